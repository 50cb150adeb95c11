"""Token lists in device rows (sgl_sparsekv/tier_rows.py) against plain emission: after the plan's loads, the
window pool's rows that the tier's lists name hold, list by list and in order, the KV that plain emission's slots
name in the host pool; across steps, chunks kept hot are not loaded again."""

import torch

from bench.packing import pack
from sgl_sparsekv.kernels.host_copy import copy_runs_ref
from sgl_sparsekv.kernels.select import emit_tokens_ref
from sgl_sparsekv.pool_ops import select_fine_ref
from sgl_sparsekv.residency import HotChunks
from sgl_sparsekv.tier_rows import SINK, device_lists, hot_chunks
from test_select_kernel import make_batch

H, G, D = 2, 2, 16
SINK_TOKENS, RECENT, WIDTH = 16, 32, 16


class Tier:
    """A host pool (one row per KV slot), a window pool holding each request's tail and, past its window rows, each
    request row's hot slots."""

    def __init__(self, seq, req_to_token, window_from, slots, gen):
        self.slots_total = int(req_to_token.max()) + 1
        self.host_k, self.host_v = (torch.randn(self.slots_total, H, D, generator=gen) for _ in range(2))
        rows = req_to_token.shape[0]
        resident = [req_to_token[r + 1, w:int(seq[r])] for r, w in enumerate(window_from)]
        n_window = sum(len(t) for t in resident) + 1   # row 0: SGLang's "not resident"
        self.base = torch.arange(rows) * slots * WIDTH + n_window
        n = n_window + rows * slots * WIDTH
        self.win_k, self.win_v = torch.full((n, H, D), float("nan")), torch.full((n, H, D), float("nan"))
        self.to_window = torch.zeros(self.slots_total, dtype=torch.int64)
        at = 1
        for t in resident:   # window rows in no particular order
            w = at + torch.randperm(len(t), generator=gen)
            self.to_window[t.long()] = w
            self.win_k[w], self.win_v[w] = self.host_k[t.long()], self.host_v[t.long()]
            at += len(t)
        self.hot = HotChunks(rows, 1, H, slots, WIDTH, self.base)

    def step(self, sel, chunks, ranges, rows, seq, req_to_token, step, cap, dense_limit=0):
        bs = len(rows)
        table = hot_chunks(sel, chunks, ranges, seq, SINK_TOKENS, RECENT, self.hot.slots, dense_limit)
        list_req = rows.long().repeat_interleave(H)
        list_head = torch.arange(H).repeat(bs)
        plan = self.hot.plan(0, list_req, list_head, table.ids, table.starts, table.lens, req_to_token, step, 256)
        assert int(plan.needed[0]) <= 256
        copy_runs_ref(self.host_k.transpose(0, 1), self.host_v.transpose(0, 1), self.win_k.transpose(0, 1),
                      self.win_v.transpose(0, 1), plan.runs, plan.count)
        lens, windows = device_lists(table, plan.first, rows, seq, req_to_token, self.to_window, H, cap)
        return table, plan, lens, windows


def scenario(seed):
    gen = torch.Generator().manual_seed(seed)
    bs = 2
    indexes, starts, lens, q = make_batch(bs, H, G, D, [30, 45], gen)
    coarse, fine, chunks, ranges = pack(indexes, starts, lens, "cpu")
    seq = torch.tensor([int(s[-1] + l[-1]) + 20 for s, l in zip(starts, lens)], dtype=torch.int32)
    req_to_token = torch.zeros(bs + 2, 1024, dtype=torch.int32)
    perm = torch.randperm(5000, generator=gen).to(torch.int32) + 1
    at = 0
    for b in range(bs):
        S = int(seq[b])
        # mostly runs of consecutive slots, as SGLang's allocator gives them, cut at random points
        cuts = sorted(torch.randint(1, S, (6,), generator=gen).tolist())
        pieces, prev = [], 0
        for c in cuts + [S]:
            pieces.append(torch.arange(c - prev, dtype=torch.int32) + int(perm[at]) * 8)
            at, prev = at + 1, c
        req_to_token[b + 1, :S] = torch.cat(pieces)
    return gen, indexes, q, coarse, fine, chunks, ranges, seq, req_to_token


def check_lists(tier, seq, req_to_token, rows, lens, windows, ref_lens, ref_windows, cap):
    for b in range(len(rows)):
        for h in range(H):
            i = b * H + h
            n = int(ref_lens[i])
            assert int(lens[i]) == n, (b, h)
            slots = ref_windows[i * cap:i * cap + n].long()
            got = windows[i * cap:i * cap + n].long()
            assert torch.equal(tier.win_k[got, h], tier.host_k[slots, h]), (b, h)
            assert torch.equal(tier.win_v[got, h], tier.host_v[slots, h]), (b, h)


def test_device_rows_read_what_plain_emission_reads_and_hot_chunks_stay():
    gen, indexes, q, coarse, fine, chunks, ranges, seq, req_to_token = scenario(0)
    rows = torch.tensor([1, 2], dtype=torch.int32)
    cap = 400
    tier = Tier(seq, req_to_token, [int(s) - RECENT for s in seq], slots=40, gen=gen)
    budget = torch.tensor([160, 160], dtype=torch.int32)
    loaded = []
    for step, qs in enumerate([q, q, q + 0.3 * torch.randn(q.shape, generator=gen)]):
        sel = select_fine_ref(qs, coarse, fine, ranges, budget, 16.0)
        ref_lens, ref_windows = emit_tokens_ref(sel, chunks, ranges, rows, seq, req_to_token, SINK_TOKENS, RECENT,
                                                cap)
        table, plan, lens, windows = tier.step(sel, chunks, ranges, rows, seq, req_to_token, step, cap)
        check_lists(tier, seq, req_to_token, rows, lens, windows, ref_lens, ref_windows, cap)
        assert (table.ids[:, 0] == SINK).all()   # every list reads the sink first
        loaded.append((int(plan.hit_rows[0]), int(plan.miss_rows[0])))
    assert loaded[0][0] == 0 and loaded[0][1] > 0       # a cold buffer loads all it reads
    assert loaded[1][1] == 0 and loaded[1][0] > 0       # the same selection again: all hot
    assert loaded[2][0] > 0                             # a nearby query: the sink and shared chunks stay hot


def test_requests_within_the_dense_limit_read_through_the_window():
    gen, indexes, q, coarse, fine, chunks, ranges, seq, req_to_token = scenario(1)
    rows = torch.tensor([1, 2], dtype=torch.int32)
    cap = 1024
    limit = int(seq.max())
    tier = Tier(seq, req_to_token, [0, 0], slots=40, gen=gen)
    sel = select_fine_ref(q, coarse, fine, ranges, torch.tensor([160, 160], dtype=torch.int32), 16.0)
    ref_lens, ref_windows = emit_tokens_ref(sel, chunks, ranges, rows, seq, req_to_token, SINK_TOKENS, RECENT, cap,
                                            dense_limit=limit)
    table, plan, lens, windows = tier.step(sel, chunks, ranges, rows, seq, req_to_token, 0, cap, dense_limit=limit)
    assert (table.ids == -1).all() and int(plan.count[0]) == 0
    check_lists(tier, seq, req_to_token, rows, lens, windows, ref_lens, ref_windows, cap)
