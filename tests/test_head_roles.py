"""Hybrid heads: role maps and their checks (sgl_sparsekv/head_roles.py), and bench/head_roles.py's role choices
and chained reuse on synthetic attention (brute force, no model)."""

import json

import numpy as np
import pytest
import torch

from bench.attention_recall import mask_metrics, summarize
from bench.head_roles import attention_weights, calibrated_roles, chained_metrics, greedy_roles
from sgl_sparsekv import head_roles
from sgl_sparsekv.config import ConfigError, SparseKVConfig
from sgl_sparsekv.patches.checks import check_model

L, FIRST, H, G, D, T, QUERIES = 8, 2, 3, 2, 16, 60, (56, 57, 58, 59)


def synthetic(seed=0):
    gen = torch.Generator().manual_seed(seed)
    layers = [(torch.randn(H * G, T, D, generator=gen), torch.randn(H, T, D, generator=gen),
               torch.randn(H, T, D, generator=gen)) for _ in range(L)]
    masks = {(l, t): torch.rand(H, t + 1, generator=gen) < 0.3 for l in range(FIRST, L) for t in QUERIES}
    return layers, masks


def test_greedy_roles_extremes_and_bisected_count():
    layers, masks = synthetic()
    w = attention_weights(layers, masks, FIRST)
    assert greedy_roles(w, masks, FIRST, float("-inf"))[FIRST:].all()
    only_first = greedy_roles(w, masks, FIRST, float("inf"))
    assert only_first[FIRST].all() and not only_first[FIRST + 1:].any() and not only_first[:FIRST].any()
    for count in (6, 10):
        assert abs(int(calibrated_roles(w, masks, FIRST, count)[FIRST:].sum()) - count) <= H


def test_staggered_roles_bound_every_chain():
    roles = np.array(head_roles.staggered_roles(L, H, FIRST, 8))
    period = round((L - FIRST) * H / 8)
    for h in range(H):
        at = np.flatnonzero(roles[:, h])
        assert at[0] == FIRST and np.diff(at).max() <= period


def test_chained_metrics_follow_the_parent():
    layers, masks = synthetic(1)
    everyone = np.zeros((L, H), dtype=bool)
    everyone[FIRST:] = True
    own = summarize({k: mask_metrics(layers[k[0]], k[1], m, 8) for k, m in masks.items()})
    assert chained_metrics(layers, masks, everyone, 8, FIRST)["mass_recall"] == own["mass_recall"]
    # nobody retrieves after the first sparse layer: every layer attends to the first layer's selection
    first_only = np.zeros((L, H), dtype=bool)
    first_only[FIRST] = True
    inherited = summarize({(l, t): mask_metrics(layers[l], t, masks[(FIRST, t)], 8)
                           for l in range(FIRST, L) for t in QUERIES})
    assert chained_metrics(layers, masks, first_only, 8, FIRST)["mass_recall"] == inherited["mass_recall"]


SHAPES = {"qwen2.5-coder-0.5b": (24, 2), "smollm2": (30, 3)}


@pytest.mark.parametrize("name", sorted(p.stem for p in head_roles.SHIPPED.glob("*.json")))
def test_shipped_maps_fit_their_models(name):
    data = head_roles.load_map(name)
    layers, kv = SHAPES[data["model"]]
    roles = head_roles.resolve(name, layers, kv, 2)
    assert len(roles) == layers - 2 and roles[0] == list(range(kv))
    assert sum(map(len, roles)) == data["retrieval_heads"] < data["of"] == (layers - 2) * kv
    cfg = SparseKVConfig.from_method("lychee", {"head_roles": name})
    other = next(m for m in SHAPES if m != data["model"])
    hf = type("HF", (), {"num_hidden_layers": SHAPES[other][0], "num_key_value_heads": SHAPES[other][1]})()
    with pytest.raises(ConfigError, match=f"head_roles: '{name}' \\(made for {data['model']}: {layers} layers"):
        check_model(hf, cfg)


def test_staggered_resolves_for_any_model():
    roles = head_roles.resolve("staggered-0.25", 32, 8, 2)
    assert roles[0] == list(range(8)) and len(roles) == 30
    assert abs(sum(map(len, roles)) - 0.25 * 240) <= 8
    assert head_roles.resolve("all-retrieval", 32, 8, 2) is None


@pytest.mark.parametrize("value,msg", [
    ("staggered-0", "share must be in"), ("staggered-1.5", "share must be in"),
    ("no-such-map", "is not 'all-retrieval'"), ("{layers}", "is not 'all-retrieval'"),
    ('{"layers": ["dense", "RX"]}', "one R/S letter"), ('{"layers": ["dense", "RS"]}', "must be all R"),
    ('{"layers": ["RR", "dense"]}', "dense layers must come first"), ('{"layers": ["dense", "RR", "R"]}', "one R/S"),
    ("not json", "not valid JSON"), ('{"roles": []}', "needs a 'layers' list")])
def test_bad_head_roles_are_one_line_errors(tmp_path, value, msg):
    if value.startswith("{") and value != "{layers}" or value == "not json":
        (tmp_path / "m.json").write_text(value)
        value = str(tmp_path / "m.json")
    with pytest.raises(ConfigError, match=msg) as e:
        SparseKVConfig.from_method("lychee", {"head_roles": value})
    assert "\n" not in str(e.value)


def test_head_roles_is_lychee_only():
    with pytest.raises(ConfigError, match="applies to --sparse-kv lychee"):
        SparseKVConfig.from_method("quest", {"head_roles": "staggered-0.5"})


def test_hardkuma_closed_form_l0_matches_sampling():
    from bench.hardkuma_roles import hardkuma_sample, prob_nonzero

    log_a = torch.tensor([[-1.0, 0.0, 1.0], [0.5, -0.5, 2.0]])
    log_b = torch.tensor([[0.0, 1.0, -1.0], [0.3, 0.0, 0.5]])
    gen = torch.Generator().manual_seed(0)
    z = torch.stack([hardkuma_sample(log_a, log_b, gen) for _ in range(20000)])
    assert z.min() == 0.0 and z.max() == 1.0 and ((z == 0) | (z == 1)).float().mean() > 0.05
    assert torch.allclose((z > 0).float().mean(0), prob_nonzero(log_a, log_b), atol=0.015)


def test_hardkuma_gates_carry_gradients():
    from bench.hardkuma_roles import hardkuma_sample, prob_nonzero

    log_a = torch.zeros(4, 2, requires_grad=True)
    log_b = torch.zeros(4, 2, requires_grad=True)
    (hardkuma_sample(log_a, log_b, torch.Generator().manual_seed(1)).sum() + prob_nonzero(log_a, log_b).sum()).backward()
    assert log_a.grad.abs().sum() > 0 and log_b.grad.abs().sum() > 0
    # a larger alpha pushes the Kumaraswamy mass up, so more gates open
    assert prob_nonzero(torch.tensor(1.0), torch.tensor(0.0)) > prob_nonzero(torch.tensor(0.0), torch.tensor(0.0))


def test_hardkuma_damped_constraint_lets_go_below_the_target():
    from bench.hardkuma_roles import constraint_term

    def pull(gap, lam, rho, equal=False):
        g = torch.tensor(gap, requires_grad=True)
        constraint_term(g, lam, rho, equal).backward()
        return g.grad.item()

    # the paper's Lagrangian pulls with lambda wherever E[L0] is; the damped one with max(0, lambda + rho * gap)
    assert pull(-0.1, 2.0, 0.0) == pytest.approx(2.0)
    assert pull(-0.1, 2.0, 20.0) == pytest.approx(0.0)
    assert pull(-0.05, 2.0, 20.0) == pytest.approx(1.0)
    assert pull(0.1, 2.0, 20.0) == pytest.approx(4.0)
    assert pull(-0.1, 2.0, 20.0, equal=True) == pytest.approx(0.0)
    assert pull(-0.2, 2.0, 20.0, equal=True) == pytest.approx(-2.0)


def test_hardkuma_top_roles_take_the_target_count_by_expected_gate():
    from bench.hardkuma_roles import top_roles

    ez = torch.tensor([[0.1, 0.9, 0.3], [0.6, 0.05, 0.2]])   # sparse layers after the first, 3 KV heads
    roles = top_roles(ez, first=2, heads=3, target=6)
    assert roles.shape == (5, 3) and not roles[:2].any() and roles[2].all()
    assert roles[3:].tolist() == [[False, True, True], [True, False, False]]


def test_hardkuma_gates_stay_recoverable_within_their_range():
    from bench.hardkuma_roles import GATE_LOG_RANGE, expected_z, prob_nonzero

    shut = (torch.tensor(-GATE_LOG_RANGE), torch.tensor(GATE_LOG_RANGE))
    assert 0.01 < prob_nonzero(*shut) < 0.05 and expected_z(*shut, samples=4000) < 0.5
    assert expected_z(torch.tensor(GATE_LOG_RANGE), torch.tensor(-GATE_LOG_RANGE), samples=4000) > 0.9


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_fidelity_hybrid_methods_have_a_map_for_each_model(model):
    from bench.fidelity import METHODS

    hybrid = {n: extra["head_roles"].format(model=model) for n, (_, extra) in METHODS.items() if "head_roles" in extra}
    assert len(hybrid) == 4
    layers, kv = SHAPES[model]
    for spec in hybrid.values():
        SparseKVConfig.from_method("lychee", {"head_roles": spec})
        roles = head_roles.resolve(spec, layers, kv, 2)
        assert len(roles) == layers - 2 and 0 < sum(map(len, roles)) < (layers - 2) * kv


def test_exact_topk_masks_take_the_largest_scores():
    from bench.head_roles import topk_masks

    layers, _ = synthetic(2)
    cfg = type("Cfg", (), {"token_budget": 32, "sink_tokens": 4, "recent_window": 16, "dense_layers": FIRST})()
    masks = topk_masks(cfg, layers, QUERIES)
    for (l, t), m in masks.items():
        q_all, k_all, _ = layers[l]
        score = torch.einsum("hgd,hsd->hgs", q_all[:, t].view(H, G, D), k_all[:, :t + 1]).amax(1)
        assert m.shape == (H, t + 1) and (m.sum(1) == 32).all()
        assert m[:, :4].all() and m[:, t + 1 - 16:].all()
        mid, sel = score[:, 4:t + 1 - 16], m[:, 4:t + 1 - 16]
        for h in range(H):   # every taken middle token scores at least as high as every one left out
            assert mid[h][sel[h]].min() >= mid[h][~sel[h]].max()
    assert sorted({l for l, _ in masks}) == list(range(FIRST, L))


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-calibrated-0.25", "smollm2-layer-sharing-0.25"])
def test_map_roles_round_trip(name):
    from bench.head_roles import roles_array

    data = head_roles.load_map(name)
    roles = roles_array(name, *SHAPES[data["model"]], 2)
    assert head_roles.to_strings(roles, data["dense_layers"]) == data["layers"]
    assert int(roles.sum()) == data["retrieval_heads"]


def test_query_spans_previous_and_sentence():
    import numpy as np

    from bench.attention_recall import query_spans
    from sgl_sparsekv.chunking import BoundaryTable

    table = BoundaryTable.from_texts(["a", " b", ".", " c", "\n"])
    ids = np.array([0, 1, 0, 1, 2, 3, 0, 4, 1, 0])
    positions = [3, 4, 5, 6, 7, 8]
    assert query_spans(ids, positions, table, "own") == {t: (t, t) for t in positions}
    assert query_spans(ids, positions, table, "previous") == {t: (t - 1, t - 1) for t in positions}
    # "." at 4 and "\n" at 7 end sentences: the steps after them start new sentence queries
    assert query_spans(ids, positions, table, "sentence") == {3: (3, 3), 4: (3, 4), 5: (5, 5), 6: (5, 6),
                                                              7: (5, 7), 8: (8, 8)}


def test_merge_recall_results_per_task_and_mean():
    import pytest

    from bench.attention_recall import merge

    def res(task, mass):
        return {"model": "m", "device": "CPU", "budget": 256, "length": 4000, "task": task,
                "samples": [{"sample": f"{task}/0"}],
                "variants": {v: {"mass_recall": x, "mass_recall_min": 0.1, "topk_recall": 0.5, "out_rel_err": 0.2,
                                 "kv_read": 0.05, "per_layer": []} for v, x in mass.items()}}

    got = merge([res("a", {"lychee": 0.8, "quest": 0.7}), res("b", {"lychee": 0.9, "quest": 0.6, "extra": 1.0})])
    assert got["tasks"]["b"]["variants"]["extra"]["mass_recall"] == 1.0
    assert set(got["mean_over_tasks"]) == {"lychee", "quest"}       # only variants every task has
    assert got["mean_over_tasks"]["lychee"]["mass_recall"] == pytest.approx(0.85)
    with pytest.raises(AssertionError):
        merge([res("a", {"lychee": 0.8}), {**res("b", {"lychee": 0.8}), "budget": 512}])


def test_merge_keeps_the_first_layers_of_every_layer_selected():
    from bench.attention_recall import merge

    def res(task, offset):
        rows = [{"layer": l, "mass_recall": 0.5 + offset + l / 10, "out_rel_err": 0.3 - l / 100} for l in range(6)]
        return {"model": "m", "device": "CPU", "budget": 256, "length": 4000, "task": task,
                "samples": [{"sample": f"{task}/0"}],
                "variants": {v: {"mass_recall": 0.8, "mass_recall_min": 0.1, "topk_recall": 0.5, "out_rel_err": 0.2,
                                 "kv_read": 0.05, "per_layer": rows} for v in ("lychee", "lychee-dense-0")}}

    got = merge([res("a", 0.0), res("b", 0.05)])["first_layers"]
    assert list(got) == ["0", "1", "2", "3"]
    assert got["1"]["b"] == {"mass_recall": 0.65, "out_rel_err": 0.29}
    assert "first_layers" not in merge([{**res("a", 0.0), "variants": {"lychee": res("a", 0.0)["variants"]["lychee"]}}])


def test_adaptive_budgets_spend_where_the_kept_mass_grows_most():
    import numpy as np

    from bench.attention_recall import adaptive_budgets

    levels = [128, 256, 512, 1024]
    recall = np.zeros((3, 2, 4))
    recall[1, 0] = [0.50, 0.60, 0.80, 0.95]     # gains a lot from more tokens
    recall[1, 1] = [0.90, 0.91, 0.92, 0.93]     # saturated: give its tokens away
    recall[2, 0] = recall[2, 1] = [0.70, 0.75, 0.78, 0.80]
    got = adaptive_budgets(recall, levels, 256, first=1)
    assert got[0].tolist() == [256, 256]        # dense layers keep the budget
    assert got[1, 0] > 256 > got[1, 1]
    assert got[1:].mean() <= 256


def test_attention_recall_several_budgets_match_single_runs(tmp_path, smollm2_dir):
    """``--budget B1 B2``: each variant at each budget over one capture, the numbers of a run at that budget alone."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    def run(out, *budgets):
        p = subprocess.run([sys.executable, "-m", "bench.attention_recall", "--model-dir", smollm2_dir, "--length",
                            "800", "--queries", "2", "--variants", "lychee", "quest", "--budget", *budgets, "--out",
                            str(out)], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(out.read_text())

    both, one = run(tmp_path / "both.json", "128", "256"), run(tmp_path / "one.json", "256")
    assert both["budget"] == [128, 256] and one["budget"] == 256
    assert set(both["variants"]) == {"lychee@128", "quest@128", "lychee@256", "quest@256"}
    for v in ("lychee", "quest"):
        assert both["variants"][f"{v}@256"]["mass_recall"] == one["variants"][v]["mass_recall"]
        assert both["variants"][f"{v}@128"]["kv_read"] < both["variants"][f"{v}@256"]["kv_read"]


PLANTED = (1500, 2, 2, 16, 700)   # tokens, KV heads, query heads per KV head, head dim, the planted key's position


def planted_layers(seed: int):
    """(boundary table, token ids, three layers of random (q, k, v)) where query head 3 (KV head 1) at the last
    position reads only the key planted at ``PLANTED[-1]``."""
    from sgl_sparsekv.chunking import BoundaryTable

    T, H, G, d, planted = PLANTED
    g = torch.Generator().manual_seed(seed)
    table = BoundaryTable.from_texts(["a", " b", ".", " c", "\n"])
    ids = np.array(torch.randint(0, 5, (T,), generator=g))
    layers = []
    for _ in range(3):
        q, k, v = (torch.randn(n, T, d, generator=g) for n in (H * G, H, H))
        k[1, planted] = 40 * q[3, T - 1] / q[3, T - 1].norm()
        layers.append((q, k, v))
    return table, ids, layers


def test_hedged_masks_join_lychee_and_quest_within_the_budget():
    """``lychee-quest-hedge-*`` (bench.attention_recall): lychee with part of the budget, joined with Quest's pages
    picked with the rest; never more tokens than the budget per KV head, and a token that takes one query head's
    whole attention (a key along that query) is found by the pages' min/max bound."""
    from bench.attention_recall import HEDGES, hedged_masks, own_masks

    T, _, _, _, planted = PLANTED
    table, ids, layers = planted_layers(0)
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": 256})
    pages = (256 - 16 - 64) // 4 // 16 * 16
    masks = hedged_masks(cfg, *HEDGES["lychee-quest-hedge-25"], ids, layers, [T - 1], table)
    own = own_masks(SparseKVConfig.from_method("lychee", {"token_budget": 256 - pages}), ids, layers, [T - 1], table)
    quest = own_masks(SparseKVConfig.from_method("quest", {"token_budget": 16 + 64 + pages}), ids, layers, [T - 1],
                      table)
    assert set(masks) == set(own) == {(2, T - 1)}   # layers 0 and 1 are dense
    for key, m in masks.items():
        assert torch.equal(m, own[key] | quest[key])
        assert int(m.sum(-1).max()) <= 256 and bool((m & ~own[key]).any())   # the pages add tokens
    assert all(bool(m[1, planted]) for m in quest.values())
    # the same bound over lychee's own chunks (of 8-16 tokens, cut by the table): its pick alone finds the planted key
    chunked = hedged_masks(cfg, *HEDGES["lychee-chunk-hedge-25"], ids, layers, [T - 1], table)
    by_bound = own_masks(SparseKVConfig.from_method("lychee", {"token_budget": 16 + 64 + pages}), ids, layers,
                         [T - 1], table, token_bound="chunk")
    for key, m in chunked.items():
        assert torch.equal(m, own[key] | by_bound[key]) and int(m.sum(-1).max()) <= 256
        assert bool((m & ~own[key]).any()) and bool(by_bound[key][1, planted])


def test_carried_masks_keep_what_the_previous_step_read():
    """``lychee-carry-*`` (bench.attention_recall): lychee's pick at a reduced budget joined with the chunks the
    previous step attended most, within the budget. A key that took one query head's whole attention at the step
    before, and that the step's own pick misses, is carried into it."""
    import dataclasses

    from bench.attention_recall import CARRIES, carried_masks, own_masks

    T, H, G, d, planted = PLANTED
    table, ids, layers = planted_layers(3)
    for q, k, _ in layers:   # the planted key answers the step before the queried one
        k[1, planted] = 40 * q[3, T - 2] / q[3, T - 2].norm()
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": 256})
    t, free = T - 1, 256 - 16 - 64
    carry = int(free * CARRIES["lychee-carry-25"])
    masks = carried_masks(cfg, CARRIES["lychee-carry-25"], ids, layers, [t], table)
    own = own_masks(dataclasses.replace(cfg, token_budget=256 - carry), ids, layers, [t], table)
    before = own_masks(cfg, ids, layers, [t - 1], table)
    for (l, _), m in masks.items():
        assert not bool((own[(l, t)] & ~m).any()) and torch.all(m.sum(-1) <= 256)
        assert torch.all((m & ~own[(l, t)]).sum(-1) <= carry) and bool((m & ~own[(l, t)]).any())
        assert bool(before[(l, t - 1)][1, planted]) and not bool(own[(l, t)][1, planted])   # not vacuous
        assert bool(m[1, planted])


def test_successor_masks_add_the_next_tokens_of_each_selected_one():
    """``lychee-next-k``, ``lychee-ahead-next-k`` (bench.attention_recall): a variant's mask plus the k positions
    after each of its positions, against a loop over the positions."""
    from bench.attention_recall import NEXTS, with_successors

    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 40, generator=gen) < 0.1
    mask[0, -1] = mask[1, 0] = True   # the last position has no successor to add; the first is one
    for k in sorted({k for _, k in NEXTS.values()}):
        want = mask.clone()
        for h, p in mask.nonzero().tolist():
            want[h, p:p + k + 1] = True
        assert torch.equal(with_successors(mask, k), want)
        assert int(want.sum()) > int(mask.sum())


def test_box_variants_take_fine_clusters_in_the_order_of_their_key_boxes():
    """``lychee-box-0.25`` (bench.attention_recall): every fine cluster clear of the sink and the recent window that
    the step takes ranks, by the bound of its tokens' key box (computed here from the keys), at or above every one
    it leaves; ``lychee-ahead-box-0.25`` attends to that selection of the step before plus the token decoded since."""
    from bench.attention_recall import VARIANTS, own_masks, per_query, unit_bounds, window
    from sgl_sparsekv.chunking import Chunker
    from sgl_sparsekv.index import box_bound, box_from, build_index
    from sgl_sparsekv.summary import summarize_units

    T, d = PLANTED[0], PLANTED[3]
    table, ids, layers = planted_layers(1)
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": 256, **VARIANTS["lychee-box-0.25"]})
    t = T - 1
    masks = own_masks(cfg, ids, layers, [t - 1, t], table)
    starts, ends = unit_bounds(Chunker(cfg.chunking, cfg.chunk_min, cfg.chunk_max, table), ids[:t + 1])
    sink, recent, _ = window(cfg, t + 1)
    ranked = 0
    for l in range(cfg.dense_layers, len(layers)):
        q, k, _ = layers[l]
        H = k.shape[0]
        kbuf = k[:, :t + 1].transpose(0, 1)
        indptr = torch.cat([torch.zeros(1, dtype=torch.long), ends]).to(torch.int32)
        slots = torch.arange(int(ends[-1]), dtype=torch.int32)   # the chunked tokens (the tail is uncut)
        # the clusters the variant's index forms (k-means over the chunks' mean keys), boxed here from their keys
        ix = build_index(summarize_units(kbuf, slots, indptr, False).transpose(0, 1), ends - starts,
                         cfg.fine_cluster_size, cfg.max_coarse, cfg.kmeans_iters)
        taken = masks[(l, t)][:, starts]                       # [H, chunks]: a chunk is taken whole
        clear = (starts >= sink) & (ends <= t + 1 - recent)
        for h in range(H):
            at = ix.chunk_fine[h]
            lo = torch.stack([k[h, a:b].amin(0) for a, b in zip(starts.tolist(), ends.tolist())])
            hi = torch.stack([k[h, a:b].amax(0) for a, b in zip(starts.tolist(), ends.tolist())])
            L = int(at.max()) + 1
            clo = torch.full((L, d), float("inf")).index_reduce_(0, at, lo, "amin")
            chi = torch.full((L, d), float("-inf")).index_reduce_(0, at, hi, "amax")
            bound = box_bound(q[h * 2:h * 2 + 2, t][None], box_from(clo, chi)[None], cfg.radius_weight,
                              cfg.gqa_reduce)[0][at]        # per chunk, its cluster's bound
            inner = clear & torch.isin(at, at[~clear], invert=True)   # clusters with no chunk in the windows
            sel, rest = bound[inner & taken[h]], bound[inner & ~taken[h]]
            assert sel.numel() and rest.numel()
            assert float(sel.min()) >= float(rest.max())
            ranked += 1
    assert ranked == (len(layers) - cfg.dense_layers) * layers[0][1].shape[0]
    ahead = SparseKVConfig.from_method("lychee", {"token_budget": 256, **VARIANTS["lychee-ahead-box-0.25"]})
    _, got = per_query(ahead, ids, layers, [t], table, "lychee-ahead-box-0.25")
    for (l, s), m in got.items():
        assert s == t and torch.equal(m[:, :t], masks[(l, t - 1)]) and bool(m[:, t].all())


def test_oracle_masks_bound_every_selection_at_the_same_read():
    """``lychee-oracle-*`` (bench.attention_recall), the ceiling a selection is measured against: per KV head the
    budget's tokens (or lychee's whole chunks) holding the most of the group's mean dense attention. Lychee's
    selection never keeps more of that mass than the token ceiling; the chunk ceiling takes chunks whole, holds no
    more than the token ceiling, and both find a key that takes one query head's whole attention."""
    import math

    from bench.attention_recall import ORACLES, oracle_masks, own_masks, unit_bounds
    from sgl_sparsekv.chunking import Chunker

    T, H, G, d, planted = PLANTED
    table, ids, layers = planted_layers(1)
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": 256})
    t = T - 1
    tokens, chunks = (oracle_masks(cfg, ids, layers, [t], table, ORACLES[o]) for o in ("-oracle-tokens",
                                                                                      "-oracle-chunks"))
    lychee = own_masks(cfg, ids, layers, [t], table)
    starts, ends = unit_bounds(Chunker(cfg.chunking, cfg.chunk_min, cfg.chunk_max, table), ids[:T])
    inside = (starts >= cfg.sink_tokens) & (ends <= T - cfg.recent_window)
    for key in lychee:
        q, k, _ = layers[key[0]]
        w = torch.softmax(torch.einsum("hgd,hsd->hgs", q[:, t].view(H, G, d), k) / math.sqrt(d), -1).mean(1)

        def mass(m):
            return (w * m).sum(-1)

        assert torch.all(tokens[key].sum(-1) == 256) and torch.all(chunks[key].sum(-1) <= 256)
        assert torch.all(mass(lychee[key]) <= mass(tokens[key]) + 1e-6)
        assert torch.all(mass(chunks[key]) <= mass(tokens[key]) + 1e-6)
        for a, b in zip(starts[inside].tolist(), ends[inside].tolist()):   # a chunk is in or out, whole
            assert bool((chunks[key][:, a:b].all(-1) | ~chunks[key][:, a:b].any(-1)).all())
        assert bool(tokens[key][1, planted]) and bool(chunks[key][1, planted])


def test_reranked_masks_keep_the_best_candidates():
    """``lychee-rerank-*`` (bench.attention_recall): lychee's pick at a multiple of the budget, of which the budget's
    best tokens by the group's attention over the candidates are kept: a subset of the candidates within the budget,
    no dropped candidate outweighs a kept one, and the planted key, once a candidate, is kept."""
    import dataclasses
    import math

    from bench.attention_recall import RERANKS, own_masks, reranked_masks

    T, H, G, d, planted = PLANTED
    table, ids, layers = planted_layers(2)
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": 256})
    t, free = T - 1, 256 - 16 - 64
    kept = reranked_masks(cfg, RERANKS["lychee-rerank-2"], ids, layers, [t], table)
    wide = own_masks(dataclasses.replace(cfg, token_budget=256 + free), ids, layers, [t], table)
    for key, m in kept.items():
        cand = wide[key]
        q, k, _ = layers[key[0]]
        logits = torch.einsum("hgd,hsd->hgs", q[:, t].view(H, G, d), k) / math.sqrt(d)
        w = torch.softmax(logits.masked_fill(~cand[:, None], float("-inf")), -1).mean(1)
        middle = torch.zeros(T, dtype=torch.bool)
        middle[16:T - 64] = True
        assert not bool((m & ~cand).any()) and torch.all((m & middle).sum(-1) <= free)
        for h in range(H):
            dropped = cand[h] & ~m[h] & middle
            assert bool(dropped.any()) and float(w[h][dropped].max()) <= float(w[h][m[h] & middle].min()) + 1e-7
        assert bool(m[1, planted]) or not bool(cand[1, planted])
    assert bool(next(iter(wide.values()))[1, planted])   # the test is not vacuous: lychee finds it at twice the budget


def test_serving_bench_qwen_shape_takes_the_shipped_qwen_maps(tmp_path):
    """bench.gpu_serving --shape qwen2.5-coder-0.5b rewrites mkmodel's Llama config into Qwen2.5-Coder-0.5B's shape:
    the server's startup check accepts every lychee-qwen-* variant's role map on it (a map that did not fit would
    fail only on the GPU machine), and rejects them on the Llama shape."""
    from transformers import AutoConfig

    from bench.gpu_serving import VARIANTS, write_shape

    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "vocab_size": 128256, "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 1,
             "eos_token_id": 2, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    before = AutoConfig.from_pretrained(tmp_path)
    assert "Qwen2.5-Coder-0.5B" in write_shape(str(tmp_path), "qwen2.5-coder-0.5b")
    hf = AutoConfig.from_pretrained(tmp_path)
    assert (hf.model_type, hf.num_hidden_layers, hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads) == \
        ("qwen2", 24, 2, 64)
    qwen = [name for name in VARIANTS if name.startswith("lychee-qwen-")]
    assert len(qwen) == 3
    for name in qwen:
        cfg = SparseKVConfig.from_method("lychee", VARIANTS[name])
        check_model(hf, cfg)
        with pytest.raises(ConfigError, match="does not fit"):
            check_model(before, cfg)
