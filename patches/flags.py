"""``--sparse-kv`` / ``--sparse-kv-config`` on SGLang's ServerArgs (CLI, ``sglang serve`` and Engine).

The parsed, validated config travels to the scheduler process as two plain attributes of
ServerArgs (``sparse_kv``: the method, ``sparse_kv_config``: the effective config as a dict),
which survive the pickling SGLang uses to start its subprocesses.
"""

from __future__ import annotations

import argparse
import logging

from sgl_sparsekv.config import METHODS, ConfigError, SparseKVConfig

logger = logging.getLogger("sgl_sparsekv")
# the config this process parsed last (the launcher's, where the tokenizer manager checks requests against it)
ACTIVE: SparseKVConfig | None = None


def add_cli_args(original, parser: argparse.ArgumentParser):
    original(parser)
    group = parser.add_argument_group("sparse KV decoding (sgl-sparsekv)")
    group.add_argument("--sparse-kv", choices=METHODS, default="off",
                       help="Retrieval-based sparse decoding: 'lychee' (LycheeCluster), 'quest' (Quest "
                            "baseline) or 'off' (default; SGLang unchanged).")
    group.add_argument("--sparse-kv-config", default=None, metavar="FILE_OR_JSON",
                       help="Overrides for the sparse-kv config: a JSON file or an inline JSON object "
                            "(keys: see configs/*.json and the sgl-sparsekv README).")


def attach(server_args, method: str, overrides) -> None:
    """Validate and store the config on ``server_args``; raises ConfigError with one line."""
    from sgl_sparsekv.patches.checks import check_server_args
    from sgl_sparsekv.patches.surface import check_sglang

    global ACTIVE
    cfg = SparseKVConfig.from_method(method, overrides)
    if cfg.enabled:
        check_sglang()
        layers = check_server_args(server_args, cfg)
        if cfg.host_tier:
            from sgl_sparsekv.patches.host_tier import add_model_overrides

            add_model_overrides(server_args, cfg, layers)
    server_args.sparse_kv = cfg.method
    server_args.sparse_kv_config = cfg.to_dict()
    ACTIVE = cfg


BACKEND_FLAGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


def wrapped_backend(device: str | None) -> str | None:
    """The attention backend sparse-kv wraps where the user names none (None: leave SGLang's choice, which the
    startup check then names). SGLang's own defaults are backends it does not wrap: fa3 on a Hopper GPU, intel_amx
    on an x86 CPU with AMX."""
    from sglang.srt.utils import get_device, is_flashinfer_available

    if device is None:
        try:
            device = get_device()   # what SGLang resolves a missing --device to
        except RuntimeError:
            return None
    if device.startswith("cpu"):
        return "torch_native"
    if device.startswith("cuda"):
        return "flashinfer" if is_flashinfer_available() else "triton"
    return None


def choose_backend(get, put) -> None:
    """Fill in :func:`wrapped_backend` where no attention-backend flag was given; ``get``/``put`` read and write the
    CLI namespace or ServerArgs' keyword arguments."""
    if all(get(f) is None for f in BACKEND_FLAGS):
        backend = wrapped_backend(get("device"))
        if backend is not None:
            put("attention_backend", backend)
            logger.info("sparse-kv: --attention-backend %s (no attention backend given)", backend)


def choose_chunk(cfg: SparseKVConfig, get, put) -> None:
    """With the host tier, prefill chunks of ``TIER_CHUNK`` where ``--chunked-prefill-size`` is not given: each
    running request keeps its last chunk in the window pool, whose slots the memory plan sets aside per request."""
    from sgl_sparsekv.host_tier import TIER_CHUNK

    if cfg.host_tier and get("chunked_prefill_size") is None:
        put("chunked_prefill_size", TIER_CHUNK)
        logger.info("sparse-kv: --chunked-prefill-size %d (host_tier; none given)", TIER_CHUNK)


def prepare(method: str, overrides, get, put) -> None:
    """What a sparse server sets among SGLang's own flags before SGLang resolves them (``get``/``put`` read and
    write the CLI namespace or ServerArgs' keyword arguments)."""
    if method == "off":
        return
    choose_backend(get, put)
    choose_chunk(SparseKVConfig.from_method(method, overrides), get, put)
    put("disable_prefill_cuda_graph", True)   # prefill does host bookkeeping per batch; decode graphs stay on


def from_cli_args(original, cls, args: argparse.Namespace):
    method, overrides = getattr(args, "sparse_kv", "off"), getattr(args, "sparse_kv_config", None)
    try:
        prepare(method, overrides, lambda f: getattr(args, f, None), lambda f, v: setattr(args, f, v))
        server_args = original(cls, args)
        attach(server_args, method, overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    return server_args


def server_args_init(original, self, *args, **kwargs):
    """``sglang.Engine(..., sparse_kv="lychee", sparse_kv_config={...})`` and ``ServerArgs(...)``."""
    method = kwargs.pop("sparse_kv", "off")
    overrides = kwargs.pop("sparse_kv_config", None)
    prepare(method, overrides, kwargs.get, kwargs.__setitem__)
    original(self, *args, **kwargs)
    attach(self, method, overrides)


def config_of(server_args) -> SparseKVConfig:
    data = getattr(server_args, "sparse_kv_config", None)
    if not data:
        return SparseKVConfig(method="off")
    return SparseKVConfig.from_dict(data)
