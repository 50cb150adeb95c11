"""End to end through the real SGLang HTTP server on CPU with SmolLM2-135M: off vs lychee vs quest.

Budget 256, so contexts of 1.5K-2.5K tokens really decode sparsely. Every check is deterministic: the
plugin's counters, the radix cache's reuse, exact token equality below the budget (the same kernels
run), and the state after traffic. Whether a 135M model's sparse answer to a long prompt matches its
dense one is an accuracy question: it lives in the benchmarks (bench/fidelity.py), not here, where one borderline
greedy token would make CI flaky.
"""

import time

import numpy as np
import pytest
import requests

from bench.server import Lineup, Server
from bench.tasks import passkey
from sgl_sparsekv.chunking import BoundaryTable, Chunker

pytestmark = pytest.mark.e2e

BUDGET = {"token_budget": 256}
PASSKEY_LEN = 2000   # the budget is 13% of it
DECODE_TOKENS = 8
# each server's KV pool: room for every prompt of the suite (about 20K tokens), and no more: a CPU server takes
# about 3 GB beside its pool (46 KB a token in fp32), and CI's 24 GB hold this module's two beside the quick
# fidelity run's two
POOL = "32768"
SHORT_PROMPTS = [
    "Write a haiku about the sea.",
    "List three colors:",
    "def fibonacci(n):",
    "The capital of France is",
]


def fork_program():
    import sglang as sgl

    @sgl.function
    def ask_all(s, doc, questions):
        s += doc
        forks = s.fork(len(questions))
        for f, q in zip(forks, questions):
            f += q + sgl.gen("answer", max_tokens=8, temperature=0)
        s["answers"] = [f["answer"] for f in forks]

    return ask_all


def fork_doc(tok, n_tokens=1500):
    """A long document shared by every fork, and one question per fork (phrasings the model handles)."""
    prompt, _ = passkey(tok, n_tokens, 0.6, seed=3)
    doc = prompt.split("\nWhat is the pass key?")[0]
    questions = ["\nWhat is the pass key? The pass key is", "\nRepeat the pass key. The pass key is",
                 "\nWhich number is the pass key? The pass key is"]
    return doc, questions


def run_suite(srv, tok):
    """Everything one server answers; compared across methods."""
    out = {"short": [], "state": srv.internal_state()}
    prompt, _ = passkey(tok, PASSKEY_LEN, 0.5, seed=11)
    before = srv.stats()
    long = srv.generate_ids(tok.encode(prompt), DECODE_TOKENS, ignore_eos=True)
    out["long"] = (long["meta_info"], before, srv.stats())
    for p in SHORT_PROMPTS:
        out["short"].append(srv.complete(p, max_tokens=24)["choices"][0]["text"])
    import sglang as sgl

    doc, questions = fork_doc(tok)
    srv.complete(doc, max_tokens=1)  # the document is cached before the forks arrive, whatever their timing
    sgl.set_default_backend(sgl.RuntimeEndpoint(srv.url))
    before = srv.stats()
    state = fork_program().run(doc=doc, questions=questions)
    out["fork_answers"] = state["answers"]
    out["fork_stats"] = (before, srv.stats())
    return out


# lychee: with the host KV tier (sgl_sparsekv/host_tier.py), its sparse layers keeping 256 tokens a request on the
# device in a window pool sized for the 8 requests it can run (--max-running-requests 8) with prefill chunks of 256:
# WINDOW_SLOTS, fewer than the suite's prompts hold together, so SGLang frees window slots as the suite goes, and its
# sparse decode reading hot buffers (one set a request it can run); the plain pools serve lychee in the data-parallel
# server (whose tokens the tier's must equal), the stress run and the GPU tests. Both with the live recall audit
# measuring every second decode step past the budget. The options (hybrid heads, the two-stage selection,
# select_ahead, fine_bound box) change what a step selects, not how the server runs it: the one lifecycle runs them
# against its spec in tests/test_pooled_decode.py, on the GPU in CUDA graphs too, and a CPU server of its own costs
# CI about two minutes each
TIER = {"host_tier": True, "host_window": 256}
SPARSE = {"lychee": ("lychee", {**TIER, "recall_audit_every": 2}), "quest": ("quest", {"recall_audit_every": 2})}
EXTRA = {"lychee": ["--chunked-prefill-size", "256", "--max-running-requests", "8"], "quest": []}
# each request's window, last prefill chunk, the 128 tokens SGLang decodes between freeing slots out of the window
# and 2 pages, and 2 chunks in flight (host_tier.window_slots)
WINDOW_SLOTS = 8 * (256 + 256 + 128 + 2) + 2 * 256


def turns(request) -> list[str]:
    """The servers this module's selected tests use, in the order pytest runs them (a module-scoped parameter's
    tests run together): the data-parallel one, the dense reference, then the sparse ones."""
    keys = []
    for item in request.session.items:
        if item.module is not request.module:
            continue
        names = item.fixturenames
        used = ["dp"] if "dp_run" in names else []
        used += ["off"] if "reference" in names or "sparse" in names else []
        used += [item.callspec.params["sparse"]] if "sparse" in names else []
        keys += [k for k in used if k not in keys]
    return keys


def server(model_dir: str, key: str) -> Server:
    if key == "off":
        return Server(model_dir, "off", extra=["--max-total-tokens", POOL])
    if key == "dp":
        return Server(model_dir, "lychee", BUDGET, extra=["--dp-size", "2", "--max-total-tokens", "8192"])
    method, cfg = SPARSE[key]
    return Server(model_dir, method, {**BUDGET, **cfg},
                  extra=["--max-total-tokens", POOL, "--enable-metrics", *EXTRA[key]])


@pytest.fixture(scope="module")
def lineup(request, smollm2_dir):
    """The module's servers, started two at a time (bench.server.Lineup)."""
    with Lineup({key: server(smollm2_dir, key) for key in turns(request)}) as line:
        yield line


@pytest.fixture(scope="module")
def reference(lineup, smollm2_tokenizer):
    with lineup.take("off") as srv:
        out = run_suite(srv, smollm2_tokenizer)
        # shared prefix: the second request reports the first one's tokens as cached
        prompt, _ = passkey(smollm2_tokenizer, 2000, 0.3, seed=5)
        first = srv.complete(prompt, max_tokens=1)
        second = srv.complete(prompt.replace("What is the pass key?", "Tell me the pass key."), max_tokens=1)
        out["cached"] = (first["usage"], second["usage"])
        return out


def dp_prompt(tok) -> list[int]:
    prompt, _ = passkey(tok, 1500, 0.5, seed=13)
    return tok.encode("Data-parallel check. " + prompt)


@pytest.fixture(scope="module")
def dp_run(lineup, smollm2_tokenizer):
    """Three requests of one prompt through the data-parallel server (plain lychee in each replica), and each
    replica's counters before and after. First in turn: SGLang's data-parallel controller polls without sleeping,
    so it must not run beside the others."""
    with lineup.take("dp") as srv:
        def replicas():
            return sorted((s["sparse_kv_stats"] for s in srv.internal_states()), key=lambda st: st["dp_rank"])

        before = replicas()
        ids = dp_prompt(smollm2_tokenizer)
        outputs = [srv.generate_ids(ids, DECODE_TOKENS, ignore_eos=True)["output_ids"]
                   for _ in range(3)]   # round robin: replicas a, b, a
        return {"before": before, "after": replicas(), "outputs": outputs}


def test_data_parallel_replicas_keep_their_own_state(dp_run):
    """--dp-size 2: each replica runs its own sparse state behind SGLang's round-robin router, so a prompt is
    indexed once per replica it reaches and its index is reused only where the radix cache holds its prefix; the
    replicas, and the adopted index, decode the same tokens."""
    before, after = dp_run["before"], dp_run["after"]
    assert [st["dp_rank"] for st in before] == [0, 1]
    first, *others = dp_run["outputs"]
    assert len(first) == DECODE_TOKENS and all(o == first for o in others)
    delta = [{k: a[k] - b[k] for k in ("index_builds", "index_reused", "sparse_steps")} for a, b in zip(after, before)]
    assert sorted(d["index_builds"] for d in delta) == [1, 1]   # each replica clustered the prompt once
    assert sorted(d["index_reused"] for d in delta) == [0, 1]   # the third request found it cached on its replica
    assert all(d["sparse_steps"] >= 3 for d in delta)
    assert all(st["unit_refs_unaccounted"] == 0 for st in after)


def test_off_is_plain_sglang(reference):
    state = reference["state"]
    assert state["sparse_kv"] == "off" and state["sparse_kv_config"] == {"method": "off"}
    assert "sparse_kv_stats" not in state  # no sparse backend was built
    meta, _, _ = reference["long"]
    assert meta["completion_tokens"] == DECODE_TOKENS
    first, second = reference["cached"]
    assert second["prompt_tokens_details"]["cached_tokens"] >= 0.9 * first["prompt_tokens"]
    assert len(reference["fork_answers"]) == 3


@pytest.fixture(scope="module", params=list(SPARSE))
def sparse(request, lineup, smollm2_tokenizer, reference):
    method, _ = SPARSE[request.param]
    with lineup.take(request.param) as srv:
        out = run_suite(srv, smollm2_tokenizer)
        out["key"] = request.param
        yield method, srv, out


def test_config_reached_scheduler(sparse):
    method, srv, out = sparse
    state = out["state"]
    assert state["sparse_kv"] == method
    assert state["sparse_kv_config"]["token_budget"] == 256 and state["sparse_kv_config"]["method"] == method
    assert state["sparse_kv_config"]["recall_audit_every"] == 2
    assert "sparse_kv_stats" in state


def test_long_prompt_decodes_sparsely(sparse):
    """The long prompt's decode steps ran the sparse path and read at most the budget per layer and step."""
    method, srv, out = sparse
    meta, before, after = out["long"]
    S = meta["prompt_tokens"]
    assert meta["completion_tokens"] == DECODE_TOKENS and S > 2 * BUDGET["token_budget"]
    steps = after["sparse_steps"] - before["sparse_steps"]
    assert DECODE_TOKENS - 1 <= steps <= DECODE_TOKENS   # every decode step (the first token comes from prefill)
    # counted per sparse layer and step: each step's context is >= S, and each reads at most the budget
    attended = after["attended_tokens"] - before["attended_tokens"]
    context = after["context_tokens"] - before["context_tokens"]
    assert context >= steps * S
    # every step selected with its own query: none attended to its whole sequence, none reordered (select_ahead's)
    assert after["unselected_steps"] == before["unselected_steps"]
    assert after["own_order_steps"] == before["own_order_steps"]
    assert attended <= BUDGET["token_budget"] * context / S
    assert attended < 0.15 * context
    assert after["scored_tokens"] == before["scored_tokens"]   # no two-stage selection
    assert after["index_builds"] + after["index_reused"] > before["index_builds"] + before["index_reused"]


def test_host_tier_decodes_as_plain_pools(dp_run, sparse, smollm2_tokenizer):
    """The lychee server runs with the host tier: past the budget its greedy tokens equal plain lychee's (the
    data-parallel server's) on the same prompt, sent after the suite's traffic took the window pool's slots many
    times over; its sparse layers attended to hot buffers that loaded the selected chunks from the host pool and
    kept them across steps; the tier's gauges read from SGLang's allocator."""
    method, srv, out = sparse
    if out["key"] != "lychee":
        pytest.skip("the host tier runs on the lychee server")
    stats = srv.stats()
    served = srv.generate_ids(dp_prompt(smollm2_tokenizer), DECODE_TOKENS, ignore_eos=True)
    assert served["output_ids"] == dp_run["outputs"][0]
    after = srv.stats()
    assert after["hot_rows_loaded"] > stats["hot_rows_loaded"] and after["hot_rows_hit"] > stats["hot_rows_hit"]
    # per decoding request (at most --max-running-requests 8): 48 slots of 16 tokens and a ring of 256, every sparse
    # layer, K and V
    per_request = 2 * 28 * (48 * 16 + 256) * 3 * 64 * 4
    assert stats["hot_buffer_bytes"] % per_request == 0 and 8 <= stats["hot_buffer_bytes"] // per_request <= 9
    assert stats["window_slots"] == WINDOW_SLOTS < 3 * PASSKEY_LEN   # fewer than the suite's prompts need together
    assert 0 < stats["window_slots_used"] <= stats["window_slots"] and stats["host_rows_used"] >= PASSKEY_LEN
    assert stats["host_kv_bytes"] == 2 * 28 * (int(POOL) + 1) * 3 * 64 * 4   # 28 sparse layers, 3 KV heads, fp32 KV
    assert stats["host_to_device_bytes"] == stats["hot_rows_loaded"] * 2 * 64 * 4   # a row's key and value, fp32
    # the prefills' stages (chunks of 256) found earlier chunks of their prompts still in the window pool
    assert stats["staged_rows_near"] > 0 and stats["staged_rows_near"] + stats["staged_rows_far"] > PASSKEY_LEN


def test_idle_state_without_further_requests(sparse):
    """Once traffic ends the scheduler's idle pass applies the last frees: /server_info reads idle at once."""
    method, srv, _ = sparse
    deadline = time.time() + 10
    while (stats := srv.stats())["live_requests"] and time.time() < deadline:
        time.sleep(0.2)
    assert stats["live_requests"] == 0
    assert stats["unit_refs_unaccounted"] == 0


def test_metrics_endpoint_exports_counters(sparse):
    method, srv, _ = sparse
    text = requests.get(srv.url + "/metrics", timeout=30).text
    steps = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("sglang:sparse_kv_sparse_steps{")]
    assert steps and steps[0] >= 1, text[-2000:]
    assert "sglang:sparse_kv_dense_fallback_steps{" in text


def test_recall_audit_reports_the_mass_each_layer_group_kept(sparse):
    """Both servers audit every second decode step past the budget (lychee's through the host tier's hot buffers):
    /server_info holds, per layer group, how many (row, layer) values it measured and their mean and minimum share of
    dense attention's mass, and /metrics the same values as a histogram."""
    method, srv, out = sparse
    stats = srv.stats()
    groups = stats["recall_audit"]
    assert list(groups) == ["2-8", "9-15", "16-22", "23-29"]   # SmolLM2's 28 sparse layers in four groups
    assert stats["audited_steps"] >= 3   # the long prompt's 7 sparse steps alone hold 3 due ones
    for g in groups.values():
        assert g["samples"] >= 7 * stats["audited_steps"] // 4 and 0 < g["min"] <= g["mean"] <= 1 + 1e-5, groups
        assert sum(g["buckets"].values()) == g["samples"]
    # each reads 256 of about 2K tokens: some audited layer kept less than all of the mass
    assert min(g["min"] for g in groups.values()) < 0.999
    text = requests.get(srv.url + "/metrics", timeout=30).text
    counts = {line.split('layers="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("sglang:sparse_kv_recall_kept_mass_count{")}
    assert set(counts) == set(groups) and all(n >= 1 for n in counts.values()), text[-3000:]


def test_requests_choose_dense_or_their_own_budget(sparse, smollm2_tokenizer):
    """custom_params {"sparse_kv": "off"} decodes one request densely, {"sparse_kv": {"token_budget": N}} at its own
    budget, beside the server's default; a value the server cannot honour is refused with one line (HTTP 400)."""
    method, srv, out = sparse
    prompt, _ = passkey(smollm2_tokenizer, PASSKEY_LEN, 0.5, seed=21)
    ids = smollm2_tokenizer.encode(prompt)

    def generate(asked):
        return requests.post(srv.url + "/generate", timeout=900, json=dict(input_ids=ids, sampling_params=dict(
            max_new_tokens=6, temperature=0, ignore_eos=True, custom_params={"sparse_kv": asked})))

    for asked, per_step in (("off", None), ({"token_budget": 128}, 128)):
        before = srv.stats()
        r = generate(asked)
        r.raise_for_status()
        after = srv.stats()
        steps = after["sparse_steps"] - before["sparse_steps"]
        attended = after["attended_tokens"] - before["attended_tokens"]
        context = after["context_tokens"] - before["context_tokens"]
        assert 5 <= steps <= 6 and context >= steps * len(ids)   # as in test_long_prompt_decodes_sparsely
        if per_step is None:   # its whole context at every step, counted as asked for, not as a fallback
            assert attended == context
            assert after["requested_dense_steps"] - before["requested_dense_steps"] == steps
        else:
            assert attended == steps * per_step
        assert after["dense_fallback_steps"] == before["dense_fallback_steps"]
    bad = generate({"token_budget": 4096})
    assert bad.status_code == 400 and "token_budget 4096 is outside (80, 256]" in bad.text, bad.text


def test_short_prompts_exactly_dense(sparse, reference):
    """Below the budget attention is exactly dense: identical greedy tokens."""
    method, srv, out = sparse
    assert out["short"] == reference["short"]


def test_fork_program_matches_dense_and_reuses_document(sparse, reference, smollm2_tokenizer):
    """Requests sharing a prefix: the forks of one program arrive after the document was served and cached, and each
    adopts the document's units and index from the radix cache."""
    method, srv, out = sparse
    before, after = out["fork_stats"]
    doc, questions = fork_doc(smollm2_tokenizer)
    assert len(out["fork_answers"]) == len(questions)
    # the forks adopted the document's cluster index instead of clustering it once per fork
    assert after["index_reused"] - before["index_reused"] >= len(questions)
    assert after["index_builds"] == before["index_builds"]
    n_doc_units = len(smollm2_tokenizer.encode(doc)) // 16
    # each fork's prefill found the document's units in the radix cache instead of rebuilding them
    assert after["units_reused"] - before["units_reused"] >= len(questions) * n_doc_units * 0.9


def test_next_turn_reuses_decode_chunks(sparse, smollm2_dir, smollm2_tokenizer):
    """A finished turn's output stays in the radix cache; the next turn reuses the chunks grafted while
    decoding it (a chat history is indexed once, not per turn). The chunks cut at decode are keyed with the grafts,
    so the next turn reuses those up to the last graft and cuts the chunks of the final recent window again (the
    cached index ends at the last grafted chunk anyway). Quest's pages go through the same cuts, grafts and reuse
    with a fixed chunker (tests/test_radix_state.py runs both methods under random radix histories): its server
    skips it (a minute of CI's CPU)."""
    method, srv, out = sparse
    if method == "quest":
        pytest.skip("quest's pages are cut, grafted and reused by lychee's code with a fixed chunker")
    tok = smollm2_tokenizer
    prompt, _ = passkey(tok, 1500, 0.5, seed=8)
    ids = tok.encode("Multi-turn check. " + prompt)
    s0 = srv.stats()
    turn1 = srv.generate_ids(ids, 128, ignore_eos=True)
    out_ids = turn1["output_ids"]
    assert len(out_ids) == 128
    s1 = srv.stats()
    srv.generate_ids(ids + out_ids + tok.encode("\nAnd once more, the pass key is"), 4)
    s2 = srv.stats()
    chunker = Chunker("structure", 8, 16, BoundaryTable.from_tokenizer(tok, 49152))
    cached = np.array(ids + out_ids[:-1])  # the last sampled token has no KV yet
    n_prompt_units = len(chunker.cuts(np.array(ids)))
    n_all_units = len(chunker.cuts(cached))
    assert n_all_units - n_prompt_units >= 6  # the output itself spans several units
    reused = s2["units_reused"] - s1["units_reused"]
    grafted = s1["grafts"] - s0["grafts"]   # the output's chunks that left the recent window
    assert 4 <= grafted < n_all_units - n_prompt_units
    assert reused >= n_prompt_units + grafted
