"""Fidelity suite: RULER-style and structured-data tasks through the real SGLang server, per method and budget.

    python -m bench.fidelity --quick                      # a few samples, one budget (CI)
    python -m bench.fidelity --model smollm2 --out bench/results/fidelity_smollm2.json --plot bench/results/fidelity_smollm2.png

Methods: off (dense), lychee, quest, lychee-fixed (16-token chunks: the structure-aware ablation).
Each (method, budget) gets its own server; every sample is scored by exact match of its expected strings.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from bench.server import Server
from bench.tasks import RULER, STRUCTURED, TASKS, make

METHODS = {"off": ("off", {}), "lychee": ("lychee", {}), "quest": ("quest", {}),
           "lychee-fixed": ("lychee", {"chunking": "fixed"})}
CONTEXT = {"smollm2": 8192, "qwen2.5-coder-0.5b": 32768}


def run(model: str, model_dir: str, methods, budgets, tasks, lengths, samples, max_tokens=24, save=None) -> dict:
    """Score every (method, budget); ``save(res)`` is called after each, so a long run keeps what it finished."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    data = {t: {n: [make(t, tok, n, s) for s in range(samples)] for n in lengths} for t in tasks}
    res = {"model": model, "device": f"CPU ({platform.machine()})", "lengths": lengths, "samples": samples,
           "budgets": budgets, "tasks": list(tasks), "runs": []}
    for name in methods:
        method, extra = METHODS[name]
        for budget in ([None] if method == "off" else budgets):
            cfg = None if method == "off" else {"token_budget": budget, **extra}
            t0 = time.time()
            with Server(model_dir, method, cfg, extra=["--max-total-tokens", "65536",
                                                       "--context-length", str(CONTEXT.get(model, 8192))]) as srv:
                scores = {}
                for t in tasks:
                    for n in lengths:
                        done = [s.score(srv.complete(s.prompt, max_tokens)["choices"][0]["text"]) for s in data[t][n]]
                        scores[f"{t}@{n}"] = sum(done) / len(done)
                stats = srv.stats()
            kv = stats["attended_tokens"] / stats["context_tokens"] if stats.get("context_tokens") else 1.0
            run_ = {"method": name, "budget": budget, "scores": scores, "kv_read": round(kv, 4),
                    "seconds": round(time.time() - t0, 1)}
            for group, names in (("ruler", RULER), ("structured", STRUCTURED), ("passkey", ("passkey",))):
                vals = [v for k, v in scores.items() if k.split("@")[0] in names]
                if vals:
                    run_[group] = sum(vals) / len(vals)
            res["runs"].append(run_)
            print(json.dumps({k: v for k, v in run_.items() if k != "scores"}), flush=True)
            if save:
                save(res)
    return res


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = res["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(3 * len(tasks), 3), sharey=True)
    for ax, t in zip(axes, tasks):
        dense = [r for r in res["runs"] if r["method"] == "off"]
        for name in sorted({r["method"] for r in res["runs"]} - {"off"}):
            runs = sorted((r for r in res["runs"] if r["method"] == name), key=lambda r: r["budget"])
            ys = [sum(v for k, v in r["scores"].items() if k.startswith(t + "@")) / len(res["lengths"]) for r in runs]
            ax.plot([r["budget"] for r in runs], ys, marker="o", label=name)
        if dense:
            y = sum(v for k, v in dense[0]["scores"].items() if k.startswith(t + "@")) / len(res["lengths"])
            ax.axhline(y, color="k", linestyle="--", label="dense")
        ax.set_title(t, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget")
    axes[0].set_ylabel("accuracy")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"{res['model']}: accuracy vs token budget ({res['samples']} samples x lengths {res['lengths']})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[2000, 6000])
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 samples, budget 256, 2K tokens, 3 tasks")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args()
    if a.quick:
        a.budgets, a.lengths, a.samples = [256], [2000], 2
        a.tasks = ["passkey", "niah_multikey", "json_value"]
    from sgl_sparsekv.models import prepare

    model_dir = a.model_dir or f"models/{a.model}"
    prepare(a.model, model_dir)

    def save(res):
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)

    res = run(a.model, model_dir, a.methods, a.budgets, a.tasks, a.lengths, a.samples, save=save)
    if a.plot:
        plot(res, a.plot)


if __name__ == "__main__":
    main()
