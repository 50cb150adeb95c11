"""Decode attention over a per-KV-head token selection (torch reference; Triton twin in kernels/)."""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def dense_decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """One request, all tokens; the same ops as SGLang's torch_native decode so results match it bit for bit.

    q: [Hq, d]; slots: [S] KV slots of the request's tokens -> [Hq, d]
    """
    k = k_buffer[slots].movedim(0, 1)
    v = v_buffer[slots].movedim(0, 1)
    if not (q.dtype == k.dtype == v.dtype):
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = scaled_dot_product_attention(q[:, None].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                       scale=scale, enable_gqa=q.shape[0] != k.shape[0])
    return out[0, :, 0]


def sparse_decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
                  mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One request, each KV head over its own selected tokens.

    q: [Hq, d]; slots: [S] KV slots by position; mask: [H, S] bool, True = attend -> [Hq, d]
    """
    H = mask.shape[0]
    group = q.shape[0] // H
    pos = torch.nonzero(mask.any(0)).flatten()           # union over heads
    k = k_buffer[slots[pos]].movedim(0, 1)               # [H, U, d]
    v = v_buffer[slots[pos]].movedim(0, 1)
    if not (q.dtype == k.dtype == v.dtype):
        k, v = k.to(q.dtype), v.to(q.dtype)
    m = mask[:, pos].repeat_interleave(group, dim=0)[:, None, :]  # [Hq, 1, U]
    out = scaled_dot_product_attention(q[:, None].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                       attn_mask=m.unsqueeze(0), scale=scale, enable_gqa=group > 1)
    return out[0, :, 0]
