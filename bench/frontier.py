"""Accuracy against budget on the GPU harness's samples (Qwen2.5-Coder-0.5B, real weights), from the committed
results: every ten-task run at its latest commit, and the four structured tasks beside (at 16K with the structured
budget sweep's runs too: the same seeded samples, one dense run for both files).

    python -m bench.frontier    # bench/results/fidelity_qwen2.5-coder-0.5b_{16k,8k}_frontier.png
"""

from __future__ import annotations

import functools
import subprocess

from bench.targets import FIDELITY, FIDELITY_8K, STRUCTURED_BUDGETS, correct, load
from bench.tasks import STRUCTURED

# name -> (prompt length, samples per task, the result files (the first holds every task), the figure)
FIGURES = {"16K": (16000, 50, [FIDELITY["16K"], STRUCTURED_BUDGETS], "fidelity_qwen2.5-coder-0.5b_16k_frontier.png"),
           "8K": (8000, 20, [FIDELITY_8K], "fidelity_qwen2.5-coder-0.5b_8k_frontier.png")}
# the options as the README names them, by the names bench.fidelity gives their runs
OPTIONS = {"lychee": "lychee (default)", "lychee-box-0.25": "fine_bound box", "lychee-ahead": "select_ahead",
           "lychee-ahead-box-0.25": "select_ahead + box", "quest": "Quest", "lychee-fixed": "fixed 16-token chunks"}

# the commit that last changed lychee's defaults (coarse_expand 32): a run of the default before it measured other
# settings
DEFAULTS_SINCE = {"lychee": "2815376"}


@functools.cache
def committed_at(commit: str) -> int:
    """The commit's time (0 where this checkout does not know it): which of two files' runs is the later."""
    got = subprocess.run(["git", "show", "-s", "--format=%ct", commit], capture_output=True, text=True)
    return int(got.stdout.strip() or 0) if got.returncode == 0 else 0


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
            since = committed_at(DEFAULTS_SINCE.get(method, ""))
            old = [(b, n) for b, n, c in got if committed_at(c) < since]
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
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    panel(axes[0], latest(results[0], cells=every, samples=samples), samples * len(every), "all ten tasks")
    panel(axes[1], latest(*reversed(results), cells=structured, samples=samples), samples * len(structured),
          "the four structured tasks (JSON, YAML, code)")
    axes[1].legend(fontsize=7, loc="lower right")
    cards = " or ".join(sorted({r["device"].removeprefix("NVIDIA ") for runs in results for r in runs}))
    fig.suptitle(f"Qwen2.5-Coder-0.5B at {name}, one {cards} per run, {samples} samples per task: each point "
                 "the latest run of its (option, budget), labelled with its commit;\nhollow: the default's runs "
                 f"before its defaults last changed ({DEFAULTS_SINCE['lychee']})", fontsize=8)
    fig.tight_layout()
    fig.savefig(f"bench/results/{out}", dpi=80)


def main() -> None:
    for name in FIGURES:
        figure(name)


if __name__ == "__main__":
    main()
