"""The README's at-a-glance table: the latest committed run of each option, one function per row, every value read
from ``bench/results`` (or, for index memory, from the pools' sizing), so the table cannot drift from the results the
targets tables read. ``python -m docs.tables`` writes it; ``python -m docs.tables.glance`` prints it.

A cell names its commit, and its card where that is not an H200; ``docs/RESULTS.md`` has every run with its card.
"""

from __future__ import annotations

from docs.tables.runs import md_table
from docs.tables.targets import (BUILD, FIDELITY, FULL, LONG, PROFILE_16, RANDOM, RECALL, SELECTION, SHARED, SHARED_AHEAD,
                           SHARED_AHEAD_BOX, TPOT, TPOT_AHEAD, TPOT_AHEAD_BOX, TPOT_AHEAD_JOIN, correct,
                           build_ms, index_shares, latest_run, load, over_4k, batch16_32k, selection_ms)

# the options compared, by the names bench.fidelity gives their runs
COLUMNS = {"dense": "off", "lychee (the default)": "lychee", "lychee, `fine_bound` box": "lychee-box-0.25",
           "lychee, `select_ahead`": "lychee-ahead", "lychee, `select_ahead` and `fine_bound` box":
           "lychee-ahead-box-0.25"}
NOT = "not measured"
BOX_SERVING, BOX_SELECTION = "gpu_serving_h200_box_dense.json", "selection_breakdown_box_h200.json"
QWEN_SHAPE = "gpu_serving_h200_qwen05b_roles.json"
BOX_RECALL = "attention_recall_qwen_box_16k.json"


def at(*results: dict) -> str:
    """``(commit, ...)`` of the results a cell reads, with the card where it is not an H200."""
    names = []
    for r in results:
        card = r.get("device", "").replace("NVIDIA ", "").replace(" 80GB HBM3", "")
        names.append(r.get("commit", r.get("tree", "")).split(" (")[0] + ("" if card in ("H200", "") else f", {card}"))
    return f"({', '.join(names)})"


def answers(length: str) -> list[str]:
    runs = load(FIDELITY[length])["runs"]
    got = {m: latest_run(runs, m, None if m == "off" else 1024) for m in COLUMNS.values()
           if any(r["method"] == m for r in runs)}
    cells = {m: f"{correct(got[m])} {at(got[m])}" if m in got else NOT for m in COLUMNS.values()}
    if any(r["method"] == "lychee-fixed" for r in runs):
        fixed = latest_run(runs, "lychee-fixed")
        cells["lychee"] += f"; with fixed 16-token chunks {correct(fixed)} {at(fixed)}"
    read = got["lychee"]["kv_read"]
    return [f"answers at {length} ({read:.1%} of the KV read)", *cells.values()]


def attention_mass() -> list[str]:
    m = load(RECALL)["mean_over_tasks"]
    lychee = (f"{m['lychee@1024']['mass_recall']:.3f} (Quest {m['quest@1024']['mass_recall']:.3f}; the best 1024 "
              f"tokens keep {m['lychee-oracle-tokens@1024']['mass_recall']:.3f})")
    box = load(BOX_RECALL)
    b = box["mean_over_tasks"]

    def cpu(variant):
        return f"{b[variant]['mass_recall']:.3f} (lychee {b['lychee']['mass_recall']:.3f} in the same run) {at(box)}"

    return ["attention mass kept at budget 1024, 16K, four tasks", "1.000", lychee,
            *(cpu(COLUMNS[c]) for c in list(COLUMNS)[2:])]


def ratio(x: dict) -> str:
    return f"{x['throughput_ratio']:.2f}x (steady decode {x['steady_decode_ratio']:.2f}x)"


def shared_prefix() -> list[str]:
    r, box, a, ab = load(SHARED), load(BOX_SERVING), load(SHARED_AHEAD), load(SHARED_AHEAD_BOX)
    return ["shared prefix, 2 x 16 requests over a 32K prefix, throughput", "1.00x",
            f"{ratio(r['shared_prefix'])} {at(r)}", f"{ratio(box['lychee-box_over_dense']['shared'])} {at(box)}",
            f"{ratio(a['lychee-ahead_over_dense']['shared'])} {at(a)}",
            f"{ratio(ab['lychee-ahead-box_over_dense']['shared'])} {at(ab)}"]


def shared64() -> list[str]:
    r = load(FULL)
    return ["the same prefixes, 64 requests at concurrency 16 / 32", "1.00x",
            f"{r['shared64_c16']['throughput_ratio']:.2f}x / {r['shared64_c32']['throughput_ratio']:.2f}x (steady "
            f"decode at batch 32 {r['shared64_c32']['steady_decode_ratio']:.2f}x) {at(r)}", NOT, NOT, NOT]


def random_ids() -> list[str]:
    r = load(RANDOM)
    x = r["random_ids"]
    return ["random ids, 32K in, concurrency 8", "1.00x",
            f"{x['throughput_ratio']:.2f}x, median ITL {x['median_itl_ratio']:.2f}x, mean TTFT "
            f"{x['mean_ttft_ratio']:.2f}x {at(r)}", NOT, NOT, NOT]


def tpot() -> list[str]:
    r, a, j, ab = load(TPOT), load(TPOT_AHEAD), load(TPOT_AHEAD_JOIN), load(TPOT_AHEAD_BOX)

    def row(res, method):
        return " / ".join(f"{over_4k(res, method, c):.2f}x" for c in LONG) + f" {at(res)}"

    ahead = f"{over_4k(a, 'lychee-ahead', 32768):.2f}x / - / {over_4k(j, 'lychee-ahead', 126976):.2f}x {at(a, j)}"
    return ["batch-1 TPOT over dense's at 4K: 32K / 64K / 126K", row(r, "dense"), row(r, "lychee"), NOT, ahead,
            row(ab, "lychee-ahead-box")]


def selection() -> list[str]:
    r, box = load(SELECTION), load(BOX_SELECTION)
    boxed = batch16_32k([x for x in box["runs"] if x["label"] == "fine_bound box"][-1]["rows"])
    p = load(PROFILE_16)
    ahead, inline = (p[m] for m in p["settings"]["methods"])
    return ["selection + token lists per sparse layer, batch 16, 32K", "-",
            f"{selection_ms(batch16_32k(r['rows'])):.3f} ms {at(r)}", f"{selection_ms(boxed):.3f} ms {at(box)}",
            "the same kernels, on a side stream beside the attention",
            f"the box's kernels, on a side stream: in a batch-16 step it hides {inline['period'] - ahead['period']:.2f} "
            f"of their {inline['selection']:.2f} ms {at(p)}"]


def index_memory() -> list[str]:
    share, boxes = index_shares()
    return ["index memory, share of the KV", "-", f"{share:.1%} (int8 centroids)",
            f"{boxes:.1%} (bf16 boxes beside the centroids)", f"{share:.1%}", f"{boxes:.1%}"]


def index_build() -> list[str]:
    return ["index build, one prompt, all 30 sparse layers: 32K / 126K tokens", "-",
            f"{build_ms(32768):.1f} / {build_ms(129024):.0f} ms {at(load(BUILD))}",
            "as lychee, plus the boxes' min/max pooling", "as lychee", "as `fine_bound` box"]


def qwen_shape() -> list[str]:
    r = load(QWEN_SHAPE)
    hybrid = r["lychee-qwen-calibrated-0.25_over_dense"]["shared"]["throughput_ratio"]
    return ["Qwen2.5-Coder-0.5B shape, shared prefix at 32K", "1.00x",
            f"{r['shared_prefix']['throughput_ratio']:.2f}x {at(r)}: on so small a model selection costs about what "
            f"the KV it saves costs; hybrid heads with the calibrated map {hybrid:.2f}x", NOT, NOT, NOT]


ROWS = (lambda: answers("16K"), lambda: answers("30K"), attention_mass, shared_prefix, shared64, random_ids, tpot,
        selection, index_memory, index_build, qwen_shape)


def table() -> str:
    return md_table("The latest run of each option, on H200s unless named (generated by `python -m "
                    "docs.tables` from `docs/tables/glance.py`). Answers: Qwen2.5-Coder-0.5B with its real weights, "
                    "50 samples of each of ten tasks, budget 1024; speed: the Llama-3.1-8B shape with dummy weights, "
                    "FlashInfer and CUDA graphs, dense measured in the same call",
                    ["", *COLUMNS], [row() for row in ROWS])


if __name__ == "__main__":
    print(table())
