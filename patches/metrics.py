"""The plugin's counters and pool fill on SGLang's Prometheus ``/metrics`` (``--enable-metrics``).

SGLang runs prometheus_client in multiprocess mode: the launcher sets ``PROMETHEUS_MULTIPROC_DIR``
before the schedulers start, each scheduler writes its gauges there and the HTTP server's
``/metrics`` collects them. Ours are gauges named ``sglang:sparse_kv_*`` with SGLang's
``model_name`` label plus ``tp_rank``, refreshed at most once a second from the decode path and
whenever the scheduler goes idle.
"""

from __future__ import annotations

import time

from sgl_sparsekv.recall_audit import BUCKETS
from sgl_sparsekv.stats import EXPORTED


class PrometheusExport:
    def __init__(self, labels: dict[str, str]):
        from prometheus_client import Gauge, Histogram

        self.labels = labels
        names = list(labels)
        self.gauges = {key: Gauge(f"sglang:sparse_kv_{key}", doc, labelnames=names, multiprocess_mode="mostrecent")
                       for key, doc in EXPORTED.items()}
        self.pool_rows = Gauge("sglang:sparse_kv_index_pool_rows_used", "Rows in use in a GPU index pool.",
                               labelnames=names + ["pool"], multiprocess_mode="mostrecent")
        self.pool_fill = Gauge("sglang:sparse_kv_index_pool_fill", "Share of a GPU index pool's rows in use.",
                               labelnames=names + ["pool"], multiprocess_mode="mostrecent")
        self.recall = Histogram("sglang:sparse_kv_recall_kept_mass",
                                "Share of dense attention's mass that a sparse layer's selection kept for one "
                                "audited request row (live recall audit, config recall_audit_every), by layer group.",
                                labelnames=names + ["layers"], buckets=BUCKETS)
        self._last = 0.0

    def update(self, snapshot, audit=None, force: bool = False) -> None:
        """``snapshot()`` -> the manager's stats; ``audit``: its RecallAudit, if on. Called only when a refresh is
        due."""
        now = time.monotonic()
        if not force and now - self._last < 1.0:
            return
        self._last = now
        if audit is not None:
            for layers, value in audit.drain():
                self.recall.labels(**self.labels, layers=layers).observe(value)
        stats = snapshot()
        for key, gauge in self.gauges.items():
            if key in stats:
                gauge.labels(**self.labels).set(stats[key])
        for pool, fill in stats.get("index_pools", {}).items():
            self.pool_rows.labels(**self.labels, pool=pool).set(fill["used"])
            self.pool_fill.labels(**self.labels, pool=pool).set(fill["used"] / max(1, fill["capacity"]))
