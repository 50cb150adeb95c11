"""kernels/host_copy.py: runs of K/V rows copied into device rows, against the torch twin. On the CPU (interpreter)
at small shapes; on the GPU from a pinned host pool through unified addressing, at Llama-3.1-8B's head shape, in
both layouts (head-major, and SGLang's [slots, heads, D]), launched eagerly and replayed from a CUDA graph. The
prefill's stage (``stage_rows``): each named row once, where requests share a prefix."""

import pytest
import torch

from sgl_sparsekv.kernels.host_copy import RUN_MAX, copy_runs, copy_runs_ref, stage_rows, stage_rows_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_runs(heads: int, src_rows: int, dst_rows: int, n_runs: int, gen: torch.Generator) -> torch.Tensor:
    """Runs of 0..RUN_MAX rows into disjoint destination ranges (as a hot buffer's free rows are), from anywhere."""
    out, free = [], {h: 0 for h in range(heads)}
    for _ in range(n_runs):
        h = int(torch.randint(heads, (1,), generator=gen))
        n = int(torch.randint(0, RUN_MAX + 1, (1,), generator=gen))
        n = min(n, dst_rows - free[h])
        src = int(torch.randint(0, src_rows - n + 1, (1,), generator=gen))
        out.append([h, src, free[h], n])
        free[h] += n
    return torch.tensor(out, dtype=torch.int32)


def pools(heads, src_rows, dst_rows, D, dtype, layout, gen, host):
    """(src_k, src_v, dst_k, dst_v) as [heads, rows, D] views; ``layout`` "slots" stores them as [rows, heads, D]."""
    def tensor(rows, device, pin=False):
        shape = (heads, rows, D) if layout == "heads" else (rows, heads, D)
        t = torch.randn(shape, generator=gen).to(dtype)
        t = t.pin_memory() if pin else t.to(device)
        return t if layout == "heads" else t.transpose(0, 1)

    src = [tensor(src_rows, DEV, pin=host) for _ in range(2)]
    dst = [tensor(dst_rows, DEV) for _ in range(2)]
    return (*src, *dst)


def check(heads, src_rows, dst_rows, D, n_runs, count, layout, dtype=torch.bfloat16, host=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sk, sv, dk, dv = pools(heads, src_rows, dst_rows, D, dtype, layout, gen, host)
    runs = make_runs(heads, src_rows, dst_rows, n_runs, gen)
    runs_dev = torch.cat([runs, torch.full((3, 4), -1, dtype=torch.int32)]).to(DEV)   # capacity past the runs
    count_t = torch.tensor([count], dtype=torch.int32, device=DEV)
    before = dk.clone()
    want_k, want_v = dk.clone(), dv.clone()
    copy_runs_ref(sk, sv, want_k, want_v, runs, count_t.cpu())
    copy_runs(sk, sv, dk, dv, runs_dev, count_t)
    assert torch.equal(dk, want_k) and torch.equal(dv, want_v)
    assert count == 0 or not torch.equal(dk, before)   # rows did move


@pytest.mark.parametrize("layout", ["heads", "slots"])
@pytest.mark.parametrize("count", [0, 5, 12])
def test_copy_runs_small(layout, count):
    """Runs of every length up to RUN_MAX (empty ones too), rows of D 64 and of D 40 (a masked tail)."""
    check(heads=3, src_rows=300, dst_rows=200, D=64, n_runs=12, count=count, layout=layout)
    check(heads=2, src_rows=150, dst_rows=150, D=40, n_runs=8, count=8, layout=layout, dtype=torch.float32, seed=1)


@pytest.mark.gpu
def test_copy_runs_refuses_pageable_host_memory():
    src = torch.zeros(1, 4, 8)
    dst = torch.zeros(1, 4, 8, device=DEV)
    with pytest.raises(ValueError, match="pinned"):
        copy_runs(src, src, dst, dst, torch.zeros(1, 4, dtype=torch.int32, device=DEV),
                  torch.zeros(1, dtype=torch.int32, device=DEV))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["heads", "slots"])
def test_copy_runs_from_pinned_host_memory(layout):
    """8 KV heads of D 128, bf16: a 64K-row host pool, 16K runs into a 32K-row buffer per head."""
    check(heads=8, src_rows=65_536, dst_rows=32_768, D=128, n_runs=16_384, count=16_000, layout=layout, host=True)


@pytest.mark.gpu
def test_copy_runs_replays_from_a_cuda_graph_with_new_runs():
    """A captured launch reads the runs and the count each replay holds (the pinned pool at a fixed address)."""
    gen = torch.Generator().manual_seed(3)
    heads, src_rows, dst_rows, D = 8, 8192, 4096, 128
    sk, sv, dk, dv = pools(heads, src_rows, dst_rows, D, torch.bfloat16, "heads", gen, host=True)
    runs = torch.zeros(1024, 4, dtype=torch.int32, device=DEV)
    count = torch.zeros(1, dtype=torch.int32, device=DEV)
    copy_runs(sk, sv, dk, dv, runs, count)   # compile before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_runs(sk, sv, dk, dv, runs, count)
    for seed, n in ((0, 1000), (1, 17), (2, 0)):
        new = make_runs(heads, src_rows, dst_rows, 1024, torch.Generator().manual_seed(seed))
        runs.copy_(new)
        count.fill_(n)
        dk.zero_(), dv.zero_()
        want_k, want_v = dk.clone(), dv.clone()
        copy_runs_ref(sk, sv, want_k, want_v, new, torch.tensor([n]))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dk, want_k) and torch.equal(dv, want_v)


def check_stage(rows, heads, D, n, dtype, host=False, seed=0, gens=(0, 1, 2), near=False):
    """Slots drawn with many repeats (prefixes shared by a batch's requests), staged over several generations into
    a stage that already holds rows of earlier layers: the kernel's stage equals its twin's, every named row equals
    its source and every other row is as it was. ``near``: a third of the rows also have a device copy (the window
    pool's, made to differ from the host row here so the test sees which one was read), which a named row takes."""
    gen = torch.Generator().manual_seed(seed)
    src_k, src_v = (torch.randn(rows, heads, D, generator=gen).to(dtype) for _ in range(2))
    if host:
        src_k, src_v = src_k.pin_memory(), src_v.pin_memory()
    else:
        src_k, src_v = src_k.to(DEV), src_v.to(DEV)
    stage_k, stage_v = (torch.randn(rows, heads, D, generator=gen).to(dtype).to(DEV) for _ in range(2))
    want_k, want_v = stage_k.clone(), stage_v.clone()
    mark, want_mark = (torch.full((rows,), -1, dtype=torch.int32, device=DEV) for _ in range(2))
    near_of = torch.zeros(rows + 2, dtype=torch.int64)   # SGLang's map is longer than the pool: padding rows
    close = torch.randperm(rows, generator=gen)[:rows // 3]
    near_of[close] = torch.randperm(rows // 3, generator=gen) + 1   # window row 0 is SGLang's padding slot
    near_of = near_of.to(DEV)
    near_k, near_v = (torch.randn(rows // 3 + 1, heads, D, generator=gen).to(dtype).to(DEV) for _ in range(2))
    for g in gens:
        shared = torch.randint(rows, (n // 2,), generator=gen)
        slots = torch.cat([shared, shared[:n // 4], torch.randint(rows, (n - n // 2 - n // 4,), generator=gen)])
        slots = slots[torch.randperm(n, generator=gen)].to(DEV)
        src_k.add_(1)   # a new layer's rows
        near_k.add_(1)
        before = stage_k.clone()
        window = (near_k, near_v, near_of) if near else None
        stage_rows_ref(src_k.to(DEV), src_v.to(DEV), want_k, want_v, slots, want_mark, g, window)
        stage_rows(src_k, src_v, stage_k, stage_v, slots, mark, g, window)
        assert torch.equal(stage_k, want_k) and torch.equal(stage_v, want_v) and torch.equal(mark, want_mark)
        named = torch.zeros(rows, dtype=torch.bool, device=DEV)
        named[slots] = True
        source = src_k.to(DEV).clone()
        if near:
            source[near_of[:rows] != 0] = near_k[near_of[:rows][near_of[:rows] != 0]]
        assert torch.equal(stage_k[named], source[named]) and torch.equal(stage_k[~named], before[~named])


def test_stage_rows_small():
    """Rows of 2 heads x 40 (a masked tail), and a row longer than one block (2 x 640, two blocks of 1024); with
    device copies of some rows, those are read instead."""
    check_stage(rows=300, heads=2, D=40, n=200, dtype=torch.float32)
    check_stage(rows=64, heads=2, D=640, n=50, dtype=torch.bfloat16, seed=1)
    check_stage(rows=300, heads=2, D=40, n=200, dtype=torch.float32, seed=2, near=True)
    check_stage(rows=64, heads=2, D=640, n=50, dtype=torch.bfloat16, seed=3, near=True)


@pytest.mark.gpu
def test_stage_rows_from_pinned_host_memory():
    """Llama-3.1-8B's KV heads in bf16 from a pinned pool of 64K rows: 100K slots, half of them repeats; then with
    a third of the rows in a device window pool."""
    check_stage(rows=65_536, heads=8, D=128, n=100_000, dtype=torch.bfloat16, host=True)
    check_stage(rows=65_536, heads=8, D=128, n=100_000, dtype=torch.bfloat16, host=True, seed=1, near=True)
