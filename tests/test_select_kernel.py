"""The batched selection kernels against the torch reference (sgl_sparsekv/select.py)."""

import pytest
import torch
import torch.nn.functional as F

from sgl_sparsekv.index import build_index, upper_bound
from sgl_sparsekv.kernels.select import emit_tokens, pack, select_fine
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
@pytest.mark.parametrize("cut_block,rw", [(4096, 1.0), (512, 1.0), (4096, 0.25)])
def test_select_and_emit_real_shapes(cut_block, rw):
    """Llama-3.1-8B shape (8 KV heads x 4, d 128), 8 requests of ~40K-60K tokens, budget 1024; ``cut_block``
    512 takes the cut's pass over memory (requests past 4096 fine clusters, about 100K tokens); ``rw`` is the
    radius weight of the ranking."""
    gen = torch.Generator().manual_seed(0)
    bs, H, G, D = 8, 8, 4, 128
    chunks = torch.randint(3000, 5000, (bs,), generator=gen).tolist()
    indexes, starts, lens, q = make_batch(bs, H, G, D, chunks, gen)
    coarse, fine, chunk_pool, (co, pn, fo, ln, ko, mn) = pack(indexes, starts, lens, DEV)
    sink, recent, budget = 16, 64, 1024
    rem = torch.full((bs,), budget - sink - recent, dtype=torch.int32, device=DEV)
    sel = select_fine(q.to(DEV), coarse, fine, co, pn, fo, ln, rem, 16.0, cut_block=cut_block, radius_weight=rw)
    seq = torch.tensor([int(s[-1] + l[-1]) + 5 for s, l in zip(starts, lens)], dtype=torch.int32)
    req_to_token = torch.arange(bs * 70_000, dtype=torch.int32).view(bs, 70_000) + 1
    rows = torch.arange(bs, dtype=torch.int32, device=DEV)
    lens_out, windows = emit_tokens(sel, chunk_pool, fo, ko, mn, rows, seq.to(DEV), req_to_token.to(DEV), sink,
                                    recent, budget)
    sel, lens_out, windows = sel.cpu(), lens_out.cpu(), windows.cpu()
    for b, ix in enumerate(indexes):
        ref = select_clusters(ix, q[b].view(H, G, D).float(), budget - sink - recent, 16.0, "max", rw)
        assert torch.equal(sel[int(fo[b]):int(fo[b]) + int(ln[b])].T > 0, ref), b
        S = int(seq[b])
        mask = units_to_token_mask(ref.gather(1, ix.chunk_fine), starts[b], starts[b] + lens[b], S, sink, recent)
        for h in range(H):
            i = b * H + h
            got = windows[i * budget:i * budget + int(lens_out[i])]
            assert sorted(got.tolist()) == sorted(req_to_token[b, :S][mask[h]].tolist())


def test_emit_dense_requests_get_every_token():
    """Rows within ``dense_limit`` attend to all their tokens, whatever the index says."""
    gen = torch.Generator().manual_seed(9)
    bs, H, G, D = 2, 2, 1, 64
    indexes, starts, lens, q = make_batch(bs, H, G, D, [10, 12], gen)
    coarse, fine, chunks, (co, pn, fo, ln, ko, mn) = pack(indexes, starts, lens, DEV)
    sel = select_fine(q.to(DEV), coarse, fine, co, pn, fo, ln, torch.tensor([40, 40], dtype=torch.int32, device=DEV),
                      16.0)
    seq = torch.tensor([100, 150], dtype=torch.int32, device=DEV)
    req_to_token = (torch.arange(2 * 200, dtype=torch.int32).view(2, 200) + 7).to(DEV)
    rows = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    cap = 128
    lens_out, windows = emit_tokens(sel, chunks, fo, ko, mn, rows, seq, req_to_token, 4, 16, cap, dense_limit=cap)
    lens_out, windows = lens_out.cpu(), windows.cpu()
    assert lens_out.view(bs, H)[0].tolist() == [100, 100]                   # dense: everything
    assert (lens_out.view(bs, H)[1] <= cap).all()                           # sparse: within the cap
    assert windows[:100].tolist() == list(range(7, 107))


def test_twins_equal_kernels_on_bf16_pools():
    """select_fine_ref / emit_tokens_ref (the CPU path) equal the kernels on pools with bf16 centroids."""
    from sgl_sparsekv.index import CENTROID_DTYPE
    from sgl_sparsekv.kernels.select import emit_tokens_ref, select_fine_ref

    gen = torch.Generator().manual_seed(11)
    bs, H, G, D = 3, 2, 4, 64
    indexes, starts, lens, q = make_batch(bs, H, G, D, [70, 20, 130], gen)
    coarse, fine, chunks, (co, pn, fo, ln, ko, mn) = pack(indexes, starts, lens, DEV)
    coarse = (coarse[0].to(CENTROID_DTYPE), *coarse[1:])
    fine = (fine[0].to(CENTROID_DTYPE), *fine[1:])
    rem = torch.tensor([200, 90, 500], dtype=torch.int32, device=DEV)
    seq = torch.tensor([int(s[-1] + l[-1]) + 20 for s, l in zip(starts, lens)], dtype=torch.int32, device=DEV)
    seq[1] = 100   # within the dense limit: every token
    req_to_token = (torch.randperm(4 * 4096, generator=gen).view(4, 4096).to(torch.int32) + 1).to(DEV)
    rows = torch.tensor([3, 0, 2], dtype=torch.int32, device=DEV)
    got, want = [], []
    for select, emit, res in ((select_fine, emit_tokens, got), (select_fine_ref, emit_tokens_ref, want)):
        sel = select(q.to(DEV), coarse, fine, co, pn, fo, ln, rem, 16.0, parts=2)
        lens_out, windows = emit(sel, chunks, fo, ko, mn, rows, seq, req_to_token, 16, 64, 400, dense_limit=300)
        res += [sel.cpu(), lens_out.cpu(), windows.cpu()]
    rows_used = torch.cat([torch.arange(int(f), int(f) + int(n)) for f, n in zip(fo, ln)])
    assert torch.equal(got[0][rows_used], want[0][rows_used])
    assert torch.equal(got[1], want[1]) and int(got[1].view(bs, H)[1, 0]) == 100
    for i, n in enumerate(got[1].tolist()):
        assert torch.equal(got[2][i * 400:i * 400 + n], want[2][i * 400:i * 400 + n]), i
