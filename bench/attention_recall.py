"""Attention-level fidelity on captured Q/K/V of a real model (no generation, no server).

    python -m bench.attention_recall --out bench/results/attention_recall_smollm2.json
    python3 -m bench.attention_recall --device cuda --model-dir /tmp/qwen --length 16000 --budget 1024 \
        --task variable_tracking --seeds 0 1 2 --out $OUT/recall.json       # the GPU machine, real weights

Runs the model once over long prompts with transformers, capturing every layer's post-RoPE
queries, keys and values. The last ``--queries`` prompt positions act as decode queries over
the tokens before them; with ``--task``, the prompt of a fidelity task's seeded sample is followed by its
expected answer, and the queries are the ones that produce the answer's tokens (teacher forcing): what dense
attention reads while answering, against what the selection gives it. For each sparse layer and each
method/config it reports, against dense attention: top-k recall (share of the budget's top dense tokens
that were selected), attention-mass recall (dense softmax weight on the selected tokens), the output's relative
error, and the share of KV read. Selection runs through the same functions the server uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import torch

from bench.tasks import passkey
from sgl_sparsekv.chunking import SENTENCE, BoundaryTable, Chunker
from sgl_sparsekv.config import SparseKVConfig
from sgl_sparsekv.index import build_index
from sgl_sparsekv.summary import summarize_units
from sgl_sparsekv.select import _prefix_within, quest_scores, select_chunks, select_pages, units_to_token_mask


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
        # logits of the last position only: all of them would be [T, vocab] (18 GB at 30K tokens on the CPU)
        model(torch.as_tensor(ids, device=model.device)[None], logits_to_keep=1)
    return layers


def unit_bounds(chunker, ids):
    ends = chunker.cuts(ids)
    starts = np.r_[0, ends[:-1]]
    return torch.tensor(starts), torch.tensor(ends)


def token_bound_chunks(index, kbuf, starts, ends, q, budget: int, reduce: str, per_chunk: bool = False) -> torch.Tensor:
    """Analysis: lychee's fine clusters (``per_chunk``: its chunks) ranked by Quest's bound over their tokens' keys
    (per-channel min/max of every token in the group) instead of their chunk centroids, every group live; taken in
    that order while they fit the budget -> bool [H, M] chunks."""
    H, M = index.chunk_fine.shape
    d = kbuf.shape[-1]
    pos = torch.arange(int(starts[0]), int(ends[-1]), device=kbuf.device)
    chunk = torch.searchsorted(ends, pos, right=True)
    if per_chunk:
        group, L = chunk.expand(H, -1), M
        sizes = (ends - starts).float().expand(H, -1)
    else:
        group, L = index.chunk_fine[:, chunk], index.fine_mu.shape[1]              # [H, T]
        sizes = index.fine_tokens
    keys = kbuf[pos].transpose(0, 1).float()                                       # [H, T, d]
    idx = group[..., None].expand(-1, -1, d)
    kmin = torch.full((H, L, d), float("inf"), device=kbuf.device).scatter_reduce(1, idx, keys, "amin")
    kmax = torch.full((H, L, d), float("-inf"), device=kbuf.device).scatter_reduce(1, idx, keys, "amax")
    live = torch.isfinite(kmin[..., 0])
    score = quest_scores(q, kmin.nan_to_num(0.0, 0.0, 0.0), kmax.nan_to_num(0.0, 0.0, 0.0), reduce)
    order = torch.sort(score.masked_fill(~live, float("-inf")), dim=-1, descending=True, stable=True).indices
    take = _prefix_within(sizes.gather(1, order), live.gather(1, order), budget)
    take = torch.zeros_like(take).scatter_(1, order, take)
    return take if per_chunk else take.gather(1, index.chunk_fine)


def recall_curves(cfg: SparseKVConfig, ids, layers, positions, table, levels) -> np.ndarray:
    """[layers, KV heads, levels]: the attention mass lychee's own selection keeps with each budget of ``levels``,
    averaged over the queries at ``positions`` and the group's query heads."""
    out = np.zeros((len(layers), layers[0][1].shape[0], len(levels)))
    for i, b in enumerate(levels):
        uniform = np.full(out.shape[:2], b)
        for (l, t), m in own_masks(cfg, ids, layers, positions, table, budgets=uniform).items():
            out[l, :, i] += mask_metrics(layers[l], t, m, b)[:, 0] / len(positions)
    return out


def adaptive_budgets(recall: np.ndarray, levels, budget: int, first: int) -> np.ndarray:
    """Token budget per (layer, KV head), one of ``levels``: each sparse layer's head takes the level that maximizes
    its kept mass minus ``lam`` per token, ``lam`` bisected so the heads read at most ``budget`` on average."""
    levels = np.asarray(levels)

    def pick(lam):
        return levels[np.argmax(recall[first:] - lam * levels, axis=-1)]

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pick(mid).mean() > budget else (lo, mid)
    out = np.full(recall.shape[:2], budget, dtype=np.int64)
    out[first:] = pick(hi)
    return out


def query_spans(ids, positions, table, query: str) -> dict:
    """{t: (first, last)}: the positions whose mean query selects for the step at ``t``. ``own``: t itself;
    ``previous``: t - 1 (RACC: adjacent steps attend alike, so a step's selection could run one step ahead);
    ``sentence``: SentenceKV's sentence query, the mean over the steps of the sentence being generated (from the
    first decode step, or the step after the last token that ends a sentence, up to t)."""
    if query == "own":
        return {t: (t, t) for t in positions}
    if query == "previous":
        return {t: (t - 1, t - 1) for t in positions}
    strength = table.cut_strength(np.asarray(ids))
    spans, start = {}, positions[0]
    for t in positions:
        spans[t] = (start, t)
        if strength[t] >= SENTENCE:         # the token at t ends a sentence: the next step starts a new one
            start = t + 1
    return spans


def selection_steps(layers, positions, first_sparse: int, every: int, drift: float) -> dict:
    """{t: s}: the decode step whose selection the step at ``t`` attends with (config ``select_every``: a request
    selects every ``every`` steps and reuses the lists in between). With ``drift`` > 0 it also selects anew once its
    query has turned away from the one that selected: the mean cosine over the first sparse layer's query heads
    below ``drift`` (a refresh a device could decide from the query it holds; not built)."""
    q = layers[first_sparse][0]                                        # [Hq, T, d]
    src, s = {}, None
    for t in positions:
        if s is None or t - s >= every or (
                drift > 0 and float(torch.nn.functional.cosine_similarity(q[:, t], q[:, s], dim=-1).mean()) < drift):
            s = t
        src[t] = s
    return src


def reused_masks(cfg: SparseKVConfig, every: int, drift: float, ids, layers, positions, table) -> dict:
    """Like :func:`own_masks` for requests that reuse their lists (``selection_steps``)."""
    return masks_selected_at(cfg, selection_steps(layers, positions, cfg.dense_layers, every, drift), ids, layers,
                             table)


def masks_selected_at(cfg: SparseKVConfig, src: dict, ids, layers, table) -> dict:
    """{(layer, t): mask}: the step at t attends to the mask selected at step ``src[t]`` = s (with its own query) and
    to every token decoded since, (s, t], as ``PooledDecode`` serves lists kept across steps (``select_every``;
    ``select_ahead``, where s = t - 1)."""
    base = own_masks(cfg, ids, layers, sorted(set(src.values())), table)
    out = {}
    for (l, s), m in base.items():
        for t in (t for t, s_ in src.items() if s_ == s):
            out[(l, t)] = torch.cat([m, torch.ones(m.shape[0], t - s, dtype=torch.bool, device=m.device)], 1)
    return out


def with_successors(mask: torch.Tensor, k: int) -> torch.Tensor:
    """[H, seq] bool: the mask and the ``k`` positions after each of its positions."""
    out = mask.clone()
    for j in range(1, k + 1):
        out[:, j:] |= mask[:, :-j]
    return out


def window(cfg: SparseKVConfig, seq: int) -> tuple[int, int, int]:
    """(sink tokens, recent window, budget past both) of a step over ``seq`` tokens."""
    sink = min(cfg.sink_tokens, seq)
    recent = min(cfg.recent_window, seq - sink)
    return sink, recent, cfg.token_budget - sink - recent


def own_masks(cfg: SparseKVConfig, ids, layers, positions, table, token_bound: str = "", query: str = "own",
              budgets: np.ndarray | None = None) -> dict:
    """{(layer, t): bool mask [H, t + 1]} of what each sparse layer selects for the query at each position t,
    through the reference functions the server's kernels are tested against (``token_bound`` "cluster" or
    "chunk": ranked by :func:`token_bound_chunks`; ``query``: which query selects, see :func:`query_spans`;
    ``budgets``: lychee, a token budget per (layer, KV head) instead of ``cfg.token_budget``)."""
    spans = query_spans(ids, positions, table, query)
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
        sink, recent, budget = window(cfg, seq)
        for l, (q_all, k_all, _) in enumerate(layers):
            if l < cfg.dense_layers:
                continue
            H, _, d = k_all.shape
            kbuf = k_all[:, :seq].transpose(0, 1)       # [seq, H, d] like a KV pool, slot = position
            first, last = spans[t]
            q = q_all[:, first:last + 1].mean(1).view(H, -1, d)
            if budgets is not None:
                budget = torch.as_tensor(budgets[l], dtype=torch.float32, device=dev)[:, None] - sink - recent
            if cfg.method == "lychee":
                ukeys = summarize_units(kbuf, slots, indptr, False).transpose(0, 1)     # [H, U, d]
                box = (summarize_units(kbuf, slots, indptr, True).transpose(0, 1)        # [H, U, 2, d]
                       if cfg.fine_bound == "box" else None)
                index = build_index(ukeys, ends - starts, cfg.fine_cluster_size, cfg.max_coarse, cfg.kmeans_iters,
                                    chunk_box=box)
                if token_bound:
                    sel = token_bound_chunks(index, kbuf, starts, ends, q, budget, cfg.gqa_reduce,
                                             token_bound == "chunk")
                else:
                    sel = select_chunks(index, q, budget, cfg.expansion(budget), cfg.gqa_reduce, cfg.radius_weight)
            else:
                mm = summarize_units(kbuf, slots, indptr, True)                          # [U, H, 2, d]
                sel = select_pages(q, mm[:, :, 0].transpose(0, 1), mm[:, :, 1].transpose(0, 1), budget,
                                   cfg.page_size, cfg.gqa_reduce)
            out[(l, t)] = units_to_token_mask(sel, starts, ends, seq, sink, recent)    # [H, seq]
    return out


def served_masks(cfg: SparseKVConfig, ids, layers, positions, table) -> dict:
    """Like :func:`own_masks`, through the serving path instead: a ``SparseKVManager`` builds the prompt's index in
    its pools from a KV pool holding the captured keys (slot = position + 1), and ``PooledDecode`` (the Triton
    kernels on a GPU, their twins on the CPU) selects each decode step's token lists; the tokens before each
    query are fed as decode steps, so decode chunks are cut and grafted as in serving."""
    from sgl_sparsekv.manager import SparseKVManager
    from sgl_sparsekv.patches.pooled_decode import PooledDecode

    dev = layers[0][1].device
    H, n, d = layers[0][1].shape
    Hq = layers[0][0].shape[0]
    k_pool = [torch.cat([torch.zeros(1, H, d, device=dev), k.transpose(0, 1)]) for _, k, _ in layers]
    v_pool = [torch.cat([torch.zeros(1, H, d, device=dev), v.transpose(0, 1)]) for _, _, v in layers]
    r2t = torch.zeros(1, n + 1, dtype=torch.int32, device=dev)
    r2t[0, :n] = torch.arange(1, n + 1, dtype=torch.int32, device=dev)
    m = SparseKVManager(cfg, len(layers), H, d, n + 1, device=dev, boundary_table=table)
    decoder = PooledDecode(m, max_bs=1, q_heads=Hq)
    # the prompt: tokens [0, first]; with select_ahead one step earlier, whose selection the first position reads
    first = positions[0] - cfg.select_ahead
    toks = [int(x) for x in ids]
    plan = m.prepare_extend([0], [0], [first + 1], r2t, [toks])
    for l in range(len(layers)):
        m.pool_layer(l, k_pool[l], plan)
    m.finish_extend([0], [True], r2t, lambda l: k_pool[l])
    out = {}
    for t in range(first, positions[-1] + 1):   # a decode step per token (cuts and grafts as in serving)
        decoder.prepare([0], [t + 1], 1, r2t, [toks], lambda l: k_pool[l])
        if t not in positions and cfg.select_every == 1 and not cfg.select_ahead:   # (kept lists: written when
            continue                                                                 # selected)
        row, tail = int(decoder.list_rows[0]), int(decoder.tail_from[0])
        if decoder.direct[0]:   # no lists selected at the step before (select_ahead's first step)
            row, tail = None, 0
        for l in range(cfg.dense_layers, len(layers)):
            sl = l - cfg.dense_layers
            read = attended_mask(decoder, row, tail, sl, t + 1) if cfg.select_ahead else None
            q = layers[l][0][:, t][None].to(k_pool[l].dtype)    # [1, Hq, d]
            decoder.attend(q, k_pool[l], v_pool[l], sl, r2t, d ** -0.5)
            out[(l, t)] = read if cfg.select_ahead else attended_mask(decoder, row, tail, sl, t + 1)
        decoder.join()   # as the backend does after the forward (select_ahead on a GPU selects on a side stream)
    return {key: m for key, m in out.items() if key[1] in positions}


def attended_mask(decoder, row: int | None, tail: int, sparse_layer: int, seq: int) -> torch.Tensor:
    """[H, seq] bool: the positions a one-request decoder's lists of list row ``row`` hold (KV slot = position + 1)
    and the tail from ``tail`` on (the whole sequence when ``row`` is None)."""
    H = decoder.H
    mask = torch.zeros(H, seq, dtype=torch.bool, device=decoder.starts.device)
    mask[:, tail:] = True   # the tokens decoded since the lists were selected
    for h in range(H if row is not None else 0):
        mask[h, decoder.token_list(row * H + h, sparse_layer).long() - 1] = True
    return mask


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


def per_query(cfg: SparseKVConfig, ids, layers, positions, table, variant: str = "", budgets=None):
    """({(layer, t): [H, 5] metrics}, {(layer, t): mask}) of the queries at ``positions``; ``variant``: one of
    VARIANTS (``-served``: selected through the manager and the pooled decode path; ``-adaptive-budget``: with
    ``budgets`` per (layer, KV head))."""
    if variant.endswith("-served"):
        masks = served_masks(cfg, ids, layers, positions, table)
    elif variant in HEDGES:
        masks = hedged_masks(cfg, *HEDGES[variant], ids, layers, positions, table)
    elif variant in CARRIES:
        masks = carried_masks(cfg, CARRIES[variant], ids, layers, positions, table)
    elif variant in RERANKS:
        masks = reranked_masks(cfg, RERANKS[variant], ids, layers, positions, table)
    elif variant in REUSES:
        masks = reused_masks(cfg, *REUSES[variant], ids, layers, positions, table)
    elif variant in NEXTS:
        base, k = NEXTS[variant]
        masks = {key: with_successors(m, k)
                 for key, m in per_query(cfg, ids, layers, positions, table, base, budgets)[1].items()}
    elif variant in ("lychee-ahead", "lychee-ahead-box-0.25"):
        masks = masks_selected_at(cfg, {t: t - 1 for t in positions}, ids, layers, table)
    elif oracle := next((o for o in ORACLES if variant.endswith(o)), None):
        masks = oracle_masks(cfg, ids, layers, positions, table, ORACLES[oracle])
    else:
        bound = next((b for b in ("cluster", "chunk") if variant.endswith(f"-{b}-token-bound")), "")
        query = next((x for x in ("previous", "sentence") if variant.endswith(f"-{x}-query")), "own")
        masks = own_masks(cfg, ids, layers, positions, table, bound, query,
                          budgets if variant.endswith("-adaptive-budget") else None)
    return {(l, t): mask_metrics(layers[l], t, m, cfg.token_budget) for (l, t), m in masks.items()}, masks


def hedged_masks(cfg: SparseKVConfig, kind: str, share: float, ids, layers, positions, table) -> dict:
    """Analysis: lychee's selection with ``1 - share`` of the budget past the sink and the recent window, joined with
    a pick by Quest's per-channel min/max bound with the rest: over Quest's pages (``kind`` "quest") or over
    lychee's own chunks ("chunk"). That bound sees a page or chunk holding one token that takes a head's whole
    attention (the digit a copying head reads); a chunk's mean key does not."""
    free = cfg.token_budget - cfg.sink_tokens - cfg.recent_window
    pages = int(free * share) // cfg.page_size * cfg.page_size
    own = dataclasses.replace(cfg, token_budget=cfg.token_budget - pages)
    rest = {"token_budget": cfg.sink_tokens + cfg.recent_window + pages}
    a = own_masks(own, ids, layers, positions, table)
    if kind == "quest":
        b = own_masks(SparseKVConfig.from_method("quest", {**rest, "sink_tokens": cfg.sink_tokens,
                                                           "recent_window": cfg.recent_window}),
                      ids, layers, positions, table)
    else:
        b = own_masks(dataclasses.replace(cfg, **rest), ids, layers, positions, table, token_bound="chunk")
    return {key: m | b[key] for key, m in a.items()}


def group_attention(layer, t: int, among: torch.Tensor | None = None) -> torch.Tensor:
    """[H, t + 1]: dense attention of the query at ``t``, the mean over each KV head's query group (the softmax taken
    over the ``among`` tokens only, a bool [H, t + 1], when given)."""
    q_all, k_all, _ = layer
    H, _, d = k_all.shape
    logits = torch.einsum("hgd,hsd->hgs", q_all[:, t].view(H, -1, d), k_all[:, :t + 1]) / math.sqrt(d)
    if among is not None:
        logits = logits.masked_fill(~among[:, None], float("-inf"))
    return torch.softmax(logits, -1).mean(1)


def chunk_pick(w: torch.Tensor, starts, ends, cost: torch.Tensor, budget: int) -> torch.Tensor:
    """bool [H, U]: per head, the chunks holding the most of ``w`` [H, seq] (attention mass), in that order while
    their ``cost`` ([U] or [H, U] tokens) fits ``budget``; chunks with no mass are never taken."""
    cum = torch.nn.functional.pad(w.cumsum(-1), (1, 0))
    mass = cum[:, ends] - cum[:, starts]                                          # [H, U]
    order = mass.argsort(-1, descending=True)
    keep = (cost.expand_as(mass).gather(1, order).cumsum(-1) <= budget) & (mass.gather(1, order) > 0)
    return torch.zeros_like(keep).scatter_(1, order, keep)


def oracle_masks(cfg: SparseKVConfig, ids, layers, positions, table, chunks: bool) -> dict:
    """Analysis, the ceiling of a selection at the same KV read: per (layer, KV head, query) the tokens that hold
    the most of the query group's mean dense attention, up to the budget past the sink and the recent window
    (``chunks``: lychee's chunks taken whole, by the mass they hold, in that order while they fit). A selection's
    gap to it is its ranking's; the ceiling's gap to 1 is the budget's."""
    chunker = Chunker(cfg.chunking, cfg.chunk_min, cfg.chunk_max, table)
    dev = layers[0][1].device
    out = {}
    for t in positions:
        seq = t + 1
        sink, recent, budget = window(cfg, seq)
        free = torch.zeros(seq, dtype=torch.bool, device=dev)
        free[sink:seq - recent] = True
        if chunks:
            starts, ends = (x.to(dev) for x in unit_bounds(chunker, ids[:seq]))
            fcum = torch.nn.functional.pad(free.long().cumsum(0), (1, 0))
            cost = fcum[ends] - fcum[starts]                                             # [U]
        for l in range(cfg.dense_layers, len(layers)):
            w = group_attention(layers[l], t) * free
            if not chunks:
                top = w.topk(min(budget, int(free.sum())), -1).indices
                out[(l, t)] = torch.zeros_like(w, dtype=torch.bool).scatter_(1, top, True) | ~free
                continue
            out[(l, t)] = units_to_token_mask(chunk_pick(w, starts, ends, cost, budget), starts, ends, seq, sink,
                                              recent)
    return out


def reranked_masks(cfg: SparseKVConfig, factor: int, ids, layers, positions, table) -> dict:
    """Analysis, a two-stage selection: lychee picks ``factor`` times the budget past the sink and the recent window
    as candidates, then the budget's best candidate tokens by the query group's attention over the candidates
    (their keys read, scored exactly) are kept. It attends what lychee attends; it reads ``factor`` times the keys."""
    free = cfg.token_budget - cfg.sink_tokens - cfg.recent_window
    wide = own_masks(dataclasses.replace(cfg, token_budget=cfg.token_budget + (factor - 1) * free), ids, layers,
                     positions, table)
    out = {}
    for (l, t), cand in wide.items():
        seq = t + 1
        sink, recent, budget = window(cfg, seq)
        w = group_attention(layers[l], t, among=cand)
        w[:, :sink] = w[:, seq - recent:] = 0
        top = w.topk(min(budget, seq - sink - recent), -1).indices
        keep = torch.zeros_like(cand).scatter_(1, top, True) & cand
        keep[:, :sink] = keep[:, seq - recent:] = True
        out[(l, t)] = keep
    return out


def carried_masks(cfg: SparseKVConfig, share: float, ids, layers, positions, table) -> dict:
    """Analysis, attention-fed carry-over: each step attends lychee's pick with ``1 - share`` of the budget past the
    sink and the recent window, joined with the chunks outside it that held the most of the previous step's attention
    (the query group's mean softmax over what that step attended) with the rest: a sparse attention that reports
    which chunks it read most lets the next step keep them (a copying head reads the digit after the one it read
    last, in the same chunk). The chain starts from plain lychee one step before the first query."""
    free = cfg.token_budget - cfg.sink_tokens - cfg.recent_window
    carry = int(free * share)
    steps = [positions[0] - 1, *positions]
    picks = own_masks(dataclasses.replace(cfg, token_budget=cfg.token_budget - carry), ids, layers, steps, table)
    prev = {l: m for (l, _), m in own_masks(cfg, ids, layers, steps[:1], table).items()}
    chunker = Chunker(cfg.chunking, cfg.chunk_min, cfg.chunk_max, table)
    dev = layers[0][1].device
    out = {}
    for t in positions:
        seq = t + 1
        sink, recent, _ = window(cfg, seq)
        starts, ends = (x.to(dev) for x in unit_bounds(chunker, ids[:seq]))
        for l in sorted(prev):
            own = picks[(l, t)]
            w = torch.nn.functional.pad(group_attention(layers[l], t - 1, among=prev[l]), (0, 1))   # [H, seq]
            outside = ~own
            outside[:, :sink] = outside[:, seq - recent:] = False
            cum = torch.nn.functional.pad(outside.long().cumsum(-1), (1, 0))
            cost = cum[:, ends] - cum[:, starts]                      # [H, U]: the tokens a chunk adds
            more = units_to_token_mask(chunk_pick(w * outside, starts, ends, cost, carry), starts, ends, seq, sink,
                                       recent)
            out[(l, t)] = prev[l] = own | more
    return out


def worst_misses(layers, masks: dict, ids, tok, n: int) -> list[dict]:
    """The ``n`` (layer, query, query head) whose dense attention mass the selection covers least, each with the
    tokens dense attention weighs most there and whether the selection has them: where the missed mass goes."""
    rows = []
    for (l, t), m in masks.items():
        q, k, _ = layers[l]
        H, _, d = k.shape
        G = q.shape[0] // H
        w = torch.softmax(torch.einsum("hgd,hsd->hgs", q[:, t].view(H, G, d), k[:, :t + 1]) / math.sqrt(d), -1)
        mass = (w * m[:, None]).sum(-1).cpu()
        rows += [(float(mass[h, g]), l, t, h, g) for h in range(H) for g in range(G)]
    out = []
    for mass, l, t, h, g in sorted(rows)[:n]:
        q, k, _ = layers[l]
        G = q.shape[0] // k.shape[0]
        w = torch.softmax(k[h, :t + 1] @ q[h * G + g, t] / math.sqrt(k.shape[-1]), -1)
        top = torch.topk(w, 4)
        out.append({"layer": l, "query": t, "kv_head": h, "q_head": h * G + g, "mass_recall": round(mass, 4),
                    "top": [{"pos": int(p), "weight": round(float(x), 4), "token": tok.decode([int(ids[p])]),
                             "selected": bool(masks[(l, t)][h, p])} for p, x in zip(top.indices, top.values)]})
    return out


# lychee joined with a second pick that takes this share of the budget past the sink and the recent window: Quest's
# pages, or lychee's own chunks ranked by Quest's bound over their tokens (``token_bound_chunks``)
HEDGES = {"lychee-quest-hedge-25": ("quest", 0.25), "lychee-quest-hedge-50": ("quest", 0.5),
          "lychee-chunk-hedge-25": ("chunk", 0.25), "lychee-chunk-hedge-50": ("chunk", 0.5)}

# lychee joined with the chunks the previous step attended most, which take this share of the budget
CARRIES = {"lychee-carry-25": 0.25, "lychee-carry-50": 0.5}

# two-stage selections: lychee's pick at this many times the budget, reranked token by token
RERANKS = {"lychee-rerank-2": 2, "lychee-rerank-4": 4}

# lists reused across decode steps: (select_every, drift threshold of selection_steps, 0 = none)
REUSES = {"lychee-every-2": (2, 0.0), "lychee-every-4": (4, 0.0), "lychee-every-16-drift-0.8": (16, 0.8)}

# a variant's masks with each selected token's next k tokens too (copying heads move one token per step: what
# select_ahead's step before selected misses the token after it)
NEXTS = {f"{base}-next-{k}": (base, k) for base in ("lychee", "lychee-ahead") for k in (1, 2, 4)}

# the ceilings at the same read (a variant's name ends with one): the best tokens, or its chunks taken whole (True)
ORACLES = {"-oracle-tokens": False, "-oracle-chunks": True}

VARIANTS = {
    "lychee": {},
    "lychee-served": {},
    "lychee-upper-bound": {"radius_weight": 1.0},
    "lychee-centroid-rank": {"radius_weight": 0.0},
    "lychee-cluster-token-bound": {},
    "lychee-chunk-token-bound": {},
    "lychee-fine-1": {"fine_cluster_size": 1.0},
    "lychee-fine-2": {"fine_cluster_size": 2.0},   # the default up to 560e8bf (results of then name it lychee)
    "lychee-fine-1.5": {"fine_cluster_size": 1.5},
    # fine-1 with the other rankings: how much its clusters' radii (the coarse level's) and coarse pruning still cost
    "lychee-fine-1-centroid-rank": {"fine_cluster_size": 1.0, "radius_weight": 0.0},
    "lychee-fine-1-upper-bound": {"fine_cluster_size": 1.0, "radius_weight": 1.0},
    "lychee-fine-1-flat": {"fine_cluster_size": 1.0, "coarse_expand": 1e9},
    "lychee-gqa-mean": {"gqa_reduce": "mean"},
    # the layers lychee leaves dense by default (dense_layers 2), selected too: how much of their attention a
    # selection keeps
    "lychee-dense-0": {"dense_layers": 0},
    "lychee-expand-4": {"coarse_expand": 4.0, "coarse_expand_min": 0},
    "lychee-expand-8": {"coarse_expand": 8.0, "coarse_expand_min": 0},
    "lychee-expand-128": {"coarse_expand": 128.0, "coarse_expand_min": 0},
    "lychee-flat": {"coarse_expand": 1e9},
    "lychee-fixed-chunks": {"chunking": "fixed"},
    "lychee-previous-query": {},
    # selection one step ahead as served (select_ahead): the step before's own selection, and the token decoded since
    "lychee-ahead": {},
    # fine_bound box (bf16 boxes of each fine cluster's token keys, ranked at the default radius_weight), alone and
    # with select_ahead (the names bench.fidelity gives their runs): the options the README offers for dense's answers
    "lychee-box-0.25": {"fine_bound": "box"},
    "lychee-ahead-box-0.25": {"fine_bound": "box"},
    **{v: {} for v in NEXTS},
    "lychee-sentence-query": {},
    "lychee-adaptive-budget": {},
    **{v: {} for v in RERANKS},
    **{v: {} for v in REUSES},
    "lychee-oracle-tokens": {},
    "lychee-oracle-chunks": {},
    "lychee-chunks-4-8": {"chunk_min": 4, "chunk_max": 8},
    "lychee-chunks-4-8-oracle-chunks": {"chunk_min": 4, "chunk_max": 8},
    **{v: {} for v in HEDGES},
    **{v: {} for v in CARRIES},
    "quest": {},
    "quest-previous-query": {},
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


def calibrate_budgets(model, tok, table, cfg: SparseKVConfig, length: int, queries: int = 16):
    """(budgets [layers, KV heads], record): :func:`adaptive_budgets` from lychee's kept-mass curves at the last
    ``queries`` positions of the calibration prompt that the head-role maps use."""
    from bench.head_roles import CALIBRATE
    from bench.tasks import make

    b = cfg.token_budget
    levels = [max(b // 2, cfg.sink_tokens + cfg.recent_window + 16), b, 2 * b, 4 * b]
    ids = np.asarray(tok(make(CALIBRATE[0], tok, length, CALIBRATE[1]).prompt).input_ids)
    recall = recall_curves(cfg, ids, capture(model, ids), range(len(ids) - queries, len(ids)), table, levels)
    budgets = adaptive_budgets(recall, levels, b, cfg.dense_layers)
    return budgets, {"calibration": {"task": CALIBRATE[0], "seed": CALIBRATE[1], "tokens": len(ids),
                                     "queries": queries},
                     "levels": levels, "recall": np.round(recall, 4).tolist(), "budgets": budgets.tolist()}


METRICS = ("mass_recall", "mass_recall_min", "topk_recall", "out_rel_err", "kv_read")


def selected_share(result: dict, variant: str) -> dict:
    """{"selected_steps": share of the queried steps that select anew} of a variant that reuses lists, else {}."""
    if variant.split("@")[0] not in REUSES:
        return {}
    picks = sum(s["selections"][variant] for s in result["samples"])
    return {"selected_steps": round(picks / sum(s["queries"] for s in result["samples"]), 4)}


def first_layers(results: list[dict], variant: str = "lychee-dense-0", n: int = 4) -> dict:
    """layer -> task -> the mass recall and output error of ``variant`` (every layer selected) in the first ``n``
    layers: the ones lychee leaves dense by default beside the first it selects."""
    out: dict = {}
    for r in results:
        for p in r["variants"][variant]["per_layer"][:n]:
            out.setdefault(str(p["layer"]), {})[r["task"]] = {k: round(p[k], 4) for k in ("mass_recall", "out_rel_err")}
    return out


def merge(results: list[dict]) -> dict:
    """Several ``--task`` results of one model, budget and length -> per task, each variant's summary (no per-layer
    rows), and each variant's mean over the tasks; with ``lychee-dense-0`` in every result, its first layers'
    rows (``first_layers``)."""
    first = results[0]
    assert all((r["model"], r["budget"], r["length"]) == (first["model"], first["budget"], first["length"])
               for r in results), "results of different models, budgets or lengths"
    tasks = {r["task"]: {"samples": [s["sample"] for s in r["samples"]],
                         "variants": {v: {k: round(x[k], 4) for k in METRICS} | selected_share(r, v)
                                      for v, x in r["variants"].items()}}
             for r in results}
    variants = [v for v in first["variants"] if all(v in t["variants"] for t in tasks.values())]
    mean = {v: {k: round(float(np.mean([t["variants"][v][k] for t in tasks.values()])), 4)
                for k in (*METRICS, "selected_steps") if k in tasks[first["task"]]["variants"][v]} for v in variants}
    out = {"model": first["model"], "device": first["device"], "budget": first["budget"], "length": first["length"],
           "tasks": tasks, "mean_over_tasks": mean}
    if "lychee-dense-0" in variants:
        out["first_layers"] = first_layers(results)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="models/smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budget", type=int, nargs="+", default=[256], help="several: each variant at each budget, "
                    "named VARIANT@BUDGET, over one capture of each sample")
    ap.add_argument("--length", type=int, default=3000)
    ap.add_argument("--queries", type=int, default=4, help="without --task: the prompt's last positions queried")
    ap.add_argument("--task", default=None, help="a bench.tasks task: its samples, queried while answering")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--explain", type=int, default=0, help="per sample and variant, the N worst-covered query "
                    "heads with dense attention's top tokens")
    ap.add_argument("--merge", nargs="+", metavar="RESULT", help="merge --task results into one (per task and "
                    "the mean over tasks), written to --out")
    ap.add_argument("--out", default="bench/results/attention_recall_smollm2.json")
    a = ap.parse_args()
    if a.merge:
        results = []
        for path in a.merge:
            with open(path) as f:
                results.append(json.load(f))
        with open(a.out, "w") as f:
            json.dump(merge(results), f, indent=1)
        return
    tok, model = load(a.model_dir, a.device)
    table = BoundaryTable.from_tokenizer(tok)
    several = len(a.budget) > 1
    res = {"model": a.model_dir, "device": torch.cuda.get_device_name() if a.device != "cpu" else "CPU",
           "budget": a.budget if several else a.budget[0], "task": a.task, "length": a.length,
           "samples": [], "variants": {}}
    cfgs = {f"{v}@{b}" if several else v:
            SparseKVConfig.from_method(v.split("-")[0], {"token_budget": b, **VARIANTS[v]})
            for b in a.budget for v in a.variants}
    per = {name: {} for name in cfgs}
    budgets = None
    if adaptive := next((v for v in a.variants if v.endswith("-adaptive-budget")), None):
        if several:
            ap.error("an adaptive-budget variant calibrates for one --budget")
        budgets, res["adaptive_budget"] = calibrate_budgets(model, tok, table, cfgs[adaptive], a.length)
    for name, ids, positions in samples(tok, a):
        layers = capture(model, ids)
        res["samples"].append({"sample": name, "tokens": len(ids), "queries": len(positions)})
        for v, cfg in cfgs.items():
            if (reuse := REUSES.get(v.split("@")[0])) is not None:   # how often the step selects anew
                src = selection_steps(layers, positions, cfg.dense_layers, *reuse)
                res["samples"][-1].setdefault("selections", {})[v] = len(set(src.values()))
            got, masks = per_query(cfg, ids, layers, positions, table, v.split("@")[0], budgets)
            per[v].update({(l, f"{name}:{t}"): m for (l, t), m in got.items()})
            if a.explain:
                res["samples"][-1].setdefault("worst", {})[v] = worst_misses(layers, masks, ids, tok, a.explain)
        del layers
    for v, cfg in cfgs.items():
        r = res["variants"][v] = dict(config=cfg.to_dict(), **summarize(per[v]))
        print(f"{v:22s} mass {r['mass_recall']:.3f} (min {r['mass_recall_min']:.3f})  top-k {r['topk_recall']:.3f}"
              f"  out err {r['out_rel_err']:.3f}  kv read {r['kv_read']:.3f}", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
