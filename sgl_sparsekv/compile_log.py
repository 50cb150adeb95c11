"""Every Triton kernel compile in this process, with its time, for finding where a server's start goes.

A lychee server's first start on a fresh H200 spent 19-20 s compiling its Triton kernels, beside FlashInfer's JIT
builds, which take minutes for any server (README, "GPU"; bench/results/gpu_start_h200.json). With
``SPARSEKV_LOG_COMPILES`` set to a file path, each compile appends one JSON line: the process, when it ended,
the kernel, its seconds (a hit in Triton's on-disk cache takes milliseconds), whether it was a manual warmup, and
Triton's specialization data, from which ``JITFunction.preload`` builds the same variant again.
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV = "SPARSEKV_LOG_COMPILES"
_lock = threading.Lock()
_installed: str | None = None   # the path this process logs to


def install_from_env() -> bool:
    """Install the hooks once per process where ``SPARSEKV_LOG_COMPILES`` names a file."""
    path = os.environ.get(ENV)
    if not path or _installed == path:
        return False
    install(path)
    return True


def install(path: str) -> None:
    """Chain Triton's JIT hooks with ones that time each compile and append it to ``path``; a hook set before
    keeps its say (a cache hook that returns True still skips the compile, which is then not logged)."""
    global _installed
    from triton import knobs

    rt = knobs.runtime
    prior_cache, prior_post = rt.jit_cache_hook, rt.jit_post_compile_hook
    started: dict[tuple, float] = {}

    def before(**kw):
        started[_ident(kw)] = time.perf_counter()
        return prior_cache(**kw) if prior_cache else None

    def after(**kw):
        t0 = started.pop(_ident(kw), None)
        fn = kw["fn"]
        record = {"pid": os.getpid(), "at": round(time.time(), 3),   # the end, to place it among the server's log lines
                  "kernel": f"{getattr(fn.module, '__name__', fn.module)}.{fn.name}",
                  "seconds": None if t0 is None else round(time.perf_counter() - t0, 3),
                  "warmup": bool(kw.get("is_manual_warmup")),
                  "specialization": kw["compile"].get("specialization_data")}
        with _lock, open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return prior_post(**kw) if prior_post else None

    rt.jit_cache_hook, rt.jit_post_compile_hook = before, after
    _installed = path


def _ident(kw: dict) -> tuple:
    return kw["fn"].name, str(kw["key"]), threading.get_ident()


def summary(path: str) -> list[dict]:
    """The log's kernels, slowest first: compiles and seconds in all."""
    by: dict[str, dict] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            s = by.setdefault(r["kernel"], {"kernel": r["kernel"], "compiles": 0, "seconds": 0.0})
            s["compiles"] += 1
            s["seconds"] = round(s["seconds"] + (r["seconds"] or 0.0), 3)
    return sorted(by.values(), key=lambda s: -s["seconds"])


if __name__ == "__main__":
    import sys

    rows = summary(sys.argv[1])
    for s in rows:
        print(f"{s['seconds']:8.2f} s  {s['compiles']:3d}  {s['kernel']}")
    print(f"{sum(s['seconds'] for s in rows):8.2f} s  {sum(s['compiles'] for s in rows):3d}  in all")
