"""The runs behind docs/RESULTS.md's generated parts: the latest serving and GPU fidelity runs (``LATEST``), each as
a table, and one index of every committed result (``bench/results``) with its card and commit, where each older run's
reading lives in the prose around it."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def md_table(caption: str, header: list[str], rows) -> str:
    """A caption line and a markdown table of ``rows`` (sequences of cells)."""
    return "\n".join([caption, "", "| " + " | ".join(header) + " |", "|---" * len(header) + "|",
                      *("| " + " | ".join(map(str, row)) + " |" for row in rows)])


WORKLOADS = (("shared", "shared prefix: 2 groups x 16 requests over a 32K prefix, 512 out, concurrency 16"),
             ("random", "random ids: 32K in, 256 out, 16 prompts, concurrency 8"),
             ("random64", "random ids: 32K in, 256 out, 64 prompts, concurrency 16"),
             ("shared64_c16", "shared prefix: 2 groups x 32 requests over a 32K prefix, 512 out, concurrency 16"),
             ("shared64_c32", "shared prefix: 2 groups x 32 requests over a 32K prefix, 512 out, concurrency 32"))


def serving_table(path: Path) -> str:
    """Dense vs lychee through the real server, from one run on one card (bench/gpu_serving.py)."""
    r = json.loads(path.read_text())
    d, s = r["dense"], r["lychee"]
    lines = [f"Serving, {r['device']}, {r['model']}, {r['settings']['backend']} backend for both (lychee wraps it), "
             f"CUDA graphs on, budget {r['settings']['budget']}, commit {r.get('commit', '?')}: {r.get('note', '')} "
             f"(`{path.relative_to(ROOT)}`)", ""]
    if d.get("tpot_bs1"):
        short = d["tpot_bs1"].get("4096", {}).get("tpot_ms")   # the target: long-context lychee vs dense at 4K
        lines += ["| batch 1, cached prompt | dense TPOT (ms) | lychee TPOT (ms) | lychee / dense | "
                  "lychee / dense at 4K |", "|---|---|---|---|---|"]
        for ctx, v in d["tpot_bs1"].items():
            x = s["tpot_bs1"][ctx]["tpot_ms"]
            vs4k = f"{x / short:.2f}" if short else "n/a"
            lines.append(f"| {ctx} tokens | {v['tpot_ms']:.2f} | {x:.2f} | {x / v['tpot_ms']:.2f} | {vs4k} |")
        lines.append("")
    if any(key in s for key, _ in WORKLOADS):
        lines += ["| workload | output tok/s dense / lychee | throughput ratio | median ITL ms dense / lychee | "
                  "mean TTFT s dense / lychee | lychee host ms per decode step | lychee dense-fallback steps | "
                  "errors |", "|---|---|---|---|---|---|---|---|"]
    for key, label in WORKLOADS:
        if key not in s:
            continue
        if key == "random":   # its prompts, concurrency and output length are the run's settings
            c = r["settings"]
            label = (f"random ids: 32K in, {c['output_len']} out, {c['prompts']} prompts, "
                     f"concurrency {c['concurrency']}")
        y = s[key]
        x = d.get(key, {})   # a dense run cut by the call's time limit reads n/a

        def pair(k, f=1, fmt=".0f"):
            return " / ".join("n/a" if r.get(k) is None else format(r[k] / f, fmt) for r in (x, y))

        ratio = f"{y['output_throughput'] / x['output_throughput']:.2f}x" if x else "n/a"
        lines.append(f"| {label} | {pair('output_throughput')} | {ratio} | {pair('median_itl_ms', fmt='.1f')} | "
                     f"{pair('mean_ttft_ms', 1000, '.2f')} | {y.get('host_ms_per_decode_step', 'n/a')} | "
                     f"{y.get('plugin', {}).get('dense_fallback_steps', 'n/a')} | {pair('errors')} |")
    for key, _ in WORKLOADS:
        steady = [r.get(m, {}).get(key, {}).get("steady_decode") for m in ("dense", "lychee")]
        if all(steady):
            lines += ["", f"Steady decode in {key} at batch {steady[0]['batch']} (median of the servers' decode log "
                          f"lines at that batch): {steady[0]['median_tok_s']:.0f} / {steady[1]['median_tok_s']:.0f} "
                          f"tok/s dense / lychee, {steady[1]['median_tok_s'] / steady[0]['median_tok_s']:.2f}x."]
    if "greedy_equal_within_budget" in r:
        lines += ["", f"Greedy tokens equal dense within the budget: {r['greedy_equal_within_budget']}; past the "
                      f"budget (4K prompt): {r['greedy_past_budget_same_tokens']} tokens the same."]
    return "\n".join(lines)


def methods_serving_table(path: Path) -> str:
    """Dense, lychee and lychee variants from one card: each method's batch-1 TPOT (and over dense at 4K, the #10
    target's yardstick), then each workload a method ran against dense's (bench/gpu_serving.py)."""
    r = json.loads(path.read_text())
    methods = r["settings"]["methods"]
    tpot = {m: {c: v["tpot_ms"] for c, v in r[m].get("tpot_bs1", {}).items()} for m in methods}
    where = (f"Serving, {r['device']}, {r['model']}, {r['settings']['backend']} backend for both (lychee wraps it), "
             f"CUDA graphs on, budget {r['settings']['budget']}, commit {r['commit']}: {r['note']} "
             f"(`{path.relative_to(ROOT)}`)")
    out = []
    if tpot["dense"]:
        short = tpot["dense"]["4096"]
        rows = [(f"{ctx} tokens", *(f"{tpot[m][ctx]:.2f} ({tpot[m][ctx] / short:.2f}x)" for m in methods))
                for ctx in tpot["dense"]]
        out.append(md_table(where, ["batch 1, cached prompt", *(f"{m} TPOT ms (over dense at 4K)" for m in methods)],
                            rows))
    else:
        out.append(where)
    d = r["dense"]
    for key, label in WORKLOADS:
        if key not in d:
            continue
        rows = []
        for m in (m for m in methods if m != "dense" and key in r[m]):
            w, p = r[m][key], r[m][key]["plugin"]
            steady = (w.get("steady_decode") or {}).get("median_tok_s"), (d[key].get("steady_decode") or {}).get(
                "median_tok_s")
            rows.append((m, f"{d[key]['output_throughput']:.0f} / {w['output_throughput']:.0f}",
                         f"{w['output_throughput'] / d[key]['output_throughput']:.2f}x",
                         f"{steady[0] / steady[1]:.2f}x" if all(steady) else "n/a",
                         f"{d[key]['median_itl_ms']:.1f} / {w['median_itl_ms']:.1f}", w["host_ms_per_decode_step"],
                         p["decode_host_syncs"], p["dense_fallback_steps"], p.get("unselected_steps", "n/a"),
                         f"{d[key]['errors']} / {w['errors']}"))
        out.append(md_table(f"{label}:", ["method", "output tok/s dense / method", "throughput ratio",
                                          "steady decode ratio", "median ITL ms dense / method",
                                          "host ms per decode step", "host syncs", "dense-fallback steps",
                                          "unselected steps", "errors"], rows))
    return "\n\n".join(out)


def fidelity_runs_table(path: Path) -> str:
    """Runs of one length, each with its own card, commit and sample count: correct/n per task, the total with its
    95% Wilson interval."""
    from bench.fidelity import FIRM, total_with_interval

    r = json.loads(path.read_text())
    firm = (f", and how many of the lost answers dense held firmly (by at least {FIRM} logits at every token of its "
            "answer)" if any("held_by" in c for run in r["runs"] for c in run["counts"].values()) else "")
    tasks = list(dict.fromkeys(t for run in r["runs"] for t in run["tasks"]))
    n = r["lengths"][0]
    rows = []
    for run in r["runs"]:
        c = run["counts"]
        cells = [f"{c[k]['correct']}/{c[k]['n']}" if (k := f"{t}@{n}") in c else "-" for t in tasks]
        rows.append((run["method"], run["budget"] or "dense", run["device"].replace("NVIDIA ", ""), run["commit"],
                     "on" if run["cuda_graph"] else "off", *cells, total_with_interval(c),
                     f"{run['kv_read']:.1%}" + (f" (keys of {run['keys_scored']:.1%} scored)" if "keys_scored" in run else ""),
                     against_dense(run, r["runs"])))
    return md_table(f"Fidelity on the GPU, {r['model']}, real weights, {n} tokens; against dense: the answers lost / "
                    f"gained sample by sample against the latest dense run over the same seeds, with the exact sign "
                    f"test's p{firm} (`{path.relative_to(ROOT)}`)",
                    ["method", "budget", "card", "commit", "graphs", *tasks, "total (95% CI)", "KV read",
                     "against dense"], rows)


def against_dense(run: dict, runs: list) -> str:
    """``lost / gained (p)`` against the latest dense run whose cells hold the same samples, with ``, K firm`` where
    that dense run recorded how firmly it answered, or "-"."""
    from bench.fidelity import lost_firm, paired, sign_test

    if run["method"] == "off":
        return "-"
    same = [d for d in runs if d["method"] == "off" and d["counts"].keys() == run["counts"].keys()
            and all(d["counts"][k]["n"] == v["n"] for k, v in run["counts"].items())]
    if not same:
        return "-"
    lost, gained = paired(same[-1]["counts"], run["counts"])
    firm = lost_firm(same[-1]["counts"], run["counts"])
    return f"{lost} / {gained} (p {sign_test(lost, gained):.2f})" + (f", {firm} firm" if firm is not None else "")


LATEST = (("gpu_serving_h100_full.json", "serving"), ("gpu_serving_h200_fine_tiles_shared.json", "serving"),
          ("gpu_serving_h200_random_latekeys.json", "serving"), ("gpu_serving_h200_random_c1.json", "serving"),
          ("gpu_serving_h200_tpot64k.json", "serving"), ("gpu_serving_h200_ahead.json", "methods"),
          ("gpu_serving_h200_chain_tpot.json", "methods"), ("gpu_serving_h200_chain_shared.json", "methods"),
          ("fidelity_qwen2.5-coder-0.5b_16k_gpu.json", "fidelity"), ("fidelity_qwen2.5-coder-0.5b_30k_gpu.json", "fidelity"),
          ("fidelity_qwen2.5-coder-0.5b_16384_gpu.json", "fidelity"), ("fidelity_qwen2.5-coder-0.5b_8k_gpu.json", "fidelity"))


def latest_tables() -> str:
    """The latest serving and GPU fidelity runs, each as a table, in ``LATEST``'s order."""
    table = {"serving": serving_table, "methods": methods_serving_table, "fidelity": fidelity_runs_table}
    return "\n\n".join(table[kind](RESULTS / name) for name, kind in LATEST)


# what a result file measures, by its name's first words (the index's "measures" column)
KINDS = (("gpu_serving", "serving through the real server (bench.gpu_serving)"),
         ("fidelity", "answers on the fidelity tasks (bench.fidelity)"),
         ("gpu_tests", "pytest -m gpu on the device"), ("stress", "the stress run (bench.stress)"),
         ("kernels", "the kernels alone (bench.bench_kernels)"), ("host_copy", "host-memory copies (bench.bench_host_copy)"),
         ("attention_recall", "attention mass kept on captured Q/K/V (retired experiment)"),
         ("answer_margin", "dense's answer margins where a method loses (retired experiment)"),
         ("selection_breakdown", "selection kernels, timed one by one (retired experiment)"),
         ("serving_profile", "a served step, profiled (experiments/serving_profile.py)"),
         ("host_prepare", "the host's step preparation alone (retired experiment)"),
         ("host_lifecycle", "the host's decode lifecycle (retired experiment)"),
         ("head_roles", "hybrid heads' role maps (retired experiment)"), ("hardkuma", "learned head roles (retired experiment)"),
         ("retrieval_heads", "exact top-k retrieval heads (retired experiment)"),
         ("selection_reuse", "selection reuse across steps (experiments/selection_reuse.py)"),
         ("record_recall", "record key/value recall (experiments/record_recall.py)"),
         ("tier_hit_rate", "the host tier's hit rate in steady decode (experiments/tier_hit_rate.py)"),
         ("", "a one-off probe (retired experiment)"))


def result_meta(r) -> tuple[str, str]:
    """(card, commits) of a result file, "-" where it does not record them."""
    runs = [x for x in (r.get("runs") or []) if isinstance(x, dict)] if isinstance(r, dict) else []
    devices = {r.get("device")} | {x.get("device") for x in runs} if isinstance(r, dict) else set()
    commits = {r.get("commit")} | {x.get("commit") for x in runs} if isinstance(r, dict) else set()
    devices, commits = devices - {None}, {str(c) for c in commits - {None}}
    short = sorted(d.replace("NVIDIA ", "") for d in devices)
    return ", ".join(short) or "-", ", ".join(sorted(commits)[:4]) + (" ..." if len(commits) > 4 else "") or "-"


def index_table() -> str:
    """One row per committed result: file, what it measures, card, commits."""
    rows = []
    for path in sorted(RESULTS.glob("*.json")):
        card, commits = result_meta(json.loads(path.read_text()))
        kind = next(what for prefix, what in KINDS if path.name.startswith(prefix))
        rows.append((f"`{path.name}`", kind, card, commits))
    return md_table("Every committed result (`bench/results/*.json`; plots and logs beside them); what each taught is in "
                    "the section that names it", ["file", "measures", "card", "commits"], rows)
