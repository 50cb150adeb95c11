"""Markdown tables for the README from the committed results (bench/results/*.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def passkey_table(path: Path) -> str:
    r = json.loads(path.read_text())
    lines = [f"Passkey, {r['model']}, budget {r['budget']}, {r['device']} "
             f"({len(r['seeds'])} seeds per cell; `{path.relative_to(RESULTS.parent.parent)}`)", "",
             "| method | " + " | ".join(f"{n} tok, depth {int(d * 100)}%" for n in r["lengths"] for d in r["depths"])
             + " | all | KV read by decode |",
             "|---" * (len(r["lengths"]) * len(r["depths"]) + 3) + "|"]
    for method, m in r["methods"].items():
        cells = []
        for n in r["lengths"]:
            for d in r["depths"]:
                rows = [x for x in m["rows"] if x["length"] == n and x["depth"] == d]
                cells.append(f"{sum(x['correct'] for x in rows)}/{len(rows)}")
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {m['accuracy']:.0%} | {m['kv_fraction_read']:.1%} |")
    return "\n".join(lines)


def recall_table(path: Path) -> str:
    r = json.loads(path.read_text())
    lines = [f"Attention fidelity on captured Q/K/V, {r['model']}, {r['tokens']} tokens, budget {r['budget']}, "
             f"mean over sparse layers (`{path.relative_to(RESULTS.parent.parent)}`)", "",
             "| variant | attention-mass recall | worst head | top-k recall | output rel. error | KV read |",
             "|---|---|---|---|---|---|"]
    for name, v in r["variants"].items():
        lines.append(f"| {name} | {v['mass_recall']:.3f} | {v['mass_recall_min']:.3f} | {v['topk_recall']:.3f} | "
                     f"{v['out_rel_err']:.3f} | {v['kv_read']:.3f} |")
    return "\n".join(lines)


def kernels_table(path: Path) -> str:
    r = json.loads(path.read_text())
    budgets = [b for b in (1024, 2048) if any(f"sparse_{b}_ms" in row for row in r["decode"])]
    lines = [f"Decode attention per layer, {r['device']}, Llama-3.1-8B shape, bf16 "
             f"(`{path.relative_to(RESULTS.parent.parent)}`; ms, medians)", "",
             "| context | batch | FlashInfer dense | Triton dense (SGLang) | " +
             " | ".join(f"sparse {b}" for b in budgets) + " | speed-up 1024 vs FlashInfer |",
             "|---" * (5 + len(budgets)) + "|"]
    for row in r["decode"]:
        if "skipped" in row:
            lines.append(f"| {row['ctx']} | {row['bs']} | skipped: {row['skipped']} |" + " |" * (2 + len(budgets)))
            continue
        fi = row.get("dense_flashinfer_ms")
        tr = row.get("dense_triton_ms")
        lines.append(f"| {row['ctx']} | {row['bs']} | {fi:.3f} | " + (f"{tr:.3f}" if tr else "n/a") + " | " +
                     " | ".join(f"{row[f'sparse_{b}_ms']:.3f}" for b in budgets) +
                     f" | {fi / row['sparse_1024_ms']:.1f}x |")
    lines += ["", "Per sparse layer of the pooled path (bs 1 / 8, ms): selection (select + emit) and the whole layer "
                  "(selection + attention), launched one by one and replayed from a CUDA graph; index build vs prefill.",
              "", "| context | fine clusters | selection | selection, graph | layer, graph | "
                  "index build per layer | prefill per layer | build share |", "|---|---|---|---|---|---|---|---|"]
    sel = {(s["ctx"], s["bs"]): s for s in r["selection"]}
    for b in r["index_build"]:
        one, eight = sel[(b["ctx"], 1)], sel[(b["ctx"], 8)]

        def pair(key):
            return f"{one[key]:.3f} / {eight[key]:.3f}" if key in one else "n/a"

        lines.append(f"| {b['ctx']} | {one['fine_clusters']} | {pair('fused_ms')} | {pair('fused_graph_ms')} | "
                     f"{pair('sparse_layer_graph_ms')} | {b['build_ms_per_layer']:.2f} | "
                     f"{b['prefill_ms_per_layer']:.2f} | {b['build_share_of_prefill']:.0%} |")
    return "\n".join(lines)


def serving_table(path: Path) -> str:
    r = json.loads(path.read_text())
    d, s = r["dense"], r["lychee"]
    lines = [f"Serving, {r['device']}, {r['model']}, FlashInfer backend, CUDA graphs on, lychee budget "
             f"{r['settings']['budget']} (`{path.relative_to(RESULTS.parent.parent)}`)", "",
             "| context | dense TPOT (ms) | lychee TPOT (ms) | lychee / dense |", "|---|---|---|---|"]
    for ctx, v in d["tpot_bs1"].items():
        lines.append(f"| {ctx} | {v['tpot_ms']:.2f} | {s['tpot_bs1'][ctx]['tpot_ms']:.2f} | "
                     f"{s['tpot_bs1'][ctx]['tpot_ms'] / v['tpot_ms']:.2f} |")
    if "serving_32k" in d:
        lines += ["", "| bench_serving 32K in, 16 prompts, concurrency 8 | completed | output tok/s | median TPOT (ms) "
                      "| mean TTFT (s) |", "|---|---|---|---|---|"]
        for name, x in (("dense", d["serving_32k"]), ("lychee", s["serving_32k"])):
            lines.append(f"| {name} | {x['completed']} | {x['output_throughput']:.1f} | {x['median_tpot_ms']:.1f} | "
                         f"{x['mean_ttft_ms'] / 1000:.1f} |")
    lines += ["", f"Greedy tokens equal dense within the budget: {r['greedy_equal_within_budget']}; past the budget "
                  f"(4K prompt): {r['greedy_past_budget_same_tokens']} tokens the same."]
    return "\n".join(lines)


def load_table(path: Path) -> str:
    """Serving under load, lychee only: completion, errors and dense fallbacks per workload (gpu_serving_load_*)."""
    r = json.loads(path.read_text())
    backend = r["server_args"][r["server_args"].index("--attention-backend") + 1]
    lines = [f"Serving under load, {r['device']}, {r['model']}, {r['method']}, {backend} backend, CUDA graphs on "
             f"(`{path.relative_to(RESULTS.parent.parent)}`)", "",
             "| workload | commit | completed | errors | index_pool_full | dense_fallback_steps | output tok/s "
             "| median TPOT (ms) | mean TTFT (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, x in r.items():
        if not isinstance(x, dict) or "status" in x or "completed" not in x or "num_prompts" not in x:
            continue
        pl = x["plugin"]
        lines.append(f"| {name} | {x['commit']} | {x['completed']}/{x['num_prompts']} | {x['errors']} | "
                     f"{pl['index_pool_full']} | {pl['dense_fallback_steps']} | {x['output_throughput']:.1f} | "
                     f"{x['median_tpot_ms']:.1f} | {x['mean_ttft_ms'] / 1000:.1f} |")
    for name, x in r.items():
        if isinstance(x, dict) and "status" in x:
            lines.append(f"\n{name}: {x['status']}.")
    return "\n".join(lines)


def stress_table(path: Path) -> str:
    r = json.loads(path.read_text())
    lines = [f"Stress run, {r['device']}, commit {r['commit']}: {sum(c['sent'] for c in r['counts'].values())} "
             f"requests over {r['load_s']:.0f} s, passed: {r['passed']} (`{path.relative_to(RESULTS.parent.parent)}`)",
             "", "| requests | sent | behaved |", "|---|---|---|"]
    lines += [f"| {kind} | {c['sent']} | {c['ok']} |" for kind, c in r["counts"].items()]
    lines += ["", "| check | held |", "|---|---|"] + [f"| {k} | {v} |" for k, v in r["checks"].items()]
    return "\n".join(lines)


def fidelity_table(path: Path) -> str:
    r = json.loads(path.read_text())
    tasks = r["tasks"]
    lines = [f"Fidelity suite, {r['model']}, {r['device']}, lengths {r['lengths']}, {r['samples']} samples per task "
             f"and length (`{path.relative_to(RESULTS.parent.parent)}`)", "",
             "| method | budget | " + " | ".join(tasks) + " | KV read |", "|---" * (len(tasks) + 3) + "|"]
    for run in r["runs"]:
        cells = [sum(v for k, v in run["scores"].items() if k.split("@")[0] == t) / len(r["lengths"]) for t in tasks]
        lines.append(f"| {run['method']} | {run['budget'] or 'dense'} | " + " | ".join(f"{c:.2f}" for c in cells)
                     + f" | {run['kv_read']:.1%} |")
    return "\n".join(lines)


def main():
    out = []
    for name, fn in (("passkey_smollm2.json", passkey_table), ("fidelity_smollm2.json", fidelity_table),
                     ("fidelity_qwen2.5-coder-0.5b_8k.json", fidelity_table),
                     ("fidelity_qwen2.5-coder-0.5b_3k.json", fidelity_table),
                     ("fidelity_qwen2.5-coder-0.5b_3k_8samples.json", fidelity_table),
                     ("attention_recall_smollm2.json", recall_table), ("gpu_serving_h200.json", serving_table),
                     ("kernels_h200.json", kernels_table), ("gpu_serving_load_h100.json", load_table),
                     ("stress_h100.json", stress_table)):
        p = RESULTS / name
        if p.exists():
            out.append(fn(p))
    print("\n\n".join(out))


if __name__ == "__main__":
    sys.exit(main())
