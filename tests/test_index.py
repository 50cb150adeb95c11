"""Cluster index and selection against brute force."""

import pytest
import torch
import torch.nn.functional as F

from helpers import graft_chunk
from sgl_sparsekv.index import (ClusterIndex, box_bound, build_index, build_index_grouped, cluster_counts, quantize_box,
                                union, upper_bound)
from sgl_sparsekv.select import (quest_scores, select_chunks, select_clusters, select_pages,
                                 units_to_token_mask)


def _keys(kind, H, M, d, gen):
    if kind == "random":
        x = torch.randn(H, M, d, generator=gen)
    else:  # a few tight topics plus noise, like real chunk keys
        centers = torch.randn(H, 6, d, generator=gen) * 3
        pick = torch.randint(0, 6, (H, M), generator=gen)
        x = centers.gather(1, pick[..., None].expand(-1, -1, d)) + torch.randn(H, M, d, generator=gen) * 0.5
    return F.normalize(x, dim=-1)


def _check_bounds(index, keys, q, reduce="max"):
    """UB of every node >= the true max q.k over every chunk below it (per query head, so any reduce)."""
    H, M, d = keys.shape
    true = torch.einsum("hgd,hmd->hgm", q, keys)            # [H, G, M]
    for level, mu, r, owner in (
        ("fine", index.fine_mu, index.fine_r, index.chunk_fine),
        ("coarse", index.coarse_mu, index.coarse_r, index.fine_parent.gather(1, index.chunk_fine)),
    ):
        ub = torch.einsum("hgd,hnd->hgn", q, mu) + q.norm(dim=-1)[..., None] * r[:, None]
        ub_of_chunk = ub.gather(2, owner[:, None, :].expand(-1, q.shape[1], -1))
        assert bool((ub_of_chunk >= true - 1e-4).all()), f"{level} bound violated"


@pytest.mark.parametrize("size", [1.0, 2.0])
@pytest.mark.parametrize("kind", ["random", "clustered"])
@pytest.mark.parametrize("H,M,d,G", [(1, 1, 64, 1), (3, 37, 64, 3), (2, 300, 128, 4), (4, 1000, 64, 7)])
def test_bounds_after_build_and_grafts(kind, H, M, d, G, size):
    gen = torch.Generator().manual_seed(H * 1000 + M)
    keys = _keys(kind, H, M, d, gen)
    lens = torch.randint(8, 17, (M,), generator=gen)
    index = build_index(keys, lens, size, 64, 10)
    L, P = cluster_counts(M, size, 64)
    assert index.fine_mu.shape == (H, L, d) and index.coarse_mu.shape == (H, P, d)
    for _ in range(5):
        _check_bounds(index, keys, torch.randn(H, G, d, generator=gen) * 3)
    # many lazy updates: new chunks drift away from the build's distribution
    for i in range(200):
        new = F.normalize(_keys(kind, H, 1, d, gen)[:, 0] + 0.01 * i * torch.randn(H, d, generator=gen), dim=-1)
        graft_chunk(index, new, 12)
        keys = torch.cat([keys, new[:, None]], dim=1)
    assert index.num_chunks == M + 200
    assert torch.equal(index.fine_n.sum(1), torch.full((H,), float(M + 200)))
    for _ in range(5):
        _check_bounds(index, keys, torch.randn(H, G, d, generator=gen) * 3)


def test_centroid_storage_is_exact_and_idempotent():
    """Centroids are stored as int8 codes times a power-of-two scale per row: each element within half a step of
    the fp32 value, a row using at least half the code range (the smallest power of two that fits), storing a
    stored row gives it back with the same codes and scale (so pools, cache and twin agree), and a packed index
    (the cache's) unpacks to its stored centroids. A zero row (an empty cluster) is zero codes at scale 1."""
    from sgl_sparsekv.index import quantize, stored

    gen = torch.Generator().manual_seed(0)
    mu = torch.randn(5, 40, 64, generator=gen) * torch.logspace(-6, 2, 40)[None, :, None]
    mu[0, 0] = 0.0
    codes, scale = quantize(mu)
    s = stored(mu)
    assert codes.dtype == torch.int8 and torch.equal(scale, torch.exp2(torch.log2(scale).round()))
    assert ((mu - s).abs() <= scale[..., None] / 2).all()
    live = mu.abs().amax(-1) > 0
    assert (codes.abs().amax(-1)[live] >= 64).all()
    again = quantize(s)
    assert torch.equal(again[0], codes) and torch.equal(again[1], scale) and torch.equal(stored(s), s)
    ix = build_index(F.normalize(torch.randn(2, 30, 16, generator=gen), dim=-1), torch.full((30,), 8), 2.0, 64, 5)
    back = ix.pack().unpack()
    assert torch.equal(back.fine_mu, stored(ix.fine_mu)) and torch.equal(back.coarse_mu, stored(ix.coarse_mu))
    assert scale[0, 0] == 1.0 and not codes[0, 0].any()


@pytest.mark.parametrize("kind", ["random", "clustered"])
def test_one_chunk_per_fine_cluster_is_the_kmeans_fixed_point(kind):
    """With as many fine clusters as chunks the build skips k-means: each chunk is its own cluster, which is where
    the iterations start (the centroids begin at every point) and stay (each unit key is nearest to itself)."""
    from sgl_sparsekv.index import stored
    from sgl_sparsekv.kernels.kmeans import cluster_sums_ref, nearest_centroid_ref

    gen = torch.Generator().manual_seed(7)
    H, M, d = 3, 120, 64
    keys = _keys(kind, H, M, d, gen)
    lens = torch.randint(8, 17, (M,), generator=gen)
    assert torch.equal(nearest_centroid_ref(keys, keys), torch.arange(M).expand(H, M))   # the fixed point
    sums, counts = cluster_sums_ref(keys, torch.arange(M).expand(H, M).clone(), M)
    assert torch.equal(counts, torch.ones(H, M, dtype=counts.dtype)) and torch.allclose(F.normalize(sums, dim=-1), keys)
    ix = build_index(keys, lens, 1.0, 64, 10)
    # fine clusters are regrouped by coarse unit: chunk m's cluster holds exactly chunk m's key and length
    own = ix.chunk_fine
    assert torch.equal(torch.sort(own, dim=1).values, torch.arange(M).expand(H, M))
    at = own[..., None].expand(-1, -1, d)
    assert torch.equal(ix.fine_mu.gather(1, at), stored(keys))
    assert torch.allclose(ix.fine_r.gather(1, own), (keys - stored(keys)).norm(dim=-1))   # the rounding, covered
    assert torch.equal(ix.fine_n, torch.ones(H, M)) and torch.equal(ix.fine_tokens.gather(1, own), lens.float().expand(H, M))


@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_full_budget_selects_everything(reduce):
    gen = torch.Generator().manual_seed(0)
    keys = _keys("clustered", 3, 250, 64, gen)
    lens = torch.randint(8, 17, (250,), generator=gen)
    index = build_index(keys, lens, 2.0, 64, 10)
    sel = select_chunks(index, torch.randn(3, 3, 64, generator=gen), int(lens.sum()), 4.0, reduce)
    assert bool(sel.all())


def _flat_reference(index, q, budget, reduce):
    """Rank every fine cluster by its bound, take the prefix that fits: what pruning must not change."""
    ub = upper_bound(q, index.fine_mu, index.fine_r, reduce).masked_fill(index.fine_n == 0, float("-inf"))
    order = torch.sort(ub, dim=-1, descending=True, stable=True).indices
    take = torch.cumsum(index.fine_tokens.gather(1, order), -1) <= budget
    return torch.zeros_like(take).scatter_(1, order, take)


@pytest.mark.parametrize("seed", range(10))
def test_coarse_pruning_is_exact_when_expanded_enough(seed):
    gen = torch.Generator().manual_seed(seed)
    keys = _keys("clustered", 2, 400, 64, gen)
    lens = torch.randint(8, 17, (400,), generator=gen)
    index = build_index(keys, lens, 2.0, 64, 10)
    q = torch.randn(2, 4, 64, generator=gen) * 2
    for budget in (64, 256, 1000):
        got = select_clusters(index, q, budget, coarse_expand=1e9, reduce="max")
        assert torch.equal(got, _flat_reference(index, q, budget, "max"))
        pruned = select_clusters(index, q, budget, coarse_expand=4.0, reduce="max")
        assert int((index.fine_tokens * pruned).sum(1).max()) <= budget


def test_budget_respected_and_tie_break_stable():
    gen = torch.Generator().manual_seed(3)
    keys = _keys("random", 2, 120, 64, gen)
    lens = torch.full((120,), 10)
    index = build_index(keys, lens, 2.0, 64, 10)
    q = torch.randn(2, 2, 64, generator=gen)
    a = select_clusters(index, q, 300, 4.0, "max")
    assert torch.equal(a, select_clusters(index, q, 300, 4.0, "max"))
    assert int((index.fine_tokens * a).sum(1).max()) <= 300

    # a real tie: every node carries the same centroid and radius, so every bound is equal; the pick must be
    # the lowest-indexed live clusters (a stable sort), up to the budget
    for node in ("fine", "coarse"):
        mu, r = getattr(index, f"{node}_mu"), getattr(index, f"{node}_r")
        mu[:] = keys[:, :1]
        r[:] = torch.where(torch.isfinite(r), torch.tensor(0.25), r)
    ub = upper_bound(q, index.fine_mu, index.fine_r, "max")
    live = index.fine_n > 0
    assert all(bool((ub[h][live[h]] == ub[h][live[h]][0]).all()) for h in range(2))
    for budget in (95, 300):
        got = select_clusters(index, q, budget, 1000.0, "max")
        for h in range(2):
            tok = torch.where(live[h], index.fine_tokens[h], torch.zeros(()))
            want = live[h] & (torch.cumsum(tok, 0) <= budget)
            assert torch.equal(got[h], want), (budget, h)
            assert 0 < int(want.sum()) < int(live[h].sum())


@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_planted_needle_is_recalled(reduce):
    """A chunk aligned with the query among many distractors: its tokens are selected at a small budget."""
    gen = torch.Generator().manual_seed(7)
    H, M, d, G = 3, 800, 64, 3
    keys = _keys("clustered", H, M, d, gen)
    q = torch.randn(H, G, d, generator=gen)
    needles = [123, 456, 789]
    for n in needles:
        keys[:, n] = F.normalize(q.mean(1) + 0.05 * torch.randn(H, d, generator=gen), dim=-1)
    lens = torch.randint(8, 17, (M,), generator=gen)
    index = build_index(keys, lens, 2.0, 64, 10)
    sel = select_chunks(index, q * 4, 256, 4.0, reduce)
    assert bool(sel[:, needles].all())


def test_quest_matches_brute_force():
    gen = torch.Generator().manual_seed(1)
    H, N, d, G = 2, 50, 64, 4
    k = torch.randn(H, N, 16, d, generator=gen)
    kmin, kmax = k.amin(2), k.amax(2)
    q = torch.randn(H, G, d, generator=gen)
    s = quest_scores(q, kmin, kmax, "max")
    # the Quest score bounds every token's q.k in the page, per query head
    assert bool((s[:, :, None] >= torch.einsum("hgd,hnpd->hgnp", q, k).amax(1) - 1e-4).all())
    brute = torch.zeros(H, N)
    for h in range(H):
        for n in range(N):
            per_head = [sum(max(float(q[h, g, i] * kmin[h, n, i]), float(q[h, g, i] * kmax[h, n, i])) for i in range(d))
                        for g in range(G)]
            brute[h, n] = max(per_head)
    assert torch.allclose(s, brute, atol=1e-4)
    sel = select_pages(q, kmin, kmax, 160, 16, "max")
    assert sel.sum(1).tolist() == [10, 10]
    assert torch.equal(sel, torch.zeros_like(sel).scatter_(1, s.topk(10, dim=1).indices, True))


def test_token_mask():
    sel = torch.tensor([[True, False, True], [False, False, False]])
    starts, ends = torch.tensor([0, 10, 20]), torch.tensor([10, 20, 30])
    m = units_to_token_mask(sel, starts, ends, 40, sink=4, recent=5)
    assert m[0].nonzero().flatten().tolist() == list(range(10)) + list(range(20, 30)) + list(range(35, 40))
    assert m[1].nonzero().flatten().tolist() == [0, 1, 2, 3] + list(range(35, 40))


def test_index_cache_adopts_shared_prefix_and_evicts_by_bytes():
    from sgl_sparsekv.index import stored
    from sgl_sparsekv.index_cache import IndexCache
    from sgl_sparsekv.store import UnitStore

    store = UnitStore(num_slots=64)
    gen = torch.Generator().manual_seed(0)
    ids = [store.add_unkeyed(i * 10, i * 10 + 10) for i in range(12)]
    store.key(ids, list(range(12)))
    lens = torch.full((12,), 10)
    index = build_index(_keys("random", 2, 12, 16, gen), lens, 2.0, 64, 5)
    one = index.pack().nbytes()   # the cache keeps centroids as the pools store them
    cache = IndexCache(store, max_bytes=int(2.5 * one))
    cache.add(ids, lens, index.pack())
    assert all(int(store.refs[i]) == 3 for i in ids)  # slot + caller + cache
    # a request sharing the first 10 units adopts the index truncated to them, with valid bookkeeping; the entry
    # stays whole
    found = cache.find(ids[:10] + [ids[11]])
    assert found is not None and found[1] == 10
    entry = cache.entries[found[0]].index
    assert entry.index.fine_mu.dtype == entry.index.coarse_mu.dtype == torch.int8
    whole = entry.index.clone()
    adopted = cache.adopt(*found)
    assert adopted.num_chunks == 10 and int(adopted.index.fine_tokens.sum()) == 2 * 100
    assert all(torch.equal(getattr(entry.index, k), t) for k, t in vars(whole).items())
    assert torch.equal(adopted.unpack().fine_mu, stored(index.fine_mu))   # the centroids the pools would hold
    assert cache.find(ids[:5] + ids[6:]) is None  # shares too little
    # byte cap: older entries go, releasing their unit references
    for n in (11, 10):
        cache.add(ids[:n], lens[:n], build_index(_keys("random", 2, n, 16, gen), lens[:n], 2.0, 64, 5).pack())
    assert len(cache.entries) == 2 and cache.nbytes() <= 2.5 * one
    assert int(store.refs[ids[11]]) == 2  # the evicted 12-unit entry released it
    cache.clear()
    assert cache.nbytes() == 0 and all(int(store.refs[i]) == 2 for i in ids)


def test_grouped_build_equals_one_build():
    gen = torch.Generator().manual_seed(4)
    keys = F.normalize(torch.randn(6, 50, 16, generator=gen), dim=-1)
    lens = torch.randint(8, 17, (50,), generator=gen)
    one = build_index(keys, lens, 2.0, 64, 5)
    grouped = build_index_grouped(keys, lens, 2.0, 64, 5, max_bytes=50 * 25 * 4 * 2)   # two heads a group
    for name, t in vars(one).items():
        assert torch.allclose(getattr(grouped, name), t, atol=1e-6), name


@pytest.mark.parametrize("seed,max_coarse", [(0, 64), (1, 64), (2, 15), (3, 15)])
def test_a_prefix_and_its_own_segment_read_as_one_index(seed, max_coarse):
    """An adopted prefix's index (as the cache keeps it) and the prompt past it, whose topics are new, clustered
    into a segment of its own (what a request that adopts a cached prefix decodes over): their union counts every
    chunk once, every bound holds, fine clusters stay grouped by coarse unit, the prefix's chunks keep their
    clusters, and a needle in the new part is found at a small budget. (Grafting these chunks one by one into the
    prefix's clusters instead loses the needle for every seed here: they inflate the radii.) With max_coarse 15
    the prefix alone fills its coarse level."""
    gen = torch.Generator().manual_seed(seed)
    H, M1, M2, d, G = 2, 400, 120, 64, 3
    keys = torch.cat([_keys("clustered", H, M1, d, gen), _keys("clustered", H, M2, d, gen)], 1)
    q = torch.randn(H, G, d, generator=gen)
    needle = M1 + 70
    keys[:, needle] = F.normalize(q.mean(1) + 0.05 * torch.randn(H, d, generator=gen), dim=-1)
    lens = torch.randint(8, 17, (M1 + M2,), generator=gen)
    prefix = build_index(keys[:, :M1], lens[:M1], 2.0, max_coarse, 10).pack().unpack()   # as the cache keeps it
    assert (prefix.coarse_mu.shape[1] == max_coarse) == (max_coarse == 15)
    ix = union(prefix, build_index(keys[:, M1:], lens[M1:], 2.0, max_coarse, 10))
    assert ix.num_chunks == M1 + M2 and ix.fine_mu.dtype == torch.float32
    assert torch.equal(ix.fine_n.sum(1), torch.full((H,), float(M1 + M2)))
    assert torch.equal(ix.fine_tokens.sum(1), lens.sum().float().expand(H))
    assert torch.equal(ix.coarse_n.sum(1), ix.fine_n.sum(1))
    assert bool((ix.fine_parent.diff(dim=1) >= 0).all())   # grouped by coarse unit
    for h in range(H):
        assert torch.equal(torch.bincount(ix.chunk_fine[h], minlength=ix.fine_n.shape[1]).float(), ix.fine_n[h])
        assert torch.equal(ix.chunk_fine[h, :M1], prefix.chunk_fine[h])
        assert not set(ix.chunk_fine[h, :M1].tolist()) & set(ix.chunk_fine[h, M1:].tolist())
    for _ in range(5):
        _check_bounds(ix, keys, torch.randn(H, G, d, generator=gen) * 3)
    assert bool(select_chunks(ix, q * 4, 256, 4.0, "max")[:, needle].all())


@pytest.mark.parametrize("weight", [0.0, 0.25, 1.0])
def test_radius_weight_ranks_by_scaled_bound(weight):
    """select_clusters with every coarse unit expanded equals brute force: fine clusters in order of
    max over the group of q.mu + weight |q| r, taken while their tokens fit the budget."""
    gen = torch.Generator().manual_seed(5)
    H, M, d, G, budget = 2, 300, 32, 3, 400
    keys = _keys("clustered", H, M, d, gen)
    lens = torch.randint(8, 17, (M,), generator=gen)
    index = build_index(keys, lens, 2.0, 64, 10)
    q = torch.randn(H, G, d, generator=gen) * 3
    got = select_clusters(index, q, budget, 1e9, "max", radius_weight=weight)
    score = (torch.einsum("hgd,hld->hgl", q, index.fine_mu) + q.norm(dim=-1)[..., None] * weight
             * index.fine_r.clamp_min(0)[:, None]).amax(1)
    for h in range(H):
        live = index.fine_n[h] > 0
        order = sorted((i for i in range(score.shape[1]) if live[i]), key=lambda i: (-float(score[h, i]), i))
        want, used = torch.zeros_like(got[h]), 0.0
        for i in order:
            if used + float(index.fine_tokens[h, i]) > budget:
                break
            used += float(index.fine_tokens[h, i])
            want[i] = True
        assert torch.equal(got[h], want), (weight, h)
    if weight == 0.0:   # the radius term changes the ranking here (else the test would not tell weights apart)
        assert not torch.equal(got, select_clusters(index, q, budget, 1e9, "max"))


def test_budget_per_head_selects_what_each_heads_own_budget_selects():
    gen = torch.Generator().manual_seed(5)
    keys = _keys("clustered", 3, 300, 64, gen)
    lens = torch.randint(8, 17, (300,), generator=gen)
    index = build_index(keys, lens, 2.0, 64, 10)
    q = torch.randn(3, 2, 64, generator=gen) * 2
    budgets = [64, 400, 0]
    got = select_clusters(index, q, torch.tensor(budgets, dtype=torch.float32)[:, None], 4.0, "max", 0.25)
    for h, b in enumerate(budgets):
        assert torch.equal(got[h], select_clusters(index, q, b, 4.0, "max", 0.25)[h])


def _token_chunks(H, M, d, gen, needle=None):
    """Raw token keys [H, T, d] of M chunks of 8-16 tokens, and per chunk its unit key, key min and max and
    length. ``needle`` (a direction [H, d]): the tokens lean toward it, those of chunk 0 less than the others,
    and one token of chunk 0 points along it, strongly."""
    lengths = torch.randint(8, 17, (M,), generator=gen)
    toks = torch.randn(H, int(lengths.sum()), d, generator=gen)
    if needle is not None:
        toks = 0.3 * toks + 1.5 * needle[:, None]
        toks[:, :int(lengths[0])] -= 0.9 * needle[:, None]
        toks[:, 3] = 6 * needle
    ends = torch.cumsum(lengths, 0)
    spans = [slice(int(e - n), int(e)) for e, n in zip(ends, lengths)]
    keys = F.normalize(torch.stack([toks[:, sp].mean(1) for sp in spans], 1), dim=-1)
    boxes = torch.stack([torch.stack([toks[:, sp].amin(1), toks[:, sp].amax(1)], 1) for sp in spans], 1)
    return toks, spans, keys, boxes, lengths


def test_fine_boxes_bound_every_token_key_through_builds_grafts_and_storage():
    """Every fine box covers the raw keys of every token of its chunks, so its bound at weight 1 is Quest's
    sum_i max(q_i lo_i, q_i hi_i) and never below any of those tokens' q.k; grafts grow boxes to cover the new
    chunk's tokens as well; storing a stored box gives it back."""
    gen = torch.Generator().manual_seed(5)
    H, M, d, G = 2, 60, 16, 3
    toks, spans, keys, boxes, lengths = _token_chunks(H, M + 10, d, gen)
    ix = build_index(keys[:, :M], lengths[:M], 2.0, 64, 5, boxes[:, :M])
    for m in range(M, M + 10):
        graft_chunk(ix, keys[:, m], int(lengths[m]), boxes[:, m])
    assert ix.has_box and ix.fine_box.shape == (H, ix.fine_r.shape[1], 2, d)
    lo, hi = ix.fine_box[..., 0, :] - ix.fine_box[..., 1, :], ix.fine_box[..., 0, :] + ix.fine_box[..., 1, :]
    q = torch.randn(H, G, d, generator=gen)
    bound = box_bound(q, ix.fine_box, 1.0, "max")
    quest = torch.maximum(q[:, :, None] * lo[:, None], q[:, :, None] * hi[:, None]).sum(-1).amax(1)
    assert torch.allclose(bound, quest, atol=1e-4)
    for m, sp in enumerate(spans):
        c = ix.chunk_fine[:, m]                                                    # [H]
        t = toks[:, sp]                                                            # [H, n, d]
        at = c[:, None, None].expand(-1, 1, d)
        assert (t >= lo.gather(1, at) - 1e-5).all() and (t <= hi.gather(1, at) + 1e-5).all(), m
        best = torch.einsum("hgd,hnd->hgn", q, t).amax(-1).amax(-1)
        assert (bound.gather(1, c[:, None])[:, 0] >= best - 1e-4).all(), m
    assert torch.equal(quantize_box(ix.fine_box).float(), ix.fine_box)
    packed = ix.pack()
    assert torch.equal(packed.unpack().fine_box, ix.fine_box)
    back = union(packed.unpack(), ix)
    assert torch.equal(back.fine_box, torch.cat([ix.fine_box, ix.fine_box], 1))


def test_boxes_find_the_token_a_chunk_mean_hides():
    """One token of chunk 0 matches the query strongly; the other chunks' tokens all lean toward it more than
    chunk 0's others do, so chunk 0's mean key ranks below theirs. At a budget of one chunk the boxes take chunk 0 in every head; the
    centroids, ranked by their bounds, do not."""
    gen = torch.Generator().manual_seed(0)
    H, M, d = 2, 80, 32
    needle = F.normalize(torch.randn(H, d, generator=gen), dim=-1)
    _, _, keys, boxes, lengths = _token_chunks(H, M, d, gen, needle)
    q = needle[:, None]                                                            # [H, 1, d]
    ix = build_index(keys, lengths, 1.0, 64, 5, boxes)
    ball = ClusterIndex(**{**vars(ix), "fine_box": None})
    budget = int(lengths[0])
    by_box = select_chunks(ix, q, budget, 1e6, "max", 1.0)
    by_ball = select_chunks(ball, q, budget, 1e6, "max", 1.0)
    assert by_box[:, 0].all() and by_box.sum(1).tolist() == [1] * H
    assert not by_ball[:, 0].any()
