"""sgl_sparsekv.residency (the host tier's hot-chunk buffers) against a brute-force LRU, step by step: the same slots
hold the same chunks, and after the planned runs are copied every selected chunk's rows on the device hold its KV."""

import random

import pytest
import torch

from helpers import sync_check
from sgl_sparsekv.kernels.host_copy import copy_runs, copy_runs_ref
from sgl_sparsekv.residency import HotChunks

H, D, W = 2, 8, 4


def lru_reference(table: dict, key, sel: list[int], step: int, slots: int) -> list[int]:
    """One (request, layer, head)'s slots: hits keep theirs, misses take the least recently used in order."""
    chunk, used = table.setdefault(key, ([-1] * slots, [-1] * slots))
    out = [-1] * len(sel)
    for k, c in enumerate(sel):
        if c >= 0 and c in chunk:
            out[k] = chunk.index(c)
            used[out[k]] = step
    order = sorted(range(slots), key=lambda s: (used[s], s))
    j = 0
    for k, c in enumerate(sel):
        if c >= 0 and out[k] < 0:
            out[k] = order[j]
            j += 1
            chunk[out[k]], used[out[k]] = c, step
    return out


def scenario(seed: int, device: str, scattered: bool):
    """Two requests of 96 positions cut into chunks of 1-4 tokens, their KV slots in SGLang's pool (consecutive, or
    shuffled in places), a host pool holding every slot's K and V."""
    rng = random.Random(seed)
    cuts = [0]
    while cuts[-1] < 96:
        cuts.append(min(96, cuts[-1] + rng.randint(1, W)))
    starts, lens = cuts[:-1], [b - a for a, b in zip(cuts, cuts[1:])]
    slots = torch.arange(1, 2 * 96 + 1).view(2, 96)
    if scattered:   # a few positions got slots out of order
        for r in range(2):
            idx = torch.tensor(rng.sample(range(96), 24))
            slots[r, idx] = slots[r, idx][torch.randperm(24, generator=torch.Generator().manual_seed(seed))]
    g = torch.Generator().manual_seed(seed)
    host_k, host_v = torch.randn(H, 2 * 96 + 1, D, generator=g), torch.randn(H, 2 * 96 + 1, D, generator=g)
    return rng, starts, lens, slots.to(torch.int32).to(device), host_k, host_v


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_equals_lru_and_loads_every_selected_chunk(seed, scattered, kernel, device="cpu"):
    """``kernel``: the plan in one launch (kernels/hot_plan.py), else its torch twin."""
    rng, starts, lens, r2t, host_k, host_v = scenario(seed, device, scattered)
    layers, slots, K = 2, 6, 5
    base = torch.tensor([1, 1 + slots * W], device=device)   # row 0 stays unused, as SGLang's padding slot
    hot = HotChunks(2, layers, H, slots, W, base, use_kernel=kernel)
    dev_k = torch.zeros(layers, 1 + 2 * slots * W, H, D, device=device)
    dev_v = torch.zeros_like(dev_k)
    if device == "cuda":
        host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
    table, hits, misses = {}, 0, 0
    # each head draws from a few favourite chunks, so steps overlap and the buffer both hits and evicts
    favourites = {(r, h): rng.sample(range(len(starts)), 9) for r in range(2) for h in range(H)}
    for step in range(12):
        layer = step % layers
        pairs = [(r, h) for r in range(2) for h in range(H) if rng.random() < 0.9]
        sel = [rng.sample(favourites[p], rng.randint(1, K)) + [-1] * K for p in pairs]
        sel = torch.tensor([s[:K] for s in sel], device=device)
        rows = torch.tensor([r for r, _ in pairs], device=device)
        heads = torch.tensor([h for _, h in pairs], device=device)
        cs = torch.tensor([[starts[c] if c >= 0 else 0 for c in s] for s in sel.tolist()], device=device)
        cl = torch.tensor([[lens[c] if c >= 0 else 0 for c in s] for s in sel.tolist()], device=device)
        plan = hot.plan(layer, rows, heads, sel, cs, cl, r2t, step, cap=len(pairs) * K * W)
        assert int(plan.needed) == int(plan.count)
        copy = copy_runs if device == "cuda" else copy_runs_ref
        copy(host_k, host_v, dev_k[layer].transpose(0, 1), dev_v[layer].transpose(0, 1), plan.runs, plan.count)
        for i, (r, h) in enumerate(pairs):
            chosen = sel[i].tolist()
            ref = lru_reference(table, (r, layer, h), chosen, step, slots)
            for k, c in enumerate(chosen):
                if c < 0:
                    assert plan.first[i, k] == -1
                    continue
                assert int(plan.first[i, k]) == int(base[r]) + ref[k] * W, (step, i, k)
                got = int(plan.first[i, k])
                kv_slots = r2t[r, starts[c]:starts[c] + lens[c]].long().cpu()
                assert torch.equal(dev_k[layer, got:got + lens[c], h].cpu(), host_k[h, kv_slots]), (step, i, k)
                assert torch.equal(dev_v[layer, got:got + lens[c], h].cpu(), host_v[h, kv_slots]), (step, i, k)
        resident = {(r, h): hot.chunk[r, layer, h].tolist() for r, h in pairs}
        for (r, h), res in resident.items():
            assert res == table[(r, layer, h)][0]
            assert len({c for c in res if c >= 0}) == len([c for c in res if c >= 0])   # never twice
        hits += int(plan.hit_rows)
        misses += int(plan.miss_rows)
    assert hits > 0 and misses > 0   # the scenario exercised both


@pytest.mark.parametrize("kernel", [False, True])
def test_runs_follow_consecutive_slots(kernel):
    """A chunk over consecutive slots is one run; one whose slots break in the middle is two."""
    r2t = torch.tensor([[0, 10, 11, 12, 13, 40, 41, 20, 21]], dtype=torch.int32)
    hot = HotChunks(1, 1, 1, 4, 4, torch.tensor([100]), use_kernel=kernel)
    sel = torch.tensor([[0, 1]])
    plan = hot.plan(0, torch.tensor([0]), torch.tensor([0]), sel, torch.tensor([[1, 5]]), torch.tensor([[4, 4]]),
                    r2t, 0, cap=8)
    runs = plan.runs[:int(plan.count)].tolist()
    assert runs == [[0, 10, 100, 4], [0, 40, 104, 2], [0, 20, 106, 2]]
    assert int(plan.miss_rows) == 8 and int(plan.hit_rows) == 0
    again = hot.plan(0, torch.tensor([0]), torch.tensor([0]), torch.tensor([[1, -1]]), torch.tensor([[5, 0]]),
                     torch.tensor([[4, 0]]), r2t, 1, cap=8)
    assert int(again.count) == 0 and int(again.hit_rows) == 4 and again.first.tolist() == [[104, -1]]


@pytest.mark.parametrize("kernel", [False, True])
def test_short_capacity_is_reported(kernel):
    r2t = torch.arange(0, 64, 2, dtype=torch.int32)[None]   # no two positions on consecutive slots
    hot = HotChunks(1, 1, 1, 2, 4, torch.tensor([0]), use_kernel=kernel)
    plan = hot.plan(0, torch.tensor([0]), torch.tensor([0]), torch.tensor([[0, 1]]), torch.tensor([[0, 4]]),
                    torch.tensor([[4, 4]]), r2t, 0, cap=5)
    assert int(plan.needed) == 8 and int(plan.count) == 5


def test_cleared_row_loads_again():
    r2t = torch.arange(16, dtype=torch.int32)[None]
    hot = HotChunks(1, 1, 1, 2, 4, torch.tensor([0]))
    args = (0, torch.tensor([0]), torch.tensor([0]), torch.tensor([[3]]), torch.tensor([[4]]), torch.tensor([[4]]),
            r2t)
    assert int(hot.plan(*args, 0, cap=4).miss_rows) == 4
    assert int(hot.plan(*args, 1, cap=4).miss_rows) == 0
    hot.clear(0)
    assert int(hot.plan(*args, 2, cap=4).miss_rows) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("scattered", [False, True])
def test_plan_and_copy_on_the_gpu(scattered, kernel):
    """The same steps on the device, the runs copied by the kernel from a pinned host pool."""
    test_plan_equals_lru_and_loads_every_selected_chunk(3, scattered, kernel, device="cuda")


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_plan_kernel_equals_its_twin(dev):
    """At the tier's shape (240 slots a list, chunks of up to 16 rows, lists that select and lists that do not,
    runs broken where slots scatter) over a history of steps: the kernel's plan equals the torch plan, slot for slot
    and run for run (the kernel's runs in no fixed order)."""
    gen = torch.Generator().manual_seed(0)
    owners, layers, heads, slots, width, positions = 3, 2, 2, 240, 16, 8192
    base = torch.arange(owners, device=dev) * (slots * width + 64)
    twin, kern = (HotChunks(owners, layers, heads, slots, width, base, use_kernel=k) for k in (False, True))
    r2t = torch.stack([torch.randperm(owners * positions, generator=gen)[:positions] // 3 * 3 for _ in range(owners)])
    r2t[:, ::5] = torch.arange(positions)[::5]   # stretches of consecutive slots, broken in places
    r2t = r2t.to(torch.int32).to(dev)
    n = owners * heads
    rows = (torch.arange(n) // heads).to(dev)
    hs = (torch.arange(n) % heads).to(dev)
    pool = torch.randperm(positions // width, generator=gen)[:400]   # the chunks the lists draw from
    for step in range(6):
        layer = step % layers
        sel = torch.full((n, slots), -1, dtype=torch.int32)
        for i in range(n):
            if torch.rand(1, generator=gen) < 0.25:
                continue   # this list does not select this step
            k = int(torch.randint(1, slots + 1, (1,), generator=gen))
            sel[i, :k] = pool[torch.randperm(len(pool), generator=gen)[:k]]
        sel = sel.to(dev)
        starts = (sel.clamp(min=0) * width).to(torch.int32)
        lens = torch.where(sel >= 0, 1 + sel % width, 0).to(torch.int32)
        want = twin.plan(layer, rows, hs, sel, starts, lens, r2t, step, cap=n * slots * width)
        got = kern.plan(layer, rows, hs, sel, starts, lens, r2t, step, cap=n * slots * width)
        assert torch.equal(got.first, want.first), step
        assert torch.equal(kern.chunk, twin.chunk) and torch.equal(kern.used, twin.used), step
        assert int(got.needed) == int(want.needed) == int(got.count) > 0, step
        runs = lambda p: sorted(map(tuple, p.runs[:int(p.count)].tolist()))
        assert runs(got) == runs(want), step
        assert int(got.hit_rows) == int(want.hit_rows) and int(got.miss_rows) == int(want.miss_rows), step
    assert int(got.hit_rows) > 0


@pytest.mark.gpu
def test_plan_never_waits_for_the_gpu():
    """Planning and loading a step on the device asks the GPU nothing back (a captured decode step holds both)."""
    dev = "cuda"
    r2t = torch.arange(1, 65, dtype=torch.int32, device=dev)[None]
    hot = HotChunks(1, 1, H, 4, W, torch.tensor([0], device=dev))
    host_k = torch.randn(H, 65, D).pin_memory()
    dev_k = torch.zeros(4 * W, H, D, device=dev)
    sel = torch.tensor([[0, 3], [2, -1]], device=dev)   # chunks of W positions each
    args = (torch.zeros(2, dtype=torch.int64, device=dev), torch.arange(2, device=dev), sel, sel.clamp(min=0) * W,
            torch.full((2, 2), W, device=dev), r2t)
    steps = torch.arange(3, device=dev)   # made before the check: a tensor from a host value is a copy that waits
    with sync_check():
        for step in steps:
            plan = hot.plan(0, *args, step, cap=2 * 2 * W)
            copy_runs(host_k, host_k, dev_k.transpose(0, 1), dev_k.transpose(0, 1), plan.runs, plan.count)
    assert int(plan.miss_rows) == 0 and int(plan.hit_rows) == 3 * W
