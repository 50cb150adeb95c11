"""Host time of one decode step's preparation (PooledDecode.prepare), with its top functions.

    python3 -m bench.host_prepare --out host.json [--batch 16] [--context 32768] [--steps 200] [--device cpu]
        [--evict-mb 256]

A Llama-3.1-8B-shaped manager (``--layers`` layers, 30 of them sparse by default; 8 KV heads, d 128) holds
``--batch`` requests of ``--context`` tokens (structure-aware chunks over random token ids with a synthetic boundary
table), then decodes ``--steps`` timed steps (after 100 warm-up steps; 50 more under cProfile): each step one token
per request, as the server's backend feeds it (host token lists, no device reads; drawing and appending the tokens is
not timed). Reports milliseconds per step (target: <= 0.3 at batch 16), its percentiles, its mean and median split
into the manager's phases, and a cProfile of it. With ``--evict-mb N`` each timed step starts after N MB were read,
so it finds its code and data out of the caches, as a served step does after the model's forward and the
scheduler's own work (the loop alone keeps them warm). ``--device cpu`` runs the same steps with the kernels' torch
twins (there a graft step computes the graft, tens of ms: read the medians). Then the requests finish one by one:
host milliseconds per release (the finished request's index cached, its rows freed) and the synchronizing calls
among them.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import platform
import pstats
import time
import warnings

import numpy as np
import torch

from sgl_sparsekv.chunking import BoundaryTable
from sgl_sparsekv.config import SparseKVConfig
from sgl_sparsekv.manager import PREPARE_PHASES, SparseKVManager
from sgl_sparsekv.patches.pooled_decode import PooledDecode
from sgl_sparsekv.transfer import sync_check

LAYERS, H, HQ, D, VOCAB = 32, 8, 32, 128, 32000


def pooled_manager(layers: int, slots: int, device, rng) -> tuple[SparseKVManager, torch.Tensor]:
    """A Llama-3.1-8B-shaped pooled lychee manager (budget 1024, a synthetic boundary table) and one random key
    buffer of ``slots`` slots that stands in for every layer's."""
    table = BoundaryTable(rng.integers(0, 5, VOCAB).astype(np.int8), rng.random(VOCAB) < 0.3)
    cfg = SparseKVConfig.from_method("lychee", {"token_budget": 1024})
    k = torch.randn(slots, H, D, device=device, dtype=torch.bfloat16)
    return SparseKVManager(cfg, layers, H, D, slots, device=device, boundary_table=table), k


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.machine()})"


def release_all(m: SparseKVManager, rows: list[int], device: str) -> tuple[dict, list[str]]:
    """Finish the requests one at a time, as the decode step that follows each finish applies it (its index
    cached, its pool rows freed): host milliseconds per release (median, max) with the GPU idle, and the
    synchronizing CUDA calls they made, by source line (each would stall a served step behind the step in flight)."""
    times = []
    checked = sync_check("warn") if device == "cuda" else contextlib.nullcontext()
    with checked, warnings.catch_warnings(record=True) as caught:   # (setting the mode back warns)
        warnings.simplefilter("always")
        for row in rows:
            sync(device)
            m.request_freed(row)
            t0 = time.perf_counter()
            m.apply_frees(wait=False)
            times.append(1000 * (time.perf_counter() - t0))
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    # the slowest release has been 60-120 ms against a median of 1.5: "slowest_at" says whether it is the first
    return {"median": round(float(np.median(times)), 3), "max": round(max(times), 3),
            "slowest_at": int(np.argmax(times)), "first": round(times[0], 3)}, syncs


def percentiles(ms: list[float]) -> dict:
    p10, p50, p90 = np.percentile(ms, [10, 50, 90])
    return {"p10": round(float(p10), 4), "median": round(float(p50), 4), "p90": round(float(p90), 4)}


def by_cuts(step_ms: list[float], cuts: list[int], grafted: list[bool]) -> dict:
    """Median step by the number of chunks it cut, over the steps without a graft: a step's cuts vary with the
    decoded tokens, and two runs compared at equal cuts differ less than their overall medians."""
    out = {}
    for c in sorted(set(cuts)):
        ms = [t for t, n, g in zip(step_ms, cuts, grafted) if n == c and not g]
        if ms:
            out[str(c)] = {"steps": len(ms), "median": round(float(np.median(ms)), 4)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--evict-mb", type=int, default=0, help="MB read before each timed step (0: warm caches)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    bs, n, dev = a.batch, a.context, a.device
    w = n + a.steps + 256
    m, k = pooled_manager(a.layers, bs * w + 1, dev, rng)
    r2t = torch.zeros(bs + 1, w, dtype=torch.int32, device=dev)
    rows = list(range(1, bs + 1))
    toks = []
    for i, row in enumerate(rows):
        # the decoded tokens' slots too, in advance: a step writes nothing to the device itself
        r2t[row, :w] = torch.arange(1 + i * w, 1 + (i + 1) * w, device=dev)
        toks.append(rng.integers(0, VOCAB, n).tolist())
        m.prepare_extend([row], [0], [n], r2t, toks[-1:])
        m.finish_extend([row], [True], r2t, lambda l: k)
    dec = PooledDecode(m, max_bs=bs, q_heads=HQ)
    seqs = [n] * bs
    evict = np.ones(a.evict_mb * 2**20 // 8)

    decoded = iter(rng.integers(0, VOCAB, (100 + a.steps + 50, bs)).tolist())

    def advance():
        """SGLang's part of a step, untimed: each request's new token appended to its host token list."""
        for i, t in enumerate(next(decoded)):
            seqs[i] += 1
            toks[i].append(t)

    def prepare():
        dec.prepare(rows, seqs, bs, r2t, toks, lambda l: k)

    def step():
        advance()
        prepare()

    for _ in range(100):   # warm-up: every Triton specialization compiled, pinned blocks cached
        step()
    sync(dev)
    keys = ("decode_prepare_s", *PREPARE_PHASES)
    step_ms, phase_ms, cuts, grafted = [], {key: [] for key in keys}, [], []
    for _ in range(a.steps):
        advance()
        evict.sum()
        before = [m.stats[key] for key in keys]
        units, grafts = m.store.stats["units_built"], m.stats["grafts"]
        t0 = time.perf_counter()
        prepare()
        step_ms.append(1000 * (time.perf_counter() - t0))
        for key, b in zip(keys, before):
            phase_ms[key].append(1000 * (m.stats[key] - b))
        cuts.append(m.store.stats["units_built"] - units)
        grafted.append(m.stats["grafts"] > grafts)
    # the rest of a step, past the manager's phases: PooledDecode's table of pool ranges and its upload
    phase_ms["table_upload"] = [t - sum(phase_ms[key][i] for key in PREPARE_PHASES)
                                for i, t in enumerate(phase_ms["decode_prepare_s"])]
    sync(dev)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        step()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    release_ms, release_syncs = release_all(m, rows, dev)
    res = {"device": device_name(dev), "batch": bs, "context": n, "layers": a.layers, "steps": a.steps,
           "evict_mb": a.evict_mb, "host_ms_per_step": round(float(np.mean(step_ms)), 3),
           "step_ms": percentiles(step_ms),
           "phase_ms_per_step": {key: round(float(np.mean(phase_ms[key])), 3) for key in keys},
           "phase_median_ms": {key: round(float(np.median(v)), 4) for key, v in phase_ms.items()},
           "step_ms_by_cuts": by_cuts(step_ms, cuts, grafted),
           "grafts": m.stats["grafts"], "decode_host_syncs": m.stats["decode_host_syncs"], "release_ms": release_ms,
           "release_syncs": len(release_syncs),
           "release_sync_sites": sorted(set(release_syncs)), "profile_top": s.getvalue().splitlines()[:45]}
    print(json.dumps({k: v for k, v in res.items() if k != "profile_top"}))
    print(s.getvalue()[:6000])
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
