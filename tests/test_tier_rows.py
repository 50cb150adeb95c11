"""Token lists in device rows (sgl_sparsekv/tier_rows.py) against plain emission: after the plan's loads, the
device rows that the tier's lists name hold, list by list and in order, the KV that plain emission's slots name in
the host pool; across steps, chunks kept hot are not loaded again."""

import torch

from bench.packing import pack
from sgl_sparsekv.kernels.host_copy import copy_runs_ref
from sgl_sparsekv.kernels.select import RANGE_FIELDS, ChunkRows, emit_tokens_ref
from sgl_sparsekv.pool_ops import select_fine_ref
from sgl_sparsekv.residency import HotChunks
from sgl_sparsekv.tier_rows import SINK, ChunkTable, device_lists, hot_chunks
from test_select_kernel import make_batch

H, G, D = 2, 2, 16
SINK_TOKENS, RECENT, WIDTH = 16, 32, 16


class Tier:
    """A host pool (one row per KV slot) and the sparse decode's device buffer: per owner (list row), its hot slots
    and a ring holding its last ``ring`` tokens."""

    def __init__(self, seq, req_to_token, owners, ring, slots, gen):
        self.slots_total = int(req_to_token.max()) + 1
        self.host_k, self.host_v = (torch.randn(self.slots_total, H, D, generator=gen) for _ in range(2))
        self.ring = ring
        span = slots * WIDTH + ring
        self.base = torch.arange(owners) * span + 7   # an owner's rows need not start at 0
        self.ring_base = self.base + slots * WIDTH
        n = 7 + owners * span
        self.dev_k, self.dev_v = torch.full((n, H, D), float("nan")), torch.full((n, H, D), float("nan"))
        self.hot = HotChunks(owners, 1, H, slots, WIDTH, self.base)

    def fill_ring(self, owner, req_row, S, req_to_token):
        """What the decode's KV writes leave there: positions S - ring .. S - 1 at p % ring."""
        pos = torch.arange(max(0, S - self.ring), S)
        at = self.ring_base[owner] + pos % self.ring
        slots = req_to_token[req_row, pos].long()
        self.dev_k[at], self.dev_v[at] = self.host_k[slots], self.host_v[slots]

    def step(self, sel, chunks, ranges, rows, seq, req_to_token, step, cap, owners, dense_limit=0):
        bs = len(rows)
        for o, r, S in zip(owners.tolist(), rows.tolist(), seq.tolist()):
            self.fill_ring(o, r, S, req_to_token)
        lists_at = (owners, torch.ones(bs, dtype=torch.int32))
        table = hot_chunks(sel, chunks, ranges, seq, SINK_TOKENS, RECENT, self.hot.slots, dense_limit,
                           lists_at=lists_at, out=None if owners.max() < bs else blank(owners, self.hot.slots))
        n = table.ids.shape[0]
        plan = self.hot.plan(0, torch.arange(n) // H, torch.arange(n) % H, table.ids, table.starts, table.lens,
                             req_to_token, step, 256, req_rows=by_owner(owners, rows, n // H).repeat_interleave(H))
        assert int(plan.needed[0]) <= 256
        copy_runs_ref(self.host_k.transpose(0, 1), self.host_v.transpose(0, 1), self.dev_k.transpose(0, 1),
                      self.dev_v.transpose(0, 1), plan.runs, plan.count)
        lens, windows = device_lists(table, plan.first, seq, self.ring_base, self.ring, H, cap, lists_at=lists_at)
        return table, plan, lens, windows


def blank(owners, K):
    n = (int(owners.max()) + 1) * H
    return ChunkTable(*(torch.full((n, K), -1, dtype=torch.int32) for _ in range(5)), torch.zeros(n, dtype=torch.int32))


def by_owner(owners, rows, n_owners):
    """Each owner's request row (0 for owners without a request this step: their lists are all padding)."""
    out = torch.zeros(n_owners, dtype=torch.int64)
    out[owners.long()] = rows.long()
    return out


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


def check_lists(tier, owners, lens, windows, ref_lens, ref_windows, cap):
    for b, o in enumerate(owners.tolist()):
        for h in range(H):
            i, j = b * H + h, o * H + h   # plain emission wrote list row b, the tier the owner's
            n = int(ref_lens[i])
            assert int(lens[j]) == n, (b, h)
            slots = ref_windows[i * cap:i * cap + n].long()
            got = windows[j * cap:j * cap + n].long()
            assert torch.equal(tier.dev_k[got, h], tier.host_k[slots, h]), (b, h)
            assert torch.equal(tier.dev_v[got, h], tier.host_v[slots, h]), (b, h)


def test_device_rows_read_what_plain_emission_reads_and_hot_chunks_stay():
    gen, indexes, q, coarse, fine, chunks, ranges, seq, req_to_token = scenario(0)
    rows = torch.tensor([1, 2], dtype=torch.int32)
    owners = torch.tensor([3, 0], dtype=torch.int32)   # list rows, not batch or request rows
    cap = 400
    tier = Tier(seq, req_to_token, owners=4, ring=RECENT + 4, slots=40, gen=gen)
    budget = torch.tensor([160, 160], dtype=torch.int32)
    loaded = []
    for step, qs in enumerate([q, q, q + 0.3 * torch.randn(q.shape, generator=gen)]):
        sel = select_fine_ref(qs, coarse, fine, ranges, budget, 16.0)
        ref_lens, ref_windows = emit_tokens_ref(sel, chunks, ranges, rows, seq, req_to_token, SINK_TOKENS, RECENT,
                                                cap)
        table, plan, lens, windows = tier.step(sel, chunks, ranges, rows, seq, req_to_token, step, cap, owners)
        check_lists(tier, owners, lens, windows, ref_lens, ref_windows, cap)
        assert (table.ids[owners.long() * H, 0] == SINK).all()   # every list reads the sink first
        loaded.append((int(plan.hit_rows[0]), int(plan.miss_rows[0])))
    assert loaded[0][0] == 0 and loaded[0][1] > 0       # a cold buffer loads all it reads
    assert loaded[1][1] == 0 and loaded[1][0] > 0       # the same selection again: all hot
    assert loaded[2][0] > 0                             # a nearby query: the sink and shared chunks stay hot
    seq += 3   # three tokens decoded since: the ring holds them, and the selection reads them as its tail
    sel = select_fine_ref(q, coarse, fine, ranges, budget, 16.0)
    ref_lens, ref_windows = emit_tokens_ref(sel, chunks, ranges, rows, seq, req_to_token, SINK_TOKENS, RECENT, cap)
    table, plan, lens, windows = tier.step(sel, chunks, ranges, rows, seq, req_to_token, 3, cap, owners)
    check_lists(tier, owners, lens, windows, ref_lens, ref_windows, cap)


def test_requests_within_the_dense_limit_read_their_ring():
    gen, indexes, q, coarse, fine, chunks, ranges, seq, req_to_token = scenario(1)
    rows = torch.tensor([1, 2], dtype=torch.int32)
    owners = torch.tensor([0, 1], dtype=torch.int32)
    cap = 1024
    limit = int(seq.max())
    tier = Tier(seq, req_to_token, owners=2, ring=limit, slots=40, gen=gen)
    sel = select_fine_ref(q, coarse, fine, ranges, torch.tensor([160, 160], dtype=torch.int32), 16.0)
    ref_lens, ref_windows = emit_tokens_ref(sel, chunks, ranges, rows, seq, req_to_token, SINK_TOKENS, RECENT, cap,
                                            dense_limit=limit)
    table, plan, lens, windows = tier.step(sel, chunks, ranges, rows, seq, req_to_token, 0, cap, owners,
                                           dense_limit=limit)
    assert (table.ids == -1).all() and int(plan.count[0]) == 0
    check_lists(tier, owners, lens, windows, ref_lens, ref_windows, cap)


def test_chunks_stay_hot_when_the_pools_move_their_rows():
    """A pool compaction moves a request's chunk rows: its hot chunks are known by position, so the next step finds
    them all and reads the same KV."""
    gen, indexes, q, coarse, fine, chunks, ranges, seq, req_to_token = scenario(2)
    rows = torch.tensor([1, 2], dtype=torch.int32)
    owners = torch.tensor([0, 1], dtype=torch.int32)
    cap = 400
    tier = Tier(seq, req_to_token, owners=2, ring=RECENT, slots=40, gen=gen)
    sel = select_fine_ref(q, coarse, fine, ranges, torch.tensor([160, 160], dtype=torch.int32), 16.0)
    ref = emit_tokens_ref(sel, chunks, ranges, rows, seq, req_to_token, SINK_TOKENS, RECENT, cap)
    tier.step(sel, chunks, ranges, rows, seq, req_to_token, 0, cap, owners)
    shift = 7   # every chunk row moves 7 rows on
    moved = ChunkRows(*(torch.cat([torch.zeros((shift, *t.shape[1:]), dtype=t.dtype), t]) for t in chunks))
    moved_ranges = ranges.clone()
    moved_ranges[[RANGE_FIELDS.index("prefix_chunk_at"), RANGE_FIELDS.index("own_chunk_at")]] += shift
    table, plan, lens, windows = tier.step(sel, moved, moved_ranges, rows, seq, req_to_token, 1, cap, owners)
    assert int(plan.miss_rows[0]) == 0 and int(plan.hit_rows[0]) > 0
    check_lists(tier, owners, lens, windows, *ref, cap)
