"""Learned head roles for hybrid heads (LycheeDecode's HardKuma, issue #12), trained on a real model.

    python -m bench.hardkuma_roles --model-dir models/smollm2 --share 0.25 \
        --out bench/results/hardkuma_smollm2.json --map configs/head_roles/smollm2-hardkuma-0.25.json

Each KV head of each sparse layer after the first gets a gate z ~ HardKuma(alpha, beta): u ~ U(0, 1),
s = (1 - u^(1/beta))^(1/alpha), stretched to (p, q) = (-0.1, 1.1) and clamped to [0, 1]. On the decode positions of
calibration prompts (the last ``--queries`` tokens, as in ``bench/head_roles.py``) every such head attends to
``z * A_retrieval + (1 - z) * A_sparse``: A_retrieval over the tokens lychee selects for it (what a retrieval head
attends to when served), A_sparse over the set its KV head used in the layer before (the chain a sparse head
inherits; a head passes its own set on when its sampled z > 0.5). The model is frozen; only (alpha, beta) learn, by

    min_{alpha, beta} max_{lambda >= 0}  L_distill + lambda * (E[||z||_0] - N_target) / heads

with L_distill the mean squared distance between the student's and the dense model's logits at those positions and
E[||z||_0] = sum_h P(z_h > 0) in closed form; lambda rises by gradient ascent. With ``--rho 0`` that is the paper's
plain Lagrangian, under which the multiplier overshoots before the distillation has separated the heads and the
gates settle below the target. ``--rho`` > 0 (the default) damps it into an augmented Lagrangian: the constraint's
term becomes ``(max(0, lambda + rho * gap)^2 - lambda^2) / (2 * rho)``, so its pull vanishes as soon as E[||z||_0]
falls below the target by lambda / rho, whatever lambda has grown to. ``--constraint equal`` makes it an equality,
E[||z||_0] = N_target: lambda of either sign plus ``rho / 2 * gap^2`` (a multiplier of either sign alone swung
E[||z||_0] to 3 for a target of 11). The gates' parameters stay within ``GATE_LOG_RANGE``, where a shut gate still
opens in about 2% of the samples: a gate that never opens passes the distillation no gradient and could never
come back once the constraint's pull has gone.
A head retrieves iff E[z] > 0.5 (Monte Carlo). The prompt before the decode positions is prefilled densely once (its
KV cached), so a step runs only the decode positions with gradients. The learned map is evaluated like the calibrated
ones (``bench/head_roles.py``: chained attention-mass recall on held-out prompts) and written as a role map for
``head_roles``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench.attention_recall import capture, load, own_masks
from bench.head_roles import EVALUATE, evaluate, roles_array
from bench.tasks import make
from sgl_sparsekv import head_roles
from sgl_sparsekv.chunking import BoundaryTable
from sgl_sparsekv.config import SparseKVConfig

STRETCH = (-0.1, 1.1)
GATE_LOG_RANGE = 1.5   # |log alpha|, |log beta| <= 1.5: P(z > 0) stays in [0.022, 1], E[z] in [0.002, 0.96]
CALIBRATE = ("niah_multikey:100", "variable_tracking:100", "json_value:100")


def hardkuma_sample(log_a: torch.Tensor, log_b: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    p, q = STRETCH
    u = torch.rand(log_a.shape, generator=gen).clamp(1e-6, 1 - 1e-6)
    s = (1 - u ** torch.exp(-log_b)) ** torch.exp(-log_a)
    return (s * (q - p) + p).clamp(0.0, 1.0)


def prob_nonzero(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """P(z > 0) = 1 - F_kuma(x0), x0 = -p / (q - p), F(x) = 1 - (1 - x^a)^b: the closed-form E[||z||_0] per head."""
    p, q = STRETCH
    x0 = -p / (q - p)
    return (1 - x0 ** torch.exp(log_a)) ** torch.exp(log_b)


def expected_z(log_a: torch.Tensor, log_b: torch.Tensor, samples: int = 20000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return torch.stack([hardkuma_sample(log_a, log_b, gen) for _ in range(samples)]).mean(0)


class Prompt:
    """One calibration prompt: its dense prefix KV, the dense logits and lychee's own selections at its decode
    positions."""

    def __init__(self, model, cfg, ids: np.ndarray, queries: int, table):
        self.ids, self.n = ids, len(ids)
        self.start = self.n - queries
        layers = capture(model, ids)
        own = own_masks(cfg, ids, layers, range(self.start, self.n), table)
        self.own = {}   # sparse layer -> bool [H, queries, n]: its own selection at each decode position
        for l in range(cfg.dense_layers, len(layers)):
            m = torch.zeros(layers[l][1].shape[0], queries, self.n, dtype=torch.bool)
            for i, t in enumerate(range(self.start, self.n)):
                m[:, i, :t + 1] = own[(l, t)]
            self.own[l] = m
        model.config._attn_implementation = "sdpa"
        with torch.no_grad():
            x = torch.as_tensor(ids)[None]
            self.teacher = model(x).logits[0, self.start:].float()
            self.cache = model(x[:, :self.start], use_cache=True).past_key_values


class HybridAttention:
    """The attention function of the student: dense layers and prefill as SGLang runs them; at the decode positions
    of each sparse layer, each KV head mixes its own selection and its inherited set by its gate."""

    def __init__(self, first: int):
        self.first = first
        self.z = None          # [sparse layers, H] gates of this step (the first sparse layer's are 1)
        self.prompt = None
        self.chain = None      # the sets each KV head passes to the next layer (layers run in order)

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        l = module.layer_idx
        _, Hq, nq, d = query.shape
        H, S = key.shape[1], key.shape[2]
        G = Hq // H
        scores = torch.einsum("hgqd,hsd->hgqs", query[0].view(H, G, nq, d), key[0]) * scaling
        pos = self.prompt.start + torch.arange(nq)
        causal = torch.arange(S)[None, :] <= pos[:, None]                        # [nq, S]
        if l < self.first:
            out = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
            return torch.einsum("hgqs,hsd->qhgd", out, value[0]).reshape(1, nq, Hq, d), None
        own = self.prompt.own[l]                                                 # [H, nq, S]
        inherited = own if l == self.first else self.chain
        zl = self.z[l - self.first]
        self.chain = torch.where((zl > 0.5).view(H, 1, 1), own, inherited)
        z = zl.view(H, 1, 1, 1)
        out = 0.0
        for mask, w in ((own, z), (inherited, 1 - z)):
            att = torch.softmax(scores.masked_fill(~(mask & causal)[:, None], float("-inf")), -1)
            out = out + w * torch.einsum("hgqs,hsd->qhgd", att, value[0]).permute(1, 2, 0, 3)
        return out.permute(2, 0, 1, 3).reshape(1, nq, Hq, d), None


def constraint_term(gap: torch.Tensor, lam: float, rho: float, equal: bool) -> torch.Tensor:
    """The constraint's share of the loss for multiplier ``lam``: E[L0] = target (``equal``) or E[L0] <= target, the
    latter as the paper's ``lam * gap`` at ``rho`` 0 and as the augmented Lagrangian's damped term above 0."""
    if equal:
        return lam * gap + rho / 2 * gap ** 2
    if rho == 0:
        return lam * gap
    return (torch.relu(lam + rho * gap) ** 2 - lam ** 2) / (2 * rho)


def train(model, prompts, first: int, heads: int, layers: int, target: int, steps: int, lr: float, lr_lambda: float,
          seed: int, equal: bool = False, rho: float = 20.0) -> dict:
    """``equal``: E[L0] = target (lambda of either sign) instead of E[L0] <= target (lambda >= 0); ``rho``: the
    augmented Lagrangian's penalty (see ``constraint_term``)."""
    torch.manual_seed(seed)
    sparse = layers - first - 1                   # the first sparse layer always retrieves
    log_a = torch.zeros(sparse, heads, requires_grad=True)
    log_b = torch.zeros(sparse, heads, requires_grad=True)
    opt = torch.optim.Adam([log_a, log_b], lr=lr)
    attn = HybridAttention(first)
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register("hybrid_heads", attn)
    lam, log = 0.0, []
    gen = torch.Generator().manual_seed(seed)
    t0 = time.time()
    for step in range(steps):
        z = hardkuma_sample(log_a, log_b, gen)
        attn.z = torch.cat([torch.ones(1, heads), z])
        distill = 0.0
        for p in prompts:
            attn.prompt = p
            model.config._attn_implementation = "hybrid_heads"
            p.cache.crop(p.start)
            for c in p.cache.layers:   # the cropped prefix must not keep the last step's graph
                c.keys, c.values = c.keys.detach(), c.values.detach()
            x = torch.as_tensor(p.ids[p.start:])[None]
            logits = model(x, past_key_values=p.cache, use_cache=True).logits[0].float()
            distill = distill + ((logits - p.teacher) ** 2).mean() / len(prompts)
        l0 = prob_nonzero(log_a, log_b).sum() + heads
        gap = (l0 - target) / (sparse + 1) / heads
        loss = distill + constraint_term(gap, lam, rho, equal)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            log_a.clamp_(-GATE_LOG_RANGE, GATE_LOG_RANGE)
            log_b.clamp_(-GATE_LOG_RANGE, GATE_LOG_RANGE)
        lam = lam + lr_lambda * gap.item()
        lam = lam if equal else max(0.0, lam)
        if step % 10 == 0 or step == steps - 1:
            log.append({"step": step, "distill": round(float(distill), 5), "expected_l0": round(float(l0), 2),
                        "lambda": round(lam, 4), "seconds": round(time.time() - t0, 1)})
            print(json.dumps(log[-1]), flush=True)
    model.config._attn_implementation = "sdpa"
    ez = expected_z(log_a.detach(), log_b.detach())
    return {"roles": gated_roles(ez > 0.5, first), "top": top_roles(ez, first, heads, target), "expected_z": ez,
            "log": log}


def gated_roles(retrieves: torch.Tensor, first: int) -> np.ndarray:
    """The role array of every layer from the gated layers' picks: dense layers none, the first sparse layer all."""
    roles = np.zeros((first + 1 + retrieves.shape[0], retrieves.shape[1]), dtype=bool)
    roles[first] = True
    roles[first + 1:] = retrieves.numpy()
    return roles


def top_roles(ez: torch.Tensor, first: int, heads: int, target: int) -> np.ndarray:
    """The target's number of retrieval heads, by learned E[z] (the first sparse layer's heads always retrieve): the
    learned ranking at the count a calibrated map has, where E[z] > 0.5 gives whatever count the training ended at."""
    pick = torch.zeros(ez.numel(), dtype=torch.bool)
    pick[torch.argsort(ez.flatten(), descending=True, stable=True)[:max(0, target - heads)]] = True
    return gated_roles(pick.view(ez.shape), first)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="models/smollm2")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--length", type=int, default=2000)
    ap.add_argument("--queries", type=int, default=16, help="decode positions per calibration prompt")
    ap.add_argument("--eval-queries", type=int, default=4)
    ap.add_argument("--share", type=float, default=0.25, help="target retrieval heads as a share of the sparse heads")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--lr-lambda", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--constraint", choices=["at-most", "equal"], default="at-most",
                    help="E[L0] <= target (the paper's, lambda >= 0) or E[L0] = target (lambda of either sign)")
    ap.add_argument("--rho", type=float, default=20.0,
                    help="augmented Lagrangian penalty; 0 with at-most is the paper's plain Lagrangian")
    ap.add_argument("--calibrate", nargs="+", default=list(CALIBRATE), metavar="TASK:SEED",
                    help="calibration prompts (keep them apart from bench.head_roles' held-out EVALUATE prompts)")
    ap.add_argument("--compare", default=None, help="a role map (name or path) to evaluate beside the learned one")
    ap.add_argument("--out", required=True)
    ap.add_argument("--map", default=None, help="write the learned roles here as a role map")
    a = ap.parse_args()
    tok, model = load(a.model_dir)
    for prm in model.parameters():
        prm.requires_grad_(False)
    table = BoundaryTable.from_tokenizer(tok)
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": a.budget})
    first, layers = cfg.dense_layers, model.config.num_hidden_layers
    heads = model.config.num_key_value_heads
    sparse_heads = (layers - first) * heads
    target = max(heads, round(a.share * sparse_heads))
    t0 = time.time()
    calibrate = [(t, int(s)) for t, s in (c.split(":") for c in a.calibrate)]
    if set(calibrate) & set(EVALUATE):
        raise SystemExit(f"calibration prompts {sorted(set(calibrate) & set(EVALUATE))} are held out for evaluation")
    prompts = [Prompt(model, cfg, np.asarray(tok(make(t, tok, a.length, s).prompt).input_ids), a.queries, table)
               for t, s in calibrate]
    prep_s = time.time() - t0
    equal = a.constraint == "equal"
    got = train(model, prompts, first, heads, layers, target, a.steps, a.lr, a.lr_lambda, a.seed, equal, a.rho)
    roles = got["roles"]
    name = f"hardkuma-{'eq-' if equal else ''}{a.share:g}"
    variants = {name: roles, f"hardkuma-top-{a.share:g}": got["top"]}
    if a.compare:
        variants[a.compare] = roles_array(a.compare, layers, heads, first)
    res = {"model": a.model_dir, "budget": a.budget, "length": a.length, "share": a.share, "target_heads": target,
           "of": sparse_heads, "retrieval_heads": int(roles[first:].sum()),
           "training": {"calibration": [{"task": t, "seed": s, "tokens": p.n, "decode_positions": a.queries}
                                        for (t, s), p in zip(calibrate, prompts)],
                        "steps": a.steps, "lr": a.lr, "lr_lambda": a.lr_lambda, "seed": a.seed, "stretch": STRETCH,
                        "constraint": a.constraint, "rho": a.rho, "gate_log_range": GATE_LOG_RANGE,
                        "prepare_s": round(prep_s, 1), "device": "CPU", "log": got["log"]},
           "expected_z": np.round(got["expected_z"].numpy(), 3).tolist(),
           "roles": {v: {"retrieval_heads": int(r[first:].sum()), "of": sparse_heads,
                         "map": head_roles.to_strings(r, first)} for v, r in variants.items()},
           **evaluate(model, tok, cfg, table, variants, a.length, a.eval_queries)}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    if a.map:
        made_by = (f"`python -m bench.hardkuma_roles --model-dir {a.model_dir} --share {a.share:g} --steps {a.steps} "
                   f"--lr {a.lr:g} --lr-lambda {a.lr_lambda:g} --length {a.length} --budget {a.budget} --constraint "
                   f"{a.constraint} --rho {a.rho:g} --queries {a.queries} --calibrate {' '.join(a.calibrate)}` "
                   f"({a.out}): "
                   "HardKuma gates trained on the CPU by "
                   f"distillation to the dense logits at {a.queries} decode positions of "
                   f"{', '.join(f'{t} seed {s}' for t, s in calibrate)}; a head retrieves iff E[z] > 0.5")
        Path(a.map).write_text(json.dumps({
            "model": Path(a.model_dir).name, "architectures": model.config.architectures, "num_layers": layers,
            "num_kv_heads": heads, "dense_layers": first, "retrieval_heads": int(roles[first:].sum()),
            "of": sparse_heads, "layers": res["roles"][name]["map"], "made_by": made_by}, indent=1) + "\n")


if __name__ == "__main__":
    main()
