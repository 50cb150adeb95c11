"""Accuracy against budget on the GPU harness's samples (Qwen2.5-Coder-0.5B, real weights), from the committed
results: every ten-task run at its latest commit, and the four structured tasks beside (at 16K with the structured
budget sweep's runs too: the same seeded samples, one dense run for both files).

    python -m docs.tables.frontier            # bench/results/fidelity_qwen2.5-coder-0.5b_{16k,8k,30k}_frontier.png
    python -m docs.tables.frontier --tables   # the budget sweep's tables at 8K, 16K and 30K (docs/RESULTS.md's, generated)
    python -m docs.tables.frontier --missing 16K   # its cells still to serve there, as bench.fidelity --methods words
"""

from __future__ import annotations

import sys

from bench.fidelity import per_task, shared, sign_test
from docs.tables.runs import md_table
from docs.tables.targets import (DEFAULTS_SINCE, FIDELITY, FIDELITY_8K, STAND_IN, STRUCTURED_BUDGETS, before_defaults,
                           committed_at, correct, first_seeds, load, paired_on_shared_seeds)
from bench.tasks import STRUCTURED

# name -> (prompt length, samples per task, the result files (the first holds every task), the figure)
FIGURES = {"16K": (16000, 50, [FIDELITY["16K"], STRUCTURED_BUDGETS], "fidelity_qwen2.5-coder-0.5b_16k_frontier.png"),
           "8K": (8000, 20, [FIDELITY_8K], "fidelity_qwen2.5-coder-0.5b_8k_frontier.png"),
           "30K": (30000, 50, [FIDELITY["30K"]], "fidelity_qwen2.5-coder-0.5b_30k_frontier.png")}
# the options as the README names them, by the names bench.fidelity gives their runs
OPTIONS = {"lychee": "lychee (default)", "lychee-box-0.25": "fine_bound box", "lychee-ahead": "select_ahead",
           "lychee-ahead-box-0.25": "select_ahead + box", "quest": "Quest",
           "quest-graphs": "Quest in CUDA graphs (quest-graphs)",
           "lychee-fixed": "fixed 16-token chunks", "lychee-flat": "every coarse unit expanded (lychee-flat)"}


def latest(*results: list, cells: set[str], samples: int = 50) -> dict:
    """(method, budget) -> (answers over ``cells``, commit) of its latest run that scored all of them, ``samples``
    each."""
    out = {}
    for runs in results:
        for r in runs:
            if (r["method"] in OPTIONS or r["method"] == "off") and cells <= r["counts"].keys() \
                    and all(r["counts"][c]["n"] == samples for c in cells):
                commit = r.get("commit", "").split(" ")[0]
                key = r["method"], r["budget"]
                if key not in out or committed_at(commit) >= committed_at(out[key][1]):
                    out[key] = (correct(r, cells), commit)
    return out


def panel(ax, points: dict, of: int, title: str) -> None:
    for method, label in OPTIONS.items():
        got = sorted((b, n, c) for (m, b), (n, c) in points.items() if m == method)
        if got:
            ax.plot([b for b, _, _ in got], [n for _, n, _ in got], marker="o", label=label)
            for b, n, c in got:
                ax.annotate(c, (b, n), fontsize=6, textcoords="offset points", xytext=(3, -9))
            old = [(b, n) for b, n, c in got if before_defaults(method, c, b)]
            if old:   # hollow: measured before the defaults last changed
                ax.scatter(*zip(*old), s=30, color="white", edgecolors=ax.lines[-1].get_color(), zorder=3)
    ax.axhline(points["off", None][0], color="k", linestyle="--", label="dense")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token budget per request, layer and KV head")
    ax.set_ylabel(f"answers of {of}")
    ax.set_title(title, fontsize=9)


def figure(name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    length, samples, files, out = FIGURES[name]
    results = [load(f)["runs"] for f in files]
    every = set(results[0][0]["counts"])
    structured = {f"{t}@{length}" for t in STRUCTURED}
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
    panel(axes[0], latest(results[0], cells=every, samples=samples), samples * len(every), "all ten tasks")
    panel(axes[1], latest(*reversed(results), cells=structured, samples=samples), samples * len(structured),
          "the four structured tasks (JSON, YAML, code)")
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))   # beside: no point hidden
    cards = " or ".join(sorted({r["device"].removeprefix("NVIDIA ") for runs in results for r in runs}))
    fig.suptitle(f"Qwen2.5-Coder-0.5B at {name}, one {cards} per run, {samples} samples per task: each point "
                 "the latest run of its (option, budget), labelled with its commit;\nhollow: the default's runs "
                 f"before its defaults last changed at that budget ({', '.join(sorted(set(DEFAULTS_SINCE.values())))})",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(f"bench/results/{out}", dpi=80)


SWEEP = {"8K": FIDELITY_8K, "16K": FIDELITY["16K"], "30K": FIDELITY["30K"]}
SWEPT = {"lychee": "lychee", "quest": "Quest", "lychee-fixed": "fixed 16-token chunks"}
BUDGETS = (256, 512, 1024, 2048)


def swept(runs: dict, method: str, budget: int) -> dict | None:
    """The sweep's run of (method, budget): its own, or its stand-in's where that one served more seeds; a run of
    the current defaults before one of older defaults, however many seeds."""
    both = [r for r in (runs.get((method, budget)), runs.get((STAND_IN.get(method), budget))) if r]
    current = [r for r in both if not before_defaults(r["method"], r["commit"], budget)]
    return max(current or both, key=per_task, default=None)   # the first of equals: the method's own


def stand_in_check(runs: dict) -> str:
    """Each stand-in beside its method (a run of its current defaults) on the seeds both served: answers, paired,
    answer texts alike."""
    parts = []
    for method, other in STAND_IN.items():
        said = []
        for b in BUDGETS:
            a, o = runs.get((method, b)), runs.get((other, b))
            if a and o and not before_defaults(method, a["commit"], b):
                k = min(per_task(a), per_task(o))
                seeds = f" (seeds 0-{k - 1})" if per_task(a) != per_task(o) else ""
                lost, gained = paired_on_shared_seeds(a, o)
                same = shared(a["counts"], o["counts"])   # zipped: the shorter run's seeds
                texts = f", {same['same']} of {same['of']} answer texts alike" if same["of"] else ""
                said.append(f"at {b}{seeds} {correct({'counts': first_seeds(o, k)})} against "
                            f"{correct({'counts': first_seeds(a, k)})} ({gained} gained, {lost} lost{texts})")
        if said:
            parts.append(f"; `{other}` beside {'eager ' * (method == 'quest')}{SWEPT[method]}: {', '.join(said)}")
    return "".join(parts)


def best_runs(runs: list) -> dict:
    """(method, budget) -> its run over all ten tasks with the most samples per task, of those the latest recorded."""
    out = {}
    for r in runs:
        key = r["method"], r["budget"]
        if len(r["counts"]) == 10 and (key not in out or per_task(r) >= per_task(out[key])):
            out[key] = r
    return out


def sweep_table(name: str) -> str:
    """#11 item 4's grid at one length: answers per budget for lychee, Quest and fixed chunks, each cell the run with
    the most samples (then the latest), with its KV read, commit and, where not the length's usual count, its
    samples per task; lychee against Quest sample by sample where both served the same seeds."""
    runs = best_runs(load(SWEEP[name])["runs"])
    dense = runs["off", None]
    per = per_task(dense)

    def cell(r):
        if r is None:
            return "-"
        n, commit = per_task(r), r["commit"].split(" ")[0]
        notes = [commit] + ["older defaults"] * before_defaults(r["method"], commit, r["budget"]) + [
            f"`{r['method']}`"] * (r["method"] in STAND_IN.values())
        return f"{correct(r)}{f' of {10 * n}' if n != per else ''} ({r['kv_read']:.1%}, {', '.join(notes)})"

    def versus(lychee, quest):
        if lychee is None or quest is None or before_defaults("lychee", lychee["commit"], lychee["budget"]):
            return "-"
        lost, gained = paired_on_shared_seeds(quest, lychee)
        return f"{gained} / {lost} (p {sign_test(lost, gained):.2f})"

    rows = [[b, *(cell(swept(runs, m, b)) for m in SWEPT), versus(swept(runs, "lychee", b), swept(runs, "quest", b))]
            for b in BUDGETS]
    caption = (f"Budget sweep at {name} (Qwen2.5-Coder-0.5B, real weights, {per} samples of each of the ten tasks "
               f"unless a cell says otherwise; dense {correct(dense)} of {10 * per}, {dense['commit']}): answers "
               f"(KV read, commit){stand_in_check(runs)}; generated by `python -m docs.tables` from "
               f"`{SWEEP[name]}`")
    return md_table(caption, ["budget", *SWEPT.values(), "lychee against Quest, gained / lost"], rows)


def missing(name: str) -> list[str]:
    """The sweep's cells at ``name`` not yet served with the length's full sample count (or, for lychee, not since its
    defaults last changed), as ``bench.fidelity --methods`` words: ``NAME@BUDGET``, or ``NAME@BUDGET:SEED`` where a
    run of the current defaults was cut at that seed (``--append`` joins the rest to it)."""
    runs = best_runs(load(SWEEP[name])["runs"])
    per = per_task(runs["off", None])

    def word(method: str, budget: int) -> str | None:
        r = swept(runs, method, budget)
        if r is None or before_defaults(r["method"], r["commit"], budget):
            return f"{STAND_IN.get(method, method)}@{budget}"
        return f"{r['method']}@{budget}:{per_task(r)}" if per_task(r) < per else None

    return [w for m in SWEPT for b in BUDGETS if (w := word(m, b))]


def main() -> None:
    if sys.argv[1:] == ["--tables"]:
        print("\n\n".join(sweep_table(name) for name in SWEEP))
        return
    if sys.argv[1:2] == ["--missing"]:   # e.g. bash bench/on_device.sh fidelity NAME 16000 "$(... --missing 16K)"
        print(" ".join(missing(sys.argv[2])))
        return
    for name in FIGURES:
        figure(name)


if __name__ == "__main__":
    main()
