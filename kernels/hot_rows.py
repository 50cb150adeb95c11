"""The host tier's token lists as rows of the decode's own device buffer (``sgl_sparsekv/tier_rows.py``), in three
kernels that read only device state, so a captured decode graph runs them beside the selection:

    hot_chunks     (sel, chunk pool, ranges, ...) -> ChunkTable: per written list (list row x KV head), the chunks it
                   reads outside the recent window, the sink first (one more chunk, always selected, so it stays
                   hot): ids (first positions), first positions and lengths of whole chunks (what a hot slot holds),
                   and the part of each this step reads, in the order ``emit_tokens`` writes them. One program per
                   list; a list over ``K`` chunks keeps its first ``K`` and counts the rest in ``dropped``
    device_lists   (ChunkTable, plan.first, ...) -> (lens, windows) in ``emit_tokens``' layout, with device rows in
                   place of KV slots: a chunk's tokens at its hot slot (``first`` + offset), its tail (the recent
                   window and the tokens decoded since) at the owner's ring rows, position p at
                   ``ring_base[owner] + p % ring``
    fill_ring      per batch row, positions [ring_from, seq) of its request from the host pool into its owner's
                   ring: all of its last ``ring`` tokens when a request takes an owner, then the token decoded

Each has a torch twin here (``*_ref``) that the tests hold it to, and that the CPU engine runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_sparsekv.kernels.select import (_chunk_ranges, _emit_request, _program_head, _union_rows, all_heads,
                                         batch_ranges, union_rows)

SINK = torch.iinfo(torch.int32).max   # the sink's chunk id (no chunk starts there)
_SINK = tl.constexpr(SINK)
CHUNK_BLOCK = 128   # chunks per tile of hot_chunks' scan
RING_BLOCK = 16     # positions per program of fill_ring


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

    @classmethod
    def empty(cls, n: int, K: int, device) -> "ChunkTable":
        return cls(*(torch.full((n, K), -1, dtype=torch.int32, device=device) for _ in range(5)),
                   torch.zeros(n, dtype=torch.int32, device=device))


@triton.jit
def _hot_chunks_kernel(Sel, stride_sel, CFine, CStart, CLen, T, st, SeqLen, Fresh, ListRows, Heads, R, Ids, Starts,
                       Lens, From, To, Tail, Dropped, dense_limit, sink, recent, H: tl.constexpr, K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b, h, M, S, n_sink, rec_start, fresh = _emit_request(T, st, SeqLen, Fresh, pid, Heads, R, dense_limit, sink,
                                                         recent)
    if fresh:
        lst = tl.load(ListRows + b).to(tl.int64) * H + h
        row = lst * K
        dense = S <= dense_limit   # within the budget: no chunk, the ring holds the whole sequence
        sparse = S > dense_limit
        tl.store(Ids + row, _SINK, mask=sparse)
        tl.store(Starts + row, 0, mask=sparse)
        tl.store(Lens + row, n_sink, mask=sparse)
        tl.store(From + row, 0, mask=sparse)
        tl.store(To + row, n_sink, mask=sparse)
        n = tl.where(dense, 0, 1)
        ko0, M0, ko1, L0, so = _chunk_ranges(T, st, b)
        for blk in range(0, M, BLOCK_M):
            offs = blk + tl.arange(0, BLOCK_M)
            mm = offs < M
            krow = _union_rows(offs, ko0, M0, ko1)
            cf = tl.load(CFine + krow * H + h, mask=mm, other=0) + tl.where(offs < M0, 0, L0)
            take = (tl.load(Sel + h * stride_sel + so + cf, mask=mm, other=0.0) > 0) & mm
            pos = tl.load(CStart + krow, mask=mm, other=0)
            ln = tl.load(CLen + krow, mask=mm, other=0)
            lo = tl.maximum(pos, n_sink)
            hi = tl.minimum(pos + ln, rec_start)
            keep = (take & (hi > lo)).to(tl.int32)
            dst = n + tl.cumsum(keep, 0) - keep
            m = (keep != 0) & (dst < K)
            tl.store(Ids + row + dst, pos, mask=m)
            tl.store(Starts + row + dst, pos, mask=m)
            tl.store(Lens + row + dst, ln, mask=m)
            tl.store(From + row + dst, lo, mask=m)
            tl.store(To + row + dst, hi, mask=m)
            n += tl.sum(keep, 0)
        for k0 in range(0, K, BLOCK_K):   # padding past the list's chunks (no entry is stored twice)
            offs = k0 + tl.arange(0, BLOCK_K)
            m = (offs >= n) & (offs < K)
            tl.store(Ids + row + offs, -1, mask=m)
            tl.store(Starts + row + offs, -1, mask=m)
            tl.store(Lens + row + offs, -1, mask=m)
            tl.store(From + row + offs, -1, mask=m)
            tl.store(To + row + offs, -1, mask=m)
        tl.store(Tail + lst, tl.where(dense, 0, rec_start))
        tl.atomic_add(Dropped, (n - K).to(tl.int64), mask=n > K)


def hot_chunks(sel, chunks, ranges, seq_lens, sink: int, recent: int, dense_limit: int, lists_at, out: ChunkTable,
               dropped: torch.Tensor, heads: torch.Tensor | None = None) -> ChunkTable:
    """The chunks of every written list (the lists ``emit_tokens`` would write for the same arguments) into ``out``
    (rows of lists not written keep what they held); ``dropped`` [1] int64 counts chunks past a list's ``K``."""
    cfine, cstart, clen = chunks
    bs, H, K = seq_lens.shape[0], sel.shape[0], out.ids.shape[1]
    heads = all_heads(H, sel.device) if heads is None else heads
    R = heads.numel()
    list_rows, fresh = lists_at
    if bs * R:
        _hot_chunks_kernel[(bs * R,)](sel, sel.stride(0), cfine, cstart, clen, ranges, ranges.stride(0), seq_lens,
                                      fresh, list_rows, heads, R, *out, dropped, dense_limit, sink, recent, H=H, K=K,
                                      BLOCK_M=CHUNK_BLOCK, BLOCK_K=triton.next_power_of_2(K))
    return out


def hot_chunks_ref(sel, chunks, ranges, seq_lens, sink: int, recent: int, dense_limit: int, lists_at,
                   out: ChunkTable, dropped: torch.Tensor, heads: torch.Tensor | None = None) -> ChunkTable:
    """Torch twin of :func:`hot_chunks`: per request, every head's list at once."""
    cfine, cstart, clen = chunks
    bs, H, K = seq_lens.shape[0], sel.shape[0], out.ids.shape[1]
    dev = sel.device
    hs = torch.arange(H, device=dev) if heads is None else heads.to(dev, torch.int64)
    list_rows, fresh = (t.tolist() for t in lists_at)
    for b, (r, S) in enumerate(zip(batch_ranges(ranges, bs), seq_lens.tolist())):
        if not fresh[b]:
            continue
        i = list_rows[b] * H + hs                                                     # the lists written
        n_sink, rec = (0, 0) if S <= dense_limit else (min(sink, S), max(min(sink, S), S - recent))
        for t in out[:5]:
            t[i] = -1
        out.tail[i] = rec
        if S <= dense_limit:
            continue
        k = union_rows(r, "chunk").to(dev)
        cf = cfine[k].long()
        cf[r.prefix.chunks:] += r.prefix.fine
        take = sel[hs[:, None], r.scratch_at + cf[:, hs].T] > 0                      # [heads, chunks]
        st, ln = cstart[k].long(), clen[k].long()
        lo, hi = st.clamp(min=n_sink), (st + ln).clamp(max=rec)
        keep = take & (hi > lo)[None, :]
        col = keep.long().cumsum(1)   # a kept chunk's entry: after the sink's and the kept chunks before it
        dropped += (1 + keep.sum(1) - K).clamp(min=0).sum()
        for t, v in zip(out[:5], (SINK, 0, n_sink, 0, n_sink)):
            t[i, 0] = v
        m = keep & (col < K)
        at = (i[:, None].expand_as(keep)[m], col[m])
        for t, v in zip(out[:5], (st, st, ln, lo, hi)):
            t[at] = v[None, :].expand_as(keep)[m].to(torch.int32)
    return out


@triton.jit
def _device_lists_kernel(Ids, Starts, From, To, Tail, First, SeqLen, Fresh, ListRows, Heads, R, RingBase, Lens, Out,
                         ring, H: tl.constexpr, K: tl.constexpr, CAP: tl.constexpr, BLOCK_K: tl.constexpr,
                         MAXLEN: tl.constexpr, BLOCK_T: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b, h = _program_head(pid, Heads, R)
    if tl.load(Fresh + b) != 0:
        owner = tl.load(ListRows + b).to(tl.int64)
        i = owner * H + h
        S = tl.load(SeqLen + b)
        k = tl.arange(0, BLOCK_K)
        e = i * K + k
        valid = (tl.load(Ids + e, mask=k < K, other=-1) >= 0) & (k < K)
        a = tl.load(From + e, mask=valid, other=0)
        cnt = tl.where(valid, tl.load(To + e, mask=valid, other=0) - a, 0)
        first = tl.load(First + e, mask=valid, other=0).to(tl.int64) + (a - tl.load(Starts + e, mask=valid, other=0))
        dst = tl.cumsum(cnt, 0) - cnt
        j = tl.arange(0, MAXLEN)
        m2 = (j[None, :] < cnt[:, None]) & ((dst[:, None] + j[None, :]) < CAP)
        base = i * CAP
        tl.store(Out + base + dst[:, None] + j[None, :], (first[:, None] + j[None, :]).to(tl.int32), mask=m2)
        n = tl.sum(cnt, 0)
        tail = tl.load(Tail + i)
        ring_at = tl.load(RingBase + owner)
        for t in range(tail, S, BLOCK_T):
            pos = t + tl.arange(0, BLOCK_T)
            d = n + pos - tail
            m = (pos < S) & (d < CAP)
            tl.store(Out + base + d, (ring_at + pos % ring).to(tl.int32), mask=m)
        tl.store(Lens + i, tl.minimum(n + S - tail, CAP))


def device_lists(table: ChunkTable, first: torch.Tensor, seq_lens: torch.Tensor, ring_base: torch.Tensor, ring: int,
                 lists_at, out, max_chunk: int, heads: torch.Tensor | None = None):
    """-> ``out`` = (lens [n] int32, windows [n * cap] int32), ``emit_tokens``' layout, for the lists ``lists_at``
    writes: each one's tokens as device rows, chunk by chunk (``first`` [n, K]: ``plan.first``, each chunk's first
    hot row), then its tail at the owner's (the list row's) ring rows."""
    lens, windows = out
    n, K = table.ids.shape
    H = n // ring_base.shape[0]
    bs = seq_lens.shape[0]
    heads = all_heads(H, seq_lens.device) if heads is None else heads
    R = heads.numel()
    if bs * R:
        _device_lists_kernel[(bs * R,)](table.ids, table.starts, table.read_from, table.read_to, table.tail, first,
                                        seq_lens, lists_at[1], lists_at[0], heads, R, ring_base, lens, windows, ring,
                                        H=H, K=K, CAP=windows.numel() // lens.numel(),
                                        BLOCK_K=triton.next_power_of_2(K),
                                        MAXLEN=triton.next_power_of_2(max_chunk), BLOCK_T=64)
    return lens, windows


def device_lists_ref(table: ChunkTable, first: torch.Tensor, seq_lens: torch.Tensor, ring_base: torch.Tensor,
                     ring: int, lists_at, out, max_chunk: int, heads: torch.Tensor | None = None):
    """Torch twin of :func:`device_lists`."""
    lens, windows = out
    n, K = table.ids.shape
    H, cap = n // ring_base.shape[0], windows.numel() // lens.numel()
    bs = seq_lens.shape[0]
    dev = first.device
    list_rows, fresh = lists_at
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


@triton.jit
def _fill_ring_kernel(SrcK, SrcV, DstK, DstV, Rows, SeqLen, ListRows, RingFrom, RingBase, ReqToToken, stride_rt,
                      s_row, d_row, ring, HD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_HD: tl.constexpr):
    b = tl.program_id(0)
    S = tl.load(SeqLen + b)
    lo = tl.load(RingFrom + b) + tl.program_id(1) * BLOCK_P
    if lo < S:
        p = lo + tl.arange(0, BLOCK_P)
        m = p < S
        slot = tl.load(ReqToToken + tl.load(Rows + b).to(tl.int64) * stride_rt + p, mask=m, other=0).to(tl.int64)
        dst = tl.load(RingBase + tl.load(ListRows + b).to(tl.int64)) + (p % ring).to(tl.int64)
        e = tl.arange(0, BLOCK_HD)
        m2 = m[:, None] & (e < HD)[None, :]
        src = slot[:, None] * s_row + e[None, :]
        d = dst[:, None] * d_row + e[None, :]
        tl.store(DstK + d, tl.load(SrcK + src, mask=m2), mask=m2)
        tl.store(DstV + d, tl.load(SrcV + src, mask=m2), mask=m2)


def fill_ring(src_k, src_v, dst_k, dst_v, rows, seq_lens, list_rows, ring_from, ring_base, req_to_token,
              ring: int) -> None:
    """Batch row b's positions [ring_from[b], seq_lens[b]) (at most ``ring`` of them) of request row ``rows[b]``:
    from ``src`` [slots, H, D] (the host pool, by KV slot) into ``dst`` [rows, H, D] at the ring rows of its owner
    ``list_rows[b]``. Each token's heads are contiguous in both."""
    assert src_k.stride() == src_v.stride() and dst_k.stride() == dst_v.stride()
    assert src_k.stride(1) == dst_k.stride(1) == src_k.shape[2] and src_k.stride(2) == 1 == dst_k.stride(2)
    bs = rows.shape[0]
    HD = src_k.shape[1] * src_k.shape[2]
    if bs:
        _fill_ring_kernel[(bs, triton.cdiv(ring, RING_BLOCK))](
            src_k, src_v, dst_k, dst_v, rows, seq_lens, list_rows, ring_from, ring_base, req_to_token,
            req_to_token.stride(0), src_k.stride(0), dst_k.stride(0), ring, HD=HD, BLOCK_P=RING_BLOCK,
            BLOCK_HD=triton.next_power_of_2(HD))


def fill_ring_ref(src_k, src_v, dst_k, dst_v, rows, seq_lens, list_rows, ring_from, ring_base, req_to_token,
                  ring: int) -> None:
    """Torch twin of :func:`fill_ring`: every row's positions in one gather."""
    lo, S = ring_from.to(torch.int64), seq_lens.to(torch.int64)
    n = (S - lo).clamp(min=0)
    b = torch.repeat_interleave(torch.arange(len(n), device=n.device), n)
    p = torch.arange(b.numel(), device=n.device) - (torch.cumsum(n, 0) - n)[b] + lo[b]
    slots = req_to_token[rows.to(torch.int64)[b], p].long().to(src_k.device)
    at = (ring_base[list_rows.to(torch.int64)[b]] + p % ring).to(dst_k.device)
    dst_k[at] = src_k[slots].to(dst_k.device)
    dst_v[at] = src_v[slots].to(dst_v.device)
