"""bench.serving_profile's reduction of a trace to per-step kernel time, on a hand-made trace."""

import pytest

from bench.serving_profile import host_profile, kind_of, our_folders, step_profile


def _kernel(name, ts, dur, corr, cat="kernel"):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _launch(ts, corr):
    return {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5, "args": {"correlation": corr}}


def _two_replays(kernels):
    """Two graph replays 1000 us apart, each running ``kernels`` (name, start in us, duration, stream)."""
    events = []
    for corr, t in ((1, 0), (2, 1000)):
        events.append(_launch(t - 50, corr))
        for name, start, dur, stream in kernels:
            events.append(_kernel(name, t + start, dur, corr))
            events[-1]["args"]["stream"] = stream
    return events


def test_step_profile_splits_replays_and_counts_idle_and_eager_work():
    # three replays (correlations 1, 2, 3) 1000 us apart; each runs a GEMM, a selection and a sparse attention
    # kernel back to back; before the second one, an eager graft kernel and a copy launched by the host
    events = []
    for i, corr in enumerate((1, 2, 3)):
        t = 1000 * i
        events += [_launch(t - 50, corr), _kernel("nvjet_tst_128x64", t, 300, corr),
                   _kernel("_fine_bounds_kernel", t + 300, 100, corr), _kernel("_partial_kernel", t + 400, 200, corr)]
    events += [_kernel("_graft_kernel", 700, 50, 90), _kernel("Memcpy HtoD (Pinned -> Device)", 760, 20, 91,
                                                                 cat="gpu_memcpy")]
    got = step_profile(events)
    assert got["steps"] == 2 and got["kernels_in_graph"] == [3]
    assert got["period"] == pytest.approx(1.0)
    assert got["graph_span"] == pytest.approx(0.6)
    assert got["matmul"] == pytest.approx(0.3)
    assert got["selection"] == pytest.approx(0.1)
    assert got["sparse_attention"] == pytest.approx(0.2)
    # step 1's window [0, 1000) holds the graph's 600 us and the graft and copy (70 us); step 2's only 600 us
    assert got["outside_graph"] == pytest.approx(0.035)
    assert got["idle"] == pytest.approx((0.33 + 0.4) / 2)
    assert list(got["top_kernels_ms"]) == ["nvjet_tst_128x64", "_partial_kernel", "_fine_bounds_kernel"]
    assert got["top_outside_ms"] == {"_graft_kernel": 0.025, "Memcpy HtoD (Pinned -> Device)": 0.01}
    assert got["top_waits_before_ms"] == {"_partial_kernel": 0.1}   # behind the selection inline before it


def test_step_profile_times_selection_beside_the_other_kernels_and_its_tail():
    # two replays 1000 us apart: a GEMM then an attention kernel with a 100 us gap between them; beside them (on
    # streams the driver picks, here the GEMM's for one) two selection kernels, one inside the GEMM, one running past
    # the attention's end
    got = step_profile(_two_replays([("nvjet_tst", 0, 300, 7), ("_partial_kernel", 400, 200, 9),
                                     ("_fine_bounds_kernel", 100, 100, 7), ("_cut_kernel", 500, 250, 9)]))
    assert got["steps"] == 1 and got["period"] == pytest.approx(1.0)
    assert got["others_busy"] == pytest.approx(0.5)
    assert got["selection_busy"] == pytest.approx(0.35)
    assert got["selection_beside_others"] == pytest.approx(0.2)   # 100-200 beside the GEMM, 500-600 beside attention
    assert got["selection_tail"] == pytest.approx(0.15)           # 600-750: the attention ended at 600
    assert got["others_waited"] == pytest.approx(0.1)             # 300-400, between the GEMM and the attention
    assert got["others_waited_behind_selection"] == 0.0           # the cut started at 500: nothing queued behind it
    assert got["others_waited_beside_selection"] == 0.0           # and no selection ran in 300-400
    assert got["idle"] == pytest.approx(1.0 - 0.65)               # busy 0-300, 400-750
    assert got["selection"] == pytest.approx(0.35)


def test_step_profile_refuses_a_window_without_two_replays():
    with pytest.raises(ValueError, match="1 CUDA-graph replays"):
        step_profile([_launch(0, 1), _kernel("x", 10, 5, 1)])


@pytest.mark.parametrize("name,kind", [("_emit_write_kernel", "selection"), ("_merge_kernel", "sparse_attention"),
                                       ("_graft_kernel", "index_upkeep"), ("void flashinfer::BatchDecodeWithPaged",
                                                                           "dense_attention"),
                                       ("sm90_xmma_gemm_bf16", "matmul"), ("rms_norm_kernel", "other"),
                                       ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>", "other")])
def test_kernel_kinds(name, kind):
    assert kind_of(name) == kind


def test_host_profile_sums_our_functions_and_cuda_calls():
    # the profiler names a file relative to its sys.path entry or by its absolute path; another package's kernels/
    # folder is not ours
    folders = ("/repo/sgl_sparsekv/", "/repo/kernels/", "/repo/patches/")
    events = [{"cat": "python_function", "name": "sgl_sparsekv/manager.py(452): _pool_index", "dur": 3000},
              {"cat": "python_function", "name": "kernels/kmeans.py(46): nearest_centroid", "dur": 500},
              {"cat": "python_function", "name": "/repo/kernels/kmeans.py(46): nearest_centroid", "dur": 700},
              {"cat": "python_function", "name": "/site/other/kernels/kmeans.py(46): nearest_centroid", "dur": 70},
              {"cat": "python_function", "name": "sglang/srt/managers/scheduler.py(10): run_batch", "dur": 9000},
              {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "dur": 2500},
              {"cat": "cuda_driver", "name": "cuModuleLoadData", "dur": 800},
              {"cat": "cpu_op", "name": "aten::sort", "dur": 100}]
    got = host_profile(events, folders)
    assert got["python_ms"] == {"sgl_sparsekv/manager.py(452): _pool_index": 3.0,
                                "kernels/kmeans.py(46): nearest_centroid": 1.2}
    assert got["cuda_api_ms"] == {"cudaStreamSynchronize": 2.5, "cuModuleLoadData": 0.8}
    assert got["torch_ops_ms"] == {"aten::sort": 0.1}


def test_our_folders_are_the_installed_sources():
    assert [f.rstrip("/").rsplit("/", 1)[1] for f in our_folders()] == ["sgl_sparsekv", "kernels", "patches"]


def test_step_profile_tells_a_wait_behind_a_selection_on_the_same_stream():
    # the attention (no dependency on the selection) waits 100 us for the GEMM's end, then starts right as a
    # selection kernel on its own stream ends: the part after the GEMM is counted as queued behind the selection
    got = step_profile(_two_replays([("nvjet_tst", 0, 300, 7), ("_cut_kernel", 250, 150, 9),
                                     ("_partial_kernel", 401, 200, 9), ("_merge_kernel", 620, 30, 7)]))
    assert got["others_waited"] == pytest.approx(0.101 + 0.019)
    assert got["others_waited_behind_selection"] == pytest.approx(0.101)
    assert got["others_waited_beside_selection"] == pytest.approx(0.1)   # the cut ran 300-400 of the first wait
    assert got["selection_tail"] == 0.0


def test_step_profile_tells_a_wait_beside_a_selection_on_another_stream():
    # the attention waits 90 us after the GEMM on stream 7 while a selection of many waves runs on stream 9 until
    # 380: not queued behind it on its stream, yet 80 us of the wait ran beside it
    got = step_profile(_two_replays([("nvjet_tst", 0, 300, 7), ("_fine_bounds_kernel", 200, 180, 9),
                                     ("_partial_kernel", 390, 100, 7)]))
    assert got["others_waited"] == pytest.approx(0.09)
    assert got["others_waited_behind_selection"] == 0.0
    assert got["others_waited_beside_selection"] == pytest.approx(0.08)
    assert got["top_waits_before_ms"] == {"_partial_kernel": 0.09}


def test_replay_timeline_lists_the_middle_replay_kernel_by_kernel():
    from bench.serving_profile import replay_timeline

    events = _two_replays([("nvjet_tst", 0, 300, 7), ("_cut_kernel", 250, 150, 9)])
    events += [_launch(1950, 3), _kernel("nvjet_tst", 2000, 310, 3)]
    events[-1]["args"]["stream"] = 7
    # three replays: the middle one starts at 1000
    assert replay_timeline(events) == [[0, 300, 7, "matmul", "nvjet_tst"], [250, 150, 9, "selection", "_cut_kernel"]]
