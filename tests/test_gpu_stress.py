"""The GPU stress run (bench/gpu_stress.py) in its small form: a tiny dummy model, a few dozen requests with
aborts, disconnects and evictions; every check of the full run must hold. With --page-size 16 SGLang allocates
KV and matches prefixes in pages of 16 tokens, while sparse-kv reads KV by token slot: the same checks cover it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.server import run_driver

ROOT = Path(__file__).resolve().parents[1]
MKMODEL = ROOT / ".gpu-bundle" / "mkmodel.py"


@pytest.mark.gpu
@pytest.mark.parametrize("tp, page_size", [(1, 1), (2, 1), (1, 16)])
def test_stress_small(tmp_path, tp, page_size):
    import torch

    if not MKMODEL.exists():
        pytest.skip("needs .gpu-bundle/mkmodel.py (see ../shared/gpu/README.md)")
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, str(MKMODEL), str(model), "tiny"], check=True)
    out = tmp_path / "stress.json"
    p = run_driver([sys.executable, "-m", "bench.gpu_stress", "--small", "--model", str(model), "--out", str(out),
                    "--tp-size", str(tp), "--page-size", str(page_size)], timeout=900, cwd=ROOT)
    res = json.loads(out.read_text())
    assert p.returncode == 0 and res["passed"], (res.get("checks"), p.stdout[-2000:], p.stderr[-3000:])
    assert res["counts"]["complete"]["sent"] > 0 and len(res["stats_idle"]) == tp
    assert all(st["grafts"] > 0 for st in res["stats_idle"])
    heads = [tuple(st["kv_heads"]) for st in res["stats_idle"]]
    assert len(set(heads)) == tp, heads   # the tiny model's 2 KV heads: each rank holds its own
