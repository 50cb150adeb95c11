"""Triton compiles inside index placement: host ms of each build and extend on a fresh Triton cache.

    python3 -m bench.kmeans_compile {specialized|unspecialized|precompiled} [--old-kernels FILE]

A 4165-chunk build (bench_serving's 36.5K-token text prefix) twice, then extends of 120-160 chunks and a few small
ones, over 240 heads (Llama-3.1-8B: 30 sparse layers x 8 KV heads), each timed to the GPU's end. ``unspecialized``:
the k-means kernels as they are; ``precompiled``: after the k-means the manager runs at startup
(``index.precompile_build``, eight unit keys); ``specialized``: with the kernels of a67de4a, which specialized on the
chunk and cluster counts (``git show a67de4a:kernels/kmeans.py > FILE``). Run each mode in its own process: the
cache is a fresh folder per process. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()   # before triton is imported

import torch  # noqa: E402

import sgl_sparsekv.index as index  # noqa: E402
from sgl_sparsekv.config import SparseKVConfig  # noqa: E402


CFG = SparseKVConfig()   # the default lychee index: one chunk per fine cluster, 64 coarse units, 10 iterations


def timed_build(n: int) -> float:
    keys = torch.nn.functional.normalize(torch.randn(240, n, 128, device="cuda"), dim=-1)
    lens = torch.full((n,), 9, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    index.build_index_grouped(keys, lens, CFG.fine_cluster_size, CFG.max_coarse, CFG.kmeans_iters)
    torch.cuda.synchronize()
    return round(1000 * (time.perf_counter() - t), 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["specialized", "unspecialized", "precompiled"])
    ap.add_argument("--old-kernels", help="a67de4a's kernels/kmeans.py (mode specialized)")
    a = ap.parse_args()
    if a.mode == "specialized":
        spec = importlib.util.spec_from_file_location("kmeans_old", a.old_kernels)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        index.nearest_centroid, index.cluster_sums = old.nearest_centroid, old.cluster_sums
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    if a.mode == "precompiled":
        index.precompile_build(128, "cuda", CFG.fine_cluster_size, CFG.max_coarse, CFG.kmeans_iters)
        torch.cuda.synchronize()
    pre = time.perf_counter() - t
    rng = random.Random(0)
    sizes = [4165, 4165] + [rng.randrange(120, 161) for _ in range(14)] + [128, 144, 16, 1, 2, 3]
    times = [(n, timed_build(n)) for n in sizes]
    files = sum(len(f) for _, _, f in os.walk(os.environ["TRITON_CACHE_DIR"]))
    print(json.dumps({"mode": a.mode, "device": torch.cuda.get_device_name(), "precompile_ms": round(1000 * pre, 1),
                      "total_ms": round(sum(ms for _, ms in times), 1), "cache_files": files, "times": times}))


if __name__ == "__main__":
    main()
