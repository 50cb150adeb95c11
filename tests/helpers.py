"""Helpers that several test modules share."""

import contextlib

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_sparsekv.index import ClusterIndex, graft


def graft_chunk(index: ClusterIndex, key: torch.Tensor, length: int, box: torch.Tensor | None = None) -> None:
    """``index.graft`` one chunk into one layer's index [H, ...] and record its cluster."""
    c = graft(index, key, length, box)
    index.chunk_fine = torch.cat([index.chunk_fine, c[:, None]], dim=1)


@contextlib.contextmanager
def sync_check(mode="error"):
    """CUDA's sync debug mode inside the block: "error" raises at any call that makes the host wait for the GPU,
    "warn" warns, 0 checks nothing (a step's host work must never wait)."""
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def sparse_decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
                  mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention for one request, each KV head over its own selected tokens (the spec the pooled path is
    checked against).

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


def kept_mass_spec(q: torch.Tensor, k_buffer: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> float:
    """The share of dense attention's mass on the masked tokens, averaged over query heads (the recall audit's
    spec), in float64, head by head. q: [Hq, d]; slots: [S] KV slots by position; mask: [H, S] bool."""
    H = mask.shape[0]
    group = q.shape[0] // H
    kept = []
    for qh in range(q.shape[0]):
        h = qh // group
        p = torch.softmax(k_buffer[slots.long(), h].double() @ q[qh].double() * scale, dim=0)
        kept.append(float(p[mask[h]].sum()))
    return sum(kept) / len(kept)
