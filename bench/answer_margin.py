"""Answer-level fidelity on the CPU without a server: the served decode path inside a real model's forward,
teacher-forced over each seeded task sample's expected answer, and optionally generating greedily.

    python -m bench.answer_margin --model-dir models/qwen --task niah_multivalue --length 16000 --seeds 6 31 \
        --methods off lychee lychee-ahead --generate 24 --out bench/results/answer_margin_qwen_multivalue_16k.json

The prompt is prefilled densely, as served (sparse-kv decodes only); its keys fill a KV pool and a
``SparseKVManager`` builds the prompt's index from them. Then every answer token but the last is one decode step
whose sparse layers attend through ``PooledDecode`` (the kernels' torch twins on the CPU) exactly as in serving:
lists selected per step with that step's own queries, decode chunks cut and grafted, ``select_ahead`` attending to
the step before's lists (its first step, eager, to the lists it selects with its own query). Errors compound
through the layers as they do in serving, which attention-mass recall over dense Q/K/V
(``bench.attention_recall``) cannot show.

Per sample and method, over the answer tokens that decode steps produce (all but the first, which the dense
prefill produces for every method): their log-probability, the smallest margin of their logits over the best other
token (below 0: greedy decoding leaves the expected answer there), and whether every one is the argmax. The answer
is the task's expected values joined by ", " (``bench.attention_recall.samples``), not necessarily the wording
dense would choose; ``--generate N`` also scores each method's own greedy answer as the fidelity harness does.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from bench.attention_recall import load
from bench.fidelity import METHODS
from sgl_sparsekv import index, index_pool
from sgl_sparsekv.chunking import BoundaryTable
from sgl_sparsekv.config import SparseKVConfig


FIRST_STEP = ("dense-first", "prompt")
LYCHEE_VARIANTS = ("sticky", "chunk-bound")


def config(method: str, budget: int) -> tuple[SparseKVConfig, int, str | None]:
    """A ``bench.fidelity`` method name (``off`` for dense) at ``budget`` -> (its config, own layers, its analysis
    variant: how the first decode step selects, "sticky" or "chunk-bound"). Analysis suffixes of a select_ahead
    method: ``+own-N`` lets the last N layers select with their own step's query, as lychee does, and the others one
    step ahead.
    Served, the first decode step selects with its own query before it attends (an eager step); instead it attends
    to its whole sequence (``+dense-first``: a first step inside a CUDA graph) or in every layer to lists selected
    with the last prompt token's query (``+prompt``: what a selection at the end of the prefill would give it).
    ``lychee+sticky``: each step attends to the union of the lists it selects and the ones it selected at the step
    before, in each layer and KV head (its KV read counts the union). ``lychee+chunk-bound``: each step attends to
    lychee's chunks ranked by Quest's key bound over each chunk's tokens instead of by the index, taken in that order
    while they fit the budget past the sink and the window."""
    name, *extra = method.split("+")
    base, overrides = METHODS[name]
    cfg = SparseKVConfig.from_method(base, None if base == "off" else {"token_budget": budget, **overrides})
    if len(extra) == 1 and extra[0] in LYCHEE_VARIANTS and base == "lychee" and not cfg.select_ahead:
        return cfg, 0, extra[0]
    own = next((int(e[4:]) for e in extra if e.startswith("own-")), 0)
    variant = [e for e in extra if e in FIRST_STEP]
    if (extra and not cfg.select_ahead) or set(extra) - {*variant, f"own-{own}"} or len(variant) > 1:
        raise ValueError(f"{method}: +own-N and one of +dense-first / +prompt apply to a select_ahead method; "
                         "+sticky or +chunk-bound to lychee")
    return cfg, own, variant[0] if variant else None


class ServedAttention:
    """A transformers attention function: dense over the cache for the prompt and for dense layers; a decode
    step's sparse layers attend as the plugin's backend serves them, over KV pools (slot = position + 1) into which
    the new token's key and value are written first, as SGLang writes them before its attention backend runs:
    lychee through a ``PooledDecode`` (``decoders``: per layer), quest through the manager's page selection
    (``plan``: the step's)."""

    def __init__(self, manager, decoders, k_pool, v_pool, r2t, first=None, prompt_q=None, variant=None):
        self.manager, self.decoders, self.k_pool, self.v_pool, self.r2t = manager, decoders, k_pool, v_pool, r2t
        self.plan = None
        # +sticky / +chunk-bound: how the step's sparse layers attend instead; +sticky: each layer's lists (per KV
        # head, KV slots) of the step before; the tokens the layers read and the tokens of the step's own lists
        self.variant, self.before, self.tokens_read, self.lists_read = variant, {}, 0, 0
        # +prompt: the decoder whose output every layer takes at the first decode step, and the last prompt token's
        # query per layer, which selects its lists there
        self.first, self.prompt_q = first, prompt_q
        self.step = 0

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        from sgl_sparsekv.attend import dense_decode, sparse_decode

        l, m = module.layer_idx, self.manager
        if query.shape[2] > 1 or m is None or not m.is_sparse_layer(l):
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        t = key.shape[2] - 1
        self.k_pool[l][t + 1] = key[0, :, t]
        self.v_pool[l][t + 1] = value[0, :, t]
        q = query[0, :, 0]                                                     # [Hq, d]
        if self.decoders:
            args = (self.k_pool[l], self.v_pool[l], l - m.cfg.dense_layers, self.r2t, scaling)
            out = self.decoders[l].attend(q[None], *args)[0]
            if self.variant == "sticky":
                out = self.attend_union(q, l, t, scaling)
            elif self.variant == "chunk-bound":
                out = self.attend_chunk_bound(q, l, t, scaling)
            if self.step == 0 and self.first is not None:   # the ahead decoder still selects for the next step
                self.first._select(self.prompt_q[l][None], *args[:1], *args[2:])
                out = self.first._attention(q[None], *args)[0]
        else:
            m.pool_layer(l, self.k_pool[l], self.plan)
            mask = m.select(l, 0, q.view(key.shape[1], -1, q.shape[-1]))
            slots = self.r2t[0, :t + 1]
            out = (dense_decode(q, self.k_pool[l], self.v_pool[l], slots, scaling) if mask is None
                   else sparse_decode(q, self.k_pool[l], self.v_pool[l], slots, mask, scaling))
        return out[None, None], None

    def attend_union(self, q, l: int, t: int, scaling) -> torch.Tensor:
        """+sticky: layer ``l`` attends to its lists of this step joined with those of the step before."""
        dec, sl = self.decoders[l], l - self.manager.cfg.dense_layers
        now = [dec.token_list(h, sl).long() for h in range(dec.H)]
        mask = torch.zeros(dec.H, t + 1, dtype=torch.bool)
        for h, lists in enumerate(zip(now, self.before.get(l, now))):
            for slots in lists:
                mask[h, slots - 1] = True   # slot = position + 1
        self.before[l] = now
        self.lists_read += sum(len(x) for x in now)
        return self.attend_mask(q, l, mask, scaling)

    def attend_chunk_bound(self, q, l: int, t: int, scaling) -> torch.Tensor:
        """+chunk-bound: layer ``l`` attends to the request's chunks (as the manager cut them) ranked by Quest's bound
        ``sum_i max(q_i min_i, q_i max_i)`` over each chunk's keys, in that order while they fit the budget."""
        from sgl_sparsekv.select import _prefix_within, quest_scores, units_to_token_mask
        from sgl_sparsekv.summary import summarize_units

        cfg, st, S = self.manager.cfg, self.manager.states[0], t + 1
        starts, ends = torch.tensor(st.starts), torch.tensor(st.ends)
        starts, ends = starts[ends <= S], ends[ends <= S]
        slots = torch.cat([torch.arange(a, b) for a, b in zip(starts.tolist(), ends.tolist())]) + 1   # position + 1
        indptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(ends - starts, 0)])
        bounds = summarize_units(self.k_pool[l], slots, indptr, True).transpose(0, 1)    # [H, n, 2, d] min, max
        H, n, _, d = bounds.shape
        scores = quest_scores(q.view(H, -1, d).float(), bounds[:, :, 0], bounds[:, :, 1], cfg.gqa_reduce)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        take = _prefix_within((ends - starts).float()[order], torch.ones(order.shape, dtype=torch.bool),
                              cfg.token_budget - cfg.sink_tokens - cfg.recent_window)
        sel = torch.zeros(H, n, dtype=torch.bool).scatter_(1, order, take)
        mask = units_to_token_mask(sel, starts, ends, S, cfg.sink_tokens, cfg.recent_window)
        self.lists_read += int(mask.sum())
        return self.attend_mask(q, l, mask, scaling)

    def attend_mask(self, q, l: int, mask: torch.Tensor, scaling) -> torch.Tensor:
        from sgl_sparsekv.attend import sparse_decode

        self.tokens_read += int(mask.sum())
        return sparse_decode(q, self.k_pool[l], self.v_pool[l], self.r2t[0, :mask.shape[1]], mask, scaling)


def answer_scores(logits: torch.Tensor, answer: list[int]) -> dict:
    """logits [A, vocab] predicting the answer's A tokens -> over the tokens that decode steps produce (all but the
    first, which the dense prefill produces for every method): their log-probability, smallest margin over the
    best other token and its index, whether each is the argmax; and the first token's margin."""
    gold = torch.as_tensor(answer)[:, None]
    margin = logits.gather(1, gold)[:, 0] - logits.scatter(1, gold, float("-inf")).amax(1)
    logp = torch.log_softmax(logits.float(), -1).gather(1, gold)[1:, 0]
    below = (margin[1:] < 0).nonzero()
    return {"logprob": round(float(logp.sum()), 4), "min_margin": round(float(margin[1:].min()), 4),
            "worst_token": int(margin[1:].argmin()) + 1, "first_below": int(below[0, 0]) + 1 if len(below) else None,
            "argmax": not len(below), "first_token_margin": round(float(margin[0]), 4)}


def decode(model, table, cfg: tuple[SparseKVConfig, int, str | None], prompt: np.ndarray, prefill, steps: int,
           pick) -> tuple[list, dict]:
    """One method (:func:`config`'s triple) over one sample: up to ``steps`` decode steps after ``prefill`` (see
    :func:`prefill`); ``pick(i, logits)`` gives step i's input token (None: stop). -> (the logits of every position
    from the prompt's last on, what the steps read: {"kv_read"} on the pooled path)."""
    import copy
    import dataclasses

    from transformers.modeling_utils import AttentionInterface

    from sgl_sparsekv.manager import SparseKVManager
    from sgl_sparsekv.patches.pooled_decode import PooledDecode

    cfg, own, variant = cfg
    cache = copy.deepcopy(prefill[0])
    P, n = len(prompt), len(prompt) + steps
    toks = [int(x) for x in prompt]
    k_pool = v_pool = r2t = None
    runs = []   # (manager, decoder or None), each over the same KV pools
    if cfg.enabled:
        keys = [(layer.keys[0], layer.values[0]) for layer in cache.layers]      # [H, P, d] each
        L, (H, _, d) = len(keys), keys[0][0].shape
        k_pool, v_pool = ([torch.cat([torch.zeros(1, H, d), x.transpose(0, 1), torch.zeros(n - P, H, d)])
                           for x in kv] for kv in zip(*keys))
        r2t = torch.zeros(1, n + 1, dtype=torch.int32)
        r2t[0, :n] = torch.arange(1, n + 1, dtype=torch.int32)
        for c in [cfg] + ([dataclasses.replace(cfg, select_ahead=False)] if own or variant == "prompt" else []):
            m = SparseKVManager(c, L, H, d, n + 1, device="cpu", boundary_table=table)
            plan = m.prepare_extend([0], [0], [P], r2t, [toks])
            for l in range(L):   # quest: page summaries
                m.pool_layer(l, k_pool[l], plan)
            m.finish_extend([0], [True], r2t, lambda l: k_pool[l])
            runs.append((m, PooledDecode(m, max_bs=1, q_heads=model.config.num_attention_heads)
                         if m.pools is not None else None))
    lychee = [dec for _, dec in runs if dec is not None]
    decoders = {l: lychee[-1] if l >= L - own else lychee[0] for l in range(L)} if lychee else {}
    by_prompt = variant == "prompt"
    served = ServedAttention(runs[0][0] if runs else None, decoders, k_pool, v_pool, r2t,
                             lychee[-1] if by_prompt else None, prefill[2] if by_prompt else None,
                             variant if variant in LYCHEE_VARIANTS else None)
    AttentionInterface.register("served", served)
    model.config._attn_implementation = "served"
    logits = [prefill[1]]
    with torch.no_grad():
        for i in range(steps):
            nxt = pick(i, logits[-1])
            if nxt is None:
                break
            toks.append(int(nxt))
            for m, dec in runs:
                if dec is not None:
                    dec.prepare([0], [len(toks)], 1, r2t, [toks], lambda l: k_pool[l],
                                eager=variant is None or variant in LYCHEE_VARIANTS)
                else:
                    served.plan = m.prepare_decode([0], [len(toks)], r2t, [toks])
            served.step = i
            logits.append(model(torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1])
    read = {}
    if lychee and not (own or by_prompt):   # the pooled path counts what its steps read (not in a composition)
        st = runs[0][0].stats
        read["kv_read"] = round(st["attended_tokens"] / max(1, st["context_tokens"]), 4)
        if variant in LYCHEE_VARIANTS:   # what the layers read, and the step's own lists (shorter than the budget)
            per_step = H * runs[0][0].pools.layers * max(1, st["context_tokens"])
            read.update(kv_read=round(served.tokens_read / per_step, 4),
                        lists_read=round(served.lists_read / per_step, 4))
    return logits, read


def teacher_forced(model, table, cfg: tuple[SparseKVConfig, int, str | None], prompt: np.ndarray, answer: list[int],
                   prefill) -> dict:
    """The expected answer's scores (:func:`answer_scores`) with each answer token fed as the next step's input."""
    logits, read = decode(model, table, cfg, prompt, prefill, len(answer) - 1, lambda i, _: answer[i])
    return {**answer_scores(torch.stack(logits), answer), **read}


def greedy(model, table, cfg: tuple[SparseKVConfig, int, str | None], prompt: np.ndarray, prefill, max_tokens: int,
           eos: set[int]) -> dict:
    """Greedy generation of up to ``max_tokens`` (as the fidelity harness's server does at temperature 0) -> the
    token ids, and per token the margin of its logit over the runner-up's."""
    def pick(i, lg):
        return None if int(lg.argmax()) in eos else int(lg.argmax())

    logits, read = decode(model, table, cfg, prompt, prefill, max_tokens - 1, pick)
    top = torch.stack(logits).topk(2, dim=-1).values
    ids = [int(lg.argmax()) for lg in logits]
    n = next((i for i, t in enumerate(ids) if t in eos), len(ids))
    return {"ids": ids[:n], "margins": [round(float(x), 3) for x in (top[:n, 0] - top[:n, 1])], **read}


def prefill(model, prompt: np.ndarray):
    """(dense cache over the prompt, logits of its last position, each layer's query there [Hq, d])."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    last_q = {}

    def keep_last_query(module, query, *args, **kwargs):
        last_q[module.layer_idx] = query[0, :, -1].clone()
        return sdpa_attention_forward(module, query, *args, **kwargs)

    AttentionInterface.register("prefill", keep_last_query)
    model.config._attn_implementation = "prefill"
    with torch.no_grad():
        out = model(torch.as_tensor(prompt)[None], use_cache=True, logits_to_keep=1)
    return out.past_key_values, out.logits[0, -1], last_q


def fp8_box(box: torch.Tensor) -> torch.Tensor:
    """A compact storage of fine boxes (``--box-storage fp8``; in the kernels it lost answers at 30K, so the served
    boxes stay bf16): fp8 e4m3 codes times one power-of-two scale
    per box, the center rounded to nearest, the half-width grown by that rounding and rounded up, as
    ``index.quantize_box`` does in bf16, so the box still covers its keys. The scale is the smallest that keeps the
    stored box's largest |center| + half-width within 224 (half of e4m3's range): a finer scale holds every value a
    coarser one does, so storing a stored box gives it back unchanged. Returned in ``index.BOX_DTYPE``, which holds
    every such value exactly: the served path reads it as it reads bf16 boxes."""
    f8 = torch.float8_e4m3fn
    center, half = box[..., 0, :].float(), box[..., 1, :].float()

    def stored(scale):
        c = (center / scale).to(f8).float() * scale
        w = (center - c).abs() + half
        codes = (w / scale).to(f8)
        up = (codes.view(torch.uint8) + 1).view(f8)   # the next e4m3 value (w >= 0: the next bit pattern)
        return c, torch.where(codes.float() * scale < w, up, codes).float() * scale

    def top(c, w):
        return (c.abs() + w).amax(-1, keepdim=True)

    scale = torch.exp2(torch.ceil(torch.log2(top(center, half).clamp_min(1e-30) / 224)))
    c, w = stored(scale)
    over = top(c, w) > 224 * scale   # the rounding pushed it past: the next scale up
    if over.any():
        c2, w2 = stored(2 * scale)
        c, w = torch.where(over, c2, c), torch.where(over, w2, w)
    return torch.stack([c, w], -2).to(index.BOX_DTYPE)


def main(argv=None):
    from bench.tasks import make

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="models/qwen")
    ap.add_argument("--task", required=True)
    ap.add_argument("--length", type=int, default=16000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--methods", nargs="+", default=["off", "lychee", "lychee-ahead"])
    ap.add_argument("--generate", type=int, default=0, metavar="N", help="also generate up to N tokens greedily "
                    "per method and score them as the fidelity harness does (24 there)")
    ap.add_argument("--box-storage", choices=["bf16", "fp8"], default="bf16", help="fine_bound box: the boxes as "
                    "served (bf16), or as fp8 codes with a power-of-two scale per box (fp8_box), the compact storage "
                    "tried in the kernels and not kept (bench/RESULTS.md, 'Fine boxes')")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.box_storage == "fp8":   # every store of a box (build, pools, grafts) rounds through quantize_box
        index.quantize_box = index_pool.quantize_box = fp8_box
    tok, model = load(a.model_dir, "cpu")
    table = BoundaryTable.from_tokenizer(tok)
    eos = {tok.eos_token_id}
    ids = model.generation_config.eos_token_id   # one id or a list
    eos.update(ids if isinstance(ids, list) else [ids])
    eos.discard(None)
    cfgs = {m: config(m, a.budget) for m in a.methods}
    res = {"model": a.model_dir, "device": "CPU", "task": a.task, "length": a.length, "budget": a.budget,
           "methods": a.methods, "box_storage": a.box_storage, "samples": []}
    for seed in a.seeds:
        s = make(a.task, tok, a.length, seed)
        prompt = np.asarray(tok(s.prompt).input_ids)
        answer = tok.encode(" " + ", ".join(s.expected), add_special_tokens=False)
        pre = prefill(model, prompt)
        row = {"seed": seed, "tokens": len(prompt), "answer_tokens": len(answer), "scores": {}}
        for m, cfg in cfgs.items():
            row["scores"][m] = teacher_forced(model, table, cfg, prompt, answer, pre)
            if a.generate:
                out = greedy(model, table, cfg, prompt, pre, a.generate, eos)
                text = tok.decode(out["ids"])
                pieces = [tok.decode([i]) for i in out["ids"]]
                row["scores"][m]["generated"] = {"text": text, "correct": s.score(text), "margins": out["margins"],
                                                 "held_by": s.held_by(pieces, out["margins"])}
            print(a.task, seed, m, row["scores"][m], flush=True)
        res["samples"].append(row)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
