"""Every counter of the sparse-kv data path, declared once with its type and meaning.

The manager, the decode steps and the backend increment one ``Counters`` object by attribute. ``/server_info``
reports the manager's whole snapshot (these counters plus the gauges below, read from the live state), and
Prometheus (``patches/metrics.py``) exports the fields listed in ``EXPORTED``, with the help text given here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def _counter(doc: str, export: bool = True):
    return field(default=0, metadata={"doc": doc, "export": export})


def _seconds(doc: str):
    return field(default=0.0, metadata={"doc": doc, "export": False})


@dataclass
class Counters:
    # decode steps
    sparse_steps: int = _counter("Decode steps with at least one request past the token budget.")
    dense_steps: int = _counter("Decode steps with every request within the token budget.")
    attended_tokens: int = _counter("KV tokens read by decode.")
    context_tokens: int = _counter("KV tokens a dense decode would have read.")
    scored_tokens: int = _counter("KV tokens whose keys the two-stage selection scored (rerank_factor > 1).")
    reused_list_steps: int = _counter("Request decode steps that attended to token lists selected at an earlier "
                                      "step (select_every > 1).", export=False)
    decode_host_syncs: int = _counter("Decode steps that read batch facts back from the GPU (0 while SGLang builds "
                                      "batches through ForwardBatch.init_new).")
    audited_steps: int = _counter("Decode steps the recall audit measured (config recall_audit_every).")
    upload_fresh_buffers: int = _counter("Decode steps whose table upload took a fresh pinned buffer.", export=False)
    requested_dense_steps: int = _counter("Request decode steps past the budget run densely because the request asked "
                                          "for it (custom_params sparse_kv \"off\").")
    # fallbacks: each is a request step decoded densely (never on less context)
    index_pool_full: int = _counter("Times an index found no room in the GPU index pools.")
    dense_fallback_steps: int = _counter("Request decode steps run densely because their index had no room in the "
                                         "pools.")
    scratch_full_steps: int = _counter("Request decode steps run densely because the batch outgrew the selection "
                                       "scratch.")
    unselected_steps: int = _counter("Request decode steps past the budget run densely because the step before "
                                     "selected no token lists for them (select_ahead: a request's first decode step "
                                     "inside a CUDA graph).")
    own_order_steps: int = _counter("select_ahead decode steps run eagerly in lychee's order (select, then attend) "
                                    "because the batch held a request's first decode step.")
    # indexes
    index_builds: int = _counter("Cluster indexes built.")
    index_reused: int = _counter("Cluster indexes adopted from a cached prefix.")
    index_extends: int = _counter("Adopted indexes extended by clustering the prompt past the shared prefix.")
    build_chunks: int = _counter("Chunks clustered into built indexes.", export=False)
    extend_chunks: int = _counter("Chunks clustered past an adopted prefix.", export=False)
    grafts: int = _counter("Decoded chunks grafted into an index.")
    units_built: int = _counter("Retrieval units (chunks, pages) cut.")
    units_reused: int = _counter("Retrieval units reused through the radix cache.")
    units_freed: int = _counter("Retrieval units freed with their KV slots.", export=False)
    # host seconds
    decode_prepare_s: float = _seconds("A decode step's host preparation, all of it.")
    prepare_frees_s: float = _seconds("... applying the frees.")
    prepare_cut_s: float = _seconds("... cutting decoded tokens into chunks.")
    prepare_place_s: float = _seconds("... placing the indexes of requests that just passed the budget.")
    prepare_graft_s: float = _seconds("... grafting chunks (their keys included).")
    index_build_s: float = _seconds("Placing a prompt's index: pooling its chunks' keys and clustering them.")
    build_keys_s: float = _seconds("... pooling the chunks' keys.")
    build_cluster_s: float = _seconds("... clustering them.")
    build_load_s: float = _seconds("Loading built or adopted indexes into the pools.")
    index_release_s: float = _seconds("Releasing finished requests' indexes into the index cache.")
    extend_wait_s: float = _seconds("A prefill's preparation waiting for the device (frees, key slots read back).")

    def snapshot(self) -> dict:
        return asdict(self)


# read from the live state at each snapshot (``SparseKVManager.snapshot_stats``)
GAUGES = {
    "live_requests": "Requests holding sparse-kv state.",
    "live_units": "Retrieval units alive in the unit store.",
    "cached_indexes": "Entries in the index cache.",
    "index_bytes": "Bytes of unit summaries, cached indexes and index pools.",
    "unplaced_requests": "Requests decoding densely until their index gets pool rows.",
    "index_pool_compactions": "Times a pool level's segments were moved together because its free rows, enough for "
                              "an index, lay apart.",
    # the host tier (config host_tier), from SGLang's allocator
    "host_kv_bytes": "Bytes of the host pool holding the sparse layers' KV (host_tier).",
    "host_rows_used": "Tokens whose sparse-layer KV the host pool holds (SGLang's full KV slots in use; host_tier).",
    "window_slots": "Device KV slots of the sparse layers, each request's recent window (host_tier).",
    "window_slots_used": "Of those, in use (host_tier).",
    "hot_buffer_bytes": "Bytes of the sparse decode's device buffers: per decoding request its hot chunks and a ring "
                        "of its last tokens (host_tier).",
    "hot_rows_hit": "Token rows of selected chunks a decode step found in the hot buffers, summed over sparse layers "
                    "and KV heads (host_tier).",
    "hot_rows_loaded": "Token rows of selected chunks loaded from the host pool (host_tier).",
    "host_to_device_bytes": "Bytes those loads moved from the host pool to the device, keys and values (host_tier).",
    "hot_chunks_dropped": "Selected chunks a token list left out, past the hot slots of its request (host_tier).",
    "staged_rows_near": "Prefix rows prefills staged from the window pool on the device, per sparse layer "
                        "(host_tier).",
    "staged_rows_far": "Prefix rows prefills staged from the host pool over the bus, per sparse layer (host_tier).",
}
# what Prometheus exports, by snapshot key: its help text
EXPORTED = {**{f.name: f.metadata["doc"] for f in Counters.__dataclass_fields__.values() if f.metadata["export"]},
            **GAUGES}
