"""An open issue's targets against the committed results: #94 (answers on the test split), and the named results
and helpers the at-a-glance table and the budget sweep read.

Each row reads its measured values from ``bench/results``, decides from them whether the target is met, and names
the files. A target's verdict reads the default configuration in one run (one commit, one card, dense and Quest in
the same call); an option measured against the same target is a row of its own, never the verdict. The closed
issues' tables (#10, #11) were frozen into ``docs/RESULTS.md`` when they closed. ``python -m docs.tables`` writes
the table into the README; ``python -m docs.tables.targets`` prints it.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

from bench.fidelity import paired, per_task, sign_test
from docs.tables.runs import RESULTS, md_table

# Llama-3.1-8B, the serving benchmark's shape: its KV per token (bf16 K and V) and the sparse layers lychee indexes
LLAMA8B_KV_BYTES = 32 * 8 * 128 * 2 * 2
LLAMA8B_SPARSE_LAYERS = 30


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def verdict(met: bool, why: str = "") -> str:
    return "**met**" if met else f"missed: {why}" if why else "missed"


# -- #10: speed in serving (Llama-3.1-8B shape, dummy weights, FlashInfer, CUDA graphs, budget 1024) ------------------

SHARED = "gpu_serving_h200_fine_tiles_shared.json"         # lychee (the default) and dense, one call
SHARED_AHEAD = "gpu_serving_h200_ahead_own_shared.json"    # select_ahead and dense, one call
RANDOM, RANDOM_C1 = "gpu_serving_h200_random_latekeys.json", "gpu_serving_h200_random_c1.json"
TPOT = "gpu_serving_h200_tpot64k.json"                    # lychee and dense, batch 1, 4K to 126K
TPOT_AHEAD, TPOT_AHEAD_JOIN = "gpu_serving_h200_ahead.json", "gpu_serving_h200_ahead_join.json"
# select_ahead with fine_bound box, and dense, one call each (the step's chain above the side stream's priority)
SHARED_AHEAD_BOX, TPOT_AHEAD_BOX = "gpu_serving_h200_chain_shared.json", "gpu_serving_h200_chain_tpot.json"
# the whole benchmark (every workload and batch-1 TPOT, the default and dense) on one H100, one machine, one tree
FULL = "gpu_serving_h100_full.json"
BUILD = "index_build_h100_fine1.json"   # one prompt's index, all 30 sparse layers, at one chunk per fine cluster
SELECTION = "selection_breakdown_fine_tiles_h100.json"   # main's kernels, then the kept tiles, one call


PROFILE_16 = "serving_profile_h200_b16_pair.json"   # the pair, then the same selection inline, batch 16


def build_ms(context: int) -> float:
    """The index build's kernel time for one prompt of ``context`` tokens (``BUILD``, one chunk per fine cluster)."""
    return next(b["kernel_ms"] for b in load(BUILD)["builds"]
                if b["context"] == context and b["fine_cluster_size"] == 1.0)


LONG = (32768, 65536, 126976)


def over_4k(res: dict, method: str, ctx: int) -> float:
    """``method``'s batch-1 TPOT at ``ctx`` over dense's at 4K in the same call."""
    return res[method]["tpot_bs1"][str(ctx)]["tpot_ms"] / res["dense"]["tpot_bs1"]["4096"]["tpot_ms"]


PROFILE_32K, PROFILE_126K = "serving_profile_h200_b1_32k.json", "serving_profile_h200_b1_126k.json"


SELECTION_PARTS = ("coarse_ms", "fine_bounds_ms", "cut_ms", "emit_ms")


def batch16_32k(rows: list, variant: int = -1) -> dict:
    """A selection breakdown's row at batch 16 and 32K: by default the variant kept (the last); 0, the one before."""
    return [x for x in rows if x["ctx"] == 32768 and x["bs"] == 16][variant]


def selection_ms(row: dict) -> float:
    return sum(row[p] for p in SELECTION_PARTS)


def index_shares() -> tuple[float, float]:
    """The index pools' share of the KV at the defaults for the Llama-3.1-8B shape: without and with fine boxes."""
    from sgl_sparsekv.config import SparseKVConfig
    from sgl_sparsekv.index_pool import pool_capacity

    slots = 1 << 20
    share, boxes = (pool_capacity(SparseKVConfig(method="lychee"), slots).nbytes(LLAMA8B_SPARSE_LAYERS, 8, 128, box)
                    / slots / LLAMA8B_KV_BYTES for box in (False, True))
    return share, boxes


# -- #11: fidelity, Qwen2.5-Coder-0.5B with its real weights on the GPU, 50 samples per task ---------------------------

FIDELITY = {"16K": "fidelity_qwen2.5-coder-0.5b_16k_gpu.json", "30K": "fidelity_qwen2.5-coder-0.5b_30k_gpu.json"}
FIDELITY_8K = "fidelity_qwen2.5-coder-0.5b_8k_gpu.json"   # the budget sweep, 20 samples per task
STRUCTURED_BUDGETS = "fidelity_qwen2.5-coder-0.5b_16k_structured_budgets_gpu.json"
RECALL = "attention_recall_qwen_oracle_16k.json"


def tasks_worse(dense: dict, run: dict, alpha: float = 0.05) -> list[str]:
    """The tasks where dense is better than ``run`` by more than chance: the exact sign test over the samples one
    answered and the other did not puts dense ahead at p < ``alpha``."""
    worse = []
    for cell, d in dense["counts"].items():
        lost, gained = paired({cell: d}, {cell: run["counts"][cell]})
        if lost > gained and (p := sign_test(lost, gained)) < alpha:
            worse.append(f"{cell.split('@')[0].replace('_', ' ')} {run['counts'][cell]['correct']} against "
                         f"{d['correct']} ({lost} lost, {gained} gained, sign test p {p:.2f})")
    return worse


# the commits that last changed lychee's defaults, per budget (None: every other): coarse_expand 32 (2815376), then
# at budgets under 1024 the floor under the expansion (coarse_expand_min, f7d1b88); a run of the default before its
# budget's commit measured other settings
DEFAULTS_SINCE = {("lychee", None): "2815376", ("lychee", 256): "f7d1b88", ("lychee", 512): "f7d1b88"}


@functools.cache
def committed_at(commit: str) -> int:
    """The commit's time (0 where this checkout does not know it): which of two files' runs is the later."""
    got = subprocess.run(["git", "show", "-s", "--format=%ct", commit], capture_output=True, text=True)
    return int(got.stdout.strip() or 0) if got.returncode == 0 else 0


def before_defaults(method: str, commit: str, budget: int | None) -> bool:
    """Whether a run of ``method`` at ``budget`` at ``commit`` ("C" or "C + D") predates the method's defaults."""
    since = DEFAULTS_SINCE.get((method, budget), DEFAULTS_SINCE.get((method, None)))
    return since is not None and committed_at(commit.split(" ")[0]) < committed_at(since)


# Where a cell has no run of a method's current defaults, or a shorter one, a method that selects the same stands in:
# for Quest its pages and bound served through lychee's pools in CUDA graphs (quest-graphs), in a graph server's time;
# for lychee every coarse unit expanded (lychee-flat), which the default does on prompts up to coarse_expand_min
# (30000) tokens since f7d1b88, and so on every prompt of the sweeps
STAND_IN = {"quest": "quest-graphs", "lychee": "lychee-flat"}


def correct(run: dict, cells=None) -> int:
    return sum(v["correct"] for k, v in run["counts"].items() if cells is None or k in cells)


def full_runs(runs: list, method: str, budget: int | None = 1024) -> list[dict]:
    """Every run of ``method`` at ``budget`` over every task with 50 samples in each, in the order recorded."""
    return [r for r in runs if r["method"] == method and r["budget"] == budget and len(r["counts"]) == 10
            and all(v["n"] == 50 for v in r["counts"].values())]


def latest_run(runs: list, method: str, budget: int | None = 1024) -> dict:
    """The last run of ``method`` at ``budget`` over every task with 50 samples in each."""
    return full_runs(runs, method, budget)[-1]


def first_seeds(run: dict, k: int) -> dict:
    """``run``'s counts over seeds 0 .. ``k`` - 1 of each task (every committed GPU run starts at seed 0), to set it
    beside a shorter run on that run's seeds."""
    return {cell: {"n": k, "failed": (f := [s for s in c["failed"] if s < k]), "correct": k - len(f)}
            for cell, c in run["counts"].items()}


def paired_on_shared_seeds(a: dict, b: dict) -> tuple[int, int]:
    """``paired`` of two runs over the seeds both served (the shorter run's), whatever their sample counts."""
    k = min(per_task(a), per_task(b))
    return paired(first_seeds(a, k), first_seeds(b, k))


# -- #94: the test split (samples no default was chosen on), the default at budget 1024, dense and Quest in one call --

TEST_SPLIT = {"16K": "fidelity_qwen2.5-coder-0.5b_16k_test_gpu.json"}
HELD_OUT = {"8K": "fidelity_qwen2.5-coder-0.5b_8k_heldout_test_gpu.json",
            "30K": "fidelity_qwen2.5-coder-0.5b_30k_heldout_test_gpu.json"}


def one_call(runs: list, *methods) -> dict:
    """The runs of ``methods`` (at budget 1024; dense at none) of one call, one commit and one card, over the seeds
    all of them served; None where some method has no run in that call."""
    by = {(r["method"], r["budget"]): r for r in runs}
    got = [by.get((m, None if m == "off" else 1024)) for m in methods]
    if None in got or len({(r["commit"], r.get("gpu")) for r in got}) != 1:
        return None
    k = min(per_task(r) for r in got)
    return {m: {**r, "counts": first_seeds(r, k)} for m, r in zip(methods, got)}


def beaten_by(base: dict, run: dict, name: str) -> list[str]:
    return [f"{name} ahead on {w}" for w in tasks_worse(base, run)]


def closest(base: dict, run: dict) -> str:
    """The family where ``base`` leads ``run`` with the lowest sign-test p."""
    cells = [(sign_test(*lg), c, lg) for c in base["counts"] if (lg := paired({c: base["counts"][c]},
                                                                             {c: run["counts"][c]}))[0] > lg[1]]
    if not cells:
        return "none"
    p, c, (lost, gained) = min(cells)
    return (f"{c.split('@')[0].replace('_', ' ')} {run['counts'][c]['correct']} against {base['counts'][c]['correct']}"
            f" ({lost} lost, {gained} gained, p {p:.2f})")


def on_test_split(length: str) -> list[list[str]]:
    """The two held-out-sample targets at ``length``: the mean over every family within 1 point of dense, and no family
    where dense or Quest beats lychee outside its 95% interval (exact sign test over the paired samples)."""
    name = TEST_SPLIT[length]
    r = one_call(load(name)["runs"], "off", "lychee", "quest")
    n = sum(v["n"] for v in r["off"]["counts"].values())
    score = {m: correct(r[m]) for m in r}
    points = (score["off"] - score["lychee"]) / n * 100
    at = f"{r['lychee']['commit']}, {r['lychee']['gpu']}, `{name}`"
    measured = (f"{n // len(r['off']['counts'])} samples of each of {len(r['off']['counts'])} families: lychee "
                f"{score['lychee']} of {n}, dense {score['off']}, Quest {score['quest']} ({at})")
    worse = beaten_by(r["off"], r["lychee"], "dense") + beaten_by(r["quest"], r["lychee"], "Quest")
    lost, gained = paired(r["quest"]["counts"], r["lychee"]["counts"])
    return [[f"{length}, test split: lychee within 1 point of dense on the mean over every family", measured,
             verdict(points <= 1, f"{points:.1f} points below")],
            [f"{length}, test split: no family where dense or Quest beats lychee outside its 95% interval",
             f"lychee against Quest {gained} gained, {lost} lost over all families (sign test p "
             f"{sign_test(lost, gained):.2f}); the family where dense leads closest to significance: "
             f"{closest(r['off'], r['lychee'])}; where Quest does: {closest(r['quest'], r['lychee'])}",
             verdict(not worse, "; ".join(worse))]]


def held_out(length: str) -> list[str]:
    """The held-out record families: at 30K the structured target (lychee at least Quest's score), which needs
    answers dense attention itself gives; at 8K, no target length, where this model answers more of them, what
    lychee and Quest lose against dense."""
    name = HELD_OUT[length]
    r = one_call(load(name)["runs"], "off", "lychee", "quest")
    n = sum(v["n"] for v in r["off"]["counts"].values())
    per = {m: correct(r[m]) for m in r}
    measured = (f"{n // len(r['off']['counts'])} samples of each of the {len(r['off']['counts'])} held-out families: "
                f"dense {per['off']}, lychee {per['lychee']}, Quest {per['quest']} of {n} "
                f"({r['lychee']['commit']}, {r['lychee']['gpu']}, `{name}`)")
    if length == "8K":
        (lost, gained), (ql, qg) = paired(r["off"]["counts"], r["lychee"]["counts"]), paired(r["off"]["counts"],
                                                                                            r["quest"]["counts"])
        return ["8K (not a target length), test split: the held-out record families, lychee against dense and Quest",
                measured, f"no verdict: lychee loses {lost} that dense answers and gains {gained} (sign test p "
                f"{sign_test(lost, gained):.3f}; closest family: {closest(r['off'], r['lychee'])}), Quest loses {ql} "
                f"and gains {qg}: lychee at least Quest's score, both below dense"]
    answered = [c.split("@")[0].replace("_", " ") for c, v in r["off"]["counts"].items() if v["correct"]]
    return ["30K, test split: on the structured-record families lychee at least Quest's score at equal KV read",
            measured, f"no verdict: Qwen2.5-Coder-0.5B answers {per['off']} of {n} densely (only "
            f"{', '.join(answered)}); both sparse methods lose those, lychee {per['lychee']}, Quest {per['quest']}"]


TABLES = {"targets94": ("Issue #94's targets on the test split (Qwen2.5-Coder-0.5B, real weights, the default "
                        "configuration at budget 1024, dense and Quest in the same call on one H100, CUDA graphs on)",
                        (lambda: on_test_split("16K"), lambda: held_out("30K"), lambda: held_out("8K")))}


def table(key: str) -> str:
    """``key``'s table: each function gives one row, or a list of rows (a target's option rows)."""
    caption, rows = TABLES[key]
    got = [row() for row in rows]
    return md_table(caption + "; generated by `python -m docs.tables` from `docs/tables/targets.py`",
                    ["target", "measured", ""], [r for g in got for r in (g if isinstance(g[0], list) else [g])])


if __name__ == "__main__":
    print("\n\n".join(table(k) for k in (sys.argv[1:] or TABLES)))
