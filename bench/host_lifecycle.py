"""Host time of a request's life events on the pooled path: a radix-hit adoption and a request's end.

    python -m bench.host_lifecycle --out host_lifecycle.json [--context 32768] [--layers 4] [--reps 5]

While these run in SGLang's scheduler thread, every running request waits. A request of ``--context`` tokens
(structure-aware chunks over random ids, Llama-3.1-8B head shape) is prefilled and its index built; then, ``--reps``
times, a new request with the same prompt plus 256 tokens arrives (a radix hit: ``prepare_extend`` finds the
prompt's units and ``finish_extend`` adopts its cached index), and the previous one ends (``request_freed``, then
``apply_frees``: its units are released and its index is cached). Reports medians in milliseconds. The unit
bookkeeping does not depend on the layer count; placing the index (a device copy) does.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

from bench.host_prepare import VOCAB, pooled_manager

QUESTION = 256


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    rng = np.random.default_rng(0)
    w = a.context + QUESTION
    rows = a.reps + 2
    m, k = pooled_manager(a.layers, rows * w + 1, dev, rng)
    r2t = torch.zeros(rows, w, dtype=torch.int32, device=dev)
    prompt = rng.integers(0, VOCAB, a.context).tolist()

    def prefill(row, prefix_row=None):
        """One request's prefill: host preparation, then index placement (ms of each)."""
        r2t[row] = torch.arange(1 + row * w, 1 + (row + 1) * w, device=dev)
        plen = 0 if prefix_row is None else a.context
        if prefix_row is not None:
            r2t[row, :plen] = r2t[prefix_row, :plen]
        toks = prompt + rng.integers(0, VOCAB, QUESTION).tolist()
        sync()
        t0 = time.perf_counter()
        m.prepare_extend([row], [plen], [len(toks)], r2t, [toks])
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        m.finish_extend([row], [True], r2t, lambda l: k)
        sync()
        return 1000 * (t1 - t0), 1000 * (time.perf_counter() - t2)

    def end(row):
        sync()
        t0 = time.perf_counter()
        m.request_freed(row)
        m.apply_frees()
        sync()
        return 1000 * (time.perf_counter() - t0)

    prefill(1)
    adopt_host, adopt_place, drops = [], [], []
    for i in range(a.reps):
        host, place = prefill(i + 2, prefix_row=i + 1)
        adopt_host.append(host)
        adopt_place.append(place)
        drops.append(end(i + 1))
    assert m.stats["index_reused"] == a.reps, m.stats
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else f"CPU ({platform.machine()})",
           "context": a.context, "layers": a.layers, "units": len(m.states[a.reps + 1].units), "reps": a.reps,
           "adopt_prepare_extend_ms": round(statistics.median(adopt_host), 2),
           "adopt_place_index_ms": round(statistics.median(adopt_place), 2),
           "request_end_ms": round(statistics.median(drops), 2)}
    print(json.dumps(res))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
