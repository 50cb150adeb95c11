"""Lazy grafting on the GPU: add packed decode chunks to their nearest fine cluster, in the index pools.

Twin: :func:`graft_chunks_ref` (``sgl_sparsekv.index.graft`` on views of the pool rows). One launch serves a list of jobs
(one new chunk of one request each) for every sparse layer and KV head at once: program
(job, layer * H + head) finds the nearest non-empty fine cluster of that request by inner product
(first index on ties, like ``argmax``), moves its centroid by running mean, grows its radius by the
shift and to cover the chunk, does the same for its coarse unit, and records the chunk's cluster.
Jobs in one launch must belong to different requests (the caller runs a request's backlog in rounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_sparsekv.index import graft


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), as fp32: the stored centroid. In integer ops, because the
    Triton interpreter truncates in a plain cast."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _graft_kernel(Keys, KeyRow, Length, Fo, Ln, Co, Row, Start,
                  FMu, FR, FN, FTok, FPar, CMu, CR, CN, CTok, KFine, KStart, KLen,
                  s_sl, s_su, s_sh, s_fl, s_cl, s_kl,
                  H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    # int64 from the start: layer * stride can pass 2**31 elements for a large backlog of chunk keys
    job = tl.program_id(0).to(tl.int64)
    lh = tl.program_id(1).to(tl.int64)
    layer = lh // H
    h = lh % H
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    kr = tl.load(KeyRow + job).to(tl.int64)
    length = tl.load(Length + job).to(tl.float32)
    fo = tl.load(Fo + job).to(tl.int64)
    L = tl.load(Ln + job)
    co = tl.load(Co + job).to(tl.int64)
    row = tl.load(Row + job).to(tl.int64)
    key = tl.load(Keys + layer * s_sl + kr * s_su + h * s_sh + offs_d, mask=dmask, other=0.0).to(tl.float32)
    if lh == 0:   # the chunk row's position and length, once per job
        tl.store(KStart + row, tl.load(Start + job))
        tl.store(KLen + row, tl.load(Length + job))

    fbase = layer * s_fl          # [F, H] fields of this layer; mu rows are D wide
    best = float("-inf")
    best_i = 0
    for blk in range(0, L, BLOCK_L):
        offs_l = blk + tl.arange(0, BLOCK_L)
        lmask = offs_l < L
        node = (fo + offs_l) * H + h
        n = tl.load(FN + fbase + node, mask=lmask, other=0.0)
        mu = tl.load(FMu + (fbase + node)[:, None] * D + offs_d[None, :], mask=lmask[:, None] & dmask[None, :],
                     other=0.0).to(tl.float32)
        sim = tl.where(lmask & (n > 0), tl.sum(mu * key[None, :], 1), float("-inf"))
        m = tl.max(sim, 0)
        i = tl.argmax(sim, 0, tie_break_left=True)
        take = m > best
        best_i = tl.where(take, blk + i, best_i)
        best = tl.where(take, m, best)

    c = fbase + (fo + best_i) * H + h
    n_c = tl.load(FN + c)
    mu_c = tl.load(FMu + c * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
    new_mu_c = _round_bf16(mu_c + (key - mu_c) / (n_c + 1))   # what the pool stores
    shift = tl.sqrt(tl.sum((new_mu_c - mu_c) * (new_mu_c - mu_c), 0))
    dist = tl.sqrt(tl.sum((key - new_mu_c) * (key - new_mu_c), 0))
    new_r_c = tl.maximum(tl.maximum(tl.load(FR + c), 0.0) + shift, dist)
    tl.store(FMu + c * D + offs_d, new_mu_c.to(FMu.dtype.element_ty), mask=dmask)
    tl.store(FR + c, new_r_c)
    tl.store(FN + c, n_c + 1)
    tl.store(FTok + c, tl.load(FTok + c) + length)

    g = layer * s_cl + (co + tl.load(FPar + c)) * H + h
    n_g = tl.load(CN + g)
    mu_g = tl.load(CMu + g * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
    new_mu_g = _round_bf16(mu_g + (key - mu_g) / (n_g + 1))
    shift_g = tl.sqrt(tl.sum((new_mu_g - mu_g) * (new_mu_g - mu_g), 0))
    reach = tl.sqrt(tl.sum((new_mu_c - new_mu_g) * (new_mu_c - new_mu_g), 0)) + new_r_c
    tl.store(CMu + g * D + offs_d, new_mu_g.to(CMu.dtype.element_ty), mask=dmask)
    tl.store(CR + g, tl.maximum(tl.maximum(tl.load(CR + g), 0.0) + shift_g, reach))
    tl.store(CN + g, n_g + 1)
    tl.store(CTok + g, tl.load(CTok + g) + length)
    tl.store(KFine + layer * s_kl + row * H + h, best_i)


def graft_chunks(pools, keys: torch.Tensor, key_rows, lengths, fo, ln, co, rows, starts) -> None:
    """Graft one chunk per job into ``pools`` (sgl_sparsekv.index_pool.IndexPools), every layer and head.

    keys: [layers, U, H, 1, d] chunk keys (``SparseKVManager.chunk_keys``); key_rows/lengths/starts: each chunk's
    row of ``keys``, token count and first position; fo/ln/co: each job's request ranges (fine offset and count, coarse
    offset); rows: the chunk-pool row each chunk is recorded at. All int32 [jobs] tensors on the pools'
    device, so nothing here waits for the GPU.
    """
    n = key_rows.shape[0]
    if n == 0:
        return
    Ls, F, H, D = pools.fmu.shape
    _graft_kernel[(n, Ls * H)](
        keys, key_rows, lengths, fo, ln, co, rows, starts,
        pools.fmu, pools.fr, pools.fn, pools.ftok, pools.fpar, pools.cmu, pools.cr, pools.cn, pools.ctok,
        pools.kfine, pools.kstart, pools.klen, keys.stride(0), keys.stride(1), keys.stride(2),
        pools.fr.stride(0), pools.cr.stride(0), pools.kfine.stride(0),
        H=H, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_L=64)


def graft_chunks_ref(pools, keys: torch.Tensor, key_rows, lengths, fo, ln, co, rows, starts) -> None:
    """Torch twin of :func:`graft_chunks`: ``index.graft`` on [layers, heads] views of each job's rows."""
    pools.kstart[rows.long()] = starts
    pools.klen[rows.long()] = lengths
    for kr, length, f0, L, c0, row in zip(*(t.tolist() for t in (key_rows, lengths, fo, ln, co, rows))):
        view = pools.view(c0, f0, L)
        pools.kfine[:, row] = graft(view, keys[:, kr, :, 0].float(), float(length))
