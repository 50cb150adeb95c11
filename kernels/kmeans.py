"""Spherical k-means steps on the GPU (``sgl_sparsekv/index.py``), each with its torch twin.

    nearest_centroid  x [H, N, d] fp32 points; cent [H, K, d] fp32 -> assign [H, N] int64 (first maximum on ties)
    cluster_sums      x, assign, K -> per-cluster sums of the points [H, K, d] fp32, counts [H, K] fp32

The torch twin materializes the [H, N, K] similarity matrix: for every layer of a 32K-token prompt that is
3.6 GB written and read per k-means iteration, and a gigabyte-sized temporary inside a server whose KV
pool holds most of the GPU. Here each program keeps a running maximum over centroid tiles in registers
and writes only the argmax. Similarities go through TF32 tensor cores: a near-tie may pick the other
centroid than fp32 would, which only moves a chunk between two equally close clusters (the radii are
computed afterwards from the actual members in fp32, so the index's bounds stay exact).

The sums add each cluster's members in index order in one program, where ``scatter_add_``'s atomics add them in
whatever order the GPU ran: the last bits of a centroid then vary from run to run, and TF32 rounding of the
next assignment turns that into different clusters. So a prompt gets the same index every time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# N and K follow each prompt's chunk count: specializing on them (== 1, divisible by 16) compiled new variants
# in the middle of serving, at a prefill's index build
@triton.jit(do_not_specialize=["N", "K"])
def _assign_kernel(X, C, Out, N, K, stride_xh, stride_xn, stride_ch, stride_ck, D: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    h = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    nmask = offs_n < N
    x = tl.load(X + h * stride_xh + offs_n[:, None] * stride_xn + offs_d[None, :], mask=nmask[:, None], other=0.0)
    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    best_k = tl.zeros([BLOCK_N], tl.int64)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        c = tl.load(C + h * stride_ch + offs_k[:, None] * stride_ck + offs_d[None, :], mask=kmask[:, None], other=0.0)
        s = tl.dot(x, tl.trans(c), input_precision=PRECISION)
        s = tl.where(kmask[None, :], s, float("-inf"))
        m = tl.max(s, 1)
        k = tl.argmax(s, 1).to(tl.int64) + k0
        better = m > best   # strict: an earlier tile keeps a tie, like torch.argmax's first maximum
        best = tl.where(better, m, best)
        best_k = tl.where(better, k, best_k)
    tl.store(Out + h * N + offs_n, best_k, mask=nmask)


def nearest_centroid(x: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    H, N, d = x.shape
    K = cent.shape[1]
    assert cent.shape == (H, K, d) and x.dtype == cent.dtype == torch.float32, (x.shape, cent.shape, x.dtype)
    assert d >= 16 and d & (d - 1) == 0, f"head_dim {d}: the kernel tiles d as a power of two >= 16"
    x, cent = x.contiguous(), cent.contiguous()
    out = torch.empty(H, N, dtype=torch.int64, device=x.device)
    if N == 0:
        return out
    # tiles timed on an H100 at 32K and 126K-token prompts (d 128): 128 x 64 with 8 warps was the fastest
    block_n, block_k = (128, 64) if d <= 128 else (64, 32)
    _assign_kernel[(triton.cdiv(N, block_n), H)](x, cent, out, N, K, x.stride(0), x.stride(1), cent.stride(0),
                                                 cent.stride(1), D=d, BLOCK_N=block_n, BLOCK_K=block_k,
                                                 PRECISION="tf32", num_warps=8)
    return out


def nearest_centroid_ref(x: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """The torch twin (and the CPU path): the full similarity matrix, then its argmax."""
    return torch.einsum("hnd,hkd->hnk", x, cent).argmax(-1)


@triton.jit(do_not_specialize=["N", "K"])
def _sums_kernel(X, Order, Offsets, Out, N, K, stride_xh, stride_xn, D: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, D)
    start = tl.load(Offsets + h * (K + 1) + k)
    end = tl.load(Offsets + h * (K + 1) + k + 1)
    acc = tl.zeros([D], tl.float32)
    for i in range(start, end):
        n = tl.load(Order + h * N + i)
        acc += tl.load(X + h * stride_xh + n * stride_xn + offs_d)
    tl.store(Out + (h * K + k) * D + offs_d, acc)


def cluster_sums(x: torch.Tensor, assign: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of each cluster's points, added in point order (deterministic), and each cluster's size."""
    H, N, d = x.shape
    x = x.contiguous()
    order = torch.sort(assign, dim=-1, stable=True).indices
    counts = torch.zeros(H, K, dtype=torch.int64, device=x.device).scatter_add_(1, assign, torch.ones_like(assign))
    offsets = torch.zeros(H, K + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(counts, 1, out=offsets[:, 1:])
    out = torch.empty(H, K, d, dtype=torch.float32, device=x.device)
    _sums_kernel[(K, H)](x, order, offsets, out, N, K, x.stride(0), x.stride(1), D=d, num_warps=1)
    return out, counts.to(x.dtype)


def cluster_sums_ref(x: torch.Tensor, assign: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    H, N, d = x.shape
    sums = torch.zeros(H, K, d, dtype=x.dtype, device=x.device).scatter_add_(1, assign[..., None].expand(-1, -1, d), x)
    counts = torch.zeros(H, K, dtype=x.dtype, device=x.device).scatter_add_(1, assign, torch.ones_like(assign, dtype=x.dtype))
    return sums, counts
