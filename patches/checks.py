"""Startup checks: combinations of SGLang flags and models that sparse decoding does not support.

Each failure is a ConfigError with one line naming the flag or the model property.
"""

from __future__ import annotations

from sgl_sparsekv import head_roles
from sgl_sparsekv.config import ConfigError, SparseKVConfig
from sgl_sparsekv.host_tier import MAX_RUNNING, layer_pattern
from sgl_sparsekv.tensor_parallel import KVShard

SUPPORTED_BACKENDS = ("torch_native", "triton", "flashinfer")
# fp8 KV: the sparse kernels and their twins dequantize on load (SGLang stores k / k_scale, v / v_scale)
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "fp8_e4m3", "fp8_e5m2")

_HYBRID_ARCH_MARKS = ("mamba", "jamba", "nemotronh", "qwen3next", "falconh1", "granitemoehybrid", "lfm2",
                      "kimilinear", "minimax", "rwkv", "zamba", "plamo2")


def check_server_args(sa, cfg: SparseKVConfig) -> int | None:
    """Returns the model's layer count (None where its config is unreadable: SGLang then reports it)."""
    def bad(flag, why):
        raise ConfigError(f"--sparse-kv {cfg.method}: {flag} {why}")

    if sa.speculative_algorithm:
        bad("--speculative-algorithm", "(speculative decoding) is not supported")
    if sa.enable_mixed_chunk:
        bad("--enable-mixed-chunk", "is not supported (decode steps must not share a batch with prefill)")
    if sa.enable_two_batch_overlap:
        bad("--enable-two-batch-overlap", "is not supported")
    if sa.enable_pdmux:
        bad("--enable-pdmux", "is not supported")
    if sa.enable_hierarchical_cache:
        bad("--enable-hierarchical-cache", "is not supported yet (the host KV tier is planned)")
    if sa.disaggregation_mode not in ("null", None):
        bad("--disaggregation-mode", "is not supported")
    if (sa.pp_size or 1) > 1:
        bad("--pp-size", "> 1 is not supported yet (pipeline stages would each hold part of the layers' index)")
    if sa.enable_dp_attention:
        bad("--enable-dp-attention", "is not supported (--dp-size alone runs independent replicas, which is)")
    for flag, attr in (("--attention-backend", "attention_backend"),
                       ("--prefill-attention-backend", "prefill_attention_backend"),
                       ("--decode-attention-backend", "decode_attention_backend")):
        value = getattr(sa, attr)   # one of SERVER_ARGS_FIELDS
        if value is not None and value not in SUPPORTED_BACKENDS:
            bad(f"{flag} {value}", f"is not supported; use one of {', '.join(SUPPORTED_BACKENDS)}")
    if sa.kv_cache_dtype not in KV_CACHE_DTYPES:
        bad(f"--kv-cache-dtype {sa.kv_cache_dtype}", f"is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")
    if sa.is_embedding:
        bad("--is-embedding", "has no decode phase to sparsify")
    graphs = sa.cuda_graph_config
    prefill_graphs = graphs is not None and graphs.prefill.backend != "disabled"
    if sa.device != "cpu" and prefill_graphs:
        bad(f"--cuda-graph-backend-prefill {graphs.prefill.backend}",
            "is not supported (prefill keeps per-batch host bookkeeping); decode graphs stay on")
    if cfg.host_tier and not 0 < (sa.max_running_requests or 0) <= MAX_RUNNING:
        bad("host_tier", f"needs --max-running-requests of at most {MAX_RUNNING}: each decoding request holds hot "
                         "buffers of its own, allocated at startup")
    hf = _hf_config(sa)
    check_model(hf, cfg, tp_size=sa.tp_size or 1)
    if hf is None:
        return None
    return getattr(getattr(hf, "text_config", None) or hf, "num_hidden_layers", None)


def _hf_config(sa):
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(sa.model_path, trust_remote_code=sa.trust_remote_code,
                                          revision=sa.revision)
    except Exception:  # unreadable config: let SGLang report it its own way
        return None


def check_model(hf, cfg: SparseKVConfig, tp_size: int = 1) -> None:
    """Reject model families whose attention the sparse path would get wrong, and KV heads that ``--tp-size``
    does not shard evenly."""
    if hf is None:
        return
    text = getattr(hf, "text_config", None) or hf
    archs = " ".join(getattr(hf, "architectures", None) or []).lower() + " " + str(getattr(hf, "model_type", "")).lower()

    def bad(why):
        raise ConfigError(f"--sparse-kv {cfg.method}: unsupported model ({why})")

    if getattr(text, "kv_lora_rank", None) or getattr(text, "q_lora_rank", None):
        bad("MLA attention")
    if any(m in archs for m in _HYBRID_ARCH_MARKS) or getattr(text, "layers_block_type", None) \
            or getattr(text, "hybrid_override_pattern", None):
        bad("hybrid Mamba / linear-attention layers")
    layers = getattr(text, "num_hidden_layers", None)
    if getattr(text, "is_hybrid_swa", False) and not (
            cfg.host_tier and layers is not None
            and getattr(text, "hybrid_layer_pattern", None) == layer_pattern(cfg.dense_layers, layers)):
        bad("hybrid sliding-window layers")   # the model's own, not the host tier's (patches/host_tier.py)
    layer_types = getattr(text, "layer_types", None) or []
    if any("sliding" in str(t) for t in layer_types) or (
            getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
            and not layer_types):
        bad("sliding-window attention")
    if getattr(hf, "is_encoder_decoder", False):
        bad("encoder-decoder")
    if layers is not None and cfg.dense_layers >= layers:
        raise ConfigError(f"sparse-kv config: dense_layers ({cfg.dense_layers}) must be < the model's "
                          f"{layers} layers, or no layer is sparse")
    kv_heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    if kv_heads is not None:
        KVShard.of_rank(kv_heads, tp_size, 0)
    if cfg.method == "lychee" and layers is not None and kv_heads is not None:
        head_roles.resolve(cfg.head_roles, layers, kv_heads, cfg.dense_layers)


def check_runner(runner, cfg: SparseKVConfig) -> None:
    """The same model checks in the scheduler, on the config SGLang actually loaded."""
    check_model(runner.model_config.hf_config, cfg, tp_size=runner.tp_size)
