"""Token lists in device rows (sgl_sparsekv/tier_rows.py) against plain emission: after the plan's loads, the
device rows that the tier's lists name hold, list by list and in order, the KV that plain emission's slots name in
the host pool; across steps, chunks kept hot are not loaded again."""

import pytest
import torch

from bench.packing import pack
from sgl_sparsekv.kernels import hot_rows
from sgl_sparsekv.kernels.host_copy import copy_runs, copy_runs_ref
from sgl_sparsekv.kernels.hot_rows import SINK, ChunkTable
from sgl_sparsekv.kernels.select import RANGE_FIELDS, ChunkRows, emit_tokens_ref
from sgl_sparsekv.pool_ops import select_fine_ref
from sgl_sparsekv.residency import HotChunks
from test_select_kernel import make_batch

TWINS = (hot_rows.hot_chunks_ref, copy_runs_ref, hot_rows.device_lists_ref, hot_rows.fill_ring_ref)
KERNELS = (hot_rows.hot_chunks, copy_runs, hot_rows.device_lists, hot_rows.fill_ring)

H, G, D = 2, 2, 16
SINK_TOKENS, RECENT, WIDTH = 16, 32, 16


class Tier:
    """A host pool (one row per KV slot) and the sparse decode's device buffer: per owner (list row), its hot slots
    and a ring holding its last ``ring`` tokens."""

    def __init__(self, seq, req_to_token, owners, ring, slots, gen, ops=TWINS, dev="cpu"):
        self.slots_total = int(req_to_token.max()) + 1
        self.host_k, self.host_v = (torch.randn(self.slots_total, H, D, generator=gen).to(dev) for _ in range(2))
        self.ring, self.owners, self.ops, self.dev = ring, owners, ops, dev
        span = slots * WIDTH + ring
        self.base = torch.arange(owners, device=dev) * span + 7   # an owner's rows need not start at 0
        self.ring_base = self.base + slots * WIDTH
        n = 7 + owners * span
        self.dev_k, self.dev_v = (torch.full((n, H, D), float("nan"), device=dev) for _ in range(2))
        self.hot = HotChunks(owners, 1, H, slots, WIDTH, self.base)
        self.table = ChunkTable.empty(owners * H, slots, dev)
        self.dropped = torch.zeros(1, dtype=torch.int64, device=dev)

    def step(self, sel, chunks, ranges, rows, seq, req_to_token, step, cap, owners, dense_limit=0, ring_from=None):
        """``ring_from``: the first position each row's ring lacks (default: its last ``ring``, as a new owner)."""
        bs = len(rows)
        hot_chunks, copy, device_lists, fill_ring = self.ops
        ring_from = (seq - self.ring).clamp(min=0) if ring_from is None else ring_from
        fill_ring(self.host_k, self.host_v, self.dev_k, self.dev_v, rows, seq, owners, ring_from.to(torch.int32),
                  self.ring_base, req_to_token, self.ring)
        lists_at = (owners, torch.ones(bs, dtype=torch.int32, device=self.dev))
        self.table.ids.fill_(-1)
        table = hot_chunks(sel, chunks, ranges, seq, SINK_TOKENS, RECENT, dense_limit, lists_at, self.table,
                           self.dropped)
        n = table.ids.shape[0]
        lists = torch.arange(n, device=self.dev)
        plan = self.hot.plan(0, lists // H, lists % H, table.ids, table.starts, table.lens, req_to_token, step, 256,
                             req_rows=by_owner(owners, rows, n // H).repeat_interleave(H))
        assert int(plan.needed[0]) <= 256
        copy(self.host_k.transpose(0, 1), self.host_v.transpose(0, 1), self.dev_k.transpose(0, 1),
             self.dev_v.transpose(0, 1), plan.runs, plan.count)
        out = (torch.full((n,), -7, dtype=torch.int32, device=self.dev),
               torch.full((n * cap,), -7, dtype=torch.int32, device=self.dev))
        lens, windows = device_lists(table, plan.first, seq, self.ring_base, self.ring, lists_at, out, WIDTH)
        return table, plan, lens, windows


def by_owner(owners, rows, n_owners):
    """Each owner's request row (0 for owners without a request this step: their lists are all padding)."""
    out = torch.zeros(n_owners, dtype=torch.int64, device=rows.device)
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
    seq += 3   # three tokens decoded since: the ring loads only them, and the selection reads them as its tail
    sel = select_fine_ref(q, coarse, fine, ranges, budget, 16.0)
    ref_lens, ref_windows = emit_tokens_ref(sel, chunks, ranges, rows, seq, req_to_token, SINK_TOKENS, RECENT, cap)
    table, plan, lens, windows = tier.step(sel, chunks, ranges, rows, seq, req_to_token, 3, cap, owners,
                                           ring_from=seq - 3)
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


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("slots", [40, 3])
def test_kernels_write_what_their_twins_write(dev, slots):
    """hot_chunks, copy_runs, device_lists and fill_ring (kernels/hot_rows.py) against their torch twins over the
    same steps: the chunk table, the loaded rows, the lists and the rings. With 3 slots a list's chunks overflow
    them: both keep the first 3 and count the rest as dropped."""
    gen, indexes, q, coarse, fine, chunks, ranges, seq, req_to_token = scenario(3)
    to = (lambda t: t.to(dev))
    owners = torch.tensor([2, 0], dtype=torch.int32)
    rows = torch.tensor([1, 2], dtype=torch.int32)
    cap, budget = 400, torch.tensor([160, 160], dtype=torch.int32)
    worlds = [Tier(seq, req_to_token, owners=3, ring=RECENT + 4, slots=slots,
                   gen=torch.Generator().manual_seed(5), ops=ops, dev=dev) for ops in (TWINS, KERNELS)]
    for step, qs in enumerate([q, q + 0.3 * torch.randn(q.shape, generator=gen), q]):
        S = seq + 2 * step
        sel = select_fine_ref(qs, coarse, fine, ranges, budget, 16.0)
        args = (to(sel), ChunkRows(*map(to, chunks)), to(ranges), to(rows), to(S), to(req_to_token), step, cap,
                to(owners))
        ring_from = None if step == 0 else to(S - 2)
        (t0, p0, l0, w0), (t1, p1, l1, w1) = (w.step(*args, ring_from=ring_from) for w in worlds)
        for a, b in zip(t0, t1):
            assert torch.equal(a, b), step
        assert torch.equal(l0, l1) and torch.equal(w0, w1), step
        for a, b in ((worlds[0].dev_k, worlds[1].dev_k), (worlds[0].dev_v, worlds[1].dev_v)):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), step
        assert torch.equal(worlds[0].dropped, worlds[1].dropped)
    assert (int(worlds[0].dropped[0]) > 0) == (slots == 3)
