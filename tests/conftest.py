import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # CI's two workers share two cores: one torch thread each (the servers they start inherit it), else each
    # process's two threads wait on each other whenever the other worker holds a core. Once the kernels' half is
    # done, the servers the other half launches take every core (bench.server.CORES_FREED, pytest_sessionfinish)
    os.environ["OMP_NUM_THREADS"] = "1"

if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    # No GPU: Triton kernels run in its interpreter (set before any kernel module is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# every pool range the GPU kernels read is checked against the pools (sgl_sparsekv/manager.py: DEBUG)
os.environ.setdefault("SPARSEKV_DEBUG", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # bench/ and tests/ helpers; appended so PyPI packages win

from bench.server import CORES_FREED  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    import kernel_bounds
    import kernel_launches
    import poison_empty

    kernel_bounds.install()     # every load and store inside the launch's tensors
    poison_empty.install()      # no read of memory the plugin allocated and never wrote
    kernel_launches.install()   # each launch's signature, compiled for sm_90 at the end


# The halves `pytest -n 2` (CI) runs side by side, about equal on 2 cores: the e2e module's servers and the CPU
# stress run in one (about 950 s of one core), everything else, the kernel tests and the quick fidelity run, in the
# other (about 830 s). Every interpreted kernel launch must happen in the "kernels" half, whose last test compiles
# them all for sm_90.
SERVERS_HALF = ("test_e2e_server.py::", "test_stress.py::test_stress_on_the_cpu_engine")


def half(nodeid: str) -> str:
    return "servers" if nodeid.rsplit("/", 1)[-1].startswith(SERVERS_HALF) else "kernels"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Halves(LoadScopeScheduling):   # one worker a half; a half's tests in collection order
        def _split_scope(self, nodeid: str) -> str:
            return half(nodeid)

    return Halves(config, log)


@pytest.fixture(autouse=True)
def _launches_in_the_kernels_half(request):
    if os.environ.get("TRITON_INTERPRET") == "1":
        kernel_launches.ELSEWHERE = half(request.node.nodeid) != "kernels" and "PYTEST_XDIST_WORKER" in os.environ


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    # `timeout` stops a run with SIGTERM, which would end pytest at once and leave the servers of a running
    # test (sessions of their own) holding the GPU; as an interrupt, the test's cleanup stops them and pytest
    # still reports what passed and which test was cut
    signal.signal(signal.SIGTERM, _interrupt)
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        # the workers, started after this, inherit it: the kernels' half touches it when done
        os.environ[CORES_FREED] = str(Path(tempfile.mkdtemp(prefix="sparsekv-halves-")) / "kernels-done")


_halves_run = set()   # the halves this process ran tests of


def pytest_runtest_logstart(nodeid, location):
    _halves_run.add(half(nodeid))


def pytest_sessionfinish(session):
    # a worker ends once its half is done (both halves are handed out at the start): after the kernels' half, the
    # servers' half has both cores, which its CPU servers use from their next launch on (1.5x faster prefill and decode
    # for SmolLM2 with two threads than with one)
    freed = os.environ.get(CORES_FREED)
    if freed and os.environ.get("PYTEST_XDIST_WORKER") and _halves_run == {"kernels"}:
        Path(freed).touch()


def pytest_unconfigure(config):
    freed = os.environ.get(CORES_FREED)
    if freed and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(Path(freed).parent, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    import torch

    # the sm_90 compile check reads the launches every other test made
    items.sort(key=lambda item: item.path.name == "test_kernels_compile.py")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device with -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_dir():
    from sgl_sparsekv.models import prepare

    return str(prepare("smollm2", os.environ.get("SPARSEKV_MODEL_DIR", ROOT / "models" / "smollm2")))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)
