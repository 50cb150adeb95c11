"""The host tier's residency plan (``sgl_sparsekv.residency.HotChunks.plan``, its torch twin) in one launch.

Per list ``i`` (one program): the chunks ``sel[i]`` names are compared with the ``S`` slots of its (owner, layer,
KV head) buffer; a chunk already there keeps its slot, and the misses take, in the order they come, the slots the
step does not hit in least-recently-used order (ties by slot). The program stamps every slot it uses with the step,
records the new chunks, writes each chunk's first device row (``first``), and cuts each miss's rows into runs of
consecutive host rows (``req_to_token``), which it appends to ``runs`` at places it reserves with an atomic add:
runs come in no fixed order (each names its own rows, so ``copy_runs`` does not care). A list with no chunk (one
that does not select this step) returns at once, so a captured step pays little for the lists it does not write.

The slots' ranks need every slot's key beside every other's: a program writes its keys to its own row of
``scratch`` and reads them back in tiles of ``RANK_TILE``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RANK_TILE = 32
_LAST = tl.constexpr(torch.iinfo(torch.int64).max)


@triton.jit
def _plan_kernel(Sel, Starts, Lens, Rows, Heads, ReqRows, Chunk, Used, Base, ReqToToken, stride_rt, Step, First,
                 Runs, Needed, HitMiss, Scratch, layer, layers, heads, cap, S: tl.constexpr, K: tl.constexpr,
                 W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                 TILE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    if tl.load(Sel + i * K) < 0:   # no chunk: this list is not written this step
        for k0 in range(0, K, BLOCK_K):
            tl.store(First + i * K + k0 + ks, -1, mask=k0 + ks < K)
    else:
        r = tl.load(Rows + i).to(tl.int64)
        h = tl.load(Heads + i).to(tl.int64)
        kv_row = tl.load(ReqRows + i).to(tl.int64)
        at = ((r * layers + layer) * heads + h) * S
        s = tl.arange(0, BLOCK_S)
        sm = s < S
        resident = tl.load(Chunk + at + s, mask=sm, other=-2)
        used = tl.load(Used + at + s, mask=sm, other=_LAST)
        step = tl.load(Step)
        # the slots this step hits
        hit_any = tl.zeros([BLOCK_S], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            c = tl.load(Sel + i * K + k0 + ks, mask=k0 + ks < K, other=-1)
            eq = (c[:, None] == resident[None, :]) & (c >= 0)[:, None]
            hit_any = tl.maximum(hit_any, tl.max(eq.to(tl.int32), 0))
        # each slot's rank among the slots a miss may take: least recently used first, then by slot; a hit slot (and
        # one past S) last
        key = tl.where((hit_any > 0) | ~sm, _LAST, used)
        tl.store(Scratch + i * BLOCK_S + s, key)
        tl.debug_barrier()
        rank = tl.zeros([BLOCK_S], dtype=tl.int32)
        for t0 in range(0, BLOCK_S, TILE):
            t = t0 + tl.arange(0, TILE)
            other = tl.load(Scratch + i * BLOCK_S + t)
            before = (other[None, :] < key[:, None]) | ((other[None, :] == key[:, None]) & (t[None, :] < s[:, None]))
            rank += tl.sum(before.to(tl.int32), 1)
        base = tl.load(Base + r)
        w = tl.arange(0, BLOCK_W)
        misses = 0
        hit_rows = 0
        miss_rows = 0
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            c = tl.load(Sel + i * K + kk, mask=kk < K, other=-1)
            valid = c >= 0
            eq = (c[:, None] == resident[None, :]) & valid[:, None]
            hit = tl.max(eq.to(tl.int32), 1) > 0
            miss = valid & ~hit
            nth = misses + tl.cumsum(miss.to(tl.int32), 0) - 1   # this miss's place among the list's misses
            misses += tl.sum(miss.to(tl.int32), 0)
            hit_slot = tl.sum(tl.where(eq, s[None, :], 0), 1)
            victim = tl.sum(tl.where(rank[None, :] == nth[:, None], s[None, :], 0), 1)
            slot = tl.where(hit, hit_slot, victim)
            tl.store(Used + at + slot, step, mask=valid)
            tl.store(Chunk + at + slot, c, mask=miss)
            first = base + slot.to(tl.int64) * W
            tl.store(First + i * K + kk, tl.where(valid, first, -1).to(tl.int32), mask=kk < K)
            n = tl.load(Lens + i * K + kk, mask=valid, other=0).to(tl.int32)
            hit_rows += tl.sum(tl.where(hit, n, 0), 0)
            miss_rows += tl.sum(tl.where(miss, n, 0), 0)
            # the misses' rows: a run starts at a chunk's first row and wherever its host rows stop being consecutive
            pos = tl.load(Starts + i * K + kk, mask=miss, other=0)[:, None] + w[None, :]
            inside = miss[:, None] & (w[None, :] < n[:, None])
            host = tl.load(ReqToToken + kv_row * stride_rt + pos, mask=inside, other=0)
            prev = tl.load(ReqToToken + kv_row * stride_rt + pos - 1, mask=inside & (w[None, :] > 0), other=-2)
            begins = inside & ((w[None, :] == 0) | (host != prev + 1))
            # a run ends at the next begin of its chunk, or at the chunk's end
            later = begins[:, None, :] & (w[None, None, :] > w[None, :, None])
            ends = tl.min(tl.where(later, w[None, None, :], BLOCK_W), 2)
            length = tl.minimum(ends, n[:, None]) - w[None, :]
            count = begins.to(tl.int32)
            per_chunk = tl.sum(count, 1)
            place = tl.atomic_add(Needed, tl.sum(per_chunk, 0)) + (tl.cumsum(per_chunk, 0) - per_chunk)[:, None] \
                + tl.cumsum(count, 1) - count
            put = begins & (place < cap)
            row = Runs + place.to(tl.int64) * 4
            tl.store(row, h.to(tl.int32), mask=put)
            tl.store(row + 1, host, mask=put)
            tl.store(row + 2, (first[:, None] + w[None, :]).to(tl.int32), mask=put)
            tl.store(row + 3, length.to(tl.int32), mask=put)
        tl.atomic_add(HitMiss, hit_rows.to(tl.int64))
        tl.atomic_add(HitMiss + 1, miss_rows.to(tl.int64))


def plan_slots(chunk: torch.Tensor, used: torch.Tensor, base: torch.Tensor, layer: int, rows: torch.Tensor,
               heads: torch.Tensor, req_rows: torch.Tensor, sel: torch.Tensor, starts: torch.Tensor,
               lens: torch.Tensor, req_to_token: torch.Tensor, step: torch.Tensor, width: int, cap: int):
    """One sparse layer's plan (module docstring) over the buffers ``chunk`` / ``used`` [owners, layers, heads,
    slots], updated in place; list ``i`` is owner ``rows[i]``'s KV head ``heads[i]``, whose rows in
    ``req_to_token`` are ``req_rows[i]``; ``step`` [1] int64. -> (first [n, K] int32, runs [cap, 4] int32,
    needed [1] int32: runs the misses make, of which the first ``cap`` are written, hit and miss rows [2] int64)."""
    n, K = sel.shape
    _, layers, H, S = chunk.shape
    dev = sel.device
    first = torch.empty(n, K, dtype=torch.int32, device=dev)
    runs = torch.empty(cap, 4, dtype=torch.int32, device=dev)
    needed = torch.zeros(1, dtype=torch.int32, device=dev)
    hit_miss = torch.zeros(2, dtype=torch.int64, device=dev)
    BLOCK_S = max(triton.next_power_of_2(S), RANK_TILE)
    scratch = torch.empty(n, BLOCK_S, dtype=torch.int64, device=dev)
    if n:
        _plan_kernel[(n,)](sel, starts, lens, rows, heads, req_rows, chunk, used, base, req_to_token,
                           req_to_token.stride(0), step, first, runs, needed, hit_miss, scratch, layer, layers, H,
                           cap, S=S, K=K, W=width, BLOCK_S=BLOCK_S, BLOCK_K=16,
                           BLOCK_W=triton.next_power_of_2(width), TILE=RANK_TILE, num_warps=8)
    return first, runs, needed, hit_miss
