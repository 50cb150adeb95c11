"""Where a sparse decode layer's time goes on the GPU: coarse expansion, fine bounds, the budget cut, token-list emission
and the attention, each replayed from a CUDA graph (Llama-3.1-8B attention shape, random unit keys); then the layer's
whole chain of kernels in one graph (``layer_ms``).

    python3 -m bench.selection_breakdown --out sel.json [--contexts 32768] [--batches 1 8 16] [--retrieving 8 2]
        [--shared] [--sizes 1 2] [--expands 16 8] [--reranks 1 2] [--cut-bands 64:65536 1:1] [--parts 32 64]
        [--cut-value-steps 0 12]

``--retrieving``: KV heads of the layer that select their own tokens (hybrid heads, config ``head_roles``); the
selection and emission run for those only, the attention for all 8. ``--sizes``: chunks per fine cluster (config
``fine_cluster_size``; 1 is the default, 2 the default up to fa847f7). ``--expands``: config ``coarse_expand``
(coarse units are expanded until they hold this many times the budget; the fine bounds are computed for their
clusters only). ``--reranks``: config ``rerank_factor`` (the cut and emission pick that many times the budget as
candidates; ``rerank_ms`` scores their keys and keeps the budget's best, which the attention then reads).
``--parts``: programs per (request, KV head) of the fine bounds and the token lists (by default what the server's
``PooledDecode`` takes at each batch size, ``parts_for``). ``--cut-bands``: TILE:KEYS of the register cut
(``kernels.select.CUT_BAND``): its last passes run on a tile of TILE once the bisection's interval holds KEYS keys
(1:1, every pass on the whole tile). ``--cut-value-steps``: how many of its first passes halve the bounds' values
rather than their keys (``kernels.select.CUT_VALUE_STEPS``; 0: key passes only, as up to this option).
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.bench_kernels import D, EXPAND, FINE, H, HQ, graph_bench, selection_case
from sgl_sparsekv.kernels import rerank as kr
from sgl_sparsekv.kernels import select as ks
from sgl_sparsekv.kernels.sparse_decode import sparse_decode_attention
from sgl_sparsekv.patches.pooled_decode import parts_for


def breakdown(bs: int, ctx: int, budget: int = 1024, sink: int = 16, recent: int = 64, parts: int = 32,
              retrieving: int = H, shared: bool = False, fine_cluster_size: float = FINE, expand: float = EXPAND,
              rerank: int = 1, cut_band: tuple[int, int] = (ks.CUT_BAND, ks.CUT_BAND_KEYS),
              value_steps: int = ks.CUT_VALUE_STEPS, bound: str = "ball") -> dict:
    c = selection_case(bs, ctx, budget, sink, recent, shared, fine_cluster_size, box=bound == "box")
    box = c["box"]
    coarse, fine, chunks, ranges = c["coarse"], c["fine"], c["chunks"], c["ranges"]
    q, rem, seq, req_to_token, rows, k = c["q"], c["rem"], c["seq"], c["req_to_token"], c["rows"], c["k"]
    lstarts, ws = c["list_starts"], c["workspace"]
    keep = budget - sink - recent
    cap_c = budget + (rerank - 1) * keep    # emission's candidate lists (the budget's own without a rerank)
    rem = rem * rerank
    ftok = fine[2]
    bnd, sel = c["scratch"]
    heads = torch.arange(retrieving, dtype=torch.int32, device="cuda")
    R, st = retrieving, ranges.stride(0)
    expanded = torch.empty(bs * R * ks._block_p(64), dtype=torch.int8, device="cuda")
    out = (torch.empty(bs * H, dtype=torch.int32, device="cuda"),
           torch.empty(bs * H * cap_c, dtype=torch.int32, device="cuda"),
           torch.empty(bs * H * parts, dtype=torch.int32, device="cuda"))
    lists = (torch.empty(bs * H, dtype=torch.int32, device="cuda"),
             torch.empty(bs * H * budget, dtype=torch.int32, device="cuda")) if rerank > 1 else out[:2]
    rerank_space = kr.workspace_for(bs, H, HQ // H, cap_c, "cuda")

    def coarse_pick():
        ks.coarse_expand(q, coarse, ranges, rem, expand, heads, 0.25, out=expanded)

    def fine_bounds():
        ks.fine_bounds(q, fine, ranges, expanded, bnd, heads, 0.25, parts, box=box)

    def cut():
        ks._cut_kernel[(bs * R,)](bnd, ftok, ranges, st, rem, sel, sel.stride(0), heads, R, H=H, BLOCK=ks.CUT_BLOCK,
                                  BAND=cut_band[0], BAND_KEYS=cut_band[1], VALUE_STEPS=value_steps,
                                  num_warps=ks.CUT_WARPS)

    def emit():
        return ks.emit_tokens(sel, chunks, ranges, rows, seq, req_to_token, sink, recent, cap_c,
                              dense_limit=budget, parts=parts, out=out, heads=heads)

    def rerank_step():
        return kr.rerank_tokens(q, k, out[:2], seq, D ** -0.5, sink, recent, keep, budget, budget, lists,
                                rerank_space, heads)

    def attend():
        return sparse_decode_attention(q, k, k, lstarts, lists[1], D ** -0.5, workspace=ws, lens=lists[0])

    # the layer before, where every head retrieved: the lists that sparse heads keep
    ks.emit_tokens(ks.select_fine(q, coarse, fine, ranges, rem, expand, parts=parts, out=c["scratch"],
                                  cut_band=cut_band, cut_value_steps=value_steps, box=box), chunks,
                   ranges, rows, seq, req_to_token, sink, recent, cap_c, dense_limit=budget, parts=parts, out=out)
    phases = [("coarse", coarse_pick), ("fine_bounds", fine_bounds), ("cut", cut), ("emit", emit),
              *([("rerank", rerank_step)] if rerank > 1 else []), ("attend", attend)]
    for _, f in phases:
        f()

    def layer():   # the whole chain through the launch wrappers, as the server runs it
        ks.emit_tokens(ks.select_fine(q, coarse, fine, ranges, rem, expand, parts=parts, out=c["scratch"],
                                      radius_weight=0.25, heads=heads, cut_band=cut_band,
                                      cut_value_steps=value_steps, box=box),
                       chunks, ranges, rows, seq, req_to_token, sink, recent, cap_c, dense_limit=budget, parts=parts,
                       out=out, heads=heads)
        if rerank > 1:
            rerank_step()
        attend()

    F = {name: i for i, name in enumerate(ks.RANGE_FIELDS)}
    L = ranges[F["L0"]] + ranges[F["L1"]]
    live = int((bnd[:R, :int(L.sum())] > float("-inf")).sum()) // R
    return {"ctx": ctx, "bs": bs, "parts": parts, "fine_cluster_size": fine_cluster_size, "coarse_expand": expand,
            "retrieving_heads": R, "shared_prefix": shared, "cut_band": list(cut_band), "cut_value_steps": value_steps,
            "rerank_factor": rerank, "fine_bound": bound, "fine_clusters": int(L.sum()) // bs,
            "live_fine_per_head": live // bs,
            "candidates_per_list": int(out[0][:bs * H].float().mean()), "attended_per_list": int(lists[0][:bs * H].float().mean()),
            **{f"{n}_ms": round(graph_bench(f), 4) for n, f in phases}, "layer_ms": round(graph_bench(layer), 4)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--retrieving", type=int, nargs="+", default=[H], help="retrieval KV heads per layer (of 8)")
    ap.add_argument("--shared", action="store_true",
                    help="also the batch over one shared prefix (one shared segment, 256 tokens of each request's own)")
    ap.add_argument("--sizes", type=float, nargs="+", default=[FINE], help="fine_cluster_size values")
    ap.add_argument("--expands", type=float, nargs="+", default=[EXPAND], help="coarse_expand values")
    ap.add_argument("--reranks", type=int, nargs="+", default=[1], help="rerank_factor values")
    ap.add_argument("--parts", type=int, nargs="+", default=[None],
                    help="programs per (request, KV head) of the fine bounds and the token lists (PooledDecode's parts)")
    ap.add_argument("--cut-bands", nargs="+", default=[f"{ks.CUT_BAND}:{ks.CUT_BAND_KEYS}"],
                    help="TILE:KEYS of the register cut's last passes")
    ap.add_argument("--bounds", nargs="+", default=["ball"], choices=["ball", "box"], help="fine_bound values")
    ap.add_argument("--cut-value-steps", type=int, nargs="+", default=[ks.CUT_VALUE_STEPS],
                    help="the register cut's first passes that halve values rather than keys")
    a = ap.parse_args()
    bands = [tuple(int(x) for x in b.split(":")) for b in a.cut_bands]
    res = {"device": torch.cuda.get_device_name(), "rows": []}
    for ctx, bs, r, sh, size, ex, f, cb, v, p, bd in (
            (c, b, r, sh, z, e, f, cb, v, p, bd) for c in a.contexts for b in a.batches for r in a.retrieving
            for sh in ((False, True) if a.shared else (False,)) for z in a.sizes for e in a.expands
            for f in a.reranks for cb in bands for v in a.cut_value_steps for p in a.parts for bd in a.bounds):
        res["rows"].append(breakdown(bs, ctx, parts=parts_for(bs) if p is None else p, retrieving=r, shared=sh,
                                     fine_cluster_size=size, expand=ex, rerank=f, cut_band=cb, value_steps=v,
                                     bound=bd))
        print(json.dumps(res["rows"][-1]), flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
