"""Head roles for LycheeDecode's hybrid heads (issue #12), measured on captured Q/K/V: which heads may reuse.

    python -m bench.head_roles --out bench/results/head_roles_smollm2.json

A retrieval head selects its own tokens (lychee); a sparse head attends to the token set of the same KV head in
the previous layer and passes it on (chains compound: a set may be inherited over several layers). For a share
of retrieval heads among all sparse heads, four ways to choose them, each reading the same number of KV tokens:
- calibrated (training-free): on one calibration prompt, layer by layer, a head retrieves iff the set it would
  inherit loses more than a threshold of attention mass against its own selection; the threshold is bisected
  to the share;
- staggered (no calibration): each head retrieves every few layers, heads offset from one another;
- layer sharing (TidalDecode-like): whole layers retrieve, those whose heads lose most by reuse;
- random, three seeds.
Evaluated on other prompts and tasks against all-retrieval lychee at the same budget: attention-mass recall and
output error of the chained sets. ``--export`` turns one variant into a role map that the server takes
(config key ``head_roles``, ``configs/head_roles/``); which selections it saves is measured on the GPU.
``--retrieval exact-topk`` calibrates and evaluates retrieval heads that select the exact top-k over all keys (the
paper's) instead of lychee's clusters; ``--compare-retrieval`` sets both kinds side by side under given role maps.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from bench.attention_recall import capture, load, mask_metrics, own_masks, summarize
from bench.tasks import make
from sgl_sparsekv.chunking import BoundaryTable
from sgl_sparsekv.config import SparseKVConfig
from sgl_sparsekv.head_roles import staggered_roles, to_strings

CALIBRATE = ("niah_multikey", 100)
EVALUATE = (("passkey", 3), ("niah_single", 2), ("json_value", 1))


def reuse_loss(layers, masks: dict, budget: int, first: int) -> np.ndarray:
    """[num_layers, H] mean mass lost when a head reuses the previous layer's own selection (0 up to ``first``)."""
    H = layers[0][1].shape[0]
    loss = np.zeros((len(layers), H))
    queries = sorted({t for _, t in masks})
    for l in range(first + 1, len(layers)):
        for t in queries:
            own = mask_metrics(layers[l], t, masks[(l, t)], budget)[:, 0]
            inherited = mask_metrics(layers[l], t, masks[(l - 1, t)], budget)[:, 0]
            loss[l] += (own - inherited) / len(queries)
    return loss


def attention_weights(layers, masks: dict, first: int) -> dict:
    """{(layer, t): dense softmax weights [H, G, t + 1]} of every sparse layer's decode queries."""
    out = {}
    for (l, t) in masks:
        q_all, k_all, _ = layers[l]
        H, _, d = k_all.shape
        q = q_all[:, t].view(H, -1, d)
        out[(l, t)] = torch.softmax(torch.einsum("hgd,hsd->hgs", q, k_all[:, :t + 1]) / math.sqrt(d), -1)
    return out


def greedy_roles(weights: dict, masks: dict, first: int, threshold: float) -> np.ndarray:
    """Layer by layer, a head retrieves iff attending to the set it would inherit (its parent's, itself maybe
    inherited) loses more than ``threshold`` of attention mass against its own selection, over the queries."""
    queries = sorted({t for _, t in masks})
    num_layers = max(l for l, _ in masks) + 1
    roles = np.zeros((num_layers, masks[(first, queries[0])].shape[0]), dtype=bool)
    roles[first] = True
    attended = {t: masks[(first, t)] for t in queries}

    def mass(l, t, m):
        return (weights[(l, t)] * m[:, None, :]).sum(-1).mean(-1)

    for l in range(first + 1, num_layers):
        lost = sum(mass(l, t, masks[(l, t)]) - mass(l, t, attended[t]) for t in queries) / len(queries)
        roles[l] = (lost > threshold).numpy()
        r = torch.from_numpy(roles[l])[:, None]
        attended = {t: torch.where(r, masks[(l, t)], attended[t]) for t in queries}
    return roles


def calibrated_roles(weights: dict, masks: dict, first: int, count: int) -> np.ndarray:
    """``greedy_roles`` with the threshold bisected until about ``count`` heads retrieve."""
    lo, hi = -1.0, 1.0
    best = None
    for _ in range(20):
        mid = (lo + hi) / 2
        roles = greedy_roles(weights, masks, first, mid)
        if best is None or abs(roles[first:].sum() - count) < abs(best[first:].sum() - count):
            best = roles
        if roles[first:].sum() > count:
            lo = mid
        else:
            hi = mid
    return best


def layer_roles(loss: np.ndarray, first: int, count: int) -> np.ndarray:
    """Whole layers as retrieval layers (the first sparse one, then the largest mean losses), ``count`` heads."""
    roles = np.zeros(loss.shape, dtype=bool)
    roles[first] = True
    layers = np.argsort(-loss[first + 1:].mean(1), kind="stable")[:max(0, math.ceil(count / loss.shape[1]) - 1)]
    roles[first + 1 + layers] = True
    return roles


def staggered(shape, first: int, count: int) -> np.ndarray:
    return np.array(staggered_roles(shape[0], shape[1], first, count), dtype=bool)


def random_roles(shape, first: int, count: int, seed: int = 0) -> np.ndarray:
    roles = np.zeros(shape, dtype=bool)
    roles[first] = True
    pick = np.random.default_rng(seed).permutation(roles[first + 1:].size)[:max(0, count - shape[1])]
    roles[first + 1:].flat[pick] = True
    return roles


def chained_metrics(layers, masks: dict, roles: np.ndarray, budget: int, first: int) -> dict:
    """Metrics when sparse heads attend to their parent's (possibly inherited) set."""
    per = {}
    for t in sorted({t for _, t in masks}):
        attended = masks[(first, t)]
        for l in range(first, len(layers)):
            r = torch.from_numpy(roles[l])[:, None]
            attended = torch.where(r, masks[(l, t)], attended) if l > first else attended
            per[(l, t)] = mask_metrics(layers[l], t, attended, budget)
    return summarize(per)


def export_map(result: str, variant: str, out: str) -> None:
    """Write one variant's roles from a result of this script as a role map file (``sgl_sparsekv.head_roles``)."""
    from transformers import AutoConfig

    res = json.loads(Path(result).read_text())
    layers = res["roles"][variant]["map"]
    hf = AutoConfig.from_pretrained(res["model"])
    cal = res["calibration"]
    made_by = (f"{variant} from `python -m bench.head_roles --model-dir {res['model']} --budget {res['budget']} "
               f"--length {res['length']}` ({result}): training-free calibration on {cal['task']} seed {cal['seed']}, "
               f"{cal['tokens']} tokens, {cal['queries']} decode queries")
    Path(out).write_text(json.dumps({
        "model": Path(res["model"]).name, "architectures": hf.architectures, "num_layers": len(layers),
        "num_kv_heads": len(layers[-1]), "dense_layers": layers.count("dense"),
        "retrieval_heads": res["roles"][variant]["retrieval_heads"], "of": res["roles"][variant]["of"],
        "layers": layers, "made_by": made_by}, indent=1) + "\n")


def prompt_masks(model, tok, cfg, table, task: str, seed: int, length: int, queries: int, retrieval: str = "lychee"):
    """(ids, captured layers, each head's own masks at the last ``queries`` positions) of one task prompt: what lychee
    selects, or with ``retrieval`` "exact-topk" the exact top-k (:func:`topk_masks`)."""
    ids = np.asarray(tok(make(task, tok, length, seed).prompt).input_ids)
    layers = capture(model, ids)
    positions = range(len(ids) - queries, len(ids))
    if retrieval == "exact-topk":
        return ids, layers, topk_masks(cfg, layers, positions)
    return ids, layers, own_masks(cfg, ids, layers, positions, table)


def topk_masks(cfg, layers, positions) -> dict:
    """{(layer, t): bool [H, t + 1]}: exact top-k retrieval, as LycheeDecode's retrieval heads select: the sink, the
    recent window and the remaining budget's tokens of largest ``q.k`` (max over the GQA group) among all keys."""
    out = {}
    for t in positions:
        seq = t + 1
        sink = min(cfg.sink_tokens, seq)
        recent = min(cfg.recent_window, seq - sink)
        for l in range(cfg.dense_layers, len(layers)):
            q_all, k_all, _ = layers[l]
            H, _, d = k_all.shape
            score = torch.einsum("hgd,hsd->hgs", q_all[:, t].view(H, -1, d), k_all[:, :seq]).amax(1)   # [H, seq]
            mask = torch.zeros(H, seq, dtype=torch.bool)
            mask[:, :sink] = True
            mask[:, seq - recent:] = True
            middle = score[:, sink:seq - recent]
            k = min(cfg.token_budget - sink - recent, middle.shape[1])
            if k > 0:
                mask[:, sink:seq - recent].scatter_(1, middle.topk(k, -1).indices, True)
            out[(l, t)] = mask
    return out


def roles_array(spec: str, num_layers: int, heads: int, first: int) -> np.ndarray:
    """[num_layers, heads] bool roles of a ``head_roles`` value (all-retrieval, staggered-<share> or a role map),
    checked against the model's shape as the server checks it; dense layers False."""
    from sgl_sparsekv.head_roles import resolve

    roles = np.zeros((num_layers, heads), dtype=bool)
    picked = resolve(spec, num_layers, heads, first)
    for l, hs in enumerate(picked or [range(heads)] * (num_layers - first)):
        roles[first + l, list(hs)] = True
    return roles


def compare_retrieval(model_dir: str, maps: list[str], budget: int, length: int, queries: int) -> dict:
    """Retrieval heads that select by lychee's clusters against exact top-k over all keys, each with every head
    retrieving and with each role map, on the held-out prompts: chained metrics and their means."""
    tok, model = load(model_dir)
    table = BoundaryTable.from_tokenizer(tok)
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": budget})
    rows = []
    for task, seed in EVALUATE:
        ids, layers, masks = prompt_masks(model, tok, cfg, table, task, seed, length, queries)
        by = {"lychee": masks, "exact-topk": topk_masks(cfg, layers, range(len(ids) - queries, len(ids)))}
        row = {"task": task, "seed": seed, "tokens": len(ids)}
        for sel, m in by.items():
            for name in ("all-retrieval", *maps):
                roles = roles_array(name, len(layers), layers[0][1].shape[0], cfg.dense_layers)
                r = chained_metrics(layers, m, roles, budget, cfg.dense_layers)
                r.pop("per_layer")
                row[f"{sel}/{name}"] = r
        rows.append(row)
        print(task, {k: round(v["mass_recall"], 4) for k, v in row.items() if isinstance(v, dict)}, flush=True)
    names = [k for k in rows[0] if "/" in k]
    return {"model": model_dir, "budget": budget, "length": length, "queries": queries, "maps": maps,
            "evaluation": rows,
            "mean_mass_recall": {n: float(np.mean([r[n]["mass_recall"] for r in rows])) for n in names},
            "mean_out_rel_err": {n: float(np.mean([r[n]["out_rel_err"] for r in rows])) for n in names},
            "mean_kv_read": {n: float(np.mean([r[n]["kv_read"] for r in rows])) for n in names}}


def evaluate(model, tok, cfg, table, variants: dict, length: int, queries: int, retrieval: str = "lychee") -> dict:
    """Each role variant's chained metrics beside all-retrieval on the held-out prompts (``EVALUATE``) and their means:
    {"evaluation": rows, "mean_mass_recall": ..., "mean_out_rel_err": ...}."""
    rows = []
    for task, seed in EVALUATE:
        ids, layers, masks = prompt_masks(model, tok, cfg, table, task, seed, length, queries, retrieval)
        row = {"task": task, "seed": seed, "tokens": len(ids), "all-retrieval": summarize(
            {k: mask_metrics(layers[k[0]], k[1], m, cfg.token_budget) for k, m in masks.items()})}
        for name, roles in variants.items():
            row[name] = chained_metrics(layers, masks, roles, cfg.token_budget, cfg.dense_layers)
        rows.append(row)
        print(task, {k: round(v["mass_recall"], 3) for k, v in row.items() if isinstance(v, dict)}, flush=True)
    names = ["all-retrieval", *variants]
    out = {"evaluation": rows,
           "mean_mass_recall": {n: float(np.mean([r[n]["mass_recall"] for r in rows])) for n in names},
           "mean_out_rel_err": {n: float(np.mean([r[n]["out_rel_err"] for r in rows])) for n in names}}
    for r in rows:
        for n in names:
            r[n].pop("per_layer")
    print(json.dumps(out["mean_mass_recall"], indent=1))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="models/smollm2")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--length", type=int, default=3000)
    ap.add_argument("--queries", type=int, default=4, help="decode queries per evaluation prompt")
    ap.add_argument("--calibration-queries", type=int, default=16)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.5, 0.25],
                    help="retrieval heads as a share of all sparse heads")
    ap.add_argument("--out", default="bench/results/head_roles_smollm2.json")
    ap.add_argument("--export", nargs=3, metavar=("RESULT", "VARIANT", "MAP"),
                    help="write VARIANT's roles from RESULT (this script's JSON) as the role map file MAP, and stop")
    ap.add_argument("--retrieval", choices=["lychee", "exact-topk"], default="lychee",
                    help="what a retrieval head selects, in calibration and evaluation: lychee's clusters or the exact "
                         "top-k over all keys (LycheeDecode's)")
    ap.add_argument("--maps", nargs="+", default=[], metavar="MAP",
                    help="role maps (shipped names or paths) evaluated beside the calibrated variants, e.g. one "
                         "calibrated at another length")
    ap.add_argument("--compare-retrieval", nargs="+", metavar="MAP",
                    help="compare lychee's cluster retrieval with exact top-k retrieval heads, with every head "
                         "retrieving and under these role maps, on the held-out prompts; write --out and stop")
    a = ap.parse_args()
    if a.export:
        export_map(*a.export)
        return
    if a.compare_retrieval:
        res = compare_retrieval(a.model_dir, a.compare_retrieval, a.budget, a.length, a.queries)
        print(json.dumps(res["mean_mass_recall"], indent=1))
        Path(a.out).write_text(json.dumps(res, indent=1))
        return
    tok, model = load(a.model_dir)
    table = BoundaryTable.from_tokenizer(tok)
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": a.budget})
    first = cfg.dense_layers

    ids, layers, masks = prompt_masks(model, tok, cfg, table, *CALIBRATE, a.length, a.calibration_queries,
                                      a.retrieval)
    loss = reuse_loss(layers, masks, a.budget, first)
    weights = attention_weights(layers, masks, first)
    sparse_heads = (len(layers) - first) * loss.shape[1]
    res = {"model": a.model_dir, "budget": a.budget, "length": a.length, "queries": a.queries,
           "retrieval": a.retrieval,
           "calibration": {"task": CALIBRATE[0], "seed": CALIBRATE[1], "tokens": len(ids), "queries": a.calibration_queries,
                           "reuse_loss": np.round(loss, 4).tolist()},
           "roles": {}}
    variants = {}
    for share in a.shares:
        count = max(loss.shape[1], round(share * sparse_heads))
        for name, roles in ((f"hybrid-calibrated-{share:g}", calibrated_roles(weights, masks, first, count)),
                            (f"layer-sharing-{share:g}", layer_roles(loss, first, count)),
                            (f"hybrid-staggered-{share:g}", staggered(loss.shape, first, count)),
                            *((f"hybrid-random-{share:g}-seed{seed}", random_roles(loss.shape, first, count, seed))
                              for seed in range(3))):
            variants[name] = roles
            res["roles"][name] = {"retrieval_heads": int(roles[first:].sum()), "of": sparse_heads,
                                  "map": to_strings(roles, first)}
    for spec in a.maps:
        variants[spec] = roles = roles_array(spec, len(layers), loss.shape[1], first)
        res["roles"][spec] = {"retrieval_heads": int(roles[first:].sum()), "of": sparse_heads,
                              "map": to_strings(roles, first)}
    res.update(evaluate(model, tok, cfg, table, variants, a.length, a.queries, a.retrieval))
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
