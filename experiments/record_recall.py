"""Which tokens of the answer's record a selection drops, and which selection would keep them (issue #94, item 3).

    python -m experiments.record_recall --model-dir models/qwen2.5-coder-0.5b --length 8000 --budget 256 \
        --out /tmp/record_recall.json                                    # the CPU, fp32, dev split

For each dev sample of the record families (code_return: a function's name and, four lines below, the value it
returns; json_value and yaml_value: a leaf key and its value among many alike), the model writes the answer greedily
and one forward over prompt and answer captures every layer's queries and keys. At each answer token's step, per
sparse layer and KV head, dense attention's mass (the GQA group's mean) is split into what a selection attends and
what it drops: on the record's key tokens (the function name, the leaf key), on its value tokens, and in all.
Every selection spends the same retrieved budget by the same rule (units in score order while the running token
count stays within it; the sink and the recent window are attended by all):

- ``lychee``: the default (structure chunks, the default index, ``sgl_sparsekv.select``);
- ``lychee_past``: the default over the chunks that end before the recent window (the server's index also holds the
  prompt's last chunks, which the window attends anyway, and a selection of them reads nothing more);
- ``sentence_mean``: the default index ranked by the mean query of the question's line and the answer so far
  (SentenceKV's query aggregation), ``sentence_max`` by each of those queries, the largest bound of any;
- ``box``: the option ``fine_bound`` "box" (each fine cluster ranked by its tokens' key box);
- ``small_chunks``: the default with structure chunks of 4-8 tokens instead of 8-16 (twice the index);
- ``rerank_2``, ``_4``, ``_8``: two stages (``rerank_factor`` f): the default's cut at f x the budget, then the
  budget's tokens of most mass among them (keys of f x the budget read);
- ``quest``: Quest's 16-token pages at the same budget;
- ``mean_logit``: the same chunks ranked by q.(mean of their keys), the largest over the group's heads: the
  centroid's score without the normalization the index applies to chunk keys (so with the mean key's norm);
- ``lychee_norm``: the default index with each fine cluster's centroid and radius scaled by the mean norm of its
  chunks' mean keys (what ``mean_logit`` asks of an index: one scalar more per fine cluster);
- ``chunk_max``: the same chunks ranked by their largest exact q.k over the group's heads, the best any bound on a
  chunk's keys can rank (what a tighter bound buys);
- ``chunk_mass``: the same chunks ranked by dense attention's own mass on them (what chunking allows at all);
- ``token_mass``: the budget's tokens of most mass, one by one (what any selection allows).

(``mean_logit``, ``chunk_max`` and ``chunk_mass`` leave out the chunks the recent window holds whole, as
``lychee_past`` does, and ``token_mass`` the window's tokens.)

Reported: the kept share of each part's mass (mass-weighted over steps, layers and heads), and how often each
selection attends all of the value's chunks. One-off: what it decided is in docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from bench.tasks import make
from experiments.selection_reuse import capture
from sgl_sparsekv.chunking import BoundaryTable, Chunker
from sgl_sparsekv.config import SparseKVConfig
from sgl_sparsekv.index import NEG_INF, build_index, scatter_max, scatter_sum
from sgl_sparsekv.select import select_chunks, select_pages

METHODS = ("lychee", "lychee_past", "sentence_mean", "sentence_max", "box", "small_chunks", "rerank_2", "rerank_4",
           "rerank_8", "mean_logit", "lychee_norm", "quest", "chunk_max", "chunk_mass", "token_mass")
PARTS = ("key", "value", "all")


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


def within(scores: torch.Tensor, sizes: torch.Tensor, budget: int) -> torch.Tensor:
    """bool [H, N]: units in descending score order while the running size stays within ``budget`` (lychee's rule;
    a unit of score -inf ends the run)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    size = torch.where(torch.isfinite(scores), sizes.float().expand_as(scores), torch.inf).gather(1, order)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, order, torch.cumsum(size, -1) <= budget)


class Chunks(NamedTuple):
    """A prompt's chunks past the sink as the server indexes them, and where each token lies."""
    starts: np.ndarray
    ends: np.ndarray
    lens: torch.Tensor
    count: int
    chunk_of: torch.Tensor   # [P] each token's chunk (count past the last)
    inside: torch.Tensor     # [P] tokens in some chunk
    at_chunk: torch.Tensor   # chunk_of[inside]

    @classmethod
    def of(cls, chunker: Chunker, ids: torch.Tensor, sink: int) -> Chunks:
        ends = chunker.cuts(ids.numpy())
        starts = np.r_[0, ends[:-1]]
        keep = starts >= sink
        starts, ends = starts[keep], ends[keep]
        pos = torch.arange(len(ids))
        chunk_of = torch.as_tensor(np.searchsorted(ends, pos.numpy(), side="right"))
        inside = (pos >= int(starts[0])) & (chunk_of < len(ends))
        return cls(starts, ends, torch.as_tensor(ends - starts), len(ends), chunk_of, inside, chunk_of[inside])

    def mean_keys(self, k: torch.Tensor, P: int) -> torch.Tensor:
        """[H, M, d] each chunk's mean key; normalized, the unit chunk keys the server pools."""
        H, d = k.shape[0], k.shape[-1]
        total = torch.zeros(H, self.count, d).index_add_(1, self.at_chunk, k[:, :P][:, self.inside])
        return total / self.lens[None, :, None].float()

    def tokens(self, sel: torch.Tensor, P: int) -> torch.Tensor:
        """bool [H, P]: the tokens of the selected chunks ``sel`` [H, M]."""
        out = torch.zeros(sel.shape[0], P, dtype=torch.bool)
        out[:, self.inside] = sel[:, self.at_chunk]
        return out


def sample_recall(model, tok, cfg: SparseKVConfig, box_cfg: SparseKVConfig, chunker: Chunker,
                  fine_chunker: Chunker, sample) -> dict | None:
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
    ch, small = Chunks.of(chunker, ids, cfg.sink_tokens), Chunks.of(fine_chunker, ids, cfg.sink_tokens)
    starts, ends, lens, M, chunk_of, inside, at_chunk = ch
    line = len(tok(sample.prompt[:sample.prompt.rindex("\n") + 1])["input_ids"])   # the question's first token
    past = int(np.searchsorted(ends, P - cfg.recent_window, side="right"))   # chunks that end before the window
    val_chunks = torch.unique(chunk_of[val_tok & inside])
    parts = torch.stack([key_tok, val_tok, torch.ones(P, dtype=torch.bool)])   # [3, P]
    retrieve = cfg.token_budget - cfg.sink_tokens - cfg.recent_window
    page = SparseKVConfig.from_method("quest").page_size
    kept = {m: np.zeros(len(PARTS)) for m in METHODS}
    read = {m: 0.0 for m in METHODS}
    value_whole = {m: 0 for m in METHODS}
    total = np.zeros(len(PARTS))
    cases = 0
    for layer in range(cfg.dense_layers, len(layers)):
        q, k = layers[layer]
        H, d = k.shape[0], k.shape[-1]
        G = q.shape[0] // H
        ki = k[:, :P][:, inside]
        mean = ch.mean_keys(k, P)
        keys = F.normalize(mean, dim=-1)
        at = at_chunk[None, :, None].expand(H, -1, d)
        lo = torch.full((H, M, d), torch.inf).scatter_reduce_(1, at, ki, "amin")
        hi = torch.full((H, M, d), -torch.inf).scatter_reduce_(1, at, ki, "amax")
        index = build_index(keys, lens, cfg.fine_cluster_size, cfg.max_coarse, cfg.kmeans_iters)
        index_past = build_index(keys[:, :past], lens[:past], cfg.fine_cluster_size, cfg.max_coarse, cfg.kmeans_iters)
        index_box = build_index(keys, lens, cfg.fine_cluster_size, cfg.max_coarse, cfg.kmeans_iters,
                                torch.stack([lo, hi], 2))
        # the default index with each fine cluster's centroid and radius scaled by its chunks' mean key norm
        L = index.fine_r.shape[1]
        scale = scatter_sum(mean.norm(dim=-1), index.chunk_fine, L) / index.fine_n.clamp(min=1)
        index_norm = replace(index, fine_mu=index.fine_mu * scale[..., None],
                             fine_r=torch.where(torch.isfinite(index.fine_r), index.fine_r * scale, index.fine_r))
        index_small = build_index(F.normalize(small.mean_keys(k, P), dim=-1), small.lens, cfg.fine_cluster_size,
                                  cfg.max_coarse, cfg.kmeans_iters)
        n_pages = -(-P // page)
        pk = F.pad(k[:, :P], (0, 0, 0, n_pages * page - P), value=float("nan")).view(H, n_pages, page, d)
        kmin, kmax = pk.nan_to_num(float("inf")).amin(2), pk.nan_to_num(float("-inf")).amax(2)
        for t in range(len(answer)):
            now = P - 1 + t   # the query that writes answer token t
            qt = q[:, now].view(H, G, d)
            qs = q[:, line:now + 1].view(H, G, -1, d)   # the queries of the question and the answer so far
            logits = (qt @ k[:, :now + 1].transpose(1, 2)) / d ** 0.5            # [H, G, now + 1]
            probs = torch.softmax(logits, dim=-1).mean(1)[:, :P]
            base = torch.zeros(H, P, dtype=torch.bool)
            base[:, :cfg.sink_tokens] = True
            base[:, max(0, now + 1 - cfg.recent_window):] = True
            in_window = torch.as_tensor(starts >= now + 1 - cfg.recent_window)   # chunks the window holds whole

            def pick(ix, query, budget=retrieve, reduce=cfg.gqa_reduce, c=cfg):   # sgl_sparsekv.select's cut
                return select_chunks(ix, query, budget, c.expansion(budget), reduce, c.radius_weight)

            def ranked(scores):   # the chunks past the window in score order, lychee's rule
                return within(scores.masked_fill(in_window, NEG_INF), lens, retrieve)

            per_chunk = at_chunk[None].expand(H, -1)
            chunks = {
                "lychee": pick(index, qt),
                "lychee_past": F.pad(pick(index_past, qt), (0, M - past)),
                "sentence_mean": pick(index, qs.mean(2)),
                "sentence_max": pick(index, qs.flatten(1, 2), reduce="max"),
                "box": pick(index_box, qt, reduce=box_cfg.gqa_reduce, c=box_cfg),
                "lychee_norm": pick(index_norm, qt),
                "mean_logit": ranked((scatter_sum(logits[..., :P][..., inside], at_chunk[None, None].expand(H, G, -1),
                                                  M) / lens.float()).amax(1)),
                "chunk_max": ranked(scatter_max(logits.amax(1)[:, :P][:, inside], per_chunk, M)),
                "chunk_mass": ranked(scatter_sum(probs[:, inside], per_chunk, M)),
            }
            tokens = {m: ch.tokens(sel, P) for m, sel in chunks.items()}
            tokens["small_chunks"] = small.tokens(pick(index_small, qt), P)
            for f in (2, 4, 8):   # two stages: lychee's cut at f x the budget, the budget's tokens of most mass
                wide = ch.tokens(pick(index, qt, f * retrieve), P) & ~base
                tokens[f"rerank_{f}"] = torch.zeros(H, P, dtype=torch.bool).scatter_(
                    1, probs.masked_fill(~wide, -1).topk(retrieve, dim=-1).indices, True) & wide
            pages = select_pages(qt, kmin, kmax, retrieve, page, cfg.gqa_reduce)
            tokens["quest"] = pages.repeat_interleave(page, 1)[:, :P]
            free = probs.masked_fill(base, NEG_INF)
            tokens["token_mass"] = torch.zeros(H, P, dtype=torch.bool).scatter_(
                1, free.topk(retrieve, dim=-1).indices, True)
            for m in METHODS:
                read[m] += float((tokens[m] & ~base).sum()) / H
                value_whole[m] += int(tokens[m][:, val_tok & inside].all(1).sum()) if len(val_chunks) else 0
                kept[m] += ((probs * (tokens[m] | base))[:, None, :] * parts).sum((0, 2)).numpy()
            total += (probs[:, None, :] * parts).sum((0, 2)).numpy()
            cases += H
    steps = (len(layers) - cfg.dense_layers) * len(answer)
    return {"dense_right": bool(dense_right), "prompt_tokens": P, "chunks": M, "key_tokens": int(key_tok.sum()),
            "value_tokens": int(val_tok.sum()), "mass": total.tolist(),
            "kept": {m: v.tolist() for m, v in kept.items()},
            "read": {m: read[m] / steps for m in METHODS},
            "value_whole": {m: value_whole[m] / cases for m in METHODS}}


def share(rows: list[dict], m: str) -> dict:
    mass = np.sum([s["mass"] for s in rows], 0)
    kept = np.sum([s["kept"][m] for s in rows], 0)
    return {**{p: round(float(kept[i] / mass[i]), 4) for i, p in enumerate(PARTS)},
            "value_whole": round(float(np.mean([s["value_whole"][m] for s in rows])), 4),
            "read": round(float(np.mean([s["read"][m] for s in rows])), 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--length", type=int, default=8000)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--tasks", nargs="+", default=["code_return", "json_value", "yaml_value"])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(6)))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).eval()
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": a.budget})
    box_cfg = SparseKVConfig.from_method("lychee", {"token_budget": a.budget, "fine_bound": "box"})
    table = BoundaryTable.from_tokenizer(tok, model.config.vocab_size)
    chunker = Chunker(cfg.chunking, cfg.chunk_min, cfg.chunk_max, table)
    fine_chunker = Chunker(cfg.chunking, cfg.chunk_min // 2, cfg.chunk_max // 2, table)
    res = {"model": a.model_dir, "split": "dev", "length": a.length, "budget": a.budget, "device": "cpu",
           "samples": []}
    for task in a.tasks:
        for seed in a.seeds:
            got = sample_recall(model, tok, cfg, box_cfg, chunker, fine_chunker, make(task, tok, a.length, seed))
            if got is None:
                continue
            res["samples"].append({"task": task, "seed": seed, **got})
            print(task, seed, got["dense_right"], {m: share([got], m) for m in METHODS}, flush=True)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    summary = {}
    for task in a.tasks + ["all"]:
        rows = [s for s in res["samples"] if task in ("all", s["task"])]
        if rows:
            summary[task] = {"samples": len(rows), "dense_right": sum(s["dense_right"] for s in rows),
                             **{m: share(rows, m) for m in METHODS}}
    res["summary"] = summary
    print(json.dumps(summary, indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
