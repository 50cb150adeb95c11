"""Attention-level fidelity on captured Q/K/V of a real model (no generation, no server).

    python -m bench.attention_recall --out bench/results/attention_recall_smollm2.json
    python3 -m bench.attention_recall --device cuda --model-dir /tmp/qwen --length 16000 --budget 1024 \
        --task variable_tracking --seeds 0 1 2 --out $OUT/recall.json       # the GPU machine, real weights

Runs the model once over long prompts with transformers, capturing every layer's post-RoPE
queries, keys and values. The last ``--queries`` prompt positions act as decode queries over
the tokens before them; with ``--task``, the prompt of a fidelity task's seeded sample is followed by its
expected answer, and the queries are the ones that produce the answer's tokens (teacher forcing): what dense
attention reads while answering, against what the selection gives it. For each sparse layer and each method/config it reports, against dense
attention: top-k recall (share of the budget's top dense tokens that were selected),
attention-mass recall (dense softmax weight on the selected tokens), the output's relative
error, and the share of KV read. Selection runs through the same functions the server uses.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch

from bench.tasks import passkey
from sgl_sparsekv.chunking import BoundaryTable, Chunker
from sgl_sparsekv.config import SparseKVConfig
from sgl_sparsekv.index import build_index
from sgl_sparsekv.summary import summarize_units
from sgl_sparsekv.select import select_chunks, select_pages, units_to_token_mask


def load(model_dir: str, device: str = "cpu"):
    """(tokenizer, model): fp32 on the CPU, bf16 (as served) on a GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return (AutoTokenizer.from_pretrained(model_dir),
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval())


def capture(model, ids: np.ndarray):
    """Every layer's (q [Hq, T, d], k [H, T, d], v [H, T, d]) in fp32, on the model's device."""
    from transformers.modeling_utils import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layers = []

    def grab(module, q, k, v, *args, **kwargs):
        layers.append((q[0].detach().float(), k[0].detach().float(), v[0].detach().float()))
        return sdpa_attention_forward(module, q, k, v, *args, **kwargs)

    AttentionInterface.register("capture", grab)
    model.config._attn_implementation = "capture"
    with torch.no_grad():
        model(torch.as_tensor(ids, device=model.device)[None])
    return layers


def unit_bounds(chunker, ids):
    ends = chunker.cuts(ids)
    starts = np.r_[0, ends[:-1]]
    return torch.tensor(starts), torch.tensor(ends)


def own_masks(cfg: SparseKVConfig, ids, layers, positions, table) -> dict:
    """{(layer, t): bool mask [H, t + 1]} of what each sparse layer selects for the query at each position t,
    through the same functions the server uses."""
    dev = layers[0][1].device
    if cfg.method == "lychee":
        chunker = Chunker(cfg.chunking, cfg.chunk_min, cfg.chunk_max, table)
    else:
        chunker = Chunker("fixed", cfg.page_size, cfg.page_size, None)
    out = {}
    for t in positions:
        seq = t + 1                      # the query at position t sees tokens [0, t]
        starts, ends = (x.to(dev) for x in unit_bounds(chunker, ids[:seq]))
        indptr = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), ends]).to(torch.int32)
        slots = torch.arange(int(ends[-1]) if len(ends) else 0, dtype=torch.int32, device=dev)
        sink = min(cfg.sink_tokens, seq)
        recent = min(cfg.recent_window, seq - sink)
        budget = cfg.token_budget - sink - recent
        for l, (q_all, k_all, _) in enumerate(layers):
            if l < cfg.dense_layers:
                continue
            H, _, d = k_all.shape
            kbuf = k_all[:, :seq].transpose(0, 1)       # [seq, H, d] like a KV pool, slot = position
            q = q_all[:, t].view(H, -1, d)
            if cfg.method == "lychee":
                ukeys = summarize_units(kbuf, slots, indptr, False).transpose(0, 1)     # [H, U, d]
                index = build_index(ukeys, ends - starts, cfg.fine_cluster_size, cfg.max_coarse, cfg.kmeans_iters)
                sel = select_chunks(index, q, budget, cfg.coarse_expand, cfg.gqa_reduce)
            else:
                mm = summarize_units(kbuf, slots, indptr, True)                          # [U, H, 2, d]
                sel = select_pages(q, mm[:, :, 0].transpose(0, 1), mm[:, :, 1].transpose(0, 1), budget,
                                   cfg.page_size, cfg.gqa_reduce)
            out[(l, t)] = units_to_token_mask(sel, starts, ends, seq, sink, recent)    # [H, seq]
    return out


def mask_metrics(layer, t: int, mask: torch.Tensor, budget: int) -> np.ndarray:
    """Against dense attention at layer ``layer`` = (q, k, v) for the query at ``t``, per KV head:
    attention-mass recall (mean and worst over the group's query heads), top-``budget`` recall, output relative
    error, share of KV read. -> [H, 5]"""
    q_all, k_all, v_all = layer
    H, _, d = k_all.shape
    seq = t + 1
    q = q_all[:, t].view(H, -1, d)
    keys, vals = k_all[:, :seq], v_all[:, :seq]
    logits = torch.einsum("hgd,hsd->hgs", q, keys) / math.sqrt(d)
    w = torch.softmax(logits, -1)
    m = mask[:, None, :].expand_as(w)
    mass = (w * m).sum(-1)                                                       # [H, G]
    top = w.topk(min(budget, seq), dim=-1).indices
    topk_recall = m.gather(-1, top).float().mean(-1)
    ws = torch.softmax(logits.masked_fill(~m, float("-inf")), -1)
    o_d = torch.einsum("hgs,hsd->hgd", w, vals)
    o_s = torch.einsum("hgs,hsd->hgd", ws, vals)
    err = (o_s - o_d).norm(dim=-1) / o_d.norm(dim=-1).clamp_min(1e-6)
    return torch.stack([mass.mean(-1), mass.amin(-1), topk_recall.mean(-1), err.mean(-1), mask.float().mean(-1)],
                       -1).cpu().numpy()


def summarize(per: dict) -> dict:
    """{(layer, t): [H, 5] metrics} -> means over layers (each layer's mean over queries and heads), the worst
    (layer, query, query head) mass recall, and the per-layer rows."""
    layers = sorted({l for l, _ in per})
    per_layer = []
    for l in layers:
        r = np.stack([v for (ll, _), v in per.items() if ll == l])              # [queries, H, 5]
        per_layer.append(dict(layer=l, mass_recall=float(r[..., 0].mean()), mass_recall_min=float(r[..., 1].min()),
                              topk_recall=float(r[..., 2].mean()), out_rel_err=float(r[..., 3].mean()),
                              kv_read=float(r[..., 4].mean())))
    agg = {k: float(np.mean([p[k] for p in per_layer])) for k in ("mass_recall", "topk_recall", "out_rel_err", "kv_read")}
    agg["mass_recall_min"] = float(min(p["mass_recall_min"] for p in per_layer))
    return dict(**agg, per_layer=per_layer)


def per_query(cfg: SparseKVConfig, ids, layers, positions, table) -> dict:
    """{(layer, t): [H, 5] metrics} of the queries at ``positions``."""
    masks = own_masks(cfg, ids, layers, positions, table)
    return {(l, t): mask_metrics(layers[l], t, m, cfg.token_budget) for (l, t), m in masks.items()}


def evaluate(cfg: SparseKVConfig, ids, layers, positions, table) -> dict:
    return dict(config=cfg.to_dict(), **summarize(per_query(cfg, ids, layers, positions, table)))


VARIANTS = {
    "lychee": {},
    "lychee-gqa-mean": {"gqa_reduce": "mean"},
    "lychee-expand-4": {"coarse_expand": 4.0},
    "lychee-flat": {"coarse_expand": 1e9},
    "lychee-fixed-chunks": {"chunking": "fixed"},
    "quest": {},
    "quest-gqa-mean": {"gqa_reduce": "mean"},
}


def samples(tok, a):
    """[(name, token ids, query positions)]: the legacy passkey prompt's last ``--queries`` positions, or each
    seeded task sample's prompt plus its expected answer, queried where the answer's tokens are produced."""
    if not a.task:
        prompt, _ = passkey(tok, a.length, 0.5, seed=3)
        ids = np.asarray(tok(prompt).input_ids)
        return [("passkey@0.5", ids, list(range(len(ids) - a.queries, len(ids))))]
    from bench.tasks import make

    out = []
    for seed in a.seeds:
        s = make(a.task, tok, a.length, seed)
        prompt = np.asarray(tok(s.prompt).input_ids)
        answer = tok.encode(" " + ", ".join(s.expected), add_special_tokens=False)
        ids = np.concatenate([prompt, answer])
        out.append((f"{a.task}/{seed}", ids, list(range(len(prompt) - 1, len(ids) - 1))))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="models/smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--length", type=int, default=3000)
    ap.add_argument("--queries", type=int, default=4, help="without --task: the prompt's last positions queried")
    ap.add_argument("--task", default=None, help="a bench.tasks task: its samples, queried while answering")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--out", default="bench/results/attention_recall_smollm2.json")
    a = ap.parse_args()
    tok, model = load(a.model_dir, a.device)
    table = BoundaryTable.from_tokenizer(tok)
    res = {"model": a.model_dir, "device": torch.cuda.get_device_name() if a.device != "cpu" else "CPU",
           "budget": a.budget, "task": a.task, "length": a.length, "samples": [], "variants": {}}
    per = {name: {} for name in a.variants}
    for name, ids, positions in samples(tok, a):
        layers = capture(model, ids)
        res["samples"].append({"sample": name, "tokens": len(ids), "queries": len(positions)})
        for v in a.variants:
            cfg = SparseKVConfig.from_method(v.split("-")[0], {"token_budget": a.budget, **VARIANTS[v]})
            per[v].update({(l, f"{name}:{t}"): m for (l, t), m in per_query(cfg, ids, layers, positions,
                                                                             table).items()})
        del layers
    for v in a.variants:
        cfg = SparseKVConfig.from_method(v.split("-")[0], {"token_budget": a.budget, **VARIANTS[v]})
        r = res["variants"][v] = dict(config=cfg.to_dict(), **summarize(per[v]))
        print(f"{v:22s} mass {r['mass_recall']:.3f} (min {r['mass_recall_min']:.3f})  top-k {r['topk_recall']:.3f}"
              f"  out err {r['out_rel_err']:.3f}  kv read {r['kv_read']:.3f}", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
