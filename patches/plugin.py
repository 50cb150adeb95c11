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
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.get_internal_state",
                          add_stats_to_internal_state, HookType.AFTER)
