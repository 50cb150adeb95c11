"""Entry point (group ``sglang.srt.plugins``): registers every SGLang hook sgl-sparsekv needs.

SGLang calls ``register()`` in the launcher before argument parsing, in ``Engine`` and in each
scheduler process. The hook targets are listed in ``patches/surface.py``, which checks at startup
that each one applied. With ``--sparse-kv off`` (the default) the hooks only add the flags: the
attention backend, the pools and the scheduler are left exactly as they are.
"""

from __future__ import annotations

import logging

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sgl_sparsekv.config import ConfigError
from sgl_sparsekv.patches import flags, surface

logger = logging.getLogger("sgl_sparsekv")


def wrap_attention_backend(original, runner, *args, **kwargs):
    backend = original(runner, *args, **kwargs)
    cfg = flags.config_of(runner.server_args)
    if not cfg.enabled or runner.is_draft_worker:
        return backend
    from sgl_sparsekv import compile_log
    from sgl_sparsekv.patches.backend import SparseKVAttnBackend
    from sgl_sparsekv.patches.checks import check_runner

    compile_log.install_from_env()   # before the backend's precompiles and the graphs' capture

    surface.check_instance(runner, surface.RUNNER_ATTRS, "ModelRunner")
    check_runner(runner, cfg)
    return SparseKVAttnBackend(runner, backend, cfg)


def charge_index_memory(cell_size, configurator, runner, num_layers, *args, **kwargs):
    """Per-token bytes of the KV pool plus the index pools, so SGLang sizes the KV pool with room for them (they
    are allocated at startup, after the KV pool)."""
    cfg = flags.config_of(runner.server_args)
    if not cfg.enabled or runner.is_draft_worker:
        return cell_size
    from sglang.srt.layers.dp_attention import get_attention_tp_size

    from sgl_sparsekv.manager import bytes_per_token

    mc = runner.model_config
    extra = bytes_per_token(cfg, num_layers, mc.get_num_kv_heads(get_attention_tp_size()), mc.head_dim)
    logger.info("sparse-kv: %d bytes per KV slot for the index pools (KV itself: %d)", extra, cell_size)
    from sgl_sparsekv.index_cache import CACHE_BYTES

    configurator.sparse_kv_reserved_bytes = CACHE_BYTES   # read by reserve_index_cache
    return cell_size + extra


def charge_index_memory_swa(result, configurator, runner, *args, **kwargs):
    """The hybrid pools' configurator (the host tier) computes its per-token bytes in ``__init__``: the index pools
    are charged per full KV slot there."""
    cfg = flags.config_of(runner.server_args)
    if not cfg.enabled:
        return result
    surface.check_instance(configurator, surface.SWA_CONFIGURATOR_ATTRS, "HybridSWAPoolConfigurator")
    configurator._cell_size = charge_index_memory(configurator._cell_size, configurator, runner,
                                                  runner.model_config.num_hidden_layers)
    if not cfg.host_tier:
        return result
    import psutil

    from sgl_sparsekv.host_tier import MAX_RUNNING, host_budget, host_reserve
    from sgl_sparsekv.tier_rows import HotBuffers

    configurator._cell_size += configurator._swa_per_token   # the prefill's stage: one sparse layer, on the device
    host_per_slot = configurator._swa_per_token * configurator._swa_layers_num   # every windowed layer's KV
    # no more full slots than the host pool holds (read by reserve_index_cache)
    configurator.sparse_kv_host_slots = host_budget(cfg.host_memory_gb, psutil.virtual_memory().available,
                                                    host_reserve(runner.device)) // host_per_slot
    owners = min(MAX_RUNNING, runner.server_args.max_running_requests)
    if str(runner.device) == "cpu":
        # the CPU engine's KV pools live in host memory too: the host pool is charged per full slot, as SGLang
        # charges the windowed layers' device slots
        configurator._cell_size += host_per_slot
    else:   # the decode's hot buffers, one set per request SGLang can run, are set aside on the device
        configurator.sparse_kv_reserved_bytes += HotBuffers.bytes_for(cfg, owners, configurator._swa_layers_num,
                                                                      configurator._swa_per_token)
    size_window_pool(configurator, runner, cfg.host_window, owners)
    return result


def size_window_pool(configurator, runner, host_window: int, requests: int) -> None:
    """Unless ``--swa-full-tokens-ratio`` is given, the window pool holds the windows of the requests the tier runs
    (``host_tier.window_slots``), set aside before the full pool is sized, rather than SGLang's default 0.8 of the
    full pool, which would keep most of every token's sparse-layer KV on the device as well as on the host."""
    from sglang.srt.server_args import ServerArgs

    from sgl_sparsekv.host_tier import window_slots
    from sgl_sparsekv.patches.host_tier import window_terms

    if configurator._swa_full_tokens_ratio != ServerArgs.swa_full_tokens_ratio:
        return   # the operator's ratio (SGLang tells its default apart the same way)
    sa = runner.server_args
    page = sa.page_size or 1
    chunk, slack = window_terms(sa, runner.model_config.context_len)
    slots = -(-window_slots(requests, host_window, chunk, slack) // page) * page
    per_slot = configurator._swa_per_token * configurator._swa_layers_num
    configurator._cell_size -= configurator._swa_full_tokens_ratio * per_slot
    configurator.sparse_kv_reserved_bytes += slots * per_slot
    logger.info("sparse-kv: a window pool of %d slots for %d requests (their last %d tokens and prefill chunks of "
                "%d), %.2f GiB", slots, requests, host_window, chunk, slots * per_slot / 2**30)
    solve = configurator._solve_pool_sizes

    def solve_with_window(max_total_num_tokens, page_size, *args, **kwargs):
        sizes = solve(max_total_num_tokens, page_size, *args, **kwargs)
        sizes.swa_max_total_num_tokens = min(slots, sizes.full_max_total_num_tokens)
        return sizes

    configurator._solve_pool_sizes = solve_with_window


def reserve_index_cache(original, configurator, available_bytes, page_size, *args, **kwargs):
    """SGLang sizes the KV pool from the bytes left after the weights: set the index cache aside first. With the host
    tier, the full slots are also capped by what the host pool holds."""
    reserved = getattr(configurator, "sparse_kv_reserved_bytes", 0)
    if reserved:
        logger.info("sparse-kv: %.2f GiB of %.2f GiB set aside for cached indexes before sizing the KV pool",
                    reserved / (1 << 30), available_bytes / (1 << 30))
    if reserved >= available_bytes:
        raise ConfigError(f"sparse-kv: the {reserved / 2**30:.2f} GiB set aside (index cache, and with host_tier the hot "
                          f"buffers and window pool) leave nothing of the {available_bytes / 2**30:.2f} GiB for the KV "
                          "pool; lower --max-running-requests or --chunked-prefill-size, or raise --mem-fraction-static")
    sizes = original(configurator, available_bytes - reserved, page_size, *args, **kwargs)
    cap = getattr(configurator, "sparse_kv_host_slots", None)
    if cap is not None:
        cap -= page_size   # SGLang's pools hold a page of padding slots beside their size
        surface.check_instance(sizes, surface.POOL_SIZES_ATTRS, "MemoryPoolConfig")
        if sizes.full_max_total_num_tokens > cap:
            logger.info("sparse-kv: %d KV slots, the host pool's capacity, where the device would hold %d",
                        cap, sizes.full_max_total_num_tokens)
            sizes = configurator.calculate_pool_sizes_from_max_tokens(cap, page_size)
    return sizes


def _sparse_backend(scheduler):
    """The scheduler's SparseKVAttnBackend, or None when sparse-kv is off."""
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    backend = getattr(runner, "attn_backend", None)
    return backend if hasattr(backend, "manager") else None


def note_batch_requests(result, cls, batch, model_runner, *args, **kwargs):
    """After SGLang builds a ForwardBatch from a ScheduleBatch: hand the batch's requests to our backend, which
    reads request rows and token ids from them instead of from the device (a decode step never syncs)."""
    backend = getattr(model_runner, "attn_backend", None)
    if hasattr(backend, "manager"):
        from sgl_sparsekv.patches.backend import note_batch_requests as note

        note(backend, batch.reqs)
    return result


def eager_first_steps(result, graph_runner, forward_batch, *args, **kwargs):
    """After SGLang decides a decode batch can replay a CUDA graph: our backend may decline it (select_ahead runs a
    request's first decode step eagerly, selecting with its own query; see ``SparseKVAttnBackend.graph_allowed``)."""
    backend = getattr(graph_runner.model_runner, "attn_backend", None)
    if result and hasattr(backend, "graph_allowed"):
        return backend.graph_allowed(forward_batch)
    return result


def add_stats_to_internal_state(result, scheduler, *args, **kwargs):
    """``/server_info``: each DP replica's entry carries its TP rank 0's counters as ``sparse_kv_stats`` and, under
    tensor parallelism, every TP rank's own as ``sparse_kv_stats_per_tp_rank`` (each labelled with its ranks)."""
    backend = _sparse_backend(scheduler)
    if backend is None or not isinstance(getattr(result, "internal_state", None), dict):
        return result
    ps = scheduler.ps
    stats = dict(backend.manager.snapshot_stats(), tp_rank=ps.tp_rank, dp_rank=ps.dp_rank or 0)
    if backend.manager.device.type == "cuda":   # the caching allocator's cudaMalloc calls and flushes (these sync)
        import torch

        mem = torch.cuda.memory_stats()
        stats.update({k: mem.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")})
    result.internal_state["sparse_kv_stats"] = stats
    if ps.tp_size > 1:
        # every TP rank handles the same broadcast request, so all of them join; only rank 0's reply goes out
        import torch.distributed as dist

        per_rank = [None] * ps.tp_size
        dist.all_gather_object(per_rank, stats, group=scheduler.tp_cpu_group)
        result.internal_state["sparse_kv_stats_per_tp_rank"] = per_rank
    return result


def check_scheduler(result, scheduler, *args, **kwargs):
    """After a scheduler is built: with sparse-kv on, its model runner must decode through our backend."""
    cfg = flags.config_of(scheduler.server_args)
    if not cfg.enabled:
        return result
    from sgl_sparsekv.patches.backend import SparseKVAttnBackend

    surface.check_instance(scheduler, surface.SCHEDULER_ATTRS, "Scheduler")
    backend = getattr(scheduler.tp_worker.model_runner, "attn_backend", None)
    if not isinstance(backend, SparseKVAttnBackend):
        raise ConfigError(f"sparse-kv: the model runner's attention backend is {type(backend).__name__}, not the "
                          "sparse one (SGLang no longer builds it through ModelRunner._get_attention_backend); "
                          "refusing to start rather than serve dense")
    if scheduler.server_args.enable_metrics:
        from sgl_sparsekv.patches.metrics import PrometheusExport

        backend.metrics = PrometheusExport({"model_name": scheduler.server_args.served_model_name,
                                            "tp_rank": str(scheduler.ps.tp_rank),
                                            "dp_rank": str(scheduler.ps.dp_rank or 0)})
    return result


def check_request(result, params, *args, **kwargs):
    """After SGLang verifies a request's sampling params (the tokenizer manager, as the request arrives): its
    ``custom_params`` sparse-kv setting must be one this server can honour (``request_control``); else the
    request is refused with one line (HTTP 400), before it is scheduled."""
    from sgl_sparsekv import request_control

    asked = request_control.requested(params.custom_params)
    if asked is not None and flags.ACTIVE is not None:
        request_control.parse(asked, flags.ACTIVE)
    return result


def on_scheduler_idle(scheduler, *args, **kwargs):
    """Before SGLang's idle housekeeping: apply the frees of the last requests, so idle state reads as idle."""
    backend = _sparse_backend(scheduler)
    if backend is not None and scheduler.is_fully_idle():
        backend.manager.apply_frees()
        backend.export_metrics(force=True)


_HOOKS = {
    "add_cli_args": (flags.add_cli_args, HookType.AROUND),
    "from_cli_args": (flags.from_cli_args, HookType.AROUND),
    "server_args_init": (flags.server_args_init, HookType.AROUND),
    "wrap_attention_backend": (wrap_attention_backend, HookType.AROUND),
    "charge_index_memory": (charge_index_memory, HookType.AFTER),
    "reserve_index_cache": (reserve_index_cache, HookType.AROUND),
    "charge_index_memory_swa": (charge_index_memory_swa, HookType.AFTER),
    "reserve_index_cache_swa": (reserve_index_cache, HookType.AROUND),
    "note_batch_requests": (note_batch_requests, HookType.AFTER),
    "eager_first_steps": (eager_first_steps, HookType.AFTER),
    "add_stats_to_internal_state": (add_stats_to_internal_state, HookType.AFTER),
    "check_scheduler": (check_scheduler, HookType.AFTER),
    "on_scheduler_idle": (on_scheduler_idle, HookType.BEFORE),
    "check_request": (check_request, HookType.AFTER),
}


def register() -> None:
    for name, target in surface.HOOK_TARGETS.items():
        hook, kind = _HOOKS[name]
        HookRegistry.register(target, hook, kind)
