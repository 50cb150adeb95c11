"""Entry point (group ``sglang.srt.plugins``): registers every SGLang hook sgl-sparsekv needs.

SGLang calls ``register()`` in the launcher before argument parsing, in ``Engine`` and in each
scheduler process. With ``--sparse-kv off`` (the default) the hooks only add the flags: the
attention backend, the pools and the scheduler are left exactly as they are.
"""

from __future__ import annotations

import logging

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sgl_sparsekv.patches import flags

logger = logging.getLogger("sgl_sparsekv")

_SA = "sglang.srt.server_args.ServerArgs"


def wrap_attention_backend(original, runner, *args, **kwargs):
    backend = original(runner, *args, **kwargs)
    cfg = flags.config_of(runner.server_args)
    if not cfg.enabled or runner.is_draft_worker:
        return backend
    from sgl_sparsekv.patches.backend import SparseKVAttnBackend
    from sgl_sparsekv.patches.checks import check_runner

    check_runner(runner, cfg)
    return SparseKVAttnBackend(runner, backend, cfg)


def charge_index_memory(cell_size, configurator, runner, num_layers, *args, **kwargs):
    """Per-token bytes of the KV pool plus the unit summaries and index pools, so SGLang sizes the KV pool
    with room for them (they are allocated at startup, after the KV pool, on the GPU)."""
    cfg = flags.config_of(runner.server_args)
    if not cfg.enabled or runner.device == "cpu" or runner.is_draft_worker:
        return cell_size
    from sglang.srt.layers.dp_attention import get_attention_tp_size

    from sgl_sparsekv.manager import bytes_per_token

    mc = runner.model_config
    extra = bytes_per_token(cfg, num_layers, mc.get_num_kv_heads(get_attention_tp_size()), mc.head_dim,
                            pooled=cfg.method == "lychee")
    logger.info("sparse-kv: %d bytes per KV slot for summaries and index pools (KV itself: %d)", extra, cell_size)
    return cell_size + extra


def add_stats_to_internal_state(result, scheduler, *args, **kwargs):
    backend = getattr(scheduler.tp_worker.model_runner, "attn_backend", None)
    manager = getattr(backend, "manager", None)
    if manager is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state["sparse_kv_stats"] = manager.snapshot_stats()
    return result


def register() -> None:
    HookRegistry.register(f"{_SA}.add_cli_args", flags.add_cli_args, HookType.AROUND)
    HookRegistry.register(f"{_SA}.from_cli_args", flags.from_cli_args, HookType.AROUND)
    HookRegistry.register(f"{_SA}.__init__", flags.server_args_init, HookType.AROUND)
    HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner._get_attention_backend",
                          wrap_attention_backend, HookType.AROUND)
    HookRegistry.register("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
                          charge_index_memory, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.get_internal_state",
                          add_stats_to_internal_state, HookType.AFTER)
