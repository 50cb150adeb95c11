"""Token lists in device rows, for the host tier's decode (docs/HOST_TIER.md, "The GPU path").

With the tier, every token's KV of a sparse layer is in the host pool, and the sparse decode reads one device buffer
per layer that holds, per owner (a request's list row, which it keeps while it decodes), its hot chunks
(``residency.HotChunks``: ``slots`` slots of ``width`` rows) and a ring of ``ring`` rows with its last tokens, which
every decode step's KV write also fills. A decode step's emission then works in two halves around
``HotChunks.plan``:

    hot_chunks(...)    -> ChunkTable: per list (owner x KV head), the chunks it reads outside the recent window,
                          the sink first (one more chunk, always selected, so it stays hot), as ``plan`` takes them:
                          ids, first positions and lengths of whole chunks (a resident chunk serves later steps whose
                          recent window has moved on), and the part of each that this step reads
    device_lists(...)  -> (lens, windows) as ``emit_tokens`` writes them, with device rows in place of KV slots: a
                          chunk's tokens at its hot slot (``plan.first`` + offset), the recent window (and the tokens
                          decoded since) at its ring rows

so the attention kernel runs unchanged on that buffer, and reads the KV that plain emission's slots name in the host
pool. A request within ``dense_limit`` tokens reads all of them from its ring (the ring is at least that long).
Torch reference: the twin a kernel will be tested against.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_sparsekv.kernels.select import ChunkRows, batch_ranges, every_row_fresh, union_rows

SINK = torch.iinfo(torch.int32).max   # the sink's chunk id (pool rows never reach it)


class ChunkTable(NamedTuple):
    """Per list ``i`` (``list_row * H + h``), up to K chunks in the order its tokens are emitted; -1 pads."""

    ids: torch.Tensor      # [n, K] int32: chunk pool row, SINK, or -1
    starts: torch.Tensor   # [n, K] int32: the chunk's first position
    lens: torch.Tensor     # [n, K] int32: its length (what a hot slot holds)
    read_from: torch.Tensor  # [n, K] int32: the positions this step reads, [read_from, read_to)
    read_to: torch.Tensor
    tail: torch.Tensor     # [n] int32: positions from here to the sequence's end are read from the ring


def hot_chunks(sel: torch.Tensor, chunks: ChunkRows, ranges: torch.Tensor, seq_lens: torch.Tensor, sink: int,
               recent: int, K: int, dense_limit: int = 0, lists_at=None, heads=None, out: ChunkTable | None = None
               ) -> ChunkTable:
    """The chunks of every written list (the lists ``emit_tokens`` would write for the same arguments)."""
    cfine, cstart, clen = chunks
    bs, H = seq_lens.shape[0], sel.shape[0]
    if out is None:
        n = bs * H
        out = ChunkTable(*(torch.full((n, K), -1, dtype=torch.int32, device=sel.device) for _ in range(5)),
                         torch.zeros(n, dtype=torch.int32, device=sel.device))
    list_rows, fresh = (t.tolist() for t in (every_row_fresh(bs, "cpu") if lists_at is None else lists_at))
    for b, (r, S) in enumerate(zip(batch_ranges(ranges, bs), seq_lens.tolist())):
        if not fresh[b]:
            continue
        k = union_rows(r, "chunk").to(sel.device)
        cf = cfine[k].long()
        cf[r.prefix.chunks:] += r.prefix.fine
        n_sink, rec = (0, 0) if S <= dense_limit else (min(sink, S), max(min(sink, S), S - recent))
        for h in (range(H) if heads is None else heads.tolist()):
            i = list_rows[b] * H + h
            for t in out[:5]:
                t[i] = -1
            out.tail[i] = rec
            if S <= dense_limit:
                continue
            take = sel[h, r.scratch_at + cf[:, h]] > 0
            st, ln = cstart[k][take].long(), clen[k][take].long()
            lo, hi = st.clamp(min=n_sink), (st + ln).clamp(max=rec)
            keep = hi > lo
            ids = torch.cat([torch.tensor([SINK], device=sel.device), k[take][keep]])
            cols = (ids, torch.cat([st.new_zeros(1), st[keep]]), torch.cat([st.new_full((1,), n_sink), ln[keep]]),
                    torch.cat([st.new_zeros(1), lo[keep]]), torch.cat([st.new_full((1,), n_sink), hi[keep]]))
            if len(ids) > K:
                raise ValueError(f"list {i} reads {len(ids)} chunks, over the {K} its hot buffer holds")
            for t, c in zip(out[:5], cols):
                t[i, :len(ids)] = c.to(torch.int32)
    return out


def device_lists(table: ChunkTable, first: torch.Tensor, seq_lens: torch.Tensor, ring_base: torch.Tensor, ring: int,
                 H: int, cap: int, lists_at=None, heads=None, out=None):
    """-> (lens [n] int32, windows [n * cap] int32), ``emit_tokens``' layout: each written list's tokens as device
    rows, chunk by chunk (``first`` [n, K]: ``plan.first``, each chunk's first hot row), then its tail: position p
    of the owner o (the list row) at ``ring_base[o] + p % ring``. ``H``: KV heads."""
    bs, n = seq_lens.shape[0], table.ids.shape[0]
    if out is None:
        out = (torch.empty(n, dtype=torch.int32, device=first.device),
               torch.empty(n * cap, dtype=torch.int32, device=first.device))
    lens, windows = out
    list_rows, fresh = (t.tolist() for t in (every_row_fresh(bs, "cpu") if lists_at is None else lists_at))
    for b, S in enumerate(seq_lens.tolist()):
        if not fresh[b]:
            continue
        for h in (range(H) if heads is None else heads.tolist()):
            i = list_rows[b] * H + h
            parts = []
            for kk in range(table.ids.shape[1]):
                if int(table.ids[i, kk]) < 0:
                    break
                a, e, s0 = int(table.read_from[i, kk]), int(table.read_to[i, kk]), int(table.starts[i, kk])
                parts.append(int(first[i, kk]) + torch.arange(a - s0, e - s0, device=first.device))
            tail = ring_base[list_rows[b]] + torch.arange(int(table.tail[i]), S, device=first.device) % ring
            lst = torch.cat([*parts, tail.to(first.device)]).to(torch.int32)[:cap]
            windows[i * cap:i * cap + len(lst)] = lst
            lens[i] = len(lst)
    return lens, windows
