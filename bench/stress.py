"""Stress run: --sparse-kv lychee under mixed load, aborts and memory pressure, checked back to idle.

    python3 -m bench.stress --model /tmp/m8b --out $OUT/stress.json                  # < 10 minutes on an H100
    python3 -m bench.stress --model /tmp/tiny --size small --out /tmp/stress.json    # the `-m gpu` test
    python3 -m bench.stress --model /tmp/tiny --size small --tp-size 2 --out /tmp/stress.json   # two GPUs
    python3 -m bench.stress --model /tmp/tiny --size small --page-size 16 --out /tmp/stress.json  # paged KV
    python3 -m bench.stress --model /tmp/tiny --size small --kv-cache-dtype fp8_e4m3 --out /tmp/stress.json  # fp8 KV
    python3 -m bench.stress --model /tmp/tiny --size small --recall-audit-every 4 --out /tmp/stress.json  # the audit
    python3 -m bench.stress --model models/smollm2 --size cpu --host-tier 256 --out /tmp/stress.json  # CI's test

One lychee server (on the GPU with CUDA graphs captured up to a batch of 8, so larger batches run eagerly; a KV pool
small enough that the radix cache evicts and SGLang retracts requests) gets, from many client threads: prompts of
random token ids (1K-64K; 1K-4K with ``--size small``; 512-2K at budget 256 on the CPU), half of them over two
shared prefixes (32K, 2K, 1K), each with a question of its own (its index adopted as a shared segment);
``max_new_tokens`` 1 and long; streamed requests whose client disconnects mid-decode and requests aborted through
``/abort_request``; some asking for dense decoding or a budget of their own (``custom_params``). It passes when every request that was not aborted returns all its tokens, the server stays
healthy, and once traffic ends ``/server_info`` reads idle without any further request (no live request state, no
pool row in use, every unit reference accounted for) and empty after ``/flush_cache``, on every TP rank, and the
ranks cut and grafted the same units. Greedy tokens of prompts within the budget must be the same after the load as
before it, and (on the GPU, with CUDA graphs) a dense server's; on the CPU the e2e suite compares them with dense.
With the host tier on the GPU, greedy tokens of two prompts past the budget must equal a plain lychee server's.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from bench.server import Server

# per size: prompt lengths (the last but one is the shared prefixes'), requests, client threads, output lengths,
# budget, KV pool and context in tokens
SIZES = {"full": dict(lengths=[1024, 4096, 16384, 32768, 65536], requests=72, concurrency=24, outs=[16, 64, 256],
                      budget=1024, pool=262144, context=70000),
         "small": dict(lengths=[1024, 2048, 4096], requests=24, concurrency=24, outs=[16, 64, 256], budget=1024,
                       pool=40000, context=70000),
         # the CPU engine: SmolLM2 (8K context); 8 requests of up to 2K run at once over a pool of 8K tokens, and 96
         # new tokens take a request past its recent window (64) into grafts. 10 requests hold every kind of request
         # and of custom_params at least once (CI's CPU time: 16 took 490 s of one core, 12 about 340 s)
         "cpu": dict(lengths=[512, 1024, 2048], requests=10, concurrency=8, outs=[16, 96], budget=256, pool=8192,
                     context=4096)}


def server_args(size: str, tp_size: int = 1, page_size: int = 1, kv_dtype: str = "auto") -> list[str]:
    z = SIZES[size]
    common = ["--tp-size", str(tp_size), "--page-size", str(page_size), "--max-running-requests", "32",
              "--max-total-tokens", str(z["pool"]), "--context-length", str(z["context"]), "--enable-metrics",
              "--kv-cache-dtype", kv_dtype]
    if size == "cpu":   # bench.server.CPU_ARGS: the CPU engine, torch_native, real weights
        return common
    return common + ["--load-format", "dummy", "--grammar-backend", "none", "--sampling-backend", "pytorch",
                     "--attention-backend", "triton", "--cuda-graph-max-bs", "8", "--mem-fraction-static", "0.8"]


def plan(seed: int, size: str) -> list[dict]:
    z = SIZES[size]
    rng = random.Random(seed)
    lengths = z["lengths"]
    prefixes = [[rng.randrange(1000, 30_000) for _ in range(lengths[-2])] for _ in range(2)]
    jobs = []
    for i in range(z["requests"]):
        if i % 2:   # a prefix and a question of its own: the prefix is over 3/4 of the prompt, so its index is adopted
            prefix = prefixes[i % 4 // 2]
            ids = prefix + [rng.randrange(1000, 30_000) for _ in range(rng.randrange(16, len(prefix) // 4))]
        else:
            ids = [rng.randrange(1000, 30_000) for _ in range(rng.choice(lengths))]
        kind = rng.choice(["complete", "complete", "one", "disconnect", "abort"])
        out = 1 if kind == "one" else rng.choice(z["outs"])
        # a quarter of the requests ask for dense decoding, a quarter for half the budget (custom_params)
        asked = [None, "off", None, {"token_budget": z["budget"] // 2}][i // 2 % 4]
        jobs.append({"i": i, "ids": ids, "kind": kind, "max_new_tokens": out, "sparse_kv": asked})
    return jobs


def run_job(url: str, job: dict) -> dict:
    body = {"input_ids": job["ids"], "rid": f"stress-{job['i']:05d}",  # fixed width: SGLang aborts by rid prefix
            "sampling_params": {"max_new_tokens": job["max_new_tokens"], "temperature": 0, "ignore_eos": True}}
    if job.get("sparse_kv") is not None:
        body["sampling_params"]["custom_params"] = {"sparse_kv": job["sparse_kv"]}
    t0 = time.perf_counter()
    res = {"i": job["i"], "kind": job["kind"], "len": len(job["ids"])}
    try:
        if job["kind"] == "disconnect":
            body["stream"] = True
            with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
                r.raise_for_status()
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 3:
                        break   # closing the connection mid-decode makes SGLang abort the request
            res["ok"] = True
        elif job["kind"] == "abort":
            timer = threading.Timer(0.5 + random.random(), lambda: requests.post(
                url + "/abort_request", json={"rid": body["rid"]}, timeout=30))
            timer.start()
            r = requests.post(url + "/generate", json=body, timeout=600)
            timer.join()
            res["ok"] = r.status_code in (200, 400)   # finished first, or aborted
        else:
            r = requests.post(url + "/generate", json=body, timeout=600)
            r.raise_for_status()
            got = len(r.json()["output_ids"])
            res["ok"] = got == job["max_new_tokens"]
            res["tokens"] = got
    except Exception as e:   # noqa: BLE001 - every failure is recorded, not raised
        res["ok"] = False
        res["error"] = repr(e)[:300]
    res["s"] = round(time.perf_counter() - t0, 2)
    return res


def wait_idle(srv: Server, timeout: float = 30) -> list[dict]:
    """Every TP rank's stats once all read idle, polling /server_info only (no request that could apply frees)."""
    deadline = time.time() + timeout
    while True:
        ranks = srv.rank_stats()
        if all(st.get("live_requests") == 0 for st in ranks) or time.time() > deadline:
            return ranks
        time.sleep(0.5)


def idle_checks(ranks: list[dict], flushed: list[dict]) -> dict:
    return {
        "no_live_request_state": all(st["live_requests"] == 0 for st in ranks),
        "no_pool_rows_in_use": all(p["used"] == 0 for st in ranks for p in st["index_pools"].values()),
        "no_unplaced_requests": all(st["unplaced_requests"] == 0 for st in ranks),
        "unit_refs_accounted": all(st["unit_refs_unaccounted"] == 0 for st in ranks),
        "empty_after_flush": all(st["live_units"] == 0 and st["cached_indexes"] == 0
                                 and st["unit_refs_unaccounted"] == 0 for st in flushed),
        # the host tier's rows and window slots are SGLang's KV slots: none is held once the cache is flushed
        "host_tier_empty_after_flush": all(st.get("host_rows_used", 0) == 0 and st.get("window_slots_used", 0) == 0
                                           for st in flushed),
        # chunk cuts depend on token ids only: every TP rank cuts, builds and grafts the same units
        "ranks_agree": len({(st["units_built"], st["index_builds"], st["grafts"]) for st in ranks}) == 1,
    }


def greedy_short(srv: Server, seed: int, budget: int) -> list[list[int]]:
    """Greedy tokens of three prompts that stay within the budget with their 32 new tokens."""
    rng = random.Random(seed)
    out = []
    for n in (budget * 200 // 1024, budget * 500 // 1024, budget * 800 // 1024):
        ids = [rng.randrange(1000, 30_000) for _ in range(n)]
        out.append(srv.generate_ids(ids, 32, ignore_eos=True)["output_ids"])
    return out


def greedy_long(srv: Server, seed: int, budget: int) -> list[list[int]]:
    """Greedy tokens of two prompts past the budget (sparse decoding from the first new token), one at a time."""
    rng = random.Random(seed + 2)
    return [srv.generate_ids([rng.randrange(1000, 30_000) for _ in range(n)], 48, ignore_eos=True)["output_ids"]
            for n in (3 * budget, 4 * budget + 1)]


def shared_prefix_pair(srv: Server, seed: int, prefix_len: int) -> dict:
    """Two requests over one new prefix, one after the other on the idle server: the second must adopt the first's
    cached index and cluster only its own question (under the load, two such requests may be prefilled in one batch
    and both build, so the load alone cannot be relied on for this)."""
    rng = random.Random(seed + 1)
    prefix = [rng.randrange(1000, 30_000) for _ in range(prefix_len)]
    before = srv.rank_stats()
    for n in (96, 160):
        srv.generate_ids(prefix + [rng.randrange(1000, 30_000) for _ in range(n)], 8, ignore_eos=True)
    wait_idle(srv)
    after = srv.rank_stats()
    return {k: [b[k] - a[k] for a, b in zip(before, after)] for k in ("index_builds", "index_reused", "index_extends")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", choices=list(SIZES), default="full",
                    help="full (on an H100 in minutes), small (a tiny model: the -m gpu test), cpu (CI's test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=1, help="SGLang's KV page (the paged allocator and radix tree)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="SGLang's flag, for both servers (fp8_e4m3: fp8 KV)")
    ap.add_argument("--recall-audit-every", type=int, default=0,
                    help="the lychee server's recall_audit_every (its audited steps run outside CUDA graphs)")
    ap.add_argument("--select-every", type=int, default=1,
                    help="the lychee servers' select_every (selection every this many decode steps)")
    ap.add_argument("--select-ahead", action="store_true",
                    help="the lychee servers' select_ahead (selection for the next step beside the attention)")
    ap.add_argument("--host-tier", type=int, default=0, metavar="WINDOW",
                    help="the lychee server with the host KV tier, keeping the last WINDOW tokens of "
                         "each request on the device, in a window pool of half the KV pool's tokens; prefill chunks "
                         "of 512 tokens, so SGLang reserves (and locks in its radix tree) at most 512 window slots "
                         "of a prompt at a time and as many requests run at once as without the tier")
    a = ap.parse_args()
    import torch

    cpu, z = a.size == "cpu", SIZES[a.size]
    jobs = plan(a.seed, a.size)
    res = {"device": "cpu" if cpu else torch.cuda.get_device_name(),
           "settings": {k: v for k, v in vars(a).items() if k != "out"},
           "gpus": 0 if cpu else torch.cuda.device_count(),
           "server_args": server_args(a.size, a.tp_size, a.page_size, a.kv_cache_dtype),
           "budget": z["budget"]}
    cfg = {"token_budget": z["budget"], **({"recall_audit_every": a.recall_audit_every}
                                           if a.recall_audit_every else {}),
           **({"select_every": a.select_every} if a.select_every > 1 else {}),
           **({"select_ahead": True} if a.select_ahead else {})}
    tier = []
    if a.host_tier:
        cfg.update(host_tier=True, host_window=a.host_tier)
        tier = ["--swa-full-tokens-ratio", "0.5", "--chunked-prefill-size", "512"]
    with Server(a.model, "lychee", cfg, extra=res["server_args"] + tier, cpu=cpu, log_path=f"{a.out}.lychee.log",
                timeout=900) as srv:
        greedy_before = greedy_short(srv, a.seed, z["budget"])
        res["shared_prefix_pair"] = shared_prefix_pair(srv, a.seed, z["lengths"][-2])
        t0 = time.perf_counter()
        with ThreadPoolExecutor(z["concurrency"]) as pool:
            results = list(pool.map(lambda j: run_job(srv.url, j), jobs))
        res["load_s"] = round(time.perf_counter() - t0, 1)
        res["healthy_after"] = requests.get(srv.url + "/health_generate", timeout=60).status_code == 200
        # /health_generate ran a request; wait for it to finish, then read the idle state
        idle = wait_idle(srv)
        requests.post(srv.url + "/flush_cache", timeout=60)
        flushed = wait_idle(srv)
        res["stats_idle"], res["stats_flushed"] = idle, flushed
        res["metrics_exported"] = "sglang:sparse_kv_index_pool_fill" in requests.get(srv.url + "/metrics",
                                                                                     timeout=60).text
        res["greedy_lychee"] = greedy_short(srv, a.seed, z["budget"])
        if a.host_tier and not cpu:
            res["greedy_long_tier"] = greedy_long(srv, a.seed, z["budget"])
    greedy = {"greedy_after_load_equal_before": res["greedy_lychee"] == greedy_before}
    if a.host_tier and not cpu:   # the tier's sparse decode reads the KV plain lychee reads, in the same order
        plain = {k: v for k, v in cfg.items() if k not in ("host_tier", "host_window")}
        with Server(a.model, "lychee", plain, extra=res["server_args"], cpu=cpu, log_path=f"{a.out}.plain.log",
                    timeout=900) as srv:
            res["greedy_long_plain"] = greedy_long(srv, a.seed, z["budget"])
        greedy["greedy_past_budget_equal_without_tier"] = res["greedy_long_tier"] == res["greedy_long_plain"]
    if not cpu:
        with Server(a.model, "off", None, extra=res["server_args"], cpu=cpu, log_path=f"{a.out}.dense.log",
                    timeout=900) as srv:
            res["greedy_dense"] = greedy_short(srv, a.seed, z["budget"])
        greedy["greedy_within_budget_equal_dense"] = res["greedy_lychee"] == res["greedy_dense"]
    res["results"] = results
    counts = {}
    for r in results:
        c = counts.setdefault(r["kind"], {"sent": 0, "ok": 0})
        c["sent"] += 1
        c["ok"] += bool(r["ok"])
    res["counts"] = counts
    pair = res["shared_prefix_pair"]
    res["checks"] = dict(idle_checks(idle, flushed), healthy_after=res["healthy_after"],
                         second_of_a_shared_prefix_adopted=all(r == 1 and e == 1 for r, e in
                                                               zip(pair["index_reused"], pair["index_extends"])),
                         every_request_ok=all(r["ok"] for r in results), metrics_exported=res["metrics_exported"],
                         **greedy)
    res["passed"] = all(res["checks"].values())
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({"counts": counts, "checks": res["checks"], "passed": res["passed"], "load_s": res["load_s"],
                      "fallbacks": [st["dense_fallback_steps"] for st in idle],
                      "index_pool_full": [st["index_pool_full"] for st in idle]}))
    raise SystemExit(0 if res["passed"] else 1)


if __name__ == "__main__":
    main()
