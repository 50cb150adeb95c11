"""Serving on the GPU: SGLang dense vs --sparse-kv lychee, dummy Llama-3.1-8B weights, bench_serving random-ids.

    python3 -m bench.gpu_serving --model /tmp/m8b --out $OUT/serving.json

Both servers run eagerly (no CUDA graphs: the sparse path does not support them yet) over the Triton backend, so
the comparison is like for like. Also checks that with the budget above the context, greedy tokens equal dense.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import requests

from bench.server import Server

COMMON = ["--load-format", "dummy", "--grammar-backend", "none", "--sampling-backend", "pytorch",
          "--attention-backend", "triton", "--disable-cuda-graph", "--mem-fraction-static", "0.7",
          "--max-running-requests", "8"]


def serve_bench(srv: Server, input_len: int, output_len: int, prompts: int, concurrency: int, out_file: str) -> dict:
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--port", str(srv.port),
           "--dataset-name", "random-ids", "--random-input-len", str(input_len), "--random-output-len",
           str(output_len), "--random-range-ratio", "1.0", "--num-prompts", str(prompts), "--max-concurrency",
           str(concurrency), "--output-file", out_file]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(p.stdout[-3000:], p.stderr[-2000:], flush=True)
    with open(out_file) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    keep = ("completed", "output_throughput", "median_tpot_ms", "mean_tpot_ms", "median_itl_ms", "mean_ttft_ms")
    return {k: rows[-1].get(k) for k in keep}


def greedy(srv: Server, ids: list[int], n: int) -> list[int]:
    r = requests.post(srv.url + "/generate", timeout=600, json=dict(
        input_ids=ids, sampling_params=dict(max_new_tokens=n, temperature=0, ignore_eos=True)))
    r.raise_for_status()
    return r.json()["output_ids"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--input-len", type=int, default=32768)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    a = ap.parse_args()
    import torch

    res = {"device": torch.cuda.get_device_name(), "model": "Llama-3.1-8B shape, dummy weights", "settings": vars(a)}
    ids = list(range(100, 2100))
    for name, method, cfg in (("dense", "off", None), ("lychee", "lychee", {"token_budget": 1024}),
                              ("lychee-budget-above-context", "lychee", {"token_budget": 4096})):
        with Server(a.model, method, cfg, extra=COMMON, cpu=False, log_path=f"{a.out}.{name}.log", timeout=900) as srv:
            res[name] = {"greedy": greedy(srv, ids, 16)}
            if name != "lychee-budget-above-context":
                res[name]["serving"] = serve_bench(srv, a.input_len, a.output_len, a.prompts, a.concurrency,
                                                   f"{a.out}.{name}.jsonl")
                if method != "off":
                    res[name]["stats"] = srv.stats()
        print(name, json.dumps(res[name])[:1500], flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    res["greedy_equal_when_budget_covers_context"] = res["dense"]["greedy"] == res["lychee-budget-above-context"]["greedy"]
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("greedy equal:", res["greedy_equal_when_budget_covers_context"])


if __name__ == "__main__":
    main()
