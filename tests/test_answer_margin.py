"""bench.answer_margin: the served decode path inside a real model's forward (SmolLM2 on the CPU)."""

import numpy as np
import pytest

from bench.answer_margin import config, greedy, prefill, teacher_forced
from bench.attention_recall import load
from bench.tasks import make
from sgl_sparsekv.chunking import BoundaryTable


@pytest.fixture(scope="module")
def sample(smollm2_dir):
    tok, model = load(smollm2_dir)
    s = make("niah_multivalue", tok, 1200, 0)
    prompt = np.asarray(tok(s.prompt).input_ids)
    answer = tok.encode(" " + ", ".join(s.expected), add_special_tokens=False)
    return model, BoundaryTable.from_tokenizer(tok), prompt, answer, prefill(model, prompt)


def test_served_path_within_the_budget_is_dense(sample):
    """A budget past the whole sequence attends to every token through the served path (pools written per step,
    slot = position + 1): the answer's scores and the greedy tokens are dense's, for lychee, select_ahead (its first
    step selected by its own query as served, or attending to everything, or selected by the last prompt token's
    query) and quest alike."""
    model, table, prompt, answer, pre = sample
    dense = teacher_forced(model, table, config("off", 0), prompt, answer, pre)
    dense_ids = greedy(model, table, config("off", 0), prompt, pre, 8, set())["ids"]
    assert len(answer) > 5 and len(dense_ids) == 8
    for method in ("lychee", "lychee-ahead", "lychee-ahead+dense-first", "lychee-ahead+prompt", "lychee+sticky",
                   "lychee+chunk-bound", "quest"):
        got = teacher_forced(model, table, config(method, 4096), prompt, answer, pre)
        assert got["logprob"] == pytest.approx(dense["logprob"], abs=1e-3), method
        assert got["min_margin"] == pytest.approx(dense["min_margin"], abs=1e-3), method
        assert greedy(model, table, config(method, 4096), prompt, pre, 8, set())["ids"] == dense_ids, method


def test_sparse_budget_changes_the_answer_scores(sample):
    """Past the budget the decode steps really attend sparsely: lychee reads a fraction of the KV and its answer
    scores move away from dense's; select_ahead, whose later steps attend to the step before's lists, reads as much
    as lychee (its first step selects with its own query) and moves differently; with a dense first step it reads
    more."""
    model, table, prompt, answer, pre = sample
    dense = teacher_forced(model, table, config("off", 0), prompt, answer, pre)
    own = teacher_forced(model, table, config("lychee", 160), prompt, answer, pre)
    ahead = teacher_forced(model, table, config("lychee-ahead", 160), prompt, answer, pre)
    dense_first = teacher_forced(model, table, config("lychee-ahead+dense-first", 160), prompt, answer, pre)
    assert own["kv_read"] < 0.3 and own["kv_read"] == ahead["kv_read"] < dense_first["kv_read"] < 1
    assert own["logprob"] != pytest.approx(dense["logprob"], abs=1e-2)
    assert ahead["logprob"] != pytest.approx(own["logprob"], abs=1e-3)
    assert own["first_token_margin"] == dense["first_token_margin"]   # the prefill's token: dense for all
    # analysis: select_ahead whose every layer selects with its own query is lychee
    every = teacher_forced(model, table, config(f"lychee-ahead+own-{model.config.num_hidden_layers}", 160), prompt,
                           answer, pre)
    assert every["logprob"] == pytest.approx(own["logprob"], abs=1e-4)
    some = teacher_forced(model, table, config("lychee-ahead+own-8", 160), prompt, answer, pre)
    assert some["logprob"] not in (pytest.approx(own["logprob"], abs=1e-4), pytest.approx(ahead["logprob"], abs=1e-4))
    # analysis: the union with the step before's lists reads more than the step's own lists, less than twice, and
    # moves the scores
    sticky = teacher_forced(model, table, config("lychee+sticky", 160), prompt, answer, pre)
    assert sticky["lists_read"] < sticky["kv_read"] < 2 * sticky["lists_read"]
    assert sticky["lists_read"] <= own["kv_read"]
    assert sticky["logprob"] != pytest.approx(own["logprob"], abs=1e-4)
    # analysis: lychee's chunks ranked by Quest's key bound read what fits the budget, and attend elsewhere
    bound = teacher_forced(model, table, config("lychee+chunk-bound", 160), prompt, answer, pre)
    assert bound["kv_read"] == bound["lists_read"] <= own["kv_read"]
    assert bound["logprob"] != pytest.approx(own["logprob"], abs=1e-4)


def test_fp8_boxes_cover_their_keys_and_keep_each_dimension():
    """The compact box storage the harness probes still covers every key (as the bf16 boxes do), stores a stored
    box unchanged, and keeps the small dimensions beside a few large ones (one scale per box would round them
    away in int8; e4m3 keeps an exponent per value)."""
    import torch

    from bench.answer_margin import fp8_box
    from sgl_sparsekv.index import BOX_DTYPE, box_bound

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(6, 4, 9, 64, generator=gen) * torch.tensor([0.05] * 60 + [40.0] * 4)   # [.., tokens, d]
    lo, hi = keys.amin(-2), keys.amax(-2)
    box = fp8_box(torch.stack([(lo + hi) / 2, (hi - lo) / 2], -2))
    assert box.dtype == BOX_DTYPE
    c, w = box[..., 0, :].float(), box[..., 1, :].float()
    assert (c - w <= lo).all() and (c + w >= hi).all()
    assert torch.equal(fp8_box(box.float()), box)
    small = slice(0, 60)
    assert ((w - (hi - lo) / 2)[..., small].abs() <= 0.15 * (hi - lo)[..., small] + 1e-6).all()
    q = torch.randn(6, 1, 64, generator=gen)   # Quest's bound over the stored box still bounds every token's score
    best = (q[:, :, None, :] * keys).sum(-1).amax(-1)
    assert (box_bound(q, box.float(), 1.0, "max") >= best - 1e-3).all()
