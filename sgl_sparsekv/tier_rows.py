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

from sgl_sparsekv.kernels.host_copy import copy_runs_ref
from sgl_sparsekv.kernels.select import ChunkRows, batch_ranges, every_row_fresh, union_rows
from sgl_sparsekv.residency import HotChunks

SINK = torch.iinfo(torch.int32).max   # the sink's chunk id (no chunk starts there)


class ChunkTable(NamedTuple):
    """Per list ``i`` (``list_row * H + h``), up to K chunks in the order its tokens are emitted; -1 pads."""

    # [n, K] int32: a chunk's id, its first position (stable while the request lives, where its pool row is not:
    # a compaction moves segments), SINK, or -1
    ids: torch.Tensor
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
            ids = torch.cat([torch.tensor([SINK], device=sel.device), st[keep]])
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
    bs, n, K = seq_lens.shape[0], table.ids.shape[0], table.ids.shape[1]
    dev = first.device
    if out is None:
        out = (torch.empty(n, dtype=torch.int32, device=dev), torch.empty(n * cap, dtype=torch.int32, device=dev))
    lens, windows = out
    list_rows, fresh = every_row_fresh(bs, dev) if lists_at is None else lists_at
    b = torch.nonzero(fresh[:bs]).flatten()
    hs = torch.arange(H, device=dev) if heads is None else heads.to(dev, torch.int64)
    owner = list_rows[b].to(torch.int64).repeat_interleave(len(hs))
    i = owner * H + hs.repeat(len(b))                                             # the lists written, [m]
    S = seq_lens[b].to(torch.int64).repeat_interleave(len(hs))
    # segments: each list's chunks (their rows from the hot slot) then its tail (positions, mapped to the ring)
    valid = table.ids[i] >= 0
    a, s0 = table.read_from[i].to(torch.int64), table.starts[i].to(torch.int64)
    count = torch.cat([torch.where(valid, table.read_to[i].to(torch.int64) - a, 0),
                       (S - table.tail[i].to(torch.int64))[:, None]], 1)         # [m, K + 1]
    start = torch.cat([first[i].to(torch.int64) + a - s0, table.tail[i].to(torch.int64)[:, None]], 1)
    seg = torch.arange(count.numel(), device=dev)
    n_seg = count.flatten()
    at = torch.repeat_interleave(seg, n_seg)
    within = torch.arange(at.numel(), device=dev) - (torch.cumsum(n_seg, 0) - n_seg)[at]
    val = start.flatten()[at] + within
    tail = at % (K + 1) == K
    lst = at // (K + 1)
    val = torch.where(tail, ring_base[owner[lst]] + val % ring, val)
    per_list = count.sum(1)
    j = torch.arange(at.numel(), device=dev) - (torch.cumsum(per_list, 0) - per_list)[lst]   # place in its list
    keep = j < cap
    windows[(i[lst] * cap + j)[keep]] = val[keep].to(torch.int32)
    lens[i] = per_list.clamp(max=cap).to(torch.int32)
    return lens, windows


class HotBuffers:
    """The sparse decode's device KV with the host tier: per sparse layer one buffer of ``owners`` x (hot slots +
    ring) rows, the owners being list rows that a request keeps while it decodes (``PooledDecode``). Host work
    (``take``, ``ring_job``) runs in a step's preparation; ``fill_ring`` and ``load`` in each sparse layer."""

    def __init__(self, owners: int, layers: int, heads: int, head_dim: int, dtype: torch.dtype, cfg, device):
        W = cfg.chunk_max
        self.slots, self.ring = self.shape(cfg)
        span = self.slots * W + self.ring
        self.heads, self.device = heads, device
        self.base = torch.arange(owners, dtype=torch.int64, device=device) * span
        self.ring_base = self.base + self.slots * W
        shape = (layers, owners * span, heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.hot = HotChunks(owners, layers, heads, self.slots, W, self.base)
        n = owners * heads
        self.table = ChunkTable(*(torch.full((n, self.slots), -1, dtype=torch.int32, device=device)
                                  for _ in range(5)), torch.zeros(n, dtype=torch.int32, device=device))
        self.list_owner = torch.arange(n, device=device) // heads
        self.list_head = torch.arange(n, device=device) % heads
        self.list_req_rows = torch.zeros(n, dtype=torch.int64, device=device)   # each list's request row
        self.cap = n * self.slots * W   # runs: at most one per row of every slot
        self.held = [None] * owners     # the request state whose chunks and ring an owner holds
        self.upto = [0] * owners        # its ring holds positions up to here
        self.step = 0
        self.ring_src = self.ring_dst = torch.zeros(0, dtype=torch.int64, device=device)
        self.rows_hit_loaded = torch.zeros(2, dtype=torch.int64, device=device)

    @staticmethod
    def shape(cfg) -> tuple[int, int]:
        """(hot slots, ring rows) of one owner in one layer."""
        retrieve = cfg.token_budget - cfg.sink_tokens - cfg.recent_window
        # one selection names at most retrieve / chunk_min chunks (plus a partial one and the sink); twice that
        # keeps the chunks of the steps before. A row within the budget reads its whole sequence from its ring.
        return 2 * (retrieve // cfg.chunk_min + 2), cfg.token_budget

    @classmethod
    def bytes_for(cls, cfg, owners: int, layers: int, token_bytes: int) -> int:
        """The buffers' size; ``token_bytes``: one token's K and V in one layer (all its KV heads)."""
        slots, ring = cls.shape(cfg)
        return owners * layers * (slots * cfg.chunk_max + ring) * token_bytes

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def take(self, owner: int, state, req_row: int) -> None:
        """``owner`` serves ``state`` this step: a new request finds its buffers empty."""
        if self.held[owner] is not state:
            self.held[owner], self.upto[owner] = state, 0
            self.hot.clear(owner)
        self.list_req_rows[owner * self.heads:(owner + 1) * self.heads] = req_row

    def ring_job(self, entries: list[tuple[int, int, int]], req_to_token: torch.Tensor) -> None:
        """The ring rows this step writes, for (owner, request row, length) entries: the positions each ring lacks
        (all of its last ``ring`` at an owner's first step, then the tokens decoded since), read from host at
        every sparse layer. Also starts the step."""
        self.step += 1
        self.table.ids.fill_(-1)
        req, pos, dst = [], [], []
        for owner, row, S in entries:
            lo = max(self.upto[owner], S - self.ring, 0)
            if lo < S:
                p = torch.arange(lo, S)
                req.append(torch.full_like(p, row))
                pos.append(p)
                dst.append(int(self.ring_base[owner]) + p % self.ring)
            self.upto[owner] = S
        if not pos:
            self.ring_src = self.ring_dst = torch.zeros(0, dtype=torch.int64, device=self.device)
            return
        req, pos = torch.cat(req).to(self.device), torch.cat(pos).to(self.device)
        self.ring_src = req_to_token[req, pos].long()
        self.ring_dst = torch.cat(dst).to(self.device)

    def fill_ring(self, layer: int, host_k: torch.Tensor, host_v: torch.Tensor) -> None:
        if self.ring_src.numel():
            self.k[layer, self.ring_dst] = host_k[self.ring_src]
            self.v[layer, self.ring_dst] = host_v[self.ring_src]

    def load(self, layer: int, sel, chunks, ranges, seq_lens, req_to_token, host_k, host_v, cfg, lists_at, lists,
             heads=None) -> None:
        """A sparse layer's selection into device lists (``lists``: (lens, windows), ``emit_tokens``' layout): the
        chunks its lists read that the hot buffers miss are loaded from the host pool."""
        table = hot_chunks(sel, chunks, ranges, seq_lens, cfg.sink_tokens, cfg.recent_window, self.slots,
                           dense_limit=cfg.token_budget, lists_at=lists_at, heads=heads, out=self.table)
        plan = self.hot.plan(layer, self.list_owner, self.list_head, table.ids, table.starts, table.lens,
                             req_to_token, self.step, self.cap, req_rows=self.list_req_rows)
        copy_runs_ref(host_k.transpose(0, 1), host_v.transpose(0, 1), self.k[layer].transpose(0, 1),
                      self.v[layer].transpose(0, 1), plan.runs, plan.count)
        self.rows_hit_loaded += torch.cat([plan.hit_rows, plan.miss_rows])
        lens, windows = lists
        device_lists(table, plan.first, seq_lens, self.ring_base, self.ring, self.heads, len(windows) // len(lens),
                     lists_at=lists_at, heads=heads, out=(lens, windows))
