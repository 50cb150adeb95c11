"""Passkey retrieval through the real SGLang server on CPU: off vs lychee vs quest.

    python -m bench.passkey_table --model smollm2 --budget 256 --out bench/results/passkey_smollm2.json

Each method gets its own server; every (length, depth, seed) prompt is scored by whether the
greedy completion contains the key. Also records the fraction of KV that decode attended.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from bench.server import Server
from bench.tasks import passkey


def run(model: str, model_dir: str, budget: int, lengths, depths, seeds, methods) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    result = {"model": model, "budget": budget, "device": f"CPU ({platform.processor() or platform.machine()})",
              "lengths": list(lengths), "depths": list(depths), "seeds": list(seeds), "methods": {}}
    for method in methods:
        cfg = None if method == "off" else {"token_budget": budget}
        rows = []
        with Server(model_dir, method, cfg, extra=["--max-total-tokens", "65536"]) as srv:
            for n in lengths:
                for d in depths:
                    for seed in seeds:
                        prompt, key = passkey(tok, n, d, seed=seed)
                        t = time.perf_counter()
                        text = srv.complete(prompt)["choices"][0]["text"]
                        rows.append(dict(length=n, depth=d, seed=seed, correct=key in text, answer=text,
                                         seconds=round(time.perf_counter() - t, 2)))
            stats = srv.stats()
        frac = stats["attended_tokens"] / stats["context_tokens"] if stats.get("context_tokens") else 1.0
        result["methods"][method] = {"accuracy": sum(r["correct"] for r in rows) / len(rows),
                                     "kv_fraction_read": round(frac, 4), "rows": rows}
        print(method, result["methods"][method]["accuracy"], flush=True)
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--model-dir", default="models/smollm2")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000, 6000])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--methods", nargs="+", default=["off", "lychee", "quest"])
    ap.add_argument("--out", default="bench/results/passkey_smollm2.json")
    a = ap.parse_args()
    from sgl_sparsekv.models import prepare

    prepare(a.model, a.model_dir)
    res = run(a.model, a.model_dir, a.budget, a.lengths, a.depths, a.seeds, a.methods)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
