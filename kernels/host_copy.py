"""Runs of KV rows copied from a host pool into device rows, in one launch that reads host memory directly.

    src_k, src_v   [heads, src_rows, D] (any strides)  the host pool in pinned memory, which the device reads
                                                      through unified addressing, or device rows
    dst_k, dst_v   [heads, dst_rows, D] (any strides)  device rows
    runs  [capacity, 4] int32   run j: (head, first src row, first dst row, rows), at most RUN_MAX rows
    count [1] int32             runs past ``count`` are skipped, so a captured launch serves any number of them
                                (``programs`` programs take the runs in turn)
-> dst[head, dst_row + i] = src[head, src_row + i] for i < rows, for K and V

A chunk of a request's tokens is a contiguous range of positions, so with the host pool laid out by position the
rows a selection misses come in runs of up to a chunk: one program copies one run (rows x D elements of K and of
V) with a single wide load from host memory, instead of one DMA descriptor per run (IceCache's bulk loading). The
device issues the reads, so the copy needs no host thread and can sit inside a CUDA graph beside the selection
that decides it. ``bench/bench_host_copy.py`` measures it against copy-engine transfers.

``stage_rows`` copies the rows a prefill's prefixes name, each once however many requests of the batch share it:

    src_k, src_v   [rows, R] (rows contiguous)  a layer of the host pool, read through unified addressing
    dst_k, dst_v   [rows, R]                    the device stage, by the same rows
    slots [n] int64                             rows to copy, repeated where requests share a prefix
    mark  [rows] int32, gen                     a row is copied by the program that first sets its mark to ``gen``
    near (optional): near_k, near_v [near_rows, R], near_of [rows] int64
                                                device copies of some rows: row s is near_k[near_of[s]] where
                                                near_of[s] != 0 (SGLang's window pool and its full-to-window map)
-> dst[s] = near[near_of[s]] if near_of[s] else src[s], for every s in slots

A chunked prefill stages its whole prefix again at every chunk; the rows of its earlier chunks mostly still sit in
the window pool on the device, so they are copied from there and only the rest cross the bus.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RUN_MAX = 64   # rows of one run: the longest chunk (config chunk_max) or page


@triton.jit
def _copy_runs_kernel(SrcK, SrcV, DstK, DstV, Runs, Count,
                      s_sh, s_sr, d_sh, d_sr, D: tl.constexpr, BLOCK_D: tl.constexpr, RUN_MAX: tl.constexpr):
    offs_r = tl.arange(0, RUN_MAX)
    offs_d = tl.arange(0, BLOCK_D)
    for j in range(tl.program_id(0), tl.load(Count), tl.num_programs(0)):
        head = tl.load(Runs + j * 4).to(tl.int64)
        src = tl.load(Runs + j * 4 + 1).to(tl.int64)
        dst = tl.load(Runs + j * 4 + 2).to(tl.int64)
        n = tl.load(Runs + j * 4 + 3)
        mask = (offs_r < n)[:, None] & (offs_d < D)[None, :]
        s = head * s_sh + (src + offs_r)[:, None] * s_sr + offs_d[None, :]
        d = head * d_sh + (dst + offs_r)[:, None] * d_sr + offs_d[None, :]
        tl.store(DstK + d, tl.load(SrcK + s, mask=mask), mask=mask)
        tl.store(DstV + d, tl.load(SrcV + s, mask=mask), mask=mask)


def copy_runs(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor, runs: torch.Tensor,
              count: torch.Tensor, programs: int = 2048) -> None:
    """Copy ``runs[:count]`` of K and V rows (module docstring). With unified addressing a pinned host tensor's
    pointer is valid on the device (the launch resolves it), so the host pool is passed as it is; each pair shares
    its strides, the last dimension contiguous."""
    D = dst_k.shape[-1]
    if src_k.device != dst_k.device and not (src_k.is_pinned() and src_v.is_pinned()):
        raise ValueError("the device reads a host pool only from pinned memory (torch.empty(..., pin_memory=True))")
    assert dst_k.stride() == dst_v.stride() and dst_k.stride(-1) == 1 and runs.shape[1] == 4
    assert src_k.stride(0) == src_v.stride(0) and src_k.stride(1) == src_v.stride(1)
    _copy_runs_kernel[(max(1, min(programs, runs.shape[0])),)](src_k, src_v, dst_k, dst_v, runs, count,
                                        src_k.stride(0), src_k.stride(1), dst_k.stride(0), dst_k.stride(1),
                                        D=D, BLOCK_D=triton.next_power_of_2(D), RUN_MAX=RUN_MAX)


def copy_runs_ref(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                  runs: torch.Tensor, count: torch.Tensor) -> None:
    """The kernel's torch twin: every run's rows in one gather."""
    head, src, dst, n = runs[:int(count)].to(torch.int64).T
    assert bool(((n >= 0) & (n <= RUN_MAX)).all()), n
    run = torch.repeat_interleave(torch.arange(len(n), device=n.device), n)
    i = torch.arange(run.numel(), device=n.device) - (torch.cumsum(n, 0) - n)[run]   # the row within its run
    h, s, d = head[run], src[run] + i, dst[run] + i
    dst_k[h.to(dst_k.device), d.to(dst_k.device)] = src_k[h.to(src_k.device), s.to(src_k.device)].to(dst_k.device)
    dst_v[h.to(dst_v.device), d.to(dst_v.device)] = src_v[h.to(src_v.device), s.to(src_v.device)].to(dst_v.device)


@triton.jit
def _stage_rows_kernel(SrcK, SrcV, NearK, NearV, NearOf, DstK, DstV, Slots, Mark, gen, R: tl.constexpr,
                       BLOCK: tl.constexpr, HAS_NEAR: tl.constexpr):
    slot = tl.load(Slots + tl.program_id(0)).to(tl.int64)
    if tl.atomic_xchg(Mark + slot, gen) != gen:   # the first of the batch's requests to name this row copies it
        src_k = SrcK + slot * R
        src_v = SrcV + slot * R
        if HAS_NEAR:
            near = tl.load(NearOf + slot)
            if near != 0:   # still on the device
                src_k = NearK + near * R
                src_v = NearV + near * R
        for off in tl.static_range(0, R, BLOCK):
            o = off + tl.arange(0, BLOCK)
            m = o < R
            tl.store(DstK + slot * R + o, tl.load(src_k + o, mask=m), mask=m)
            tl.store(DstV + slot * R + o, tl.load(src_v + o, mask=m), mask=m)


def stage_rows(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
               slots: torch.Tensor, mark: torch.Tensor, gen: int, near: tuple | None = None) -> None:
    """Copy rows ``slots`` of K and V to ``dst``, from ``near`` = (near_k, near_v, near_of) where it holds them and
    from ``src`` otherwise (module docstring); ``gen`` must differ from every value ``mark`` holds, so a caller
    counts it up and refills ``mark`` with -1 before it wraps."""
    if slots.numel() == 0:
        return
    R = src_k[0].numel()
    for t in (src_k, src_v, dst_k, dst_v):
        assert t.is_contiguous() and t[0].numel() == R and t.shape[0] == mark.shape[0], t.shape
    assert slots.dtype == torch.int64 and mark.dtype == torch.int32 and 0 <= gen < 2**31 - 1
    near_k, near_v, near_of = near if near is not None else (dst_k, dst_v, slots)   # unread without HAS_NEAR
    if near is not None:
        assert near_k.is_contiguous() and near_v.is_contiguous() and near_k[0].numel() == R, near_k.shape
        assert near_k.shape == near_v.shape and near_of.dtype == torch.int64 and near_of.shape[0] >= mark.shape[0]
    _stage_rows_kernel[(slots.numel(),)](src_k, src_v, near_k, near_v, near_of, dst_k, dst_v, slots, mark, gen,
                                         R=R, BLOCK=min(1024, triton.next_power_of_2(R)), HAS_NEAR=near is not None)


def stage_rows_ref(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                   slots: torch.Tensor, mark: torch.Tensor, gen: int, near: tuple | None = None) -> None:
    """The kernel's torch twin: each row once, from ``near`` where it holds it."""
    rows = slots.unique()
    far = rows
    if near is not None:
        near_k, near_v, near_of = near
        at = near_of[rows]
        close = at != 0
        dst_k.index_copy_(0, rows[close], near_k.index_select(0, at[close]))
        dst_v.index_copy_(0, rows[close], near_v.index_select(0, at[close]))
        far = rows[~close]
    dst_k.index_copy_(0, far, src_k.index_select(0, far))
    dst_v.index_copy_(0, far, src_v.index_select(0, far))
    mark[rows] = gen
