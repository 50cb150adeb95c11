"""Host-to-device copies of the rows a selection misses, on the GPU (8 KV heads, D 128, bf16, K and V).

    python -m bench.bench_host_copy --out bench/results/host_copy_h100.json

A host tier loads, per sparse layer and step, the chunks that a request's selection needs and its device buffer
lacks: many runs of 1-16 rows of one KV head, scattered over a large pinned pool. Four ways to do it, each timed
over the same runs (``J`` runs of ``n`` rows), against one contiguous copy of the same bytes (the link's peak):
  - ``kernel_uva``: kernels/host_copy.py, one launch whose programs read the pinned pool through unified addressing;
  - ``kernel_graph``: the same launch replayed from a CUDA graph (what a captured decode step would pay);
  - ``memcpy_per_run``: one ``cudaMemcpyAsync`` per run and tensor (copy engine, a host call each);
  - ``gather_then_copy``: the host gathers the runs into pinned staging, one copy, a device scatter.
And, for scale, ``kernel_device``: the kernel over a device-resident pool (HBM). Times are wall-clock medians
from the host's launch to the copies' end (CUDA events around a synchronized region), except ``kernel_graph``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from bench.bench_kernels import graph_bench
from sgl_sparsekv.kernels.host_copy import copy_runs

H, D = 8, 128
DTYPE = torch.bfloat16


def wall_ms(fn, reps: int = 20) -> float:
    """Median over ``reps`` of the time from issuing ``fn`` to the stream finishing it (host work included)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def random_runs(J: int, n: int, pool_rows: int, buf_rows: int, gen: torch.Generator) -> torch.Tensor:
    """J runs of n rows: a random head, a random n-aligned source, destinations packed per head (a buffer's rows)."""
    head = torch.randint(H, (J,), generator=gen)
    src = torch.randint(pool_rows // n, (J,), generator=gen) * n
    dst = torch.zeros(J, dtype=torch.int64)
    for h in range(H):
        idx = (head == h).nonzero().flatten()
        dst[idx] = (torch.arange(idx.numel()) * n) % (buf_rows - n + 1)
    return torch.stack([head, src, dst, torch.full((J,), n)], 1).to(torch.int32)


def case(host_k, host_v, dev_k, dev_v, buf_k, buf_v, J: int, n: int, gen) -> dict:
    runs_cpu = random_runs(J, n, host_k.shape[1], buf_k.shape[1], gen)
    runs = runs_cpu.cuda()
    count = torch.tensor([J], dtype=torch.int32, device="cuda")
    nbytes = 2 * J * n * D * host_k.element_size()
    out = {"runs": J, "rows": n, "mbytes": nbytes / 2**20}

    out["kernel_uva"] = wall_ms(lambda: copy_runs(host_k, host_v, buf_k, buf_v, runs, count))
    out["kernel_graph"] = graph_bench(lambda: copy_runs(host_k, host_v, buf_k, buf_v, runs, count))
    out["kernel_device"] = wall_ms(lambda: copy_runs(dev_k, dev_v, buf_k, buf_v, runs, count))

    plan = runs_cpu.tolist()

    def per_run():
        for h, s, d, m in plan:
            buf_k[h, d:d + m].copy_(host_k[h, s:s + m], non_blocking=True)
            buf_v[h, d:d + m].copy_(host_v[h, s:s + m], non_blocking=True)
    out["memcpy_per_run"] = wall_ms(per_run, reps=5)

    # the rows as flat (head, row) indexes of the pools
    rows = torch.arange(n)
    src_flat = (runs_cpu[:, :1].long() * host_k.shape[1] + runs_cpu[:, 1:2].long() + rows).flatten()
    dst_flat = (runs_cpu[:, :1].long() * buf_k.shape[1] + runs_cpu[:, 2:3].long() + rows).flatten().cuda()
    stage = torch.empty(2, src_flat.numel(), D, dtype=DTYPE, pin_memory=True)
    flat_k, flat_v = host_k.view(-1, D), host_v.view(-1, D)

    def gather_then_copy():
        torch.index_select(flat_k, 0, src_flat, out=stage[0])
        torch.index_select(flat_v, 0, src_flat, out=stage[1])
        dev = stage.to("cuda", non_blocking=True)
        buf_k.view(-1, D).index_copy_(0, dst_flat, dev[0])
        buf_v.view(-1, D).index_copy_(0, dst_flat, dev[1])
    out["gather_then_copy"] = wall_ms(gather_then_copy, reps=5)

    bulk_src = torch.empty(nbytes // 2, dtype=torch.uint8, pin_memory=True)
    bulk_dst = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")

    def bulk():
        bulk_dst.copy_(bulk_src, non_blocking=True)
        bulk_dst.copy_(bulk_src, non_blocking=True)
    out["bulk_copy"] = wall_ms(bulk)
    for k in ("kernel_uva", "kernel_graph", "memcpy_per_run", "gather_then_copy", "bulk_copy"):
        out[f"{k}_gbs"] = nbytes / out[k] / 1e6
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--pool-rows", type=int, default=1 << 18, help="host pool rows per KV head")
    ap.add_argument("--runs", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    host_k, host_v = (torch.randn(H, a.pool_rows, D, generator=gen).to(DTYPE).pin_memory() for _ in range(2))
    dev_k, dev_v = host_k.cuda(), host_v.cuda()
    buf_rows = max(a.runs) * max(a.rows) // H * 2
    buf_k, buf_v = (torch.empty(H, buf_rows, D, dtype=DTYPE, device="cuda") for _ in range(2))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "heads": H, "head_dim": D, "dtype": str(DTYPE), "pool_rows": a.pool_rows, "cases": []}
    for J in a.runs:
        for n in a.rows:
            res["cases"].append(c := case(host_k, host_v, dev_k, dev_v, buf_k, buf_v, J, n, gen))
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in c.items()}), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
