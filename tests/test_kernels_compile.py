"""Every Triton kernel launched by the tests before this one (in the interpreter, on a machine without a GPU) also
compiles for an H100/H200 (sm_90) without spilling registers: tests/kernel_launches.py. With SPARSEKV_SM90_REPORT=FILE
it writes each launch's registers there, e.g. to compare a kernel change's register use without a GPU:
    SPARSEKV_SM90_REPORT=regs.json python -m pytest -q tests/test_kernels.py tests/test_kernels_compile.py \
        -k "pool or sm90"
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernel_launches

# kernel -> why its spills are accepted
SPILLS_ACCEPTED = {
    "_cut_kernel": "its widest register tile (CUT_BLOCK = 16384 bounds over 16 warps, 32 a thread, past the 128 "
                   "registers a thread of 16 warps may hold) spills 592 bytes a thread at the default band (up to 1672 "
                   "with the tests' widest); it cuts only requests with more than 8192 fine clusters, over 4096 of "
                   "them live (past ~100K tokens), where it still beats the passes over memory (kernels/select.py, "
                   "CUT_BLOCK). Tiles up to 8192 do not spill.",
}


def test_every_interpreted_launch_compiles_for_sm90_without_spills(tmp_path):
    launches = list(kernel_launches.LAUNCHES.values())
    if os.environ.get("TRITON_INTERPRET") != "1" or not launches:
        pytest.skip("checks the launches of the interpreted kernel tests run before it in the same session")
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = Path(__file__).resolve().parent
    got = subprocess.run([sys.executable, str(here / "kernel_launches.py"), str(path)], env=env, cwd=here.parent,
                         capture_output=True, text=True, timeout=1200)
    assert got.returncode == 0, got.stderr[-3000:]
    results = json.loads(got.stdout)
    if os.environ.get("SPARSEKV_SM90_REPORT"):   # per launch: kernel, constexprs, registers, spilled bytes
        Path(os.environ["SPARSEKV_SM90_REPORT"]).write_text(json.dumps(results, indent=1))
    failed = [f"{r['kernel']} {r['constexprs']}: {r['error']}" for r in results if "error" in r]
    assert not failed, "\n".join(failed)
    spilled = [f"{r['kernel']} {r['constexprs']}: {r['spill_bytes']} bytes" for r in results
               if r["spill_bytes"] and r["kernel"] not in SPILLS_ACCEPTED]
    assert not spilled, "\n".join(spilled)
    kernels = {r["kernel"] for r in results}
    print(f"{len(results)} launches of {len(kernels)} kernels compiled for sm_90; most registers:",
          max(r["registers"] for r in results))
