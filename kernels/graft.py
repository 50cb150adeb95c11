"""Lazy grafting on the GPU: add packed decode chunks to their nearest fine cluster, in the index pools.

Twin: ``sgl_sparsekv.pool_ops.graft_chunks_ref`` (the algorithm's ``index.graft`` on views of the pool rows). One launch serves every
request's backlog of new chunks, for every sparse layer and KV head at once: program (request, layer * H + head)
grafts its request's chunks in order, each to the nearest non-empty fine cluster by inner product (first index on
ties, like ``argmax``): it moves that centroid by running mean, grows its radius by the shift and to cover the
chunk, does the same for its coarse unit, and records the chunk's cluster. A chunk sees the grafts before it.
With fine boxes (``fine_bound`` "box") the cluster's box grows to cover the chunk's key min and max.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _stored(x, dmask):
    """fp32 row -> (int8 codes, power-of-two scale, codes x scale), exactly as ``index.quantize``: IEEE divisions
    (a plain one is approximate on the GPU), and adding and taking 1.5 * 2^23 rounds to the nearest integer, ties
    to even (the Triton interpreter truncates in a plain cast)."""
    t = tl.div_rn(tl.max(tl.where(dmask, tl.abs(x), 0.0), 0), 127.0)
    bits = t.to(tl.int32, bitcast=True)
    up = ((bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)) << 23
    scale = tl.where(t > 0, up.to(tl.float32, bitcast=True), 1.0)
    codes = tl.minimum(tl.maximum((tl.div_rn(x, scale) + 12582912.0) - 12582912.0, -127.0), 127.0)
    return codes, scale, codes * scale


@triton.jit
def _stored_box(lo, hi, dmask):
    """Key bounds -> (center, half-width) in bf16 as ``index.box_from`` stores them: the center to the nearest
    value (ties to even), the half-width grown by the center's rounding and rounded up. Rounded on the bits, as
    the Triton interpreter truncates in a cast."""
    center = (lo + hi) * 0.5
    b = center.to(tl.int32, bitcast=True)
    c = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    w = tl.where(dmask, tl.abs(center - c.to(tl.float32)) + (hi - lo) * 0.5, 0.0)
    wb = (w.to(tl.int32, bitcast=True) >> 16).to(tl.int16)   # w >= 0: dropping bits rounds down
    wb = tl.where((wb.to(tl.int32) << 16).to(tl.float32, bitcast=True) < w, wb + 1, wb)
    return c, wb.to(tl.bfloat16, bitcast=True)


# strides that follow the step's job and chunk counts, and the 16-byte alignment of the job table, lengths and
# starts (slices of the step's one upload at offsets that follow its counts): specializing on either would
# compile new variants mid-serving
class GraftJob(NamedTuple):
    """One request's backlog of new chunks, a column of :func:`graft_chunks`' ``jobs``: its chunks are the key rows
    ``first_key .. first_key + chunks`` and go, in order, to consecutive chunk-pool rows from ``first_chunk_row``,
    each into the nearest fine cluster of the request's own segment (``fines`` rows from ``fine_at``, coarse units
    from ``coarse_at``)."""

    first_key: int
    chunks: int
    fine_at: int
    fines: int
    coarse_at: int
    first_chunk_row: int


def graft_payload(jobs: list[GraftJob], lengths: list[int], starts: list[int]) -> list[int]:
    """The integers of one :func:`graft_chunks` launch, ``jobs`` field by field, then each chunk's length and first
    position: one upload with the step's other integers (``graft_args`` views them on the device)."""
    return [v for field in zip(*jobs) for v in field] + list(lengths) + list(starts)


def graft_args(payload: torch.Tensor, jobs: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(jobs, lengths, starts) of :func:`graft_chunks`, as views of ``graft_payload``'s integers on the device."""
    n = len(GraftJob._fields) * jobs
    return payload[:n].view(len(GraftJob._fields), jobs), payload[n:n + chunks], payload[n + chunks:]


# the kernel's row indexes of GraftJob's fields in ``jobs``
JOB_FIRST_KEY, JOB_CHUNKS, JOB_FINE_AT, JOB_FINES, JOB_COARSE_AT, JOB_FIRST_CHUNK_ROW = (
    tl.constexpr(i) for i in range(len(GraftJob._fields)))


@triton.jit(do_not_specialize=["s_sl", "s_jf", "s_jg"], do_not_specialize_on_alignment=["Jobs", "Length", "Start"])
def _graft_kernel(Keys, Jobs, Length, Start,
                  FMu, FSc, FR, FN, FTok, FPar, CMu, CSc, CR, CN, CTok, KFine, KStart, KLen, FBox,
                  s_sl, s_su, s_sh, s_fl, s_cl, s_kl, s_jf, s_jg,
                  H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                  BOX: tl.constexpr):
    # int64 from the start: layer * stride can pass 2**31 elements for a large backlog of chunk keys
    g = tl.program_id(0).to(tl.int64)
    lh = tl.program_id(1).to(tl.int64)
    layer = lh // H
    h = lh % H
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    job = Jobs + g * s_jg
    key0 = tl.load(job + JOB_FIRST_KEY * s_jf).to(tl.int64)
    count = tl.load(job + JOB_CHUNKS * s_jf).to(tl.int32)
    fo = tl.load(job + JOB_FINE_AT * s_jf).to(tl.int64)
    L = tl.load(job + JOB_FINES * s_jf).to(tl.int32)
    co = tl.load(job + JOB_COARSE_AT * s_jf).to(tl.int64)
    row0 = tl.load(job + JOB_FIRST_CHUNK_ROW * s_jf).to(tl.int64)
    fbase = layer * s_fl          # [F, H] fields of this layer; mu rows are D wide
    for i in range(count):
        kr = key0 + i
        row = row0 + i
        length = tl.load(Length + kr).to(tl.float32)
        key = tl.load(Keys + layer * s_sl + kr * s_su + h * s_sh + offs_d, mask=dmask, other=0.0).to(tl.float32)
        if lh == 0:   # the chunk row's position and length, once per chunk
            tl.store(KStart + row, tl.load(Start + kr).to(KStart.dtype.element_ty))
            tl.store(KLen + row, tl.load(Length + kr).to(KLen.dtype.element_ty))

        best = float("-inf")
        best_i = 0
        for blk in range(0, L, BLOCK_L):
            offs_l = blk + tl.arange(0, BLOCK_L)
            lmask = offs_l < L
            node = (fo + offs_l) * H + h
            n = tl.load(FN + fbase + node, mask=lmask, other=0.0)
            mu = tl.load(FMu + (fbase + node)[:, None] * D + offs_d[None, :], mask=lmask[:, None] & dmask[None, :],
                         other=0).to(tl.float32) * tl.load(FSc + fbase + node, mask=lmask, other=0.0)[:, None]
            sim = tl.where(lmask & (n > 0), tl.sum(mu * key[None, :], 1), float("-inf"))
            m = tl.max(sim, 0)
            j = tl.argmax(sim, 0, tie_break_left=True)
            take = m > best
            best_i = tl.where(take, blk + j, best_i)
            best = tl.where(take, m, best)

        c = fbase + (fo + best_i) * H + h
        n_c = tl.load(FN + c)
        mu_c = tl.load(FMu + c * D + offs_d, mask=dmask, other=0).to(tl.float32) * tl.load(FSc + c)
        codes_c, scale_c, new_mu_c = _stored(mu_c + tl.div_rn(key - mu_c, n_c + 1), dmask)   # what the pool stores
        # an empty cluster has no member to keep covered: its old centroid does not widen the radius
        shift = tl.where(n_c > 0, tl.sqrt(tl.sum((new_mu_c - mu_c) * (new_mu_c - mu_c), 0)), 0.0)
        dist = tl.sqrt(tl.sum((key - new_mu_c) * (key - new_mu_c), 0))
        new_r_c = tl.maximum(tl.maximum(tl.load(FR + c), 0.0) + shift, dist)
        tl.store(FMu + c * D + offs_d, codes_c.to(FMu.dtype.element_ty), mask=dmask)
        tl.store(FSc + c, scale_c)
        tl.store(FR + c, new_r_c)
        tl.store(FN + c, n_c + 1)
        tl.store(FTok + c, tl.load(FTok + c) + length)
        if BOX:   # [F, H, 2, D] bf16 (center, half-width)
            kb = Keys + layer * s_sl + kr * s_su + h * s_sh + D
            lo = tl.load(kb + offs_d, mask=dmask, other=0.0).to(tl.float32)
            hi = tl.load(kb + D + offs_d, mask=dmask, other=0.0).to(tl.float32)
            bc = tl.load(FBox + c * 2 * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
            bw = tl.load(FBox + c * 2 * D + D + offs_d, mask=dmask, other=0.0).to(tl.float32)
            lo = tl.where(n_c > 0, tl.minimum(bc - bw, lo), lo)
            hi = tl.where(n_c > 0, tl.maximum(bc + bw, hi), hi)
            bc, bw = _stored_box(lo, hi, dmask)
            tl.store(FBox + c * 2 * D + offs_d, bc, mask=dmask)
            tl.store(FBox + c * 2 * D + D + offs_d, bw, mask=dmask)

        gc = layer * s_cl + (co + tl.load(FPar + c)) * H + h
        n_g = tl.load(CN + gc)
        mu_g = tl.load(CMu + gc * D + offs_d, mask=dmask, other=0).to(tl.float32) * tl.load(CSc + gc)
        codes_g, scale_g, new_mu_g = _stored(mu_g + tl.div_rn(key - mu_g, n_g + 1), dmask)
        shift_g = tl.where(n_g > 0, tl.sqrt(tl.sum((new_mu_g - mu_g) * (new_mu_g - mu_g), 0)), 0.0)
        reach = tl.sqrt(tl.sum((new_mu_c - new_mu_g) * (new_mu_c - new_mu_g), 0)) + new_r_c
        tl.store(CMu + gc * D + offs_d, codes_g.to(CMu.dtype.element_ty), mask=dmask)
        tl.store(CSc + gc, scale_g)
        tl.store(CR + gc, tl.maximum(tl.maximum(tl.load(CR + gc), 0.0) + shift_g, reach))
        tl.store(CN + gc, n_g + 1)
        tl.store(CTok + gc, tl.load(CTok + gc) + length)
        tl.store(KFine + layer * s_kl + row * H + h, best_i)
        # the next chunk's nearest-cluster scan reads these rows through other threads of the program
        tl.debug_barrier()


def graft_chunks(pools, keys: torch.Tensor, jobs: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor) -> None:
    """Graft every request's new chunks into ``pools`` (sgl_sparsekv.index_pool.IndexPools), every layer and head.

    keys: [layers, J, H, vecs, d] chunk keys (``SparseKVManager.chunk_keys``: the unit key, then with fine boxes
    the keys' min and max); lengths/starts: [J] each chunk's token
    count and first position. jobs: [len(GraftJob._fields), requests] integers, a ``GraftJob`` per request. All on
    the pools' device, so nothing here waits for the GPU.
    """
    G = jobs.shape[1]
    if G == 0:
        return
    Ls, F, H, D = pools.fine_mu.shape
    _graft_kernel[(G, Ls * H)](
        keys, jobs, lengths, starts,
        pools.fine_mu, pools.fine_scale, pools.fine_r, pools.fine_n, pools.fine_tokens, pools.fine_parent,
        pools.coarse_mu, pools.coarse_scale, pools.coarse_r, pools.coarse_n, pools.coarse_tokens,
        pools.chunk_fine, pools.chunk_start, pools.chunk_len, pools.fine_box,
        keys.stride(0), keys.stride(1), keys.stride(2),
        pools.fine_r.stride(0), pools.coarse_r.stride(0), pools.chunk_fine.stride(0), jobs.stride(0), jobs.stride(1),
        H=H, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_L=64, BOX=pools.box)


def precompile_graft(pools, key_dtype: torch.dtype) -> None:
    """Compile the graft kernel for ``pools`` now: one launch of one job of no chunks, which writes nothing. Grafts
    run outside the CUDA graph, so its first compile (about a second) would otherwise stall the whole decode batch
    of the first request that grafts. The variant is the one serving uses (see the kernel's specializations)."""
    Ls, _, H, D = pools.fine_mu.shape
    if Ls == 0:
        return
    payload = torch.tensor(graft_payload([GraftJob(0, 0, 0, 0, 0, 0)], [0], [0]), device=pools.fine_mu.device)
    keys = torch.zeros(Ls, 1, H, pools.key_vecs, D, dtype=key_dtype, device=pools.fine_mu.device)
    graft_chunks(pools, keys, *graft_args(payload, 1, 1))
