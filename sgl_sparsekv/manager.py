"""SparseKVManager: the whole sparse-decoding data path for one model replica, in plain torch.

One lifecycle for every method: each request's cluster index (every sparse layer) lives in the fixed index pools
(``index_pool.py``), and decode runs static-shape steps over them, which a CUDA graph can hold. Only the ops differ:
Triton kernels on the GPU, their torch twins on the CPU. A method is a selection policy of this lifecycle: lychee
cuts structure-aware chunks and clusters them; quest cuts fixed pages, one fine cluster each, ranked by their key
boxes (``SparseKVConfig.quest_policy``); hybrid heads choose which heads select (``head_roles``).

    prefill  -> prepare_extend: cut the request's new tokens into units, reuse the prefix's units
             -> finish_extend:  after the last layer, place the index of every request whose prompt is
                                complete, so decode never clusters: a cached prefix's index is adopted as a
                                shared segment (one copy in the pools for all its adopters), and the chunks
                                past it are clustered into the request's own segment; without a cached
                                prefix the whole prompt is built into its own segment
    decode   -> prepare_decode_pooled: cut, graft the chunks each index lacks (``graft_chunks``) into the
                request's own segment -> per-request (shared, own) pool ranges
    (layer)  -> select_fine, emit_tokens, sparse_decode_attention (``sgl_sparsekv/pooled_decode.py``)
    free     -> request_freed / slots_freed: deferred, applied at the next batch; a finished request
                leaves its grafted index in the IndexCache for the next turn or fork

No unit keeps a summary: a chunk's key (its L2-normalized mean key, per sparse layer and KV head, and with fine
boxes its keys' min and max) is computed from the KV pool when a build or a graft needs it (``chunk_keys``), and
only the index keeps what it needs of it.

A decode step never waits for the GPU: request rows, lengths and token ids come from the host (the
scheduler's requests), token spans are gathered from ``req_to_token`` on the device, and the key slots
of units cut at decode are gathered with the next graft's chunks and come back one step after it
(``transfer.LateRead``). A prefill does not wait either: it asks for its units' key slots in its own step, and
the next prefill (the first that could hit them in the radix cache) waits for them.

It knows nothing of SGLang: the attention backend in ``sgl_sparsekv.patches`` feeds it batch
facts (request pool rows, lengths, the requests' token ids) and the per-layer KV buffers.
Frees arrive from the scheduler thread and are applied at the start of the next batch in the
forward thread, so a batch never sees half-applied frees (SGLang may overlap scheduling with
the forward pass).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from sgl_sparsekv.chunking import BoundaryTable, Chunker
from sgl_sparsekv.config import SparseKVConfig
from sgl_sparsekv.index import build_index_grouped, empty_index, precompile_build
from sgl_sparsekv.index_cache import IndexCache, chain, longest_shared
from sgl_sparsekv.index_pool import IndexPools, PoolRanges, pool_capacity
from sgl_sparsekv.kernels.graft import GraftJob, graft_args, graft_chunks, graft_payload, precompile_graft
from sgl_sparsekv.kernels.pool import pool_units_layers, pool_units_ref
from sgl_sparsekv.kernels.select import Segment
from sgl_sparsekv.pool_ops import graft_chunks_ref
from sgl_sparsekv.recall_audit import RecallAudit
from sgl_sparsekv.request_control import OFF
from sgl_sparsekv.stats import Counters
from sgl_sparsekv.store import UnitStore
from sgl_sparsekv.tensor_parallel import KVShard
from sgl_sparsekv.transfer import DEBUG, LateRead, to_device


class SharedSegment(NamedTuple):
    """An adopted prefix's segment in the pools, read-only: the pools' key of the segment, its ranges as the pools
    hold them (``IndexPools.compact`` moves them in place), and the chunks this request shares (an adopter may share
    fewer than the one that loaded it)."""

    key: int
    parent: PoolRanges
    chunks: int

    @property
    def ranges(self) -> PoolRanges:
        """The segment's ranges with ``chunks`` cut to this request's share (a copy: read, never kept)."""
        return dataclasses.replace(self.parent, chunks=self.chunks)

    def segment(self) -> Segment:
        """The rows the selection kernels read for this request."""
        p = self.parent
        return Segment(p.coarse_at, p.coarse, p.fine_at, p.fine, p.chunk_at, self.chunks)


class KeptLists(NamedTuple):
    """The token lists a request keeps across decode steps (select_every > 1, select_ahead): the decoder whose
    buffers hold them, their list row there, and the length at which they were selected (None: not yet)."""

    decoder: object
    row: int
    selected_at: int | None


@dataclass
class RequestState:
    """One live request: its unit chain (in position order) and its rows in the index pools."""

    units: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    seq_len: int = 0
    pool: PoolRanges | None = None      # its own segment: the chunks past the adopted prefix, grafts go here
    shared: SharedSegment | None = None
    # the pools' generation when placing the index last failed; until it is placed the request
    # decodes densely (full context) and retries once a free changed the generation
    unplaced_gen: int | None = None
    row: int = -1   # the request's row in req_to_token (its key in ``SparseKVManager.states``)
    # units cut at decode whose key slots nobody asked the device for yet (asked for at the grafts; a request
    # that finishes before drops their keys: a later turn re-cuts those tokens, as it would past its cached index)
    unkeyed: list[int] = field(default_factory=list)
    lists: KeptLists | None = None
    # its own token budget (``request_control``): None, the server's; 0 (OFF), dense decoding and no index placed
    budget: int | None = None

    @property
    def indexed_end(self) -> int:
        return self.ends[-1] if self.ends else 0

    @property
    def segments(self) -> list[PoolRanges]:
        """Its index's pool segments in union order (the shared one first)."""
        return ([self.shared.ranges] if self.shared else []) + ([self.pool] if self.pool else [])

    @property
    def pooled_chunks(self) -> int:
        return (self.shared.chunks if self.shared else 0) + (self.pool.chunks if self.pool else 0)


class PackedPlan(NamedTuple):
    """A ``PoolPlan`` on the device, from one upload and one gather: each span's output row (``ids``), the KV slots of
    all spans' tokens, span after span, delimited by ``indptr`` (``kernels.pool``'s inputs), the key slot of each new
    unit, and the plan's ``payload`` of further integers."""

    ids: torch.Tensor
    token_slots: torch.Tensor
    indptr: torch.Tensor
    key_slots: torch.Tensor
    payload: torch.Tensor


@dataclass
class PoolPlan:
    """Token spans whose keys this forward pools: (output row, request row, start, end), whose KV slots are
    gathered from ``req_to_token`` on the device; and the (request row, position) of each new unit's key slot,
    gathered in the same pass. The output row is a row of ``chunk_keys``.
    ``payload``: more integers for the step's kernels, uploaded with them."""

    req_to_token: torch.Tensor | None = None
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    keys: list[tuple[int, int]] = field(default_factory=list)
    payload: list[int] = field(default_factory=list)
    _packed: PackedPlan | None = None

    def add(self, uid: int, row: int, start: int, end: int) -> None:
        self.spans.append((uid, row, start, end))

    def packed(self, device) -> PackedPlan:
        """The plan on the device: one upload and one gather for the whole step."""
        if self._packed is None:
            uid, row, start, end = np.array(self.spans, dtype=np.int64).reshape(-1, 4).T
            krow, kpos = np.array(self.keys, dtype=np.int64).reshape(-1, 2).T
            counts = end - start
            indptr = np.concatenate([[0], np.cumsum(counts)])
            pos = np.arange(indptr[-1]) + np.repeat(start - indptr[:-1], counts)
            # (request row, position) as flat indexes into req_to_token: one gather (torch.take) on the device
            width = self.req_to_token.shape[1]
            at = np.concatenate([np.repeat(row, counts) * width + pos, krow * width + kpos])
            n, t = len(uid), len(at)
            flat = to_device(torch.from_numpy(np.concatenate(
                [uid, indptr, at, np.asarray(self.payload, dtype=np.int64)])), device)
            slots = torch.take(self.req_to_token, flat[2 * n + 1:2 * n + 1 + t]).to(torch.int32)
            self._packed = PackedPlan(flat[:n], slots[:t - len(kpos)], flat[n:2 * n + 1].to(torch.int32),
                                      slots[t - len(kpos):], flat[2 * n + 1 + t:])
        return self._packed


logger = logging.getLogger("sgl_sparsekv")


def bytes_per_token(cfg: SparseKVConfig, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Memory the manager needs per KV slot: its index pools."""
    layers = max(0, num_layers - cfg.dense_layers)
    per = pool_capacity(cfg, 1 << 20).nbytes(layers, num_kv_heads, head_dim, cfg.fine_bound == "box") / (1 << 20)
    return int(per * 1.01) + 1   # 1% for the few fixed rows the capacities add


class SparseKVManager:
    def __init__(self, cfg: SparseKVConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_slots: int, device="cpu", boundary_table: BoundaryTable | None = None,
                 key_dtype: torch.dtype = torch.float32, use_kernels: bool | None = None,
                 kv_shard: KVShard | None = None, kv_dtype: torch.dtype | None = None):
        """``use_kernels``: Triton kernels (default on a CUDA device) or their torch twins. ``key_dtype``: the chunk
        keys' (the model's on the GPU). ``kv_dtype``: the KV buffers' (fp8 when quantized), ``key_dtype`` by default.
        ``kv_shard``: which of the model's KV heads the ``num_kv_heads`` are (under
        tensor parallelism); all of them by default."""
        assert cfg.enabled
        self.cfg = cfg
        self.num_layers = num_layers
        self.kv_shard = kv_shard or KVShard.whole(num_kv_heads)
        assert self.kv_shard.count == num_kv_heads, (self.kv_shard, num_kv_heads)
        self.device = torch.device(device)
        self.use_kernels = self.device.type == "cuda" if use_kernels is None else use_kernels
        self.chunker = Chunker(cfg.chunking, cfg.chunk_min, cfg.chunk_max,
                               boundary_table if cfg.chunking == "structure" else None)
        sparse_layers = max(0, num_layers - cfg.dense_layers)
        self.key_dtype = key_dtype
        self.kv_dtype = kv_dtype or key_dtype
        self.stats = Counters()
        self.store = UnitStore(num_slots, capacity=num_slots // cfg.chunk_min + 64, stats=self.stats)
        self.states: dict[int, RequestState] = {}
        self.index_cache = IndexCache(self.store)
        self.pools = IndexPools(pool_capacity(cfg, num_slots), sparse_layers, num_kv_heads, head_dim, self.device,
                                box=cfg.fine_bound == "box")
        self.audit = (RecallAudit(cfg.recall_audit_every, sparse_layers, cfg.dense_layers)
                      if cfg.recall_audit_every else None)
        self.tier_gauges = None   # the host tier's gauges from SGLang's allocator (patches/host_tier.py)
        self.max_requests = None  # requests SGLang runs at once: with the host tier, the decoders' hot buffers
        if self.use_kernels:
            precompile_graft(self.pools, self.key_dtype)
            self._precompile_build()
        self._lock = threading.Lock()
        self._freed_reqs: list[int] = []
        self._freed_slots: list[torch.Tensor] = []
        self._cleared = False
        self._k_ptrs = None   # (base addresses, their device table) of the sparse layers' key buffers
        self._segment_chains: dict[int, np.ndarray] = {}   # unit chain of each shared segment in the pools, by key
        self._segment_keys = 0
        # key slots of new units and freed KV slots, both read back from the device without waiting,
        # applied in the order they happened: ("keys", unit ids, LateRead) | ("slots", None, LateRead) | ("clear",)
        self._ordered: deque = deque()

    # ------------------------------------------------------------------ frees (any thread)
    def request_freed(self, req_pool_idx: int) -> None:
        with self._lock:
            self._freed_reqs.append(int(req_pool_idx))

    def slots_freed(self, slots: torch.Tensor) -> None:
        read = LateRead(slots.detach())   # SGLang's freed slots live on the device: no wait here either
        with self._lock:
            self._freed_slots.append(read)

    def cache_cleared(self) -> None:
        with self._lock:
            self._cleared = True

    def apply_frees(self, wait: bool = True) -> None:
        """Apply the frees observed since the last batch: at every batch, and when the scheduler goes idle.

        Slot frees and unit keys from the device apply in the order they happened, as far as they reached the
        host; ``wait`` (prefill, idle) waits for all of them, a decode step (``wait=False``) never does.
        """
        if not (wait or self._freed_reqs or self._freed_slots or self._cleared or self._ordered):
            return   # a decode step with nothing to apply (one that races a free applies it at the next step)
        with self._lock:
            reqs, slots, cleared = self._freed_reqs, self._freed_slots, self._cleared
            self._freed_reqs, self._freed_slots, self._cleared = [], [], False
        for idx in reqs:
            self._drop(idx)
        self._ordered.extend(("slots", None, read) for read in slots)
        if cleared:   # a cache flush: the cached indexes go with the cached KV
            self._ordered.append(("clear", None, None))
        while self._ordered:
            kind, uids, read = self._ordered[0]
            if read is not None and not (wait or read.ready()):
                break
            if kind == "keys":
                self.store.key(uids, read.get().tolist())
            elif kind == "slots":
                self.store.free_slots(read.get())
            else:
                self.index_cache.clear()
                self.store.clear()
            self._ordered.popleft()

    def _drop(self, idx: int) -> None:
        state = self.states.pop(idx, None)
        if state is None:
            return
        # a finished turn leaves its (grafted) index for the next turn that extends it
        if state.pool is not None:
            t0 = time.perf_counter()
            self._release_index(state, finished=True)
            self.stats.index_release_s += time.perf_counter() - t0
        self.store.drop_unkeyed(state.unkeyed)
        self.store.release(state.units)

    def _release_index(self, state: RequestState, finished: bool) -> None:
        """Cache the index over the chunks grafted so far, then free its pool rows. The chunks past them (the
        recent window's) are left to whoever extends it. ``finished``: the entry replaces the entries its chain
        extends (the next turn adopts it); else it is kept beside them (a request that ran out of pool room
        adopts it when it retries)."""
        segs = state.segments
        cache = self.index_cache.put if finished else self.index_cache.add
        lengths = self.pools.lengths(*segs)
        cache(state.units[:state.pooled_chunks], lengths, self.pools.export_packed(*segs, lengths=lengths))
        self.pools.free(state.pool)
        if state.shared is not None:
            self._release_shared(state.shared.key)
        state.pool = state.shared = None

    # ------------------------------------------------------------------ per batch (forward thread)
    def prepare_extend(self, req_pool_indices: list[int], prefix_lens: list[int], seq_lens: list[int],
                       req_to_token: torch.Tensor, tokens: list, budgets: list | None = None) -> None:
        """tokens: per request its token ids on the host, by position (at least its first ``seq_len``); budgets: per
        request its own token budget (``RequestState.budget``), None for the server's."""
        t0 = time.perf_counter()
        self.apply_frees()   # waits: a radix hit may reach units whose key slots are still on their way
        self.stats.extend_wait_s += time.perf_counter() - t0
        plan = PoolPlan(req_to_token)
        states = []
        budgets = budgets or [None] * len(req_pool_indices)
        for idx, prefix, seq, toks, own in zip(req_pool_indices, prefix_lens, seq_lens, tokens, budgets):
            state = self.states.get(idx)
            if state is None or state.seq_len != prefix:
                # a new request (maybe with a radix hit), or a row reused after a free we never saw
                self._drop(idx)
                state = self.states[idx] = RequestState(row=idx)
                t0 = time.perf_counter()
                self._adopt_prefix(state, req_to_token[idx, :prefix])
                self.stats.extend_wait_s += time.perf_counter() - t0
            state.seq_len, state.budget = seq, own
            self._cut(state, toks, seq)
            states.append(state)
        self._read_keys(self._ask_keys(states, plan), plan)

    def _cut_decode(self, req_pool_indices: list[int], seq_lens: list[int], req_to_token: torch.Tensor,
                    tokens: list, budgets: list) -> tuple[PoolPlan, list[RequestState], list[RequestState], int]:
        """The step's cuts, in one pass over the batch that also finds what the pooled path must do (a served
        step starts with cold caches, where each further pass costs tens of microseconds): (plan, the requests'
        states, those past the budget whose index is not in the pools, steps until the first chunk an index in
        the pools lacks leaves the recent window)."""
        plan, states, unplaced, get, la = PoolPlan(req_to_token), [], [], self.states.get, self.chunker.lookahead
        budget, lag = self.cfg.token_budget, 1 << 62
        for idx, seq, toks, own in zip(req_pool_indices, seq_lens, tokens, budgets):
            state = get(idx)
            if state is None:  # decode without a prefill we saw (e.g. a retracted request resumed)
                state = self.states[idx] = RequestState(row=idx)
                self._adopt_prefix(state, req_to_token[idx, :seq - 1])
                self.stats.decode_host_syncs += 1
            state.seq_len, state.budget = seq, own
            states.append(state)
            if toks is not None:
                known = min(seq - 1, len(toks))
                if known - (state.ends[-1] if state.ends else 0) >= la:   # _cut's guard, ahead of its call
                    self._cut(state, toks, known)
            if state.pool is None:
                if seq > budget and state.units and own != OFF:
                    unplaced.append(state)
            elif (i := state.pooled_chunks) < len(state.units):
                lag = min(lag, state.starts[i] - seq)
        return plan, states, unplaced, lag + self.cfg.recent_window

    def _ask_keys(self, states: list[RequestState], plan: PoolPlan) -> list[int]:
        """Add the key positions of the states' units not keyed yet to the plan (before it is packed); their ids."""
        la, start, asked = self.chunker.lookahead, self.store.unit_start, []
        for s in states:
            if s.unkeyed:
                plan.keys.extend((s.row, int(start[u]) + la - 1) for u in s.unkeyed)
                asked += s.unkeyed
                s.unkeyed = []
        return asked

    def _read_keys(self, uids: list[int], plan: PoolPlan) -> None:
        """The key slots of ``uids`` that the plan gathered come back one step late."""
        if uids:
            self._ordered.append(("keys", uids, LateRead(plan.packed(self.device).key_slots)))

    def _adopt_prefix(self, state: RequestState, slots: torch.Tensor) -> None:
        found = self.store.chain(slots, self.chunker.lookahead)
        state.units.extend(found)
        state.starts.extend(self.store.unit_start[found].tolist())   # host arrays: no device sync
        state.ends.extend(self.store.unit_end[found].tolist())

    def _cut(self, state: RequestState, tokens, known: int) -> None:
        """Cut every unit whose decision window lies inside the request's first ``known`` tokens: new units whose
        key slots the step reads back without waiting (``_ask_keys``); the next prefill's ``apply_frees`` waits
        for them, so a radix hit on them finds them (``_adopt_prefix``)."""
        start = state.indexed_end
        if tokens is None or known - start < self.chunker.lookahead:
            return
        ends = self.chunker.ends(tokens[start:known])
        if not ends:
            return
        prev = 0
        for end in ends:
            a, b = start + prev, start + end
            uid = self.store.add_unkeyed(a, b)
            state.unkeyed.append(uid)
            state.units.append(uid)
            state.starts.append(a)
            state.ends.append(b)
            prev = end

    # ------------------------------------------------------------------ decode over the index pools
    def prepare_decode_pooled(self, req_pool_indices: list[int], seq_lens: list[int], req_to_token: torch.Tensor,
                              tokens: list, k_buffers, budgets: list | None = None) -> list[RequestState]:
        """Everything a decode step needs before its (graph-captured) layers run; the requests' states, which name
        their indexes' pool segments (``RequestState.pool``, ``shared``: none while a request has no index).

        k_buffers(l) -> the key buffer of model layer ``l``: the keys of the chunks grafted here are pooled from
        it, for every layer at once (their tokens precede the step's token, so their keys are all written).
        budgets: per request its own token budget, as for :meth:`prepare_extend`.
        """
        t = [time.perf_counter()]
        self.apply_frees(wait=False)
        t.append(time.perf_counter())
        plan, states, unplaced, lead = self._cut_decode(req_pool_indices, seq_lens, req_to_token, tokens,
                                                        budgets or [None] * len(req_pool_indices))
        t.append(time.perf_counter())
        if unplaced:   # normally placed when the prefill finished; here for requests that just passed the budget
            self._place(unplaced, req_to_token, k_buffers)
        t.append(time.perf_counter())
        if lead <= 0:   # the step after this one must still find every missing chunk inside its recent window
            self._graft_pooled(states, plan, k_buffers)
        t.append(time.perf_counter())
        st = self.stats
        st.prepare_frees_s += t[1] - t[0]
        st.prepare_cut_s += t[2] - t[1]
        st.prepare_place_s += t[3] - t[2]
        st.prepare_graft_s += t[4] - t[3]
        if DEBUG:
            for s in states:
                for seg in s.segments:
                    self.pools.check_range(seg)
                # every chunk the index lacks lies inside the recent window, which the step attends in full
                lacks = s.pool is not None and s.pooled_chunks < len(s.units)
                assert not lacks or s.starts[s.pooled_chunks] >= s.seq_len - self.cfg.recent_window, \
                    (s.segments, s.seq_len)
        return states

    def finish_extend(self, req_pool_indices: list[int], complete: list[bool], req_to_token: torch.Tensor,
                      k_buffers) -> None:
        """After the last layer of a prefill: place the index of every request whose prompt is complete, so
        its first decode step finds it in the pools (a k-means never runs inside a decode step)."""
        self._place([self.states[i] for i, done in zip(req_pool_indices, complete) if done], req_to_token, k_buffers)

    def chunk_keys(self, plan: PoolPlan, k_buffers) -> torch.Tensor:
        """[sparse layers, spans, H, vecs, d]: the L2-normalized mean key of each of the plan's spans (output rows 0,
        1, ...), then with fine boxes its keys' min and max (vecs 3, else 1), pooled from the KV for every sparse
        layer at once, rounded to ``key_dtype`` (the KV's on the GPU: the kernels and their twins then agree on
        every bit that clustering and grafting see)."""
        box = self.pools.box
        out = torch.empty(self.pools.layers, len(plan.spans), self.pools.heads, self.pools.key_vecs, self.pools.head_dim,
                          dtype=self.key_dtype, device=self.device)
        layers = range(self.cfg.dense_layers, self.num_layers)
        if not plan.spans or not layers:
            return out
        if not self.use_kernels:
            p = plan.packed(self.device)
            ids, slots, indptr = p.ids, p.token_slots, p.indptr
            for i, l in enumerate(layers):
                out[i, ids, :, :1] = pool_units_ref(k_buffers(l), slots, indptr, False).unsqueeze(2).to(out.dtype)
                if box:
                    out[i, ids, :, 1:] = pool_units_ref(k_buffers(l), slots, indptr, True).to(out.dtype)
            return out
        # one launch reads every sparse layer's key buffer through a table of base addresses; the KV pool
        # allocates its buffers once, so the first and last layers' addresses stand for the table
        first = k_buffers(layers[0])
        key = (first.data_ptr(), k_buffers(layers[-1]).data_ptr())
        if self._k_ptrs is None or self._k_ptrs[0] != key:
            bufs = [k_buffers(l) for l in layers]
            assert all(k.shape == first.shape and k.stride() == first.stride() and k.dtype == first.dtype
                       for k in bufs), "the sparse layers' key buffers differ in layout"
            ptrs = torch.tensor([k.data_ptr() for k in bufs], dtype=torch.int64)
            self._k_ptrs = (key, to_device(ptrs, self.device))
        p = plan.packed(self.device)
        ids, slots, indptr = p.ids, p.token_slots, p.indptr
        self._pool_keys(self._k_ptrs[1], first, slots, indptr, ids, out)
        return out

    def _pool_keys(self, k_ptrs, k0, slots, indptr, ids, out) -> None:
        """The kernel launches of :meth:`chunk_keys`: mean keys, then with fine boxes the keys' min and max."""
        pool_units_layers(k_ptrs, k0, slots, indptr, ids, out, False)
        if self.pools.box:
            pool_units_layers(k_ptrs, k0, slots, indptr, ids, out[:, :, :, 1:], True)

    def _precompile_build(self) -> None:
        """Compile the kernels that place a prompt's index (its chunks' keys, k-means) now, on eight made-up
        chunks of a made-up key buffer laid out like the KV pool's (``index.precompile_build`` says why)."""
        Ls, H, d = self.pools.layers, self.pools.heads, self.pools.head_dim
        n = 8
        if Ls == 0:
            return
        kv = torch.zeros(n, H, d, dtype=self.kv_dtype, device=self.device)
        ptrs = torch.full((Ls,), kv.data_ptr(), dtype=torch.int64, device=self.device)
        out = torch.empty(Ls, n, H, self.pools.key_vecs, d, dtype=self.key_dtype, device=self.device)
        every = torch.arange(n + 1, device=self.device)
        self._pool_keys(ptrs, kv, every[:n].int(), every.int(), every[:n], out)
        c = self.cfg
        precompile_build(d, self.device, c.fine_cluster_size, c.max_coarse, c.kmeans_iters)

    def _place(self, states: list[RequestState], req_to_token: torch.Tensor, k_buffers) -> None:
        for state in states:
            if (state.pool is None and self.needs_sparse(state.seq_len) and state.units and state.budget != OFF
                    and state.unplaced_gen != self.pools.generation):
                self._pool_index(state, req_to_token, k_buffers)

    def _pool_index(self, state: RequestState, req_to_token: torch.Tensor, k_buffers) -> None:
        """Bring a request's all-layer index into the pools: a cached prefix's index as a shared segment (loaded
        once for all its adopters), and the chunks past it clustered into a segment of its own; or built."""
        shared, seg = 0, None
        starts = to_device(torch.from_numpy(np.asarray(state.starts, dtype=np.int32)), self.device)
        lengths = self._lengths(state)
        units = chain(state.units)
        if (live := self._live_segment(units)) is not None:
            key, n = live
            seg = self.pools.acquire(key, None)
        elif (found := self.index_cache.find(units)) is not None:
            eid, n = found
            key, self._segment_keys = self._segment_keys, self._segment_keys + 1
            seg = self.pools.acquire(key, lambda: self.pools.load(self.index_cache.adopt(eid, n), starts[:n],
                                                                  lengths[:n], room=0))
            if seg is None:
                return self._unplaced(state)
            self._segment_chains[key] = units[:n]
            self.store.retain(units[:n])   # as a cached index does: no id of the chain is recycled while it lives
        if seg is not None:
            # the segment's chunks past the ones this request shares are not scanned for it (their tokens still
            # count in their clusters' sizes, a few chunks at the end of the prefix); the chunks past go to its own
            shared = min(n, seg.chunks)
            self.stats.index_reused += 1
        Ls, H, d = self.pools.layers, self.pools.heads, self.pools.head_dim
        if shared < len(state.units):
            t0 = time.perf_counter()
            plan = PoolPlan(req_to_token)
            for j, (a, b) in enumerate(zip(state.starts[shared:], state.ends[shared:])):
                plan.add(j, state.row, a, b)
            vecs = self.chunk_keys(plan, k_buffers).float()                         # [Ls, M, H, 1 or 3, d]
            M = len(state.units) - shared
            keys = vecs[:, :, :, 0].permute(0, 2, 1, 3).reshape(Ls * H, M, d)
            boxes = vecs[:, :, :, 1:].permute(0, 2, 1, 3, 4).reshape(Ls * H, M, 2, d) if self.pools.box else None
            t1 = time.perf_counter()
            c = self.cfg
            packed = build_index_grouped(keys, lengths[shared:], c.fine_cluster_size, c.max_coarse,
                                         c.kmeans_iters, chunk_box=boxes).pack()
            if seg is None:
                self.stats.index_builds += 1
                self.stats.build_chunks += len(state.units)
                self.index_cache.add(state.units, lengths, packed)   # loading below copies it into the pools
            else:
                self.stats.index_extends += 1
                self.stats.extend_chunks += len(state.units) - shared
            t2 = time.perf_counter()
            self.stats.build_keys_s += t1 - t0
            self.stats.build_cluster_s += t2 - t1
            self.stats.index_build_s += t2 - t0
        else:   # the whole prompt is the cached prefix: its own segment starts empty, for the grafts
            packed = empty_index(Ls * H, d, self.device, self.pools.box).pack()
            t2 = time.perf_counter()
        n = len(state.units) - shared
        state.pool = self.pools.load(packed, starts[shared:], lengths[shared:], room=max(64, n // 4))
        self.stats.build_load_s += time.perf_counter() - t2
        if state.pool is None:
            if seg is not None:
                self._release_shared(key)
            return self._unplaced(state)
        state.shared = SharedSegment(key, seg, shared) if seg is not None else None
        state.unplaced_gen = None

    def _live_segment(self, units: np.ndarray) -> tuple[int, int] | None:
        """(key, chunks shared) of the shared segment in the pools sharing the longest prefix with a unit chain, if
        that covers as much of it as a cached index must. Preferred to loading a cached entry: requests over one
        prefix then read one copy of its index, whichever request's cached entry each would have found (every
        finished request caches an entry of its own over the prefix)."""
        return longest_shared(self._segment_chains.items(), units, self.index_cache.min_shared)

    def _release_shared(self, key: int) -> None:
        if self.pools.release(key):
            self.store.release(self._segment_chains.pop(key))

    def _unplaced(self, state: RequestState) -> None:
        """No room in the pools: the request decodes densely until a free makes room (never on less context)."""
        state.unplaced_gen = self.pools.generation
        if not self.stats.index_pool_full:
            logger.warning("sparse-kv: the index pools are full; requests without room decode densely (whole "
                           "context) until rows free up (counted in index_pool_full and dense_fallback_steps; "
                           "raise index_pool_scale to avoid it)")
        self.stats.index_pool_full += 1

    def _graft_pooled(self, states: list[RequestState], plan: PoolPlan, k_buffers) -> None:
        """Graft the chunks the requests' pooled indexes lack, every request's at once; called when the first missing
        chunk of any of them is about to leave the recent window (until then each step attends them in full).
        After a graft no request lacks a chunk that was cut, so the next graft is due when a chunk cut later
        nears the window's edge, dozens of steps on (a 64-token window, chunks of at most 16): a batch launches
        grafts once in that many steps, not at every step where one of its requests cut a chunk. Every request's
        backlog goes in one launch (a request's chunks in order); their keys are pooled in one launch too, and
        both launches' inputs travel in the plan's one upload, with the key positions of every request's units
        cut since its last graft (so a step without a graft makes no device call here)."""
        backlog = [(s, i) for s in states if s.pool is not None and (i := s.pooled_chunks) < len(s.units)]
        jobs, lengths, starts = [], [], []
        for state, i in backlog:
            rng, n = state.pool, len(state.units) - i
            row = self.pools.add_chunks(rng, n)
            if row is None:
                # no room to grow: decode densely; a new generation, so the request retries at the next step
                self._unplaced(state)
                self._release_index(state, finished=False)
                continue
            jobs.append(GraftJob(len(plan.spans), n, rng.fine_at, rng.fine, rng.coarse_at, row))
            for a, b in zip(state.starts[i:], state.ends[i:]):
                plan.add(len(plan.spans), state.row, a, b)
                lengths.append(b - a)
                starts.append(a)
        asked = self._ask_keys(states, plan)
        if jobs:
            plan.payload = graft_payload(jobs, lengths, starts)
            keys = self.chunk_keys(plan, k_buffers)
            args = graft_args(plan.packed(self.device).payload, len(jobs), len(lengths))
            (graft_chunks if self.use_kernels else graft_chunks_ref)(self.pools, keys, *args)
            self.stats.grafts += len(lengths)
        self._read_keys(asked, plan)   # after the payload is set: the plan packs once

    # ------------------------------------------------------------------ per layer
    def is_sparse_layer(self, layer_id: int) -> bool:
        return layer_id >= self.cfg.dense_layers

    def needs_sparse(self, seq_len: int) -> bool:
        return seq_len > self.cfg.token_budget

    def _lengths(self, state: RequestState) -> torch.Tensor:
        """Tokens per unit of a request's chain, on the device (numpy: thousands of ids)."""
        return to_device(torch.from_numpy(np.subtract(state.ends, state.starts)), self.device)

    # ------------------------------------------------------------------ reporting
    def snapshot_stats(self) -> dict:
        out = self.stats.snapshot()
        out["live_units"] = self.store.live_units
        out["unit_capacity"] = self.store.capacity
        out["live_requests"] = len(self.states)
        out["index_bytes"] = self.store.nbytes() + self.index_cache.nbytes() + self.pools.nbytes()
        out["cached_indexes"] = len(self.index_cache.entries)
        out["kv_heads"] = [self.kv_shard.start, self.kv_shard.start + self.kv_shard.count]
        # every unit reference is held by a KV slot, a live request or a cached index: anything else is a leak
        held = (self.store.keyed_units + self.store.unkeyed + sum(len(e.units) for e in self.index_cache.entries.values())
                + sum(len(s.units) for s in self.states.values()) + sum(map(len, self._segment_chains.values())))
        out["unit_refs_unaccounted"] = int(self.store.refs.sum()) - held
        out["index_pools"] = self.pools.fill()
        out["index_pool_compactions"] = self.pools.compactions
        out["shared_segments"] = self.pools.shared_fill()
        out["unplaced_requests"] = sum(s.pool is None and s.unplaced_gen is not None for s in self.states.values())
        if self.audit is not None:
            out["recall_audit"] = self.audit.snapshot()
        if self.tier_gauges is not None:
            out.update(self.tier_gauges())
        return out
