"""The batched selection kernels against the torch reference (sgl_sparsekv/select.py)."""

import pytest
import torch
import torch.nn.functional as F

from sgl_sparsekv.index import build_index, upper_bound
from sgl_sparsekv.kernels.select import emit_tokens, emit_tokens_ref, pack, select_fine, select_fine_ref
from sgl_sparsekv.select import select_clusters, units_to_token_mask

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(bs, H, G, D, chunks_per_req, gen, noise=1.0):
    indexes, starts, lens, qs = [], [], [], []
    for b in range(bs):
        M = chunks_per_req[b]
        centers = torch.randn(H, 5, D, generator=gen) * 2
        pick = torch.randint(0, 5, (H, M), generator=gen)
        keys = F.normalize(centers.gather(1, pick[..., None].expand(-1, -1, D)) + noise * torch.randn(H, M, D, generator=gen),
                           dim=-1)
        ln = torch.randint(8, 17, (M,), generator=gen)
        st = torch.cumsum(ln, 0) - ln + 16  # chunks start after a 16-token sink
        indexes.append(build_index(keys, ln, 2.0, 64, 5))
        starts.append(st)
        lens.append(ln)
        qs.append(torch.randn(H * G, D, generator=gen) * 2)
    return indexes, starts, lens, torch.stack(qs)


@pytest.mark.parametrize("G,D", [(1, 64), (3, 64), (4, 128), (7, 64)])
def test_select_fine_matches_reference(G, D):
    gen = torch.Generator().manual_seed(G * 10 + D)
    bs, H = 3, 2
    indexes, starts, lens, q = make_batch(bs, H, G, D, [40, 150, 7], gen)
    coarse, fine, chunks, (co, pn, fo, ln, ko, mn) = pack(indexes, starts, lens, DEV)
    budgets = [100, 400, 10_000]
    for expand, parts, rw in ((1.0, 1, 1.0), (4.0, 3, 1.0), (1e6, 8, 1.0), (4.0, 3, 0.25), (1.0, 2, 0.0)):
        sel = select_fine(q.to(DEV), coarse, fine, co, pn, fo, ln, torch.tensor(budgets, dtype=torch.int32, device=DEV),
                          expand, parts=parts, radius_weight=rw).cpu()
        for b, ix in enumerate(indexes):
            ref = select_clusters(ix, q[b].view(H, G, D), budgets[b], expand, "max", rw)
            got = sel[int(fo[b]):int(fo[b]) + int(ln[b])].T > 0
            assert torch.equal(got, ref), (b, expand, rw)


@pytest.mark.parametrize("cut_block", [16, 4096])
def test_select_fine_ties_and_the_memory_pass(cut_block):
    """Chunks repeating five keys exactly: whole groups of fine clusters tie on their bound, and the cut must
    take them in index order like the stable sort. ``cut_block`` 16 sends every request through the pass
    over memory that requests with more than 4096 fine clusters take."""
    gen = torch.Generator().manual_seed(3)
    bs, H, G, D = 3, 2, 2, 64
    indexes, starts, lens, q = make_batch(bs, H, G, D, [60, 200, 9], gen, noise=0.0)
    coarse, fine, chunks, (co, pn, fo, ln, ko, mn) = pack(indexes, starts, lens, DEV)
    budgets = [50, 333, 10_000]
    sel = select_fine(q.to(DEV), coarse, fine, co, pn, fo, ln, torch.tensor(budgets, dtype=torch.int32, device=DEV),
                      4.0, parts=2, cut_block=cut_block).cpu()
    ties = 0
    for b, ix in enumerate(indexes):
        ref = select_clusters(ix, q[b].view(H, G, D), budgets[b], 4.0, "max")
        assert torch.equal(sel[int(fo[b]):int(fo[b]) + int(ln[b])].T > 0, ref), b
        ub = upper_bound(q[b].view(H, G, D), ix.fine_mu, ix.fine_r, "max")
        ties += sum(len(row) - len(set(row)) for row in ub.tolist())
    assert ties > 0


def test_emit_matches_reference_mask():
    gen = torch.Generator().manual_seed(5)
    bs, H, G, D = 2, 2, 3, 64
    indexes, starts, lens, q = make_batch(bs, H, G, D, [60, 90], gen)
    coarse, fine, chunks, (co, pn, fo, ln, ko, mn) = pack(indexes, starts, lens, DEV)
    budget, sink, recent, cap = 300, 16, 64, 300 + 16
    seq = torch.tensor([int(s[-1] + l[-1]) + 10 for s, l in zip(starts, lens)], dtype=torch.int32)
    req_to_token = torch.zeros(4, 4096, dtype=torch.int32)
    for b in range(bs):
        req_to_token[b + 1, :int(seq[b])] = torch.randperm(100_000, generator=gen)[:int(seq[b])].to(torch.int32) + 1
    rem = torch.tensor([budget - sink - recent] * bs, dtype=torch.int32, device=DEV)
    sel = select_fine(q.to(DEV), coarse, fine, co, pn, fo, ln, rem, 16.0)
    rows = torch.tensor([1, 2], dtype=torch.int32, device=DEV)
    lens_out, windows = emit_tokens(sel, chunks, fo, ko, mn, rows, seq.to(DEV), req_to_token.to(DEV), sink, recent,
                                    cap, parts=4)
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
@pytest.mark.parametrize("cut_block,rw,heads", [(4096, 1.0, None), (512, 1.0, None), (4096, 0.25, None),
                                                (4096, 0.25, [1, 4, 7])])
def test_select_and_emit_real_shapes(cut_block, rw, heads):
    """Llama-3.1-8B shape (8 KV heads x 4, d 128), 8 requests of ~40K-60K tokens, budget 1024; ``cut_block``
    512 takes the cut's pass over memory (requests past 4096 fine clusters, about 100K tokens); ``rw`` is the
    radius weight of the ranking; ``heads``: only these retrieve (hybrid heads), the others' rows stay as they were."""
    gen = torch.Generator().manual_seed(0)
    bs, H, G, D = 8, 8, 4, 128
    chunks = torch.randint(3000, 5000, (bs,), generator=gen).tolist()
    indexes, starts, lens, q = make_batch(bs, H, G, D, chunks, gen)
    coarse, fine, chunk_pool, (co, pn, fo, ln, ko, mn) = pack(indexes, starts, lens, DEV)
    sink, recent, budget = 16, 64, 1024
    rem = torch.full((bs,), budget - sink - recent, dtype=torch.int32, device=DEV)
    hs = None if heads is None else torch.tensor(heads, dtype=torch.int32, device=DEV)
    out = (torch.empty(fine[1].shape, device=DEV), torch.full(fine[1].shape, 7.0, device=DEV))
    sel = select_fine(q.to(DEV), coarse, fine, co, pn, fo, ln, rem, 16.0, cut_block=cut_block, radius_weight=rw,
                      out=out, heads=hs)
    seq = torch.tensor([int(s[-1] + l[-1]) + 5 for s, l in zip(starts, lens)], dtype=torch.int32)
    req_to_token = torch.arange(bs * 70_000, dtype=torch.int32).view(bs, 70_000) + 1
    rows = torch.arange(bs, dtype=torch.int32, device=DEV)
    lists = (torch.full((bs * H,), -1, dtype=torch.int32, device=DEV),
             torch.full((bs * H * budget,), -1, dtype=torch.int32, device=DEV),
             torch.empty(bs * H * 8, dtype=torch.int32, device=DEV))
    lens_out, windows = emit_tokens(sel, chunk_pool, fo, ko, mn, rows, seq.to(DEV), req_to_token.to(DEV), sink,
                                    recent, budget, out=lists, heads=hs)
    sel, lens_out, windows = sel.cpu(), lens_out.cpu(), windows.cpu()
    for b, ix in enumerate(indexes):
        ref = select_clusters(ix, q[b].view(H, G, D).float(), budget - sink - recent, 16.0, "max", rw)
        S = int(seq[b])
        mask = units_to_token_mask(ref.gather(1, ix.chunk_fine), starts[b], starts[b] + lens[b], S, sink, recent)
        for h in range(H):
            got_sel = sel[int(fo[b]):int(fo[b]) + int(ln[b]), h]
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
    coarse, fine, chunks, (co, pn, fo, ln, ko, mn) = pack(indexes, starts, lens, DEV)
    cap, sink, recent = 200, 16, 64
    seq = torch.tensor([int(s[-1] + l[-1]) + 10 for s, l in zip(starts, lens)], dtype=torch.int32, device=DEV)
    r2t = (torch.arange(3 * 2048, dtype=torch.int32).view(3, 2048) + 1).to(DEV)
    rows = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    rem = torch.tensor([cap - sink - recent] * bs, dtype=torch.int32, device=DEV)

    def run(heads, fill):
        out = (torch.empty(fine[1].shape, device=DEV), torch.full(fine[1].shape, fill, device=DEV))
        hs = None if heads is None else torch.tensor(heads, dtype=torch.int32, device=DEV)
        sel = select(q.to(DEV), coarse, fine, co, pn, fo, ln, rem, 4.0, parts=2, out=out, heads=hs)
        lists = (torch.full((bs * H,), int(fill), dtype=torch.int32, device=DEV),
                 torch.full((bs * H * cap,), int(fill), dtype=torch.int32, device=DEV),
                 torch.empty(bs * H * 2, dtype=torch.int32, device=DEV))
        lens_out, windows = emit(sel, chunks, fo, ko, mn, rows, seq, r2t, sink, recent, cap, parts=2, out=lists,
                                 heads=hs)
        return sel.cpu().T, lens_out.cpu().view(bs, H), windows.cpu().view(bs, H, cap)

    (sel_all, lens_all, win_all), (sel, lens_part, win_part) = run(None, 0.0), run([2, 0], -3.0)
    mine = [0, 2]
    assert torch.equal(sel[mine], sel_all[mine]) and torch.equal(lens_part[:, mine], lens_all[:, mine])
    for b in range(bs):
        for h in mine:
            n = int(lens_all[b, h])
            assert n > sink + recent and torch.equal(win_part[b, h, :n], win_all[b, h, :n]), (b, h)
    assert (sel[1] == -3.0).all() and (lens_part[:, 1] == -3).all() and (win_part[:, 1] == -3).all()
