"""End to end through the real SGLang HTTP server on CPU with SmolLM2-135M: off vs lychee vs quest.

Budget 256, so contexts of 2K-6K tokens really decode sparsely. The dense server runs first and
its answers are the reference for the sparse ones.
"""

import re

import numpy as np
import pytest

from bench.server import Server
from bench.tasks import passkey
from sgl_sparsekv.chunking import BoundaryTable, Chunker

pytestmark = pytest.mark.e2e

BUDGET = {"token_budget": 256}
DEPTHS = (0.1, 0.5, 0.9)
PASSKEY_LEN = 3000
SHORT_PROMPTS = [
    "Write a haiku about the sea.",
    "List three colors:",
    "def fibonacci(n):",
    "The capital of France is",
]


def number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


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


def fork_doc(tok, n_tokens=2500):
    """A long document shared by every fork, and one question per fork (phrasings the model handles)."""
    prompt, key = passkey(tok, n_tokens, 0.6, seed=3)
    doc = prompt.split("\nWhat is the pass key?")[0]
    questions = ["\nWhat is the pass key? The pass key is", "\nRepeat the pass key. The pass key is",
                 "\nWhich number is the pass key? The pass key is"]
    return doc, questions, key


def run_suite(srv, tok):
    """Everything one server answers; compared across methods."""
    out = {"passkey": {}, "short": [], "state": srv.internal_state()}
    for depth in DEPTHS:
        prompt, key = passkey(tok, PASSKEY_LEN, depth, seed=11)
        out["passkey"][depth] = (key, srv.complete(prompt)["choices"][0]["text"])
    for p in SHORT_PROMPTS:
        out["short"].append(srv.complete(p, max_tokens=24)["choices"][0]["text"])
    import sglang as sgl

    doc, questions, _ = fork_doc(tok)
    srv.complete(doc, max_tokens=1)  # the document is cached before the forks arrive, whatever their timing
    sgl.set_default_backend(sgl.RuntimeEndpoint(srv.url))
    before = srv.stats()
    state = fork_program().run(doc=doc, questions=questions)
    out["fork_answers"] = state["answers"]
    out["fork_stats"] = (before, srv.stats())
    return out


@pytest.fixture(scope="module")
def reference(smollm2_dir, smollm2_tokenizer):
    with Server(smollm2_dir, "off", extra=["--max-total-tokens", "65536"]) as srv:
        out = run_suite(srv, smollm2_tokenizer)
        # shared prefix: the second request reports the first one's tokens as cached
        prompt, key = passkey(smollm2_tokenizer, 2000, 0.3, seed=5)
        first = srv.complete(prompt)
        second = srv.complete(prompt.replace("What is the pass key?", "Tell me the pass key."))
        out["cached"] = (first["usage"], second["usage"], key, second["choices"][0]["text"])
        return out


def test_off_is_plain_sglang(reference, smollm2_tokenizer):
    state = reference["state"]
    assert state["sparse_kv"] == "off" and state["sparse_kv_config"] == {"method": "off"}
    assert "sparse_kv_stats" not in state  # no sparse backend was built
    for depth, (key, text) in reference["passkey"].items():
        assert key in text, (depth, text)
    first, second, key, text = reference["cached"]
    assert key in text
    _, _, doc_key = fork_doc(smollm2_tokenizer)
    assert all(number(a) == doc_key for a in reference["fork_answers"])
    assert second["prompt_tokens_details"]["cached_tokens"] >= 0.9 * first["prompt_tokens"]


@pytest.fixture(scope="module", params=["lychee", "quest"])
def sparse(request, smollm2_dir, smollm2_tokenizer, reference):
    method = request.param
    with Server(smollm2_dir, method, BUDGET, extra=["--max-total-tokens", "65536"]) as srv:
        yield method, srv, run_suite(srv, smollm2_tokenizer)


def test_config_reached_scheduler(sparse):
    method, srv, out = sparse
    state = out["state"]
    assert state["sparse_kv"] == method
    assert state["sparse_kv_config"]["token_budget"] == 256 and state["sparse_kv_config"]["method"] == method
    assert "sparse_kv_stats" in state


def test_passkey_and_sparsity(sparse, reference):
    method, srv, out = sparse
    stats = srv.stats()
    assert stats["sparse_steps"] > 0
    assert stats["attended_tokens"] < 0.35 * stats["context_tokens"]  # decode really read a fraction of the KV
    got = {d: text for d, (key, text) in out["passkey"].items()}
    if method == "lychee":
        for depth, (key, text) in reference["passkey"].items():
            assert number(got[depth]) == number(text) == key, (depth, got[depth], text)
    else:  # quest is the yardstick: it must run sparsely; its accuracy goes to the README table
        assert all(isinstance(t, str) for t in got.values())


def test_short_prompts_exactly_dense(sparse, reference):
    """Below the budget attention is exactly dense: identical greedy tokens."""
    method, srv, out = sparse
    assert out["short"] == reference["short"]


def test_fork_program_matches_dense_and_reuses_document(sparse, reference, smollm2_tokenizer):
    method, srv, out = sparse
    before, after = out["fork_stats"]
    doc, questions, key = fork_doc(smollm2_tokenizer)
    if method == "lychee":
        assert [number(a) for a in out["fork_answers"]] == [number(a) for a in reference["fork_answers"]]
        assert all(number(a) == key for a in out["fork_answers"])
        # the forks adopted the document's cluster index instead of clustering it once per fork
        assert after["index_reused"] - before["index_reused"] >= 28
    n_doc_units = len(smollm2_tokenizer.encode(doc)) // 16
    # each fork's prefill found the document's units in the radix cache instead of rebuilding them
    assert after["units_reused"] - before["units_reused"] >= len(questions) * n_doc_units * 0.9


def test_shared_prefix_reuses_units(sparse, smollm2_tokenizer):
    method, srv, _ = sparse
    prompt, key = passkey(smollm2_tokenizer, 2500, 0.7, seed=21)
    prompt = "Shared-prefix check. " + prompt  # nothing earlier in the session shares this prefix
    s0 = srv.stats()
    first = srv.complete(prompt)
    s1 = srv.stats()
    second = srv.complete(prompt.replace("What is the pass key?", "Tell me the pass key."))
    s2 = srv.stats()
    built_first = s1["units_built"] - s0["units_built"]
    assert built_first > 100
    assert s2["units_reused"] - s1["units_reused"] >= 0.95 * built_first
    assert s2["units_built"] - s1["units_built"] < 0.1 * built_first
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 2000
    if method == "lychee":
        assert key in first["choices"][0]["text"] and key in second["choices"][0]["text"]
        assert s2["index_reused"] - s1["index_reused"] == 28  # every sparse layer (30 - 2 dense)


def test_next_turn_reuses_decode_chunks(sparse, smollm2_dir, smollm2_tokenizer):
    """A finished turn's output stays in the radix cache; the next turn reuses the chunks grafted while
    decoding it (a chat history is indexed once, not per turn)."""
    method, srv, _ = sparse
    tok = smollm2_tokenizer
    prompt, _ = passkey(tok, 1500, 0.5, seed=8)
    ids = tok.encode("Multi-turn check. " + prompt)
    turn1 = srv.generate_ids(ids, 96, ignore_eos=True)
    out_ids = turn1["output_ids"]
    assert len(out_ids) == 96
    s1 = srv.stats()
    srv.generate_ids(ids + out_ids + tok.encode("\nAnd once more, the pass key is"), 4)
    s2 = srv.stats()
    if method == "lychee":
        chunker = Chunker("structure", 8, 16, BoundaryTable.from_tokenizer(tok, 49152))
    else:
        chunker = Chunker("fixed", 16, 16, None)
    cached = np.array(ids + out_ids[:-1])  # the last sampled token has no KV yet
    n_prompt_units = len(chunker.cuts(np.array(ids)))
    n_all_units = len(chunker.cuts(cached))
    assert n_all_units - n_prompt_units >= 4  # the output itself spans several units
    assert s2["units_reused"] - s1["units_reused"] >= n_all_units
