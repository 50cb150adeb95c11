"""Which tokens of the answer's record the selection drops (issue #94, item 3: find the structured-record loss).

    python -m experiments.record_recall --model-dir models/qwen2.5-coder-0.5b --length 4000 --budget 256 \
        --out /tmp/record_recall.json                                    # the CPU, fp32, dev split

For each dev sample of the record families (code_return: a function's name and, four lines below, the value it
returns; json_value and yaml_value: a leaf key and its value among many alike), the model writes the answer greedily
and one forward over prompt and answer captures every layer's queries and keys. At each answer token's step, per
sparse layer and KV head, dense attention's mass on the record's key tokens and on its value tokens is split into
what a selection attends and what it drops, for lychee's default selection (structure chunks, the default index,
``sgl_sparsekv.select``), for Quest's pages at the same budget, and for lychee with each selected chunk's next
chunk pulled in, at an equal count of tokens read (its cut shrinks until its tokens fit). The sink and the recent
window are attended by all. Reported: the kept share of each part's mass (mass-weighted over steps, layers and
heads), and how often the value's chunk is dropped while its key's chunk is kept. One-off: what it decided is in
docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import re

import numpy as np
import torch
import torch.nn.functional as F

from bench.tasks import make
from experiments.selection_reuse import capture
from sgl_sparsekv.chunking import BoundaryTable, Chunker
from sgl_sparsekv.config import SparseKVConfig
from sgl_sparsekv.index import build_index
from sgl_sparsekv.select import select_chunks, select_pages

METHODS = ("lychee", "quest", "lychee_next")


def record_spans(task: str, prompt: str, value: str) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """Character spans (key, value) of the answer's record, or None where the value is not unique in the prompt."""
    body = prompt[:prompt.rindex("\n")]   # the question (last line) names the key again
    found = [m.start() for m in re.finditer(rf"(?<!\w){re.escape(value)}(?!\w)", body)]
    if len(found) != 1:
        return None
    v = (found[0], found[0] + len(value))
    if task == "code_return":
        name = re.search(r"function (\w+) returns$", prompt).group(1)
        k = body.index(f"def {name}(")
        return (k, k + len(f"def {name}(")), v
    key = re.search(r"key path ([\w.]+)\?", prompt).group(1).split(".")[-1]
    k = body.rindex(key, 0, v[0])   # the leaf key just before its value
    return (k, k + len(key)), v


def token_mask(offsets: list[tuple[int, int]], span: tuple[int, int]) -> torch.Tensor:
    return torch.tensor([s < span[1] and e > span[0] for s, e in offsets])


def sample_recall(model, tok, cfg: SparseKVConfig, chunker: Chunker, sample) -> dict | None:
    enc = tok(sample.prompt, return_offsets_mapping=True)
    spans = record_spans(sample.task, sample.prompt, sample.expected[0])
    if spans is None:
        return None
    ids = torch.tensor(enc["input_ids"])
    P = len(ids)
    key_tok, val_tok = (token_mask(enc["offset_mapping"], s) for s in spans)
    answer = tok.encode(" " + sample.expected[0], add_special_tokens=False)
    out = model.generate(ids[None], max_new_tokens=len(answer), min_new_tokens=len(answer), do_sample=False)[0]
    dense_right = sample.score(tok.decode(out[P:]))
    layers = capture(model, out)
    ends = chunker.cuts(ids.numpy())
    starts = np.r_[0, ends[:-1]]
    keep = starts >= cfg.sink_tokens
    starts, ends = starts[keep], ends[keep]
    lens = torch.as_tensor(ends - starts)
    pos = torch.arange(P)
    chunk_of = torch.as_tensor(np.searchsorted(ends, pos.numpy(), side="right"))
    inside = (pos >= int(starts[0])) & (chunk_of < len(ends))
    key_chunks = torch.unique(chunk_of[key_tok & inside])
    val_chunks = torch.unique(chunk_of[val_tok & inside])
    retrieve = cfg.token_budget - cfg.sink_tokens - cfg.recent_window
    page = SparseKVConfig.from_method("quest").page_size
    kept = {m: np.zeros(2) for m in METHODS}
    total = np.zeros(2)
    split = {m: 0 for m in METHODS}   # (step, layer, head)s with the key's chunk kept and the value's dropped
    cases = 0
    for layer in range(cfg.dense_layers, len(layers)):
        q, k = layers[layer]
        H, d = k.shape[0], k.shape[-1]
        G = q.shape[0] // H
        keys = torch.zeros(H, len(ends), d).index_add_(1, chunk_of[inside], k[:, :P][:, inside])
        keys = F.normalize(keys / lens[None, :, None].float(), dim=-1)
        index = build_index(keys, lens, cfg.fine_cluster_size, cfg.max_coarse, cfg.kmeans_iters)
        n_pages = -(-P // page)
        pk = F.pad(k[:, :P], (0, 0, 0, n_pages * page - P), value=float("nan")).view(H, n_pages, page, d)
        kmin, kmax = pk.nan_to_num(float("inf")).amin(2), pk.nan_to_num(float("-inf")).amax(2)
        for t in range(len(answer)):
            at = P - 1 + t   # the query that writes answer token t
            qt = q[:, at].view(H, G, d)
            probs = torch.softmax((qt @ k[:, :at + 1].transpose(1, 2)) / d ** 0.5, dim=-1).mean(1)[:, :P]
            mass = torch.stack([probs[:, key_tok].sum(1), probs[:, val_tok].sum(1)], 1)   # [H, 2]
            total += mass.sum(0).numpy()
            base = torch.zeros(H, P, dtype=torch.bool)
            base[:, :cfg.sink_tokens] = True
            base[:, max(0, at + 1 - cfg.recent_window):] = True
            sel = select_chunks(index, qt, retrieve, cfg.expansion(retrieve), cfg.gqa_reduce, cfg.radius_weight)
            read = int((lens * sel).sum())
            # the next chunk pulled in, the cut shrunk until the tokens read match lychee's
            cut = retrieve
            while True:
                nxt = select_chunks(index, qt, cut, cfg.expansion(cut), cfg.gqa_reduce, cfg.radius_weight)
                nxt = nxt | F.pad(nxt[:, :-1], (1, 0))
                if int((lens * nxt).sum()) <= read or cut <= cfg.chunk_max:
                    break
                cut -= cfg.chunk_max
            chosen = {"lychee": sel, "lychee_next": nxt}
            pages = select_pages(qt, kmin, kmax, cfg.token_budget - cfg.sink_tokens - cfg.recent_window, page,
                                 cfg.gqa_reduce)
            for m in METHODS:
                if m == "quest":
                    tokens = pages.repeat_interleave(page, 1)[:, :P]
                    key_kept = val_kept = None
                else:
                    tokens = torch.zeros(H, P, dtype=torch.bool)
                    tokens[:, inside] = chosen[m][:, chunk_of[inside]]
                    key_kept, val_kept = chosen[m][:, key_chunks].any(1), chosen[m][:, val_chunks].all(1)
                tokens |= base
                kept[m] += torch.stack([(probs * (tokens & key_tok)).sum(1),
                                        (probs * (tokens & val_tok)).sum(1)], 1).sum(0).numpy()
                if key_kept is not None:
                    split[m] += int((key_kept & ~val_kept).sum())
            cases += H
    return {"dense_right": bool(dense_right), "prompt_tokens": P, "key_tokens": int(key_tok.sum()),
            "value_tokens": int(val_tok.sum()),
            "key_value_chunks_apart": (int(val_chunks.min() - key_chunks.max()) if len(val_chunks) and len(key_chunks)
                                       else None),
            "mass": total.tolist(), "kept": {m: v.tolist() for m, v in kept.items()},
            "key_kept_value_dropped": {m: split[m] / cases for m in ("lychee", "lychee_next")}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--length", type=int, default=4000)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--tasks", nargs="+", default=["code_return", "json_value", "yaml_value"])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(6)))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).eval()
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": a.budget})
    chunker = Chunker(cfg.chunking, cfg.chunk_min, cfg.chunk_max,
                      BoundaryTable.from_tokenizer(tok, model.config.vocab_size))
    res = {"model": a.model_dir, "split": "dev", "length": a.length, "budget": a.budget, "samples": []}
    for task in a.tasks:
        for seed in a.seeds:
            got = sample_recall(model, tok, cfg, chunker, make(task, tok, a.length, seed))
            if got is None:
                continue
            res["samples"].append({"task": task, "seed": seed, **got})
            share = {m: [round(k / max(t, 1e-9), 3) for k, t in zip(got["kept"][m], got["mass"])] for m in METHODS}
            print(task, seed, got["dense_right"], got["key_value_chunks_apart"], share,
                  got["key_kept_value_dropped"], flush=True)
    summary = {}
    for task in a.tasks + ["all"]:
        rows = [s for s in res["samples"] if task in ("all", s["task"])]
        if not rows:
            continue
        mass = np.sum([s["mass"] for s in rows], 0)
        summary[task] = {"samples": len(rows), "dense_right": sum(s["dense_right"] for s in rows),
                         **{m: {"key": float(np.sum([s["kept"][m][0] for s in rows]) / mass[0]),
                                "value": float(np.sum([s["kept"][m][1] for s in rows]) / mass[1])} for m in METHODS},
                         "key_kept_value_dropped": {m: float(np.mean([s["key_kept_value_dropped"][m] for s in rows]))
                                                    for m in ("lychee", "lychee_next")}}
    res["summary"] = summary
    print(json.dumps(summary, indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
