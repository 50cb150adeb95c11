"""Launch parameters of the selection kernels, swept on the GPU: the tiles ``kernels/select.py`` uses were chosen here.

    python3 -m bench.tile_sweep --out $OUT/tiles.json [--size 1] [--expand 32] [--kernels fine_bounds cut emit] [--box]
        [--batches 16 1]

For the fine bounds (rows per tile, programs per list, warps), the cut (register tile, warps) and emission (chunks
per tile, programs per list, warps), each setting's GPU time from CUDA graph replays at 32K tokens, batch 16 and 1
(``--batches``), all 8 KV heads retrieving (Llama-3.1-8B attention shape, budget 1024, random unit keys as in
``bench_kernels``, ``--size`` chunks per fine cluster: 1, the default (the fine bounds' tiles were chosen at it), or
2, the default when the cut's and emission's were; ``--expand`` the coarse expansion, by default the config's: it
sets how many fine clusters get bounds; ``--box``: the fine bounds rank boxes, as ``fine_bound`` "box" does).
The tiles only split the same work among programs: every setting computes the same bounds, selection and lists.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from itertools import product

import torch

from bench.bench_kernels import D, EXPAND, FINE, H, HQ, graph_bench, selection_case
from sgl_sparsekv.kernels import select as ks
from sgl_sparsekv.patches.pooled_decode import parts_for

BUDGET, SINK, RECENT = 1024, 16, 64


def sweep(bs: int, ctx: int, size: float, expand: float, kernels: list[str], box: bool) -> list[dict]:
    c = selection_case(bs, ctx, BUDGET, SINK, RECENT, fine_cluster_size=size, box=box)
    ftok = c["fine"][2]
    cfine, cstart, clen = c["chunks"]
    ranges = c["ranges"]
    st = ranges.stride(0)
    q, rem, seq, r2t, rows = c["q"], c["rem"], c["seq"], c["req_to_token"], c["rows"]
    bnd, sel = c["scratch"]
    heads = ks.all_heads(H, "cuda")
    expanded = ks.coarse_expand(q, c["coarse"], ranges, rem, expand, heads, 0.25)
    # the step's bounds and picks, as the server's launches compute them: the cut reads the bounds and emission the
    # picks, whichever kernels are swept (without this, a sweep of the cut alone read a fresh scratch's garbage)
    ks.select_fine(q, c["coarse"], c["fine"], ranges, rem, expand, parts=parts_for(bs), out=(bnd, sel),
                   radius_weight=0.25, heads=heads, box=c["box"])
    rows_out = []
    settings = product((16, 32, 64, 128), (8, 16, 32, 64, 128), (1, 2, 4)) if "fine_bounds" in kernels else ()
    for tile, parts, warps in settings:
        def bounds():
            ks.fine_bounds(q, c["fine"], ranges, expanded, bnd, heads, 0.25, parts, block_l=tile, num_warps=warps,
                           box=c["box"])
        rows_out.append({"bs": bs, "k": "fine_bounds", "BLOCK_L": tile, "parts": parts, "warps": warps,
                         "ms": round(graph_bench(bounds), 4)})
    for warps in (4, 8, 16, 32) if "cut" in kernels else ():
        for tile in (16384, 8192, 4096):
            def cut():
                ks._cut_kernel[(bs * H,)](bnd, ftok, ranges, st, rem, sel, sel.stride(0), heads, H, H=H, BLOCK=tile,
                                          BAND=ks.CUT_BAND, BAND_KEYS=ks.CUT_BAND_KEYS,
                                          VALUE_STEPS=ks.CUT_VALUE_STEPS, num_warps=warps)
            rows_out.append({"bs": bs, "k": "cut", "BLOCK": tile, "warps": warps, "ms": round(graph_bench(cut), 4)})
    lens = torch.empty(bs * H, dtype=torch.int32, device="cuda")
    list_rows, fresh = ks.every_row_fresh(bs, "cuda")
    windows = torch.empty(bs * H * BUDGET, dtype=torch.int32, device="cuda")
    for tile in (32, 64, 128, 256) if "emit" in kernels else ():
        for parts in (8, 16, 32, 64, 128):
            for warps in (2, 4, 8):
                counts = torch.empty(bs * H * parts, dtype=torch.int32, device="cuda")

                def count():
                    ks._emit_count_kernel[(bs * H, parts)](sel, sel.stride(0), cfine, cstart, clen, ranges, st, seq,
                                                           fresh, counts, heads, H, BUDGET, SINK, RECENT, H=H,
                                                           BLOCK_M=tile, PARTS=parts, num_warps=warps)

                def write():
                    ks._emit_write_kernel[(bs * H, parts)](
                        sel, sel.stride(0), cfine, cstart, clen, ranges, st, rows, seq, fresh, list_rows, r2t, counts,
                        windows, lens, heads, H, r2t.stride(0), BUDGET, SINK, RECENT, H=H, CAP=BUDGET, BLOCK_M=tile,
                        BLOCK_T=64, MAXLEN=16, PARTS=parts, num_warps=warps)
                t1, t2 = graph_bench(count), graph_bench(write)
                rows_out.append({"bs": bs, "k": "emit", "BLOCK_M": tile, "parts": parts, "warps": warps,
                                 "count_ms": round(t1, 4), "write_ms": round(t2, 4), "ms": round(t1 + t2, 4)})
    return rows_out


# each kernel's swept launch settings
KEYS = {"fine_bounds": ("BLOCK_L", "parts", "warps"), "cut": ("BLOCK", "warps"), "emit": ("BLOCK_M", "parts", "warps")}


def best(rows: list[dict], kernel: str, keys: tuple[str, ...]) -> list:
    """Settings of one kernel by their summed time over the batch sizes, fastest first."""
    per = defaultdict(dict)
    for r in rows:
        if r["k"] == kernel:
            per[tuple(r[k] for k in keys)][r["bs"]] = r["ms"]
    return sorted(per.items(), key=lambda kv: sum(kv[1].values()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--size", type=float, default=FINE, help="fine_cluster_size")
    ap.add_argument("--expand", type=float, default=EXPAND, help="coarse_expand")
    ap.add_argument("--kernels", nargs="+", default=list(KEYS), choices=list(KEYS), help="the kernels to sweep")
    ap.add_argument("--box", action="store_true", help="fine bounds over boxes (fine_bound box)")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 1])
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "context": a.context, "fine_cluster_size": a.size,
           "coarse_expand": a.expand, "box": a.box, "rows": []}
    for bs in a.batches:
        res["rows"] += sweep(bs, a.context, a.size, a.expand, a.kernels, a.box)
        with open(a.out, "w") as f:
            json.dump(res, f)
    for kernel in a.kernels:
        print(kernel, KEYS[kernel], best(res["rows"], kernel, KEYS[kernel])[:3])


if __name__ == "__main__":
    main()
