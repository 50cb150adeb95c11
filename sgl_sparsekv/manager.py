"""SparseKVManager: the whole sparse-decoding data path for one model replica, in plain torch.

    prefill  -> prepare_extend: cut the request's new tokens into units, reuse the prefix's units
    (layer)  -> pool_layer:     summarize the new units from the layer's freshly written keys
    decode   -> prepare_decode: pack the decode buffer into a unit once its window is known
    (layer)  -> pool_layer, then select: index (built on first use, grafted after) -> token mask
    free     -> request_freed / slots_freed: deferred, applied at the next batch

It knows nothing of SGLang: the attention backend in ``sgl_sparsekv.patches`` feeds it batch
facts (request pool rows, lengths, KV slots, token ids) and the per-layer KV buffers.
Frees arrive from the scheduler thread and are applied at the start of the next batch in the
forward thread, so a batch never sees half-applied frees (SGLang may overlap scheduling with
the forward pass).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from sgl_sparsekv.chunking import BoundaryTable, Chunker
from sgl_sparsekv.config import SparseKVConfig
from sgl_sparsekv.index import ClusterIndex, build_index, graft
from sgl_sparsekv.index_cache import IndexCache
from sgl_sparsekv.kernels.pool import pool_units
from sgl_sparsekv.select import select_chunks, select_pages, units_to_token_mask
from sgl_sparsekv.store import UnitStore
from sgl_sparsekv.summary import summarize_units


@dataclass
class RequestState:
    """One live request: its unit chain (in position order) and, per sparse layer, its index."""

    units: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    seq_len: int = 0
    index: dict[int, ClusterIndex] = field(default_factory=dict)
    adopted: tuple[int, int] | None = None  # (IndexCache entry, shared units) this request grafts onto

    @property
    def indexed_end(self) -> int:
        return self.ends[-1] if self.ends else 0


@dataclass
class PoolPlan:
    """Units whose summaries this forward computes, and the KV slots of their tokens."""

    unit_ids: list[int] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    _packed: tuple | None = None

    def add(self, uid: int, slots: torch.Tensor) -> None:
        self.unit_ids.append(uid)
        self.slots.append(slots)

    def packed(self, device):
        """(unit ids, token slots, indptr) for summarize_units / kernels.pool.pool_units."""
        if self._packed is None:
            ids = torch.tensor(self.unit_ids, dtype=torch.int64, device=device)
            counts = torch.tensor([len(s) for s in self.slots], dtype=torch.int64, device=device)
            indptr = torch.zeros(len(self.slots) + 1, dtype=torch.int32, device=device)
            indptr[1:] = torch.cumsum(counts, 0)
            self._packed = (ids, torch.cat(self.slots).to(torch.int32), indptr)
        return self._packed


class SparseKVManager:
    def __init__(self, cfg: SparseKVConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_slots: int, device="cpu", boundary_table: BoundaryTable | None = None,
                 summary_dtype: torch.dtype = torch.float32):
        assert cfg.enabled
        self.cfg = cfg
        self.num_layers = num_layers
        self.device = torch.device(device)
        if cfg.method == "lychee":
            self.chunker = Chunker(cfg.chunking, cfg.chunk_min, cfg.chunk_max, boundary_table)
        else:
            self.chunker = Chunker("fixed", cfg.page_size, cfg.page_size, None)
        vecs = 1 if cfg.method == "lychee" else 2  # mean key, or key min and max
        self.store = UnitStore(num_slots, max(0, num_layers - cfg.dense_layers), num_kv_heads, head_dim,
                               vecs, self.device, dtype=summary_dtype)
        self.states: dict[int, RequestState] = {}
        self.index_cache = IndexCache(self.store)
        self._lock = threading.Lock()
        self._freed_reqs: list[int] = []
        self._freed_slots: list[torch.Tensor] = []
        self._cleared = False
        self.stats = {"index_builds": 0, "index_reused": 0, "grafts": 0, "sparse_steps": 0, "dense_steps": 0,
                      "attended_tokens": 0, "context_tokens": 0}

    # ------------------------------------------------------------------ frees (any thread)
    def request_freed(self, req_pool_idx: int) -> None:
        with self._lock:
            self._freed_reqs.append(int(req_pool_idx))

    def slots_freed(self, slots: torch.Tensor) -> None:
        with self._lock:
            self._freed_slots.append(slots.detach().to(self.device, torch.int64).clone())

    def cache_cleared(self) -> None:
        with self._lock:
            self._cleared = True

    def _apply_frees(self) -> None:
        with self._lock:
            reqs, slots, cleared = self._freed_reqs, self._freed_slots, self._cleared
            self._freed_reqs, self._freed_slots, self._cleared = [], [], False
        for idx in reqs:
            self._drop(idx)
        if slots:
            self.store.free_slots(torch.cat(slots))
        if cleared:
            self.store.clear()

    def _drop(self, idx: int) -> None:
        state = self.states.pop(idx, None)
        if state is None:
            return
        # a finished turn leaves its (grafted) index for the next turn that extends it
        if state.index:
            for l, index in state.index.items():
                self._graft_missing(index, l, state)
            self.index_cache.put(state.units, self._lengths(state), state.index)
        self.store.release(state.units)

    # ------------------------------------------------------------------ per batch (forward thread)
    def prepare_extend(self, req_pool_indices: list[int], prefix_lens: list[int], seq_lens: list[int],
                       req_to_token: torch.Tensor, input_ids: torch.Tensor, out_cache_loc: torch.Tensor) -> PoolPlan:
        self._apply_frees()
        self.store.slot_token[out_cache_loc.to(torch.int64)] = input_ids.to(self.device, torch.int32)
        plan = PoolPlan()
        for idx, prefix, seq in zip(req_pool_indices, prefix_lens, seq_lens):
            state = self.states.get(idx)
            if state is None or state.seq_len != prefix:
                # a new request (maybe with a radix hit), or a row reused after a free we never saw
                self._drop(idx)
                state = self.states[idx] = RequestState()
                self._adopt_prefix(state, req_to_token[idx, :prefix])
            self._cut(state, req_to_token[idx], seq, plan)
        return plan

    def prepare_decode(self, req_pool_indices: list[int], seq_lens: list[int], req_to_token: torch.Tensor,
                       input_ids: torch.Tensor, out_cache_loc: torch.Tensor) -> PoolPlan:
        self._apply_frees()
        self.store.slot_token[out_cache_loc.to(torch.int64)] = input_ids.to(self.device, torch.int32)
        plan = PoolPlan()
        for idx, seq in zip(req_pool_indices, seq_lens):
            state = self.states.get(idx)
            if state is None:  # decode without a prefill we saw (e.g. a retracted request resumed)
                state = self.states[idx] = RequestState()
                self._adopt_prefix(state, req_to_token[idx, :seq - 1])
            self._cut(state, req_to_token[idx], seq, plan)
        return plan

    def _adopt_prefix(self, state: RequestState, slots: torch.Tensor) -> None:
        for uid in self.store.chain(slots, self.chunker.lookahead):
            state.units.append(uid)
            state.starts.append(int(self.store.unit_start[uid]))
            state.ends.append(int(self.store.unit_end[uid]))

    def _cut(self, state: RequestState, row: torch.Tensor, seq_len: int, plan: PoolPlan) -> None:
        """Cut every unit whose decision window lies inside the request's first ``seq_len`` tokens."""
        start = state.indexed_end
        state.seq_len = seq_len
        if seq_len - start < self.chunker.lookahead:
            return
        slots = row[start:seq_len].to(torch.int64)
        prev = 0
        for end in self.chunker.cuts(self.store.slot_token[slots]).tolist():
            key_slot = int(slots[prev + self.chunker.lookahead - 1])  # last token the cut depended on
            uid, fresh = self.store.add_or_reuse(start + prev, start + end, key_slot)
            if fresh:
                plan.add(uid, slots[prev:end])
            state.units.append(uid)
            state.starts.append(start + prev)
            state.ends.append(start + end)
            prev = end

    # ------------------------------------------------------------------ per layer
    def is_sparse_layer(self, layer_id: int) -> bool:
        return layer_id >= self.cfg.dense_layers

    def needs_sparse(self, seq_len: int) -> bool:
        return seq_len > self.cfg.token_budget

    def pool_layer(self, layer_id: int, k_buffer: torch.Tensor, plan: PoolPlan) -> None:
        """Summaries of the plan's new units from this layer's keys (already written to the pool)."""
        if not plan.unit_ids or not self.is_sparse_layer(layer_id):
            return
        ids, slots, indptr = plan.packed(self.device)
        summarize = pool_units if k_buffer.is_cuda else summarize_units
        summary = summarize(k_buffer, slots, indptr, self.cfg.method == "quest")   # [U, H, d] or [U, H, 2, d]
        l = layer_id - self.cfg.dense_layers
        self.store.summary[l, ids] = summary.view(len(ids), *self.store.shape).to(self.store.dtype)

    def select(self, layer_id: int, req_pool_idx: int, q: torch.Tensor) -> torch.Tensor | None:
        """bool [H, seq_len] of tokens to attend for one request; None means attend densely.

        q: [H, G, d] the request's query heads grouped by KV head.
        """
        state = self.states[req_pool_idx]
        S, cfg = state.seq_len, self.cfg
        if not self.is_sparse_layer(layer_id) or not self.needs_sparse(S):
            return None
        sink = min(cfg.sink_tokens, S)
        recent = min(cfg.recent_window, S - sink)
        budget = cfg.token_budget - sink - recent
        l = layer_id - cfg.dense_layers
        starts = torch.tensor(state.starts, dtype=torch.int64, device=self.device)
        ends = torch.tensor(state.ends, dtype=torch.int64, device=self.device)
        qf = q.to(torch.float32)
        if not state.units:
            unit_sel = torch.zeros(q.shape[0], 0, dtype=torch.bool, device=self.device)
        elif cfg.method == "lychee":
            index = self._index(l, state)
            unit_sel = select_chunks(index, qf, budget, cfg.coarse_expand, cfg.gqa_reduce)
        else:
            summ = self.store.summary[l, state.units].to(torch.float32)   # [N, H, 2, d]
            unit_sel = select_pages(qf, summ[:, :, 0].transpose(0, 1), summ[:, :, 1].transpose(0, 1),
                                    budget, cfg.page_size, cfg.gqa_reduce)
        return units_to_token_mask(unit_sel, starts, ends, S, sink, recent)

    def _lengths(self, state: RequestState) -> torch.Tensor:
        return torch.tensor(state.ends, device=self.device) - torch.tensor(state.starts, device=self.device)

    def _index(self, l: int, state: RequestState) -> ClusterIndex:
        """The request's index at sparse layer ``l``: adopted from a shared prefix or built, then grafted."""
        index = state.index.get(l)
        if index is None:
            if state.adopted is None:
                # requests earlier in this very batch may have just cached this layer for a shared prefix
                state.adopted = self.index_cache.find(state.units)
            if state.adopted is not None:
                index = self.index_cache.adopt(*state.adopted, l)
            if index is not None:
                self.stats["index_reused"] += 1
            else:
                keys = self.store.summary[l, state.units, :, 0].to(torch.float32).transpose(0, 1)  # [H, M, d]
                index = build_index(keys, self._lengths(state), self.cfg.fine_cluster_size, self.cfg.max_coarse,
                                    self.cfg.kmeans_iters)
                self.stats["index_builds"] += 1
                self.index_cache.add(state.units, self._lengths(state), l, index)
            state.index[l] = index
        self._graft_missing(index, l, state)
        return index

    def _graft_missing(self, index: ClusterIndex, l: int, state: RequestState) -> None:
        """Lazy update: graft the units the request packed since its index was last brought up to date."""
        for i in range(index.num_chunks, len(state.units)):
            graft(index, self.store.summary[l, state.units[i], :, 0].to(torch.float32), state.ends[i] - state.starts[i])
            self.stats["grafts"] += 1

    # ------------------------------------------------------------------ reporting
    def snapshot_stats(self) -> dict:
        out = dict(self.store.stats)
        out.update(self.stats)
        out["live_units"] = self.store.live_units
        out["live_requests"] = len(self.states)
        out["index_bytes"] = (self.store.nbytes() + self.index_cache.nbytes()
                              + sum(ix.nbytes() for s in self.states.values() for ix in s.index.values()))
        out["cached_indexes"] = len(self.index_cache.entries)
        return out
