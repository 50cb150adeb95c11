"""The batched selection kernels against the torch reference (sgl_sparsekv/select.py)."""

import pytest
import torch
import torch.nn.functional as F

from sgl_sparsekv.index import ClusterIndex, build_index, empty_index, union, upper_bound
from bench.packing import over_shared, pack, pack_box
from sgl_sparsekv.kernels.select import (RANGE_FIELDS, RequestRanges, Segment, batch_ranges, emit_tokens, emit_tokens_ref,
                                         scratch, select_fine)
from sgl_sparsekv.pool_ops import select_fine_ref
from sgl_sparsekv.select import select_clusters, units_to_token_mask

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NEG = float("-inf")


def own_rows(ranges, b):
    """Request ``b``'s scratch rows in a ``pack``ed batch (its index is its own segment)."""
    r = batch_ranges(ranges, b + 1)[b]
    so, L = r.scratch_at, r.own.fine
    return slice(so, so + L)


def make_batch(bs, H, G, D, chunks_per_req, gen, noise=1.0, box=False):
    """``box``: the indexes carry fine boxes over made-up chunk key bounds around their keys."""
    indexes, starts, lens, qs = [], [], [], []
    for b in range(bs):
        M = chunks_per_req[b]
        centers = torch.randn(H, 5, D, generator=gen) * 2
        pick = torch.randint(0, 5, (H, M), generator=gen)
        keys = F.normalize(centers.gather(1, pick[..., None].expand(-1, -1, D)) + noise * torch.randn(H, M, D, generator=gen),
                           dim=-1)
        ln = torch.randint(8, 17, (M,), generator=gen)
        st = torch.cumsum(ln, 0) - ln + 16  # chunks start after a 16-token sink
        spread = torch.rand(H, M, 2, D, generator=gen)
        boxes = torch.stack([keys - spread[:, :, 0], keys + spread[:, :, 1]], 2) if box else None
        indexes.append(build_index(keys, ln, 2.0, 64, 5, boxes))
        starts.append(st)
        lens.append(ln)
        qs.append(torch.randn(H * G, D, generator=gen) * 2)
    return indexes, starts, lens, torch.stack(qs)


@pytest.mark.parametrize("G,D,dtype", [(1, 64, torch.float32), (3, 64, torch.float32), (4, 128, torch.float32),
                                       (7, 64, torch.float32), (4, 128, torch.bfloat16), (3, 64, torch.bfloat16)])
def test_select_fine_matches_reference(G, D, dtype):
    """bf16 queries take the fine bounds' tensor-core path (fp32 ones the FMA path); the reference scores the same
    query values in fp32."""
    gen = torch.Generator().manual_seed(G * 10 + D)
    bs, H = 3, 2
    indexes, starts, lens, q = make_batch(bs, H, G, D, [40, 150, 7], gen)
    q = q.to(dtype)
    coarse, fine, chunks, ranges = pack(indexes, starts, lens, DEV)
    budgets = [100, 400, 10_000]
    for expand, parts, rw, band in ((1.0, 1, 1.0, (64, 1 << 16)), (4.0, 3, 1.0, (2, 1 << 10)), (1e6, 8, 1.0, (64, 1)),
                                    (4.0, 3, 0.25, (256, 1 << 40)), (1.0, 2, 0.0, (64, 1 << 16))):
        sel = select_fine(q.to(DEV), coarse, fine, ranges, torch.tensor(budgets, dtype=torch.int32, device=DEV),
                          expand, parts=parts, radius_weight=rw, cut_band=band).cpu()
        for b, ix in enumerate(indexes):
            ref = select_clusters(ix, q[b].float().view(H, G, D), budgets[b], expand, "max", rw)
            got = sel[:, own_rows(ranges, b)] > 0
            assert torch.equal(got, ref), (b, expand, rw)


@pytest.mark.parametrize("G,D,dtype", [(1, 64, torch.float32), (4, 128, torch.float32), (4, 128, torch.bfloat16),
                                       (3, 64, torch.bfloat16)])
def test_select_fine_by_boxes_matches_reference(G, D, dtype):
    """Fine clusters ranked by their boxes (``fine_bound`` "box"): the kernel (FMA path for fp32 queries, tensor
    cores for bf16), its twin and the reference pick the same clusters, and the boxes change the pick."""
    gen = torch.Generator().manual_seed(G * 10 + D + 1)
    bs, H = 3, 2
    indexes, starts, lens, q = make_batch(bs, H, G, D, [40, 150, 7], gen, box=True)
    q = q.to(dtype)
    coarse, fine, chunks, ranges = pack(indexes, starts, lens, DEV)
    box = pack_box(indexes, DEV)
    budgets = torch.tensor([100, 400, 10_000], dtype=torch.int32, device=DEV)
    changed = 0
    for expand, parts, rw in ((1.0, 1, 1.0), (4.0, 3, 0.25), (1e6, 8, 1.0)):
        sel = select_fine(q.to(DEV), coarse, fine, ranges, budgets, expand, parts=parts, radius_weight=rw,
                          box=box).cpu()
        twin = select_fine_ref(q.to(DEV), coarse, fine, ranges, budgets, expand, radius_weight=rw, box=box).cpu()
        for b, ix in enumerate(indexes):
            ref = select_clusters(ix, q[b].float().view(H, G, D), int(budgets[b]), expand, "max", rw)
            assert torch.equal(sel[:, own_rows(ranges, b)] > 0, ref), (b, expand, rw)
            assert torch.equal(twin[:, own_rows(ranges, b)] > 0, ref), (b, expand, rw)
            ball = select_clusters(ClusterIndex(**{**vars(ix), "fine_box": None}), q[b].float().view(H, G, D),
                                   int(budgets[b]), expand, "max", rw)
            changed += int((ball != ref).sum())
    assert changed > 0


@pytest.mark.parametrize("value_steps", [0, 1, 12, 64])
def test_cut_value_passes_pick_what_key_passes_pick(value_steps):
    """The cut's first passes halve the bounds' value interval (``kernels.select.CUT_VALUE_STEPS``), the rest its
    key interval: any number of value passes gives the reference's picks. Including a cut at a bound near zero
    (queries along the first axis and the centroid score alone, so a bound is a centroid's first element, which for
    one cluster per request is one code step): keys crowd there, and halving the values alone takes 15-16 passes to
    reach the band, more than the default's 12, after which key passes finish."""
    from sgl_sparsekv.index import centroid_scale

    gen = torch.Generator().manual_seed(21)
    bs, H, G, D = 3, 2, 1, 64
    indexes, starts, lens, q = make_batch(bs, H, G, D, [90, 160, 40], gen)
    axis = torch.zeros(bs, H * G, D)
    axis[..., 0] = 1.0
    budgets = []
    for ix in indexes:   # head 0: cluster 3's bound is one code step, and the budget overflows there
        ix.fine_mu[0, 3, 0] = centroid_scale(ix.fine_mu[0, 3])
        ub = ix.fine_mu[0, :, 0].masked_fill(ix.fine_r[0] == NEG, NEG)
        assert 0 < ub[3] < 0.01 and not ((ub > 0) & (ub < ub[3])).any()
        budgets.append(int(ix.fine_tokens[0][ub > ub[3]].sum() + ix.fine_tokens[0, 3] // 2))
    coarse, fine, chunks, ranges = pack(indexes, starts, lens, DEV)
    for query, rw, budget in ((axis, 0.0, budgets), (q, 1.0, [70, 600, 200])):
        sel = select_fine(query.to(DEV), coarse, fine, ranges, torch.tensor(budget, dtype=torch.int32, device=DEV),
                          1e6, parts=2, radius_weight=rw, cut_value_steps=value_steps).cpu()
        for b, ix in enumerate(indexes):
            ref = select_clusters(ix, query[b].view(H, G, D), budget[b], 1e6, "max", rw)
            assert torch.equal(sel[:, own_rows(ranges, b)] > 0, ref), (b, rw)
            assert rw or (ref[0, 3] == 0 and ref[0].sum() > 0)   # the cut falls at the near-zero bound


def tie_pairs(ix):
    """``ix`` with each odd fine cluster's centroid and radius copied from the cluster before it, where both are
    live: the two tie exactly on their bound for every query, so a cut between them must take the first."""
    mu, r = ix.fine_mu.clone(), ix.fine_r.clone()
    even = slice(0, r.shape[1] - 1, 2)
    both = (r[:, 1::2] > NEG) & (r[:, even] > NEG)
    mu[:, 1::2] = torch.where(both[..., None], mu[:, even], mu[:, 1::2])
    r[:, 1::2] = torch.where(both, r[:, even], r[:, 1::2])
    return type(ix)(**{**vars(ix), "fine_mu": mu, "fine_r": r})


# the cut's path for each request of the tie test (30, 100 and 5 fine clusters, of which 12-14, 51-59 and 5 live
# per head) by cut_block: a register tile over all its clusters, over the live ones listed first, or passes over memory
CUT_PATHS = {16: ("memory", "memory", "registers"), 64: ("live list", "memory", "registers"),
             128: ("registers", "registers", "registers"), 256: ("registers", "live list", "registers"),
             4096: ("registers", "registers", "registers")}


@pytest.mark.parametrize("cut_band", [(64, 1 << 16), (1, 1 << 16), (4, 1), (256, 1 << 40)])
@pytest.mark.parametrize("cut_block", list(CUT_PATHS))
def test_select_fine_ties_and_every_cut_path(cut_block, cut_band):
    """Pairs of live fine clusters tie exactly on their bound (``tie_pairs``), and the cut must take them in index
    order like the stable sort, on each of its paths (``CUT_PATHS``): a request with more than a quarter of the
    block in clusters lists its live ones first and cuts those if they fit a quarter, else takes the smallest tile
    that holds all its clusters (128: the second request's list is too long, its 100 clusters fit the block), else
    passes over memory. ``cut_band``: the cut's last passes on the band's few clusters gathered (the default;
    (256, 2^40): every cluster is the band), or on all of them where the band holds more than its tile (the pass
    over memory's tile is 8 times the register cut's)."""
    gen = torch.Generator().manual_seed(3)
    bs, H, G, D = 3, 2, 2, 64
    indexes, starts, lens, q = make_batch(bs, H, G, D, [60, 200, 9], gen, noise=0.3)
    indexes = [tie_pairs(ix) for ix in indexes]
    coarse, fine, chunks, ranges = pack(indexes, starts, lens, DEV)
    budgets = [50, 333, 10_000]
    out = scratch(fine[1].shape[0], H, DEV)
    sel = select_fine(q.to(DEV), coarse, fine, ranges, torch.tensor(budgets, dtype=torch.int32, device=DEV),
                      4.0, parts=2, cut_block=cut_block, cut_band=cut_band, out=out).cpu()
    split_pairs = 0
    for b, ix in enumerate(indexes):
        ref = select_clusters(ix, q[b].view(H, G, D), budgets[b], 4.0, "max")
        got = sel[:, own_rows(ranges, b)] > 0
        assert torch.equal(got, ref), b
        L, live, quarter = ref.shape[1], (out[0][:, own_rows(ranges, b)].cpu() > NEG).sum(1), cut_block // 4
        path = ("registers" if L <= quarter else "live list" if (live <= quarter).all() else
                "registers" if L <= cut_block else "memory")
        assert path == CUT_PATHS[cut_block][b], (b, L, live)
        ub = upper_bound(q[b].view(H, G, D), ix.fine_mu, ix.fine_r, "max")
        even = slice(0, L - 1, 2)
        tied = (ub[:, 1::2] == ub[:, even]) & (ub[:, 1::2] > NEG)
        split_pairs += int((tied & (got[:, 1::2] != got[:, even])).sum())
    assert split_pairs > 0   # some cut fell inside a tied pair, where only index order decides


def with_childless_units(ix, every: int = 2):
    """``ix`` with an empty coarse unit (no fine cluster, radius -inf) before every ``every``-th unit, parents
    renumbered: fine-cluster runs of length zero, which k-means can leave, in the middle and at both ends."""
    P = ix.coarse_r.shape[1]
    new_of = torch.arange(P) + torch.arange(P) // every + 1   # one empty unit first, then one per ``every``
    Pn = P + P // every + 1 + 1                                 # and one at the end
    H = ix.coarse_mu.shape[0]

    def spread(t, fill):
        out = torch.full((H, Pn, *t.shape[2:]), fill, dtype=t.dtype)
        out[:, new_of] = t
        return out

    return type(ix)(**{**vars(ix), "coarse_mu": spread(ix.coarse_mu, 0.0), "coarse_r": spread(ix.coarse_r, NEG),
                       "coarse_n": spread(ix.coarse_n, 0.0), "coarse_tokens": spread(ix.coarse_tokens, 0.0),
                       "fine_parent": new_of[ix.fine_parent]})


def test_select_fine_skips_childless_units():
    """Coarse units without a fine cluster (k-means can leave them; radius -inf) are never expanded and shift no fine
    cluster's parent: the kernels pick what the reference picks, with every split of the bounds among programs."""
    gen = torch.Generator().manual_seed(11)
    bs, H, G, D = 3, 2, 2, 64
    indexes, starts, lens, q = make_batch(bs, H, G, D, [80, 140, 6], gen)
    indexes = [with_childless_units(ix, e) for ix, e in zip(indexes, (2, 3, 1))]
    coarse, fine, chunks, ranges = pack(indexes, starts, lens, DEV)
    budgets = [90, 500, 10_000]
    for parts in (1, 3, 8):
        sel = select_fine(q.to(DEV), coarse, fine, ranges, torch.tensor(budgets, dtype=torch.int32, device=DEV),
                          4.0, parts=parts).cpu()
        for b, ix in enumerate(indexes):
            ref = select_clusters(ix, q[b].view(H, G, D), budgets[b], 4.0, "max")
            assert torch.equal(sel[:, own_rows(ranges, b)] > 0, ref), (b, parts)


@pytest.mark.parametrize("parts", [4, 128])
def test_emit_matches_reference_mask(parts):
    """Token lists hold exactly the reference mask's tokens, with every split of the chunk scan among programs (128:
    what a batch of one uses in the server, ``pooled_decode.parts_for``)."""
    gen = torch.Generator().manual_seed(5)
    bs, H, G, D = 2, 2, 3, 64
    indexes, starts, lens, q = make_batch(bs, H, G, D, [60, 90], gen)
    coarse, fine, chunks, ranges = pack(indexes, starts, lens, DEV)
    budget, sink, recent, cap = 300, 16, 64, 300 + 16
    seq = torch.tensor([int(s[-1] + l[-1]) + 10 for s, l in zip(starts, lens)], dtype=torch.int32)
    req_to_token = torch.zeros(4, 4096, dtype=torch.int32)
    for b in range(bs):
        req_to_token[b + 1, :int(seq[b])] = torch.randperm(100_000, generator=gen)[:int(seq[b])].to(torch.int32) + 1
    rem = torch.tensor([budget - sink - recent] * bs, dtype=torch.int32, device=DEV)
    sel = select_fine(q.to(DEV), coarse, fine, ranges, rem, 16.0)
    rows = torch.tensor([1, 2], dtype=torch.int32, device=DEV)
    lens_out, windows = emit_tokens(sel, chunks, ranges, rows, seq.to(DEV), req_to_token.to(DEV), sink, recent,
                                    cap, parts=parts)
    lens_out, windows = lens_out.cpu(), windows.cpu()
    for b, ix in enumerate(indexes):
        S = int(seq[b])
        unit_sel = select_clusters(ix, q[b].view(H, G, D), budget - sink - recent, 16.0, "max").gather(1, ix.chunk_fine)
        mask = units_to_token_mask(unit_sel, starts[b], starts[b] + lens[b], S, sink, recent)
        for h in range(H):
            want = sorted(req_to_token[b + 1, :S][mask[h]].tolist())
            i = b * H + h
            got = windows[i * cap:i * cap + int(lens_out[i])].tolist()
            assert len(got) == len(set(got)) and sorted(got) == want, (b, h)


@pytest.mark.gpu
@pytest.mark.parametrize("cut_block,rw,heads,dtype", [(4096, 1.0, None, torch.float32),
                                                      (512, 1.0, None, torch.float32),
                                                      (4096, 0.25, None, torch.float32),
                                                      (4096, 0.25, [1, 4, 7], torch.float32),
                                                      (4096, 0.25, None, torch.bfloat16),
                                                      (512, 0.25, [1, 4, 7], torch.bfloat16)])
def test_select_and_emit_real_shapes(cut_block, rw, heads, dtype):
    """Llama-3.1-8B shape (8 KV heads x 4, d 128), 8 requests of ~40K-60K tokens, budget 1024; ``cut_block``
    512 takes the cut's pass over memory (by default requests past 16384 fine clusters, about 196K tokens); ``rw``
    is the radius weight of the ranking; ``heads``: only these retrieve (hybrid heads), the others' rows stay as they
    were; bf16 queries (a served model's) score the fine bounds on the tensor cores."""
    gen = torch.Generator().manual_seed(0)
    bs, H, G, D = 8, 8, 4, 128
    chunks = torch.randint(3000, 5000, (bs,), generator=gen).tolist()
    indexes, starts, lens, q = make_batch(bs, H, G, D, chunks, gen)
    q = q.to(dtype)
    coarse, fine, chunk_pool, ranges = pack(indexes, starts, lens, DEV)
    sink, recent, budget = 16, 64, 1024
    rem = torch.full((bs,), budget - sink - recent, dtype=torch.int32, device=DEV)
    hs = None if heads is None else torch.tensor(heads, dtype=torch.int32, device=DEV)
    out = (scratch(fine[1].shape[0], H, DEV)[0], torch.full((H, fine[1].shape[0]), 7.0, device=DEV))
    sel = select_fine(q.to(DEV), coarse, fine, ranges, rem, 16.0, cut_block=cut_block, radius_weight=rw,
                      out=out, heads=hs)
    seq = torch.tensor([int(s[-1] + l[-1]) + 5 for s, l in zip(starts, lens)], dtype=torch.int32)
    req_to_token = torch.arange(bs * 70_000, dtype=torch.int32).view(bs, 70_000) + 1
    rows = torch.arange(bs, dtype=torch.int32, device=DEV)
    lists = (torch.full((bs * H,), -1, dtype=torch.int32, device=DEV),
             torch.full((bs * H * budget,), -1, dtype=torch.int32, device=DEV),
             torch.empty(bs * H * 8, dtype=torch.int32, device=DEV))
    lens_out, windows = emit_tokens(sel, chunk_pool, ranges, rows, seq.to(DEV), req_to_token.to(DEV), sink,
                                    recent, budget, out=lists, heads=hs)
    sel, lens_out, windows = sel.cpu(), lens_out.cpu(), windows.cpu()
    for b, ix in enumerate(indexes):
        ref = select_clusters(ix, q[b].view(H, G, D).float(), budget - sink - recent, 16.0, "max", rw)
        S = int(seq[b])
        mask = units_to_token_mask(ref.gather(1, ix.chunk_fine), starts[b], starts[b] + lens[b], S, sink, recent)
        for h in range(H):
            got_sel = sel[h, own_rows(ranges, b)]
            i = b * H + h
            if heads is not None and h not in heads:
                assert (got_sel == 7.0).all() and int(lens_out[i]) == -1, (b, h)
                assert (windows[i * budget:(i + 1) * budget] == -1).all(), (b, h)
                continue
            assert torch.equal(got_sel > 0, ref[h]), (b, h)
            got = windows[i * budget:i * budget + int(lens_out[i])]
            assert sorted(got.tolist()) == sorted(req_to_token[b, :S][mask[h]].tolist())


@pytest.mark.parametrize("ops", [(select_fine, emit_tokens), (select_fine_ref, emit_tokens_ref)])
def test_retrieval_heads_only_touch_their_rows_and_lists(ops):
    """Hybrid heads: selection and emission for a subset of KV heads equal the all-heads run on those heads and
    leave every other head's selection and list as they were (kernels and their twins alike)."""
    select, emit = ops
    gen = torch.Generator().manual_seed(9)
    bs, H, G, D = 2, 3, 2, 64
    indexes, starts, lens, q = make_batch(bs, H, G, D, [70, 40], gen)
    coarse, fine, chunks, ranges = pack(indexes, starts, lens, DEV)
    cap, sink, recent = 200, 16, 64
    seq = torch.tensor([int(s[-1] + l[-1]) + 10 for s, l in zip(starts, lens)], dtype=torch.int32, device=DEV)
    r2t = (torch.arange(3 * 2048, dtype=torch.int32).view(3, 2048) + 1).to(DEV)
    rows = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    rem = torch.tensor([cap - sink - recent] * bs, dtype=torch.int32, device=DEV)

    def run(heads, fill):
        out = (scratch(fine[1].shape[0], H, DEV)[0], torch.full((H, fine[1].shape[0]), fill, device=DEV))
        hs = None if heads is None else torch.tensor(heads, dtype=torch.int32, device=DEV)
        sel = select(q.to(DEV), coarse, fine, ranges, rem, 4.0, parts=2, out=out, heads=hs)
        lists = (torch.full((bs * H,), int(fill), dtype=torch.int32, device=DEV),
                 torch.full((bs * H * cap,), int(fill), dtype=torch.int32, device=DEV),
                 torch.empty(bs * H * 2, dtype=torch.int32, device=DEV))
        lens_out, windows = emit(sel, chunks, ranges, rows, seq, r2t, sink, recent, cap, parts=2, out=lists,
                                 heads=hs)
        return sel.cpu(), lens_out.cpu().view(bs, H), windows.cpu().view(bs, H, cap)

    (sel_all, lens_all, win_all), (sel, lens_part, win_part) = run(None, 0.0), run([2, 0], -3.0)
    mine = [0, 2]
    assert torch.equal(sel[mine], sel_all[mine]) and torch.equal(lens_part[:, mine], lens_all[:, mine])
    for b in range(bs):
        for h in mine:
            n = int(lens_all[b, h])
            assert n > sink + recent and torch.equal(win_part[b, h, :n], win_all[b, h, :n]), (b, h)
    assert (sel[1] == -3.0).all() and (lens_part[:, 1] == -3).all() and (win_part[:, 1] == -3).all()


@pytest.mark.parametrize("ops", [(select_fine, emit_tokens), (select_fine_ref, emit_tokens_ref)])
def test_requests_over_one_shared_segment(ops):
    """Three requests adopt one prefix's index (segment 0, the same rows for all) and each has its own segment
    after it (one holds no chunk yet: an empty cluster). Selection and token lists equal the reference on the
    union of the two segments, and the shared rows are read, never written."""
    select, emit = ops
    gen = torch.Generator().manual_seed(13)
    H, G, D = 2, 3, 64
    (shared,), (s0,), (l0,), _ = make_batch(1, H, G, D, [150], gen)
    own, own_starts, own_lens, q = make_batch(3, H, G, D, [30, 1, 45], gen)
    own[1] = empty_index(H, D, "cpu")
    own_starts[1], own_lens[1] = own_starts[1][:0], own_lens[1][:0]
    end = int(s0[-1] + l0[-1])
    own_starts = [st - 16 + end for st in own_starts]
    coarse, fine, chunks, packed = pack([shared, *own], [s0, *own_starts], [l0, *own_lens], DEV)
    ranges = torch.zeros(len(RANGE_FIELDS), 4, dtype=torch.int32, device=DEV)   # a spare column: fewer batch rows
    ranges[:, :3] = over_shared(packed, first_row=5)
    so = 5 + sum(shared.fine_r.shape[1] + ix.fine_r.shape[1] for ix in own)
    def pools():   # every tensor of the pools, centroid codes and scales included
        return [x for t in (*coarse, *fine, *chunks) for x in (t if isinstance(t, tuple) else (t,))]

    before = [t.clone() for t in pools()]
    sink, recent, cap = 16, 64, 400
    seq = torch.tensor([int(st[-1] + ln[-1]) + 20 if len(st) else end + 20 for st, ln in zip(own_starts, own_lens)],
                       dtype=torch.int32)
    r2t = (torch.randperm(3 * 4096, generator=gen).view(3, 4096).to(torch.int32) + 1)
    rem = torch.tensor([cap - sink - recent] * 3, dtype=torch.int32, device=DEV)
    sel = select(q.to(DEV), coarse, fine, ranges, rem, 4.0, parts=2, out=scratch(so, H, DEV), radius_weight=0.25)
    rows = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEV)
    lens_out, windows = emit(sel, chunks, ranges, rows, seq.to(DEV), r2t.to(DEV), sink, recent, cap, parts=2)
    assert all(torch.equal(a, b) for a, b in zip(before, pools()))
    sel, lens_out, windows = sel.cpu(), lens_out.cpu(), windows.cpu()
    for b in range(3):
        ix = union(shared, own[b])
        ref = select_clusters(ix, q[b].view(H, G, D), cap - sink - recent, 4.0, "max", 0.25)
        so_b = int(ranges[RANGE_FIELDS.index("scratch_at"), b])
        assert torch.equal(sel[:, so_b:so_b + ix.fine_r.shape[1]] > 0, ref), b
        starts, lens = torch.cat([s0, own_starts[b]]), torch.cat([l0, own_lens[b]])
        S = int(seq[b])
        mask = units_to_token_mask(ref.gather(1, ix.chunk_fine), starts, starts + lens, S, sink, recent)
        for h in range(H):
            i = b * H + h
            got = windows[i * cap:i * cap + int(lens_out[i])].tolist()
            assert sorted(got) == sorted(r2t[int(rows[b]), :S][mask[h]].tolist()), (b, h)
        assert ref.sum() > 0 and int(lens_out[b * H]) > sink + recent


@pytest.mark.parametrize("parts", [1, 3])
def test_rows_over_two_prefixes_interleaved(parts):
    """A batch mixing two adopted prefixes (rows 0, 3 over one, rows 2, 4 over the other), a row without one and a
    row without an index: the kernel computes each shared segment's bounds once, in the programs of its first row,
    for every row reading it. Selections equal the reference for the retrieval heads; the other head's picks and
    every row's scratch outside its own columns stay untouched."""
    gen = torch.Generator().manual_seed(21)
    H, G, D = 3, 2, 64
    prefixes, p_starts, p_lens, _ = make_batch(2, H, G, D, [120, 90], gen)
    own, own_starts, own_lens, q = make_batch(6, H, G, D, [20, 60, 5, 33, 12, 1], gen)
    coarse, fine, chunks, packed = pack([*prefixes, *own], [*p_starts, *own_starts], [*p_lens, *own_lens], DEV)
    adopted = [0, None, 1, 0, 1, None]
    packs = batch_ranges(packed, packed.shape[1])
    columns, at = [], 7
    for b, p in enumerate(adopted):
        r = RequestRanges(Segment() if p is None else packs[p].own, packs[2 + b].own, at)
        if b == 5:
            # a row without an index in the pools (dense fallback, padding)
            r = RequestRanges(Segment(), Segment(), at)
        columns.append(r.column())
        at += r.fines
    ranges = torch.tensor(columns, dtype=torch.int32, device=DEV).T.contiguous()
    L = torch.tensor([RequestRanges.of(c).fines for c in columns])
    rows = int(7 + L.sum()) + 5
    heads = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    rem = torch.tensor([100, 300, 60, 1000, 200, 50], dtype=torch.int32, device=DEV)
    got, want = (op(q.to(DEV), coarse, fine, ranges, rem, 3.0, parts=parts, heads=heads, radius_weight=0.5,
                    out=(torch.full((H, rows), -5.0, device=DEV), torch.full((H, rows), -7.0, device=DEV))).cpu()
                 for op in (select_fine, select_fine_ref))
    assert torch.equal(got, want)
    assert (got[1] == -7.0).all() and (got[:, :7] == -7.0).all() and (got[:, int(7 + L.sum()):] == -7.0).all()
    assert all((got[h, 7:int(7 + L.sum())] > 0).sum() > 0 for h in (0, 2))


@pytest.mark.parametrize("ops", [(select_fine, emit_tokens), (select_fine_ref, emit_tokens_ref)])
def test_emit_into_list_rows_skips_stale_rows(ops):
    """``lists_at``: a fresh batch row writes its lists at its list row (not its batch row); a row reusing lists
    of an earlier step (not fresh) leaves every list as it was."""
    select, emit = ops
    gen = torch.Generator().manual_seed(17)
    bs, H, G, D = 3, 2, 2, 64
    indexes, starts, lens, q = make_batch(bs, H, G, D, [50, 40, 60], gen)
    coarse, fine, chunks, ranges = pack(indexes, starts, lens, DEV)
    cap, sink, recent = 200, 16, 64
    seq = torch.tensor([int(s[-1] + l[-1]) + 10 for s, l in zip(starts, lens)], dtype=torch.int32, device=DEV)
    r2t = (torch.arange(3 * 2048, dtype=torch.int32).view(3, 2048) + 1).to(DEV)
    rows = torch.tensor([1, 2, 0], dtype=torch.int32, device=DEV)
    rem = torch.tensor([cap - sink - recent] * bs, dtype=torch.int32, device=DEV)
    sel = select(q.to(DEV), coarse, fine, ranges, rem, 4.0, parts=2)

    def run(lists_at, n_rows):
        lists = (torch.full((n_rows * H,), -1, dtype=torch.int32, device=DEV),
                 torch.full((n_rows * H * cap,), -1, dtype=torch.int32, device=DEV),
                 torch.empty(bs * H * 2, dtype=torch.int32, device=DEV))
        out = emit(sel, chunks, ranges, rows, seq, r2t, sink, recent, cap, parts=2, out=lists, lists_at=lists_at)
        return out[0].cpu().view(n_rows, H), out[1].cpu().view(n_rows, H, cap)

    lens_all, win_all = run(None, bs)
    at = tuple(torch.tensor(x, dtype=torch.int32, device=DEV) for x in ([4, 0, 2], [1, 0, 1]))
    lens_at, win_at = run(at, 5)
    for b, lr in ((0, 4), (2, 2)):
        assert torch.equal(lens_at[lr], lens_all[b]) and torch.equal(win_at[lr], win_all[b]), b
    assert (lens_at[[0, 1, 3]] == -1).all() and (win_at[[0, 1, 3]] == -1).all()
    assert (lens_all > sink + recent).all()
