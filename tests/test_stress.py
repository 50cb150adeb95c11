"""The stress run (bench/stress.py) in its small forms: on the GPU a tiny dummy model, on the CPU engine SmolLM2 at
budget 256; a few dozen requests with aborts, disconnects, evictions and shared prefixes; every check of the full run
must hold. With --page-size 16 SGLang allocates KV and matches prefixes in pages of 16 tokens, while sparse-kv reads
KV by token slot: the same checks cover it, and with fp8 KV (--kv-cache-dtype fp8_e4m3), which the sparse kernels
dequantize on load. And the host tier's window pool under more requests than it was sized for."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.server import Server, run_driver

ROOT = Path(__file__).resolve().parents[1]
MKMODEL = ROOT / ".gpu-bundle" / "mkmodel.py"


def stress(tmp_path, *args) -> dict:
    """``bench.stress`` with ``args``; its result, after asserting that every check passed."""
    out = tmp_path / "stress.json"
    p = run_driver([sys.executable, "-m", "bench.stress", *args, "--out", str(out)], timeout=900, cwd=ROOT)
    assert out.exists(), f"bench.stress exited {p.returncode} without a result: {p.stderr[-3000:]}"
    res = json.loads(out.read_text())
    assert p.returncode == 0 and res["passed"], (res.get("checks"), p.stdout[-2000:], p.stderr[-3000:])
    return res


def tiny_model(tmp_path) -> str:
    """A tiny dummy-weight model dir (.gpu-bundle/mkmodel.py), or skip without the bundle."""
    if not MKMODEL.exists():
        pytest.skip("needs .gpu-bundle/mkmodel.py (see ../shared/gpu/README.md)")
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, str(MKMODEL), str(model), "tiny"], check=True)
    return str(model)


@pytest.mark.gpu
@pytest.mark.parametrize("tp, page_size, kv_dtype", [(1, 1, "auto"), (2, 1, "auto"), (1, 16, "auto"),
                                                     (1, 1, "fp8_e4m3")])
def test_stress_small(tmp_path, tp, page_size, kv_dtype):
    import torch

    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    res = stress(tmp_path, "--size", "small", "--model", tiny_model(tmp_path), "--tp-size", str(tp),
                 "--page-size", str(page_size), "--kv-cache-dtype", kv_dtype)
    assert res["counts"]["complete"]["sent"] > 0 and len(res["stats_idle"]) == tp
    assert all(st["grafts"] > 0 and st["index_reused"] > 0 for st in res["stats_idle"])
    assert all(st["requested_dense_steps"] > 0 for st in res["stats_idle"])   # custom_params "off" was honoured
    heads = [tuple(st["kv_heads"]) for st in res["stats_idle"]]
    assert len(set(heads)) == tp, heads   # the tiny model's 2 KV heads: each rank holds its own


@pytest.mark.gpu
@pytest.mark.parametrize("every,kv_dtype", [pytest.param(1, "auto", id="1"), pytest.param(4, "auto", id="4"),
                                            pytest.param("ahead-4", "auto", id="ahead-4"),
                                            pytest.param(4, "fp8_e4m3", id="4-fp8")])
def test_stress_host_tier_on_the_gpu(tmp_path, every, kv_dtype):
    """The host KV tier on the GPU: the sparse layers' KV of every token in registered host memory, which the
    prefill, the index and the hot buffers' loads read over the bus, the decode in CUDA graphs up to a batch of 8;
    the same checks, greedy tokens within the budget equal a dense server's and past it a plain lychee server's
    (with select_every 4 both servers select every 4th step, the tier's tails read from its rings; "ahead-4": and
    select ahead, the loads beside the attention on a second stream; "4-fp8": with fp8 KV, whose stored bytes the host
    pool, the hot buffers and the rings hold)."""
    ahead = str(every).startswith("ahead")
    res = stress(tmp_path, "--size", "small", "--model", tiny_model(tmp_path), "--host-tier", "256",
                 "--select-every", str(every).removeprefix("ahead-"), *(["--select-ahead"] if ahead else []),
                 "--kv-cache-dtype", kv_dtype)
    st = res["stats_idle"][0]
    assert st["host_kv_bytes"] > 0 and st["hot_buffer_bytes"] > 0
    assert st["hot_rows_hit"] > st["hot_rows_loaded"] > 0 and st["sparse_steps"] > 0 and st["grafts"] > 0
    assert st["hot_chunks_dropped"] == 0
    # prefills staged their prefixes from the window pool where it still held them (here, with a window pool of
    # half the full one, every row on the H100), the rest from the host pool
    assert st["staged_rows_near"] > 0


@pytest.mark.e2e
def test_stress_on_the_cpu_engine(tmp_path, smollm2_dir):
    """With the host KV tier on: SGLang admits, retracts and frees by its hybrid pools while the sparse layers read
    every token from the host pool. The window pool (4,096 slots) holds fewer tokens than the load's prompts, so
    SGLang freed the window slots of cached tokens to make room: at idle the radix cache holds more tokens (host
    rows) than window slots. The greedy tokens within the budget are the same after the load as before it, though
    the load's requests took the decode's hot buffers in between."""
    res = stress(tmp_path, "--size", "cpu", "--model", smollm2_dir, "--host-tier", "256")
    st = res["stats_idle"][0]
    assert st["window_slots"] == 4096 and st["host_rows_used"] > st["window_slots_used"]
    # prefills staged prefix rows from the window pool where it still held them
    assert st["staged_rows_near"] > 0
    # the sparse layers decoded from hot buffers (one set a request it can run): chunks loaded and kept across steps
    assert st["hot_rows_hit"] > st["hot_rows_loaded"] > 0
    assert res["counts"]["complete"]["sent"] > 0 and st["sparse_steps"] > 0 and st["grafts"] > 0
    assert st["requested_dense_steps"] > 0   # requests that asked for dense decoding (custom_params) got it
    # the second of two requests over one prefix, sent one after the other, adopted the first's cached index (a
    # shared segment) and clustered only its own chunks: under the load two such requests may share a prefill batch
    assert res["shared_prefix_pair"] == {"index_builds": [1], "index_reused": [1], "index_extends": [1]}


@pytest.mark.e2e
@pytest.mark.parametrize("select", [{}, {"select_every": 4, "select_ahead": True}])
def test_host_tier_window_pool_for_fewer_requests_than_arrive(smollm2_dir, select):
    """At its defaults the tier's window pool holds the windows of the requests it runs, here 2: 2 x (256 + 256 +
    130) + 2 x 256 = 1,796 slots (host_tier.window_slots), where 6 prompts of 0.9-1.6K tokens arrive at once. They
    queue for room, all finish, and their greedy tokens past the budget equal plain lychee's. Also with selection
    every 4th step, one step ahead (both servers): the tier then loads beside the attention what the lists for the
    next 4 steps miss."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(rng.randrange(900, 1600))] for _ in range(6)]
    outputs = {}
    tier = ["--max-running-requests", "2", "--chunked-prefill-size", "256"]
    for name, cfg, extra in (("tier", {"host_tier": True, "host_window": 256}, tier), ("plain", {}, [])):
        extra = ["--max-total-tokens", "16384", *extra]
        server = Server(smollm2_dir, "lychee", {"token_budget": 256, **select, **cfg}, extra=extra)
        with server as srv, ThreadPoolExecutor(len(prompts)) as pool:
            outputs[name] = list(pool.map(lambda p: srv.generate_ids(p, 40, ignore_eos=True)["output_ids"], prompts))
            if name == "tier":
                st = srv.stats()
                assert st["window_slots"] == 1796 < sum(map(len, prompts)) and st["sparse_steps"] > 0
                assert (st["reused_list_steps"] > 0) == bool(select)
    assert outputs["tier"] == outputs["plain"]
