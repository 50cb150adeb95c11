"""The two-stage selection's kernels on the GPU, one by one: the score kernel (keys of the candidates, softmax
statistics) at 8, 16 and 32 programs per list, and the keep kernel (threshold and compaction), each replayed from a
CUDA graph at Llama-3.1-8B's group shape (8 KV heads, 4 query heads each, d 128, bf16), budget 1024,
``rerank_factor`` 2 (1968 candidates per list over a 32K-token KV buffer per request).

    python3 -m bench.rerank_kernels --out rerank.json [--batches 1 4 16]

``parts_used`` marks the row of the part count that ``rerank_tokens`` picks for that batch (``parts_for``).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from bench.bench_kernels import D, H, HQ, graph_bench
from sgl_sparsekv.kernels import rerank as kr

SINK, RECENT, BUDGET, CTX = 16, 64, 1024, 32768


def candidates(bs: int, factor: int = 2):
    """Random keys; per (request, KV head) a list [sink | sorted random middle slots | recent window]."""
    keep = BUDGET - SINK - RECENT
    cap_c = BUDGET + (factor - 1) * keep
    k = torch.randn(bs * CTX, H, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(bs, HQ, D, device="cuda", dtype=torch.bfloat16)
    mid = torch.rand(bs * H, CTX - SINK - RECENT, device="cuda").argsort(-1)[:, :cap_c - SINK - RECENT].sort(-1).values
    base = (torch.arange(bs * H, device="cuda") // H * CTX)[:, None]
    lists = torch.cat([torch.arange(SINK, device="cuda").expand(bs * H, -1), mid + SINK,
                       torch.arange(CTX - RECENT, CTX, device="cuda").expand(bs * H, -1)], 1) + base
    lens = torch.full((bs * H,), cap_c, dtype=torch.int32, device="cuda")
    return q, k, (lens, lists.int().flatten()), torch.full((bs,), CTX, dtype=torch.int32, device="cuda"), keep, cap_c


def rows_for(bs: int) -> list[dict]:
    q, k, (lens, wins), seq, keep, cap_c = candidates(bs)
    heads = torch.arange(H, dtype=torch.int32, device="cuda")
    logits, stats = kr.workspace_for(bs, H, HQ // H, cap_c, "cuda")
    out = (torch.empty(bs * H, dtype=torch.int32, device="cuda"),
           torch.empty(bs * H * BUDGET, dtype=torch.int32, device="cuda"))
    G, bg = HQ // H, kr.group_block(HQ // H)
    rows = []
    for parts in (8, 16, 32):
        def score():
            kr._score_kernel[(bs * H, parts)](q, k, wins, lens, logits, stats, heads, H, D ** -0.5, q.stride(0),
                                              q.stride(1), k.stride(0), k.stride(1), H=H, G=G, BLOCK_G=bg, D=D,
                                              BLOCK_D=D, CAPC=cap_c, BLOCK_N=kr.SCORE_BLOCK, PARTS=parts)

        def keep_best():
            kr._keep_kernel[(bs * H,)](wins, lens, logits, stats, seq, out[1], out[0], heads, H, BUDGET, SINK, RECENT,
                                       keep, H=H, G=G, BLOCK_G=bg, CAPC=cap_c, CAP=BUDGET,
                                       BLOCK=triton.next_power_of_2(cap_c), PARTS=parts, num_warps=8)

        rows.append({"bs": bs, "lists": bs * H, "candidates_per_list": cap_c, "parts": parts,
                     "parts_used": parts == kr.parts_for(bs * H),
                     "score_ms": round(graph_bench(score), 4), "keep_ms": round(graph_bench(keep_best), 4)})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "rows": []}
    for bs in a.batches:
        for row in rows_for(bs):
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
