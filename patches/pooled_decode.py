"""Lychee decode from the index pools, in static buffers that a CUDA graph captures (on the GPU).

Before each step (eager, outside the graph) ``prepare`` runs the manager's pooled preparation and
writes every batch row's pool ranges into fixed ``[max_bs]`` tensors. Inside the graph each sparse
layer runs ``select_fine`` -> ``emit_tokens`` -> ``sparse_decode_attention`` on them: no host reads,
shapes fixed by the captured batch size, every list at most ``token_budget`` slots. With hybrid heads
(config ``head_roles``) a layer selects and emits only for its retrieval heads; a sparse head's list is the one
its KV head used in the layer before, left in place in ``windows``, and a layer without retrieval heads launches
no selection at all. A request past its
budget whose index found no room in the pools is flagged ``direct``: the attention kernel reads its
whole sequence from its ``req_to_token`` row (dense, counted in ``dense_fallback_steps``). The same steps
run on the CPU with the kernels' torch twins (``manager.use_kernels`` off).
"""

from __future__ import annotations

import time

import torch

from sgl_sparsekv import head_roles
from sgl_sparsekv.kernels.select import all_heads, emit_tokens, emit_tokens_ref, select_fine, select_fine_ref
from sgl_sparsekv.kernels.sparse_decode import sparse_decode_attention, sparse_decode_attention_ref, workspace_for
from sgl_sparsekv.manager import DEBUG, SparseKVManager
from sgl_sparsekv.transfer import to_device

SPLITS = 8  # flash-decoding splits of a list


class PooledDecode:
    def __init__(self, manager: SparseKVManager, max_bs: int, q_heads: int, parts: int = 32):
        """``parts``: programs per (request, KV head) in selection and emission."""
        self.manager = manager
        self.parts = parts
        pools, cfg = manager.pools, manager.cfg
        self.cfg = cfg
        dev = manager.device
        H, d = pools.heads, pools.head_dim
        self.H, self.cap = H, cfg.token_budget
        self.max_bs = max_bs

        def i32(n):
            return torch.zeros(n, dtype=torch.int32, device=dev)

        # per batch row: pool ranges, request row, length, budget left for retrieved units, dense fallback
        self.table = torch.zeros(10, max_bs, dtype=torch.int32, device=dev)   # filled by one copy per step
        self.fields = tuple(self.table)
        self.co, self.pn, self.fo, self.ln, self.ko, self.mn, self.rows, self.seq, self.budget, self.direct = self.fields
        self.bounds = torch.empty(pools.fr.shape[1:], dtype=torch.float32, device=dev)
        self.sel = torch.empty(pools.fr.shape[1:], dtype=torch.float32, device=dev)
        self.lens, self.windows, self.counts = i32(max_bs * H), i32(max_bs * H * self.cap), i32(max_bs * H * parts)
        self.starts = torch.arange(max_bs * H, dtype=torch.int32, device=dev) * self.cap
        self.workspace = workspace_for(max_bs, H, q_heads // H, d, SPLITS, dev) if manager.use_kernels else None
        ops = (select_fine, emit_tokens) if manager.use_kernels else (select_fine_ref, emit_tokens_ref)
        self.select, self.emit = ops
        shard = manager.kv_shard
        roles = head_roles.resolve(cfg.head_roles, manager.num_layers, shard.total, cfg.dense_layers, heads=shard.heads)
        every = all_heads(H, dev)
        # per sparse layer: its retrieval KV heads (int32), None where it has none
        self.layer_heads = [every] * pools.layers if roles is None else [
            torch.tensor(r, dtype=torch.int32, device=dev) if r else None for r in roles]

    def token_list(self, j: int) -> torch.Tensor:
        """The KV slots list ``j`` (batch row * KV heads + head) attended to in the last ``attend``."""
        return self.windows[j * self.cap:j * self.cap + int(self.lens[j])]

    def fill_idle(self, bs: int) -> None:
        """Safe contents for capture: every row a one-token dense request on request row 0."""
        for t in self.fields:
            t[:bs].zero_()
        self.seq[:bs].fill_(1)

    def prepare(self, rows: list[int], seq_lens: list[int], padded_bs: int, req_to_token, tokens, k_buffers) -> None:
        """Host work of a decode step (no device read): tokens are the requests' host token ids."""
        m, cfg = self.manager, self.cfg
        t0 = time.perf_counter()
        ranges = m.prepare_decode_pooled(rows, seq_lens, req_to_token, tokens, k_buffers)
        retrieve = cfg.token_budget - cfg.sink_tokens - cfg.recent_window
        table = [[0] * padded_bs for _ in self.fields]
        table[7] = [1] * padded_bs   # padding rows: one token of request row 0
        for i, (row, S, r) in enumerate(zip(rows, seq_lens, ranges)):
            if r is not None:
                for j, v in enumerate((r.co, r.P, r.fo, r.L, r.ko, r.M)):
                    table[j][i] = v
            direct = r is None and m.needs_sparse(S)
            table[6][i], table[7][i], table[8][i], table[9][i] = row, S, retrieve, int(direct)
            m.stats["context_tokens"] += S
            m.stats["attended_tokens"] += S if direct else min(S, cfg.token_budget)
            m.stats["dense_fallback_steps"] += direct
        if DEBUG:
            check_table(table, len(rows), m.pools.capacity, req_to_token.shape)
        self.table[:, :padded_bs].copy_(to_device(torch.tensor(table, dtype=torch.int32), self.co.device))
        m.stats["decode_prepare_s"] += time.perf_counter() - t0

    def attend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, sparse_layer: int,
               req_to_token: torch.Tensor, scale: float) -> torch.Tensor:
        """q [bs, Hq, d] -> [bs, Hq, d]; graph-safe."""
        bs = q.shape[0]
        cfg, n = self.cfg, bs * self.H
        r = slice(0, bs)
        lens, windows = self.lens[:n], self.windows[:n * self.cap]
        heads = self.layer_heads[sparse_layer]
        if heads is not None:
            coarse, fine, chunks = self.manager.pools.layer(sparse_layer)
            # gqa_reduce "mean": the group's mean query ranks (a group of one), as in the reference's upper_bound
            qs = q.view(bs, self.H, -1, q.shape[-1]).float().mean(2) if cfg.gqa_reduce == "mean" else q
            sel = self.select(qs, coarse, fine, self.co[r], self.pn[r], self.fo[r], self.ln[r], self.budget[r],
                              cfg.coarse_expand, cfg.max_coarse, self.parts, out=(self.bounds, self.sel),
                              radius_weight=cfg.radius_weight, heads=heads)
            self.emit(sel, chunks, self.fo[r], self.ko[r], self.mn[r], self.rows[r], self.seq[r], req_to_token,
                      cfg.sink_tokens, cfg.recent_window, self.cap, dense_limit=cfg.token_budget,
                      max_chunk=cfg.chunk_max, parts=self.parts, heads=heads,
                      out=(lens, windows, self.counts[:n * self.parts]))
        direct = (self.direct[r], self.rows[r], self.seq[r], req_to_token)
        if self.workspace is None:
            return sparse_decode_attention_ref(q, k_buf, v_buf, self.starts[:n], windows, scale, lens=lens,
                                               direct=direct)
        opart, lse = self.workspace
        ws = (opart[:opart.numel() // self.max_bs * bs], lse[:lse.numel() // self.max_bs * bs])
        return sparse_decode_attention(q, k_buf, v_buf, self.starts[:n], windows, scale, num_splits=SPLITS,
                                       workspace=ws, lens=lens, direct=direct)


def check_table(table, bs: int, cap, req_to_token_shape) -> None:
    """Debug mode: every batch row's ranges lie inside the pools, its request row and length inside req_to_token."""
    co, pn, fo, ln, ko, mn, rows, seq, _, direct = table
    for i in range(bs):
        assert co[i] + pn[i] <= cap.coarse and fo[i] + ln[i] <= cap.fine and ko[i] + mn[i] <= cap.chunks, (i, table)
        assert 0 <= rows[i] < req_to_token_shape[0] and 0 < seq[i] <= req_to_token_shape[1], (i, rows[i], seq[i])
        assert not (direct[i] and mn[i]), ("a dense-fallback row with an index", i)
