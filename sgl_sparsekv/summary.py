"""Unit summaries from the KV pool's keys: L2-normalized mean (lychee chunks) or per-dim min and max (quest pages).

    k_buffer [slots, H, d]      a layer's key buffer
    token_slots [T]             KV slots of all units' tokens, unit after unit
    indptr [U + 1]              unit u owns token_slots[indptr[u] : indptr[u + 1]]
-> mean: [U, H, d] fp32 unit vectors; minmax: [U, H, 2, d] fp32

This is the reference; kernels/pool.py is its Triton twin, used on the GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def summarize_units(k_buffer: torch.Tensor, token_slots: torch.Tensor, indptr: torch.Tensor, minmax: bool) -> torch.Tensor:
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
