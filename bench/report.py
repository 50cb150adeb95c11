"""Markdown tables for the README from the committed results (bench/results/*.json)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.gpu_serving import RATIO_KEYS, SHARED, SHARED_OUTPUT

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


def md_table(caption: str, header: list[str], rows) -> str:
    """A caption line and a markdown table of ``rows`` (sequences of cells)."""
    return "\n".join([caption, "", "| " + " | ".join(header) + " |", "|---" * len(header) + "|",
                      *("| " + " | ".join(map(str, row)) + " |" for row in rows)])


def budgets_named(b) -> str:
    """An attention_recall result's budget: one, or several (its variants then named VARIANT@BUDGET)."""
    return f"budget {b}" if isinstance(b, int) else "budgets " + ", ".join(map(str, b)) + " (VARIANT@BUDGET)"


def recall_table(path: Path) -> str:
    r = json.loads(path.read_text())
    if "tokens" in r:
        what = f"{r['tokens']} tokens"
    else:   # a task's samples, queried where their answers are produced
        sm = r["samples"]
        what = (f"{r['task']} answers ({len(sm)} samples of {min(x['tokens'] for x in sm)}-"
                f"{max(x['tokens'] for x in sm)} tokens, {sum(x['queries'] for x in sm)} queries), {r.get('device', 'CPU')}")
    budget = budgets_named(r["budget"])
    return md_table(f"Attention fidelity on captured Q/K/V, {r['model']}, {what}, {budget}, "
                    f"mean over sparse layers (`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["variant", "attention-mass recall", "worst head", "top-k recall", "output rel. error", "KV read"],
                    [(name, f"{v['mass_recall']:.3f}", f"{v['mass_recall_min']:.3f}", f"{v['topk_recall']:.3f}",
                      f"{v['out_rel_err']:.3f}", f"{v['kv_read']:.3f}") for name, v in r["variants"].items()])


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
             f"(`{path.relative_to(RESULTS.parent.parent)}`)", ""]
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


def variants_serving_table(path: Path) -> str:
    """Lychee variants through the real server from one card, dense among them or not (bench/gpu_serving.py)."""
    r = json.loads(path.read_text())
    rows = []
    for name in r["settings"]["methods"]:
        for key, label in WORKLOADS:
            if key in r[name]:
                w, p = r[name][key], r[name][key]["plugin"]   # dense, where the run has it, has no plugin counters
                rows.append((name, label, f"{w['output_throughput']:.0f}", f"{w['median_itl_ms']:.1f}",
                             f"{w['mean_ttft_ms'] / 1000:.2f}", w.get("host_ms_per_decode_step", "-"),
                             p.get("index_pool_full", "-"), p.get("dense_fallback_steps", "-"), w["errors"]))
    return md_table(f"Lychee variants in serving, {r['device']}, {r['model']}, {r['settings']['backend']}, CUDA graphs "
                    f"on, budget {r['settings']['budget']}, commit {r['commit']}: {r['note']} "
                    f"(`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["method", "workload", "output tok/s", "median ITL ms", "mean TTFT s", "host ms per decode step",
                     "failed placements", "dense-fallback steps", "errors"], rows)


PARALLEL_RUNS = ("gpu_serving_h100x2_tp1.json", "gpu_serving_h100x2_tp2.json", "gpu_serving_h100x2_tp2_random.json",
                 "gpu_serving_h100x2_dp2.json")


def parallel_table(paths: list[Path]) -> str:
    """Lychee over dense per workload at TP 1, TP 2 and DP 2 on two-GPU hosts, one row per (run, workload); each
    ratio comes from its own run's dense and lychee."""
    lines = ["Several GPUs, Llama-3.1-8B shape, dummy weights, FlashInfer, CUDA graphs on, budget 1024; each row's dense "
             "and lychee ran on the same machine (" + ", ".join(f"`{p.name}`" for p in paths) + ")", "",
             "| layout | card | commit | workload | output tok/s dense / lychee | throughput ratio | "
             "median ITL ms dense / lychee | mean TTFT ratio | lychee host ms per decode step | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in paths:
        r = json.loads(p.read_text())
        st = r["settings"]
        layout = f"TP {st['tp_size']}, DP {st['dp_size']}"
        for key, label in WORKLOADS:
            if key not in r["lychee"] or key not in r["dense"]:
                continue
            d, s, q = r["dense"][key], r["lychee"][key], r[RATIO_KEYS[key]]
            lines.append(f"| {layout} | {r['gpus']} x {r['device']} | {r.get('commit', '?')} | {label.split(':')[0]} | "
                         f"{d['output_throughput']:.0f} / {s['output_throughput']:.0f} | {q['throughput_ratio']:.2f}x | "
                         f"{d['median_itl_ms']:.1f} / {s['median_itl_ms']:.1f} | {q['mean_ttft_ratio']:.2f} | "
                         f"{q['lychee_host_ms_per_decode_step']} | {d['errors']} / {s['errors']} |")
    return "\n".join(lines)


def breakdown_table(path: Path) -> str:
    r = json.loads(path.read_text())
    lines = [f"A sparse layer's GPU time by kernel, {r['device']}: {r['what']} (`{path.relative_to(RESULTS.parent.parent)}`)",
             "", "| context | batch | version | coarse | fine bounds | cut | emit | attention | total |",
             "|---|---|---|---|---|---|---|---|---|"]
    for version in ("before", "after"):
        for row in r[version]["rows"]:
            parts = ([row["bounds_ms"], None] if "bounds_ms" in row else [row["coarse_ms"], row["fine_bounds_ms"]])
            parts += [row["cut_ms"], row["emit_ms"], row["attend_ms"]]
            cells = " | ".join("(in bounds)" if p is None else f"{p:.3f}" for p in parts)
            lines.append(f"| {row['ctx']} | {row['bs']} | {version} | {cells} | {sum(p or 0 for p in parts):.3f} |")
    lines += ["", "before: " + r["before"]["commit"] + "; after: " + r["after"]["commit"] + "."]
    return "\n".join(lines)


def role_rows(r: dict) -> list:
    """(roles, retrieval heads, mass recall, output error) per variant of a head-roles result."""
    return [(name, "all" if name == "all-retrieval" else f"{r['roles'][name]['retrieval_heads']} of "
             f"{r['roles'][name]['of']}", f"{r['mean_mass_recall'][name]:.4f}", f"{r['mean_out_rel_err'][name]:.4f}")
            for name in r["mean_mass_recall"]]


def roles_table(path: Path) -> str:
    r = json.loads(path.read_text())
    tasks = ", ".join(e["task"] for e in r["evaluation"])
    cal = r["calibration"]
    rows = role_rows(r)
    return md_table(f"Hybrid heads at the attention level (issue #12), {r['model']}, budget {r['budget']}, about "
                    f"{r['length']} tokens, retrieval heads selecting "
                    f"{'the exact top-k over all keys' if r.get('retrieval') == 'exact-topk' else 'by lychee clusters'}: "
                    f"sparse heads attend to their parent's set; roles calibrated on "
                    f"{cal['task']} ({cal['queries']} queries), evaluated on {tasks} ({r['queries']} queries each), "
                    f"means (`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["roles", "retrieval heads", "attention-mass recall", "output rel. error"], rows)


def hardkuma_table(path: Path) -> str:
    """Learned (HardKuma) head roles against all-retrieval and a calibrated map (bench/hardkuma_roles.py)."""
    r = json.loads(path.read_text())
    t = r["training"]
    last = t["log"][-1]
    rows = role_rows(r)
    cal = ", ".join(f"{c['task']} seed {c['seed']}" for c in t["calibration"])
    return md_table(f"Learned head roles (HardKuma, issue #12), {r['model']}, budget {r['budget']}, {r['length']} tokens: "
                    f"gates trained {t['steps']} steps on {t['device']} under E[L0] "
                    f"{'=' if t.get('constraint') == 'equal' else '<='} target"
                    f"{' (augmented Lagrangian, rho %g)' % t['rho'] if t.get('rho') else ''} ({cal}; "
                    f"{t['calibration'][0]['decode_positions']} "
                    f"decode positions each; final distillation loss {last['distill']}, E[L0] {last['expected_l0']} "
                    f"for a target of {r['target_heads']}), evaluated on held-out prompts like the calibrated maps "
                    f"(`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["roles", "retrieval heads", "attention-mass recall", "output rel. error"], rows)


def shared_prefix_ceiling(r: dict) -> tuple[float, float]:
    """(step ms, throughput ratio): the most a sparse method can gain over dense on the shared-prefix workload if every
    decode step at batch 16 took only the batch-1 step at 32K (the fastest sparse method's, from the same run). Dense
    spends about waves x output length x its median ITL decoding; the rest of its wall time (prefills, queueing) stays."""
    _, prompts, conc = SHARED
    d = r["dense"]["shared"]
    wall = prompts * SHARED_OUTPUT / d["output_throughput"]
    decode = prompts / conc * SHARED_OUTPUT * d["median_itl_ms"] / 1000
    step = min(r[m]["tpot_bs1"]["32768"]["tpot_ms"] for m in r["settings"]["methods"] if m != "dense")
    return step, wall / (wall - decode + prompts / conc * SHARED_OUTPUT * step / 1000)


def retrieval_heads_table(path: Path) -> str:
    """Lychee's cluster retrieval against exact top-k retrieval heads, all heads and role maps (head_roles
    --compare-retrieval)."""
    r = json.loads(path.read_text())
    mm, err, kv = r["mean_mass_recall"], r["mean_out_rel_err"], r["mean_kv_read"]
    rows = [(roles, *(f"{d[f'{sel}/{roles}']:.4f}" for sel in ("lychee", "exact-topk") for d in (mm, err)))
            for roles in ("all-retrieval", *r["maps"])]
    return md_table(f"Retrieval heads that select by lychee's clusters or by exact top-k over all keys (LycheeDecode's), "
                    f"with every head retrieving or under a role map, {Path(r['model']).name}, {r['length']}-token "
                    f"held-out prompts, budget {r['budget']} ({kv['lychee/all-retrieval']:.1%} of the KV read), "
                    f"{r['queries']} decode queries each, CPU (`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["roles", "lychee: mass recall", "lychee: output rel. error", "exact top-k: mass recall",
                     "exact top-k: output rel. error"], rows)


def hybrid_serving_table(path: Path) -> str:
    """Dense and lychee variants through the real server from one card (bench/gpu_serving.py)."""
    r = json.loads(path.read_text())
    d = r["dense"]["shared"]
    rows = []
    for name in r["settings"]["methods"]:
        x = r[name]
        w = x["shared"]
        rows.append((name, f"{w['output_throughput']:.0f}", f"{w['output_throughput'] / d['output_throughput']:.2f}x",
                     f"{w['median_tpot_ms']:.2f}", f"{w['median_itl_ms']:.2f}", f"{w['mean_ttft_ms'] / 1000:.2f}",
                     w.get("host_ms_per_decode_step", "-"), f"{x['tpot_bs1']['32768']['tpot_ms']:.2f}",
                     w["errors"]))
    bound = ""
    # the ceiling counts dense's decode time by its median ITL, which a stream delivering tokens in bursts hides
    if r["dense"]["shared"]["median_itl_ms"] >= r["dense"]["shared"]["median_tpot_ms"] / 2:
        step, ceiling = shared_prefix_ceiling(r)
        bound = (f" Were every decode step of the batch as fast as one request's at 32K ({step:.2f} ms), throughput "
                 f"would reach at most {ceiling:.2f}x dense here: dense's prefills and queueing stay")
    return md_table(f"Lychee variants in serving, {r['device']}, {r['model']}, {r['settings']['backend']}, CUDA "
                    f"graphs on, budget {r['settings']['budget']}, commit {r['commit']}: {r['note']}; shared prefix = 32 "
                    f"requests over two 32K prefixes at concurrency 16, {SHARED_OUTPUT} tokens out each.{bound} "
                    f"(`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["method", "output tok/s", "vs dense", "median TPOT ms", "median ITL ms", "mean TTFT s",
                     "host ms per decode step", "batch-1 TPOT at 32K ms", "errors"], rows)


def methods_serving_table(path: Path) -> str:
    """Dense, lychee and lychee variants from one card: each method's batch-1 TPOT (and over dense at 4K, the #10
    target's yardstick), then each workload a method ran against dense's (bench/gpu_serving.py)."""
    r = json.loads(path.read_text())
    methods = r["settings"]["methods"]
    tpot = {m: {c: v["tpot_ms"] for c, v in r[m].get("tpot_bs1", {}).items()} for m in methods}
    where = (f"Serving, {r['device']}, {r['model']}, {r['settings']['backend']} backend for both (lychee wraps it), "
             f"CUDA graphs on, budget {r['settings']['budget']}, commit {r['commit']}: {r['note']} "
             f"(`{path.relative_to(RESULTS.parent.parent)}`)")
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


def hybrid_breakdown_table(path: Path) -> str:
    r = json.loads(path.read_text())
    parts = ["coarse_ms", "fine_bounds_ms", "cut_ms", "emit_ms"]
    if any("rerank_ms" in x for run in r["runs"] for x in run["rows"]):
        parts.append("rerank_ms")   # the two-stage selection (config rerank_factor)
    rows = []
    for run in r["runs"]:
        for x in run["rows"]:
            rows.append((run["device"].replace("NVIDIA ", "") + (f", {run['label']}" if run.get("label") else ""),
                         x["bs"], x.get("fine_cluster_size", 2.0), x.get("coarse_expand", 16.0), x["live_fine_per_head"],
                         f"{x['retrieving_heads']} of 8" + (", shared prefix" if x.get("shared_prefix") else "")
                         + (f", rerank {x['rerank_factor']}" if x.get("rerank_factor", 1) > 1 else ""),
                         *(f"{x.get(k, 0):.4f}" for k in parts),
                         f"{sum(x.get(k, 0) for k in parts):.3f}", f"{x['attend_ms']:.3f}"))
    return md_table(f"A sparse layer's GPU time, part by part: {r['what']}; commit {r['commit']} "
                    f"(`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["card", "batch", "chunks per fine cluster", "coarse expand", "live fine clusters per head",
                     "retrieving heads", "coarse", "fine bounds", "cut", "emit", *(["rerank"] if len(parts) > 4 else []),
                     "selection + lists", "attention"], rows)


def rerank_kernels_table(path: Path) -> str:
    """The two-stage selection's score and keep kernels per batch and programs per list."""
    r = json.loads(path.read_text())
    return md_table(f"The rerank's kernels, {r['device']}, commit {r['commit']}: {r['what']}; * marks the part count "
                    f"`parts_for` picks (`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["batch", "lists", "programs per list", "score ms", "keep ms"],
                    [(x["bs"], x["lists"], f"{x['parts']}{' *' if x['parts_used'] else ''}", f"{x['score_ms']:.4f}",
                      f"{x['keep_ms']:.4f}") for x in r["rows"]])


def bounds_kernel_table(path: Path) -> str:
    """The fine-bounds kernel against an experimental variant, per launch setting, best first."""
    r = json.loads(path.read_text())["fine_bounds_fma_vs_dot"]
    rows = sorted(r["rows"], key=lambda x: x["ms"])
    return md_table(f"Fine bounds per launch setting, {r['device']}: {r['what']} (`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["kernel", "rows per tile", "programs per list", "warps", "ms"],
                    [(x["kernel"], x["BLOCK_L"], x["parts"], x["warps"], f"{x['ms']:.4f}") for x in rows[:8]])


def fine_bounds_variants_table(path: Path) -> str:
    """Fine-bounds kernel variants, each swapped into one tree in one call per card (bench/selection_breakdown.py)."""
    r = json.loads(path.read_text())
    rows = [(run["device"], v["name"], v["commit"], x["bs"], "yes" if x["shared_prefix"] else "no",
             x["live_fine_per_head"], f"{x['fine_bounds_ms']:.4f}")
            for run in r["runs"] for v in run["variants"] for x in v["rows"]]
    return md_table(f"Fine-bounds kernel variants {r['what']}; kept: {r['kept']} "
                    f"(`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["card", "variant", "commit", "batch", "shared prefix", "live clusters per head", "fine bounds ms"],
                    rows)


def grouped_bounds_table(path: Path) -> str:
    """Main's fine-bounds kernel against the tiled one of branch fine-tiles: per call (kernel state), batch and
    prefix sharing, main's time and the tiled kernel's best setting."""
    r = json.loads(path.read_text())
    rows = []
    for i, run in enumerate(r["runs"], 1):
        for x in run["rows"]:
            best = min((k for k in x if k.endswith("_ms") and k != "old_ms"), key=x.get)
            rows.append((i, x["bs"], "yes" if x["shared"] else "no", f"{x['old_ms']:.4f}", f"{x[best]:.4f}",
                         best[:-3], "yes" if x["sel_equal"] else f"no ({x['sel_diff_cols']} picks)"))
    variants = "; ".join(f"call {i}: {run['variant']}" for i, run in enumerate(r["runs"], 1))
    return md_table(f"Fine bounds, main against tiles shared by the rows reading them, {r['runs'][0]['device']}: "
                    f"{r['what']}. {variants} (`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["call", "batch", "shared prefix", "main ms", "tiled ms (best)", "best setting", "picks equal"],
                    rows)


def fine_bounds_probes_table(path: Path) -> str:
    """Fine-bounds kernel variants that were timed and not kept: per variant, context, prefix sharing and batch,
    main's time and the variant's best setting."""
    r = json.loads(path.read_text())
    rows = []
    for p in r["probes"]:
        for x in p["rows"]:
            main = x.get("main_ms", x.get("old_ms"))
            best = min((k for k in x if k.endswith("_ms") and k not in ("main_ms", "old_ms")), key=x.get)
            rows.append((p["name"], x["ctx"], "yes" if x["shared"] else "no", x["bs"], f"{main:.4f}",
                         f"{x[best]:.4f}", best[:-3], "yes" if x[best[:-3] + "_equal"] else "no"))
    variants = "; ".join(f"{p['name']} ({p['gpu']}, {p['tree']}): {p['variant']}" for p in r["probes"])
    return md_table(f"Fine-bounds variants not kept, {r['device']}: {r['what']}. {variants} "
                    f"(`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["variant", "context", "shared prefix", "batch", "main ms", "variant ms (best)", "best setting",
                     "bounds bit-equal"], rows)


def cut_probe_table(path: Path) -> str:
    """A budget-cut variant against main's: ms per layer by context and batch (and the layer's whole chain where
    measured); "-" where a variant did not run a case."""
    r = json.loads(path.read_text())
    variants = list(dict.fromkeys(x["variant"] for x in r["rows"]))
    cases = list(dict.fromkeys((x["ctx"], x["bs"], x["fine_clusters"]) for x in r["rows"]))
    fields = ["cut_ms", *(["layer_ms"] if all("layer_ms" in x for x in r["rows"]) else [])]
    ms = {(x["variant"], x["ctx"], x["bs"], f): x[f] for x in r["rows"] for f in fields}

    def cell(*k):
        return f"{ms[k]:.4f}" if k in ms else "-"

    return md_table(f"Budget-cut variant, {r['device']} ({r['gpu']}, {r['tree']}): {r['what']} "
                    f"(`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["context", "batch", "fine clusters",
                     *(f"{v} {'cut' if f == 'cut_ms' else 'chain'} ms" for f in fields for v in variants)],
                    [(c, b, n, *(cell(v, c, b, f) for f in fields for v in variants)) for c, b, n in cases])


def selection_variant_table(path: Path) -> str:
    """A selection change against main's, swapped in turn in one call: each kernel's ms per sparse layer, their sum
    (selection and token lists) and the layer's whole chain, by variant, context and batch."""
    r = json.loads(path.read_text())
    parts = ("coarse", "fine_bounds", "cut", "emit")
    return md_table(f"Selection variant, {r['device']} ({r['gpu']}, {r['tree']}): {r['what']} "
                    f"(`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["variant", "context", "batch", "fine clusters", *(f"{p} ms" for p in parts), "selection ms",
                     "attend ms", "chain ms"],
                    [(x["variant"], x["ctx"], x["bs"], x["fine_clusters"], *(f"{x[p + '_ms']:.4f}" for p in parts),
                      f"{sum(x[p + '_ms'] for p in parts):.4f}", f"{x['attend_ms']:.4f}", f"{x['layer_ms']:.4f}")
                     for x in r["rows"]])


def pdl_probe_table(path: Path) -> str:
    """One sparse layer's kernel chain in one graph, launched plainly and with programmatic dependent launch."""
    r = json.loads(path.read_text())
    phases = ("coarse", "fine_bounds", "cut", "emit", "attend")
    return md_table(f"Kernel chain, {r['device']} ({r['gpu']}, {r['tree']}): {r['what']} "
                    f"(`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["context", "batch", "fine clusters", *(f"{p} ms" for p in phases), "chain ms", "chain with PDL ms"],
                    [(x["ctx"], x["bs"], x["fine_clusters"], *(f"{x[p + '_ms']:.4f}" for p in phases),
                      f"{x['layer_ms']:.4f}", f"{x['layer_pdl_ms']:.4f}") for x in r["rows"]])


def parts_table(path: Path) -> str:
    """Programs per (request, KV head) of the fine bounds and token lists: ms per layer by context, batch and parts."""
    r = json.loads(path.read_text())
    return md_table(f"Selection programs per list, {r['device']} ({r['gpu']}, {r['tree']}): {r['what']} "
                    f"(`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["context", "batch", "parts", "fine bounds ms", "token lists ms", "chain ms"],
                    [(x["ctx"], x["bs"], x["parts"], f"{x['fine_bounds_ms']:.4f}", f"{x['emit_ms']:.4f}",
                      f"{x['layer_ms']:.4f}") for x in r["rows"]])


def lifecycle_table(path: Path) -> str:
    r = json.loads(path.read_text())
    a = r["after"]
    return md_table(f"Host time of a request's life events, {r['device']}, {a['context']}-token prompt ({a['units']} chunks), "
                    f"medians of {a['reps']} (`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["version", "adoption: prepare_extend (ms)", "adoption: index placed (ms)", "request end (ms)"],
                    [(v["commit"], v["adopt_prepare_extend_ms"], v["adopt_place_index_ms"], v["request_end_ms"])
                     for v in (r["before"], r["after"])])


OVERLAP_COLUMNS = (("selection_busy", "selection running"), ("others_busy", "the rest running"),
                   ("selection_beside_others", "both at once"), ("selection_tail", "selection after the rest"),
                   ("others_waited", "the rest waited"), ("others_waited_behind_selection", "of it behind a selection"),
                   ("others_waited_beside_selection", "of it beside a selection"))


def step_profile_table(path: Path) -> str:
    """bench/serving_profile.py: a steady decode step's GPU time by kind of kernel, per method, from one card."""
    r = json.loads(path.read_text())
    kinds = ["matmul", "dense_attention", "selection", "sparse_attention", "index_upkeep", "other", "outside_graph",
             "idle"]
    period = r["dense"]["period"] if "dense" in r else None
    methods = r["settings"]["methods"]
    # selection beside the rest, where the profile has it (older ones do not)
    overlap = [(k, h) for k, h in OVERLAP_COLUMNS if any(k in r[m] for m in methods)]
    rows = [(m, f"{r[m]['period']:.2f}", f"{r[m]['period'] / period:.2f}" if period else "-",
             *(f"{r[m].get(k, 0):.2f}" for k in kinds + [k for k, _ in overlap]), r[m]["steps"]) for m in methods]
    return md_table(f"Where a serving step's time goes, {r['device']} ({r['gpu']}), {r['model']}, "
                    f"{r['settings']['backend']}, CUDA graphs on, budget {r['settings']['budget']}, commit {r['commit']}: "
                    f"{r['what']}. Step = one replay's first kernel to the next one's; idle = the part of it no kernel "
                    f"or copy ran in (`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["method", "step ms", "vs dense", "matmul", "dense attention", "selection", "sparse attention",
                     "index upkeep", "other kernels", "outside the graph", "GPU idle",
                     *(h for _, h in overlap), "steps"], rows)


def busy_lifecycle_table(path: Path) -> str:
    r = json.loads(path.read_text())
    keys = ["adopt_prepare_extend_ms", "adopt_place_index_host_ms", "request_end_host_ms", "build_index_host_ms",
            "build_index_ms"]
    return md_table(f"Host time of a request's life events with the GPU idle and busy, {r['device']}: {r['what']}; "
                    f"commit {r['commit']} (`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["GPU before the event", "adoption: prepare_extend", "adoption: index placed (host)",
                     "request end (host)", "32K build (host)", "32K build (GPU done)"],
                    [(busy_label(run), *(run[x] for x in keys)) for run in r.values()
                     if isinstance(run, dict) and "busy_ms" in run])


def busy_label(run: dict) -> str:
    """How much GPU work ``bench.host_lifecycle`` queued before each event, and in how many kernels."""
    if not run["busy_ms"]:
        return "idle"
    kernels = run.get("busy_kernels", 1)
    return f"{run['busy_ms']:g} ms of work queued" + (f" as {kernels} kernels" if kernels > 1 else "")


def build_table(path: Path) -> str:
    r = json.loads(path.read_text())
    return md_table(f"Index build for every sparse layer of one prompt, {r['device']}, {r['shape']}, {r['kmeans_iters']} "
                    f"k-means iterations, commit {r['commit']} (`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["context", "chunks", "chunks per fine cluster", "kernels/kmeans.py (ms)", "torch twin (ms)",
                     "speed-up", "extra GPU memory MiB, kernel / twin"],
                    [(b["context"], b["chunks"], b.get("fine_cluster_size", 2.0), f"{b['kernel_ms']:.1f}",
                      f"{b['torch_twin_ms']:.1f}",
                      f"{b['speedup']:.1f}x", f"{b['kernel_extra_mib']} / {b['torch_twin_extra_mib']}")
                     for b in r["builds"]])


def host_table(path: Path) -> str:
    r = json.loads(path.read_text())
    line = (f"Host time of a decode step's preparation, {r['device']}, batch {r['batch']} at {r['context']} tokens, "
            f"commit {r['commit']}: {r['host_ms_per_step']} ms per step, {r['decode_host_syncs']} device syncs")
    if "phase_ms_per_step" in r:
        line += "; by phase (ms): " + ", ".join(f"{k.removeprefix('prepare_').removesuffix('_s')} {v}"
                                                for k, v in r["phase_ms_per_step"].items() if k != "decode_prepare_s")
    if "same_call_before" in r:
        b = r["same_call_before"]
        line += (f"; in the same call, {' and '.join(map(str, r['runs_ms_per_step']))} ms against "
                 f"{' and '.join(map(str, b['host_ms_per_step']))} at {b['commit']}")
        if "release_median_ms_runs" in r:
            line += (f"; releasing a finished request (its index cached, its rows freed), median ms per request "
                     f"{' / '.join(map(str, r['release_median_ms_runs']))} against "
                     f"{' / '.join(map(str, b['release_median_ms_runs']))} at {b['commit']}, "
                     f"{r['release_syncs']} syncs")
    if r.get("note"):
        line += f" ({r['note']})"
    return line + f" (`{path.relative_to(RESULTS.parent.parent)}`)"


def cold_host_table(path: Path) -> str:
    """bench.host_prepare's runs with warm and cold caches (--evict-mb), medians per step by phase (and, where the
    runs split them, the median step at 0 and 1 chunks cut, without a graft)."""
    r = json.loads(path.read_text())
    phases = ("prepare_frees_s", "prepare_cut_s", "prepare_place_s", "prepare_graft_s", "table_upload")
    split = all("step_ms_by_cuts" in x for x in r["runs"])
    return md_table(f"Host time of a decode step's preparation with warm and cold caches, {r['device']}, batch "
                    f"{r['batch']} at {r['context']} tokens, {r['layers']} layers, commit {r['commit']}: {r['what']} "
                    f"(`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["tree", "MB read before each step", "step p10 / median / p90 (ms)",
                     *(["median step at 0 / 1 cuts"] if split else []), "frees", "cuts", "placement",
                     "grafts (their check on most steps)", "table and upload"],
                    [(x.get("tree", r["commit"]), x["evict_mb"],
                      " / ".join(str(x["step_ms"][k]) for k in ("p10", "median", "p90")),
                      *([" / ".join(str(x["step_ms_by_cuts"][c]["median"]) for c in ("0", "1"))] if split else []),
                      *(x["phase_median_ms"][k] for k in phases)) for x in r["runs"]])


def load_table(path: Path) -> str:
    """Serving under load, lychee only: completion, errors and dense fallbacks per workload (gpu_serving_load_*)."""
    r = json.loads(path.read_text())
    backend = r["server_args"][r["server_args"].index("--attention-backend") + 1]
    lines = [f"Serving under load, {r['device']}, {r['model']}, {r['method']}, CUDA graphs on "
             f"(`{path.relative_to(RESULTS.parent.parent)}`)", "",
             "| workload | commit | backend | completed | errors | index_pool_full | dense_fallback_steps | output tok/s "
             "| median TPOT (ms) | mean TTFT (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, x in r.items():
        if not isinstance(x, dict) or "status" in x or "completed" not in x or "num_prompts" not in x:
            continue
        pl = x["plugin"]
        lines.append(f"| {name} | {x['commit']} | {x.get('backend', backend)} | {x['completed']}/{x['num_prompts']} | "
                     f"{x['errors']} | "
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
    note = (f", commit {r['commit']}" if "commit" in r else "") + (f": {r['note']}" if "note" in r else "")
    lines = [f"Fidelity suite, {r['model']}, {r['device']}, lengths {r['lengths']}, {r['samples']} samples per task "
             f"and length{note} (`{path.relative_to(RESULTS.parent.parent)}`)", "",
             "| method | budget | " + " | ".join(tasks) + " | KV read |", "|---" * (len(tasks) + 3) + "|"]
    for run in r["runs"]:
        cells = [sum(v for k, v in run["scores"].items() if k.split("@")[0] == t) / len(r["lengths"]) for t in tasks]
        lines.append(f"| {run['method']} | {run['budget'] or 'dense'} | " + " | ".join(f"{c:.2f}" for c in cells)
                     + f" | {run['kv_read']:.1%} |")
    return "\n".join(lines)


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
                    f"test's p{firm} (`{path.relative_to(RESULTS.parent.parent)}`)",
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


def merged_recall_table(path: Path) -> str:
    """``attention_recall --merge``: attention-mass recall per task and variant, and the mean over tasks."""
    r = json.loads(path.read_text())
    tasks = list(r["tasks"])
    n = sum(len(t["samples"]) for t in r["tasks"].values())
    reuse = any("selected_steps" in m for m in r["mean_over_tasks"].values())   # lists reused across steps
    rows = [(v, *(f"{r['tasks'][t]['variants'][v]['mass_recall']:.3f}" for t in tasks),
             f"{m['mass_recall']:.3f}", f"{m['out_rel_err']:.3f}", f"{m['kv_read']:.1%}",
             *([f"{m['selected_steps']:.0%}" if "selected_steps" in m else "100%"] if reuse else []))
            for v, m in r["mean_over_tasks"].items()]
    budget = budgets_named(r["budget"])
    return md_table(f"{r.get('what', 'Attention-mass recall')}, {r['model']}, {r['length']} tokens, {budget}, "
                    f"{n} samples, {r['device']} (`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["variant", *tasks, "mean", "output error (mean)", "KV read",
                     *(["decode steps that select"] if reuse else [])], rows)


def first_layers_table(path: Path) -> str:
    """``attention_recall`` with every layer selected (``lychee-dense-0``): attention-mass recall and output error of
    the first sparse-capable layers per task, the layers lychee leaves dense by default among them."""
    r = json.loads(path.read_text())
    layers = r["first_layers"]
    tasks = list(next(iter(layers.values())))
    rows = [(f"layer {l}", *(f"{x[t]['mass_recall']:.2f} / {x[t]['out_rel_err']:.2f}" for t in tasks))
            for l, x in layers.items()]
    return md_table(f"Each of the first layers selected as lychee selects the others, {r['model']}, {r['length']} "
                    f"tokens, budget {r['budget']}, {r['device']}: attention-mass recall / output error, mean over the "
                    f"queries (`{path.relative_to(RESULTS.parent.parent)}`)", ["layer", *tasks], rows)


def compare_fidelity_table(path: Path) -> str:
    """The same seeded samples served twice (``bench.fidelity --compare``: TP 1 against TP 2, the CPU against the
    GPU): answers right per task, the answers a sparse run shares with dense in the same result, and the answers
    each run shares with itself in the other result."""
    from bench.fidelity import run_key, total_with_interval

    c = json.loads(path.read_text())
    labels = c["labels"]
    first = c["results"][labels[0]]
    n = first["lengths"][0]
    tasks = first["tasks"]
    rows = []
    for label in labels:
        r = c["results"][label]
        for run in r["runs"]:
            key = run_key(run)
            counts = run["counts"]
            dense = c["same_as_dense"][label].get(key)
            other = c["same_answers"].get(key)
            rows.append((label, run["method"], run["budget"] or "dense",
                         *(counts[f"{t}@{n}"]["correct"] for t in tasks), total_with_interval(counts),
                         f"{dense['same']}/{dense['of']}" if dense else "-",
                         f"{other['same']}/{other['of']}" if other else "-"))
    served = "; ".join(dict.fromkeys(f"{c['results'][x]['device']}, commit {c['results'][x]['commit']}"
                                     for x in labels))
    return md_table(f"The same seeded samples, {' against '.join(labels)}, {first['model']}, real weights, {n} tokens, "
                    f"{first['samples']} samples per task, {served}{': ' + c['note'] if 'note' in c else ''} "
                    f"(`{path.relative_to(RESULTS.parent.parent)}`)",
                    ["served at", "method", "budget", *tasks, "total (95% CI)", "answer text as dense's",
                     f"answer text as at {' / '.join(labels)}"], rows)


# the latest-runs tables of docs/RESULTS.md ("Where the issues stand"): the latest serving runs (#10) and the GPU
# fidelity runs (#11); every table goes to docs/RESULTS.md's full list too
LATEST = ("gpu_serving_h100_full.json", "gpu_serving_h200_fine_tiles_shared.json",
          "gpu_serving_h200_random_latekeys.json", "gpu_serving_h200_random_c1.json", "gpu_serving_h200_tpot64k.json",
          "gpu_serving_h200_ahead.json", "gpu_serving_h200_chain_tpot.json", "gpu_serving_h200_chain_shared.json",
          "fidelity_qwen2.5-coder-0.5b_16k_gpu.json", "fidelity_qwen2.5-coder-0.5b_30k_gpu.json",
          "fidelity_qwen2.5-coder-0.5b_16384_gpu.json", "fidelity_qwen2.5-coder-0.5b_8k_gpu.json")


def main(argv=None):
    ap = argparse.ArgumentParser(description="Markdown tables of the committed results")
    ap.add_argument("--latest", action="store_true", help="only the latest runs' tables (LATEST)")
    latest = ap.parse_args(argv).latest
    out = []
    for name, fn in (("fidelity_qwen2.5-coder-0.5b_8k_gpu.json", fidelity_runs_table),
                     ("fidelity_qwen2.5-coder-0.5b_16k_gpu.json", fidelity_runs_table),
                     ("fidelity_qwen2.5-coder-0.5b_30k_gpu.json", fidelity_runs_table),
                     ("fidelity_qwen2.5-coder-0.5b_16384_gpu.json", fidelity_runs_table),
                     ("gpu_serving_h100_full.json", serving_table),
                     ("host_lifecycle_h100_launch_queue.json", busy_lifecycle_table),
                     ("gpu_serving_h200_check_cf05bee.json", serving_table),
                     ("gpu_serving_h200_check_a22444c.json", serving_table),
                     ("gpu_serving_h200_fine_tiles_shared.json", serving_table),
                     ("selection_breakdown_cut_warps_h100.json", selection_variant_table),
                     ("selection_breakdown_fine_tiles_h100.json", selection_variant_table),
                     ("gpu_serving_h200_host_fuse_shared.json", serving_table),
                     ("gpu_serving_h200_packed_shared.json", serving_table),
                     ("gpu_serving_h200_gpu_queue_shared.json", serving_table),
                     ("selection_breakdown_shared_packs_h200.json", hybrid_breakdown_table),
                     ("gpu_serving_h200_floor_shared.json", serving_table),
                     ("gpu_serving_h200_pagetable_tpot.json", methods_serving_table),
                     ("serving_profile_h200_b16_pair.json", step_profile_table),
                     ("serving_profile_h200_b16_pair_launch.json", step_profile_table),
                     ("serving_profile_h200_b16_pair_parts.json", step_profile_table),
                     ("serving_profile_h200_b16_at_start.json", step_profile_table),
                     ("serving_profile_h200_b16_chain_priority.json", step_profile_table),
                     ("serving_profile_h200_b16_chain_priority_repeat.json", step_profile_table),
                     ("gpu_serving_h200_chain_tpot.json", methods_serving_table),
                     ("gpu_serving_h200_chain_shared.json", methods_serving_table),
                     ("gpu_serving_h200_parts_tpot.json", methods_serving_table),
                     ("gpu_serving_h200_parts_shared.json", methods_serving_table),
                     ("serving_profile_h200_b1_126k_pagetable.json", step_profile_table),
                     ("gpu_serving_h200_pagetable_shared.json", methods_serving_table),
                     ("gpu_serving_h200_aheadbox_tpot.json", methods_serving_table),
                     ("serving_profile_h200_b1_32k.json", step_profile_table),
                     ("serving_profile_h200_b1_126k.json", step_profile_table),
                     ("gpu_serving_h200_aheadbox_shared.json", methods_serving_table),
                     ("fidelity_qwen2.5-coder-0.5b_16k_structured_budgets_gpu.json", fidelity_runs_table),
                     ("gpu_serving_h200_box.json", variants_serving_table),
                     ("gpu_serving_h200_box_dense.json", variants_serving_table),
                     ("selection_breakdown_box_bs1_h200.json", hybrid_breakdown_table),
                     ("selection_breakdown_box_h200.json", hybrid_breakdown_table),
                     ("fidelity_qwen2.5-coder-0.5b_16k_tp1_tp2.json", compare_fidelity_table),
                     ("fidelity_smollm2_4k_cpu_gpu.json", compare_fidelity_table),
                     ("attention_recall_qwen_oracle_16k.json", merged_recall_table),
                     ("attention_recall_qwen_oracle_30k.json", merged_recall_table),
                     ("attention_recall_qwen_rerank_16k.json", merged_recall_table),
                     ("selection_query_qwen_4k.json", merged_recall_table),
                     ("attention_recall_qwen_ahead_16k.json", merged_recall_table),
                     ("attention_recall_qwen_ahead_budgets_16k.json", merged_recall_table),
                     ("attention_recall_qwen_ahead_next_16k.json", merged_recall_table),
                     ("attention_recall_qwen_next_16k.json", merged_recall_table),
                     ("attention_recall_qwen_previous_query_16k.json", merged_recall_table),
                     ("attention_recall_qwen_previous_query_layers_vt16k.json", recall_table),
                     ("adaptive_budget_qwen_4k.json", merged_recall_table),
                     ("attention_recall_qwen_carry_4k.json", merged_recall_table),
                     ("attention_recall_qwen_dense_layers_4k.json", merged_recall_table),
                     ("attention_recall_qwen_dense_layers_4k.json", first_layers_table),
                     ("attention_recall_qwen_dense_layers_16k.json", merged_recall_table),
                     ("attention_recall_qwen_dense_layers_16k.json", first_layers_table),
                     ("attention_recall_qwen_mv30k_flat.json", recall_table),
                     ("attention_recall_qwen_mv30k_fine1.json", recall_table),
                     ("attention_recall_qwen_vt16k_query.json", recall_table),
                     ("attention_recall_qwen_variable_tracking_4k.json", recall_table),
                     ("attention_recall_qwen_niah_multivalue_4k.json", recall_table),
                     ("attention_recall_qwen_variable_tracking_16k.json", recall_table),
                     ("attention_recall_qwen_vt4k_b2000.json", recall_table),
                     ("attention_recall_qwen_vt16k_h100.json", recall_table),
                     ("attention_recall_qwen_code_return_16k.json", recall_table),
                     ("attention_recall_qwen_code_return_hedge_16k.json", recall_table),
                     ("attention_recall_qwen_code_return_chunks48_16k.json", recall_table),
                     ("attention_recall_qwen_code_return_chunk_hedge_16k.json", recall_table),
                     ("attention_recall_qwen_code_return_fine15_16k.json", recall_table),
                     ("attention_recall_qwen_code_return_fine1_rankings_16k.json", recall_table),
                     ("passkey_smollm2.json", passkey_table), ("fidelity_smollm2.json", fidelity_table),
                     ("fidelity_smollm2_4k_cpu.json", fidelity_table),
                     ("fidelity_smollm2_quest_graphs_cpu.json", fidelity_table),
                     ("fidelity_qwen2.5-coder-0.5b_8k.json", fidelity_table),
                     ("fidelity_qwen2.5-coder-0.5b_3k.json", fidelity_table),
                     ("fidelity_qwen2.5-coder-0.5b_3k_8samples.json", fidelity_table),
                     ("attention_recall_smollm2.json", recall_table), ("head_roles_smollm2.json", roles_table),
                     ("head_roles_qwen.json", roles_table), ("head_roles_qwen_8k.json", roles_table),
                     ("hardkuma_smollm2.json", hardkuma_table),
                     ("hardkuma_qwen.json", hardkuma_table),
                     ("hardkuma_eq_qwen.json", hardkuma_table),
                     ("hardkuma_smollm2_damped.json", hardkuma_table),
                     ("hardkuma_qwen_damped.json", hardkuma_table),
                     ("hardkuma_qwen_5prompts.json", hardkuma_table), ("head_roles_qwen_topk.json", roles_table),
                     ("retrieval_heads_qwen.json", retrieval_heads_table),
                     ("retrieval_heads_smollm2.json", retrieval_heads_table),
                     ("gpu_serving_h200_ahead.json", methods_serving_table),
                     ("gpu_serving_h200_ahead_join.json", methods_serving_table),
                     ("gpu_serving_h200_ahead_shared_join.json", methods_serving_table),
                     ("gpu_serving_h200_ahead_prompt_shared.json", methods_serving_table),
                     ("gpu_serving_h200_ahead_own_shared.json", methods_serving_table),
                     ("gpu_serving_h200_valuecut.json", serving_table),
                     ("gpu_serving_h200_tpot64k.json", serving_table),
                     ("gpu_serving_h200_tpot_valuecut.json", serving_table),
                     ("cut_value_steps_h200.json", cut_probe_table),
                     ("gpu_serving_h200_int8.json", serving_table),
                     ("gpu_serving_h200_tpot_int8.json", serving_table),
                     ("gpu_serving_h200_latekeys.json", serving_table),
                     ("gpu_serving_h200_random_latekeys.json", serving_table),
                     ("gpu_serving_h200_random_c1.json", serving_table),
                     ("gpu_serving_h200_tpot_live.json", serving_table),
                     ("gpu_serving_h200_tpot.json", serving_table),
                     ("gpu_serving_h200_dot.json", serving_table),
                     ("gpu_serving_h200_random.json", serving_table),
                     ("selection_breakdown_dot_h200.json", fine_bounds_variants_table),
                     ("selection_breakdown_int8_h200.json", breakdown_table),
                     ("centroid_storage_qwen_4k.json", merged_recall_table),
                     ("parts_sweep_h200.json", parts_table),
                     ("cut_live_list_h200.json", cut_probe_table),
                     ("pdl_probe_h200.json", pdl_probe_table),
                     ("cut_band_pairwise_h200.json", cut_probe_table),
                     ("cut_kary_probe_h200.json", cut_probe_table),
                     ("gpu_serving_h200_fold.json", serving_table),
                     ("gpu_serving_h200_staged.json", serving_table),
                     ("gpu_serving_h200_band.json", serving_table),
                     ("gpu_serving_h200_expand32.json", serving_table),
                     ("gpu_serving_h200_qwen05b_roles.json", hybrid_serving_table),
                     ("serving_profile_h200_text.json", step_profile_table),
                     ("host_lifecycle_h200_busy_kernels.json", busy_lifecycle_table),
                     ("serving_profile_h200.json", step_profile_table),
                     ("host_lifecycle_h200_busy.json", busy_lifecycle_table),
                     ("gpu_serving_h200_every4.json", hybrid_serving_table),
                     ("gpu_serving_h200_qwen05b.json", serving_table),
                     ("gpu_serving_h200_check.json", serving_table),
                     ("gpu_serving_h100_random.json", serving_table),
                     ("fine_bounds_probes_h200.json", fine_bounds_probes_table),
                     ("fine_bounds_grouped.json", grouped_bounds_table),
                     ("fine_bounds_variants.json", fine_bounds_variants_table),
                     ("gpu_serving_h100_default.json", serving_table),
                     ("selection_breakdown_band.json", hybrid_breakdown_table),
                     ("selection_breakdown_rerank.json", hybrid_breakdown_table),
                     ("rerank_kernels_h200.json", rerank_kernels_table),
                     ("selection_breakdown_fine1.json", hybrid_breakdown_table),
                     ("selection_breakdown_expand.json", hybrid_breakdown_table),
                     ("selection_breakdown_expand.json", bounds_kernel_table),
                     ("attention_recall_qwen_expand_budgets_30k.json", merged_recall_table),
                     ("attention_recall_qwen_expand_16k.json", merged_recall_table),
                     ("attention_recall_qwen_reuse_4k.json", merged_recall_table),
                     ("attention_recall_qwen_mv30k_expand.json", recall_table),
                     ("index_build_h100_fine1.json", build_table),
                     ("gpu_serving_h100_chains.json", variants_serving_table),
                     ("gpu_serving_h100_fine1.json", variants_serving_table),
                     ("gpu_serving_h200_fine1.json", hybrid_serving_table),
                     ("gpu_serving_h200_hybrid.json", hybrid_serving_table),
                     ("gpu_serving_h100_keys.json", serving_table),
                     ("gpu_serving_h100_release.json", serving_table),
                     ("gpu_serving_h200_grafts.json", serving_table),
                     ("gpu_serving_h200_grafts_before.json", serving_table),
                     ("gpu_serving_h200_segments.json", serving_table),
                     ("selection_breakdown_segments.json", hybrid_breakdown_table),
                     ("selection_breakdown_tiles.json", hybrid_breakdown_table),
                     ("selection_breakdown_hybrid.json", hybrid_breakdown_table),
                     (PARALLEL_RUNS, parallel_table),
                     ("gpu_serving_h200.json", serving_table),
                     ("gpu_serving_h100_flashinfer.json", serving_table),
                     ("gpu_serving_h100.json", serving_table),
                     ("index_build_h100.json", build_table), ("host_lifecycle_segments_cpu.json", lifecycle_table),
                     ("host_lifecycle_cpu.json", lifecycle_table),
                     ("selection_breakdown_h100.json", breakdown_table),
                     ("host_prepare_h100_host_fuse.json", cold_host_table),
                     ("host_prepare_cpu_host_fuse.json", cold_host_table),
                     ("host_prepare_cpu_lean_upload.json", cold_host_table),
                     ("host_prepare_cpu_cold.json", cold_host_table),
                     ("host_prepare_h200_packed.json", host_table),
                     ("host_prepare_h200_staged.json", host_table), ("host_prepare_h100_keys.json", host_table),
                     ("host_prepare_h100_release.json", host_table),
                     ("host_prepare_h200_grafts.json", host_table),
                     ("host_prepare_h200.json", host_table),
                     ("host_prepare_h100.json", host_table),
                     ("kernels_h200.json", kernels_table), ("gpu_serving_load_h100.json", load_table),
                     ("stress_h100.json", stress_table)):
        if latest and name not in LATEST:
            continue
        if isinstance(name, tuple):
            out.append((name, fn([RESULTS / n for n in name])))
        elif (p := RESULTS / name).exists():
            out.append((name, fn(p)))
    if latest:
        out.sort(key=lambda t: LATEST.index(t[0]))
    print("\n\n".join(table for _, table in out))


if __name__ == "__main__":
    sys.exit(main())
