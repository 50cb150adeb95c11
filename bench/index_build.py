"""GPU time of building one prompt's index for every sparse layer (what ``finish_extend`` runs after a prefill).

    python3 -m bench.index_build --out $OUT/index_build.json [--contexts 8192 32768 129024] [--sizes 1 2]

Llama-3.1-8B shape (30 sparse layers x 8 KV heads, d 128), chunks of 8-16 tokens, 10 k-means iterations,
all layers in one ``build_index_grouped`` call, at each average fine cluster size of ``--sizes`` (at 1 only the
coarse level runs k-means). The k-means steps run either in ``kernels/kmeans.py`` (the GPU
path) or as their torch twins (the similarity matrix, then argmax; scatter_add sums), in the same run on the
same card; also the peak of extra GPU memory the build allocates.
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch

from sgl_sparsekv import index as index_mod
from sgl_sparsekv.index import build_index_grouped, cluster_counts
from sgl_sparsekv.kernels.kmeans import cluster_sums_ref, nearest_centroid_ref

LAYERS, H, D = 30, 8, 128


def timed_build(keys, lens, size, reps=3, max_bytes=1 << 30):
    def build():
        build_index_grouped(keys, lens, size, 64, 10, max_bytes=max_bytes)

    build()   # warm-up (compiles)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        build()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / reps, 2), round((torch.cuda.max_memory_allocated() - base) / 2**20)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 129024])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1.0, 2.0], help="fine_cluster_size values")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for ctx in a.contexts:
        lens = torch.randint(8, 17, (ctx // 12,), generator=gen)
        lens = lens[:int((lens.cumsum(0) <= ctx).sum())].cuda()
        keys = torch.nn.functional.normalize(torch.randn(LAYERS * H, len(lens), D, generator=gen), dim=-1).cuda()
        for size in a.sizes:
            kernel_ms, kernel_mb = timed_build(keys, lens, size)
            # the twin's heads grouped as on the CPU path: one group's similarity matrix within 1 GiB
            L, _ = cluster_counts(len(lens), size, 64)
            with mock.patch.object(index_mod, "nearest_centroid", nearest_centroid_ref), \
                    mock.patch.object(index_mod, "cluster_sums", cluster_sums_ref):
                twin_ms, twin_mb = timed_build(keys, lens, size, max_bytes=(1 << 30) * 4 * D // L)
            rows.append({"context": ctx, "chunks": len(lens), "fine_cluster_size": size, "kernel_ms": kernel_ms,
                         "torch_twin_ms": twin_ms, "speedup": round(twin_ms / kernel_ms, 2),
                         "kernel_extra_mib": kernel_mb, "torch_twin_extra_mib": twin_mb})
            print(json.dumps(rows[-1]), flush=True)
    res = {"device": torch.cuda.get_device_name(), "shape": f"{LAYERS} sparse layers x {H} KV heads, d {D}",
           "kmeans_iters": 10, "builds": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
