"""Host time of a request's life events on the pooled path: a radix-hit adoption and a request's end.

    python -m bench.host_lifecycle --out host_lifecycle.json [--context 32768] [--layers 4] [--reps 5]

While these run in SGLang's scheduler thread, every running request waits. A request of ``--context`` tokens
(structure-aware chunks over random ids, Llama-3.1-8B head shape) is prefilled and its index built; then, ``--reps``
times, a new request with the same prompt plus 256 tokens arrives (a radix hit: ``prepare_extend`` finds the
prompt's units and ``finish_extend`` adopts its cached index), and the previous one ends (``request_freed``, then
``apply_frees``: its units are released and its index is cached). Reports medians in milliseconds. The unit
bookkeeping does not depend on the layer count; placing the index (a device copy) does. With ``--busy-ms``, each
event starts while the GPU still runs that long a kernel (as it does in a server, which prepares a step while the
last one runs): the event's host time then shows whether it waits for the GPU anywhere, syncs that
``set_sync_debug_mode`` does not flag (a copy from pageable memory, a pinned allocation) among them. Split over
``--busy-kernels`` launches, the queued work also fills CUDA's launch queue, so every launch of the event waits
for a slot, as inside a prefill whose layers' kernels are still queued. The ``*_host_ms`` times stop when the host
returns; the others when the GPU is done too, which with ``--busy-ms`` includes the wait.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from bench.host_prepare import VOCAB, device_name, pooled_manager, sync

QUESTION = 256


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--busy-ms", type=float, default=0.0, help="GPU work queued before each event (CUDA only)")
    ap.add_argument("--busy-kernels", type=int, default=1,
                    help="that work as this many kernels: a few thousand fill the launch queue, as a prefill's do")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cycles_per_ms = 0
    if dev == "cuda" and a.busy_ms:
        torch.cuda._sleep(1_000_000)   # first call loads the kernel
        sync(dev)
        t = time.perf_counter()
        torch.cuda._sleep(10_000_000)
        sync(dev)
        cycles_per_ms = 10_000_000 / (1000 * (time.perf_counter() - t))

    def busy():
        """Queue ``--busy-ms`` of GPU work, then time the host from here."""
        sync(dev)
        if cycles_per_ms:
            for _ in range(a.busy_kernels):
                torch.cuda._sleep(int(a.busy_ms * cycles_per_ms / a.busy_kernels))
        return time.perf_counter()

    rng = np.random.default_rng(0)
    w = a.context + QUESTION
    rows = a.reps + 3
    m, k = pooled_manager(a.layers, rows * w + 1, dev, rng)
    r2t = torch.zeros(rows, w, dtype=torch.int32, device=dev)
    prompt = rng.integers(0, VOCAB, a.context).tolist()

    def prefill(row, prefix_row=None, prompt=prompt):
        """One request's prefill: host preparation, then index placement (ms of each)."""
        r2t[row] = torch.arange(1 + row * w, 1 + (row + 1) * w, device=dev)
        plen = 0 if prefix_row is None else a.context
        if prefix_row is not None:
            r2t[row, :plen] = r2t[prefix_row, :plen]
        toks = prompt + rng.integers(0, VOCAB, QUESTION).tolist()
        t0 = busy()
        m.prepare_extend([row], [plen], [len(toks)], r2t, [toks])
        t1 = time.perf_counter()
        t2 = busy()
        m.finish_extend([row], [True], r2t, lambda l: k)
        t3 = time.perf_counter()
        sync(dev)
        return 1000 * (t1 - t0), 1000 * (time.perf_counter() - t2), 1000 * (t3 - t2)

    def end(row):
        t0 = busy()
        m.request_freed(row)
        m.apply_frees()
        t1 = time.perf_counter()
        sync(dev)
        return 1000 * (time.perf_counter() - t0), 1000 * (t1 - t0)

    # the first build compiles and warms the kernels: its prompt differs, so the next one builds again
    prefill(a.reps + 2, prompt=rng.integers(0, VOCAB, a.context).tolist())
    _, build_place, build_host = prefill(1)
    adopt_host, adopt_place, adopt_place_host, drops, drops_host = [], [], [], [], []
    for i in range(a.reps):
        host, place, place_host = prefill(i + 2, prefix_row=i + 1)
        adopt_host.append(host)
        adopt_place.append(place)
        adopt_place_host.append(place_host)
        drop, drop_host = end(i + 1)
        drops.append(drop)
        drops_host.append(drop_host)
    assert m.stats["index_reused"] == a.reps, m.stats
    res = {"device": device_name(dev),
           "context": a.context, "layers": a.layers, "units": len(m.states[a.reps + 1].units), "reps": a.reps,
           "adopt_prepare_extend_ms": round(statistics.median(adopt_host), 2),
           "adopt_place_index_ms": round(statistics.median(adopt_place), 2),
           "request_end_ms": round(statistics.median(drops), 2),
           "busy_ms": a.busy_ms, "busy_kernels": a.busy_kernels,
           "build_index_ms": round(build_place, 2), "build_index_host_ms": round(build_host, 2),
           "adopt_place_index_host_ms": round(statistics.median(adopt_place_host), 2),
           "request_end_host_ms": round(statistics.median(drops_host), 2)}
    print(json.dumps(res))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
