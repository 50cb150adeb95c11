"""SparseKVAttnBackend: SGLang attention backend that wraps the configured one.

Prefill/extend runs on the wrapped backend (torch_native on CPU, triton/flashinfer on GPU); after the last layer,
each complete prompt's index is placed (built from chunk keys pooled from the KV, or adopted from a cached prefix).
Dense layers always decode on the wrapped backend. Sparse layers decode through ``PooledDecode``, the one lifecycle
of every method (lychee, quest, hybrid heads): static-shape steps over the index pools, so decode is captured in
SGLang's CUDA graphs (Triton kernels on the GPU, their torch twins on the CPU). Requests within the budget attend
to all their tokens through the same steps. An eager batch with no request past its budget goes to the wrapped
backend, so short contexts behave exactly like ``--sparse-kv off``.
"""

from __future__ import annotations

import functools
import logging
import sys
import time

import torch

from sgl_sparsekv import request_control
from sgl_sparsekv.chunking import BoundaryTable
from sgl_sparsekv.config import ConfigError, SparseKVConfig
from sgl_sparsekv.host_tier import prefix_slots
from sgl_sparsekv.kernels.page_table import PageTableWriter
from sgl_sparsekv.manager import SparseKVManager
from sgl_sparsekv.patches import surface
from sgl_sparsekv.pooled_decode import PooledDecode
from sgl_sparsekv.tensor_parallel import KVShard
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

logger = logging.getLogger("sgl_sparsekv")


def _boundary_table(runner, cfg: SparseKVConfig) -> BoundaryTable | None:
    if cfg.chunking != "structure":
        return None
    from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

    sa = runner.server_args
    tok = get_tokenizer(sa.tokenizer_path, tokenizer_mode=sa.tokenizer_mode,
                        trust_remote_code=sa.trust_remote_code, revision=sa.revision)
    return BoundaryTable.from_tokenizer(tok, runner.model_config.vocab_size)


class ReqTokens:
    """A request's token ids on the host by position (prompt, then output so far): what the scheduler already
    holds, so cutting chunks never reads ``input_ids`` back from the device."""

    __slots__ = ("prompt", "output")

    def __init__(self, req):
        self.prompt, self.output = req.origin_input_ids, req.output_ids

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, s: slice) -> list[int]:
        n = len(self.prompt)
        return list(self.prompt[s.start:min(s.stop, n)]) + list(self.output[max(s.start - n, 0):max(s.stop - n, 0)])


def note_batch_requests(backend, reqs) -> None:
    """Called as SGLang builds a ForwardBatch (patches/plugin.py): the batch's requests, for the host facts."""
    backend.batch_reqs = reqs


def watch_frees(manager: SparseKVManager, req_pool, allocator) -> None:
    """Tell ``manager`` about freed request rows and KV slots (it applies them at its next batch).

    Wraps the two pool instances' free/clear methods; SGLang's own classes stay untouched.
    """
    surface.check_instance(req_pool, surface.REQ_POOL_PATCHED, "ReqToTokenPool")
    surface.check_instance(allocator, surface.ALLOCATOR_PATCHED, "TokenToKVPoolAllocator")
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


def join_after_forward(model, backend) -> None:
    """select_ahead: the decoder's side stream joins once the whole forward is issued, not at the last sparse layer.
    SGLang's runners call ``model.forward`` itself (no module hooks run), so the instance attribute wraps it.

    A captured forward runs on a stream of higher priority than the side stream. At equal priority the GPU places a
    later kernel's programs only once an earlier kernel has none left waiting, so a selection kernel of several
    waves would hold back the step's next kernel; PyTorch instantiates graphs with per-node priorities, so the
    step's kernels are placed first in every replay. Eager forwards keep the caller's stream, which SGLang's
    allocator and overlap scheduling assume."""
    forward = model.forward
    side = backend.active.side
    chain = torch.cuda.Stream(side.device, priority=-1) if side is not None else None

    @functools.wraps(forward)
    def joined(*args, **kwargs):
        if chain is None or not torch.cuda.is_current_stream_capturing():
            out = forward(*args, **kwargs)
            backend.active.join()
            return out
        step = torch.cuda.current_stream()
        chain.wait_stream(step)
        with torch.cuda.stream(chain):
            out = forward(*args, **kwargs)
            backend.active.join()
        step.wait_stream(chain)
        return out

    model.forward = joined


# SGLang 0.5.15's page-table kernel, by its parameters: every call site of the GPU backends passes these, in order
PAGE_TABLE_KERNEL = "create_flashinfer_kv_indices_triton"
PAGE_TABLE_ARGS = ("req_to_token_ptr", "req_pool_indices_ptr", "page_kernel_lens_ptr", "kv_indptr", "kv_start_idx",
                   "kv_indices_ptr", "req_to_token_ptr_stride")


def write_page_tables_wide(inner) -> None:
    """Before every decode graph replay the wrapped backend rewrites the dense layers' page table (every token of
    every request) with SGLang's kernel, one program per request: 0.122 ms of the step at batch 1 and 126K, where
    kernels/page_table.py's writer, the same entries from many programs, takes 0.005 ms
    (bench/results/serving_profile_h200_b1_126k_pagetable.json). Its module gets that writer instead. A kernel
    with other parameters is left alone (serving stays correct, only slower)."""
    module = sys.modules[type(inner).__module__]
    kernel = getattr(module, PAGE_TABLE_KERNEL, None)
    if kernel is None or isinstance(kernel, PageTableWriter):
        return
    if tuple(getattr(kernel, "arg_names", ())) != PAGE_TABLE_ARGS:
        logger.warning("sparse-kv: %s.%s takes other arguments than SGLang 0.5.15's; left as it is",
                       module.__name__, PAGE_TABLE_KERNEL)
        return
    setattr(module, PAGE_TABLE_KERNEL, PageTableWriter())


class SparseKVAttnBackend(AttentionBackend):
    def __init__(self, runner, inner: AttentionBackend, cfg: SparseKVConfig):
        super().__init__()
        self.inner = inner
        self.cfg = cfg
        self.device = runner.device
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool = runner.token_to_kv_pool
        pool = self.token_to_kv_pool
        surface.check_instance(pool, surface.KV_POOL_ATTRS, "KV pool")
        self.host = None
        if cfg.host_tier:   # before anything reads a sparse layer's buffers: from here on they are the host pool's
            import psutil

            from sgl_sparsekv.patches import host_tier

            mc = runner.model_config
            self.host = host_tier.install(pool, cfg, mc.num_hidden_layers, psutil.virtual_memory().available,
                                          host_tier.window_terms(runner.server_args, mc.context_len))
            self.window_rows = functools.partial(host_tier.window_rows, pool)
        start = pool.start_layer or 0
        k0 = pool.get_key_buffer(start)
        self.use_triton = str(self.device).startswith("cuda")
        if self.use_triton:
            write_page_tables_wide(inner)
        shard = KVShard.of_rank(runner.model_config.get_total_num_kv_heads(), runner.tp_size, runner.tp_rank)
        if shard.count != k0.shape[1]:
            raise ConfigError(f"sparse-kv: TP rank {runner.tp_rank} holds {k0.shape[1]} KV heads, expected "
                              f"{shard.count} of {shard.total}")
        self.manager = SparseKVManager(
            cfg, num_layers=runner.model_config.num_hidden_layers, num_kv_heads=k0.shape[1], kv_shard=shard,
            head_dim=k0.shape[2], num_slots=k0.shape[0], device=self.device,
            boundary_table=_boundary_table(runner, cfg),
            # chunk keys in bf16 on GPU, as the model; fp32 on CPU, where the twins run
            key_dtype=torch.float32 if str(runner.device) == "cpu" else torch.bfloat16, kv_dtype=k0.dtype)
        watch_frees(self.manager, runner.req_to_token_pool, runner.token_to_kv_pool_allocator)
        if self.host is not None:
            surface.check_instance(runner.req_to_token_pool, surface.REQ_POOL_ATTRS, "ReqToTokenPool")
            self.manager.max_requests = runner.req_to_token_pool.size
            self.manager.tier_gauges = host_tier.gauges(self.host, runner.token_to_kv_pool_allocator, self._hot)
        self.decode_sparse = False
        self.q_heads = runner.model_config.num_attention_heads // max(1, runner.tp_size)
        self._big = None
        self.batch_reqs = None   # the requests of the batch being prepared, from note_batch_requests
        self.extend_rows = ([], [])   # the prefill's (request rows, prompt complete), for finish_extend
        self.stage_slots = None   # the host tier: the full KV slots of the prefill batch's prefixes
        self.pooled = self.active = PooledDecode(self.manager, max_bs=64, q_heads=self.q_heads)
        if self.pooled.side is not None:
            join_after_forward(runner.model, self)
        self._last_log = 0.0
        self.metrics = None   # PrometheusExport, set by the scheduler hook with --enable-metrics
        logger.info("sparse-kv: %s decoding over the %s backend, config %s", cfg.method,
                    type(inner).__name__, cfg.to_dict())

    # ------------------------------------------------------------------ metadata, once per batch
    def init_forward_metadata(self, forward_batch):
        """Eager batches (prefill always; decode when CUDA graphs are off or the batch is too big)."""
        self.inner.init_forward_metadata(forward_batch)
        self._prepare(forward_batch, forward_batch.batch_size)

    def _hot(self) -> list:
        """The hot buffers of this backend's decoders (the host tier)."""
        return [d.tier for d in (self.pooled, self._big) if d is not None and d.tier is not None]

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.inner.init_cuda_graph_state(max_bs, max_num_tokens)
        if max_bs > self.pooled.max_bs:
            self.pooled = self.active = PooledDecode(self.manager, max_bs=max_bs, q_heads=self.q_heads)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Before a captured decode graph runs (capture and every replay): host work, static buffers."""
        self.inner.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        bs = forward_batch.batch_size
        if in_capture:
            self.active = self.pooled
            self.pooled.fill_idle(bs)
            self.decode_sparse = True
        else:
            self._prepare(forward_batch, bs - (forward_batch.num_padding or 0), padded_bs=bs)

    def graph_allowed(self, forward_batch) -> bool:
        """Asked before SGLang replays a decode graph (patches/plugin.py). A batch runs eagerly when the recall
        audit measures it (its due step, with a request past the budget), and with select_ahead when it holds a
        request's first decode step past the budget, so that step selects with its own query instead of attending
        to its whole sequence. Host facts only: the batch's requests and ``seq_lens_cpu``."""
        reqs, m = self.batch_reqs, self.manager
        if reqs is None or forward_batch.seq_lens_cpu is None:
            return True
        seq_lens = forward_batch.seq_lens_cpu[:len(reqs)].tolist()
        if m.audit is not None and m.audit.due_next() and any(map(m.needs_sparse, seq_lens)):
            return False
        if not self.pooled.ahead:
            return True
        return not self.pooled.first_steps([m.states.get(r.req_pool_idx) for r in reqs], seq_lens)

    def init_forward_metadata_in_graph(self, forward_batch):
        self.inner.init_forward_metadata_in_graph(forward_batch)

    def _prepare(self, forward_batch, bs: int, padded_bs: int | None = None):
        mode = forward_batch.forward_mode
        req_to_token = self.req_to_token_pool.req_to_token
        self.decode_sparse = padded_bs is not None   # a captured graph runs the sparse steps whatever the lengths
        reqs, self.batch_reqs = self.batch_reqs, None
        if mode.is_idle():
            return
        budgets = None
        if reqs is not None and len(reqs) == bs:
            rows = [r.req_pool_idx for r in reqs]
            tokens = [ReqTokens(r) for r in reqs]
            asked = [request_control.requested(r.sampling_params.custom_params) for r in reqs]
            if any(a is not None for a in asked):   # checked when the request arrived (plugin.check_request)
                budgets = [request_control.parse(a, self.cfg) for a in asked]
        else:   # a batch SGLang built without ForwardBatch.init_new: rows from the device, no chunk cuts this step
            rows = forward_batch.req_pool_indices[:bs].tolist()
            tokens = [None] * bs
            self.manager.stats.decode_host_syncs += int(mode.is_decode())
        seq_lens = (forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None
                    else forward_batch.seq_lens)[:bs].tolist()
        if mode.is_decode():
            sparse = any(map(self.manager.needs_sparse, seq_lens))
            self.decode_sparse |= sparse
            self.active = self.pooled
            if bs > self.pooled.max_bs:   # an eager batch past the captured sizes: buffers of its own
                if self._big is None or self._big.max_bs < bs:
                    self._big = PooledDecode(self.manager, max_bs=bs, q_heads=self.q_heads)
                self.active = self._big
            self.active.prepare(rows, seq_lens, padded_bs or bs, req_to_token, tokens,
                                self.token_to_kv_pool.get_key_buffer, attends=self.decode_sparse,
                                eager=padded_bs is None, budgets=budgets)
            if sparse:
                self.manager.stats.sparse_steps += 1
            else:
                self.manager.stats.dense_steps += 1
            self.export_metrics()
        else:
            prefix_lens = list(forward_batch.extend_prefix_lens_cpu)
            self.manager.prepare_extend(rows, prefix_lens, seq_lens, req_to_token, tokens, budgets)
            if self.host is not None:   # what each sparse layer's prefill stages (forward_extend)
                self.stage_slots = prefix_slots(req_to_token, rows, prefix_lens)
            # the prompt is complete when the batch reaches its last token (else a chunked prefill goes on)
            self.extend_rows = (rows, [t is not None and S == len(t) for t, S in zip(tokens, seq_lens)])
            self._maybe_log()

    def export_metrics(self, force: bool = False) -> None:
        if self.metrics is not None:
            self.metrics.update(self.manager.snapshot_stats, self.manager.audit, force=force)

    def _maybe_log(self):
        now = time.monotonic()
        if now - self._last_log > 10:
            self._last_log = now
            logger.info("sparse-kv stats: %s", self.manager.snapshot_stats())

    # ------------------------------------------------------------------ per layer
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        staged = self.host is not None and self.host.holds(layer.layer_id)
        if staged:   # the prefixes' rows of this layer once, for an attention that reads them per tile: from the
            # window pool where SGLang still holds them there, over the bus otherwise
            self.host.stage(layer.layer_id, self.stage_slots, self.window_rows(layer.layer_id))
        out = self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        if staged:
            self.host.unstage()
        if layer.layer_id == self.manager.num_layers - 1:
            self.manager.finish_extend(*self.extend_rows, self.req_to_token_pool.req_to_token,
                                       self.token_to_kv_pool.get_key_buffer)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        lid = layer.layer_id
        if not self.decode_sparse or not self.manager.is_sparse_layer(lid):
            return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v,
                                                k_scale=layer.k_scale, v_scale=layer.v_scale)
        # fp8 KV holds k / k_scale and v / v_scale (SGLang's convention): the scales fold into the softmax's scale
        # and the output, as SGLang's triton backend applies them
        scaled = layer.k_scale is not None and layer.v_scale is not None
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = self.active.attend(q, self.token_to_kv_pool.get_key_buffer(lid),
                                 self.token_to_kv_pool.get_value_buffer(lid), lid - self.cfg.dense_layers,
                                 self.req_to_token_pool.req_to_token,
                                 layer.scaling * (layer.k_scale_float if scaled else 1.0))
        if scaled and layer.v_scale_float != 1.0:
            out = out * layer.v_scale_float
        return out.view(q.shape[0], -1)

    # ------------------------------------------------------------------ delegated
    def get_cuda_graph_seq_len_fill_value(self):
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def support_triton(self):
        return self.inner.support_triton()
