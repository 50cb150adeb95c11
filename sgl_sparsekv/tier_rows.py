"""The host tier's decode buffers (docs/HOST_TIER.md, "The GPU path").

With the tier, every token's KV of a sparse layer is in the host pool, and the sparse decode reads one device buffer
per layer that holds, per owner (a request's list row, which it keeps while it decodes), its hot chunks
(``residency.HotChunks``: ``slots`` slots of ``width`` rows) and a ring of ``ring`` rows with its last tokens. A
decode step, per sparse layer:

    fill_ring      the positions each owner's ring lacks, from the host pool (all of its last ``ring`` tokens when a
                   request takes the owner, then the token decoded, which the step's KV write put there)
    hot_chunks     the chunks each written list reads (``kernels/hot_rows.py``)
    plan           which of them the hot slots miss, the slots they take, the runs of host rows to load
    copy_runs      the loads, from the host pool
    device_lists   the token lists as rows of this buffer

so the attention kernel runs unchanged on that buffer, and reads the KV that plain emission's slots name in the host
pool. A request within ``dense_limit`` tokens reads all of them from its ring (the ring is at least that long).
Everything but the host bookkeeping of ``take`` and ``start_step`` reads only device state, so a CUDA graph captures
it; the CPU engine runs the kernels' torch twins.
"""

from __future__ import annotations

import torch

from sgl_sparsekv.kernels import hot_rows
from sgl_sparsekv.kernels.host_copy import copy_runs, copy_runs_ref
from sgl_sparsekv.kernels.hot_rows import ChunkTable
from sgl_sparsekv.residency import HotChunks


class HotBuffers:
    """The sparse decode's device KV with the host tier: per sparse layer one buffer of ``owners`` x (hot slots +
    ring) rows, the owners being list rows that a request keeps while it decodes (``PooledDecode``). Host work
    (``take``, ``start_step``) runs in a step's preparation; ``fill_ring`` and ``load`` in each sparse layer."""

    def __init__(self, owners: int, layers: int, heads: int, head_dim: int, dtype: torch.dtype, cfg, device,
                 use_kernels: bool):
        W = cfg.chunk_max
        self.slots, self.ring = self.shape(cfg)
        span = self.slots * W + self.ring
        self.heads = heads
        self.base = torch.arange(owners, dtype=torch.int64, device=device) * span
        self.ring_base = self.base + self.slots * W
        shape = (layers, owners * span, heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.hot = HotChunks(owners, layers, heads, self.slots, W, self.base, use_kernel=use_kernels)
        n = owners * heads
        self.table = ChunkTable.empty(n, self.slots, device)
        self.list_owner = torch.arange(n, device=device) // heads
        self.list_head = torch.arange(n, device=device) % heads
        self.list_req_rows = torch.zeros(n, dtype=torch.int64, device=device)   # each list's request row
        self.cap = n * self.slots * W   # runs: at most one per row of every slot
        self.held = [None] * owners     # the request state whose chunks and ring an owner holds
        self.upto = [0] * owners        # its ring holds positions up to here
        self.step = 0
        self.step_at = torch.zeros(1, dtype=torch.int64, device=device)   # the step, as the graph reads it
        self.rows_hit_loaded = torch.zeros(2, dtype=torch.int64, device=device)
        self.dropped = torch.zeros(1, dtype=torch.int64, device=device)   # chunks past a list's slots
        self.ops = ((hot_rows.hot_chunks, copy_runs, hot_rows.device_lists, hot_rows.fill_ring) if use_kernels else
                    (hot_rows.hot_chunks_ref, copy_runs_ref, hot_rows.device_lists_ref, hot_rows.fill_ring_ref))

    @staticmethod
    def shape(cfg) -> tuple[int, int]:
        """(hot slots, ring rows) of one owner in one layer."""
        retrieve = cfg.token_budget - cfg.sink_tokens - cfg.recent_window
        # one selection names at most retrieve / chunk_min chunks (plus a partial one and the sink); twice that
        # keeps the chunks of the steps before. A row within the budget reads its whole sequence from its ring;
        # with select_ahead a list selected at the budget's length serves the step after it, one token longer.
        return 2 * (retrieve // cfg.chunk_min + 2), cfg.token_budget + cfg.select_ahead

    @classmethod
    def bytes_for(cls, cfg, owners: int, layers: int, token_bytes: int) -> int:
        """The buffers' size; ``token_bytes``: one token's K and V in one layer (all its KV heads)."""
        slots, ring = cls.shape(cfg)
        return owners * layers * (slots * cfg.chunk_max + ring) * token_bytes

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def start_step(self) -> None:
        """Before a step's ``take`` calls: no list is written yet, and the step count moves on."""
        self.step += 1
        self.step_at.fill_(self.step)
        self.table.ids.fill_(-1)

    def take(self, owner: int, state, req_row: int, S: int) -> int:
        """``owner`` serves ``state`` at length ``S`` this step (a new request finds its buffers empty) -> the first
        position its ring lacks (``S``: none)."""
        if self.held[owner] is not state:   # (a request keeps its req_to_token row while it lives)
            self.held[owner], self.upto[owner] = state, 0
            self.hot.clear(owner)
            self.list_req_rows[owner * self.heads:(owner + 1) * self.heads] = req_row
        lo = max(self.upto[owner], S - self.ring, 0)
        self.upto[owner] = S
        return min(lo, S)

    def fill_ring(self, layer: int, host_k, host_v, rows, seq_lens, list_rows, ring_from, req_to_token) -> None:
        self.ops[3](host_k, host_v, self.k[layer], self.v[layer], rows, seq_lens, list_rows, ring_from,
                    self.ring_base, req_to_token, self.ring)

    def load(self, layer: int, sel, chunks, ranges, seq_lens, req_to_token, host_k, host_v, cfg, lists_at, lists,
             heads=None) -> None:
        """A sparse layer's selection into device lists (``lists``: (lens, windows), ``emit_tokens``' layout): the
        chunks its lists read that the hot buffers miss are loaded from the host pool."""
        hot_chunks, copy, device_lists, _ = self.ops
        table = hot_chunks(sel, chunks, ranges, seq_lens, cfg.sink_tokens, cfg.recent_window, cfg.token_budget,
                           lists_at, self.table, self.dropped, heads)
        plan = self.hot.plan(layer, self.list_owner, self.list_head, table.ids, table.starts, table.lens,
                             req_to_token, self.step_at, self.cap, req_rows=self.list_req_rows)
        copy(host_k.transpose(0, 1), host_v.transpose(0, 1), self.k[layer].transpose(0, 1),
             self.v[layer].transpose(0, 1), plan.runs, plan.count)
        self.rows_hit_loaded += torch.cat([plan.hit_rows, plan.miss_rows])
        device_lists(table, plan.first, seq_lens, self.ring_base, self.ring, lists_at, lists, cfg.chunk_max, heads)
