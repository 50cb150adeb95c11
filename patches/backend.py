"""SparseKVAttnBackend: SGLang attention backend that wraps the configured one.

Prefill/extend runs on the wrapped backend (torch_native on CPU, triton/flashinfer on GPU);
afterwards the new retrieval units of each sparse layer are summarized from the keys just
written. Decode selects, per request and KV head, the tokens to attend (sgl_sparsekv) and
attends over them. A batch with no request past its budget, and every dense layer, goes
straight to the wrapped backend, so short contexts behave exactly like ``--sparse-kv off``.
"""

from __future__ import annotations

import logging
import time

import torch

from sgl_sparsekv.attend import dense_decode, sparse_decode
from sgl_sparsekv.chunking import BoundaryTable
from sgl_sparsekv.config import SparseKVConfig
from sgl_sparsekv.kernels.sparse_decode import sparse_decode_attention
from sgl_sparsekv.manager import PoolPlan, SparseKVManager
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

logger = logging.getLogger("sgl_sparsekv")


def _boundary_table(runner, cfg: SparseKVConfig) -> BoundaryTable | None:
    if cfg.method != "lychee" or cfg.chunking != "structure":
        return None
    from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

    sa = runner.server_args
    tok = get_tokenizer(sa.tokenizer_path, tokenizer_mode=sa.tokenizer_mode,
                        trust_remote_code=sa.trust_remote_code, revision=sa.revision)
    return BoundaryTable.from_tokenizer(tok, runner.model_config.vocab_size)


def watch_frees(manager: SparseKVManager, req_pool, allocator) -> None:
    """Tell ``manager`` about freed request rows and KV slots (it applies them at its next batch).

    Wraps the two pool instances' free/clear methods; SGLang's own classes stay untouched.
    """
    free_req, clear_req = req_pool.free, req_pool.clear
    free_slots, clear_slots = allocator.free, allocator.clear

    def req_free(req):
        idx = req.req_pool_idx
        free_req(req)
        manager.request_freed(idx)

    def req_clear():
        clear_req()
        for idx in list(manager.states):
            manager.request_freed(idx)

    def slot_free(free_index):
        manager.slots_freed(free_index)
        return free_slots(free_index)

    def slot_clear():
        clear_slots()
        manager.cache_cleared()

    req_pool.free, req_pool.clear = req_free, req_clear
    allocator.free, allocator.clear = slot_free, slot_clear


class SparseKVAttnBackend(AttentionBackend):
    def __init__(self, runner, inner: AttentionBackend, cfg: SparseKVConfig):
        super().__init__()
        self.inner = inner
        self.cfg = cfg
        self.device = runner.device
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool = runner.token_to_kv_pool
        pool = self.token_to_kv_pool
        start = getattr(pool, "start_layer", 0) or 0
        k0 = pool.get_key_buffer(start)
        self.manager = SparseKVManager(
            cfg, num_layers=runner.model_config.num_hidden_layers, num_kv_heads=k0.shape[1],
            head_dim=k0.shape[2], num_slots=k0.shape[0], device=self.device,
            boundary_table=_boundary_table(runner, cfg),
            # summaries in the model's dtype on GPU (half the memory); fp32 on CPU for the reference path
            summary_dtype=torch.float32 if str(runner.device) == "cpu" else torch.bfloat16)
        watch_frees(self.manager, runner.req_to_token_pool, runner.token_to_kv_pool_allocator)
        self.plan = PoolPlan()
        self.decode_sparse = False
        self.use_triton = str(self.device).startswith("cuda")
        self._last_log = 0.0
        logger.info("sparse-kv: %s decoding over the %s backend, config %s", cfg.method,
                    type(inner).__name__, cfg.to_dict())

    # ------------------------------------------------------------------ metadata, once per batch
    def init_forward_metadata(self, forward_batch):
        self.inner.init_forward_metadata(forward_batch)
        mode = forward_batch.forward_mode
        req_to_token = self.req_to_token_pool.req_to_token
        if mode.is_idle():
            self.plan = PoolPlan()
            return
        rows = forward_batch.req_pool_indices.tolist()
        seq_lens = (forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None
                    else forward_batch.seq_lens).tolist()
        if mode.is_decode():
            self.plan = self.manager.prepare_decode(rows, seq_lens, req_to_token, forward_batch.input_ids,
                                                    forward_batch.out_cache_loc)
            self.decode_sparse = any(self.manager.needs_sparse(s) for s in seq_lens)
            key = "sparse_steps" if self.decode_sparse else "dense_steps"
            self.manager.stats[key] += 1
        else:
            self.plan = self.manager.prepare_extend(rows, list(forward_batch.extend_prefix_lens_cpu), seq_lens,
                                                    req_to_token, forward_batch.input_ids,
                                                    forward_batch.out_cache_loc)
            self._maybe_log()

    def _maybe_log(self):
        now = time.monotonic()
        if now - self._last_log > 10:
            self._last_log = now
            logger.info("sparse-kv stats: %s", self.manager.snapshot_stats())

    # ------------------------------------------------------------------ per layer
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        out = self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        self.manager.pool_layer(layer.layer_id, self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.plan)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        lid = layer.layer_id
        if not self.decode_sparse or not self.manager.is_sparse_layer(lid):
            out = self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
            self.manager.pool_layer(lid, self.token_to_kv_pool.get_key_buffer(lid), self.plan)
            return out
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        k_buf = self.token_to_kv_pool.get_key_buffer(lid)
        v_buf = self.token_to_kv_pool.get_value_buffer(lid)
        self.manager.pool_layer(lid, k_buf, self.plan)

        H = k_buf.shape[1]
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        rows = forward_batch.req_pool_indices.tolist()
        req_to_token = self.req_to_token_pool.req_to_token
        stats = self.manager.stats
        masks, slot_rows = [], []
        for i, row in enumerate(rows):
            S = self.manager.states[row].seq_len
            slot_rows.append(req_to_token[row, :S])
            masks.append(self.manager.select(lid, row, q[i].view(H, -1, layer.qk_head_dim)))
            stats["attended_tokens"] += S if masks[-1] is None else int(masks[-1].sum()) // H
            stats["context_tokens"] += S
        if self.use_triton:
            out = self._attend_triton(q, k_buf, v_buf, slot_rows, masks, layer.scaling)
        else:
            out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
            for i, (slots, mask) in enumerate(zip(slot_rows, masks)):
                out[i] = (dense_decode(q[i], k_buf, v_buf, slots, layer.scaling) if mask is None
                          else sparse_decode(q[i], k_buf, v_buf, slots, mask, layer.scaling))
        return out.view(q.shape[0], -1)

    def _attend_triton(self, q, k_buf, v_buf, slot_rows, masks, scale):
        """One kernel launch for the batch: each (request, KV head) attends over its own slot list."""
        H = k_buf.shape[1]
        lists, counts = [], []
        for slots, mask in zip(slot_rows, masks):
            if mask is None:
                lists.append(slots.repeat(H))
                counts.append(torch.full((H,), len(slots), device=slots.device))
            else:
                _, pos = torch.nonzero(mask, as_tuple=True)   # row-major: grouped by head, positions ascending
                lists.append(slots[pos])
                counts.append(mask.sum(1))
        indptr = torch.zeros(len(masks) * H + 1, dtype=torch.int32, device=q.device)
        indptr[1:] = torch.cumsum(torch.cat(counts), 0)
        indices = torch.cat(lists).to(torch.int32)
        return sparse_decode_attention(q.contiguous(), k_buf, v_buf, indptr, indices, scale)

    # ------------------------------------------------------------------ delegated
    def get_cuda_graph_seq_len_fill_value(self):
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def support_triton(self):
        return self.inner.support_triton()
