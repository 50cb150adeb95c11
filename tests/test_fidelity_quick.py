"""The fidelity suite's quick mode, through the real server (CPU, SmolLM2): every method runs every task and
the sparse ones really read a fraction of the KV."""

import concurrent.futures
import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.server import run_driver

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.e2e


def test_quick_mode(tmp_path, smollm2_dir):
    out = tmp_path / "quick.json"
    p = run_driver([sys.executable, "-m", "bench.fidelity", "--quick", "--model-dir", smollm2_dir, "--out", str(out)],
                   timeout=1800, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    runs = {r["method"]: r for r in res["runs"]}
    assert set(runs) == {"off", "lychee"}
    for r in runs.values():
        assert set(r["scores"]) == {"passkey@1000", "niah_multikey@1000", "json_value@1000"}
        assert all(0.0 <= v <= 1.0 for v in r["scores"].values())
        for cell, c in r["counts"].items():   # every cell carries its sample count and interval
            assert c["n"] == 2 and c["correct"] / c["n"] == r["scores"][cell]
            assert c["ci95"][0] <= r["scores"][cell] <= c["ci95"][1]
            assert len(c["failed"]) == c["n"] - c["correct"] and set(c["failed"]) <= {0, 1}
            assert len(c["digests"]) == c["n"]
            # how firmly each right answer was written: one entry per right seed, a gap between two log-probs
            assert set(c["held_by"]) == {str(seed) for seed in range(c["n"]) if seed not in c["failed"]}
            assert all(m is None or m >= 0 for m in c["held_by"].values())
    # what the runner measures, not what a 135M model answers (accuracy claims live in the committed results)
    assert runs["off"]["kv_read"] == 1.0
    assert runs["lychee"]["kv_read"] < 0.5   # decode really was sparse


@pytest.mark.parametrize("correct,n,lo,hi", [(5, 10, 0.2366, 0.7634), (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0),
                                              (45, 50, 0.7864, 0.9565)])
def test_wilson_interval(correct, n, lo, hi):
    from bench.fidelity import wilson

    got = wilson(correct, n)
    assert got == pytest.approx([lo, hi], abs=1e-4)


def test_same_answers_counts_matching_digests():
    from bench.fidelity import same_answers

    def res(runs):
        return {"runs": [{"method": m, "budget": b, "counts": {cell: {"digests": d} for cell, d in cells.items()}}
                         for (m, b), cells in runs.items()]}

    a = res({("lychee", 1024): {"passkey@16000": ["a", "b", "c"], "json_value@16000": ["x"]},
             ("off", None): {"passkey@16000": ["a"]}})
    b = res({("lychee", 1024): {"passkey@16000": ["a", "z", "c"], "json_value@16000": ["x"]},
             ("quest", 1024): {"passkey@16000": ["a"]}})
    assert same_answers(a, b) == {"lychee@1024": {"same": 3, "of": 4}}


def test_compare_counts_answers_shared_across_results_and_with_dense():
    from bench.fidelity import compare

    def res(runs):
        return {"runs": [{"method": m, "budget": b, "counts": {"passkey@2000": {"digests": d}}}
                         for (m, b), d in runs.items()]}

    tp1 = res({("off", None): ["a", "b", "c", "d"], ("lychee", 1024): ["a", "x", "c", "y"]})
    tp2 = res({("off", None): ["a", "b", "z", "d"], ("lychee", 1024): ["a", "x", "w", "d"]})
    got = compare(tp1, tp2, ("tp1", "tp2"))
    assert got["same_answers"] == {"lychee@1024": {"same": 2, "of": 4}, "off@None": {"same": 3, "of": 4}}
    assert got["same_as_dense"] == {"tp1": {"lychee@1024": {"same": 2, "of": 4}},
                                    "tp2": {"lychee@1024": {"same": 2, "of": 4}}}
    assert got["results"]["tp2"] is tp2


class WordTokenizer:
    """Words and punctuation marks as tokens: a tokenizer whose JSON-to-YAML ratio differs from SmolLM2's BPE."""

    def encode(self, text, add_special_tokens=False):
        return re.findall(r"\w+|[^\w\s]", text)


@pytest.mark.parametrize("n", [2000, 6000])
def test_task_prompts_hold_their_length(smollm2_tokenizer, n):
    """A cell labelled n tokens holds about n, whatever the tokenizer: YAML sized by a fixed ratio to JSON once
    overshot by 20% with Qwen's tokenizer (36K tokens for a 30K cell, past the model's 32K context)."""
    from bench.tasks import STRUCTURED, TASKS, make

    for task in TASKS:
        got = len(smollm2_tokenizer(make(task, smollm2_tokenizer, n, 0).prompt).input_ids)
        assert 0.9 * n <= got <= 1.1 * n, (task, n, got)
    words = WordTokenizer()
    for task in STRUCTURED:
        got = len(words.encode(make(task, words, n, 0).prompt))
        assert 0.9 * n <= got <= 1.1 * n, ("words", task, n, got)


@pytest.mark.parametrize("task", ["table_row", "log_lookup", "config_value", "json_list", "sql_insert",
                                  "call_chain"])
def test_held_out_families_ask_for_one_record_among_many_alike(smollm2_tokenizer, task):
    """Each held-out family's answer is one field of one record among dozens alike: the answer stands once in the
    prompt (a neighbour's value is a wrong answer), the sample is the same for the same seed and split, and the test
    split draws another sample from the same seed."""
    from bench.tasks import HELD_OUT, make

    assert task in HELD_OUT
    x = make(task, smollm2_tokenizer, 3000, 7, split="test")
    assert x.expected and all(x.prompt.count(e) == 1 for e in x.expected)
    assert x.prompt.count("\n") >= 40   # dozens of records, each a line or more
    assert x == make(task, smollm2_tokenizer, 3000, 7, split="test")
    assert make(task, smollm2_tokenizer, 3000, 7).prompt != x.prompt   # the dev split's sample of seed 7
    assert x.score(f" {x.expected[0]}.") and not x.score(" 1" + x.expected[0])


def test_held_out_families_serve_on_the_test_split_only(smollm2_dir):
    """No default may be chosen on a held-out family: the harness serves them on the test split alone, and a test
    split's runs never join a dev file (other samples)."""
    from bench import fidelity

    with pytest.raises(ValueError, match="held-out task families are served on the test split only"):
        fidelity.run("smollm2", smollm2_dir, ["off"], [256], ["passkey", "sql_insert"], [300], 1)
    with pytest.raises(ValueError, match="split 'holdout'"):
        fidelity.run("smollm2", smollm2_dir, ["off"], [256], ["passkey"], [300], 1, split="holdout")
    dev = {"model": "smollm2", "lengths": [300], "runs": []}   # a file from before the split: dev samples
    with pytest.raises(ValueError, match="split test against the file's dev"):
        fidelity.append({**dev, "split": "test", "device": "d", "samples": 1, "tasks": []}, dev)


def test_extend_joins_two_runs_over_consecutive_seeds():
    from bench.fidelity import extend

    def run(seeds, failed, digests, kv, seconds):
        """Passkey right but for ``failed``, JSON value wrong on every seed."""
        return {"method": "lychee", "budget": 1024, "kv_read": kv, "seconds": seconds, "scores": {},
                "counts": {"passkey@30000": {"correct": len(seeds) - len(failed), "n": len(seeds), "ci95": [0, 1],
                                             "failed": failed, "digests": digests},
                           "json_value@30000": {"correct": 0, "n": len(seeds), "ci95": [0, 1], "failed": list(seeds),
                                                "digests": digests}}}

    a = run(range(0, 2), [1], ["a", "b"], 0.03, 10.0)
    b = run(range(2, 5), [], ["c", "d", "e"], 0.04, 20.0)
    a["counts"]["passkey@30000"]["held_by"], b["counts"]["passkey@30000"]["held_by"] = {"0": 1.0}, {"3": 2.0}
    got = extend(a, b)
    assert got["counts"]["passkey@30000"]["held_by"] == {"0": 1.0, "3": 2.0}
    assert "held_by" not in got["counts"]["json_value@30000"]   # runs from before it
    cell = got["counts"]["passkey@30000"]
    assert (cell["correct"], cell["n"], cell["failed"], cell["digests"]) == (4, 5, [1], ["a", "b", "c", "d", "e"])
    assert got["counts"]["json_value@30000"]["failed"] == [0, 1, 2, 3, 4]
    assert cell["ci95"] == pytest.approx([0.3755, 0.9638], abs=1e-4)
    assert got["scores"] == {"passkey@30000": 0.8, "json_value@30000": 0.0}
    assert got["passkey"] == 0.8 and got["structured"] == 0.0
    assert got["samples"] == 5 and got["seconds"] == 30.0 and got["kv_read"] == pytest.approx(0.036)
    with pytest.raises(AssertionError):
        extend(a, {**b, "method": "off"})


class StartedServer:
    """bench.fidelity's Server, faked: already started (``proc`` set, so Lineup launches nothing), no counters."""
    proc = object()

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def stats(self):
        return {}


def test_run_scores_each_cell_from_one_queue_of_every_cells_samples(monkeypatch, smollm2_dir, smollm2_tokenizer):
    """bench.fidelity.run with a fake server that answers right on chosen (task, seed): each cell gets its own
    samples' answers back, though all of them were asked in one queue, several in flight."""
    from bench import fidelity
    from bench.tasks import make

    right = {("passkey", 0), ("passkey", 2), ("niah_single", 1)}
    asked = {make(t, smollm2_tokenizer, 300, seed).prompt: (t, seed) for t in ("passkey", "niah_single")
             for seed in range(3)}

    class FakeServer(StartedServer):
        def complete(self, prompt, max_tokens, logprobs=None):
            task, seed = asked[prompt]
            sample = make(task, smollm2_tokenizer, 300, seed)
            text = " ".join(sample.expected) if (task, seed) in right else " no idea"
            top = {"a": -0.1, "b": -0.1 - (seed + 1)}   # a gap of seed + 1 at every token
            return {"choices": [{"text": text, "logprobs": {"tokens": [text], "top_logprobs": [top]}}]}

    monkeypatch.setattr(fidelity, "Server", FakeServer)
    res = fidelity.run("smollm2", smollm2_dir, ["off"], [256], ["passkey", "niah_single"], [300], 3,
                       concurrency=4)
    counts = res["runs"][0]["counts"]
    assert counts["passkey@300"]["failed"] == [1] and counts["niah_single@300"]["failed"] == [0, 2]
    assert fidelity.brief(res["runs"][0]) == {"method": "off", "budget": None, "total": 3, "of": 6,
                                              "right": {"passkey@300": 2, "niah_single@300": 1}, "kv_read": 1.0,
                                              "seconds": res["runs"][0]["seconds"], "cuda_graph": False}
    assert counts["passkey@300"]["held_by"] == {"0": 1.0, "2": 3.0}
    assert counts["niah_single@300"]["held_by"] == {"1": 2.0}


def test_deadline_keeps_the_seeds_every_task_finished(monkeypatch, smollm2_dir, smollm2_tokenizer):
    """At the deadline no more samples are sent: the run keeps the first seeds every task answered (the requests in
    flight then finish), says how many, and the next server is not started."""
    from bench import fidelity
    from bench.tasks import make

    drawn = {(t, 300, seed): make(t, smollm2_tokenizer, 300, seed) for t in ("passkey", "niah_single")
             for seed in range(5)}
    asked = {x.prompt: key[2] for key, x in drawn.items()}
    started, sent = [], []
    # seed 2 of both tasks is in flight (concurrency 2) when the deadline comes, and ends only once the samples not
    # sent yet (seeds 3 and 4 of both tasks) are cancelled: whatever the machine's speed, those are never sent
    cancel, cancelled, dropped = concurrent.futures.Future.cancel, [], threading.Event()

    def counting_cancel(future):
        if (done := cancel(future)) and len(cancelled) < 4:
            cancelled.append(future)
            if len(cancelled) == 4:
                dropped.set()
        return done

    class FakeServer(StartedServer):
        def __init__(self, model_dir, method, cfg, **kwargs):
            started.append(method)

        def complete(self, prompt, max_tokens, logprobs=None):
            sent.append(asked[prompt])
            if asked[prompt] >= 2:
                assert dropped.wait(60)
            return {"choices": [{"text": " no idea", "logprobs": {"tokens": [], "top_logprobs": []}}]}

    monkeypatch.setattr(concurrent.futures.Future, "cancel", counting_cancel)
    monkeypatch.setattr(fidelity, "Server", FakeServer)
    # drawn already: the second before the deadline is the serving's, not the tokenizer's on a busy machine
    monkeypatch.setattr(fidelity, "make_all", lambda model_dir, keys, workers, split: {k: drawn[k] for k in keys})
    res = fidelity.run("smollm2", smollm2_dir, ["off", "lychee"], [256], ["passkey", "niah_single"], [300], 5,
                       concurrency=2, deadline=time.time() + 1.0)
    assert sorted(sent) == [0, 0, 1, 1, 2, 2]   # seeds 3 and 4 were never sent
    assert [r["method"] for r in res["runs"]] == ["off"] and res["runs"][0]["samples"] == 3
    assert {c["n"] for c in res["runs"][0]["counts"].values()} == {3}
    assert res["runs"][0]["counts"]["passkey@300"]["failed"] == [0, 1, 2]
    assert fidelity.append(res, {**res, "runs": []}, commit="c", gpu="g", note="n")["runs"][0]["samples"] == 3


def test_a_cell_word_with_a_seed_serves_the_rest_of_a_cut_run_and_append_joins_it(monkeypatch, smollm2_dir,
                                                                                   smollm2_tokenizer):
    """``NAME@BUDGET:SEED``: that cell serves seeds SEED .. --samples - 1 beside a cell from seed 0 in the same call
    (failed seeds numbered as served), a cell already served to --samples starts no server, and ``append`` joins
    each run from where it starts: the cut one to the file's run over seeds 0 .. SEED - 1, the whole one as it is."""
    from bench import fidelity
    from bench.tasks import make

    asked = {make("passkey", smollm2_tokenizer, 300, seed).prompt: seed for seed in range(4)}
    started, sent = [], []

    class FakeServer(StartedServer):
        def __init__(self, model_dir, method, cfg, **kwargs):
            self.method = method
            started.append((method, cfg and cfg["token_budget"]))

        def complete(self, prompt, max_tokens, logprobs=None):
            sent.append((self.method, asked[prompt]))
            text = " no idea" if asked[prompt] % 2 else " ".join(make("passkey", smollm2_tokenizer, 300,
                                                                      asked[prompt]).expected)
            return {"choices": [{"text": text, "logprobs": {"tokens": [text], "top_logprobs": [{}]}}]}

    monkeypatch.setattr(fidelity, "Server", FakeServer)
    res = fidelity.run("smollm2", smollm2_dir, ["off", "lychee@256:2", "quest@256:4"], [1024], ["passkey"], [300], 4)
    assert started == [("off", None), ("lychee", 256)]   # quest at 256 already has seeds 0-3
    assert sorted(sent) == [("lychee", 2), ("lychee", 3)] + [("off", s) for s in range(4)]
    off, lychee = res["runs"]
    assert "first_seed" not in off and "samples" not in off and off["counts"]["passkey@300"]["failed"] == [1, 3]
    assert (lychee["first_seed"], lychee["samples"]) == (2, 2)
    got = lychee["counts"]["passkey@300"]
    assert got["failed"] == [3] and got["held_by"].keys() == {"2"}   # seeds numbered as served, not from 0
    cut = {**lychee, "counts": {"passkey@300": {"correct": 1, "n": 2, "failed": [0], "digests": ["x", "y"]}},
           "samples": 2, "commit": "aaa"}
    del cut["first_seed"]
    merged = fidelity.append(res, {**res, "runs": [cut]}, commit="bbb", gpu="GPU-1", note="n")
    assert [(r["method"], r["samples"]) for r in merged["runs"]] == [("lychee", 2), ("off", 4), ("lychee", 4)]
    assert merged["runs"][2]["counts"]["passkey@300"]["failed"] == [0, 3] and "first_seed" not in merged["runs"][2]
    for word in ("lychee:3", "lychee@256:x", "lychee@256:"):
        with pytest.raises(ValueError, match="METHOD@BUDGET:SEED"):
            fidelity.cell(word)


def test_after_starts_each_cell_where_the_earlier_calls_stopped_it(monkeypatch, smollm2_dir, smollm2_tokenizer):
    """``--after``: calls sent together continue one another. A cell starts at the seed after the last one any
    earlier call served of it (the later of two calls, a ``NAME@BUDGET:SEED`` word's seed where that is later),
    a cell they served to --samples starts no server, a cell they never served starts at its own seed, and
    ``append`` joins the runs in the order the calls ran."""
    from bench import fidelity
    from bench.tasks import make

    asked = {make("passkey", smollm2_tokenizer, 300, seed).prompt: seed for seed in range(6)}
    sent = []

    class FakeServer(StartedServer):
        def __init__(self, model_dir, method, cfg, **kwargs):
            self.key = (method, cfg and cfg["token_budget"])

        def complete(self, prompt, max_tokens, logprobs=None):
            sent.append((*self.key, asked[prompt]))
            return {"choices": [{"text": " no idea", "logprobs": {"tokens": [], "top_logprobs": []}}]}

    monkeypatch.setattr(fidelity, "Server", FakeServer)
    one = dict(model="smollm2", model_dir=smollm2_dir, tasks=["passkey"], lengths=[300])
    first = fidelity.run(methods=["lychee@256", "quest@256"], budgets=[1024], samples=2, **one)
    second = fidelity.run(methods=["lychee@256", "quest@256:1"], budgets=[1024], samples=6,
                          after=fidelity.ends([first]), **one)
    assert [(r["method"], r["first_seed"]) for r in second["runs"]] == [("lychee", 2), ("quest", 2)]
    sent.clear()
    third = fidelity.run(methods=["lychee@256:4", "quest@256", "lychee@512"], budgets=[1024], samples=6,
                         after=fidelity.ends([first, second]), **one)
    assert sorted(sent) == [("lychee", 512, s) for s in range(6)]   # both 256 cells already had seeds 0-5
    assert [(r["method"], r["budget"], r.get("first_seed", 0)) for r in third["runs"]] == [("lychee", 512, 0)]
    merged = {**first, "runs": []}
    for res in (first, second):
        merged = fidelity.append(res, merged, commit="c", gpu="g", note="n")
    assert [(r["method"], fidelity.per_task(r)) for r in merged["runs"][-2:]] == [("lychee", 6), ("quest", 6)]


def test_methods_name_whole_sweeps_or_single_cells(monkeypatch, smollm2_dir):
    """``--methods`` words: a method runs at every budget, ``NAME@BUDGET`` at that one alone; bad words are refused
    when the flags are read, before any server starts."""
    from bench import fidelity

    started = []

    class FakeServer(StartedServer):
        def __init__(self, model_dir, method, cfg, **kwargs):
            started.append((method, cfg and cfg["token_budget"], cfg and cfg.get("chunking")))

    monkeypatch.setattr(fidelity, "Server", FakeServer)
    res = fidelity.run("smollm2", smollm2_dir, ["off", "lychee-fixed@512", "lychee"], [256, 1024], [], [300], 1)
    assert started == [("off", None, None), ("lychee", 512, "fixed"), ("lychee", 256, None), ("lychee", 1024, None)]
    assert [(r["method"], r["budget"]) for r in res["runs"]] == [
        ("off", None), ("lychee-fixed", 512), ("lychee", 256), ("lychee", 1024)]
    for word in ("off@512", "lychee@big", "dense"):
        with pytest.raises(ValueError, match="METHOD@BUDGET"):
            fidelity.cell(word)


def test_held_by_is_the_smallest_top_two_gap_up_to_the_answers_end():
    """Brute force over hand-made log-probabilities: the gaps after the answer (a near tie in the chatter after it)
    and a collapsed entry (two top tokens of one text) do not count; a wrong answer has none."""
    from bench.fidelity import held_by
    from bench.tasks import Sample

    tokens = [" VAR", " A", ",", " VAR", " B", ".", " Then"]
    gaps = [2.0, 0.9, 3.0, 1.5, 0.7, 0.01, 0.02]
    top = [{"x": -0.1, "y": -0.1 - g} for g in gaps]
    top[1] = {" A": -0.2}   # one entry: its gap is unknown
    choice = {"logprobs": {"tokens": tokens, "top_logprobs": top}}
    assert held_by(Sample("t", "", ["VAR A", "VAR B"]), choice) == 0.7
    assert held_by(Sample("t", "", ["VAR A"]), choice) == 2.0   # the answer ends at token 2
    assert held_by(Sample("t", "", ["VAR A", "VAR C"]), choice) is None
    brute = min(g for i, g in enumerate(gaps[:5]) if i != 1)
    assert held_by(Sample("t", "", ["B"]), choice) == brute


def test_lost_firm_counts_the_lost_answers_dense_held_firmly():
    from bench.fidelity import FIRM, lost_firm

    def cell(failed, held=None, n=4):
        return {"correct": n - len(failed), "n": n, "failed": failed,
                **({"held_by": held} if held is not None else {})}

    dense = {"a@1": cell([3], {"0": FIRM + 1, "1": FIRM / 10, "2": None}),
             "b@1": cell([], {str(i): 5.0 for i in range(4)})}
    run = {"a@1": cell([0, 1, 2, 3]), "b@1": cell([2])}
    assert lost_firm(dense, run) == 2   # a: seed 0 firm, 1 a near tie, 2 unknown; b: seed 2
    assert lost_firm({"a@1": cell([3])}, run) is None   # a dense run from before held_by


def test_paired_counts_and_sign_test():
    from bench.fidelity import paired, sign_test

    def cell(failed, n=5):
        return {"correct": n - len(failed), "n": n, "failed": failed}

    dense = {"a@1": cell([0, 1]), "b@1": cell([4]), "c@1": cell([0], n=3)}
    run = {"a@1": cell([1, 2, 3]), "b@1": cell([]), "c@1": cell([1, 2])}   # c: other samples, not compared
    assert paired(dense, run) == (2, 2)       # a: lost seeds 2, 3, gained 0; b: gained 4; c: other seeds
    assert sign_test(2, 2) == 1.0 and sign_test(0, 0) == 1.0
    assert sign_test(5, 0) == pytest.approx(0.0625)
    assert sign_test(29, 13) == pytest.approx(0.01952, abs=1e-5)
    assert sign_test(29, 13) == sign_test(13, 29)


def test_append_labels_runs_and_refuses_other_samples():
    """A device call's runs join a committed file labelled with where they ran; a call at another length (the same
    seeds, other samples) is refused instead of being paired with the file's dense run."""
    from bench.fidelity import append

    def result(length, methods):
        return {"model": "qwen2.5-coder-0.5b", "lengths": [length], "device": "NVIDIA H200", "samples": 50,
                "tasks": ["passkey"], "runs": [{"method": m, "counts": {f"passkey@{length}": {}}} for m in methods]}

    committed = {k: v for k, v in result(16000, ["off"]).items() if k not in ("device", "samples", "tasks")}
    merged = append(result(16000, ["lychee"]), committed, commit="abc1234", gpu="GPU-1", note="why")
    assert [r["method"] for r in merged["runs"]] == ["off", "lychee"] and "servers_alongside" not in merged["runs"][1]
    beside = append({**result(16000, ["lychee"]), "servers_alongside": 2}, committed, commit="c", gpu="g", note="n")
    assert beside["runs"][1]["servers_alongside"] == 2   # how many servers shared the card: its seconds' meaning
    assert len(committed["runs"]) == 1   # the committed result itself is left as it was
    labels = {"device": "NVIDIA H200", "samples": 50, "tasks": ["passkey"], "commit": "abc1234", "gpu": "GPU-1",
              "note": "why"}
    assert {k: merged["runs"][1][k] for k in labels} == labels
    with pytest.raises(ValueError, match=r"lengths \[16384\] against the file's \[16000\]"):
        append(result(16384, ["lychee"]), committed, commit="abc1234", gpu="GPU-1", note="why")


def test_append_joins_a_result_that_starts_past_seed_zero_to_the_run_it_continues():
    """The rest of a run a deadline cut (``--first 2``) is joined to the file's run over seeds 0-1, which stays; with
    no such run it is refused rather than paired with the dense run's first seeds."""
    from bench.fidelity import append

    def run(seeds, failed, **labels):
        return {"method": "lychee", "budget": 1024, "kv_read": 0.06, "seconds": 10.0, "scores": {}, **labels,
                "counts": {"passkey@16000": {"correct": len(seeds) - len(failed), "n": len(seeds), "ci95": [0, 1],
                                             "failed": failed, "digests": [str(s) for s in seeds]}}}

    cut = run(range(2), [1], commit="aaa", gpu="GPU-1", device="H200", samples=2, note="cut")
    committed = {"model": "m", "lengths": [16000], "runs": [cut]}
    rest = {"model": "m", "lengths": [16000], "device": "H200", "samples": 3, "first_seed": 2, "tasks": ["passkey"],
            "runs": [run(range(2, 5), [3])]}
    merged = append(rest, committed, commit="bbb", gpu="GPU-2", note="the rest")
    assert merged["runs"][0] is cut and len(merged["runs"]) == 2
    both = merged["runs"][1]
    assert both["counts"]["passkey@16000"]["failed"] == [1, 3] and both["samples"] == 5
    assert (both["commit"], both["gpu"], both["device"]) == ("aaa + bbb", "GPU-1 + GPU-2", "H200")
    assert both["note"] == "seeds 0-1 from the run of aaa; the rest: the rest"
    with pytest.raises(ValueError, match="no run of it over seeds 0-2"):
        append({**rest, "first_seed": 3}, committed, commit="bbb", gpu="GPU-2", note="the rest")


def test_results_are_written_with_each_list_of_plain_values_on_one_line():
    """bench.fidelity.dumps: the same JSON back, nested objects one key per line, a sample list on one line."""
    from bench.fidelity import dumps

    res = {"runs": [{"counts": {"passkey@300": {"failed": [1, 4], "held_by": {"0": 0.5}, "ci95": [0.1, 0.9]}}}],
           "lengths": [300], "note": "a, b", "empty": [], "none": None}
    text = dumps(res)
    assert json.loads(text) == res
    assert '     "failed": [1, 4],' in text.splitlines() and ' "empty": [],' in text.splitlines()


@pytest.mark.parametrize("name", ["quest", "quest-graphs"])
@pytest.mark.parametrize("reduce", ["max", "mean"])
@pytest.mark.parametrize("budget", [16, 160, 1000])
def test_quest_policy_selects_the_pages_quest_selects(name, reduce, budget):
    """quest, a selection policy of the one lifecycle (``SparseKVConfig.quest_policy``), and bench.fidelity's
    quest-graphs (the lychee config that served Quest through the pools before quest did): over 16-token chunks the
    index ranks every chunk by Quest's bound on the chunk's key box, so it selects the pages Quest selects (top
    budget // page_size, ``select.select_pages``) from the same (stored) key bounds, at any budget and GQA
    reduction."""
    import torch
    import torch.nn.functional as F

    from bench.fidelity import METHODS
    from sgl_sparsekv.config import SparseKVConfig
    from sgl_sparsekv.index import build_index
    from sgl_sparsekv.select import select_chunks, select_pages

    method, extra = METHODS[name]
    cfg = SparseKVConfig.from_method(method, extra)
    gen = torch.Generator().manual_seed(budget)
    H, M, d, G, page = 2, 200, 32, 4, SparseKVConfig.from_method("quest").page_size
    assert cfg.chunking == "fixed" and cfg.chunk_max == page
    toks = torch.randn(H, M, page, d, generator=gen) + 2 * torch.randn(H, M, 1, d, generator=gen)
    boxes = torch.stack([toks.amin(2), toks.amax(2)], 2)                           # [H, M, 2, d] lo, hi
    ix = build_index(F.normalize(toks.mean(2), dim=-1), torch.full((M,), page), cfg.fine_cluster_size,
                     cfg.max_coarse, cfg.kmeans_iters, boxes)
    # Quest reads the bounds the pools store (the box rounded outward to bf16), page by page in chunk order
    box = ix.fine_box.gather(1, ix.chunk_fine[..., None, None].expand(-1, -1, 2, d))
    lo, hi = box[..., 0, :] - box[..., 1, :], box[..., 0, :] + box[..., 1, :]
    q = torch.randn(H, G, d, generator=gen)
    ours = select_chunks(ix, q, budget, cfg.coarse_expand, reduce, cfg.radius_weight)
    assert torch.equal(ours, select_pages(q, lo, hi, budget, page, reduce))
    assert ours.sum(1).tolist() == [budget // page] * H


@pytest.mark.parametrize("name", ["lychee-flat", "lychee"])
def test_budget_256_ranks_every_fine_cluster_of_a_30k_prompt(name):
    """At budget 256 (176 tokens past sink and window) on a 30K-token index, bench.fidelity's lychee-flat and the
    default (its coarse_expand_min floor) expand every coarse unit, so they take the fine clusters in the order of
    their own bounds over the whole prompt; coarse_expand alone would expand units holding 32 x 176 tokens."""
    import torch
    import torch.nn.functional as F

    from bench.fidelity import METHODS
    from sgl_sparsekv.config import SparseKVConfig
    from sgl_sparsekv.index import build_index, upper_bound
    from sgl_sparsekv.select import select_clusters

    method, extra = METHODS[name]
    cfg = SparseKVConfig.from_method(method, {"token_budget": 256, **extra})
    retrieved = cfg.token_budget - cfg.sink_tokens - cfg.recent_window
    gen = torch.Generator().manual_seed(0)
    H, M, d, G = 2, 2000, 32, 4
    ix = build_index(F.normalize(torch.randn(H, M, d, generator=gen), dim=-1), torch.full((M,), 15),
                     cfg.fine_cluster_size, cfg.max_coarse, cfg.kmeans_iters)
    q = torch.randn(H, G, d, generator=gen)
    ours = select_clusters(ix, q, retrieved, cfg.expansion(retrieved), cfg.gqa_reduce, cfg.radius_weight)
    bound = upper_bound(q, ix.fine_mu, cfg.radius_weight * ix.fine_r, cfg.gqa_reduce)
    for h in range(H):
        order = torch.sort(bound[h], descending=True, stable=True).indices
        taken = order[torch.cumsum(ix.fine_tokens[h, order], 0) <= retrieved]
        assert sorted(ours[h].nonzero().flatten().tolist()) == sorted(taken.tolist())


def test_stretched_model_is_read_by_sglang_as_yarn_at_factor_times_its_context(tmp_path, smollm2_dir):
    """``--rope-scale``'s model: a sibling directory whose config SGLang reads as YaRN over the trained length, at
    twice the context, every other file linked; a model already stretched, or a factor of 1, is refused."""
    from transformers import AutoConfig

    from sglang.srt.utils.hf_transformers.common import get_context_length, get_rope_config
    from sgl_sparsekv.models import stretched

    src = tmp_path / "smollm2"
    src.mkdir()
    for f in Path(smollm2_dir).iterdir():
        if f.name == "config.json":
            (src / f.name).write_text(f.read_text())
        else:
            (src / f.name).symlink_to(f)
    trained = json.loads((src / "config.json").read_text())["max_position_embeddings"]
    out = stretched(src, 2)
    assert out == tmp_path / "smollm2-yarn2" and (out / "config.json").read_text() != (src / "config.json").read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    assert (out / "tokenizer.json").resolve() == (Path(smollm2_dir) / "tokenizer.json").resolve()
    cfg = AutoConfig.from_pretrained(out)
    theta, rope = get_rope_config(cfg)
    assert get_context_length(cfg) == 2 * trained
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 2, trained)
    assert theta == get_rope_config(AutoConfig.from_pretrained(src))[0]
    assert stretched(src, 2) == out   # again: the same directory, nothing left from before in the way
    with pytest.raises(SystemExit, match="already 'yarn'"):
        stretched(out, 2)
    with pytest.raises(SystemExit, match="above 1"):
        stretched(src, 1)


def test_a_stretched_run_serves_at_factor_times_the_context_and_keeps_to_its_own_file(monkeypatch, smollm2_dir):
    """``rope_scale``: every server's context is that many times the model's, the result says so, and its runs are
    refused by a file of the model as trained (other answers of other positions)."""
    from bench import fidelity

    started = []

    class FakeServer(StartedServer):
        def __init__(self, *args, extra=(), **kwargs):
            started.append(list(extra))

        def complete(self, prompt, max_tokens, logprobs=None):
            return {"choices": [{"text": "no", "logprobs": {"tokens": ["no"], "top_logprobs": [{"no": -0.1}]}}]}

    monkeypatch.setattr(fidelity, "Server", FakeServer)
    res = fidelity.run("smollm2", smollm2_dir, ["off"], [256], ["passkey"], [300], 1, rope_scale=2)
    ctx = started[0][started[0].index("--context-length") + 1]
    assert ctx == str(2 * fidelity.CONTEXT["smollm2"]) and res["rope_scale"] == 2
    plain = fidelity.run("smollm2", smollm2_dir, ["off"], [256], ["passkey"], [300], 1)
    assert "rope_scale" not in plain
    assert started[1][started[1].index("--context-length") + 1] == str(fidelity.CONTEXT["smollm2"])
    with pytest.raises(ValueError, match="RoPE stretched 2 times against the file's 1"):
        fidelity.append(res, plain, commit="c", gpu="g", note="n")


def test_samples_drawn_in_worker_processes_are_the_ones_drawn_here(smollm2_dir, smollm2_tokenizer):
    """``make_all`` over two spawned workers gives every (task, length, seed) the sample ``make`` draws here."""
    from bench.tasks import make, make_all

    keys = [(t, n, s) for t in ("passkey", "json_value", "variable_tracking") for n in (400, 900) for s in (0, 3)]
    here = {(t, n, s): make(t, smollm2_tokenizer, n, s) for t, n, s in keys}
    assert make_all(smollm2_dir, keys, workers=2) == here == make_all(smollm2_dir, keys)
    assert len({x.prompt for x in here.values()}) == len(keys)
