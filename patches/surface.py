"""Every SGLang internal sgl-sparsekv hooks, patches or reads, in one list, checked at startup.

SGLang's plugin loader logs and skips a hook whose target is gone, so a renamed private method
would let ``--sparse-kv lychee`` start and silently serve dense. Instead, with the plugin on:

- in the launcher (flag parsing), :func:`check_sglang` verifies that every hook target below really
  was patched and that every other internal named here exists;
- in each scheduler, :func:`check_instance` verifies the pool instances and the model runner before they
  are patched or read, and ``patches/plugin.py`` checks that the runner's attention backend is ours.

Any miss refuses to start with one line naming it. Written against SGLang 0.5.15.
"""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil

from sgl_sparsekv.config import ConfigError

_SA = "sglang.srt.server_args.ServerArgs"

# hook name (a function in patches/) -> SGLang target it wraps
HOOK_TARGETS = {
    "add_cli_args": f"{_SA}.add_cli_args",
    "from_cli_args": f"{_SA}.from_cli_args",
    "server_args_init": f"{_SA}.__init__",
    "wrap_attention_backend": "sglang.srt.model_executor.model_runner.ModelRunner._get_attention_backend",
    "charge_index_memory":
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
    "reserve_index_cache":
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes",
    # the same two for the hybrid sliding-window pools the host tier runs on (patches/host_tier.py)
    "charge_index_memory_swa":
        "sglang.srt.model_executor.pool_configurator.HybridSWAPoolConfigurator.__init__",
    "reserve_index_cache_swa":
        "sglang.srt.model_executor.pool_configurator.HybridSWAPoolConfigurator.calculate_pool_sizes",
    "note_batch_requests": "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
    "eager_first_steps": "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
                         ".can_run_graph",
    "add_stats_to_internal_state": "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
    "check_scheduler": "sglang.srt.managers.scheduler.Scheduler.__init__",
    "on_scheduler_idle": "sglang.srt.managers.scheduler.Scheduler.on_idle",
    # the tokenizer manager checks each request's sampling params with it as the request arrives
    "check_request": "sglang.srt.sampling.sampling_params.SamplingParams.verify",
}

# names imported from SGLang by patches/
IMPORTS = (
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend",
    "sglang.srt.mem_cache.memory_pool.KVWriteLoc",
    "sglang.srt.mem_cache.memory_pool.unwrap_write_loc",
    "sglang.srt.mem_cache.swa_memory_pool.SWAKVPool",
    "sglang.srt.layers.dp_attention.get_attention_tp_size",
    "sglang.srt.utils.hf_transformers.tokenizer.get_tokenizer",
    "sglang.srt.server_args.ServerArgs",
    "sglang.srt.environ.envs",   # SGLANG_SWA_EVICTION_INTERVAL: how far past its window a request's slots run
)

# the attention-backend interface SparseKVAttnBackend implements, and where SGLang's graph runner calls it
BACKEND = "sglang.srt.layers.attention.base_attn_backend.AttentionBackend"
BACKEND_METHODS = ("init_forward_metadata", "init_cuda_graph_state", "init_forward_metadata_out_graph",
                   "init_forward_metadata_in_graph", "forward_extend", "forward_decode",
                   "get_cuda_graph_seq_len_fill_value")
GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
GRAPH_RUNNER_CALLS = ("init_cuda_graph_state", "init_forward_metadata_out_graph", "init_forward_metadata_in_graph")

# the replay view the graph runner hands to init_forward_metadata_out_graph: its padding rows past the batch
GRAPH_REPLAY_FIELDS = ("num_padding",)

# the server flags sgl-sparsekv reads (patches/checks.py, backend.py, plugin.py), all fields of ServerArgs
SERVER_ARGS = _SA
SERVER_ARGS_FIELDS = ("speculative_algorithm", "enable_mixed_chunk", "enable_two_batch_overlap", "enable_pdmux",
                      "enable_hierarchical_cache", "disaggregation_mode", "pp_size", "enable_dp_attention",
                      "attention_backend", "prefill_attention_backend", "decode_attention_backend",
                      "kv_cache_dtype", "is_embedding", "cuda_graph_config", "device", "tp_size", "model_path",
                      "trust_remote_code", "revision", "tokenizer_path", "tokenizer_mode", "served_model_name",
                      "enable_metrics", "max_running_requests", "chunked_prefill_size", "page_size",
                      "swa_full_tokens_ratio")
# ServerArgs.cuda_graph_config: a phase's graphs are off where its backend is "disabled"
GRAPH_CONFIG = "sglang.srt.model_executor.cuda_graph_config.CudaGraphConfig"
GRAPH_CONFIG_FIELDS = ("decode", "prefill")
GRAPH_PHASE = "sglang.srt.model_executor.cuda_graph_config.PhaseConfig"
GRAPH_PHASE_FIELDS = ("backend",)

FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
FORWARD_BATCH_FIELDS = ("forward_mode", "batch_size", "req_pool_indices", "seq_lens", "seq_lens_cpu",
                        "out_cache_loc", "input_ids", "extend_prefix_lens_cpu")

# the request fields read from ScheduleBatch.reqs (set in Req.__init__)
REQ = "sglang.srt.managers.schedule_batch.Req"
REQ_FIELDS = ("origin_input_ids", "output_ids", "req_pool_idx", "sampling_params")
# a request's own sparse-kv setting (sgl_sparsekv/request_control.py), a field of the msgspec Struct
SAMPLING_PARAMS = "sglang.srt.sampling.sampling_params.SamplingParams"
SAMPLING_PARAMS_FIELDS = ("custom_params",)

# instance attributes read or patched in the scheduler process
RUNNER_ATTRS = ("server_args", "model_config", "device", "tp_size", "tp_rank", "is_draft_worker",
                "req_to_token_pool", "token_to_kv_pool", "token_to_kv_pool_allocator",
                "model")   # select_ahead wraps model.forward (patches/backend.py, join_after_forward)
KV_POOL_ATTRS = ("get_key_buffer", "get_value_buffer", "set_kv_buffer", "start_layer")
# the host tier (patches/host_tier.py): the hybrid configurator's per-token bytes, which the index pools (and, on
# the CPU engine, the host pool) are charged to; the allocator's two pool sizes (its gauges); the hybrid pool's layer
# map, its two pools and their buffers
SWA_CONFIGURATOR_ATTRS = ("_cell_size", "_swa_per_token", "_swa_layers_num", "_swa_full_tokens_ratio",
                          "_solve_pool_sizes", "calculate_pool_sizes_from_max_tokens")
# MemoryPoolConfig, what calculate_pool_sizes returns
POOL_SIZES_ATTRS = ("full_max_total_num_tokens", "swa_max_total_num_tokens")
SWA_ALLOCATOR_ATTRS = ("size_full", "size_swa", "full_available_size", "swa_available_size")
SWA_POOL_ATTRS = ("layers_mapping", "swa_kv_pool", "full_kv_pool", "translate_loc_from_full_to_swa", "get_kv_buffer",
                  "full_to_swa_index_mapping")
REQ_POOL_PATCHED = ("free", "clear")         # watch_frees wraps these on the instance
REQ_POOL_ATTRS = ("size",)   # the host tier: one set of hot buffers per request SGLang can run
ALLOCATOR_PATCHED = ("free", "clear")
SCHEDULER_ATTRS = ("tp_worker", "is_fully_idle", "server_args", "ps", "tp_cpu_group")


def _fail(what: str) -> None:
    raise ConfigError(f"sparse-kv: this SGLang lacks {what} (sgl-sparsekv is written against SGLang 0.5.15); "
                      "refusing to start rather than serve dense")


def _resolve(path: str):
    try:
        return pkgutil.resolve_name(path)
    except (ImportError, AttributeError, ValueError):
        _fail(path)


def check_sglang() -> None:
    """Launcher-side: every hook applied, every named internal present."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    for name, target in HOOK_TARGETS.items():
        patched = _resolve(target)
        if target not in HookRegistry._patched or not hasattr(patched, "__wrapped__"):
            _fail(f"{target} (hook {name} did not apply)")
    for path in IMPORTS:
        _resolve(path)
    backend = _resolve(BACKEND)
    for m in BACKEND_METHODS:
        if not callable(getattr(backend, m, None)):
            _fail(f"{BACKEND}.{m}")
    source = inspect.getsource(_resolve(GRAPH_RUNNER))
    for m in GRAPH_RUNNER_CALLS:
        if f".{m}(" not in source:
            _fail(f"a call of AttentionBackend.{m} in {GRAPH_RUNNER}")
    init = inspect.getsource(_resolve(REQ).__init__)
    for f in REQ_FIELDS:
        if f"self.{f} =" not in init and f"self.{f}: " not in init:
            _fail(f"{REQ}.{f}")
    for cls, names in ((FORWARD_BATCH, FORWARD_BATCH_FIELDS), (SERVER_ARGS, SERVER_ARGS_FIELDS),
                       (GRAPH_CONFIG, GRAPH_CONFIG_FIELDS), (GRAPH_PHASE, GRAPH_PHASE_FIELDS)):
        fields = {f.name for f in dataclasses.fields(_resolve(cls))}
        for f in names:
            if f not in fields:
                _fail(f"{cls}.{f}")
    for f in SAMPLING_PARAMS_FIELDS:
        if f not in getattr(_resolve(SAMPLING_PARAMS), "__struct_fields__", ()):
            _fail(f"{SAMPLING_PARAMS}.{f}")
    for f in GRAPH_REPLAY_FIELDS:
        if f"{f}=" not in source:
            _fail(f"the field {f} of the replay view that {GRAPH_RUNNER} builds")


def check_instance(obj, attrs, what: str) -> None:
    """Scheduler-side: an SGLang object has what the plugin reads or patches."""
    for a in attrs:
        if not hasattr(obj, a):
            _fail(f"{what}.{a} ({type(obj).__name__})")
