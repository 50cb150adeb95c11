"""Upper bounds of index nodes for a batch: UB = q.mu + |q| r, reduced over each GQA group.

    q [bs, Hq, d]; mu [bs, H, N, d]; r [bs, H, N]; n_nodes [bs] int32 (nodes past it are padding)
-> ub [bs, H, N] fp32, -inf on padding and on empty nodes (r = -inf)

Serves both index levels (coarse units, fine clusters) and every request of the batch in one
launch; no host synchronization. ``reduce="mean"`` scores the group's mean query instead of the
maximum over its heads (pass it through :func:`group_mean`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_sparsekv.kernels.sparse_decode import group_block


@triton.jit
def _bounds_kernel(Q, Mu, R, NNodes, UB, stride_qb, stride_qh, stride_mb, stride_mh, stride_mn,
                   stride_rb, stride_rh, N, H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    n_valid = tl.load(NNodes + b)
    nmask = offs_n < n_valid
    q = tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < G)[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    qn = tl.sqrt(tl.sum(q * q, 1))
    mu = tl.load(Mu + b * stride_mb + h * stride_mh + offs_n[:, None] * stride_mn + offs_d[None, :],
                 mask=nmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    r = tl.load(R + b * stride_rb + h * stride_rh + offs_n, mask=nmask, other=float("-inf"))
    s = tl.dot(q, tl.trans(mu)) + qn[:, None] * r[None, :]
    s = tl.where((offs_g < G)[:, None], s, float("-inf"))
    ub = tl.max(s, 0)
    ub = tl.where(nmask & (r > float("-inf")), ub, float("-inf"))
    tl.store(UB + pid * N + offs_n, ub, mask=offs_n < N)


def group_mean(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    bs, Hq, D = q.shape
    return q.view(bs, num_kv_heads, Hq // num_kv_heads, D).mean(2)


def node_bounds(q: torch.Tensor, mu: torch.Tensor, r: torch.Tensor, n_nodes: torch.Tensor,
                block_n: int = 64) -> torch.Tensor:
    bs, H, N, D = mu.shape
    G = q.shape[1] // H
    ub = torch.empty(bs, H, N, dtype=torch.float32, device=q.device)
    grid = (bs * H, triton.cdiv(N, block_n))
    _bounds_kernel[grid](q, mu, r, n_nodes, ub, q.stride(0), q.stride(1), mu.stride(0), mu.stride(1), mu.stride(2),
                         r.stride(0), r.stride(1), N, H=H, G=G, BLOCK_G=group_block(G),
                         D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_N=block_n)
    return ub


def node_bounds_ref(q, mu, r, n_nodes):
    """Torch twin: sgl_sparsekv.index.upper_bound per request, -inf past each request's node count."""
    from sgl_sparsekv.index import upper_bound

    bs, H, N, D = mu.shape
    out = torch.full((bs, H, N), float("-inf"), device=q.device)
    for b in range(bs):
        n = int(n_nodes[b])
        ub = upper_bound(q[b].float().view(H, -1, D), mu[b, :, :n].float(), r[b, :, :n].float(), "max")
        out[b, :, :n] = torch.where(torch.isfinite(r[b, :, :n]), ub, float("-inf"))
    return out
