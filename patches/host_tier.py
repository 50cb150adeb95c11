"""SGLang glue of the host KV tier (``host_tier``; docs/HOST_TIER.md, ``sgl_sparsekv/host_tier.py``).

The tier runs the model on SGLang's hybrid sliding-window pools: the plugin declares the dense layers "full" and
the sparse layers "sliding window" through ``--json-model-override-args`` (every process builds its model config
from it), with ``host_window`` as the window. SGLang then sizes, allocates, admits and releases by its own rules: a
token gets a full slot and a window slot, and the window slots of tokens past the window are freed as requests
decode (or, for a cached prefix, when the radix cache needs room). ``install`` adds the host pool to the KV pool
instance: each sparse-layer write also lands in the token's host row, and the sparse layers read their KV there.
"""

from __future__ import annotations

import json
import logging

from sgl_sparsekv.config import ConfigError, SparseKVConfig
from sgl_sparsekv.host_tier import HostKV, host_budget, host_reserve, layer_pattern, window_requests
from sgl_sparsekv.patches import surface
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, unwrap_write_loc
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

logger = logging.getLogger("sgl_sparsekv")

HYBRID_KEYS = ("is_hybrid_swa", "hybrid_layer_pattern", "sliding_window_size")


def hybrid_overrides(cfg: SparseKVConfig, num_layers: int) -> dict:
    """The model-config keys that make SGLang build hybrid pools: layers [0, dense_layers) full, the rest windowed
    (SGLang reads ``sliding_window_size`` before ``sliding_window``, which the model check keeps for models that
    really have one)."""
    return {"is_hybrid_swa": True, "sliding_window_size": cfg.host_window,
            "hybrid_layer_pattern": layer_pattern(cfg.dense_layers, num_layers)}


def add_model_overrides(server_args, cfg: SparseKVConfig, num_layers: int | None) -> None:
    """Merge :func:`hybrid_overrides` into ``server_args.json_model_override_args``; a user's own value for one of
    those keys is refused (the same values again, from a second parse of these args, are not)."""
    if num_layers is None:
        raise ConfigError(f"--sparse-kv {cfg.method}: host_tier needs the model's layer count, and its config could "
                          "not be read")
    given = json.loads(server_args.json_model_override_args or "{}")
    ours = hybrid_overrides(cfg, num_layers)
    clash = [k for k in HYBRID_KEYS if k in given and given[k] != ours[k]]
    if clash:
        raise ConfigError(f"--sparse-kv {cfg.method}: host_tier sets --json-model-override-args key(s) "
                          f"{', '.join(clash)} itself; drop them")
    server_args.json_model_override_args = json.dumps({**given, **ours})


def window_terms(server_args, context_len: int) -> tuple[int, int]:
    """This server's ``chunk`` and ``slack`` of ``host_tier.window_slots``: its prefill chunk (without chunked
    prefill a prompt is one chunk, as long as the context), and the tokens SGLang decodes between freeing those out
    of a window (``SGLANG_SWA_EVICTION_INTERVAL``) plus two pages."""
    from sglang.srt.environ import envs

    chunk = server_args.chunked_prefill_size
    chunk = chunk if (chunk or 0) > 0 else context_len
    return chunk, envs.SGLANG_SWA_EVICTION_INTERVAL.get() + 2 * (server_args.page_size or 1)


def install(pool, cfg: SparseKVConfig, num_layers: int, available_bytes: int, terms: tuple[int, int]) -> HostKV:
    """Give ``pool`` (SGLang's SWAKVPool) a host pool for its sparse layers: writes go through to it, and those
    layers' key and value buffers become the host pool's (by full KV slot). Refuses with one line what cannot
    fit in ``available_bytes`` of host memory, or in ``host_memory_gb``. ``terms``: :func:`window_terms` (the log
    says how many requests the window pool holds)."""
    if not isinstance(pool, SWAKVPool):
        raise ConfigError(f"--sparse-kv {cfg.method}: host_tier needs SGLang's hybrid sliding-window KV pool, got "
                          f"{type(pool).__name__}")
    surface.check_instance(pool, surface.SWA_POOL_ATTRS, "SWAKVPool")
    sparse = sorted(lid for lid, (_, windowed) in pool.layers_mapping.items() if windowed)
    if sparse != list(range(cfg.dense_layers, num_layers)):
        raise ConfigError(f"--sparse-kv {cfg.method}: host_tier found windowed layers {sparse}, expected the sparse "
                          f"layers {cfg.dense_layers}..{num_layers - 1}")
    swa, full = pool.swa_kv_pool, pool.full_kv_pool
    k0 = swa.k_buffer[0]
    if k0.dim() != 3:
        raise ConfigError(f"--sparse-kv {cfg.method}: host_tier needs the token-major KV layout [slots, heads, dim]")
    rows = full.k_buffer[0].shape[0]
    need = HostKV.bytes_for(len(sparse), rows, k0.shape[1], k0.shape[2], k0.element_size())
    reserve = host_reserve(k0.device)
    # host_budget refuses a size over what is available; the default's 90% is not taken again of what is left now,
    # since the plan took its slots from the memory available then
    limit = (host_budget(cfg.host_memory_gb, available_bytes, reserve) if cfg.host_memory_gb
             else available_bytes - reserve)
    if need > limit:
        raise ConfigError(f"--sparse-kv {cfg.method}: host_tier needs {need / 2**30:.2f} GiB of host memory for the "
                          f"sparse layers' KV of {rows} tokens, {limit / 2**30:.2f} GiB is "
                          f"{'host_memory_gb' if cfg.host_memory_gb else 'available beside the server'}; lower "
                          "--max-total-tokens")
    try:
        host = HostKV(sparse, rows, k0.shape[1], k0.shape[2], swa.store_dtype, swa.dtype, device=k0.device)
    except RuntimeError as e:
        raise ConfigError(f"--sparse-kv {cfg.method}: host_tier could not allocate {need / 2**30:.2f} GiB of "
                          f"host memory ({str(e).splitlines()[0]})") from None
    set_kv, get_k, get_v = pool.set_kv_buffer, pool.get_key_buffer, pool.get_value_buffer

    def set_kv_buffer(layer, loc_info, cache_k, cache_v, *args, **kwargs):
        lid = layer.layer_id
        if not host.holds(lid):
            return set_kv(layer, loc_info, cache_k, cache_v, *args, **kwargs)
        loc, swa_loc, _ = unwrap_write_loc(loc_info)
        if swa_loc is None:   # the sparse backend's own decode writes name the full slots only
            swa_loc = pool.translate_loc_from_full_to_swa(loc)
            loc_info = KVWriteLoc(loc, swa_loc)
        set_kv(layer, loc_info, cache_k, cache_v, *args, **kwargs)
        j = pool.layers_mapping[lid][0]   # the stored rows, in the pool's own dtype (fp8 stays fp8)
        host.write(lid, loc, swa.k_buffer[j][swa_loc], swa.v_buffer[j][swa_loc])

    def get_key_buffer(layer_id):
        return host.key_buffer(layer_id) if host.holds(layer_id) else get_k(layer_id)

    def get_value_buffer(layer_id):
        return host.value_buffer(layer_id) if host.holds(layer_id) else get_v(layer_id)

    pool.set_kv_buffer, pool.get_key_buffer, pool.get_value_buffer = set_kv_buffer, get_key_buffer, get_value_buffer
    pool.get_kv_buffer = lambda layer_id: (get_key_buffer(layer_id), get_value_buffer(layer_id))
    logger.info("sparse-kv: host tier of %.2f GiB for %d sparse layers x %d tokens; the device keeps their last %d "
                "tokens per request (%d window slots: room for %d requests at worst, each also holding its last "
                "prefill chunk of up to %d tokens there)", host.nbytes / 2**30, len(sparse), rows, cfg.host_window,
                swa.size, window_requests(swa.size, cfg.host_window, *terms), terms[0])
    return host


def window_rows(pool, layer_id: int) -> tuple:
    """A sparse layer's rows still in SGLang's window pool (keys, values, in the stored dtype) and its full-to-window
    slot map (0: the slot has no window row), for ``HostKV.stage`` to copy on the device instead of over the bus."""
    swa, j = pool.swa_kv_pool, pool.layers_mapping[layer_id][0]
    return swa.k_buffer[j], swa.v_buffer[j], pool.full_to_swa_index_mapping


def gauges(host: HostKV, allocator, hot):
    """The tier's ``/server_info`` and Prometheus gauges (sgl_sparsekv/stats.py), read from SGLang's allocator and
    from the decoders' hot buffers (``hot()``: their ``tier_rows.HotBuffers``)."""
    surface.check_instance(allocator, surface.SWA_ALLOCATOR_ATTRS, "SWATokenToKVPoolAllocator")

    def read() -> dict:
        buffers = hot()
        hit, loaded = (sum(int(b.rows_hit_loaded[i]) for b in buffers) for i in (0, 1))
        return {"host_kv_bytes": host.nbytes, "host_rows_used": allocator.size_full - allocator.full_available_size(),
                "window_slots": allocator.size_swa,
                "window_slots_used": allocator.size_swa - allocator.swa_available_size(),
                "hot_buffer_bytes": sum(b.nbytes for b in buffers), "hot_rows_hit": hit, "hot_rows_loaded": loaded,
                "host_to_device_bytes": loaded * host.row_bytes,
                **dict(zip(("staged_rows_near", "staged_rows_far"), host.staged_near_far.tolist())),
                "hot_chunks_dropped": sum(int(b.dropped[0]) for b in buffers)}

    return read
