"""Structure-aware chunking: bounds, delimiter choice, fuzz, and stream stability."""

import json
import random

import numpy as np
import pytest

from sgl_sparsekv.chunking import (NONE, PHRASE, SENTENCE, SPACE, STRUCT, BoundaryTable, Chunker, fixed_cuts,
                                   structure_cuts, text_strength)


@pytest.mark.parametrize("text,level", [
    ("\n\n", STRUCT), ("```", STRUCT), ("---", STRUCT), ("***", STRUCT), ("}", STRUCT), ("]", STRUCT), (">", STRUCT),
    (".", SENTENCE), ("?", SENTENCE), ("!", SENTENCE), ("。", SENTENCE), ("？", SENTENCE), ("！", SENTENCE),
    ("\n", SENTENCE), (",", PHRASE), (";", PHRASE), (":", PHRASE), ("，", PHRASE), ("、", PHRASE), ("·", PHRASE),
    ("word ", SPACE), ("\t", SPACE), ("word", NONE), ("", NONE),
])
def test_strength_levels(text, level):
    assert text_strength(text) == level


def brute_cuts(strength, n, lo, hi):
    """The rule read literally: grow to `lo`, cut after the strongest of tokens lo..hi (earliest on ties)."""
    ends, s = [], 0
    while s + hi + 1 <= n:
        window = [(strength[i], -i) for i in range(s + lo - 1, s + hi)]
        best = max(window)
        e = (-best[1] + 1) if best[0] > NONE else s + hi
        ends.append(e)
        s = e
    return ends


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("lo,hi", [(8, 16), (1, 1), (4, 32), (16, 16)])
def test_structure_cuts_match_brute_force(seed, lo, hi):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 400))
    p = rng.dirichlet(np.ones(5))
    strength = rng.choice(5, size=n, p=p).astype(np.int8)
    got = structure_cuts(strength, n, lo, hi).tolist()
    assert got == brute_cuts(strength, n, lo, hi)
    lengths = np.diff([0] + got)
    assert all(lo <= L <= hi for L in lengths)


def test_no_delimiters_degrade_to_fixed_chunks():
    n = 200
    assert structure_cuts(np.zeros(n, np.int8), n, 8, 16).tolist() == list(range(16, 193, 16))  # last start 176: 176 + 17 <= 200


def test_cut_lands_on_strongest_delimiter_in_window():
    strength = np.zeros(64, np.int8)
    strength[[9, 11, 13]] = [PHRASE, SENTENCE, SENTENCE]   # tie between 11 and 13 -> earliest
    strength[5] = STRUCT                                     # before chunk_min: ignored
    assert structure_cuts(strength, 64, 8, 16)[0] == 12


@pytest.fixture(scope="module")
def table(smollm2_tokenizer):
    return BoundaryTable.from_tokenizer(smollm2_tokenizer)


def _samples(rng):
    words = ["alpha", "beta", "gamma", "delta", "foo", "bar"]
    code = "\n".join(f"def f{i}(x):\n    return x * {i}  # note, {i}\n" for i in range(40))
    data = json.dumps({f"k{i}": {"v": list(range(i % 5)), "s": "x" * (i % 7)} for i in range(60)}, indent=2)
    cjk = "这是一个测试。我们需要把文本切成块，每块都有意义！" * 30
    prose = " ".join(rng.choice(words) + rng.choice(["", ",", ".", ";", "\n"]) for _ in range(600))
    junk = bytes(rng.randrange(256) for _ in range(3000)).decode("latin-1")
    flat = "x" * 3000
    return dict(code=code, json=data, cjk=cjk, prose=prose, random_bytes=junk, no_delims=flat)


@pytest.mark.parametrize("kind", ["code", "json", "cjk", "prose", "random_bytes", "no_delims"])
def test_fuzz_real_tokenizer(kind, table, smollm2_tokenizer):
    text = _samples(random.Random(0))[kind]
    ids = np.array(smollm2_tokenizer.encode(text, add_special_tokens=False))
    ch = Chunker("structure", 8, 16, table)
    cuts = ch.cuts(ids)
    assert cuts.tolist() == brute_cuts(table.cut_strength(ids), len(ids), 8, 16)
    lengths = np.diff(np.r_[0, cuts])
    assert len(cuts) > 0 and lengths.min() >= 8 and lengths.max() <= 16
    assert len(ids) - cuts[-1] <= ch.lookahead  # everything but the undecidable tail is cut
    if kind in ("code", "json"):
        # structure wins: most chunks end on a newline or closing bracket
        ends = [smollm2_tokenizer.decode(ids[e - 1:e]) for e in cuts]
        assert np.mean([("\n" in t) or ("}" in t) or ("]" in t) or ("," in t) for t in ends]) > 0.8


@pytest.mark.parametrize("kind", ["code", "prose", "cjk"])
def test_stream_stable(kind, table, smollm2_tokenizer):
    """Cutting a prefix, then the rest as tokens arrive, gives the cuts of the whole stream: through ``cuts`` on
    numpy windows, and through ``ends`` on the host token list, as a decode step cuts."""
    ids = np.array(smollm2_tokenizer.encode(_samples(random.Random(1))[kind], add_special_tokens=False))[:1500]
    ch = Chunker("structure", 8, 16, table)
    whole = ch.cuts(ids).tolist()
    for window in (lambda a, b: ch.cuts(ids[a:b]).tolist(), lambda a, b, toks=ids.tolist(): ch.ends(toks[a:b])):
        streamed, start = [], 0
        for n in range(1, len(ids) + 1):  # one token at a time, like decode
            for e in window(start, n):
                streamed.append(start + e)
            start = streamed[-1] if streamed else 0
        assert streamed == whole
    assert ch.ends(ids.tolist()) == whole   # a long window: numpy's cut, as a list


def test_fixed_units():
    assert fixed_cuts(50, 16).tolist() == [16, 32, 48]
    assert fixed_cuts(50, 16, final=True).tolist() == [16, 32, 48, 50]
    assert Chunker("fixed", 16, 16, None).cuts(np.arange(40)).tolist() == [16, 32]
    assert Chunker("fixed", 16, 16, None).ends(list(range(40))) == [16, 32]


def test_long_input_matches_brute_force(table):
    """128K tokens through the vectorized path (its speed is measured in bench/bench_chunking.py)."""
    ids = np.random.default_rng(0).integers(0, len(table.strength), 131072)
    cuts = Chunker("structure", 8, 16, table).cuts(ids)
    assert cuts.tolist() == brute_cuts(table.cut_strength(ids), len(ids), 8, 16)


@pytest.mark.parametrize("lo,hi", [(8, 16), (1, 1), (4, 32), (16, 16)])
@pytest.mark.parametrize("final", [False, True])
def test_short_windows_cut_like_the_vectorized_path(lo, hi, final):
    """Decode steps cut windows of up to ``SHORT`` tokens in plain Python: the same cuts as numpy, at every length,
    with ids past the table's end clipped the same way."""
    from sgl_sparsekv.chunking import SHORT

    rng = np.random.default_rng(lo * 100 + hi)
    V = 50
    table = BoundaryTable(rng.choice(5, size=V, p=[0.6, 0.2, 0.1, 0.06, 0.04]).astype(np.int8), rng.random(V) < 0.3)
    ch = Chunker("structure", lo, hi, table)
    for _ in range(300):
        ids = rng.integers(-3, V + 3, int(rng.integers(0, SHORT + 1)))
        want = structure_cuts(table.cut_strength(ids), len(ids), lo, hi, final)
        assert ch.cuts(ids.tolist(), final).tolist() == want.tolist()
