"""Kernel microbenchmarks on the GPU (Llama-3.1-8B attention shape: 32 q / 8 kv heads, d 128, bf16).

    python -m bench.bench_kernels --out bench/results/kernels_h200.json

Per decode layer at context 8K-126K and batch 1/8/32:
  - dense decode baselines measured here: SGLang's Triton decode kernel and FlashInfer's paged decode;
  - sparse decode attention (kernels/sparse_decode.py) at budget 1024 and 2048;
  - lychee selection cost: the fused kernels of kernels/select.py (coarse expansion, fine pick,
    token-list emission), i.e. the whole per-layer retrieval, and that plus the attention (``sparse_layer_ms``),
    launched one by one and replayed from a CUDA graph (``*_graph_ms``, what the server's decode pays);
  - index build (kernels/pool.py + spherical k-means) for one layer vs. one prefill layer of the same
    model measured in the same run (causal SDPA + the layer's matmuls at that context).
Prints ratios against the dense baselines of the same run; every number is a median of do_bench.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import triton

from bench.packing import over_shared, pack, pack_box
from sgl_sparsekv.config import SparseKVConfig
from sgl_sparsekv.index import build_index
from sgl_sparsekv.kernels.pool import pool_units
from sgl_sparsekv.kernels.select import emit_tokens, scratch, scratch_rows, select_fine
from sgl_sparsekv.kernels.sparse_decode import sparse_decode_attention, workspace_for

HQ, H, D = 32, 8, 128
FINE = SparseKVConfig().fine_cluster_size   # chunks per fine cluster of the default config (kernels_h200.json: 2)
EXPAND = SparseKVConfig().coarse_expand   # coarse expansion of the default config
HIDDEN, FFN = 4096, 14336


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def graph_bench(fn, reps: int = 10) -> float:
    """GPU time of ``fn`` replayed from a CUDA graph (as the server runs decode): no launch overhead."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return bench(graph.replay) / reps


def splits_for(bs: int, n: int) -> int:
    return max(1, min(32, math.ceil(2 * 132 / (bs * H)), math.ceil(n / 64)))


def dense_triton(q, k, v, indptr, indices):
    from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd

    bs = q.shape[0]
    splits = 16
    logits = torch.empty(bs, HQ, splits, D, dtype=torch.float32, device="cuda")
    lse = torch.empty(bs, HQ, splits, dtype=torch.float32, device="cuda")
    nsplit = torch.full((bs,), splits, dtype=torch.int32, device="cuda")
    o = torch.empty_like(q)
    return lambda: decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, nsplit, splits, D ** -0.5, 1.0, 1.0)


def dense_flashinfer(q, k, v, indptr, indices):
    import flashinfer

    bs = q.shape[0]
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    w.plan(indptr, indices, torch.ones(bs, dtype=torch.int32, device="cuda"), HQ, H, D, 1,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    kc, vc = k.view(-1, 1, H, D), v.view(-1, 1, H, D)
    return lambda: w.run(q, (kc, vc))


def selection_case(bs, ctx, budget, sink=16, recent=64, shared: bool = False, fine_cluster_size: float = FINE,
                   box: bool = False) -> dict:
    """A batch of ``bs`` requests of ``ctx`` tokens on the GPU as the pooled path holds it: packed indexes over
    random unit keys (8-16-token chunks, ``fine_cluster_size`` per fine cluster on average), queries, budgets,
    lengths, request rows, and a key buffer. ``shared``:
    every request adopted one prefix of ``ctx - 256`` tokens (one shared segment) and owns an index of its last 256
    tokens; else each owns an index of all its tokens. ``box``: fine boxes too (``box``, over made-up chunk key
    bounds)."""
    own_tokens = 256 if shared else ctx
    indexes, starts, lens = [], [], []

    def add(n_tokens, first):
        M = n_tokens // 12
        keys = torch.nn.functional.normalize(torch.randn(H, M, D, device="cuda"), dim=-1)
        ln = torch.randint(8, 17, (M,), device="cuda")
        spread = torch.rand(H, M, 2, D, device="cuda")
        bounds = torch.stack([keys - spread[:, :, 0], keys + spread[:, :, 1]], 2) if box else None
        indexes.append(build_index(keys, ln, fine_cluster_size, 64, 3, bounds))
        starts.append(torch.cumsum(ln, 0) - ln + first)
        lens.append(ln)

    if shared:
        add(ctx - own_tokens, sink)
    for _ in range(bs):
        add(own_tokens, int(starts[0][-1] + lens[0][-1]) if shared else sink)
    coarse, fine, chunks, packed = pack(indexes, starts, lens, "cuda")
    ranges = over_shared(packed) if shared else packed
    seq = [int(s[-1] + l[-1]) + 8 for s, l in zip(starts[len(indexes) - bs:], lens[len(indexes) - bs:])]
    # random chunk lengths sum past ctx at times: rows as long as the longest sequence, or emission reads past them
    width = max(seq)
    return dict(
        coarse=coarse, fine=fine, chunks=chunks, ranges=ranges.contiguous(), box=pack_box(indexes, "cuda") if box else None,
        scratch=scratch(scratch_rows(ranges, ranges.shape[1]), H, "cuda"),
        q=torch.randn(bs, HQ, D, device="cuda", dtype=torch.bfloat16),
        rem=torch.full((bs,), budget - sink - recent, dtype=torch.int32, device="cuda"),
        seq=torch.tensor(seq, dtype=torch.int32, device="cuda"),
        req_to_token=torch.arange(bs * width, dtype=torch.int32, device="cuda").view(bs, width),
        rows=torch.arange(bs, dtype=torch.int32, device="cuda"),
        k=torch.randn(bs * width + 1, H, D, device="cuda", dtype=torch.bfloat16),
        list_starts=torch.arange(bs * H, dtype=torch.int32, device="cuda") * budget,
        workspace=workspace_for(bs, H, HQ // H, D, 8, "cuda"))


def fused_selection_ms(bs, ctx, budget, sink=16, recent=64):
    """kernels/select.py (coarse expansion + fine pick + token-list emission) for real index sizes, alone and
    followed by the sparse attention over the emitted lists: the whole sparse decode layer of the pooled path."""
    c = selection_case(bs, ctx, budget, sink, recent)
    coarse, fine, chunks, ranges = c["coarse"], c["fine"], c["chunks"], c["ranges"]
    q, rem, seq, req_to_token, rows, k = c["q"], c["rem"], c["seq"], c["req_to_token"], c["rows"], c["k"]
    starts, ws = c["list_starts"], c["workspace"]

    def select():
        sel = select_fine(q, coarse, fine, ranges, rem, EXPAND, parts=32, out=c["scratch"])
        return emit_tokens(sel, chunks, ranges, rows, seq, req_to_token, sink, recent, budget, dense_limit=budget,
                           parts=32)

    def layer():
        lens_out, windows = select()
        return sparse_decode_attention(q, k, k, starts, windows, D ** -0.5, workspace=ws, lens=lens_out)

    return bench(select), bench(layer), graph_bench(select), graph_bench(layer)


def prefill_layer_ms(ctx):
    x = torch.randn(ctx, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w_qkv = torch.randn(HIDDEN, (HQ + 2 * H) * D, device="cuda", dtype=torch.bfloat16)
    w_o = torch.randn(HQ * D, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w_up = torch.randn(HIDDEN, 2 * FFN, device="cuda", dtype=torch.bfloat16)
    w_down = torch.randn(FFN, HIDDEN, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, HQ, ctx, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, H, ctx, D, device="cuda", dtype=torch.bfloat16)

    def run():
        x @ w_qkv
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        x @ w_o
        h = x @ w_up
        h[:, :FFN] @ w_down

    return bench(run)


def index_build_ms(ctx):
    units = ctx // 12
    k = torch.randn(ctx + 1, H, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.randint(8, 17, (units,), device="cuda")
    lens = (lens * ctx // int(lens.sum())).clamp_min(1)
    indptr = torch.zeros(units + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = torch.cumsum(lens, 0)
    slots = torch.arange(1, int(indptr[-1]) + 1, dtype=torch.int32, device="cuda")

    def run():
        keys = pool_units(k, slots, indptr, False)                  # [U, H, D]
        build_index(keys.transpose(0, 1), lens, FINE, 64, 10)

    return bench(run)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 65536, 129024])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--skip-flashinfer", action="store_true")
    ap.add_argument("--selection-batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--selection-only", action="store_true", help="only the selection rows (kernels/select.py)")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "shape": {"q_heads": HQ, "kv_heads": H, "head_dim": D, "dtype": "bf16"}, "decode": [], "selection": [],
           "index_build": []}

    def save():
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    torch.manual_seed(0)
    for ctx in a.contexts:
        if a.selection_only:
            for bs in a.selection_batches:
                fused, layer, fused_g, layer_g = fused_selection_ms(bs, ctx, 1024)
                k = torch.randn(bs * ctx + 1, H, D, device="cuda", dtype=torch.bfloat16)
                q = torch.randn(bs, HQ, D, device="cuda", dtype=torch.bfloat16)
                indptr = torch.arange(bs + 1, dtype=torch.int32, device="cuda") * ctx
                indices = torch.arange(1, bs * ctx + 1, dtype=torch.int32, device="cuda")
                dense = bench(dense_triton(q, k, k, indptr, indices))
                del k
                res["selection"].append({"ctx": ctx, "bs": bs, "fused_graph_ms": fused_g,
                                         "sparse_layer_graph_ms": layer_g, "dense_triton_ms": dense,
                                         "sparse_layer_over_dense": round(layer_g / dense, 3)})
                print(json.dumps(res["selection"][-1]), flush=True)
                save()
            continue
        bmax = max(b for b in a.batches if b * ctx * H * D < 2 ** 31)
        k = torch.randn(bmax * ctx + 1, H, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for bs in a.batches:
            if bs * ctx * H * D >= 2 ** 31:
                # SGLang's Triton decode kernel computes K/V offsets in int32 and faults past 2^31 elements
                res["decode"].append({"ctx": ctx, "bs": bs, "skipped": "KV buffer over 2^31 elements"})
                continue
            q = torch.randn(bs, HQ, D, device="cuda", dtype=torch.bfloat16)
            indptr = torch.arange(bs + 1, dtype=torch.int32, device="cuda") * ctx
            indices = torch.arange(1, bs * ctx + 1, dtype=torch.int32, device="cuda")
            row = {"ctx": ctx, "bs": bs}
            row["dense_triton_ms"] = bench(dense_triton(q, k, v, indptr, indices))
            if not a.skip_flashinfer:
                try:
                    t = time.time()
                    row["dense_flashinfer_ms"] = bench(dense_flashinfer(q, k, v, indptr, indices))
                    row["flashinfer_first_call_s"] = round(time.time() - t, 1)
                except Exception as e:  # JIT unavailable: keep the Triton baseline
                    row["flashinfer_error"] = repr(e)[:200]
            for budget in a.budgets:
                n = min(budget, ctx)
                lists = torch.sort(torch.rand(bs * H, ctx, device="cuda").topk(n, dim=1).indices, dim=1).values
                base = (torch.arange(bs, device="cuda").repeat_interleave(H) * ctx + 1)[:, None]
                sp_idx = (lists + base).flatten().to(torch.int32)
                sp_ptr = torch.arange(bs * H + 1, dtype=torch.int32, device="cuda") * n
                splits = splits_for(bs, n)
                ws = workspace_for(bs, H, HQ // H, D, splits, "cuda")
                out = torch.empty_like(q)
                row[f"sparse_{budget}_ms"] = bench(lambda: sparse_decode_attention(
                    q, k, v, sp_ptr, sp_idx, D ** -0.5, out=out, num_splits=splits, workspace=ws))
                base_ms = row.get("dense_flashinfer_ms", row["dense_triton_ms"])
                row[f"speedup_{budget}_vs_dense"] = round(base_ms / row[f"sparse_{budget}_ms"], 2)
            res["decode"].append(row)
            print(json.dumps(row), flush=True)
            save()
        del k, v
        torch.cuda.empty_cache()
        for bs in a.selection_batches:
            fused, layer, fused_g, layer_g = fused_selection_ms(bs, ctx, 1024)
            res["selection"].append({"ctx": ctx, "bs": bs, "fused_ms": fused, "sparse_layer_ms": layer,
                                     "fused_graph_ms": fused_g,
                                     "sparse_layer_graph_ms": layer_g})
            print(json.dumps(res["selection"][-1]), flush=True)
        build = index_build_ms(ctx)
        prefill = prefill_layer_ms(ctx)
        res["index_build"].append({"ctx": ctx, "build_ms_per_layer": build, "prefill_ms_per_layer": prefill,
                                   "build_share_of_prefill": round(build / (build + prefill), 3)})
        print(json.dumps(res["index_build"][-1]), flush=True)
        save()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
