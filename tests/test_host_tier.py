"""The host KV tier's pool (sgl_sparsekv/host_tier.py) against a brute-force store; the tier through SGLang's
hybrid pools is served in tests/test_e2e_server.py and under load in tests/test_stress.py."""

import pytest
import torch

from sgl_sparsekv.config import ConfigError
from sgl_sparsekv.host_tier import (HOST_RESERVE_BYTES, HostKV, host_budget, host_reserve, layer_pattern, prefix_slots,
                                   window_requests, window_slots)


def test_rows_hold_the_last_write_of_each_slot():
    """Writes of several layers at scattered slots, some written again (a freed slot reused): each row reads back
    what a dict of (layer, slot) -> last write holds, and rows never written stay zero."""
    g = torch.Generator().manual_seed(0)
    layers, rows, heads, d = [2, 3, 4], 64, 3, 8
    host = HostKV(layers, rows, heads, d, torch.float32, torch.float32)
    spec = {}
    for _ in range(20):
        lid = layers[int(torch.randint(0, 3, (1,), generator=g))]
        loc = torch.randperm(rows, generator=g)[:int(torch.randint(1, 9, (1,), generator=g))]
        k, v = torch.randn(len(loc), heads, d, generator=g), torch.randn(len(loc), heads, d, generator=g)
        host.write(lid, loc, k, v)
        for i, slot in enumerate(loc.tolist()):
            spec[lid, slot] = (k[i], v[i])
    for lid in layers:
        for slot in range(rows):
            k, v = spec.get((lid, slot), (torch.zeros(heads, d), torch.zeros(heads, d)))
            assert torch.equal(host.key_buffer(lid)[slot], k) and torch.equal(host.value_buffer(lid)[slot], v)
    assert host.holds(3) and not host.holds(1)
    assert host.nbytes == HostKV.bytes_for(3, rows, heads, d, 4) == 2 * 3 * rows * heads * d * 4


def test_fp8_rows_stay_bytes_and_read_as_fp8():
    """fp8 KV: SGLang stores it as bytes and its readers see fp8; the host rows keep the stored bytes exactly."""
    host = HostKV([2], 8, 2, 4, torch.uint8, torch.float8_e4m3fn)
    k = torch.randn(3, 2, 4).to(torch.float8_e4m3fn)
    host.write(2, torch.tensor([5, 1, 7]), k.view(torch.uint8), k.view(torch.uint8))
    keys = host.key_buffer(2)
    assert keys.dtype == torch.float8_e4m3fn
    assert torch.equal(keys[[5, 1, 7]].view(torch.uint8), k.view(torch.uint8))


def test_prefix_slots_are_each_rows_first_positions():
    g = torch.Generator().manual_seed(0)
    req_to_token = torch.randint(0, 1000, (6, 50), generator=g, dtype=torch.int32)
    rows, lens = [4, 1, 4, 0], [7, 0, 50, 3]
    want = torch.cat([req_to_token[r, :n] for r, n in zip(rows, lens)]).to(torch.int64)
    assert torch.equal(prefix_slots(req_to_token, rows, lens), want)
    assert prefix_slots(req_to_token, [2], [0]).numel() == 0


def test_stage_serves_a_layers_readers_until_unstaged():
    """While a layer is staged its readers see the stage: the staged rows as the host holds them and the rows
    written since (in the stage and the host alike); other layers and, after unstage, every reader see the host."""
    g = torch.Generator().manual_seed(1)
    rows, heads, d = 40, 2, 4
    host = HostKV([1, 2], rows, heads, d, torch.float32, torch.float32)
    for lid in (1, 2):
        host.write(lid, torch.arange(rows), torch.randn(rows, heads, d, generator=g), torch.randn(rows, heads, d,
                                                                                                   generator=g))
    prefix = torch.tensor([3, 9, 3, 30, 9], dtype=torch.int64)
    host.stage(2, prefix)
    assert host.key_buffer(2).data_ptr() == host.stage_k.data_ptr()
    assert host.key_buffer(1).data_ptr() != host.stage_k.data_ptr()
    new = torch.tensor([11, 12])
    k, v = torch.randn(2, heads, d, generator=g), torch.randn(2, heads, d, generator=g)
    host.write(2, new, k, v)
    for slot in (3, 9, 30, 11, 12):
        assert torch.equal(host.key_buffer(2)[slot], host.k[1][slot])
        assert torch.equal(host.value_buffer(2)[slot], host.v[1][slot])
    assert torch.equal(host.k[1][new], k) and host.staged == 2
    host.unstage()
    assert host.key_buffer(2).data_ptr() == host.k[1].data_ptr()
    assert host.stage_nbytes == 2 * rows * heads * d * 4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_stages_count_the_rows_they_copy_from_the_window_pool_and_over_the_bus(device):
    """Counted once a stage round, at the first sparse layer, each row once however many requests name it: of rows
    3, 9 and 30, two still have window rows; a later layer's stage of the same rows adds nothing (on a GPU: the
    stage kernel from pinned rows)."""
    rows, heads, d = 40, 2, 4
    host = HostKV([1, 2], rows, heads, d, torch.float32, torch.float32, device=device)
    host.write(1, torch.arange(rows, device=device), torch.randn(rows, heads, d, device=device),
               torch.randn(rows, heads, d, device=device))
    near_of = torch.zeros(rows + 2, dtype=torch.int64)
    near_of[[3, 30]] = torch.tensor([5, 1])
    window = tuple(t.to(device) for t in (torch.randn(8, heads, d), torch.randn(8, heads, d), near_of))
    prefix = torch.tensor([3, 9, 3, 30, 9], dtype=torch.int64, device=device)
    host.stage(1, prefix, window)
    assert torch.equal(host.stage_k[3], window[0][5]) and torch.equal(host.stage_k[9].cpu(), host.k[0][9])
    host.stage(2, prefix, window)
    assert host.staged_near_far.tolist() == [2, 1]
    host.stage(1, torch.tensor([9, 12], dtype=torch.int64, device=device))   # no window rows given: over the bus
    assert host.staged_near_far.tolist() == [2, 3]


def test_host_budget_leaves_the_reserve_to_the_rest_of_the_server():
    """Beside a GPU the pool takes 90% of what is available beyond the reserve, or host_memory_gb where that fits in
    it; a size over it is refused in one line (a 96 GiB pool on a host with 114 GiB free was killed mid-serving)."""
    gib = 2**30
    assert host_reserve("cuda:0") == HOST_RESERVE_BYTES and host_reserve("cpu") == 0
    assert host_budget(0, 114 * gib, HOST_RESERVE_BYTES) == int(0.9 * (114 * gib - HOST_RESERVE_BYTES))
    assert host_budget(80, 114 * gib, HOST_RESERVE_BYTES) == 80 * gib
    with pytest.raises(ConfigError, match=r"host_memory_gb \(96\) is more than the 82.00 GiB of host memory available "
                                          r"beyond the 32 GiB the rest of the server needs"):
        host_budget(96, 114 * gib, HOST_RESERVE_BYTES)
    assert host_budget(0, 20 * gib, 0) == int(0.9 * 20 * gib)   # the CPU engine: its plan counts the host already
    assert host_budget(0, 20 * gib, HOST_RESERVE_BYTES) == 0


def test_window_requests_count_each_requests_last_prefill_chunk():
    """The window pool of the H100 capacity run (83,885 slots, window 1024, chunks of 8,192, 130 slots of slack)
    holds 7 requests at worst (it ran 11, their last chunks shorter); with 2,048-token chunks 24; without chunking
    the window and slack alone. The pool the plan sizes for 32 requests holds 32, and no more."""
    assert window_requests(83885, 1024, 8192, 130) == 7
    assert window_requests(83885, 1024, 2048, 130) == 24
    assert window_requests(83885, 1024, 0, 130) == 72
    slots = window_slots(32, 1024, 2048, 130)
    assert slots == 106_560
    assert window_requests(slots, 1024, 2048, 130) == 32 and window_requests(slots - 1, 1024, 2048, 130) == 31


@pytest.mark.parametrize("dense, layers", [(2, 30), (1, 2)])
def test_layer_pattern_marks_the_sparse_layers_windowed(dense, layers):
    pattern = layer_pattern(dense, layers)
    assert len(pattern) == layers and pattern.index(1) == dense and sum(pattern) == layers - dense


@pytest.mark.gpu
def test_pinned_rows_are_written_and_read_by_gpu_kernels():
    """On a GPU the host pool is registered host memory, and its readers and writers get CUDA tensors over it: rows
    written by a kernel land in host memory, and the hot buffers' copy kernel reads runs of them from there."""
    from sgl_sparsekv.kernels.host_copy import copy_runs

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, heads, d = 4096, 8, 128
    host = HostKV([2, 3], rows, heads, d, torch.bfloat16, torch.bfloat16, device=dev)
    assert host.k.device.type == "cpu" and host.key_buffer(3).device.type == "cuda"
    loc = torch.randperm(rows, device=dev, generator=gen)[:1000]
    k = torch.randn(1000, heads, d, device=dev, generator=gen, dtype=torch.bfloat16)
    host.write(3, loc, k, -k)
    torch.cuda.synchronize()
    assert torch.equal(host.k[1][loc.cpu()], k.cpu()) and torch.equal(host.v[1][loc.cpu()], -k.cpu())
    assert torch.equal(host.key_buffer(3)[loc], k) and not host.k[0].any()
    # runs of consecutive host rows into device rows, read through the mapping
    dst_k, dst_v = (torch.zeros(256, heads, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    runs = torch.tensor([[h, 64 * h + 5, 16 * h, 16] for h in range(heads)], dtype=torch.int32, device=dev)
    copy_runs(host.key_buffer(3).transpose(0, 1), host.value_buffer(3).transpose(0, 1), dst_k.transpose(0, 1),
              dst_v.transpose(0, 1), runs, torch.tensor([heads], dtype=torch.int32, device=dev))
    for h in range(heads):
        src = slice(64 * h + 5, 64 * h + 21)
        assert torch.equal(dst_k[16 * h:16 * h + 16, h].cpu(), host.k[1][src, h])
        assert torch.equal(dst_v[16 * h:16 * h + 16, h].cpu(), host.v[1][src, h])
