"""Unit summaries after prefill: variable-length mean-pool + L2 norm (lychee) or min/max (quest).

    k_buffer [slots, H, d]      SGLang's per-layer key buffer
    token_slots [T] int32       KV slots of all units' tokens, unit after unit
    indptr [U + 1] int32        unit u owns token_slots[indptr[u] : indptr[u + 1]]
-> mean mode: out [U, H, d] fp32 unit vectors; minmax mode: out [U, H, 2, d] fp32 (min, max)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _pool_unit(K, Slots, start, end, h, stride_kn, stride_kh, D: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_T: tl.constexpr, MINMAX: tl.constexpr):
    """One unit's summary for one KV head: (mean as a unit vector, or min, max) over its tokens' keys."""
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    lo = tl.full([BLOCK_D], float("inf"), tl.float32)
    hi = tl.full([BLOCK_D], float("-inf"), tl.float32)
    for blk in range(start, end, BLOCK_T):
        offs_t = blk + tl.arange(0, BLOCK_T)
        valid = offs_t < end
        slot = tl.load(Slots + offs_t, mask=valid, other=0).to(tl.int64)
        m2 = valid[:, None] & dmask[None, :]
        k = tl.load(K + slot[:, None] * stride_kn + h * stride_kh + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
        if MINMAX:
            lo = tl.minimum(lo, tl.min(tl.where(m2, k, float("inf")), 0))
            hi = tl.maximum(hi, tl.max(tl.where(m2, k, float("-inf")), 0))
        else:
            acc += tl.sum(k, 0)
    if MINMAX:
        return lo, hi
    mean = acc / tl.maximum(end - start, 1).to(tl.float32)
    return mean / tl.maximum(tl.sqrt(tl.sum(mean * mean, 0)), 1e-12), hi


@triton.jit
def _pool_kernel(K, Slots, Indptr, Out, stride_kn, stride_kh, H: tl.constexpr, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, MINMAX: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    a, b = _pool_unit(K, Slots, tl.load(Indptr + u), tl.load(Indptr + u + 1), h, stride_kn, stride_kh, D, BLOCK_D,
                      BLOCK_T, MINMAX)
    if MINMAX:
        base = ((u * H + h) * 2) * D
        tl.store(Out + base + offs_d, a, mask=dmask)
        tl.store(Out + base + D + offs_d, b, mask=dmask)
    else:
        tl.store(Out + (u * H + h) * D + offs_d, a, mask=dmask)


@triton.jit
def _pool_layers_kernel(KPtrs, Slots, Indptr, Uids, Out, stride_kn, stride_kh, s_ol, s_ou, s_oh,
                        KDTYPE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                        MINMAX: tl.constexpr):
    """Program (unit, head, layer): reads layer ``l``'s key buffer through a table of base addresses and
    writes the summary straight into the unit store (Out [layers, units, H, vecs, d], its dtype)."""
    u = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    l = tl.program_id(2).to(tl.int64)
    K = tl.load(KPtrs + l).to(tl.pointer_type(KDTYPE))
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    a, b = _pool_unit(K, Slots, tl.load(Indptr + u), tl.load(Indptr + u + 1), h, stride_kn, stride_kh, D, BLOCK_D,
                      BLOCK_T, MINMAX)
    base = Out + l * s_ol + tl.load(Uids + u).to(tl.int64) * s_ou + h * s_oh
    tl.store(base + offs_d, a.to(Out.dtype.element_ty), mask=dmask)
    if MINMAX:
        tl.store(base + D + offs_d, b.to(Out.dtype.element_ty), mask=dmask)


def pool_units(k_buffer: torch.Tensor, token_slots: torch.Tensor, indptr: torch.Tensor, minmax: bool) -> torch.Tensor:
    U = indptr.numel() - 1
    _, H, D = k_buffer.shape
    shape = (U, H, 2, D) if minmax else (U, H, D)
    out = torch.empty(shape, dtype=torch.float32, device=k_buffer.device)
    if U == 0:
        return out
    _pool_kernel[(U, H)](k_buffer, token_slots, indptr, out, k_buffer.stride(0), k_buffer.stride(1), H=H, D=D,
                         BLOCK_D=triton.next_power_of_2(D), BLOCK_T=16, MINMAX=minmax)
    return out


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
       torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


def pool_units_layers(k_ptrs: torch.Tensor, k0: torch.Tensor, token_slots: torch.Tensor, indptr: torch.Tensor,
                      uids: torch.Tensor, out: torch.Tensor, minmax: bool) -> None:
    """Every layer's summaries of the same units in one launch: layer ``l`` reads the key buffer at address
    ``k_ptrs[l]`` (all laid out like ``k0``) and writes ``out[l, uids[u]]`` (the unit store, [layers, units,
    H, vecs, d] in its dtype). At decode this replaces one launch and one scatter per layer."""
    U = indptr.numel() - 1
    if U == 0:
        return
    _, H, D = k0.shape
    _pool_layers_kernel[(U, H, k_ptrs.numel())](
        k_ptrs, token_slots, indptr, uids, out, k0.stride(0), k0.stride(1), out.stride(0), out.stride(1),
        out.stride(2), KDTYPE=_TL[k0.dtype], D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_T=16, MINMAX=minmax)


def pool_units_ref(k_buffer: torch.Tensor, token_slots: torch.Tensor, indptr: torch.Tensor, minmax: bool) -> torch.Tensor:
    """Torch twin of :func:`pool_units` (and, layer by layer, of :func:`pool_units_layers`): what the CPU path runs."""
    counts = (indptr[1:] - indptr[:-1]).long()
    seg = torch.repeat_interleave(torch.arange(len(counts), device=k_buffer.device), counts)
    keys = k_buffer[token_slots.long()].float()
    U, (H, D) = len(counts), keys.shape[1:]
    if minmax:
        idx = seg[:, None, None].expand_as(keys)
        lo = torch.full((U, H, D), float("inf"), device=keys.device).scatter_reduce_(0, idx, keys, "amin")
        hi = torch.full((U, H, D), float("-inf"), device=keys.device).scatter_reduce_(0, idx, keys, "amax")
        return torch.stack([lo, hi], dim=2)
    mean = torch.zeros(U, H, D, device=keys.device).index_add_(0, seg, keys) / counts.clamp_min(1)[:, None, None]
    return F.normalize(mean, dim=-1)
