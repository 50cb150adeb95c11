"""Fidelity suite: RULER-style and structured-data tasks through the real SGLang server, per method and budget.

    python -m bench.fidelity --quick                      # a few samples, one budget (CI)
    python -m bench.fidelity --model smollm2 --out bench/results/fidelity_smollm2.json --plot bench/results/fidelity_smollm2.png
    python3 -m bench.fidelity --device gpu --model qwen2.5-coder-0.5b --model-dir /tmp/qwen --lengths 16000 \
        --samples 50 --concurrency 32 --out $OUT/fidelity.json   # the GPU machine, real weights (../shared/gpu)
    python -m bench.fidelity --append /work/.device/N/fidelity.json \
        bench/results/fidelity_qwen2.5-coder-0.5b_16k_gpu.json --commit C --gpu GPU-xxxxxxxx --note "..."
        # that call's runs into the committed file (refused at another length: other samples); a run from seed K on
        # (--first K, or a --methods word NAME@BUDGET:K: the rest of a run a --deadline cut at K seeds) is joined to
        # the file's run of it over seeds 0 .. K-1

Methods: off (dense), lychee, quest, lychee-fixed (16-token chunks: the structure-aware ablation), and lychee
ranking by its full upper bound, half of its radius, or the centroid's score alone (config key ``radius_weight``,
0.25 by default), lychee with two chunks per fine cluster (``fine_cluster_size`` 2, the default up to 560e8bf),
and hybrid heads (config ``head_roles``) with the model's shipped calibrated, HardKuma-learned or layer-sharing
role map, or staggered roles.
Samples come in two splits (``--split``): dev, the samples every default and option is chosen on (the seeded
streams of every result before the split), and test, other samples of the same seeds that only ever report. The
held-out record families (``bench.tasks.HELD_OUT``: tables, logs, configuration files, JSON lists, SQL dumps, call
chains, written after the defaults were chosen) serve on the test split only.
Each (method, budget) gets its own server; every sample is scored by exact match of its expected strings. Each
cell records its sample count and a 95% Wilson interval. On the GPU the server runs with CUDA graphs on
(``--attention-backend``, Triton by default) and ``--concurrency`` samples in flight, so SGLang batches them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor, wait

from bench.server import CPU_ARGS, Lineup, Server, alongside
from bench.tasks import HELD_OUT, RULER, SPLITS, STRUCTURED, TASKS, check_split, make_all

METHODS = {"off": ("off", {}), "lychee": ("lychee", {}), "quest": ("quest", {}),
           "lychee-fixed": ("lychee", {"chunking": "fixed"}),
           "lychee-upper-bound": ("lychee", {"radius_weight": 1.0}),
           "lychee-radius-0.5": ("lychee", {"radius_weight": 0.5}),
           "lychee-centroid-rank": ("lychee", {"radius_weight": 0.0}),
           "lychee-fine-2": ("lychee", {"fine_cluster_size": 2.0}),   # the default up to 560e8bf
           # half the coarse expansion: fine bounds for about half the clusters at 32K (selection_breakdown_expand)
           "lychee-expand-8": ("lychee", {"coarse_expand": 8.0, "coarse_expand_min": 0}),
           # the coarse expansion of lychee-rerank-2 at 32K, no rerank: the default since 2815376 (lychee), measured
           # under this name before; lychee-expand-16: the default up to it (lychee in the results of that time)
           "lychee-expand-32": ("lychee", {"coarse_expand": 32.0, "coarse_expand_min": 0}),
           "lychee-expand-16": ("lychee", {"coarse_expand": 16.0, "coarse_expand_min": 0}),
           # every coarse unit of a 30K prompt expanded at every budget: the default since its coarse_expand_min
           # (f7d1b88) on prompts up to 30000 tokens, and before it at budgets from 1024 up (docs.tables.targets.STAND_IN)
           "lychee-flat": ("lychee", {"coarse_expand": 1024.0}),
           # two-stage selection: twice the budget's candidates, the budget's best by the group's attention kept
           "lychee-rerank-2": ("lychee", {"rerank_factor": 2}),
           # four and eight times: on dev record lookups at 8K they keep 0.91 and 0.94 of the value's attention mass
           # where the default keeps 0.77 (experiments/record_recall.py, record_recall_qwen_8k.json)
           "lychee-rerank-4": ("lychee", {"rerank_factor": 4}),
           "lychee-rerank-8": ("lychee", {"rerank_factor": 8}),
           # the same, its coarse expansion sized for the budget alone (fine bounds for half the clusters at 32K)
           "lychee-rerank-2-expand-8": ("lychee", {"rerank_factor": 2, "coarse_expand": 8.0,
                                                   "coarse_expand_min": 0}),
           # fine clusters ranked by the box of their tokens' keys: Quest's bound (weight 1), or a quarter of it
           "lychee-box": ("lychee", {"fine_bound": "box", "radius_weight": 1.0}),
           "lychee-box-0.25": ("lychee", {"fine_bound": "box"}),
           # hybrid heads (#12): a shipped role map of the model served ({model}: the --model name), or staggered
           **{f"lychee-hybrid-{roles}": ("lychee", {"head_roles": f"{{model}}-{roles}"})
              for roles in ("calibrated-0.25", "hardkuma-0.25", "layer-sharing-0.25")},
           "lychee-hybrid-staggered-0.25": ("lychee", {"head_roles": "staggered-0.25"}),
           # selection every k decode steps, its lists reused in between with the tokens decoded since (RACC)
           **{f"lychee-every-{k}": ("lychee", {"select_every": k}) for k in (2, 4)},
           # selection one step ahead, beside the attention, with the step before's query
           "lychee-ahead": ("lychee", {"select_ahead": True}),
           # both: select_ahead's step-before query, fine clusters ranked by their boxes (does box win back its loss?)
           "lychee-ahead-box-0.25": ("lychee", {"select_ahead": True, "fine_bound": "box"}),
           # Quest's pages through lychee's config, as served before quest became a policy of the same lifecycle
           # (SparseKVConfig.quest_policy): 16-token chunks, each its own fine cluster, ranked by its key box at
           # weight 1, every coarse unit expanded; kept so its committed runs still name a method
           "quest-graphs": ("lychee", {"chunking": "fixed", "fine_bound": "box", "radius_weight": 1.0,
                                       "coarse_expand": 1024.0}),
           # lychee and quest with the live recall audit on every 8th sparse step (those steps run eagerly): their
           # runs record the share of dense attention's mass each layer group kept
           **{f"{m}-audit": (m, {"recall_audit_every": 8}) for m in ("lychee", "quest")},
           # fp8 KV (--kv-cache-dtype fp8_e4m3, SERVER_FLAGS): each method against its own bf16 run of the same call
           **{f"{m}-fp8kv": (m, {}) for m in ("off", "lychee", "quest")},
           # the host KV tier (issue #93): its answers against plain lychee's (and lychee-every-4's), its hot buffers'
           # hit rate on real weights; a host pool that leaves room for the call's other servers (a 0.5B model's
           # sparse layers take 11 KiB a token: 12 GiB hold 32 prompts of 30K)
           **{f"lychee-tier{s}": ("lychee", {"host_tier": True, "host_memory_gb": 12.0, **extra})
              for s, extra in (("", {}), ("-every-4", {"select_every": 4}),
                               ("-ahead-every-4", {"select_every": 4, "select_ahead": True}))},
           # selection every 4th step, one step ahead (the tier's loads beside the attention), without the tier
           "lychee-ahead-every-4": ("lychee", {"select_every": 4, "select_ahead": True})}
# methods served with server flags of their own (the tier: one set of hot buffers per request --concurrency sends)
SERVER_FLAGS = {**{f"{m}-fp8kv": ["--kv-cache-dtype", "fp8_e4m3"] for m in ("off", "lychee", "quest")},
                **{m: ["--max-running-requests", "32"] for m in ("lychee-tier", "lychee-tier-every-4",
                                                                 "lychee-tier-ahead-every-4")}}
CONTEXT = {"smollm2": 8192, "qwen2.5-coder-0.5b": 32768}
GPU_SERVER = ["--grammar-backend", "none", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.8",
              "--cuda-graph-max-bs", "32"]


def cell(arg: str) -> tuple[str, list[int] | None, int | None]:
    """A ``--methods`` word: a method of METHODS, served at every ``--budgets`` budget, or ``NAME@BUDGET``, one
    cell, so one call can serve the cells a sweep lacks without repeating those it has, or ``NAME@BUDGET:SEED``, that
    cell from seed SEED on (the rest of a run a deadline cut there), so one call can finish runs cut at different
    seeds."""
    name, _, rest = arg.partition("@")
    budget, colon, start = rest.partition(":")
    if name not in METHODS or (budget and not budget.isdigit()) or (budget and name == "off") \
            or (colon and not (budget and start.isdigit())):
        raise ValueError(f"--methods: {arg!r} is not a method ({', '.join(METHODS)}), METHOD@BUDGET or "
                         "METHOD@BUDGET:SEED")
    return name, [int(budget)] if budget else None, int(start) if colon else None


def method_arg(arg: str) -> str:
    try:
        cell(arg)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--methods: ")) from None
    return arg


def dumps(obj, depth: int = 0) -> str:
    """JSON as ``indent=1`` writes it, except that a list or dict of plain values stays on one line: a result keeps
    per sample its failed seeds, digests and margins, which one per line made most of a 16K file's 464 KB."""
    pad = " " * (depth + 1)
    if isinstance(obj, dict) and any(isinstance(v, (dict, list)) for v in obj.values()):
        inner = (f"{pad}{json.dumps(k)}: {dumps(v, depth + 1)}" for k, v in obj.items())
        return "{\n" + ",\n".join(inner) + "\n" + " " * depth + "}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(pad + dumps(v, depth + 1) for v in obj) + "\n" + " " * depth + "]"
    return json.dumps(obj)


def write(obj, path: str) -> None:
    with open(path, "w") as f:
        f.write(dumps(obj) + "\n")


def wilson(correct: int, n: int, z: float = 1.96) -> list[float]:
    """95% Wilson score interval of a success rate (well behaved at 0 and n, unlike the normal approximation)."""
    if n == 0:
        return [0.0, 1.0]
    p = correct / n
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


def digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:8]


# logits: a right answer held by less turns on a near tie, which bf16 noise or the batch a request lands in can flip
# (answer_margin_qwen_8k_losses.json: most of what lychee lost at 8K were ties of 0.03-0.36)
FIRM = 0.5


def held_by(sample, choice: dict) -> float | None:
    """``sample.held_by`` of a completion asked for 2 logprobs."""
    lp = choice["logprobs"]
    # two top tokens with one text collapse to one entry: that gap is unknown
    gaps = [b[0] - b[1] if len(b := sorted((top or {}).values(), reverse=True)) >= 2 else None
            for top in lp["top_logprobs"]]
    return sample.held_by(lp["tokens"], gaps)


def ends(results: list[dict]) -> dict:
    """(method, budget) -> the seed after the last one served by any run of it in ``results`` (earlier calls' --out)."""
    out = {}
    for res in results:
        for r in res["runs"]:
            end = r.get("first_seed", res.get("first_seed", 0)) + per_task(r)
            out[r["method"], r["budget"]] = max(end, out.get((r["method"], r["budget"]), 0))
    return out


def run(model: str, model_dir: str, methods, budgets, tasks, lengths, samples, max_tokens=24, save=None,
        gpu_backend: str | None = None, concurrency: int = 1, cuda_graph: bool = True, tp_size: int = 1,
        first: int = 0, parallel: int = 1, deadline: float | None = None, after: dict | None = None,
        rope_scale: float = 1.0, split: str = "dev") -> dict:
    """Score every (method, budget) on the seeded samples ``first .. first + samples - 1`` of each task (a
    ``NAME@BUDGET:SEED`` word: from SEED on, its run saying so in ``first_seed``; ``after`` ((method, budget) ->
    seed, ``ends`` of earlier calls): from that seed on where it is later); ``save(res)`` is called after
    each, so a long run keeps what it finished. At ``deadline`` (a ``time.time()``) no more samples are sent: each
    run keeps the seeds every task finished (its first .. first + kept - 1), its ``samples`` saying how many, so a
    device call cut short still returns what it served and ``extend`` can add the rest.
    ``gpu_backend``: serve on the GPU with this attention backend (CUDA graphs on); else on the CPU.
    ``tp_size``: tensor parallelism on the GPU. ``parallel``: servers at work at once on the one GPU, each with
    its KV pool capped (``bench.server.alongside``). Each answer's digest is kept, so two runs of the same samples
    (say TP 1 and TP 2) can be compared answer by answer. ``rope_scale``: ``model_dir`` is the model with its RoPE
    stretched that many times (``sgl_sparsekv.models.stretched``), served at that many times its context.
    ``split``: "dev", the samples defaults are chosen on, or "test", other samples of the same seeds that only
    report; the held-out task families (``tasks.HELD_OUT``) are served on the test split only."""
    check_split(split, tasks)
    seeds = {}   # (name, budget) -> the seeds its run serves
    for name, own, start in map(cell, methods):
        for budget in ([None] if METHODS[name][0] == "off" else own or budgets):
            begin = max(first if start is None else start, (after or {}).get((name, budget), 0))
            seeds[name, budget] = range(begin, first + samples)
            if not seeds[name, budget]:
                print(f"{name}@{budget}: seeds {first}-{first + samples - 1} already served", flush=True)
    seeds = {key: r for key, r in seeds.items() if r}
    every = sorted({s for r in seeds.values() for s in r})
    keys = [(t, n, s) for t in tasks for n in lengths for s in every]
    # a few samples are drawn here; a device call's hundreds of long ones on every core (see make_all)
    drawn = make_all(model_dir, keys, workers=min(16, os.cpu_count() or 1) if len(keys) * max(lengths) > 2e6 else 1,
                     split=split)
    data = {t: {n: {s: drawn[t, n, s] for s in every} for n in lengths} for t in tasks}
    # servers side by side (two on the CPU, a Lineup; --parallel on a GPU): each KV pool capped at what its samples
    # in flight need. On the CPU two pools of 65,536 fp32 tokens took 6 GB each, and CI's 24 GB lost a server to
    # the OOM killer
    capped = ["--max-total-tokens", str(concurrency * (max(lengths) + 1024))]
    if gpu_backend:
        import torch

        device, server = torch.cuda.get_device_name(), GPU_SERVER + ["--attention-backend", gpu_backend]
        if parallel > 1:
            server = server + capped
    else:
        device, server = f"CPU ({platform.machine()})", capped
    server = server + ["--context-length", str(int(CONTEXT.get(model, 8192) * rope_scale))] + (
        ["--tp-size", str(tp_size)] if tp_size > 1 else [])
    res = {"model": model, **({"rope_scale": rope_scale} if rope_scale != 1 else {}), "split": split, "device": device,
           "lengths": lengths, "samples": samples, "first_seed": first,
           "budgets": budgets, "tasks": list(tasks), "server_args": server if gpu_backend else CPU_ARGS + server,
           "runs": [], **({"servers_alongside": parallel} if parallel > 1 else {})}
    servers, eager = {}, {}
    for name, budget in seeds:
        method, extra = METHODS[name]
        cfg = None if method == "off" else {"token_budget": budget, **{
            k: v.format(model=model) if isinstance(v, str) else v for k, v in extra.items()}}
        eager[name, budget] = bool(gpu_backend) and not cuda_graph
        args = server + SERVER_FLAGS.get(name, []) + (["--disable-cuda-graph"] if eager[name, budget] else [])
        servers[name, budget] = Server(model_dir, method, cfg, extra=args, cpu=not gpu_backend)

    def score(name, budget, srv, pool) -> dict | None:
        scores, counts = {}, {}
        # every cell's samples in one queue, so the batch stays full where a task's last samples finish; seed by seed,
        # so at the deadline the finished samples are the first seeds of every cell
        def ask(sample):
            return srv.complete(sample.prompt, max_tokens, logprobs=2)["choices"][0]

        own = seeds[name, budget]
        asked = {(t, n, s): pool.submit(ask, data[t][n][s]) for s in own for t in tasks for n in lengths}
        if deadline is not None:
            wait(asked.values(), timeout=max(0.0, deadline - time.time()))
            for f in asked.values():
                f.cancel()   # those not sent yet; the requests in flight finish
        kept = next((i for i, s in enumerate(own) for t in tasks for n in lengths if asked[t, n, s].cancelled()),
                    len(own))
        if kept == 0:
            print(f"{name}@{budget}: the deadline came before every task finished seed {own.start}: nothing kept",
                  flush=True)
            return None
        served = own[:kept]
        for t in tasks:
            for n in lengths:
                got = [asked[t, n, s].result() for s in served]
                texts = [c["text"] for c in got]
                done = [data[t][n][s].score(text) for s, text in zip(served, texts)]
                k = sum(done)
                scores[f"{t}@{n}"] = k / len(done)
                # the failed seeds let two methods be compared sample by sample; held_by (seed -> margin, for the
                # right answers) tells an answer lost to a near tie from one that dense wrote firmly
                held = {str(s): held_by(data[t][n][s], c) for s, c, ok in zip(served, got, done) if ok}
                counts[f"{t}@{n}"] = {"correct": k, "n": len(done), "ci95": wilson(k, len(done)),
                                      "failed": [s for s, ok in zip(served, done) if not ok],
                                      "digests": [digest(text) for text in texts], "held_by": held}
        stats = srv.stats()
        kv = stats["attended_tokens"] / stats["context_tokens"] if stats.get("context_tokens") else 1.0
        return {"method": name, "budget": budget, "scores": scores, "counts": counts, "kv_read": round(kv, 4),
                **({"keys_scored": round(stats["scored_tokens"] / stats["context_tokens"], 4)}
                   if stats.get("scored_tokens") else {}),
                **({"recall_audit": stats["recall_audit"]} if "recall_audit" in stats else {}),
                **({"hot_rows_hit_loaded": [stats["hot_rows_hit"], stats["hot_rows_loaded"]]}
                   if "hot_rows_hit" in stats else {}),
                "cuda_graph": bool(gpu_backend) and not eager[name, budget],
                **({"samples": kept} if kept < samples else {}),
                **({"first_seed": own.start} if own.start != first else {})}

    def record(run_: dict | None, seconds: float) -> None:
        if run_ is None:
            return
        run_["seconds"] = round(seconds, 1)
        res["runs"].append(summarize(run_))
        res["runs"].sort(key=lambda r: order.index((r["method"], r["budget"])))   # alongside: as they end
        print(json.dumps(brief(run_)), flush=True)
        if save:
            save(res)

    order = list(servers)
    if parallel > 1:
        def work(key, srv):
            t0 = time.time()
            with ThreadPoolExecutor(concurrency) as pool:
                return score(*key, srv, pool), time.time() - t0 + srv.ready_s   # its start included, as below

        # the eager servers first, so the last wave is not one of them alone: at 16K an eager quest run took 160-206
        # s where lychee's took 102-108 (fidelity_qwen2.5-coder-0.5b_16k_structured_budgets_gpu.json)
        first_eager = dict(sorted(servers.items(), key=lambda item: not eager[item[0]]))
        for _, (run_, seconds) in alongside(first_eager, work, parallel, until=deadline):
            record(run_, seconds)
        return res
    with Lineup(servers, ahead=0 if gpu_backend else 1) as lineup:
        for name, budget in servers:
            t0 = time.time()
            if deadline is not None and t0 >= deadline:
                break
            # the pool closes last: stopped mid-run (SIGTERM), the server goes first and the requests in flight
            # fail at once, instead of the pool waiting out their timeouts before the server is stopped
            with ThreadPoolExecutor(concurrency) as pool, lineup.take((name, budget)) as srv:
                run_ = score(name, budget, srv, pool)
            record(run_, time.time() - t0)
    return res


def brief(run_: dict) -> dict:
    """A run as one short line of a device call's output (whose tail is all that comes back): right answers per cell
    and in all, without the digests, seeds and margins the result file keeps."""
    right = {cell: c["correct"] for cell, c in run_["counts"].items()}
    return {"method": run_["method"], "budget": run_["budget"], "right": right, "total": sum(right.values()),
            "of": sum(c["n"] for c in run_["counts"].values()),
            **{k: run_[k] for k in ("kv_read", "seconds", "cuda_graph") if k in run_}}


def summarize(run_: dict) -> dict:
    """``run_`` with its task groups' mean scores (ruler, structured, passkey)."""
    for group, names in (("ruler", RULER), ("structured", STRUCTURED), ("passkey", ("passkey",))):
        vals = [v for k, v in run_["scores"].items() if k.split("@")[0] in names]
        if vals:
            run_[group] = sum(vals) / len(vals)
    return run_


def per_task(run: dict) -> int:
    """A run's samples per task and length (its smallest cell's)."""
    return min(c["n"] for c in run["counts"].values())


def extend(a: dict, b: dict) -> dict:
    """One run of a (method, budget) from two runs of it over consecutive seeds (``b``'s first seed is where ``a``'s
    samples end): counts, failed seeds and digests joined per cell, scores and intervals recomputed."""
    assert run_key(a) == run_key(b) and a["counts"].keys() == b["counts"].keys(), (run_key(a), run_key(b))
    counts = {}
    for cell, x in a["counts"].items():
        y = b["counts"][cell]
        k, n = x["correct"] + y["correct"], x["n"] + y["n"]
        counts[cell] = {"correct": k, "n": n, "ci95": wilson(k, n), "failed": x["failed"] + y["failed"],
                        "digests": x["digests"] + y["digests"],
                        **({"held_by": x["held_by"] | y["held_by"]} if "held_by" in x and "held_by" in y else {})}
    scores = {cell: c["correct"] / c["n"] for cell, c in counts.items()}
    na, nb = per_task(a), per_task(b)
    kv = (a["kv_read"] * na + b["kv_read"] * nb) / (na + nb)
    return summarize({**a, "scores": scores, "counts": counts, "kv_read": round(kv, 4),
                      "seconds": round(a["seconds"] + b["seconds"], 1), "samples": na + nb})


def append(new: dict, committed: dict, **fields) -> dict:
    """``committed`` with ``new``'s runs (a device call's result) added, each labelled with its device, tasks, sample
    count, servers side by side and ``fields`` (commit, gpu, note). Refused unless both hold the same model and
    lengths: the runs of a file are compared sample by sample against its dense run, so another length (16384 in a
    16000 file: the same seeds, other samples) would be paired with samples it never saw. A run that starts past
    seed 0 (``--first`` or a ``NAME@BUDGET:SEED`` word, say the rest of a run a deadline cut) is joined (``extend``)
    to the file's latest run of its (method, budget) whose seeds end where it starts; that run stays, and the joined
    one is added after it."""
    for key in ("model", "lengths"):
        if new[key] != committed[key]:
            raise ValueError(f"{key} {new[key]} against the file's {committed[key]}: not the same samples")
    if new.get("split", "dev") != committed.get("split", "dev"):   # files from before the split hold dev samples
        raise ValueError(f"split {new.get('split', 'dev')} against the file's {committed.get('split', 'dev')}: not "
                         "the same samples")
    if new.get("rope_scale", 1) != committed.get("rope_scale", 1):
        raise ValueError(f"RoPE stretched {new.get('rope_scale', 1)} times against the file's "
                         f"{committed.get('rope_scale', 1)}: not the same model")
    runs = []
    for run in new["runs"]:
        run = {**run, "device": new["device"], "samples": run.get("samples", new["samples"]), "tasks": new["tasks"],
               **({"servers_alongside": new["servers_alongside"]} if "servers_alongside" in new else {}), **fields}
        first = run.pop("first_seed", new.get("first_seed", 0))
        runs.append(joined(committed["runs"], run, first) if first else run)
    return {**committed, "runs": committed["runs"] + runs}


def joined(runs: list, later: dict, first: int) -> dict:
    """``later`` (seeds from ``first`` on) joined to the latest of ``runs`` of its (method, budget) over seeds
    0 .. first - 1, labelled with both runs' commits, cards and devices where they differ."""
    before = [r for r in runs if run_key(r) == run_key(later) and per_task(r) == first   # as frontier --missing counts
              and r["counts"].keys() == later["counts"].keys()]
    if not before:
        raise ValueError(f"{run_key(later)} starts at seed {first}: the file has no run of it over seeds 0-{first - 1}")
    earlier = before[-1]
    both = extend(earlier, later)
    for key in ("commit", "gpu", "device"):
        if key in earlier and earlier[key] != later.get(key):
            both[key] = f"{earlier[key]} + {later[key]}"
    return {**both, "note": f"seeds 0-{first - 1} from the run of {earlier['commit']}; the rest: {later.get('note')}"}


def discordant(dense: dict, counts: dict):
    """Per cell both runs scored with the same seeds: (cell, seeds dense got right and the run got wrong, seeds the
    run got right and dense got wrong)."""
    for cell in dense.keys() & counts.keys():
        if dense[cell]["n"] == counts[cell]["n"]:
            d, c = set(dense[cell]["failed"]), set(counts[cell]["failed"])
            yield cell, c - d, d - c


def paired(dense: dict, counts: dict) -> tuple[int, int]:
    """Sample by sample over the cells both runs scored with the same seeds: (answers dense got right and the run
    got wrong, answers the run got right and dense got wrong)."""
    pairs = [(len(lost), len(gained)) for _, lost, gained in discordant(dense, counts)]
    return sum(x for x, _ in pairs), sum(y for _, y in pairs)


def lost_firm(dense: dict, counts: dict) -> int | None:
    """Of the answers dense got right and the run got wrong (``paired``), those dense held by at least ``FIRM``;
    None where dense's run did not record how firmly (results before held_by)."""
    if not all("held_by" in c for c in dense.values()):
        return None
    return sum((dense[cell]["held_by"].get(str(seed)) or 0) >= FIRM
               for cell, lost, _ in discordant(dense, counts) for seed in lost)


def sign_test(lost: int, gained: int) -> float:
    """Two-sided exact sign test (McNemar's) of ``lost`` against ``gained`` discordant samples."""
    n, k = lost + gained, min(lost, gained)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


def shared(counts_a: dict, counts_b: dict) -> dict:
    """How many samples two runs' counts (cell -> digests) both answered with the same text."""
    same = total = 0
    for cell in counts_a.keys() & counts_b.keys():
        pairs = list(zip(counts_a[cell].get("digests", []), counts_b[cell].get("digests", [])))
        same += sum(x == y for x, y in pairs)
        total += len(pairs)
    return {"same": same, "of": total}


def run_key(run: dict) -> str:
    return f"{run['method']}@{run['budget']}"


def runs_by_key(res: dict) -> dict:
    return {run_key(r): r["counts"] for r in res["runs"]}


def total_with_interval(counts: dict) -> str:
    """A run's answers right over all its cells, with the 95% Wilson interval: ``ok/n (lo-hi)``."""
    ok, n = sum(v["correct"] for v in counts.values()), sum(v["n"] for v in counts.values())
    lo, hi = wilson(ok, n)
    return f"{ok}/{n} ({lo:.2f}-{hi:.2f})"


def same_answers(a: dict, b: dict) -> dict:
    """Per (method, budget) run in both results: how many of the samples they share got the same answer text
    (say TP 1 against TP 2, or the CPU against the GPU, on the same seeded samples)."""
    ra, rb = runs_by_key(a), runs_by_key(b)
    return {key: shared(ra[key], rb[key]) for key in sorted(ra.keys() & rb.keys())}


def same_as_dense(res: dict) -> dict:
    """Per sparse (method, budget) run: how many of its answers are the dense run's answer, text for text."""
    runs = runs_by_key(res)
    dense = runs.pop("off@None", None)
    return {} if dense is None else {key: shared(dense, c) for key, c in sorted(runs.items())}


def compare(a: dict, b: dict, labels=("a", "b")) -> dict:
    """Two results of the same seeded samples (say TP 1 and TP 2): the answers they share per run, and within each
    result the answers its sparse runs share with its dense run."""
    return {"labels": list(labels), "same_answers": same_answers(a, b),
            "same_as_dense": {labels[0]: same_as_dense(a), labels[1]: same_as_dense(b)},
            "results": {labels[0]: a, labels[1]: b}}


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = res["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(3 * len(tasks), 3), sharey=True)
    for ax, t in zip(axes, tasks):
        dense = [r for r in res["runs"] if r["method"] == "off"]
        for name in sorted({r["method"] for r in res["runs"]} - {"off"}):
            runs = sorted((r for r in res["runs"] if r["method"] == name), key=lambda r: r["budget"])
            ys = [sum(v for k, v in r["scores"].items() if k.startswith(t + "@")) / len(res["lengths"]) for r in runs]
            ax.plot([r["budget"] for r in runs], ys, marker="o", label=name)
        if dense:
            y = sum(v for k, v in dense[0]["scores"].items() if k.startswith(t + "@")) / len(res["lengths"])
            ax.axhline(y, color="k", linestyle="--", label="dense")
        ax.set_title(t, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget")
    axes[0].set_ylabel("accuracy")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"{res['model']}: accuracy vs token budget ({res['samples']} samples x lengths {res['lengths']})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--methods", nargs="+", default=None, type=method_arg,
                    help="default: off lychee quest lychee-fixed (--quick: off lychee); the ranking variants "
                         "run only when named; METHOD@BUDGET: that one budget; METHOD@BUDGET:SEED: that cell from "
                         "seed SEED up to --samples")
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--tasks", nargs="+", choices=list(TASKS), default=None,
                    help="default: every task of the split (the held-out families on the test split only)")
    ap.add_argument("--split", choices=SPLITS, default="dev",
                    help="dev: the samples defaults are chosen on; test: other samples of the same seeds, to report")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2000, 6000])
    ap.add_argument("--samples", type=int, default=5, help="samples per task and length (10 tasks: 50 is 500 in all)")
    ap.add_argument("--first", type=int, default=0, help="the first sample's seed (to add samples to a result)")
    ap.add_argument("--after", nargs="+", default=[], metavar="RESULT",
                    help="earlier calls' --out: each cell starts at the seed after the last one they served of it, "
                    "so calls sent together continue one another wherever a deadline cut the one before")
    ap.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                    help="after this long, send no more samples: each run keeps the seeds every task finished")
    ap.add_argument("--quick", action="store_true", help="dense and lychee, 2 samples, budget 256, 1K tokens, 3 tasks, "
                    "all 6 of a server's samples in flight at once")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--attention-backend", default="triton", help="on the GPU: the backend dense runs on and "
                    "lychee wraps")
    ap.add_argument("--concurrency", type=int, default=1, help="samples in flight at once (batched by SGLang)")
    ap.add_argument("--disable-cuda-graph", action="store_true", help="on the GPU: serve every method eagerly")
    ap.add_argument("--tp-size", type=int, default=1, help="on the GPU: tensor parallelism of every server")
    ap.add_argument("--parallel", type=int, default=1, help="on one GPU: servers at work at once (a small model "
                    "leaves the GPU idle through most of a server's start and much of its serving)")
    ap.add_argument("--rope-scale", type=float, default=1.0, metavar="FACTOR",
                    help="serve the model with its RoPE stretched FACTOR times by YaRN, at FACTOR times its context "
                         "(Qwen2.5-Coder-0.5B past its 32K)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--compare", nargs=2, metavar="RESULT",
                    help="how many answers two results share, per run, and each sparse run with its dense run; with "
                         "--out, both results and the comparison are written there")
    ap.add_argument("--labels", nargs=2, default=("a", "b"), help="with --compare: the two results' names")
    ap.add_argument("--append", nargs=2, metavar=("RESULT", "FILE"),
                    help="add RESULT's runs (a device call's --out) to the committed FILE, labelled with --commit, "
                         "--gpu and --note; refused where the model or lengths differ")
    ap.add_argument("--commit", help="with --append: the commit the runs ran at")
    ap.add_argument("--gpu", help="with --append: the card's id (GPU-xxxxxxxx)")
    ap.add_argument("--note", help="with --append: what the runs are, in a sentence")
    a = ap.parse_args()
    if a.compare:
        with open(a.compare[0]) as f, open(a.compare[1]) as g:
            both = compare(json.load(f), json.load(g), a.labels)
        print(json.dumps({k: v for k, v in both.items() if k != "results"}, indent=1))
        if a.out:
            write(both, a.out)
        return
    if a.append:
        if not (a.commit and a.gpu and a.note):
            ap.error("--append needs --commit, --gpu and --note")
        with open(a.append[0]) as f, open(a.append[1]) as g:
            new, committed = json.load(f), json.load(g)
        try:
            merged = append(new, committed, commit=a.commit, gpu=a.gpu, note=a.note)
        except ValueError as e:
            ap.error(f"--append {a.append[0]} {a.append[1]}: {e}")
        write(merged, a.append[1])
        return
    if a.methods is None:
        a.methods = ["off", "lychee"] + ([] if a.quick else ["quest", "lychee-fixed"])
    if a.first and any(cell(word)[2] is not None for word in a.methods):
        ap.error("--first and METHOD@BUDGET:SEED words: each run's first seed is said once")
    if a.parallel > 1 and (a.device != "gpu" or a.tp_size > 1):
        ap.error("--parallel runs servers side by side on one GPU: it needs --device gpu and --tp-size 1")
    if a.quick:
        # every sample of a server in flight at once: SGLang batches their decode steps (CI's CPU time is the servers')
        a.budgets, a.lengths, a.samples, a.concurrency = [256], [1000], 2, 6
        a.tasks = ["passkey", "niah_multikey", "json_value"]
    if a.tasks is None:
        a.tasks = [t for t in TASKS if a.split == "test" or t not in HELD_OUT]
    try:
        check_split(a.split, a.tasks)
    except ValueError as e:
        ap.error(f"{e} (--split test)")
    after = []
    for path in a.after:
        if not os.path.exists(path):
            ap.error(f"--after {path}: no such result (on the device: a fresh machine keeps no earlier call's)")
        with open(path) as f:
            after.append(json.load(f))

    from sgl_sparsekv.models import prepare, stretched

    model_dir = a.model_dir or f"models/{a.model}"
    if not (a.model_dir and os.path.exists(os.path.join(model_dir, "config.json"))):   # a ready HF dir is used as is
        prepare(a.model, model_dir)
    if a.rope_scale != 1:
        model_dir = str(stretched(model_dir, a.rope_scale))

    def save(res):
        if a.out:
            write(res, a.out)

    res = run(a.model, model_dir, a.methods, a.budgets, a.tasks, a.lengths, a.samples, save=save,
              gpu_backend=a.attention_backend if a.device == "gpu" else None, concurrency=a.concurrency,
              cuda_graph=not a.disable_cuda_graph, tp_size=a.tp_size, first=a.first, parallel=a.parallel,
              deadline=None if a.deadline is None else time.time() + a.deadline, after=ends(after),
              rope_scale=a.rope_scale, split=a.split)
    if a.plot:
        plot(res, a.plot)


if __name__ == "__main__":
    main()
