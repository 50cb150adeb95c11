"""How much of a decode step's selection the steps before it already selected: the hit rate a per-request device
buffer of hot tokens would get, by its size (issue #93: it sizes the host tier's buffers; bench_host_copy's 29 GB/s
says the misses must stay near 2% at batch 32). One-off: what it decided is in docs/RESULTS.md.

    python -m experiments.selection_reuse --model-dir models/qwen2.5-coder-0.5b --length 4000 --budget 256 \
        --out /tmp/reuse.json                                            # the CPU, fp32
    python3 -m experiments.selection_reuse --device cuda --model-dir /tmp/qwen2.5-coder-0.5b --length 30000 \
        --budget 1024 --out $OUT/reuse.json                              # the GPU machine, bf16

For each dev sample: the model writes ``--steps`` tokens greedily after the prompt; one forward over prompt and output
captures every layer's post-RoPE queries and keys. Lychee's index is built over the prompt's chunks (structure cuts,
unit keys as the server pools them, the default config), and each output position's query selects chunks through
``sgl_sparsekv.select`` as a decode step would (the sink and the recent window are on the device anyway and are left
out). Per sparse layer and KV head, a buffer of ``m`` x the retrieved budget in device rows keeps the chunks used
most recently, by the tier's own policy (``sgl_sparsekv.residency.HotChunks``: slots of ``chunk_max`` rows, one chunk
each, at least as many as one selection can name); its hit rate is the share of the tokens attended over the steps
after the first that it did not have to load. With ``select_every`` k a request selects at every k-th step and
attends to those lists in between, so only every k-th step loads (k = 1, 4, 8). Reported per period and buffer size:
the mean over samples and sparse layers (heads pooled), per layer, and each layer's worst selecting step.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.nn.functional as F

from bench.tasks import make
from sgl_sparsekv.chunking import BoundaryTable, Chunker
from sgl_sparsekv.config import SparseKVConfig
from sgl_sparsekv.index import build_index
from sgl_sparsekv.residency import HotChunks
from sgl_sparsekv.select import select_chunks

SIZES = (2.0, 3.0, 4.0)   # device rows of a (request, layer, KV head)'s buffer, in retrieved budgets
PERIODS = (1, 4, 8)        # select_every: steps between two selections


def capture(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (q [Hq, T, d], k [H, T, d]) in fp32."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    layers = []

    def grab(module, q, k, v, *args, **kwargs):
        layers.append((q[0].detach().float(), k[0].detach().float()))
        return sdpa_attention_forward(module, q, k, v, *args, **kwargs)

    AttentionInterface.register("capture", grab)
    model.config._attn_implementation = "capture"
    with torch.no_grad():
        model(ids[None], logits_to_keep=1)
    model.config._attn_implementation = "sdpa"
    return layers


def sample_reuse(model, tok, cfg: SparseKVConfig, chunker: Chunker, prompt: str, steps: int) -> dict:
    dev = model.device
    ids = torch.tensor(tok.encode(prompt), device=dev)
    out = model.generate(ids[None], max_new_tokens=steps, min_new_tokens=steps, do_sample=False)[0]
    P = len(ids)
    layers = capture(model, out)
    ends = chunker.cuts(ids.cpu().numpy())
    starts = np.r_[0, ends[:-1]]
    keep = starts >= cfg.sink_tokens   # chunks past the sink, as the server indexes them
    starts, ends = starts[keep], ends[keep]
    lens = ends - starts
    pos = torch.arange(P, device=dev)
    chunk_of = torch.as_tensor(np.searchsorted(ends, pos.cpu().numpy(), side="right"), device=dev)
    inside = (pos >= int(starts[0])) & (chunk_of < len(ends))
    retrieve = cfg.token_budget - cfg.sink_tokens - cfg.recent_window
    per_layer = {}
    for layer in range(cfg.dense_layers, len(layers)):
        q, k = layers[layer]
        H, d = k.shape[0], k.shape[-1]
        G = q.shape[0] // H
        keys = torch.zeros(H, len(ends), d, device=dev).index_add_(1, chunk_of[inside], k[:, :P][:, inside])
        keys = F.normalize(keys / torch.as_tensor(lens, device=dev, dtype=torch.float32)[None, :, None], dim=-1)
        index = build_index(keys, torch.as_tensor(lens, device=dev), cfg.fine_cluster_size, cfg.max_coarse,
                            cfg.kmeans_iters)
        # per selection period k (select_every): the lists of step t are the ones selected at the last multiple
        # of k, so only those steps load; a buffer's misses over every step's attended tokens is its miss rate
        W = cfg.chunk_max
        most = retrieve // cfg.chunk_min + 2   # chunks one selection may name
        slots = [max(-(-int(m * retrieve) // W), most) for m in SIZES]
        buffers = {k: [HotChunks(1, 1, H, n, W, torch.zeros(1, dtype=torch.int64)) for n in slots] for k in PERIODS}
        positions = torch.arange(P, dtype=torch.int32)[None]   # host rows: any, only the hit counts are read
        misses = {k: np.zeros(len(SIZES)) for k in PERIODS}
        worst = {k: np.ones(len(SIZES)) for k in PERIODS}
        attended = 0
        for t in range(steps):
            qt = q[:, P + t].view(H, G, d)
            sel = select_chunks(index, qt, retrieve, cfg.expansion(retrieve), cfg.gqa_reduce, cfg.radius_weight)
            chunks = [sel[h].nonzero().flatten().cpu() for h in range(H)]
            ids = torch.full((H, most), -1, dtype=torch.int64)
            for h, c in enumerate(chunks):
                ids[h, :len(c)] = c
            need = int(sum(lens[c.numpy()].sum() for c in chunks))
            attended += need * (t > 0)
            cs = torch.as_tensor(starts)[ids.clamp(min=0)] * (ids >= 0)
            cl = torch.as_tensor(lens)[ids.clamp(min=0)] * (ids >= 0)
            for k in PERIODS:
                if t % k:
                    continue
                for s, hot in enumerate(buffers[k]):
                    plan = hot.plan(0, torch.zeros(H, dtype=torch.int64), torch.arange(H), ids, cs, cl, positions, t,
                                    cap=H * most * W)
                    if t:
                        misses[k][s] += int(plan.miss_rows)
                        worst[k][s] = min(worst[k][s], int(plan.hit_rows) / max(need, 1))
        per_layer[layer] = {f"every_{k}": {"hit_rate": {str(m): float(1 - misses[k][s] / max(attended, 1))
                                                        for s, m in enumerate(SIZES)},
                                           "worst_step": {str(m): float(worst[k][s]) for s, m in enumerate(SIZES)}}
                            for k in PERIODS}
    return {"prompt_tokens": P, "chunks": len(ends), "layers": per_layer}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--length", type=int, default=4000)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--tasks", nargs="+", default=["niah_multivalue", "variable_tracking", "json_value", "code_return"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=dtype).to(a.device).eval()
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": a.budget})
    table = BoundaryTable.from_tokenizer(tok, model.config.vocab_size)
    chunker = Chunker(cfg.chunking, cfg.chunk_min, cfg.chunk_max, table)
    res = {"model": a.model_dir, "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(),
           "length": a.length, "budget": a.budget, "steps": a.steps, "sizes": SIZES, "periods": PERIODS, "samples": []}
    for task in a.tasks:
        for seed in a.seeds:
            got = sample_reuse(model, tok, cfg, chunker, make(task, tok, a.length, seed).prompt, a.steps)
            res["samples"].append({"task": task, "seed": seed, **got})
            print(task, seed, {k: {m: round(float(np.mean([x[f"every_{k}"]["hit_rate"][str(m)]
                                                            for x in got["layers"].values()])), 4) for m in SIZES}
                               for k in PERIODS}, flush=True)
    layers = sorted(res["samples"][0]["layers"])

    def mean(k, m, lays=layers):
        return float(np.mean([s["layers"][lay][f"every_{k}"]["hit_rate"][str(m)] for s in res["samples"]
                              for lay in lays]))

    res["mean"] = {f"every_{k}": {str(m): mean(k, m) for m in SIZES} for k in PERIODS}
    res["mean_per_layer"] = {lay: {f"every_{k}": {str(m): mean(k, m, [lay]) for m in SIZES} for k in PERIODS}
                             for lay in layers}
    print(json.dumps(res["mean"]))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
