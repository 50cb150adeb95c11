"""Unit state under SGLang's real radix cache: random inserts, splits, evictions, chunked prefills,
decodes and aborts must leave exactly the state a from-scratch rebuild gives, with no stale or
leaked entries, and concurrent requests sharing a prefix must keep their own decode chunks."""

import random
from array import array
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sgl_sparsekv.chunking import BoundaryTable, Chunker
from sgl_sparsekv.config import SparseKVConfig
from sgl_sparsekv.manager import SparseKVManager
from sgl_sparsekv.patches.backend import watch_frees
from sgl_sparsekv.pooled_decode import PooledDecode
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

VOCAB, LAYERS, H, D = 64, 4, 2, 16
SLOTS = 3000


def synthetic_table():
    """Token t: strength t % 5 for a few ids, so chunk cuts depend on content like real text."""
    strength = np.zeros(VOCAB, np.int8)
    strength[[3, 7, 11]] = [4, 3, 2]
    lead = np.zeros(VOCAB, bool)
    lead[::5] = True
    return BoundaryTable(strength, lead)


class World:
    """SGLang's ReqToTokenPool, token allocator and RadixCache, with a fake model writing keys."""

    def __init__(self, method, seed, overrides=None, kv_dtype=torch.float32):
        """``kv_dtype``: the KV buffers' (fp8 as SGLang stores it: written through a uint8 view)."""
        self.rng = random.Random(seed)
        cfg = SparseKVConfig.from_method(method, {"token_budget": 128, "dense_layers": 1, "recent_window": 32,
                                                  **(overrides or {})})
        self.cfg = cfg
        self.manager = SparseKVManager(cfg, LAYERS, H, D, SLOTS + 1, boundary_table=synthetic_table(),
                                       kv_dtype=kv_dtype)   # as the server passes its pool's (fp8 when quantized)
        self.req_pool = ReqToTokenPool(size=8, max_context_len=1024, device="cpu", enable_memory_saver=False)
        self.alloc = TokenToKVPoolAllocator(SLOTS, torch.float32, "cpu", kvcache=None, need_sort=False)
        self.radix = RadixCache(CacheInitParams(disable=False, req_to_token_pool=self.req_pool,
                                                token_to_kv_pool_allocator=self.alloc, page_size=1))
        watch_frees(self.manager, self.req_pool, self.alloc)
        self.holders = [(self.manager, slice(None))]   # managers that keep state, with the KV heads each holds
        g = torch.Generator().manual_seed(seed)
        self.tok_emb = torch.randn(LAYERS, VOCAB, H, D, generator=g)
        self.pos_emb = torch.randn(LAYERS, 1024, H, D, generator=g) * 0.3
        self.k = torch.zeros(LAYERS, SLOTS + 1, H, D, dtype=kv_dtype)
        self.v = torch.randn(LAYERS, SLOTS + 1, H, D, generator=g).to(kv_dtype)
        self.decoder = PooledDecode(self.manager, max_bs=8, q_heads=2 * H, parts=2)
        self.docs = [[self.rng.randrange(VOCAB) for _ in range(self.rng.randrange(100, 300))] for _ in range(3)]
        self.live = []
        self.own_budgets = None   # requests take their own budgets (request_control) from these in turn when set
        self.started = 0
        self.unkeyed_at_finish = set()   # (key slot, start, end) of units a finished request left unkeyed

    def write_kv(self, slots, tokens, positions):
        keys = (self.tok_emb[:, tokens] + self.pos_emb[:, positions]).to(self.k.dtype)
        if self.k.dtype.itemsize == 1:   # fp8 has no index_put on the CPU
            self.k.view(torch.uint8)[:, slots] = keys.view(torch.uint8)
        else:
            self.k[:, slots] = keys

    def take_slots(self, n):
        slots = self.alloc.alloc(n)
        if slots is None:
            self.radix.evict(EvictParams(num_tokens=n - self.alloc.available_size()))
            slots = self.alloc.alloc(n)
        assert slots is not None
        return slots

    def forward_extend(self, req, start, end):
        row = req.req_pool_idx
        slots = self.take_slots(end - start)
        self.req_pool.req_to_token[row, start:end] = slots.to(torch.int32)
        toks = torch.tensor(req.tokens[start:end])
        self.write_kv(slots, toks, torch.arange(start, end))
        req.decoded = 0
        for manager, heads in self.holders:
            k = [self.k[l][:, heads] for l in range(LAYERS)]
            manager.prepare_extend([row], [start], [end], self.req_pool.req_to_token, [req.tokens], [req.budget])
            manager.finish_extend([row], [end == len(req.tokens)], self.req_pool.req_to_token, k.__getitem__)

    def forward_decode(self, req):
        row, pos = req.req_pool_idx, len(req.tokens)
        tok = self.rng.randrange(VOCAB)
        req.tokens.append(tok)
        slots = self.take_slots(1)
        self.req_pool.req_to_token[row, pos] = int(slots[0])
        self.write_kv(slots, torch.tensor([tok]), torch.tensor([pos]))
        req.decoded = 1
        r2t, S, budget = self.req_pool.req_to_token, pos + 1, self.cfg.token_budget
        self.decoder.prepare([row], [S], 1, r2t, [req.tokens], lambda l: self.k[l])
        for l in range(self.cfg.dense_layers, LAYERS):
            self.decoder.attend(torch.randn(1, 2 * H, D), self.k[l], self.v[l], l - self.cfg.dense_layers, r2t,
                                D ** -0.5)
            for h in range(H):   # every list holds the newest token, within the budget
                n = int(self.decoder.lens[h])
                assert n == min(S, budget) or (S > budget and n <= budget), (n, S)
                assert int(r2t[row, pos]) in self.decoder.windows[h * budget:h * budget + n].tolist()

    def start(self, tokens=None):
        if tokens is None:
            doc = self.rng.choice(self.docs)
            cut = self.rng.randrange(len(doc) // 2, len(doc) + 1)
            tokens = doc[:cut] + [self.rng.randrange(VOCAB) for _ in range(self.rng.randrange(0, 60))]
        m = self.radix.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        prefix = min(len(m.device_indices), len(tokens) - 1)
        req = SimpleNamespace(req_pool_idx=None, inflight_middle_chunks=0, kv_committed_len=0, tokens=tokens,
                              protected=prefix, last_node=m.last_device_node,
                              budget=self.own_budgets[self.started % len(self.own_budgets)] if self.own_budgets
                              else None)
        self.started += 1
        self.radix.inc_lock_ref(req.last_node)
        self.req_pool.alloc([req])
        self.req_pool.req_to_token[req.req_pool_idx, :prefix] = m.device_indices[:prefix].to(torch.int32)
        # chunked prefill in 1-3 pieces, caching the unfinished prefix like cache_unfinished_req
        bounds = sorted({prefix, len(tokens), *[self.rng.randrange(prefix, len(tokens) + 1) for _ in range(2)]})
        for a, b in zip(bounds, bounds[1:]):
            self.forward_extend(req, a, b)
            if b < len(tokens) and self.rng.random() < 0.5:
                self.cache_unfinished(req, b)
        self.live.append(req)

    def cache_unfinished(self, req, n):
        row = req.req_pool_idx
        values = self.req_pool.req_to_token[row, :n].to(torch.int64).clone()
        res = self.radix.insert(InsertParams(key=RadixKey(array("q", req.tokens[:n])), value=values))
        self.alloc.free(values[req.protected:res.prefix_len])
        m = self.radix.match_prefix(MatchPrefixParams(key=RadixKey(array("q", req.tokens[:n]))))
        self.req_pool.req_to_token[row, :len(m.device_indices)] = m.device_indices.to(torch.int32)
        self.radix.dec_lock_ref(req.last_node)
        self.radix.inc_lock_ref(m.last_device_node)
        req.last_node, req.protected = m.last_device_node, len(m.device_indices)

    def finish(self, req, abort):
        row, n = req.req_pool_idx, len(req.tokens)
        kv = self.req_pool.req_to_token[row, :n].to(torch.int64).clone()
        # the key slots of units cut at decode are asked for at the grafts: those cut after a request's last
        # graft are never keyed (a later turn re-cuts their tokens)
        st, la = self.manager.states.get(row), self.manager.chunker.lookahead
        store = self.manager.store
        for uid in st.unkeyed if st is not None else []:
            s, e = int(store.unit_start[uid]), int(store.unit_end[uid])
            self.unkeyed_at_finish.add((int(kv[s + la - 1]), s, e))
        if abort:
            self.alloc.free(kv[req.protected:])
        else:
            # the last token's KV does not exist yet in real decoding; its slot is freed as the tail
            res = self.radix.insert(InsertParams(key=RadixKey(array("q", req.tokens[:n - 1])), value=kv[:n - 1]))
            self.alloc.free(kv[req.protected:res.prefix_len])
            self.alloc.free(kv[n - 1:])
        self.radix.dec_lock_ref(req.last_node)
        self.req_pool.free(req)
        self.live.remove(req)

    def step(self):
        r = self.rng.random()
        if r < 0.35 and len(self.live) < 4:
            self.start()
        elif r < 0.75 and self.live:
            req = self.rng.choice(self.live)
            for _ in range(self.rng.randrange(1, 40)):
                self.forward_decode(req)
        elif r < 0.9 and self.live:
            self.finish(self.rng.choice(self.live), abort=self.rng.random() < 0.3)
        else:
            self.radix.evict(EvictParams(num_tokens=self.rng.randrange(1, 200)))
        self.check_live_requests()

    # ---------------------------------------------------------------- checks
    def expected_key(self, slots):
        """A unit's key per sparse layer and KV head: its keys' normalized mean."""
        return F.normalize(self.k[self.cfg.dense_layers:, slots].float().mean(1), dim=-1)   # [L, H, D]

    def check_index(self, req):
        """A placed index records the request's first chunks, and each of them lies within its fine cluster's
        radius of the stored centroid (and so within its coarse unit's): the chunk keys the build and the grafts
        pooled from the KV were the request's own, and the upper bounds hold for what selection reads."""
        m = self.manager
        st = m.states[req.req_pool_idx]
        if st.pool is None:
            return
        ix, M = m.pools.export(*st.segments), st.pooled_chunks
        k = torch.cat([torch.arange(seg.chunk_at, seg.chunk_at + seg.chunks) for seg in st.segments])
        assert m.pools.chunk_start[k].tolist() == st.starts[:M]
        assert m.pools.chunk_len[k].tolist() == [e - s for s, e in zip(st.starts[:M], st.ends[:M])]
        row = self.req_pool.req_to_token[req.req_pool_idx]
        keys = torch.stack([self.expected_key(row[s:e].long()) for s, e in zip(st.starts[:M], st.ends)],
                           2).reshape(ix.fine_mu.shape[0], M, D)   # [sparse layers * H, M, D], layer-major
        for mu, r, owner in ((ix.fine_mu, ix.fine_r, ix.chunk_fine),
                             (ix.coarse_mu, ix.coarse_r, ix.fine_parent.gather(1, ix.chunk_fine))):
            centre = mu.float().gather(1, owner[..., None].expand(-1, -1, D))
            assert bool(((keys - centre).norm(dim=-1) <= r.gather(1, owner) + 1e-5).all())

    def check_live_requests(self):
        """Each live request's units are its own chain, with an index of its own tokens."""
        self.manager.prepare_extend([], [], [], self.req_pool.req_to_token, [])
        store = self.manager.store
        for req in self.live:
            st = self.manager.states[req.req_pool_idx]
            chunker = self.manager.chunker
            n = st.seq_len - req.decoded   # a decode step cuts from the tokens before its own
            assert st.ends == Chunker.cuts(chunker, np.array(req.tokens[:n])).tolist()
            for uid, s, e in zip(st.units, st.starts, st.ends):
                assert (int(store.unit_start[uid]), int(store.unit_end[uid])) == (s, e)
                assert int(store.refs[uid]) >= 1
            self.check_index(req)

    def paths(self):
        out = []

        def walk(node, toks, slots):
            if node.key is not None and node is not self.radix.root_node:
                toks = toks + list(node.key.token_ids)
                slots = slots + node.value.tolist()
            if not node.children and toks:
                out.append((toks, slots))
            for child in node.children.values():
                walk(child, toks, slots)

        walk(self.radix.root_node, [], [])
        return out

    def check_against_rebuild(self):
        assert not self.live
        self.manager.prepare_extend([], [], [], self.req_pool.req_to_token, [])
        self.manager.index_cache.clear()  # cached indexes hold unit references of their own
        store = self.manager.store
        snap = store.snapshot()
        rebuild = set()
        for toks, slots in self.paths():
            ends = self.manager.chunker.cuts(np.array(toks)).tolist()
            starts = [0] + ends[:-1]
            for s, e in zip(starts, ends):
                rebuild.add((slots[s + self.manager.chunker.lookahead - 1], s, e))
        # exactly the rebuild's units but those left unkeyed at a finish: none stale
        assert sorted(snap) == sorted(rebuild - self.unkeyed_at_finish)
        # no leaks: with no live request, each stored unit is held by its slot alone
        assert store.live_units == len(snap)
        assert all(int(store.refs[int(store.slot_unit[slot])]) == 1 for slot, _, _ in snap)
        assert not self.manager.states


@pytest.mark.parametrize("method", ["lychee", "quest"])
@pytest.mark.parametrize("seed", range(3))
def test_random_radix_history_equals_rebuild(method, seed):
    w = World(method, seed)
    for _ in range(120):
        w.step()
    for req in list(w.live):
        w.finish(req, abort=False)
    w.check_against_rebuild()
    assert w.manager.store.stats.units_reused > 0


def test_a_later_sharer_reads_the_live_copy_of_the_prefix_index():
    """Each finished request caches an entry of its own over the prefix it shared; a request that arrives later
    adopts the copy of the prefix's index that live requests read, not one more copy loaded from another entry
    (at 32 requests over two prefixes, one copy per finished request filled the pools)."""
    w = World("lychee", 99)
    doc = [w.rng.randrange(VOCAB) for _ in range(240)]

    def start(question_len):
        w.start(doc + [w.rng.randrange(VOCAB) for _ in range(question_len)])
        return w.live[-1]

    m = w.manager
    m.index_cache.max_entries = 1   # so the entry b adopted goes when d finishes
    w.finish(start(0), abort=False)   # the document is now cached
    b = start(20)
    sb = m.states[b.req_pool_idx]
    w.finish(start(30), abort=False)
    m.apply_frees()
    assert sb.shared is not None and m.stats.index_builds == 1 and len(m.index_cache.entries) == 1
    c = start(10)
    sc = m.states[c.req_pool_idx]
    assert sc.shared is not None and sc.shared.key == sb.shared.key
    assert m.pools.shared_fill() == {"segments": 1, "references": 2}
    for _ in range(40):
        w.forward_decode(b)
        w.forward_decode(c)
    w.check_live_requests()
    assert m.snapshot_stats()["unit_refs_unaccounted"] == 0
    for req in list(w.live):
        w.finish(req, abort=False)
    m.apply_frees()
    assert m.pools.shared_fill() == {"segments": 0, "references": 0} and not m._segment_chains
    w.check_against_rebuild()


def test_concurrent_sharers_keep_their_own_decode_chunks():
    w = World("lychee", 99)
    w.rng = random.Random(5)
    doc = w.docs[0]
    w.docs = [doc]
    w.start()
    a = w.live[0]
    w.finish(a, abort=False)            # the document is now cached
    w.start()
    w.start()
    b, c = w.live
    m = w.manager
    sb, sc = m.states[b.req_pool_idx], m.states[c.req_pool_idx]
    # both adopted the cached document's index as one shared segment: one copy in the pools, of which each reads
    # the chunks it shares (here not as many for both)
    rows = [(seg.coarse_at, seg.fine_at, seg.chunk_at) for seg in (sb.shared.ranges, sc.shared.ranges)]
    assert sb.shared.key == sc.shared.key and rows[0] == rows[1] and sb.shared.ranges.chunks != sc.shared.ranges.chunks
    assert m.pools.shared_fill() == {"segments": 1, "references": 2}
    # each clustered only its chunks past the shared ones (the counts the serving benchmark reports)
    own = [len(s.units) - s.shared.ranges.chunks for s in (sb, sc)]
    assert m.stats.extend_chunks == sum(own) == sb.pool.chunks + sc.pool.chunks > 0
    assert m.stats.build_chunks > max(own)
    frozen = m.pools.export(sb.shared.ranges)
    for _ in range(60):
        w.forward_decode(b)
        w.forward_decode(c)
    shared = set(sb.units) & set(sc.units)
    assert shared  # the cached document's chunks are shared ...
    tail_b = set(sb.units[len(sb.units) - 3:])
    tail_c = set(sc.units[len(sc.units) - 3:])
    assert not (tail_b & set(sc.units)) and not (tail_c & set(sb.units))  # ... decode chunks are not
    w.check_live_requests()
    # the sharers clustered their own chunks past the document into segments of their own, where their
    # grafts went: the shared rows are as they were
    assert m.stats.index_reused >= 2 and m.stats.index_builds == 1 and m.stats.index_extends == 2
    assert sb.pool.chunks > 0 and sc.pool.chunks > 0 and m.stats.grafts > 0
    assert all(torch.equal(t, getattr(frozen, k)) for k, t in vars(m.pools.export(sb.shared.ranges)).items())
    assert sb.pool.fine_at != sc.pool.fine_at and sb.pool.chunk_at != sc.pool.chunk_at
    for req in (b, c):
        w.finish(req, abort=False)
    m.apply_frees()
    assert m.pools.shared_fill() == {"segments": 0, "references": 0}
