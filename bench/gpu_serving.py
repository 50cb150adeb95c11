"""Serving on the GPU: SGLang dense FlashInfer vs --sparse-kv lychee, CUDA graphs on, dummy Llama-3.1-8B weights.

    python3 -m bench.gpu_serving --model /tmp/m8b --out $OUT/serving.json

Both servers run the FlashInfer backend with CUDA graphs (lychee wraps it: prefill and the dense
layers run on FlashInfer, the sparse layers' decode on kernels/). Per server, against one running
instance:
  - greedy tokens for a prompt within the budget (must equal dense) and one past it (reported);
  - TPOT at batch 1 per context length: a random-id prompt is prefilled and cached first, then the time of a
    2-token request is subtracted from that of a (2 + n)-token request on the cached prompt, over n tokens;
  - bench_serving workloads (``--workloads``), counting errors: ``random`` (32K random ids, ``--prompts`` at
    ``--concurrency``), ``random64`` (64 prompts at concurrency 16), ``mixed`` (48 prompts of 3.2K-32K, 512 out, at
    concurrency 16: lengths that leave the index pools in pieces), ``shared`` (2 groups x 16 requests over
    a 32K shared prefix, 256-token questions, 512 out, concurrency 16) and ``shared64_c16`` / ``shared64_c32``
    (2 groups x 32 requests, the same prefixes, at concurrency 16 and 32);
  - the plugin's counters after the workloads (index pool fill, dense fallbacks), the most requests each workload
    ran at once (``peak_running``, from the scheduler's decode log lines) and each server's KV pool in tokens
    (``kv_pool_tokens``): what bounds a workload that outgrows GPU memory. ``--kv-cache-dtype fp8_e4m3`` serves
    every method with fp8 KV (the capacity runs: ``--workloads random --prompts 32 --concurrency 32``).
Ratios are lychee (and each variant: lychee-hybrid-*, hybrid heads; lychee-fine-2, two chunks per fine cluster;
and quest, the same lifecycle with Quest's pages) over dense, from the same run on the same device. ``--tp-size 2`` /
``--dp-size 2`` serve both on two GPUs. One
method per device call fits the 10-minute limit: ``--resume`` adds this call's methods (or more of a method's
measurements) to the result of an earlier call on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time

import requests

from bench.server import Server

COMMON = ["--load-format", "dummy", "--grammar-backend", "none", "--sampling-backend", "pytorch",
          "--mem-fraction-static", "0.8", "--max-running-requests", "32", "--cuda-graph-max-bs", "32",
          "--context-length", "131072"]
KEEP = ("completed", "output_throughput", "median_tpot_ms", "mean_tpot_ms", "median_itl_ms", "mean_ttft_ms",
        "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_e2e_latency_ms")
WORKLOADS = ("random", "random64", "mixed", "shared", "shared64_c16", "shared64_c32", "capacity32", "capacity32_2k",
             "capacity126")
# lychee's served variants: config beside the budget. lychee-hybrid-*: hybrid heads with staggered roles (dummy
# weights have no attention to calibrate on; every layer keeps some retrieval heads, so no layer skips selection);
# lychee-fine-2: two chunks per fine cluster, the paper's default and ours up to 560e8bf (half the fine clusters to
# rank and store); results of that time name it lychee, and one chunk per fine cluster lychee-fine-1;
# lychee-expand-8: coarse_expand 8, fine bounds for about half the clusters at 32K; lychee-rerank-2: the two-stage
# selection (twice the budget's candidates, their keys scored, the budget's best attended); lychee-qwen-*: the role
# maps shipped for Qwen2.5-Coder-0.5B (configs/head_roles/), served on that shape (--shape qwen2.5-coder-0.5b);
# lychee-every-k: selection every k decode steps, the lists reused in between (config select_every); lychee-ahead:
# selection one step ahead, beside the attention (config select_ahead); lychee-box: fine clusters ranked by their
# tokens' key boxes (fine_bound "box", at weight 1: Quest's bound); lychee-ahead-box: both, at fine_bound's default
# weight (bench.fidelity's lychee-ahead-box-0.25); lychee-tier: the host KV tier (config host_tier) at its defaults
# (prefill chunks of 2,048 and a window pool for the 32 requests it can run; its results up to ffde855 ran
# SGLang's 8,192 and a window pool of 0.8 of the full one); lychee-tier-every-k: the tier selecting every k decode
# steps (loads only at those steps); -ahead-every-k: and ahead, the loads beside the attention on a second stream
# (lychee-ahead-every-k: the same selections without the tier); lychee-tier-capacity: the tier sized for capacity
# (docs/HOST_TIER.md, "Capacity model"): a host pool of 80 GiB (96 was killed for host memory on the lent H100,
# 128 GiB in all), as first measured (VARIANT_ARGS: SGLang's prefill chunks of 8,192 and a window pool of a tenth
# of the full one). The tier's defaults size it for capacity since (the host pool 90% of the host memory available
# beyond a 32 GiB reserve, about 74 GiB there, the window pool for the requests it runs): lychee-tier-every-4 and
# lychee-tier-ahead-every-4 on the capacity workloads
VARIANTS = {"lychee": {}, "lychee-tier": {"host_tier": True},
            **{f"lychee-tier-every-{k}": {"host_tier": True, "select_every": k} for k in (4, 8)},
            "lychee-tier-ahead-every-4": {"host_tier": True, "select_every": 4, "select_ahead": True},
            "lychee-ahead-every-4": {"select_every": 4, "select_ahead": True},
            "lychee-tier-capacity": {"host_tier": True, "select_every": 4, "host_memory_gb": 80.0},
            "lychee-hybrid-0.5": {"head_roles": "staggered-0.5"},
            "lychee-hybrid-0.25": {"head_roles": "staggered-0.25"}, "lychee-fine-2": {"fine_cluster_size": 2.0},
            "lychee-expand-8": {"coarse_expand": 8.0, "coarse_expand_min": 0}, "lychee-rerank-2": {"rerank_factor": 2},
            **{f"lychee-every-{k}": {"select_every": k} for k in (2, 4)},
            "lychee-ahead": {"select_ahead": True}, "lychee-box": {"fine_bound": "box", "radius_weight": 1.0},
            "lychee-ahead-box": {"select_ahead": True, "fine_bound": "box"},
            **{f"lychee-qwen-{m}": {"head_roles": f"qwen2.5-coder-0.5b-{m}"}
               for m in ("calibrated-0.25", "layer-sharing-0.25", "hardkuma-0.25")}}
# server flags beside COMMON
VARIANT_ARGS = {"lychee-tier-capacity": ["--swa-full-tokens-ratio", "0.1", "--chunked-prefill-size", "8192"]}
# --shape: config.json of a dummy-weight model dir made by mkmodel.py (which knows the Llama-3.1-8B shape), replaced
# by another model's shape
SHAPES = {"llama3-8b": ("Llama-3.1-8B shape, dummy weights", None),
          "qwen2.5-coder-0.5b": ("Qwen2.5-Coder-0.5B shape (24 layers, 14 q / 2 KV heads, d 64), dummy weights",
                                 dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                                      intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                      num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                                      max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                      sliding_window=None, use_sliding_window=False))}
DELTAS = ("index_builds", "index_reused", "index_extends", "grafts", "sparse_steps", "dense_steps", "index_pool_full",
          "dense_fallback_steps", "scratch_full_steps", "reused_list_steps", "unselected_steps", "own_order_steps",
          "upload_fresh_buffers",
          "decode_prepare_s", "index_build_s", "index_release_s", "decode_host_syncs", "prepare_frees_s",
          "prepare_cut_s", "prepare_place_s", "prepare_graft_s", "build_keys_s", "build_cluster_s", "build_load_s",
          "extend_wait_s", "build_chunks", "extend_chunks", "num_alloc_retries", "num_device_alloc", "num_device_free",
          # the host tier's: selected (layer, KV head) rows found and loaded, the bytes loaded, and the prefix rows
          # its prefills staged from the window pool and over the bus
          "hot_rows_hit", "hot_rows_loaded", "host_to_device_bytes", "staged_rows_near", "staged_rows_far")


def write_shape(model_dir: str, name: str) -> str:
    """Give the dummy model in ``model_dir`` (made by mkmodel.py) the shape ``name`` of SHAPES -> its label."""
    label, shape = SHAPES[name]
    if shape is not None:
        path = os.path.join(model_dir, "config.json")
        with open(path) as f:
            config = json.load(f)
        with open(path, "w") as f:
            json.dump({k: config[k] for k in ("torch_dtype", "hidden_act", "bos_token_id", "eos_token_id")} | shape, f,
                      indent=1)
    return label


def random_ids(input_len: int, output_len: int, prompts: int, range_ratio: float = 1.0) -> list[str]:
    return ["--dataset-name", "random-ids", "--random-input-len", str(input_len), "--random-output-len",
            str(output_len), "--random-range-ratio", str(range_ratio), "--num-prompts", str(prompts)]


SHARED_OUTPUT = 512   # tokens out per request of the shared-prefix workloads
WARMUP_TOKENS = 160   # past the default recent window (64 tokens) by several chunks


def shared_prefix(per_group: int) -> list[str]:
    return ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group",
            str(per_group), "--gsp-system-prompt-len", "32000", "--gsp-question-len", "256", "--gsp-output-len",
            str(SHARED_OUTPUT)]


SHARED = (shared_prefix(16), 32, 16)   # the shared-prefix workload: (dataset, prompts, concurrency)


# the scheduler's log line every decode_log_interval steps: batch size, and output tokens per second since the last
DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+),.*?gen throughput \(token/s\): ([\d.]+)")


def steady_decode(log: str, batch: int) -> dict | None:
    """Decode throughput at full batch from the server's log lines of one workload: the median (and best) of the
    lines logged with ``batch`` requests running. A line covers the steps since the one before, so one with a
    prefill among them reads low; the median is the decode rate between prefills."""
    rates = [float(t) for n, t in DECODE_LINE.findall(log) if int(n) == batch]
    if not rates:
        return None
    return {"batch": batch, "lines": len(rates), "median_tok_s": round(statistics.median(rates), 1),
            "max_tok_s": round(max(rates), 1)}


CAPTURE_LINE = re.compile(r"Capture target decode CUDA graph end\. elapsed=([\d.]+) s")
KV_POOL_LINE = re.compile(r"max_total_num_tokens=(\d+)")


def server_start(srv: Server) -> dict:
    """How long the server took to start (launch to ready) and, of that, the decode graphs' capture, where a fresh
    machine compiles the plugin's Triton kernels and, in its first server, FlashInfer's JIT modules."""
    with open(srv.log_path, errors="replace") as f:
        log = f.read()
    capture, pool = CAPTURE_LINE.search(log), KV_POOL_LINE.search(log)
    return {"ready_s": srv.ready_s, "decode_graph_capture_s": float(capture.group(1)) if capture else None,
            "kv_pool_tokens": int(pool.group(1)) if pool else None}


def serve_bench(srv: Server, dataset: list[str], prompts: int, concurrency: int, out_file: str) -> dict:
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--port", str(srv.port), *dataset,
           "--max-concurrency", str(concurrency), "--output-file", out_file]
    before = srv.stats()
    log_from = os.path.getsize(srv.log_path)   # the server writes its log itself: nothing buffered here
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(p.stdout[-1500:], p.stderr[-1500:], flush=True)
    with open(out_file) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = {k: rows[-1].get(k) for k in KEEP}
    out["errors"] = prompts - (out["completed"] or 0)   # bench_serving's result rows do not carry the prompt count
    after = srv.stats()
    out["plugin"] = {k: after[k] - before.get(k, 0) for k in DELTAS if k in after}
    out["index_pools_after"] = after.get("index_pools")
    with open(srv.log_path, errors="replace") as f:
        f.seek(log_from)
        log = f.read()
    out["steady_decode"] = steady_decode(log, concurrency)
    # the most requests the scheduler ran at once (decode log lines): what the KV pool admitted
    out["peak_running"] = max((int(n) for n, _ in DECODE_LINE.findall(log)), default=None)
    steps = out["plugin"].get("sparse_steps", 0) + out["plugin"].get("dense_steps", 0)
    if steps:
        out["host_ms_per_decode_step"] = round(1000 * out["plugin"]["decode_prepare_s"] / steps, 3)
    if rows := out["plugin"].get("hot_rows_hit", 0) + out["plugin"].get("hot_rows_loaded", 0):
        out["hot_hit_rate"] = round(out["plugin"]["hot_rows_hit"] / rows, 4)
    return out


def greedy(srv: Server, ids: list[int], n: int) -> list[int]:
    r = requests.post(srv.url + "/generate", timeout=900, json=dict(
        input_ids=ids, sampling_params=dict(max_new_tokens=n, temperature=0, ignore_eos=True)))
    r.raise_for_status()
    return r.json()["output_ids"]


def tpot_ms(srv: Server, ctx: int, n: int) -> dict:
    ids = [random.Random(ctx).randrange(1000, 100_000) for _ in range(ctx)]
    greedy(srv, ids, 2)                   # prefill; the prompt (and lychee's index of it) is now cached
    t = time.perf_counter()
    greedy(srv, ids, 2)
    short = time.perf_counter() - t
    t = time.perf_counter()
    got = greedy(srv, ids, n + 2)
    long = time.perf_counter() - t
    assert len(got) == n + 2
    return {"tpot_ms": round(1000 * (long - short) / n, 3), "cached_2_token_request_s": round(short, 3)}


def measure(srv: Server, a, name: str, out: dict, save) -> dict:
    """Fills ``out`` and calls ``save()`` after each measurement, so a call cut by its time limit keeps them."""
    # one entry per call (a resumed method starts its server again): the first on a fresh machine compiles
    out.setdefault("server_start", []).append(server_start(srv))
    out.update({"greedy_within_budget": greedy(srv, list(range(100, 1000)), 32),
                "greedy_past_budget": greedy(srv, list(range(100, 4100)), 32)})
    # a decode past the recent window grafts its first chunks: the graft kernel's first compile (about 1 s on an H100,
    # outside the CUDA graph) lands here rather than in the first timed request
    greedy(srv, list(range(100, 4100)), WARMUP_TOKENS)
    out.setdefault("tpot_bs1", {})   # a resumed method keeps what its earlier call measured
    for ctx in a.contexts:
        out["tpot_bs1"][str(ctx)] = tpot_ms(srv, ctx, a.output_len)   # str: the keys JSON gives back
        print(name, ctx, out["tpot_bs1"][str(ctx)], flush=True)
        save()
    workloads = {"random": (random_ids(32768, a.output_len, a.prompts), a.prompts, a.concurrency),
                 "random64": (random_ids(32768, a.output_len, 64), 64, 16),
                 "mixed": (random_ids(32768, 512, 48, range_ratio=0.1), 48, 16),
                 "shared": SHARED,
                 "shared64_c16": (shared_prefix(32), 64, 16),
                 "shared64_c32": (shared_prefix(32), 64, 32),
                 # issue #93's capacity workloads: more long requests than dense's KV pool holds at once; at 256
                 # out the prefills take most of dense's time (docs/HOST_TIER.md), at 2K the decode does
                 "capacity32": (random_ids(32768, 256, 32), 32, 32),
                 "capacity32_2k": (random_ids(32768, 2048, 32), 32, 32),
                 "capacity126": (random_ids(126976, 256, 8), 8, 8)}
    for w in a.workloads:
        dataset, prompts, conc = workloads[w]
        out[w] = serve_bench(srv, dataset, prompts, conc, f"{a.out}.{name}.{w}.jsonl")
        print(name, w, out[w], flush=True)
        save()
    out["stats"] = srv.stats()
    if len(ranks := srv.rank_stats()) > 1:
        out["stats_per_tp_rank"] = ranks
    return out


def ratios(dense: dict, lychee: dict) -> dict:
    """Lychee over dense for one workload (throughput: higher is better; latencies: lower is better)."""
    def r(k):
        return round(lychee[k] / dense[k], 3) if dense.get(k) and lychee.get(k) is not None else None

    steady = [w.get("steady_decode") or {} for w in (dense, lychee)]
    return {"throughput_ratio": r("output_throughput"),
            "steady_decode_ratio": round(steady[1]["median_tok_s"] / steady[0]["median_tok_s"], 3)
            if all(steady) else None,
            "median_tpot_ratio": r("median_tpot_ms"),
            "median_itl_ratio": r("median_itl_ms"), "mean_ttft_ratio": r("mean_ttft_ms"),
            "median_ttft_ratio": r("median_ttft_ms"), "p99_ttft_ratio": r("p99_ttft_ms"),
            "mean_e2e_latency_ratio": r("mean_e2e_latency_ms"), "peak_running_ratio": r("peak_running"),
            "lychee_host_ms_per_decode_step": lychee.get("host_ms_per_decode_step"),
            "lychee_decode_host_syncs": lychee.get("plugin", {}).get("decode_host_syncs"),
            "errors": {"dense": dense["errors"], "lychee": lychee["errors"]}}


def tpot_ratios(dense: dict, sparse: dict) -> dict:
    return {ctx: round(sparse["tpot_bs1"][ctx]["tpot_ms"] / dense["tpot_bs1"][ctx]["tpot_ms"], 3)
            for ctx in dense["tpot_bs1"] if ctx in sparse["tpot_bs1"]}


# lychee over dense per workload, stored under these keys
RATIO_KEYS = {"shared": "shared_prefix", "random": "random_ids", "random64": "random64", "mixed": "mixed",
              "shared64_c16": "shared64_c16", "shared64_c32": "shared64_c32", "capacity32": "capacity32",
              "capacity32_2k": "capacity32_2k", "capacity126": "capacity126"}
SUMMARY = ("greedy_equal_within_budget", "greedy_past_budget_same_tokens", "tpot_ratio_lychee_over_dense",
           *RATIO_KEYS.values())


def summarize(res: dict) -> dict:
    """Each variant, and lychee, over dense from one result (also for a result whose call was cut short after its
    measurements)."""
    if "dense" not in res:
        return res
    d = res["dense"]
    for name in (n for n in SERVED if n != "lychee" and n in res):
        res[f"{name}_over_dense"] = {"tpot_bs1": tpot_ratios(d, res[name]),
                                     **{w: ratios(d[w], res[name][w]) for w in res[name] if w in WORKLOADS and w in d}}
    if "lychee" in res:
        s = res["lychee"]
        res["greedy_equal_within_budget"] = d["greedy_within_budget"] == s["greedy_within_budget"]
        same = sum(x == y for x, y in zip(d["greedy_past_budget"], s["greedy_past_budget"]))
        res["greedy_past_budget_same_tokens"] = f"{same}/{len(d['greedy_past_budget'])}"
        res["tpot_ratio_lychee_over_dense"] = tpot_ratios(d, s)
        for w, key in RATIO_KEYS.items():
            if w in d and w in s:
                res[key] = ratios(d[w], s[w])
    return res


# every served method but dense: (--sparse-kv method, its config beside the budget)
SERVED = {**{name: ("lychee", cfg) for name, cfg in VARIANTS.items()}, "quest": ("quest", {})}


def method_parser() -> argparse.ArgumentParser:
    """The arguments of a benchmark that serves the dummy model once per method."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--methods", nargs="+", default=["dense", "lychee"], choices=["dense", *SERVED])
    return ap


def method_server(a, name: str, server_args: list[str]) -> Server:
    """The GPU server of method ``name`` (dense, lychee, a variant or quest) at ``a.budget``, logging beside
    ``a.out``."""
    method, cfg = ("off", None) if name == "dense" else (SERVED[name][0], {"token_budget": a.budget, **SERVED[name][1]})
    return Server(a.model, method, cfg, extra=server_args + VARIANT_ARGS.get(name, []), cpu=False,
                  log_path=f"{a.out}.{name}.log", timeout=900)


def main():
    ap = method_parser()
    ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 32768, 65536, 126976])
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS),
                    choices=list(WORKLOADS))
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--backend", default="flashinfer", choices=["flashinfer", "triton"],
                    help="SGLang attention backend of both servers (lychee wraps it)")
    ap.add_argument("--resume", help="result JSON of an earlier call on this machine: add this call's methods to it")
    ap.add_argument("--tp-size", type=int, default=1, help="tensor parallelism of both servers (GPUs per server)")
    ap.add_argument("--dp-size", type=int, default=1, help="data-parallel replicas of both servers")
    ap.add_argument("--kv-cache-dtype", default="auto", help="SGLang's flag, for every server (fp8_e4m3: fp8 KV)")
    ap.add_argument("--shape", default="llama3-8b", choices=list(SHAPES),
                    help="the dummy model's shape: other than llama3-8b, --model's config.json is rewritten to it")
    a = ap.parse_args()
    label = write_shape(a.model, a.shape)
    import torch

    import sglang

    res = {"device": torch.cuda.get_device_name(), "sglang": sglang.__version__,
           "model": label,
           "settings": {k: v for k, v in vars(a).items() if k not in ("out", "resume")},
           "gpus": torch.cuda.device_count(),
           "server_args": COMMON + ["--attention-backend", a.backend, "--tp-size", str(a.tp_size),
                                    "--dp-size", str(a.dp_size), "--kv-cache-dtype", a.kv_cache_dtype]}
    if a.resume:
        with open(a.resume) as f:
            prior = json.load(f)
        assert prior["device"] == res["device"] and prior["server_args"] == res["server_args"], "not the same setup"
        methods = prior["settings"]["methods"] + [m for m in a.methods if m not in prior["settings"]["methods"]]
        res = {**prior, **{k: res[k] for k in ("device", "sglang", "model", "server_args")}}
        calls = res["settings"].get("calls", []) + [{k: getattr(a, k) for k in ("methods", "contexts", "workloads")}]
        res["settings"] = {**res["settings"], "methods": methods, "calls": calls}
    def save():
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    for name in a.methods:
        with method_server(a, name, res["server_args"]) as srv:
            measure(srv, a, name, res.setdefault(name, {}), save)
        save()
    summarize(res)
    save()
    print(json.dumps({k: v for k, v in res.items() if k in SUMMARY or k.endswith("_over_dense")}))


if __name__ == "__main__":
    main()
