"""The generated tables in the README and docs/RESULTS.md are what docs/tables makes of the committed results:
a result committed without `python -m docs.tables` (or a table edited by hand) fails here."""

import pytest

from docs.tables.__main__ import BLOCKS, ROOT, block


@pytest.mark.parametrize("path,marker,make", BLOCKS, ids=[m for _, m, _ in BLOCKS])
def test_generated_tables_match_the_committed_results(path, marker, make):
    found = block(marker).search((ROOT / path).read_text())
    assert found, f"{path} lacks its {marker} markers"
    assert found.group(1) == make(), f"{path}: run `python -m docs.tables`"


def test_a_task_is_worse_than_dense_only_beyond_chance():
    """#11's per-task rule: dense ahead on a task by the exact sign test (p < 0.05), not by a count alone."""
    from docs.tables.targets import tasks_worse

    def run(failed):
        return {"counts": {f"{t}@16000": {"correct": 50 - len(f), "n": 50, "failed": f} for t, f in failed.items()}}

    dense = run({"code_return": [], "passkey": [1, 2]})
    assert tasks_worse(dense, run({"code_return": [3, 4, 5, 6, 7, 8], "passkey": [1, 2]})) == [
        "code return 44 against 50 (6 lost, 0 gained, sign test p 0.03)"]
    # passkey: one lost against two gained; code return: five lost and none gained (p 0.06) is chance
    assert tasks_worse(dense, run({"code_return": [3, 4, 5, 6, 7], "passkey": [9]})) == []
    # six lost against two gained: chance
    assert tasks_worse(run({"code_return": [1, 2], "passkey": []}), run({"code_return": [3, 4, 5, 6, 7, 8],
                                                                         "passkey": []})) == []


def test_every_glance_row_fills_every_option():
    """A row of the at-a-glance table names its label and one cell per option, none empty."""
    from docs.tables.glance import COLUMNS, ROWS

    for row in ROWS:
        cells = row()
        assert len(cells) == len(COLUMNS) + 1 and all(cells), cells


def test_frontier_takes_each_points_latest_run_across_files(monkeypatch):
    """docs.tables.frontier: per (option, budget), the run of the later commit whichever file holds it, over runs that
    scored every cell asked with 50 samples; other methods and short runs are left out."""
    import docs.tables.frontier
    from docs.tables.frontier import latest

    # commit times as git gives them (b432e23 on 2026-11-26, 516fbe5 on 2026-12-02), whatever this clone's depth
    times = {"b432e23": 1764190219, "516fbe5": 1764678685, "753310e": 1764100000}
    monkeypatch.setattr(docs.tables.frontier, "committed_at", times.__getitem__)

    def run(method, budget, commit, correct, n=50, cells=("json_value@16000",)):
        return {"method": method, "budget": budget, "commit": commit,
                "counts": {c: {"correct": correct, "n": n} for c in cells}}

    first = [run("lychee", 512, "516fbe5", 9), run("quest", 1024, "516fbe5", 17), run("off", None, "753310e", 21)]
    second = [run("lychee", 512, "b432e23", 3), run("quest", 1024, "b432e23", 5, n=20),
              run("lychee-upper-bound", 512, "b432e23", 1)]
    got = latest(first, second, cells={"json_value@16000"})
    assert got == {("lychee", 512): (9, "516fbe5"), ("quest", 1024): (17, "516fbe5"), ("off", None): (21, "753310e")}
    assert latest(second, first, cells={"json_value@16000"}) == got
    # the 8K sweep's figure takes its runs of 20 samples, and only those
    assert latest(first, second, cells={"json_value@16000"}, samples=20) == {("quest", 1024): (5, "b432e23")}


def test_the_index_lists_every_result_with_its_card_and_commits():
    """docs/RESULTS.md's index: one row per committed result file, its card and commits read from the file itself
    (top level and runs), "-" where the file records none."""
    from docs.tables.runs import RESULTS, index_table, result_meta

    assert result_meta({"device": "NVIDIA H100 80GB HBM3", "runs": [{"commit": "b"}, {"commit": "a", "device": "CPU"}]}
                       ) == ("CPU, H100 80GB HBM3", "a, b")
    assert result_meta({"what": "a probe"}) == ("-", "-") and result_meta([1, 2]) == ("-", "-")
    rows = [line for line in index_table().splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == sorted(p.name for p in RESULTS.glob("*.json"))


def test_sweep_cells_take_the_run_with_most_samples_and_compare_on_shared_seeds(monkeypatch):
    """docs.tables.frontier's sweep table: per (method, budget) the ten-task run with the most samples per task (of equal
    ones the later recorded); lychee against Quest counted on the seeds both served, and left out for a lychee run
    of older defaults; quest-graphs stands in for Quest where Quest has no run or a shorter one, and is set beside it
    on the seeds both served; lychee-flat stands in for lychee, and a run of current defaults comes before one of
    older defaults however many seeds it has."""
    import docs.tables.frontier as fr
    import docs.tables.targets

    tasks = [f"t{i}@8000" for i in range(10)]

    def run(method, budget, commit, n, failed=()):
        return {"method": method, "budget": budget, "commit": commit, "kv_read": 0.05,
                "counts": {t: {"n": n, "correct": n - len(failed) if t == tasks[0] else n,
                               "failed": list(failed) if t == tasks[0] else []} for t in tasks}}

    runs = [run("off", None, "new", 5), run("lychee", 1024, "new", 5, failed=[4]), run("lychee", 1024, "newer", 3),
            run("lychee", 1024, "newest", 5, failed=[0]), run("quest", 1024, "new", 3, failed=[1, 2]),
            run("lychee", 512, "old", 5), run("quest", 512, "new", 5, failed=[1]),
            run("quest-graphs", 512, "new", 5, failed=[1, 3]), run("quest-graphs", 2048, "new", 5),
            run("lychee", 256, "old", 5), run("lychee-flat", 256, "new", 3, failed=[1]),
            run("quest-graphs", 1024, "new", 5, failed=[2, 4])]
    best = fr.best_runs(runs)
    assert best["lychee", 1024]["commit"] == "newest" and best["quest", 1024]["commit"] == "new"
    monkeypatch.setattr(fr, "load", lambda name: {"runs": runs})
    monkeypatch.setattr(docs.tables.targets, "committed_at", {"old": 1, "2815376": 2, "new": 3, "newer": 4, "newest": 5,
                                                        "f7d1b88": 2}.__getitem__)
    lines = fr.sweep_table("8K").splitlines()
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ")}
    # Quest at 1024 through its stand-in, which served 5 seeds to eager Quest's 3: lychee lost seed 0, it 2 and 4
    assert rows["1024"].endswith("| 2 / 1 (p 1.00) |") and "49 (5.0%, newest)" in rows["1024"]
    assert "| 48 (5.0%, new, `quest-graphs`) |" in rows["1024"]
    assert "50 (5.0%, old, older defaults)" in rows["512"] and rows["512"].endswith("| - |")
    assert "| 49 (5.0%, new) |" in rows["512"]   # eager Quest's own run, not its stand-in's
    assert "| 50 (5.0%, new, `quest-graphs`) |" in rows["2048"]
    # beside eager Quest at 1024 on seeds 0-2: eager lost 1 and 2, the stand-in 2
    assert ("`quest-graphs` beside eager Quest: at 512 48 against 49 (0 gained, 1 lost), at 1024 (seeds 0-2) 29 "
            "against 28 (1 gained, 0 lost);") in lines[0]
    # lychee at 256 through lychee-flat's 3 seeds, not the 5 of a run of older defaults
    assert rows["256"] == "| 256 | 29 of 30 (5.0%, new, `lychee-flat`) | - | - | - |"
    # still to serve: every empty cell and the cells of older defaults, through the stand-ins, and the rest of a
    # cut run
    assert fr.missing("8K") == ["lychee-flat@256:3", "lychee-flat@512", "lychee-flat@2048", "quest-graphs@256",
                                "lychee-fixed@256", "lychee-fixed@512", "lychee-fixed@1024", "lychee-fixed@2048"]
    runs.pop()   # without the stand-in's 5 seeds at 1024, eager Quest's 3 are short of the length's 5: the rest
    assert "quest@1024:3" in fr.missing("8K")


def test_a_test_split_verdict_reads_dense_lychee_and_quest_of_one_call_on_their_shared_seeds():
    from docs.tables.targets import one_call

    def run(method, commit, failed, n):
        return {"method": method, "budget": None if method == "off" else 1024, "commit": commit, "gpu": "GPU-a",
                "counts": {"passkey@16000": {"correct": n - len(failed), "n": n, "failed": failed}}}

    runs = [run("off", "c1", [0], 50), run("lychee", "c1", [1, 45], 50), run("quest", "c1", [2], 44)]
    got = one_call(runs, "off", "lychee", "quest")
    # the seeds all three served (the deadline cut Quest at 44): lychee's failure at seed 45 falls outside them
    assert {m: r["counts"]["passkey@16000"]["correct"] for m, r in got.items()} == {"off": 43, "lychee": 43,
                                                                                    "quest": 43}
    assert one_call(runs[:2] + [run("quest", "c2", [2], 50)], "off", "lychee", "quest") is None   # another call
    assert one_call(runs[:2], "off", "lychee", "quest") is None
