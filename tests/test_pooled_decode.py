"""The pooled GPU decode path (index pools + Triton select/emit/graft/attend) against the torch reference.

A reference manager and a pooled manager watch the same SGLang radix world (real RadixCache,
allocator and request pool); every batched decode step must give each (request, layer, KV head)
the same token list and the same attention output.
"""

import dataclasses
import random
import types

import pytest
import torch

from helpers import graft_chunk, kept_mass_spec, sparse_decode, sync_check
from sgl_sparsekv import head_roles, recall_audit
from sgl_sparsekv.index import ClusterIndex, build_index, recount, union
from sgl_sparsekv.index_pool import IndexPools, PoolCapacity, RangeAllocator
from sgl_sparsekv.kernels.graft import GraftJob, graft_args, graft_chunks, graft_payload, precompile_graft
from sgl_sparsekv.kernels.sparse_decode import sparse_decode_attention_ref
from sgl_sparsekv.manager import SharedSegment, SparseKVManager
from sgl_sparsekv.pool_ops import graft_chunks_ref
from sgl_sparsekv.pooled_decode import PooledDecode
from sgl_sparsekv.request_control import OFF
from sgl_sparsekv.select import select_chunks, units_to_token_mask
from sgl_sparsekv.transfer import StagedUpload
from tests.test_radix_state import LAYERS, D, H, World, synthetic_table

G = 3


def test_range_allocator_first_fit_and_merge():
    a = RangeAllocator(100)
    x, y, z = a.alloc(30), a.alloc(30), a.alloc(30)
    assert (x, y, z) == (0, 30, 60) and a.alloc(20) is None
    a.free(y, 30)
    assert a.alloc(31) is None and a.alloc(10) == 30
    a.free(30, 10)
    a.free(x, 30)
    a.free(z, 30)
    assert a.free_rows == 100 and a.alloc(100) == 0
    a.compacted(40)
    assert a.free_rows == 60 and a.alloc(61) is None and a.alloc(60) == 40
    a.compacted(100)
    assert a.free_rows == 0 and a.alloc(1) is None


def test_a_fragmented_pool_compacts_and_every_segment_keeps_its_index():
    """Segments freed between live ones leave gaps that no single index fits: the load that needs their sum moves
    the live segments together (once per level it needs), and every segment exports the index it held, an adopter's
    shorter view of a shared segment included; a chunk range that must grow finds room the same way."""
    gen = torch.Generator().manual_seed(3)
    Ls, d, M = 2, 16, 40
    pools = IndexPools(PoolCapacity(coarse=64, fine=96, chunks=192), Ls, H, d, "cpu")

    def index(m):
        keys = torch.nn.functional.normalize(torch.randn(Ls * H, m, d, generator=gen), dim=-1)
        lengths = torch.randint(8, 17, (m,), generator=gen)
        return build_index(keys, lengths, 2.0, 64, 5), torch.cumsum(lengths, 0) - lengths, lengths

    def load(m, room=4):
        ix, starts, lengths = index(m)
        return pools.load(ix.pack(), starts, lengths, room), ix

    segs = [load(M) for _ in range(4)]
    assert pools.alloc["fine"].used_rows == 80 and pools.alloc["chunks"].used_rows == 176
    for rng, _ in segs[0::2]:
        pools.free(rng)
    kept = segs[1::2]
    view = SharedSegment(0, kept[1][0], M // 2)   # an adopter that shares half of a segment's chunks
    before = [pools.export(r) for r, _ in kept] + [pools.export(view.ranges)]
    rng, ix = load(2 * M)   # 40 fine rows and 84 chunk rows: more than any gap, less than the free rows
    assert rng is not None and pools.compactions == 2   # fine and chunks (the coarse rows still fit a gap)
    assert [r.fine_at for r, _ in kept] == [0, 20] and rng.fine_at == 40
    for got, want in zip([pools.export(r) for r, _ in kept] + [pools.export(view.ranges)], before):
        assert all(torch.equal(getattr(got, k), t) for k, t in vars(want).items())
    assert all(torch.equal(getattr(pools.export(rng), k), t) for k, t in vars(ix).items())
    assert view.segment() == view.ranges.segment() and view.segment().chunk_at == kept[1][0].chunk_at

    # a chunk range that grows past its room (to 50 rows) where the free chunk rows lie in pieces of 24 and 48
    pools = IndexPools(PoolCapacity(coarse=64, fine=96, chunks=120), Ls, H, d, "cpu")
    x, a, c, y = (load(20)[0] for _ in range(4))
    pools.free(x)
    pools.free(y)
    before = [pools.export(r) for r in (a, c)]
    first = pools.add_chunks(a, 30)
    assert pools.compactions == 1 and (a.chunk_at, a.chunk_rows, c.chunk_at) == (48, 50, 24) and first == 48 + 20
    got = pools.export(dataclasses.replace(a, chunks=20))   # its recorded chunks, moved twice
    assert all(torch.equal(getattr(got, k), t) for k, t in vars(before[0]).items())
    assert all(torch.equal(getattr(pools.export(c), k), t) for k, t in vars(before[1]).items())


def chunk_boxes(keys: torch.Tensor, gen) -> torch.Tensor:
    """Made-up key min and max [..., 2, d] of chunks around their keys [..., d]."""
    spread = torch.rand(*keys.shape, 2, generator=gen)
    return torch.stack([keys - spread[..., 0], keys + spread[..., 1]], -2)


@pytest.mark.parametrize("box", [False, True])
@pytest.mark.parametrize("graft_fn,dev", [(graft_chunks, "cpu"), (graft_chunks_ref, "cpu"),
                                          pytest.param(graft_chunks, "cuda", marks=pytest.mark.gpu)])
def test_pool_roundtrip_and_graft_matches_index_graft(graft_fn, dev, box):
    """load -> export is lossless; one graft launch over two requests' backlogs equals index.graft chunk after chunk,
    on every layer and head: a request's later chunks (here near one another, so they meet in one cluster) see its
    earlier grafts. ``box``: fine boxes, which the grafts grow over the chunks' key bounds."""
    gen = torch.Generator().manual_seed(1)
    Ls, M, d = 2, 40, 16

    def build(keys, lengths):
        return build_index(keys, lengths, 2.0, 64, 5, chunk_boxes(keys, gen) if box else None)

    pools = IndexPools(PoolCapacity(coarse=64, fine=128, chunks=256), Ls, H, d, dev, box=box)
    pools.load(build(torch.nn.functional.normalize(torch.randn(Ls * H, 8, d, generator=gen), dim=-1),
                     torch.full((8,), 12)).pack(),
               torch.zeros(8, dtype=torch.int32), torch.ones(8, dtype=torch.int32), 4)   # someone else's rows
    refs, ranges = [], []
    for m in (M, M // 2):
        keys = torch.nn.functional.normalize(torch.randn(Ls * H, m, d, generator=gen), dim=-1)
        lengths = torch.randint(8, 17, (m,), generator=gen)
        ix = build(keys, lengths)
        assert ix.has_box == box
        rng = pools.load(ix.pack(), torch.cumsum(lengths, 0) - lengths, lengths, room=2)
        back = pools.export(rng)
        for name, t in vars(ix).items():
            assert torch.equal(getattr(back, name).cpu().to(t.dtype), t), name
        refs.append(ix.clone())
        ranges.append(rng)

    # backlogs of 6 and 2 chunks; the first request's six move its chunk rows to a bigger range
    new = torch.randn(Ls, 8, H, 1, d, generator=gen)
    new[:, 1:6] = new[:, :1] + 0.2 * new[:, 1:6]
    new = torch.nn.functional.normalize(new, dim=-1)
    if box:   # the chunks' key bounds ride beside their keys, as SparseKVManager.chunk_keys lays them out
        new = torch.cat([new, chunk_boxes(new[:, :, :, 0], gen)], 3)
    lengths, starts = torch.tensor([9, 16, 12, 10, 11, 8, 13, 14]), torch.arange(8) * 16 + 500
    jobs, backlogs = [], ((0, 6), (6, 2))
    for (k0, n), ref, rng in zip(backlogs, refs, ranges):
        jobs.append(GraftJob(k0, n, rng.fine_at, rng.fine, rng.coarse_at, pools.add_chunks(rng, n)))
        for kr in range(k0, k0 + n):
            graft_chunk(ref, new[:, kr, :, 0].reshape(Ls * H, d), int(lengths[kr]),
                        new[:, kr, :, 1:].reshape(Ls * H, 2, d) if box else None)
    near = refs[0].chunk_fine[:, M:M + 6]
    assert (near == near[:, :1]).all(1).float().mean() > 0.5   # mostly one cluster: grafts build on each other
    graft_fn(pools, new.to(dev), torch.tensor(jobs, device=dev).T.contiguous(), lengths.to(dev), starts.to(dev))
    assert ranges[0].chunk_rows == 2 * (M + 2) and ranges[0].chunks == M + 6 and ranges[1].chunks == M // 2 + 2
    for (k0, n), ref, rng in zip(backlogs, refs, ranges):
        got = pools.export(rng)
        for name, t in vars(ref).items():
            # centroids are exact (IEEE divisions); on the GPU a radius's square root is not IEEE's
            rtol = 1e-5 if dev == "cuda" else 0
            assert torch.allclose(getattr(got, name).cpu().to(t.dtype), t, atol=1e-5, rtol=rtol), name
        added = slice(rng.chunk_at + rng.chunks - n, rng.chunk_at + rng.chunks)
        assert pools.chunk_len[added].tolist() == lengths[k0:k0 + n].tolist()
        assert pools.chunk_start[added].tolist() == starts[k0:k0 + n].tolist()


@pytest.mark.parametrize("box", [False, True])
@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_export_packed_is_the_union_of_the_segments_as_stored_and_owns_its_memory(dev, box):
    """A request's release caches ``export_packed`` of its segments (a shared prefix's, then its own): the union of
    the two indexes with centroid codes, scales and boxes as stored and cluster sizes counted from its chunks. It
    shares no memory with the pools, and loads back as it was exported."""
    gen = torch.Generator().manual_seed(2)
    Ls, H_, d = 2, 3, 16
    pools = IndexPools(PoolCapacity(coarse=64, fine=128, chunks=256), Ls, H_, d, dev, box=box)
    packed, ranges, lengths = [], [], []
    for m in (30, 12):
        keys = torch.nn.functional.normalize(torch.randn(Ls * H_, m, d, generator=gen), dim=-1)
        n = torch.randint(8, 17, (m,), generator=gen)
        ix = build_index(keys, n, 2.0, 64, 5, chunk_boxes(keys, gen) if box else None).pack()
        packed.append(ix)
        ranges.append(pools.load(ix, torch.cumsum(n, 0) - n, n, room=4))
        lengths.append(n)
    # the shared segment's clusters count chunks past the request's share of it: the export counts its own
    shared_len = 20
    ranges[0].chunks = shared_len
    lengths[0] = lengths[0][:shared_len]
    got = pools.export_packed(*ranges)

    a, b = (p.index for p in packed)
    a = ClusterIndex(**{**vars(a), "chunk_fine": a.chunk_fine[:, :shared_len]})
    want = recount(union(a, b), torch.cat(lengths))
    for name, t in vars(want).items():
        assert torch.equal(getattr(got.index, name).cpu(), t.to(getattr(got.index, name).dtype)), name
    for name in ("fine_scale", "coarse_scale"):
        assert torch.equal(getattr(got, name).cpu(), torch.cat([getattr(p, name) for p in packed], 1)), name
    assert got.index.fine_parent.dtype == got.index.chunk_fine.dtype == torch.long
    assert got.index.fine_mu.dtype == pools.fine_mu.dtype and got.index.fine_box.dtype == pools.fine_box.dtype

    before = {name: t.clone() for name, t in vars(got.index).items()}
    for pool in (pools.fine_mu, pools.fine_scale, pools.fine_r, pools.fine_tokens, pools.fine_n, pools.fine_parent,
                 pools.fine_box, pools.coarse_mu, pools.coarse_scale, pools.coarse_r, pools.coarse_tokens,
                 pools.coarse_n, pools.chunk_fine):
        pool.zero_()
    assert all(torch.equal(getattr(got.index, name), t) for name, t in before.items())

    total = torch.cat(lengths).to(dev)
    again = pools.export_packed(pools.load(got, torch.cumsum(total, 0) - total, total, room=0))
    for name, t in vars(got.index).items():
        assert torch.equal(getattr(again.index, name), t), name


class TwinWorld(World):
    """World whose lychee decode steps are checked against the algorithm's spec (``select.select_chunks`` on
    the request's index as the pools hold it, after this step's grafts)."""

    def __init__(self, seed, overrides=None, steps="graph", method="lychee", kv_dtype=torch.float32):
        """``steps`` (select_ahead): how decode steps run: "graph" (every one replays a CUDA graph: eager off),
        "eager" (none does: CUDA graphs off), or "served" (each asks the plugin's hook whether its graph may run)."""
        super().__init__(method, seed, overrides, kv_dtype)
        self.steps = steps
        self.own_steps = 0   # (request, sparse layer) attended with the lists it selected that step (select_ahead)
        self.roles = head_roles.resolve(self.cfg.head_roles, LAYERS, H, self.cfg.dense_layers)
        self.pooled, self.decoder = self.manager, PooledDecode(self.manager, max_bs=8, q_heads=H * G, parts=2)
        self.qgen = torch.Generator().manual_seed(seed + 1)
        self.lists_checked = 0
        self.overflow = set()   # request rows whose step found no room in the selection scratch (dense)
        self.kept = {}   # select_every > 1: (request row, sparse layer) -> (mask, length) at its last selection
        self.reused = 0
        self.held = 0   # select_ahead with select_every > 1: (request, sparse layer) steps on lists kept further
        self.sparse_steps = 0      # decode steps with a request past the budget
        self.audits_checked = 0    # (audited row, sparse layer) values checked against the spec
        self.audited_rows = 0

    def random_history(self, steps: int, start_below: float, decodes: int, shuffle: bool = False):
        """``steps`` random events: a request starts (while fewer than 3 live), a run of decode steps, or a request
        finishes (some abort); ``shuffle``: each decode step takes the batch in a new order."""
        for _ in range(steps):
            r = self.rng.random()
            if (r < start_below and len(self.live) < 3) or not self.live:
                self.start()
            elif r < 0.85:
                for _ in range(self.rng.randrange(1, decodes)):
                    self.decode_batch(self.rng.sample(self.live, len(self.live)) if shuffle else list(self.live))
            else:
                self.finish(self.rng.choice(self.live), abort=self.rng.random() < 0.3)

    def append_tokens(self, reqs):
        """Each request samples one token: its KV is written. -> (rows, lengths, host token ids)."""
        rows, seqs = [], []
        for req in reqs:
            row, pos = req.req_pool_idx, len(req.tokens)
            tok = self.rng.randrange(64)
            req.tokens.append(tok)
            slot = self.take_slots(1)
            self.req_pool.req_to_token[row, pos] = int(slot[0])
            self.write_kv(slot, torch.tensor([tok]), torch.tensor([pos]))
            rows.append(row); seqs.append(pos + 1)
        return rows, seqs, [req.tokens for req in reqs]

    def decode_batch_unchecked(self, reqs):
        """One decode step of ``reqs`` (no comparison): fills the decoder's windows."""
        rows, seqs, toks = self.append_tokens(reqs)
        r2t = self.req_pool.req_to_token
        self.decoder.prepare(rows, seqs, len(rows), r2t, toks, lambda l: self.k[l])
        q = torch.randn(len(rows), H * G, D, generator=self.qgen)
        self.decoder.attend(q, self.k[1], self.v[1], 0, r2t, D ** -0.5)

    def spec_mask(self, row, S, l, q):
        """The token mask the algorithm gives request ``row`` at sparse layer ``l`` (at its own budget, with the
        server's coarse expansion factor)."""
        st, cfg = self.pooled.states[row], self.cfg
        if S <= cfg.token_budget or st.pool is None or row in self.overflow:
            return torch.ones(H, S, dtype=torch.bool)
        ix = self.pooled.pools.read(*st.segments)
        heads = slice(l * H, (l + 1) * H)
        ix = ClusterIndex(**{k: v[heads].float() if v.is_floating_point() else v[heads] for k, v in vars(ix).items()})
        sink, recent = cfg.sink_tokens, cfg.recent_window
        budget = (st.budget or cfg.token_budget) - sink - recent
        expand = cfg.expansion(cfg.token_budget - sink - recent)
        sel = select_chunks(ix, q.view(H, G, D), budget, expand, cfg.gqa_reduce, cfg.radius_weight)
        n = st.pooled_chunks   # the chunks past them lie in the recent window
        return units_to_token_mask(sel, torch.tensor(st.starts[:n]), torch.tensor(st.ends[:n]), S, sink, recent)

    def decode_batch(self, reqs):
        if self.cfg.select_ahead:
            return self.decode_batch_ahead(reqs)
        rows, seqs, toks = self.append_tokens(reqs)
        r2t = self.req_pool.req_to_token
        padded = len(rows) + 1   # one padding row, as a captured batch size would add
        eager = self.steps == "eager" or (self.steps == "served" and not self.graph_allowed(reqs, seqs))
        self.decoder.prepare(rows, seqs, padded, r2t, toks, lambda l: self.k[l], eager=eager,
                             budgets=[r.budget for r in reqs])
        audited = self._audited(seqs)
        self.overflow = {row for i, row in enumerate(rows) if int(self.decoder.direct[i])}
        fresh = self.decoder.fresh[:len(rows)].tolist()
        list_rows = self.decoder.list_rows[:len(rows)].tolist()
        scale = D ** -0.5
        inherited = {}   # hybrid heads: each request's masks as the last retrieval head of each KV head left them
        for l in range(self.cfg.dense_layers, LAYERS):
            q = torch.randn(padded, H * G, D, generator=self.qgen)
            sl = l - self.cfg.dense_layers
            out = self.decoder.attend(q, self.k[l], self.v[l], sl, r2t, scale)
            retrieving = range(H) if self.roles is None else self.roles[sl]
            for i, (row, S) in enumerate(zip(rows, seqs)):
                if fresh[i] or row in self.overflow:
                    own = self.spec_mask(row, S, sl, q[i])
                    self.kept[row, sl] = (own, S)
                    tail = own
                else:   # the lists of its last selection, then every token decoded since
                    own, S_sel = self.kept[row, sl]
                    tail = torch.cat([own, torch.ones(H, S - S_sel, dtype=torch.bool)], 1)
                    self.reused += not bool(own.all())   # reuses a sparse selection
                mask = inherited.setdefault(row, own.clone())
                for h in retrieving:
                    mask[h] = own[h]
                # a dense row reads its whole sequence; with the host tier the lists name hot-buffer rows, which
                # the outputs check
                for h in range(H if row not in self.overflow and self.decoder.tier is None else 0):
                    got = self.decoder.token_list(list_rows[i] * H + h, sl).tolist()
                    want = r2t[row, :len(own[h])][mask[h]].tolist()
                    assert len(got) == len(set(got)) and sorted(got) == sorted(want), (l, row, h)
                    self.lists_checked += 1
                if self.roles is None:
                    mask = tail
                ref = sparse_decode(q[i], self.k[l], self.v[l], r2t[row, :S], mask, scale)
                assert torch.allclose(out[i], ref, atol=1e-4), (l, row)
                self._audit_spec(audited, i, sl, q[i], l, r2t[row, :S], mask)
        self._check_audit(audited)

    def _audited(self, seqs) -> dict[int, int]:
        """After a step's preparation: the batch rows the recall audit measures, by their row in its values."""
        self.sparse_steps += any(S > self.cfg.token_budget for S in seqs)
        self.audit_want = {}
        audited = {a.i: r for r, a in enumerate(self.decoder.audited)}
        assert all(self.pooled.states[self.decoder.audited[r].row].budget != OFF for r in audited.values())
        self.audited_rows += len(audited)
        return audited

    def _audit_spec(self, audited, i, sl, q, l, slots, mask) -> None:
        if i in audited:
            self.audit_want[audited[i], sl] = kept_mass_spec(q, self.k[l], slots, mask, D ** -0.5)

    def _check_audit(self, audited) -> None:
        """The audit's values of the step (on the CPU its copy is done at once) are the spec's."""
        if not audited:
            return
        got = self.manager.audit.pending[-1].get()
        assert got.shape == (len(audited), LAYERS - self.cfg.dense_layers)
        for (r, sl), want in self.audit_want.items():
            assert abs(float(got[r, sl]) - want) < 1e-5, (r, sl, float(got[r, sl]), want)
            self.audits_checked += 1
        assert len(self.audit_want) == got.numel()

    def decode_batch_ahead(self, reqs):
        """select_ahead: a request attends to the spec's lists for its query of the step before (in the same
        layer) plus the token decoded since, or to its whole sequence when it selected nothing then; its lists
        after the step are the spec's for this step's query. With select_every k the lists serve the k steps after
        the one that selected them (with the host tier, one step when selected within the budget)."""
        rows, seqs, toks = self.append_tokens(reqs)
        r2t = self.req_pool.req_to_token
        padded = len(rows) + 1
        # a first decode step: past the budget with its index placed, no lists kept from a step before
        first = any(S > self.cfg.token_budget and self.pooled.states[row].pool is not None
                    and (row, 0) not in self.kept for row, S in zip(rows, seqs))
        eager = self.steps == "eager"
        if self.steps == "served":
            audit = self.manager.audit
            due = audit is not None and audit.due_next() and any(S > self.cfg.token_budget for S in seqs)
            eager = not self.graph_allowed(reqs, seqs)
            assert eager == (first or due)
        self.decoder.prepare(rows, seqs, padded, r2t, toks, lambda l: self.k[l], eager=eager,
                             budgets=[r.budget for r in reqs])
        audited = self._audited(seqs)
        own_order = self.decoder.own_order
        assert own_order == (eager and first)
        n = len(rows)
        unselected, selects, list_rows = (t[:n].tolist() for t in (self.decoder.direct, self.decoder.fresh,
                                                                    self.decoder.list_rows))
        every, tier = self.cfg.select_every, self.decoder.tier is not None
        self.overflow = set()
        for l in range(self.cfg.dense_layers, LAYERS):
            q = torch.randn(padded, H * G, D, generator=self.qgen)
            sl = l - self.cfg.dense_layers
            out = self.decoder.attend(q, self.k[l], self.v[l], sl, r2t, D ** -0.5)
            for i, (row, S) in enumerate(zip(rows, seqs)):
                own = self.spec_mask(row, S, sl, q[i]) if selects[i] else None
                due = True
                if own_order and selects[i]:   # lychee's order: the lists it selects now
                    assert not unselected[i]
                    mask = own
                    self.own_steps += 1
                elif unselected[i]:
                    mask = torch.ones(H, S, dtype=torch.bool)
                else:
                    before, S_sel = self.kept[row, sl]
                    mask = torch.cat([before, torch.ones(H, S - S_sel, dtype=torch.bool)], 1)
                    self.reused += not bool(before.all())
                    due = S >= S_sel + every or (tier and S_sel <= self.cfg.token_budget)
                    assert due or not selects[i], (l, row, S, S_sel)
                ref = sparse_decode(q[i], self.k[l], self.v[l], r2t[row, :S], mask, D ** -0.5)
                assert torch.allclose(out[i], ref, atol=1e-4), (l, row)
                self._audit_spec(audited, i, sl, q[i], l, r2t[row, :S], mask)
                if not (selects[i] or unselected[i] or due):   # its lists serve its next step too
                    self.held += 1
                    continue
                self.kept.pop((row, sl), None)
                if not selects[i]:
                    continue
                self.kept[row, sl] = (own, S)
                for h in range(H if not tier else 0):   # (with the host tier lists name hot-buffer rows)
                    got = self.decoder.token_list(list_rows[i] * H + h, sl).tolist()
                    want = r2t[row, :S][own[h]].tolist()
                    assert len(got) == len(set(got)) and sorted(got) == sorted(want), (l, row, h)
                    self.lists_checked += 1
        self._check_audit(audited)

    def graph_allowed(self, reqs, seqs) -> bool:
        """The plugin's hook on SGLang's ``can_run_graph``, asked as the graph runner asks it (SGLang said yes)."""
        from sgl_sparsekv.patches.backend import SparseKVAttnBackend
        from sgl_sparsekv.patches.plugin import eager_first_steps

        backend = types.SimpleNamespace(pooled=self.decoder, manager=self.manager, batch_reqs=reqs)
        backend.graph_allowed = types.MethodType(SparseKVAttnBackend.graph_allowed, backend)
        runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(attn_backend=backend))
        batch = types.SimpleNamespace(seq_lens_cpu=torch.tensor(seqs + [1]))   # a padding row past the batch
        assert eager_first_steps(False, runner, batch) is False   # never turns a refusal into a replay
        return eager_first_steps(True, runner, batch)


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("seed,overrides,method,kv_dtype", [
    (0, None, "lychee", torch.float32), (1, None, "lychee", torch.float32),
    (2, {"fine_bound": "box", "radius_weight": 1.0}, "lychee", torch.float32),
    (3, {"gqa_reduce": "mean"}, "lychee", torch.float32), (4, None, "quest", torch.float32),
    (5, {"gqa_reduce": "mean"}, "quest", torch.float32), (6, {"fine_bound": "box"}, "lychee", FP8)])
def test_pooled_decode_equals_spec_under_radix_history(seed, overrides, method, kv_dtype):
    """Every method decodes through the one lifecycle; each step's lists are the spec's (quest: its pages ranked
    by Quest's bound, the best budget // page_size of them). With fp8 KV the index is built from, and attention
    reads, the stored fp8 values."""
    w = TwinWorld(seed, overrides, method=method, kv_dtype=kv_dtype)
    w.rng = random.Random(seed)
    w.random_history(14, 0.4, 12)
    for _ in range(6):
        w.decode_batch(list(w.live))
    st = w.pooled.stats
    assert st.index_builds + st.index_reused > 0 and st.grafts > 0 and st.index_pool_full == 0
    assert w.lists_checked > 200
    for req in w.live:
        w.check_index(req)
    # finishing everything returns every pool row
    for req in list(w.live):
        w.finish(req, abort=False)
    w.pooled.prepare_extend([], [], [], w.req_pool.req_to_token, [])
    assert all(a.free_rows == a.capacity for a in w.pooled.pools.alloc.values())


@pytest.mark.parametrize("seed,method,every,kv_dtype", [(7, "lychee", 1, torch.float32), (8, "quest", 1, torch.float32),
                                                         (9, "lychee", 3, torch.float32), (10, "lychee", 3, FP8)])
def test_host_tier_decodes_from_hot_buffers_as_the_spec(seed, method, every, kv_dtype):
    """With the host tier each step's attention reads the hot buffers (``tier_rows``): the selected chunks loaded from
    the host pool where they miss, the tail from each request's ring, a row without its index the host pool itself;
    every output is the spec's, under the same radix history as the plain pools, and chunks stay hot across steps.
    With select_every 3 a request attends between its selections to its kept lists plus the tokens decoded since,
    read from its ring, and loads nothing at those steps. With fp8 KV the host rows, the hot buffers and the ring hold
    the stored fp8 bytes, which the attention reads as the plain pools' are read."""
    w = TwinWorld(seed, {"host_tier": True, **({"select_every": every} if every > 1 else {})}, method=method,
                  kv_dtype=kv_dtype)
    w.rng = random.Random(seed)
    w.random_history(14, 0.4, 12)
    loads = []
    for _ in range(6):
        before = w.decoder.tier.rows_hit_loaded.tolist()
        w.decode_batch(list(w.live))
        loads.append((any(w.decoder.fresh[:len(w.live)].tolist()), w.decoder.tier.rows_hit_loaded.tolist() != before))
    hit, loaded = w.decoder.tier.rows_hit_loaded.tolist()
    assert w.sparse_steps > 5 and loaded > 0 and hit > loaded
    assert w.pooled.stats.grafts > 0
    assert all(fresh or not moved for fresh, moved in loads)   # a step where no row selects reads no chunk
    assert (w.reused > 0) == (every > 1)


@pytest.mark.parametrize("method,overrides", [("lychee", {"head_roles": "staggered-0.5"}),
                                              ("lychee", {"select_ahead": True}), ("lychee", {"select_every": 3}),
                                              ("quest", None)])
def test_requests_decode_at_their_own_budget_or_densely(method, overrides):
    """Requests of one batch asking for the server's budget, a smaller one of their own, or dense decoding
    (custom_params, ``request_control``): each row's lists are the spec's at its budget, a dense request attends to
    its whole sequence and never takes index pool rows, and the counters say what each read."""
    w = TwinWorld(7, overrides, method=method)
    w.own_budgets = [None, OFF, 64, 100]   # the server's is 128, sink and recent window 48
    w.rng = random.Random(7)
    asked = set()
    for _ in range(5):
        w.random_history(3, 0.5, 5)
        for req in w.live:
            st = w.pooled.states[req.req_pool_idx]
            assert st.budget == req.budget and (req.budget != OFF or st.pool is None)
            asked.add(req.budget)
    assert asked == set(w.own_budgets)
    assert w.pooled.stats.requested_dense_steps > 0 and w.pooled.stats.dense_fallback_steps == 0
    assert w.lists_checked > 100


@pytest.mark.parametrize("method,overrides", [("lychee", {}), ("lychee", {"head_roles": "staggered-0.5"}),
                                              ("lychee", {"select_every": 3}), ("lychee", {"select_ahead": True}),
                                              ("quest", {}), ("lychee", {"host_tier": True}),
                                              ("lychee", {"host_tier": True, "select_every": 3})])
def test_recall_audit_measures_the_mass_each_audited_step_kept(method, overrides, monkeypatch):
    """With recall_audit_every 3, every third decode step past the budget runs eagerly (the plugin's hook declines
    its graph) and each audited row's value per sparse layer is the spec's: the share of dense attention's mass on
    the tokens the step attended (lists, tail, the previous layer's lists for a sparse head; with the host tier, lists
    of hot-buffer rows and tails in the rings), averaged over the query heads; requests that asked for dense
    decoding are never audited. The histograms hold every value."""
    monkeypatch.setattr(recall_audit, "KEY_BLOCK", 7)   # the dense logits in several blocks
    monkeypatch.setattr(recall_audit, "AUDIT_ROWS", 2)   # fewer than the batch's rows: they take turns
    w = TwinWorld(8, {**overrides, "recall_audit_every": 3}, steps="served", method=method)
    w.own_budgets = [None, None, OFF]
    w.rng = random.Random(8)
    w.random_history(16, 0.4, 12)
    for _ in range(6):
        w.decode_batch(list(w.live))
    audit, st = w.manager.audit, w.pooled.stats
    # every third step past the budget was due and ran eagerly; those with a row to measure count as audited
    assert audit.since == w.sparse_steps % 3 and 3 <= st.audited_steps <= w.sparse_steps // 3
    assert w.audits_checked == w.audited_rows * (LAYERS - w.cfg.dense_layers)
    groups = audit.snapshot()
    assert sum(h["samples"] for h in groups.values()) == w.audits_checked
    assert all(0 < h["min"] <= h["mean"] <= 1 + 1e-6 for h in groups.values())
    assert sum(h["min"] < 1 - 1e-3 for h in groups.values()) > 0   # some selection left mass out


def test_compaction_between_steps_keeps_every_request_on_its_index():
    """Every level compacted between decode steps (as a load that finds its rows apart does): the requests, their
    shared segments and their grafts follow their moved rows, and every step's lists stay the spec's."""
    w = TwinWorld(12)
    w.rng = random.Random(12)
    pools, moved = w.pooled.pools, 0
    for _ in range(6):
        while len(w.live) < 3:
            w.start()
        for _ in range(8):
            w.decode_batch(list(w.live))
        w.finish(w.live[0], abort=False)   # the oldest: a gap before the others' rows
        where = {id(r): (r.coarse_at, r.fine_at, r.chunk_at) for r in pools.live.values()}
        for kind in ("coarse", "fine", "chunks"):
            pools.compact(kind)
        moved += sum(where[id(r)] != (r.coarse_at, r.fine_at, r.chunk_at) for r in pools.live.values())
        for _ in range(4):
            w.decode_batch(list(w.live))
    st = w.pooled.stats
    assert moved > 0 and st.index_reused > 0 and st.grafts > 0 and w.lists_checked > 200
    for req in w.live:
        w.check_index(req)


def test_grafts_wait_for_the_window_edge_and_take_every_backlog():
    """Decode chunks are grafted only when some request's first missing chunk is about to leave the recent window,
    and then every request's backlog goes: over a long decode of four requests a graft comes once in dozens of
    steps (eager grafting launched at every step where a request cut a chunk), and each leaves no request lacking
    a cut chunk. The debug check of every step (on in tests) asserts no missing chunk lies outside the window. The key
    slots of units cut at decode are read back with the grafts only."""
    w = TwinWorld(5, {"recent_window": 64})
    w.rng = random.Random(5)
    for _ in range(4):
        w.start()
    m, W = w.pooled, w.cfg.recent_window
    period = W - 2 * w.cfg.chunk_max - 2   # a chunk cut after a graft starts at most 2 chunk lengths back
    graft_steps = cut_steps = 0
    steps = 150
    for _ in range(steps):
        units = [len(m.states[r.req_pool_idx].units) if r.req_pool_idx in m.states else 0 for r in w.live]
        grafts = m.stats.grafts
        w.decode_batch_unchecked(list(w.live))
        states = [m.states[r.req_pool_idx] for r in w.live]
        cut_steps += any(len(s.units) > n for s, n in zip(states, units) if s.pool is not None)
        asked = [e for e in m._ordered if e[0] == "keys"]   # key-slot reads this step started
        if m.stats.grafts > grafts:
            graft_steps += 1
            assert all(s.pooled_chunks == len(s.units) for s in states if s.pool is not None)
            # the graft's one upload gathers the key slots of every unit cut since the last graft
            assert len(asked) == 1 and not any(s.unkeyed for s in states)
        else:
            assert not asked   # a step without a graft reads nothing back from the device
    assert all(s.pool is not None for s in states)
    assert 1 <= graft_steps <= steps // period + 1 and cut_steps >= 3 * graft_steps, (graft_steps, cut_steps)


def test_adopters_of_one_prefix_decode_over_one_shared_segment():
    """Two requests adopt one cached document's index (one shared segment, each an own segment past it): every
    token list of every step equals the spec on the index the two segments form, grafts go to the own segments,
    and a third request over the same document, started while they decode, reads the same shared rows."""
    w = TwinWorld(7)
    w.rng = random.Random(3)
    w.docs = [w.docs[0] * 2]   # past the budget of 128 once the questions are added
    w.start()
    w.finish(w.live[0], abort=False)   # the document and its index are cached
    w.start()
    w.start()
    for _ in range(25):
        w.decode_batch(list(w.live))
    w.start()
    for _ in range(25):
        w.decode_batch(list(w.live))
    m = w.pooled
    states = [m.states[r.req_pool_idx] for r in w.live]
    assert all(st.shared is not None for st in states) and len({st.shared.key for st in states}) == 1
    assert m.pools.shared_fill() == {"segments": 1, "references": 3}
    assert m.stats.grafts > 0 and all(st.pool.chunks > 0 for st in states) and w.lists_checked >= 300
    for req in list(w.live):
        w.finish(req, abort=False)
    m.prepare_extend([], [], [], w.req_pool.req_to_token, [])
    assert m.pools.shared_fill() == {"segments": 0, "references": 0}
    assert all(a.free_rows == a.capacity for a in m.pools.alloc.values())


@pytest.mark.parametrize("every", [1, 3, "ahead"])
def test_a_batch_past_the_selection_scratch_decodes_its_overflow_densely(every):
    """The selection scratch holds the clusters of the first request only: the second decodes over its whole
    sequence that step (attention equal to dense, counted as a dense fallback), the first stays sparse. With
    select_every 3 the rows take turns: a step where the first reuses its lists leaves the scratch to the second,
    and a row that decoded densely selects at its next step. With select_ahead the second selects nothing, so it
    decodes densely at each next step."""
    ahead = every == "ahead"
    w = TwinWorld(2, {"select_ahead": True} if ahead else {"select_every": every})
    w.rng = random.Random(2)
    w.docs = [d * 2 for d in w.docs]
    for _ in range(2):
        w.start()
    w.decode_batch(list(w.live))
    first = w.pooled.states[w.live[0].req_pool_idx]
    rows = sum(seg.fine for seg in first.segments)
    w.decoder.scratch = tuple(t[:, :rows].contiguous() for t in w.decoder.scratch)
    before = w.pooled.stats.dense_fallback_steps
    overflows = []
    steps = {1: 3, 3: 6, "ahead": 4}[every]
    for _ in range(steps):
        attended = w.pooled.stats.attended_tokens
        w.decode_batch(list(w.live))
        dense = {r.req_pool_idx for r, u in zip(w.live, w.decoder.direct.tolist()) if u} if ahead else w.overflow
        overflows.append(dense)
        # the attended tokens count a dense row's whole sequence, a sparse row's budget
        seqs = w.decoder.seq[:2].tolist()
        assert w.pooled.stats.attended_tokens - attended == sum(
            S if r.req_pool_idx in dense else min(S, w.cfg.token_budget) for r, S in zip(w.live, seqs))
    if every == 1:
        assert overflows == [{w.live[1].req_pool_idx}] * 3
    if ahead:   # the lists of its step before the scratch shrank, then its whole sequence
        assert overflows == [set()] + [{w.live[1].req_pool_idx}] * 3
    if every != 3:
        assert w.pooled.stats.dense_fallback_steps - before == steps == w.pooled.stats.scratch_full_steps
    else:
        assert {w.live[1].req_pool_idx} in overflows and set() in overflows and w.reused > 0, overflows


def test_hybrid_heads_reuse_the_previous_layers_lists(tmp_path):
    """A role map with a layer of no retrieval head: every sparse head attends to the list its KV head had in the
    layer before (chained), the same spec check as above; a layer without retrieval heads selects nothing."""
    path = tmp_path / "roles.json"
    path.write_text('{"layers": ["dense", "RR", "SR", "SS"]}')
    w = TwinWorld(0, {"head_roles": str(path)})
    assert w.roles == [[0, 1], [1], []] and w.decoder.layer_heads[2] is None
    w.rng = random.Random(0)
    for _ in range(3):
        w.start()
    for _ in range(40):   # grafts wait for the recent window's edge (32 tokens here)
        w.decode_batch(list(w.live))
    assert w.pooled.stats.grafts > 0 and w.lists_checked > 100


@pytest.mark.parametrize("seed", [0, 3])
def test_select_every_reuses_lists_between_selections(seed):
    """select_every 3: a request selects at one step and attends to those lists plus the tokens decoded since for
    the next two steps, in every sparse layer, while requests join and leave (so batch rows move and list rows are
    claimed again); each step is checked against the spec at the step its lists were selected."""
    w = TwinWorld(seed, {"select_every": 3})
    w.rng = random.Random(seed)
    w.docs = [d * 2 for d in w.docs]
    w.random_history(16, 0.35, 8, shuffle=True)   # batch order changes from step to step
    for _ in range(30):   # grafts wait for the recent window's edge
        w.decode_batch(list(w.live))
    st = w.pooled.stats
    assert w.reused > 0 and st.reused_list_steps > 0 and st.grafts > 0 and w.lists_checked > 200
    assert st.dense_fallback_steps == 0


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("steps", ["graph", "served", "eager"])
def test_select_ahead_attends_to_the_lists_of_the_step_before(seed, steps):
    """select_ahead: every step attends, in every sparse layer, to the lists the spec gives the request's query of
    the step before plus the token decoded since, and leaves the spec's lists for this step's query, while
    requests join and leave and batch rows move; never to another request's lists. A request's first decode step
    has no lists from a step before. Inside a graph ("graph") it attends to its whole sequence (counted in
    unselected_steps). Served, the plugin's hook declines the graph exactly for the steps whose batch holds one
    (TwinWorld asserts it per step), and such an eager step runs in lychee's order: every request that selects
    attends to the lists of its own query (checked against the spec). With CUDA graphs off ("eager") only the steps
    holding a first step change order."""
    w = TwinWorld(seed, {"select_ahead": True}, steps=steps)
    w.rng = random.Random(seed)
    w.docs = [d * 2 for d in w.docs]
    w.random_history(16, 0.35, 8, shuffle=True)
    for _ in range(30):
        w.decode_batch(list(w.live))
    st = w.pooled.stats
    assert w.reused > 0 and st.grafts > 0 and w.lists_checked > 200 and st.dense_fallback_steps == 0
    if steps == "graph":
        assert st.unselected_steps > 0 and w.own_steps == st.own_order_steps == 0
    else:
        assert st.unselected_steps == 0 and w.own_steps > 0 and st.own_order_steps > 0


@pytest.mark.parametrize("seed,tier", [(0, False), (3, True)])
def test_select_ahead_every_few_steps_keeps_its_lists_between_selections(seed, tier):
    """select_ahead with select_every 3: a step that selects writes the lists of the three steps after it, which
    attend to them plus the tokens decoded since and select nothing, while requests join and leave (served steps:
    a first decode step runs eagerly in lychee's order). With the host tier the loads come with the selections
    beside the attention, and a step where no row selects loads nothing."""
    w = TwinWorld(seed, {"select_ahead": True, "select_every": 3, **({"host_tier": True} if tier else {})},
                  steps="served")
    w.rng = random.Random(seed)
    w.docs = [d * 2 for d in w.docs]
    w.random_history(16, 0.35, 8, shuffle=True)
    loads = []
    for _ in range(30):
        before = w.decoder.tier.rows_hit_loaded.tolist() if tier else None
        w.decode_batch(list(w.live))
        if tier:
            loads.append((any(w.decoder.fresh[:len(w.live)].tolist()),
                          w.decoder.tier.rows_hit_loaded.tolist() != before))
    st = w.pooled.stats
    assert w.held > 0 and st.reused_list_steps > 0 and st.grafts > 0 and st.dense_fallback_steps == 0
    assert st.unselected_steps == 0 and w.own_steps > 0
    if tier:
        hit, loaded = w.decoder.tier.rows_hit_loaded.tolist()
        assert loaded > 0 and hit > loaded
        assert all(fresh or not moved for fresh, moved in loads) and not all(f for f, _ in loads)
    else:
        assert w.lists_checked > 100


@pytest.mark.parametrize("every,tier", [(1, True), (3, True), (3, False)])
def test_select_ahead_across_the_budget(every, tier):
    """select_ahead: a list selected within the budget names every position and serves the step after it. With the
    host tier it reads them from its owner's ring, which takes that step's token as well (so the ring is one token
    longer than the budget). Across the budget's edge (a request of budget - 3 tokens decoding past it) every step
    attends to every position it should."""
    w = TwinWorld(5, {"select_ahead": True, "select_every": every, **({"host_tier": True} if tier else {})},
                  steps="served")
    budget = w.cfg.token_budget
    w.start([w.rng.randrange(64) for _ in range(budget - 3)])
    for _ in range(8):
        w.decode_batch(list(w.live))
    assert w.sparse_steps > 0 and w.pooled.stats.unselected_steps == 0


@pytest.mark.parametrize("keep", [{"select_every": 3}, {"select_ahead": True}])
def test_kept_lists_survive_a_batch_past_the_captured_sizes(keep):
    """Requests that keep lists across steps decode a step through the buffers of a batch larger than the captured
    sizes (the backend's eager ``_big``) and come back: each claims a list row again, although every row of the
    captured buffers still names one of them as its owner, and attends correctly (the spec check)."""
    w = TwinWorld(4, keep)
    w.rng = random.Random(4)
    w.docs = [d * 2 for d in w.docs]
    captured, big = PooledDecode(w.manager, max_bs=4, q_heads=H * G, parts=2), w.decoder
    for _ in range(3):
        w.start()
    for decoder in (captured, captured, big, captured, captured, captured):
        w.decoder = decoder
        w.decode_batch(list(w.live))
    assert w.lists_checked > 0 and w.reused > 0


@pytest.mark.gpu
@pytest.mark.parametrize("no_sync,roles,rerank,every,bound,asked", [
    (False, "all-retrieval", 1, 1, "ball", None), (True, "all-retrieval", 1, 1, "ball", None),
    (False, "staggered-0.5", 1, 1, "ball", None), (True, "staggered-0.5", 2, 1, "ball", None),
    (True, "all-retrieval", 1, 4, "ball", None), (True, "all-retrieval", 1, "ahead", "ball", None),
    (True, "all-retrieval", 1, "ahead-4", "ball", None),
    (True, "all-retrieval", 1, 1, "box", None), (True, "all-retrieval", 1, 1, "quest", None),
    (True, "staggered-0.5", 2, 1, "ball", [None, 512, OFF])])
def test_pooled_decode_real_shapes_and_cuda_graph_replay(no_sync, roles, rerank, every, bound, asked, monkeypatch):
    """Llama-3.1-8B attention shape on the GPU: 3 long requests decode through PooledDecode captured in a
    CUDA graph; every replay (with lengths, units and grafts changing) attends exactly over the token lists it
    selected, and those lists are the ones the same orchestration picks with the kernels' torch twins (twin grafts,
    selection, emission), up to near-ties: both start from the kernels' index, yet a bound computed in another
    order may swap the chunk at the budget's edge (a few lists in a thousand, a few chunks each).
    ``no_sync``: every decode step's host work runs with CUDA's sync check set to raise (debug checks off, as
    in serving): cutting, summarizing and grafting units never waits for the GPU. ``roles``: hybrid heads, whose
    sparse heads' lists must survive from one captured layer to the next. ``rerank``: the two-stage selection's
    factor (its candidates' keys scored in the graph too). ``every``: select_every (lists kept per layer across
    steps, attended with the tokens decoded since), or "ahead": select_ahead, whose selection and emission run on
    a second stream in the graph; each step attends to the lists the step before left, and leaves the ones the
    twin selects with this step's query ("ahead-4": every 4th step selects, for the 4 steps after it).
    ``bound``: fine_bound (boxes built, grafted and scored by the kernels), or "quest": the quest method (its pages
    ranked by their boxes at weight 1, no coarse pruning). ``asked``: the
    requests' own budgets (``request_control``: the server's, 512, dense) in one captured graph."""
    from sgl_sparsekv.config import SparseKVConfig
    from sgl_sparsekv.patches.backend import join_after_forward

    ahead = str(every).startswith("ahead")
    every = int(every[6:] or 1) if ahead else every
    if no_sync:
        monkeypatch.setattr("sgl_sparsekv.manager.DEBUG", False)
        monkeypatch.setattr("sgl_sparsekv.pooled_decode.DEBUG", False)

    dev, Hk, Gq, d, layers = "cuda", 8, 4, 128, 4
    cfg = SparseKVConfig.from_method("quest", {"token_budget": 1024, "dense_layers": 1}) if bound == "quest" else \
        SparseKVConfig.from_method("lychee", {"token_budget": 1024, "dense_layers": 1, "chunking": "fixed",
                                              "head_roles": roles, "rerank_factor": rerank, "select_every": every,
                                              "select_ahead": ahead, "fine_bound": bound})
    lens = [20_000, 9_000, 31_000]
    slots = sum(lens) + 4096
    gen = torch.Generator(device=dev).manual_seed(0)
    k = [torch.randn(slots, Hk, d, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(slots, Hk, d, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(layers)]
    r2t = torch.zeros(4, 40_000, dtype=torch.int32, device=dev)
    ref = SparseKVManager(cfg, layers, Hk, d, slots, device=dev, key_dtype=torch.bfloat16, use_kernels=False)
    pooled = SparseKVManager(cfg, layers, Hk, d, slots, device=dev, key_dtype=torch.bfloat16)
    rows, nxt, toks = [1, 2, 3], 1, []
    for row, n in zip(rows, lens):
        r2t[row, :n] = torch.arange(nxt, nxt + n, dtype=torch.int32, device=dev)
        nxt += n
        toks.append(torch.randint(0, 1000, (n,)).tolist())
        for m in (ref, pooled):
            with sync_check("error" if no_sync and m is pooled else 0):   # the cut reads no slot back either
                m.prepare_extend([row], [0], [n], r2t, toks[-1:], None if asked is None else [asked[row - 1]])
            m.finish_extend([row], [True], r2t, lambda l: k[l])
    # k-means and its twin may settle in different local optima (test_kernels compares them): the twin starts
    # from the kernels' index, so the steps compare selection, not clustering
    assert [ref.states[r].segments for r in rows] == [pooled.states[r].segments for r in rows]
    for name, t in vars(ref.pools).items():
        if isinstance(t, torch.Tensor):
            t.copy_(getattr(pooled.pools, name))
    dec = PooledDecode(pooled, max_bs=4, q_heads=Hk * Gq)
    twin = PooledDecode(ref, max_bs=4, q_heads=Hk * Gq)
    q = torch.zeros(4, Hk * Gq, d, device=dev, dtype=torch.bfloat16)
    outs = [torch.zeros(4, Hk * Gq, d, device=dev, dtype=torch.bfloat16) for _ in range(1, layers)]
    # each layer's lists, copied by the graph (with select_every 1 every layer rewrites one set)
    lists = [tuple(t.clone() for t in dec._layer_lists(l - 1)) for l in range(1, layers)]
    seqs, n, cap = list(lens), 3 * Hk, cfg.token_budget

    def step(eager=False):
        for i in range(3):
            r2t[rows[i], seqs[i]] = nxt + i
            seqs[i] += 1
            toks[i].append(i)
        twin.prepare(rows, seqs, 3, r2t, toks, lambda l: k[l], eager=eager, budgets=asked)
        with sync_check("error" if no_sync else 0):
            dec.prepare(rows, seqs, 4, r2t, toks, lambda l: k[l], eager=eager, budgets=asked)
        q.copy_(torch.randn(q.shape, device=dev, generator=gen))

    def run_layers():   # keeps the lists each layer attends to: the step before's with select_ahead
        for l in range(1, layers):
            if ahead:
                for dst, src in zip(lists[l - 1], dec._layer_lists(l - 1)):
                    dst.copy_(src)
            outs[l - 1].copy_(dec.attend(q, k[l], v[l], l - 1, r2t, d ** -0.5))
            if not ahead:
                for dst, src in zip(lists[l - 1], dec._layer_lists(l - 1)):
                    dst.copy_(src)

    # the layers stand for the model, whose forward the backend wraps to join the side stream once it is issued
    model = torch.nn.Module()
    model.forward = run_layers
    join_after_forward(model, types.SimpleNamespace(active=dec))

    def sorted_lists(lens, windows):
        w = windows[:n * cap].view(n, cap).long()
        return lens[:n], torch.where(torch.arange(cap, device=dev) < lens[:n, None], w, 1 << 40).sort(1).values

    # warm up (Triton compiles) outside the graph: the requests' first decode step, eager as the plugin's hook
    # makes it (select_ahead selects it in lychee's order)
    step(eager=True)
    assert dec.own_order == ahead
    model.forward()
    for l in range(1, layers):                   # the twin too: with select_every its lists outlive the step
        twin.attend(q[:3], k[l], v[l], l - 1, r2t, d ** -0.5)
    twin.join()
    dec.fill_idle(4)                             # as SGLang's capture does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.forward()
    assert not dec.forked
    direct = (dec.direct[:3], dec.rows[:3], dec.seq[:3], r2t, dec.tail_from[:3])
    checked, near_ties = 0, []
    for it in range(90):   # grafts wait for the recent window's edge (64 tokens)
        nxt += 3
        step()
        graph.replay()
        torch.cuda.synchronize()
        for l in range(1, layers):
            got_lens, got = lists[l - 1]
            own = sparse_decode_attention_ref(q[:3], k[l], v[l], dec.starts, got, d ** -0.5, lens=got_lens,
                                              direct=direct, list_rows=dec.list_rows[:3])
            assert torch.allclose(outs[l - 1][:3].float(), own.float(), atol=2e-2, rtol=2e-2), (it, l)
            twin.attend(q[:3], k[l], v[l], l - 1, r2t, d ** -0.5)
            twin.join()
            assert torch.equal(twin.list_rows[:3], dec.list_rows[:3]) and torch.equal(twin.fresh[:3], dec.fresh[:3])
            left = dec._layer_lists(l - 1) if ahead else (got_lens, got)   # the lists the step wrote
            (a_len, a), (b_len, b) = sorted_lists(*left), sorted_lists(*twin._layer_lists(l - 1))
            assert torch.equal(a_len, b_len), (it, l)
            for j in (a != b).any(1).nonzero().flatten().tolist():
                swapped = int((~torch.isin(a[j], b[j])).sum())
                near_ties.append((it, l, j, swapped))
                assert swapped <= 4 * cfg.chunk_max, near_ties[-1]
            checked += n
    assert len(near_ties) <= checked // 100, near_ties
    assert pooled.stats.grafts == ref.stats.grafts > 0 and pooled.stats.index_builds == 3 - (asked is not None)
    if asked is not None:   # the dense request read its whole sequence at every step, and the others their budgets
        assert pooled.stats.requested_dense_steps == 91 and pooled.stats.dense_fallback_steps == 0
        assert bool(dec.direct[2]) and int(dec.budget[1]) == 2 * (512 - cfg.sink_tokens - cfg.recent_window)
    assert pooled.stats.decode_host_syncs == 0
    assert (pooled.stats.reused_list_steps > 0) == (every > 1)
    assert pooled.stats.unselected_steps == 0   # select_ahead's first steps selected with their own query
    # a request finishes: the next step caches its index over the grafted chunks without waiting for the GPU
    done = pooled.states[rows[0]]
    grafted = done.units[:done.pooled_chunks]
    pooled.request_freed(rows[0])
    with sync_check("error" if no_sync else 0):
        pooled.apply_frees(wait=False)
    assert rows[0] not in pooled.states and pooled.index_cache.find(grafted)[1] == len(grafted)
    pooled.prepare_extend([], [], [], r2t, [])   # the key slots asked for at the grafts all arrive
    # units cut since a live request's last graft wait for its next graft; the finished request's were dropped
    assert pooled.store.unkeyed == sum(len(s.unkeyed) for s in pooled.states.values())
    assert pooled.snapshot_stats()["unit_refs_unaccounted"] == 0


@pytest.mark.parametrize("method,overrides", [("lychee", {"fine_bound": "ball"}), ("lychee", {"fine_bound": "box"}),
                                              ("quest", {})])
def test_memory_charged_to_sglang_matches_what_is_allocated(method, overrides):
    """bytes_per_token (added to SGLang's per-token KV cost) covers the pools really allocated, fine boxes
    included (quest's pages are ranked by theirs)."""
    from sgl_sparsekv.config import SparseKVConfig
    from sgl_sparsekv.index_pool import pool_capacity
    from sgl_sparsekv.manager import bytes_per_token

    cfg = SparseKVConfig.from_method(method, {"dense_layers": 1, **overrides})
    slots = 1 << 18
    m = SparseKVManager(cfg, LAYERS, H, D, slots, boundary_table=synthetic_table())
    pools = m.pools
    allocated = sum(t.numel() * t.element_size() for t in vars(pools).values() if isinstance(t, torch.Tensor))
    box = cfg.fine_bound == "box"
    assert allocated == pool_capacity(cfg, slots).nbytes(LAYERS - 1, H, D, box)
    assert (pools.fine_box.numel() > 0) == box == (overrides.get("fine_bound", "box") == "box")
    charged = bytes_per_token(cfg, LAYERS, H, D) * slots
    assert allocated <= charged <= 1.03 * allocated


def test_full_pools_decode_densely_until_placed(monkeypatch):
    """No room in the pools: a request past its budget decodes on its whole context (counted), never on less,
    and gets its index placed once other requests free rows; nothing crashes or leaks."""
    monkeypatch.setattr("sgl_sparsekv.manager.pool_capacity", lambda cfg, n: PoolCapacity(coarse=8, fine=24, chunks=160))
    w = TwinWorld(7)
    w.rng = random.Random(7)
    while len(w.live) < 3:
        w.start()
    cfg, r2t, m = w.cfg, w.req_pool.req_to_token, w.pooled
    scale = D ** -0.5
    dense_seen, placed_after_dense = 0, set()
    for step in range(40):
        reqs = list(w.live)
        rows, seqs, toks = w.append_tokens(reqs)
        w.decoder.prepare(rows, seqs, len(rows), r2t, toks, lambda l: w.k[l])
        q = torch.randn(len(rows), H * G, D, generator=w.qgen)
        out = w.decoder.attend(q, w.k[1], w.v[1], 0, r2t, scale)
        for i, (row, S) in enumerate(zip(rows, seqs)):
            st = m.states[row]
            if S > cfg.token_budget and st.pool is None:
                dense_seen += 1
                assert int(w.decoder.direct[i]) == 1
                want = sparse_decode(q[i], w.k[1], w.v[1], r2t[row, :S], torch.ones(H, S, dtype=torch.bool), scale)
                assert torch.allclose(out[i], want, atol=1e-4), (step, row)
            elif st.pool is not None and st.unplaced_gen is None and m.stats.dense_fallback_steps:
                placed_after_dense.add(row)
        if step == 20:   # the requests that hold rows finish: the others must get theirs
            for req in [r for r in reqs if m.states[r.req_pool_idx].pool is not None]:
                w.finish(req, abort=False)
    assert m.stats.index_pool_full > 0 and m.stats.dense_fallback_steps == dense_seen > 0
    assert placed_after_dense, "a request that decoded densely never got its index placed"
    for req in list(w.live):
        w.finish(req, abort=False)
    m.prepare_extend([], [], [], r2t, [])
    assert all(a.free_rows == a.capacity for a in m.pools.alloc.values())
    assert m.snapshot_stats()["unit_refs_unaccounted"] == 0


@pytest.mark.gpu
def test_graft_past_int32_offsets():
    """The H100 crash: chunk keys of more than 2**31 elements (Llama-3.1-8B: 30 sparse layers x 8 heads x 128,
    about 70K chunks; then the unit store, which cached indexes kept growing) made the graft kernel's layer
    offset wrap. Offsets are 64-bit: grafting from the last rows into every layer must equal the twin."""
    dev, Ls, Hk, d, M = "cuda", 30, 8, 128, 64
    U = (1 << 31) // (Ls * Hk * d) + 1024
    summary = torch.empty(Ls, U, Hk, 1, d, dtype=torch.bfloat16, device=dev)
    assert summary.numel() > 2 ** 31
    gen = torch.Generator(device=dev).manual_seed(0)
    keys = torch.nn.functional.normalize(torch.randn(Ls * Hk, M, d, device=dev, generator=gen), dim=-1)
    lengths = torch.full((M,), 12, device=dev)
    ix = build_index(keys, lengths, 2.0, 64, 5)
    pools = IndexPools(PoolCapacity(coarse=64, fine=128, chunks=256), Ls, Hk, d, dev)
    rng = pools.load(ix.pack(), torch.cumsum(lengths, 0) - lengths, lengths, room=8)
    ref = ix.clone()
    for uid in (U - 1, U - 2):
        summary[:, uid] = torch.nn.functional.normalize(torch.randn(Ls, Hk, 1, d, device=dev, generator=gen),
                                                        dim=-1).to(summary.dtype)
        row = pools.add_chunks(rng, 1)
        graft_chunk(ref, summary[:, uid, :, 0].float().reshape(Ls * Hk, d), 12)
        jobs = torch.tensor([GraftJob(uid, 1, rng.fine_at, rng.fine, rng.coarse_at, row)], device=dev).T.contiguous()
        graft_chunks(pools, summary, jobs, torch.full((U,), 12, device=dev), torch.full((U,), 10_000, device=dev))
    torch.cuda.synchronize()
    got = pools.export(rng)
    for name, t in vars(ref).items():
        # centroids are exact (IEEE divisions); a radius's square root is not IEEE's on the GPU
        assert torch.allclose(getattr(got, name).to(t.dtype), t, atol=1e-4, rtol=1e-5), name
    pools.check_range(rng)


@pytest.mark.gpu
def test_dense_fallback_inside_cuda_graph(monkeypatch):
    """Real shapes: pools with room for one of two long requests; the other attends to its whole context from
    the captured graph (the direct rows of the attention kernel), then gets placed once the first finishes."""
    from sgl_sparsekv.config import SparseKVConfig

    dev, Hk, Gq, d, layers = "cuda", 8, 4, 128, 3
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": 1024, "dense_layers": 1, "chunking": "fixed"})
    lens = [20_000, 24_000]
    slots = sum(lens) + 4096
    # room for either request's index (fixed 16-token chunks: 1250 and 1500 chunks, as many fine clusters), not both
    monkeypatch.setattr("sgl_sparsekv.manager.pool_capacity",
                        lambda c, n: PoolCapacity(coarse=200, fine=1600, chunks=1900))
    gen = torch.Generator(device=dev).manual_seed(1)
    k = [torch.randn(slots, Hk, d, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(slots, Hk, d, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(layers)]
    r2t = torch.zeros(4, 30_000, dtype=torch.int32, device=dev)
    m = SparseKVManager(cfg, layers, Hk, d, slots, device=dev, key_dtype=torch.bfloat16)
    rows, nxt = [1, 2], 1
    for row, n in zip(rows, lens):
        r2t[row, :n] = torch.arange(nxt, nxt + n, dtype=torch.int32, device=dev)
        nxt += n
        m.prepare_extend([row], [0], [n], r2t, [[0] * n])
    dec = PooledDecode(m, max_bs=4, q_heads=Hk * Gq)
    q = torch.zeros(4, Hk * Gq, d, device=dev, dtype=torch.bfloat16)
    out = torch.zeros(4, Hk * Gq, d, device=dev, dtype=torch.bfloat16)
    seqs = list(lens)

    def step(live):
        nonlocal nxt
        for i in live:
            r2t[rows[i], seqs[i]] = nxt
            seqs[i] += 1
            nxt += 1
        dec.prepare([rows[i] for i in live], [seqs[i] for i in live], 4, r2t, [[0] * seqs[i] for i in live],
                    lambda l: k[l])
        q.copy_(torch.randn(q.shape, device=dev, generator=gen))

    step([0, 1])
    out.copy_(dec.attend(q, k[1], v[1], 0, r2t, d ** -0.5))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(dec.attend(q, k[1], v[1], 0, r2t, d ** -0.5))
    placed = [m.states[r].pool is not None for r in rows]
    assert placed.count(True) == 1, placed
    dense_i = placed.index(False)
    for _ in range(5):
        step([0, 1])
        graph.replay()
        torch.cuda.synchronize()
        row, S = rows[dense_i], seqs[dense_i]
        want = sparse_decode(q[dense_i], k[1], v[1], r2t[row, :S], torch.ones(Hk, S, dtype=torch.bool, device=dev),
                             d ** -0.5)
        assert torch.allclose(out[dense_i].float(), want.float(), atol=2e-2, rtol=2e-2)
    assert m.stats.dense_fallback_steps == 6
    m.request_freed(rows[1 - dense_i])         # the placed request finishes: its rows go back
    step([dense_i])
    assert m.states[rows[dense_i]].pool is not None and int(dec.direct[0]) == 0


@pytest.mark.gpu
def test_graft_compiles_once_across_step_shapes():
    """In serving the job table, lengths and starts are slices of the step's one int64 upload, at offsets that
    follow the step's request and chunk counts. Each new 16-byte alignment or count-derived stride used to
    compile a new graft kernel mid-serving (seconds of stall): steps of any shape must share one variant, the one
    the manager compiles at startup (``precompile_graft``)."""
    from sgl_sparsekv.kernels.graft import _graft_kernel
    dev, Ls, d = "cuda", 2, 64
    gen = torch.Generator(device=dev).manual_seed(0)
    pools = IndexPools(PoolCapacity(coarse=256, fine=512, chunks=2048), Ls, H, d, dev)
    ranges = []
    for _ in range(3):
        keys = torch.nn.functional.normalize(torch.randn(Ls * H, 24, d, device=dev, generator=gen), dim=-1)
        lengths = torch.full((24,), 12, device=dev)
        ranges.append(pools.load(build_index(keys, lengths, 2.0, 64, 5).pack(), torch.cumsum(lengths, 0) - lengths,
                                 lengths, room=64))
    cache = _graft_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(cache)
    precompile_graft(pools, torch.bfloat16)
    variants = len(cache)
    assert variants <= before + 1
    for step, (G, J, pad) in enumerate([(1, 1, 0), (2, 3, 1), (3, 5, 3), (1, 2, 2), (3, 3, 5)]):
        per = [J // G + (i < J % G) for i in range(G)]
        jobs, k0 = [], 0
        for rng, n in zip(ranges, per):
            jobs.append(GraftJob(k0, n, rng.fine_at, rng.fine, rng.coarse_at, pools.add_chunks(rng, n)))
            k0 += n
        payload = torch.tensor([7] * pad + graft_payload(jobs, [12] * J, range(J)), device=dev)[pad:]
        keys = torch.nn.functional.normalize(torch.randn(Ls, J, H, 1, d, device=dev, generator=gen), dim=-1)
        graft_chunks(pools, keys.to(torch.bfloat16), *graft_args(payload, G, J))
        n = len(cache)
        assert n == variants, f"step {step} (G={G}, J={J}, offset {pad}) compiled a new graft variant"
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("fine_bound", ["ball", "box"])
def test_index_placement_compiles_nothing_after_startup(fine_bound):
    """Placing a prompt's index pools its chunks' keys (with boxes, their min and max too) and runs k-means inside
    the prefill: a kernel variant compiled there stalls the batch for seconds. The manager compiles them at
    startup; prompts whose chunk and cluster counts are 1, divisible by 16 or neither must all reuse those
    variants."""
    from sgl_sparsekv.config import SparseKVConfig
    from sgl_sparsekv.kernels.kmeans import _assign_kernel, _sums_kernel
    from sgl_sparsekv.kernels.pool import _pool_layers_kernel

    dev, Hk, d, layers = "cuda", 8, 128, 3
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": 256, "dense_layers": 1, "chunking": "fixed",
                                                "fine_bound": fine_bound})
    # 16-token chunks: 125 chunks (12 coarse units), 129 (12), 256 (16), 4000 (64)
    lens = [2000, 2064, 4096, 64_000]
    slots = sum(lens) + 64
    gen = torch.Generator(device=dev).manual_seed(2)
    k = [torch.randn(slots, Hk, d, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(layers)]
    r2t = torch.zeros(len(lens) + 1, max(lens), dtype=torch.int32, device=dev)
    kernels = (_assign_kernel, _sums_kernel, _pool_layers_kernel)

    def variants():
        return [len(kern.device_caches[torch.cuda.current_device()][0]) for kern in kernels]

    m = SparseKVManager(cfg, layers, Hk, d, slots, device=dev, key_dtype=torch.bfloat16)
    at_start = variants()
    nxt = 1
    for row, n in enumerate(lens, start=1):
        r2t[row, :n] = torch.arange(nxt, nxt + n, dtype=torch.int32, device=dev)
        nxt += n
        m.prepare_extend([row], [0], [n], r2t, [[0] * n])
        m.finish_extend([row], [True], r2t, lambda l: k[l])
        assert m.states[row].pool is not None
        assert variants() == at_start, f"a {n}-token prompt compiled a new kernel variant"
    assert m.stats.index_builds == len(lens)
    torch.cuda.synchronize()


class LaggingCopies:
    """A stand-in GPU for StagedUpload on the CPU: it runs the queued copies ``lag`` copies behind the host, and a
    copy reads its source buffer when it runs, so a buffer the host refilled before its copy ran is caught."""

    def __init__(self, shape):
        self.shape, self.dtype, self.is_cuda = shape, torch.int32, False
        self.queue, self.ran, self.queries = [], 0, 0

    def is_contiguous(self):
        return True

    def copy_(self, src, non_blocking):
        self.queue.append((src, src.clone()))

    def run(self, lag: int) -> None:
        while self.ran < len(self.queue) - lag:
            src, queued = self.queue[self.ran]
            assert torch.equal(src, queued), f"copy {self.ran} read a buffer the host refilled after queueing it"
            self.ran += 1

    def event(self):
        gpu = self

        class Fence:
            def record(self):
                self.after = len(gpu.queue)

            def query(self):
                gpu.queries += 1
                return gpu.ran >= self.after

        return Fence()


@pytest.mark.parametrize("lag", [0, 1, 2, 7, 9, 15, 40, "random"])
def test_staged_upload_fences_on_a_lagging_gpu(lag):
    """No copy reads a buffer the host refilled, however far behind the GPU runs (0 to 40 copies); with the GPU a
    step or two behind no buffer is replaced and a step queries an event once in ring // 2 copies."""
    gpu = LaggingCopies((3, 4))
    up = StagedUpload(gpu, ring=16, event=gpu.event)
    rng = random.Random(0)
    steps = 400
    for v in range(steps):
        gpu.run(rng.randint(0, 40) if lag == "random" else lag)
        up.host()[:] = v
        up.upload()
    gpu.run(0)
    assert [int(q[0, 0]) for _, q in gpu.queue] == list(range(steps))
    if lag != "random" and lag <= 2:
        assert up.fresh == 0 and gpu.queries <= steps // 8
    if lag == 40:
        assert up.fresh > steps // 2


@pytest.mark.gpu
def test_staged_upload_never_rewrites_a_pending_copy():
    """The step's range table goes up through a ring of pinned buffers. With the GPU held busy, every copy is still
    pending when the ring comes round: each step must still deliver its own values, without waiting."""
    dest = torch.zeros(3, 8, dtype=torch.int32, device="cuda")
    up = StagedUpload(dest, ring=2)
    seen = torch.zeros(6, 3, 8, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    with sync_check("error"):
        torch.cuda._sleep(200_000_000)   # about 0.1 s of GPU time ahead of the copies
        for v in range(6):
            up.host()[:] = v
            up.upload()
            seen[v].copy_(dest)
    torch.cuda.synchronize()
    assert seen.flatten(1).tolist() == [[v] * 24 for v in range(6)]
    assert up.fresh == 4   # every buffer came round with its copy pending
