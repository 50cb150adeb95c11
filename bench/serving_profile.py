"""Where a batched serving step's time goes: kernel time per decode step, by kind, in the real server.

    python3 -m bench.serving_profile --model /tmp/m8b --out $OUT/profile.json --methods dense lychee

Per method, one server (the same arguments as ``bench.gpu_serving``) decodes ``--batch`` requests over two
shared 32K-token prefixes (the prefixes are prefilled first, then every request joins in one extend step) for
``--output-len`` tokens each. Once all of them decode, SGLang's own profiler (``/start_profile``, torch profiler,
CUPTI) records ``--steps`` forward steps, and the trace is reduced to each CUDA-graph replay (one decode step):
kernel time by kind (the plugin's selection, its sparse attention, its index upkeep, dense attention, matrix
products, the rest), the kernels launched outside the graph between two replays, and the GPU's idle time between
replays (host work the GPU waited for). Every method from the same call on the same card, so the differences
against dense place the cost of sparse decoding in the step.

With ``--join``, one more request over the first prefix arrives while the batch decodes, and ``--join-steps``
steps around its prefill are profiled with Python stacks: host time per function of this package (inclusive),
CUDA runtime and driver calls, and the plugin's counters over that window, to place what a join costs the host
(a prefill that adopts a cached index and clusters its question's chunks). ``--stream`` reads every request's
tokens as a stream, and ``--text`` makes the prompts as its generated-shared-prefix dataset does (random vocabulary
tokens decoded to text and tokenized again: more tokens, and more chunks per token, than random ids), so the
profile can be matched to ``sglang.bench_serving``'s workload one difference at a time.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import random
import re
import statistics
import tempfile
import threading
import time

import requests

from bench.gpu_serving import COMMON, WARMUP_TOKENS, greedy, method_parser, method_server
from bench.server import Server

# kernel name -> kind; the first pattern that matches wins
KINDS = (("selection", r"_coarse_expand_kernel|_fine_bounds_kernel|_cut_kernel|_emit_count_kernel|_emit_write_kernel"
                       r"|_bounds_kernel|_score_kernel|_keep_kernel"),
         ("sparse_attention", r"_partial_kernel|_merge_kernel"),
         ("index_upkeep", r"_graft_kernel|_pool_kernel|_pool_layers_kernel|_assign_kernel|_sums_kernel"),
         # flashinfer's norms are not attention (the committed profiles up to serving_profile_h200_b1_*.json
         # count them as dense attention: about 0.19 ms a step on the Llama-3.1-8B shape)
         ("other", r"flashinfer::norm::"),
         ("dense_attention", r"BatchDecode|BatchPrefill|MergeState|flashinfer|decode_attention|_fwd_"),
         ("matmul", r"gemm|Gemm|cutlass|nvjet|xmma|cublas|splitK"))


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other")


def step_profile(events: list[dict]) -> dict:
    """Chrome-trace events of a profiled window -> per decode step (one CUDA-graph replay) means, in ms.

    A kernel belongs to a replay when it carries the correlation id of a ``cudaGraphLaunch`` runtime call; kernels
    and copies with another id that start between two replays are counted to the later one as ``outside_graph``.
    ``period`` runs from one replay's first kernel to the next one's, ``idle`` is the part of it no kernel or copy
    ran in (the GPU waited for the host). ``selection_busy`` is the time the graph's selection kernels ran,
    ``others_busy`` the time its other kernels did, ``selection_beside_others`` the time both did (select_ahead's
    side stream), ``selection_tail`` the time selection ran after the last other kernel ended (the step waited for
    it). By kind, not stream: a replay runs a graph's branches on streams the driver picks, and it runs part of the
    capture stream's chain on the side branch's stream. ``others_waited`` is the time between two of the other
    kernels (the step's own chain) before the last of them, ``others_waited_behind_selection`` the part of it where
    the kernel that waited started within 3 us of a selection kernel's end on its own stream: queued behind a
    selection it does not depend on, if its stream is shared. ``others_waited_beside_selection`` is the part of
    ``others_waited`` during which a selection kernel ran on any stream: at equal priority the GPU hands out a later
    kernel's blocks only once an earlier kernel has none left to place, so a selection kernel of many waves holds
    back the chain's next kernel even on another stream."""
    work, order = _replays(events)
    steps, outside_names, late = [], {}, {}
    for kernels, nxt in zip(order, order[1:]):
        start, end = kernels[0]["ts"], nxt[0]["ts"]
        inside = {id(k) for k in kernels}
        window = [e for e in work if start <= e["ts"] < end]
        kinds: dict[str, float] = {}
        for k in kernels:
            kind = kind_of(k["name"])
            kinds[kind] = kinds.get(kind, 0.0) + k["dur"]
        busy = _length(_union(window, end))
        outside = [e for e in window if id(e) not in inside]
        for e in outside:
            outside_names[e["name"]] = outside_names.get(e["name"], 0.0) + e["dur"]
        chosen = [k for k in kernels if kind_of(k["name"]) == "selection"]
        rest = [k for k in kernels if kind_of(k["name"]) != "selection"]
        picks, others = _union(chosen, end), _union(rest, end)
        steps.append({"period": end - start, "graph_span": max(k["ts"] + k["dur"] for k in kernels) - start,
                      "idle": end - start - busy, "kernels_in_graph": len(kernels),
                      "outside_graph": sum(e["dur"] for e in outside), "selection_busy": _length(picks),
                      "others_busy": _length(others), "selection_beside_others": _overlap(picks, others),
                      "selection_tail": max(0.0, picks[-1][1] - others[-1][1]) if picks and others else 0.0,
                      **_waits(rest, chosen, picks, late),
                      **kinds})
    keys = sorted({k for s in steps for k in s})
    out = {k: round(statistics.mean(s.get(k, 0.0) for s in steps) / 1000, 4) for k in keys if k != "kernels_in_graph"}
    out["kernels_in_graph"] = sorted({s["kernels_in_graph"] for s in steps})
    out["steps"] = len(steps)
    names: dict[str, float] = {}
    for kernels in order[:-1]:
        for k in kernels:
            names[k["name"]] = names.get(k["name"], 0.0) + k["dur"]
    out["top_kernels_ms"] = _top(names, len(steps), 15)
    # what runs between replays (SGLang's page table of the dense layers, the sampler's copies, the plugin's eager
    # work) by name: its growth with the context is part of the step's
    out["top_outside_ms"] = _top(outside_names, len(steps), 8)
    # the step's own kernels that started late, by the wait before each: where the chain waited
    out["top_waits_before_ms"] = _top(late, len(steps), 6)
    return out


def _union(events: list[dict], end: float) -> list[tuple[float, float]]:
    """The events' busy time, cut at ``end``, as disjoint sorted intervals."""
    out: list[tuple[float, float]] = []
    for lo, hi in sorted((e["ts"], min(e["ts"] + e["dur"], end)) for e in events):
        if hi <= lo:
            continue
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _replays(events: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """The window's kernels and copies by start, and its CUDA-graph replays' kernels (each by start), in order."""
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") == "cuda_runtime" and e["name"].startswith("cudaGraphLaunch")}
    work = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])
    replays: dict[int, list[dict]] = {}
    for e in work:
        if e.get("args", {}).get("correlation") in launches:
            replays.setdefault(e["args"]["correlation"], []).append(e)
    order = sorted(replays.values(), key=lambda ks: ks[0]["ts"])
    if len(order) < 2:
        raise ValueError(f"the profiled window holds {len(order)} CUDA-graph replays; need at least 2")
    return work, order


def replay_timeline(events: list[dict]) -> list[list]:
    """The middle replay of the window, kernel by kernel: [start (us from its first kernel), duration (us), stream,
    kind, name cut to 60 characters], to see where the step's chain waited and on what."""
    kernels = _replays(events)[1]
    kernels = kernels[len(kernels) // 2]
    t0 = kernels[0]["ts"]
    return [[round(k["ts"] - t0, 1), round(k["dur"], 1), k.get("args", {}).get("stream"), kind_of(k["name"]),
             k["name"][:60]] for k in kernels]


def _waits(rest: list[dict], chosen: list[dict], picks: list[tuple[float, float]], late: dict[str, float]
           ) -> dict[str, float]:
    """How long a replay's non-selection kernels (``rest``, by start) waited between each other, how much of that
    right behind one of its selection kernels (``chosen``) on the waiting kernel's stream, and how much while one ran
    (``picks``, their busy intervals) on any stream (``step_profile``); each wait is added to ``late`` under the name
    of the kernel that waited."""
    picks_end: dict = {}   # stream -> end times of its selection kernels
    for k in chosen:
        picks_end.setdefault(k.get("args", {}).get("stream"), []).append(k["ts"] + k["dur"])
    gaps: list[tuple[float, float]] = []   # disjoint and in order: ``done`` only grows
    behind = 0.0
    done = rest[0]["ts"] if rest else 0.0
    for k in rest:
        gap = k["ts"] - done
        if gap > 0:
            gaps.append((done, k["ts"]))
            late[k["name"]] = late.get(k["name"], 0.0) + gap
            ends = picks_end.get(k.get("args", {}).get("stream"), ())
            if any(0 <= k["ts"] - e <= 3 for e in ends):
                behind += gap
        done = max(done, k["ts"] + k["dur"])
    return {"others_waited": _length(gaps), "others_waited_behind_selection": behind,
            "others_waited_beside_selection": _overlap(gaps, picks)}


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The time two lists of disjoint sorted intervals share."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _top(names: dict[str, float], steps: int, n: int) -> dict[str, float]:
    """The ``n`` largest of name -> total microseconds, as ms per step, names cut to 90 characters."""
    top = sorted(names.items(), key=lambda kv: -kv[1])[:n]
    return {name[:90]: round(t / steps / 1000, 4) for name, t in top}


def our_folders() -> tuple[str, ...]:
    """This package's source folders: sgl_sparsekv/ and, installed from this checkout, kernels/ and patches/."""
    import sgl_sparsekv
    import sgl_sparsekv.kernels
    import sgl_sparsekv.patches

    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + "/"
                 for m in (sgl_sparsekv, sgl_sparsekv.kernels, sgl_sparsekv.patches))


def _our_function(name: str, folders: tuple[str, ...]) -> str | None:
    """The profiler names a Python function "<file>(<line>): <name>", the file either absolute or relative to its
    sys.path entry: for one of ours, "<folder>/<file>(<line>): <name>"; None for any other."""
    for folder in folders:
        short = os.path.basename(folder.rstrip("/")) + "/"
        if name.startswith(folder):
            return short + name[len(folder):]
        if name.startswith(short):
            return name
    return None


def host_profile(events: list[dict], folders: tuple[str, ...], top: int = 25) -> dict:
    """Chrome-trace events recorded with Python stacks -> ms per name, largest first: the Python functions of
    ``folders`` (inclusive time; a recursive call counts at each level), CUDA runtime and driver calls, and the
    largest torch operators."""
    def largest(pick) -> dict:
        sums: dict[str, float] = {}
        for e in events:
            if (name := pick(e)) is not None:
                sums[name] = sums.get(name, 0.0) + e.get("dur", 0.0)
        return {n: round(t / 1000, 3) for n, t in sorted(sums.items(), key=lambda kv: -kv[1])[:top]}

    return {"python_ms": largest(lambda e: _our_function(e["name"], folders)
                                 if e.get("cat") == "python_function" else None),
            "cuda_api_ms": largest(lambda e: e["name"] if e.get("cat") in ("cuda_runtime", "cuda_driver") else None),
            "torch_ops_ms": largest(lambda e: e["name"] if e.get("cat") == "cpu_op" else None)}


def _generate(srv: Server, ids: list[int], n: int, done: list, stream: bool = False) -> None:
    if not stream:
        done.append(len(greedy(srv, ids, n)))
        return
    r = requests.post(srv.url + "/generate", timeout=900, stream=True, json=dict(
        input_ids=ids, stream=True, sampling_params=dict(max_new_tokens=n, temperature=0, ignore_eos=True)))
    r.raise_for_status()
    last = None
    for line in r.iter_lines():
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            last = json.loads(line[5:])
    done.append(last["meta_info"]["completion_tokens"])   # output_ids may be cumulative or deltas


def _trace(trace_dir: str, timeout: float = 120) -> list[dict]:
    """The events of the one trace the scheduler writes into ``trace_dir`` after its last profiled step (the file
    appears before it is complete: read until it parses)."""
    deadline = time.time() + timeout
    while True:
        try:
            with gzip.open(glob.glob(os.path.join(trace_dir, "*.trace.json.gz"))[0], "rt") as f:
                return json.load(f)["traceEvents"]
        except (IndexError, EOFError, OSError, ValueError):
            if time.time() > deadline:
                raise
            time.sleep(1)


PLUGIN_COUNTERS = ("sparse_steps", "dense_steps", "decode_host_syncs", "reused_list_steps", "decode_prepare_s",
                   "index_reused", "index_extends", "extend_chunks", "index_build_s", "build_keys_s", "build_cluster_s",
                   "build_load_s", "extend_wait_s", "num_alloc_retries", "num_device_alloc")


def _delta(before: dict, after: dict) -> dict:
    return {k: round(after[k] - before.get(k, 0), 4) for k in PLUGIN_COUNTERS if k in after}


def prompt_maker(a):
    """n -> a prompt's token ids: random ids, or (``--text``) sglang.bench_serving's generated text, tokenized."""
    rng = random.Random(0)
    if not a.text:
        return lambda n: [rng.randrange(1000, 100_000) for _ in range(n)]
    from sglang.benchmark.datasets.common import gen_prompt
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    random.seed(0)   # gen_prompt draws from the module's generator
    return lambda n: tok.encode(gen_prompt(tok, n), add_special_tokens=False)


def profile_method(srv: Server, a, name: str) -> dict:
    make = prompt_maker(a)
    prefixes = [make(a.prefix) for _ in range(2)]
    greedy(srv, list(range(100, 4100)), WARMUP_TOKENS)   # compiles the graft kernel outside the profile
    for p in prefixes:   # prefilled and cached (with lychee, indexed) before the batch arrives
        greedy(srv, p, 1)
    done: list[int] = []
    threads = [threading.Thread(target=_generate, args=(srv, prefixes[i % 2] + make(a.question), a.output_len, done,
                                                        a.stream)) for i in range(a.batch)]
    for t in threads:
        t.start()
    time.sleep(a.settle)   # every request past its extend step, decoding

    def profile(steps: int, stack: bool) -> str:
        """The trace of the next ``steps`` forward steps, in a folder of its own (a warm machine keeps /tmp)."""
        out_dir = tempfile.mkdtemp(prefix="serving-profile-")
        requests.post(srv.url + "/start_profile", timeout=60, json=dict(
            output_dir=out_dir, num_steps=steps, activities=["CPU", "GPU"], with_stack=stack,
            record_shapes=False)).raise_for_status()
        return out_dir

    before = srv.stats()
    events = _trace(profile(a.steps, False))
    out = step_profile(events)
    if a.timeline:
        with open(f"{a.out}.{name}.timeline.json", "w") as f:
            json.dump(replay_timeline(events), f)
    out["plugin_in_window"] = _delta(before, srv.stats())   # the window, and the steps until the trace was read
    if a.join:
        before = srv.stats()
        join_dir = profile(a.join_steps, True)
        greedy(srv, prefixes[0] + make(a.question), 4)
        out["join"] = host_profile(_trace(join_dir), our_folders())
        out["join"]["plugin"] = _delta(before, srv.stats())
    for t in threads:
        t.join()
    assert done == [a.output_len] * a.batch, done
    return out


def main():
    ap = method_parser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=32000)
    ap.add_argument("--question", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=1024, help="long enough to decode past both profiles")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds from sending the batch to profiling")
    ap.add_argument("--join", action="store_true", help="also profile one request joining the batch, with stacks")
    ap.add_argument("--join-steps", type=int, default=12)
    ap.add_argument("--stream", action="store_true", help="the batch's requests stream their tokens")
    ap.add_argument("--text", action="store_true", help="prompts as bench_serving's generated-shared-prefix makes them")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--backend", default="flashinfer", choices=["flashinfer", "triton"])
    ap.add_argument("--timeline", action="store_true", help="also write one replay's kernels, in order, beside "
                    "--out (OUT.METHOD.timeline.json)")
    a = ap.parse_args()
    import torch

    import sglang

    res = {"device": torch.cuda.get_device_name(), "sglang": sglang.__version__,
           "model": "Llama-3.1-8B shape, dummy weights", "settings": {k: v for k, v in vars(a).items() if k != "out"},
           "server_args": COMMON + ["--attention-backend", a.backend]}
    for name in a.methods:
        with method_server(a, name, res["server_args"]) as srv:
            res[name] = profile_method(srv, a, name)
        print(name, json.dumps(res[name]), flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
