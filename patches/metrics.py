"""The plugin's counters and pool fill on SGLang's Prometheus ``/metrics`` (``--enable-metrics``).

SGLang runs prometheus_client in multiprocess mode: the launcher sets ``PROMETHEUS_MULTIPROC_DIR``
before the schedulers start, each scheduler writes its gauges there and the HTTP server's
``/metrics`` collects them. Ours are gauges named ``sglang:sparse_kv_*`` with SGLang's
``model_name`` label plus ``tp_rank``, refreshed at most once a second from the decode path and
whenever the scheduler goes idle.
"""

from __future__ import annotations

import time

# stats key -> (metric suffix, help)
COUNTERS = {
    "sparse_steps": ("sparse_steps", "Decode steps with at least one request past the token budget."),
    "dense_steps": ("dense_steps", "Decode steps with every request within the token budget."),
    "index_builds": ("index_builds", "Cluster indexes built."),
    "index_reused": ("index_reused", "Cluster indexes adopted from a cached prefix."),
    "index_extends": ("index_extends", "Adopted indexes extended by clustering the prompt past the shared prefix."),
    "grafts": ("grafts", "Decoded chunks grafted into an index."),
    "units_built": ("units_built", "Retrieval units (chunks, pages) summarized."),
    "units_reused": ("units_reused", "Retrieval units reused through the radix cache."),
    "index_pool_full": ("index_pool_full", "Times an index found no room in the GPU index pools."),
    "dense_fallback_steps": ("dense_fallback_steps",
                             "Request decode steps run densely because their index had no room in the pools."),
    "scratch_full_steps": ("scratch_full_steps",
                           "Request decode steps run densely because the batch outgrew the selection scratch."),
    "unselected_steps": ("unselected_steps",
                         "Request decode steps past the budget run densely because the step before selected no "
                         "token lists for them (select_ahead: a request's first decode step inside a CUDA graph)."),
    "own_order_steps": ("own_order_steps",
                        "select_ahead decode steps run eagerly in lychee's order (select, then attend) because the "
                        "batch held a request's first decode step."),
    "decode_host_syncs": ("decode_host_syncs",
                          "Decode steps that read batch facts back from the GPU (0 while SGLang builds batches "
                          "through ForwardBatch.init_new)."),
    "attended_tokens": ("attended_tokens", "KV tokens read by decode."),
    "scored_tokens": ("scored_tokens", "KV tokens whose keys the two-stage selection scored (rerank_factor > 1)."),
    "context_tokens": ("context_tokens", "KV tokens a dense decode would have read."),
    "live_requests": ("live_requests", "Requests holding sparse-kv state."),
    "live_units": ("live_units", "Retrieval units alive in the unit store."),
    "cached_indexes": ("cached_indexes", "Entries in the index cache."),
    "index_bytes": ("index_bytes", "Bytes of unit summaries and cached indexes."),
    "unplaced_requests": ("unplaced_requests", "Requests decoding densely until their index gets pool rows."),
}


class PrometheusExport:
    def __init__(self, labels: dict[str, str]):
        from prometheus_client import Gauge

        self.labels = labels
        names = list(labels)
        self.gauges = {key: Gauge(f"sglang:sparse_kv_{suffix}", doc, labelnames=names, multiprocess_mode="mostrecent")
                       for key, (suffix, doc) in COUNTERS.items()}
        self.pool_rows = Gauge("sglang:sparse_kv_index_pool_rows_used", "Rows in use in a GPU index pool.",
                               labelnames=names + ["pool"], multiprocess_mode="mostrecent")
        self.pool_fill = Gauge("sglang:sparse_kv_index_pool_fill", "Share of a GPU index pool's rows in use.",
                               labelnames=names + ["pool"], multiprocess_mode="mostrecent")
        self._last = 0.0

    def update(self, snapshot, force: bool = False) -> None:
        """``snapshot()`` -> the manager's stats; called only when a refresh is due."""
        now = time.monotonic()
        if not force and now - self._last < 1.0:
            return
        self._last = now
        stats = snapshot()
        for key, gauge in self.gauges.items():
            if key in stats:
                gauge.labels(**self.labels).set(stats[key])
        for pool, fill in stats.get("index_pools", {}).items():
            self.pool_rows.labels(**self.labels, pool=pool).set(fill["used"])
            self.pool_fill.labels(**self.labels, pool=pool).set(fill["used"] / max(1, fill["capacity"]))
