"""Start and stop a real SGLang server (CPU or GPU) for tests and benchmarks."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import requests

# --sleep-on-idle: an idle scheduler otherwise polls its sockets nonstop, and on a 2-core CI machine the servers a
# test module keeps up (a reference beside the one under test) took the cores from the one doing the work.
# --dtype float32: on an AVX2 CPU torch runs a bf16 linear layer at a sixth of fp32's speed
CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--grammar-backend", "none", "--sleep-on-idle",
            "--dtype", "float32"]
# a path: once that file exists, the CPU servers launched from then on run one torch thread per core (the test run
# that sets it holds them to one while another process of its own works beside them: tests/conftest.py)
CORES_FREED = "SPARSEKV_CORES_FREED"


def ephemeral_floor() -> int:
    """The lowest port the OS numbers sockets with itself (bind to port 0, outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default


DERIVED = 240   # SGLang's ports for a server on port p: p .. p + 239

# the ports of this process's servers that are not stopped yet: servers starting together (a Lineup) must not
# derive the same ports, and neither binds them before it has imported SGLang
_claimed: set[int] = set()


def free_port() -> int:
    """A free port below the OS's ephemeral range, with room for the ports SGLang derives from it: a port inside
    that range can be taken between this check and the server's bind by any socket the OS numbers, the server's own
    NCCL port among them (a CI server lost its HTTP port to that). Its derived ports miss those of this process's
    other servers."""
    rng = random.Random()
    hi = min(40000, ephemeral_floor()) - 300
    lo = min(20000, hi - 1000)
    while True:
        port = rng.randrange(lo, hi)
        if any(abs(port - c) < DERIVED for c in _claimed):
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)   # unwinds the `with Server(...)` blocks, which stop their servers


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False


def run_driver(cmd: list[str], timeout: float, grace: float = 120, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` for a driver that runs servers: where
    ``subprocess.run`` would SIGKILL it (its timeout, or the caller stopped), the driver gets SIGTERM first and
    ``grace`` seconds to stop its servers, which live in sessions of their own and would outlive a killed driver."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except BaseException:
            p.terminate()
            try:
                p.communicate(timeout=grace)
            except subprocess.TimeoutExpired:
                p.kill()
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


class Lineup:
    """Servers taken in turn and started in groups: taking one that is not started yet starts it together with the
    next ``ahead`` ones; a started server sleeps until its turn (``--sleep-on-idle``). On a 2-core CPU a server's
    start is mostly SGLang's imports, and part of it leaves a core free: in CI the e2e module's six servers took
    543 s with pairs against 663 s one by one, while the quick fidelity run's four took as long either way (pairs
    ready in 84-96 s). A group starts only when a server not started yet is taken, never beside a server at work:
    its imports would take a core from the torch threads serving, which then wait on each other (a CPU decode step
    ran 10x slower). On one GPU, ``ahead=0``: two servers would split its memory (``alongside`` runs several there,
    each with its KV pool capped).

        with Lineup({"off": Server(...), "lychee": Server(...)}) as lineup:
            with lineup.take("off") as srv: ...

    ``take`` also accepts a key out of turn (a test run that selects some of them); the servers started and never
    taken are stopped on exit."""

    def __init__(self, servers: dict, ahead: int = 1):
        self.waiting = dict(servers)   # in turn order
        self.ahead = ahead

    def __enter__(self) -> Lineup:
        return self

    def take(self, key) -> Server:
        srv = self.waiting.pop(key)
        if srv.proc is None:
            for other in [srv, *list(self.waiting.values())[:self.ahead]]:
                other.launch()
        return srv

    def __exit__(self, *exc):
        for srv in self.waiting.values():
            srv.__exit__()
        self.waiting.clear()


def alongside(servers: dict, work, k: int, until: float | None = None, clock=time.time):
    """Yields ``(key, work(key, srv))`` for each server as its work ends, ``k`` servers starting or at work at once,
    each on a thread of its own. For servers side by side on one GPU: SGLang sizes a server's KV pool from the
    memory free when it starts, so each must cap its pool (``--max-total-tokens``), else the first takes the memory
    the others need. A failure, or SIGTERM, stops every server and starts no more. A server whose turn comes at
    ``until`` (a ``clock()``, by default ``time.time()``) or later is not started and yields nothing."""
    if not servers:   # every cell served already (fidelity's --after): nothing to start, nothing to stop
        return
    stopping = threading.Event()

    def one(key):
        srv = servers[key]
        if stopping.is_set():
            raise RuntimeError("stopped before its start")
        if until is not None and clock() >= until:
            return None
        try:
            srv.__enter__()
            return key, work(key, srv)
        except BaseException:
            stopping.set()   # before this thread takes the next server
            raise
        finally:
            srv.__exit__()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    pool = ThreadPoolExecutor(k)
    futures = [pool.submit(one, key) for key in servers]
    try:
        for done in as_completed(futures):
            if (got := done.result()) is not None:
                yield got
    finally:
        stopping.set()
        pool.shutdown(wait=False, cancel_futures=True)
        # the requests in flight fail at once and their threads end; a start already under way when the stop came
        # is stopped at the next pass
        while True:
            with ThreadPoolExecutor(len(servers)) as stop:   # together: each may take seconds to go
                list(stop.map(lambda srv: srv.__exit__(), servers.values()))
            if all(f.done() for f in futures):
                break
            time.sleep(0.2)


class Server:
    """``with Server(model, method, config) as srv: srv.complete(prompt)``; logs go to ``log_path``."""

    def __init__(self, model_path: str, method: str = "off", config: dict | None = None, extra=(),
                 cpu: bool = True, log_path: str | None = None, timeout: float = 600):
        model_path = os.path.abspath(model_path) if os.path.exists(model_path) else model_path
        self.port = free_port()
        _claimed.add(self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
                     "--port", str(self.port), "--enable-cache-report", "--sparse-kv", method]
        # SGLang takes its NCCL port by binding port 0 and letting it go; its scheduler binds it some 20 s later, and
        # a CI server found it taken then. Ours comes from the ports this process claims (not with --dp-size: every
        # replica would bind the one given)
        self.nccl_port = None
        if "--dp-size" not in extra and "--nccl-port" not in extra:
            self.nccl_port = free_port()
            _claimed.add(self.nccl_port)
            self.args += ["--nccl-port", str(self.nccl_port)]
        if config:
            self.args += ["--sparse-kv-config", json.dumps(config)]
        if cpu:
            self.args += CPU_ARGS
        self.args += list(extra)
        self.env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1") if cpu else dict(os.environ)
        # a server is stopped by SIGTERM, which SGLang treats as a crash: with these on (its default) it sleeps 5 s
        # before py-spy and CUDA core dumps on every stop
        for var in ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH"):
            self.env.setdefault(var, "0")
        self.env.pop("TRITON_INTERPRET", None)  # set by the CPU test session for kernel tests only
        self.log_path = log_path or f"/tmp/sglang-{method}-{self.port}.log"
        self.timeout = timeout
        self.proc = self.log = None
        self.launched_at = self.ready_s = None

    def launch(self) -> Server:
        """Starts the server without waiting for it (``with`` waits); a second call does nothing."""
        if self.proc is None:
            self.log = open(self.log_path, "w")
            # the server runs in its own session, so a driver stopped by `timeout` (SIGTERM) must stop it itself:
            # otherwise the next server on that GPU finds its memory taken
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, _exit_on_sigterm)
            # outside the checkout: its kernels/ folder would shadow the PyPI package `kernels` SGLang may import
            env = self.env
            if (freed := env.get(CORES_FREED)) and os.path.exists(freed):
                env = dict(env, OMP_NUM_THREADS=str(os.cpu_count() or 1))
            self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=tempfile.gettempdir())
            self.launched_at = time.monotonic()
        return self

    def __enter__(self):
        try:
            self.launch()
            self._wait_ready()
        except BaseException:   # `with` calls __exit__ only once __enter__ returned: a failed start stops here
            self.__exit__()
            raise
        return self

    def _wait_ready(self):
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            proc = self.proc
            if proc is None:
                raise RuntimeError("server stopped while it started")
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; log:\n{self.tail()}")
            try:
                if requests.get(self.url + "/health_generate", timeout=5).status_code == 200:
                    # launch to ready; a server a Lineup launched ahead is seen ready only once it is taken
                    self.ready_s = round(time.monotonic() - self.launched_at, 1)
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready after {self.timeout}s; log:\n{self.tail()}")

    def __exit__(self, *exc):
        """Stops the server's whole process group (its schedulers hold the GPU memory) and waits until it is
        gone, so the next server on these GPUs finds their memory free."""
        _claimed.difference_update((self.port, self.nccl_port))
        proc, self.proc = self.proc, None   # (``alongside`` may stop it from another thread too)
        if proc:
            group = proc.pid
            for sig in (signal.SIGTERM, signal.SIGKILL):
                _signal_group(group, sig)
                deadline = time.time() + 30
                while _group_alive(group) and time.time() < deadline:
                    proc.poll()   # reaps the launcher, else it stays a zombie member of the group
                    time.sleep(0.2)
                if not _group_alive(group):
                    break
            proc.wait()
        log, self.log = self.log, None
        if log is not None:   # also where the launch itself failed
            log.close()

    def tail(self, n: int = 60) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    # ---------------------------------------------------------------- requests
    def complete(self, prompt: str, max_tokens: int = 8, logprobs: int | None = None) -> dict:
        """Greedy completion; ``logprobs``: each output token's top log-probabilities, that many."""
        r = requests.post(self.url + "/v1/completions", timeout=900, json=dict(
            model="default", prompt=prompt, max_tokens=max_tokens, temperature=0,
            **({"logprobs": logprobs} if logprobs else {})))
        r.raise_for_status()
        return r.json()

    def generate_ids(self, input_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> dict:
        r = requests.post(self.url + "/generate", timeout=900, json=dict(
            input_ids=input_ids, sampling_params=dict(max_new_tokens=max_new_tokens, temperature=0,
                                                      ignore_eos=ignore_eos)))
        r.raise_for_status()
        return r.json()

    def internal_states(self) -> list[dict]:
        """One entry per data-parallel replica (its TP rank 0's state)."""
        return requests.get(self.url + "/server_info", timeout=60).json()["internal_states"]

    def internal_state(self) -> dict:
        return self.internal_states()[0]

    def stats(self) -> dict:
        """The plugin's counters (TP rank 0's); with data parallelism, the numbers summed over the replicas and
        each replica's own under ``replicas``."""
        states = [s.get("sparse_kv_stats", {}) for s in self.internal_states()]
        if len(states) == 1:
            return states[0]
        summed = {k: sum(s[k] for s in states) for k, v in states[0].items()
                  if isinstance(v, (int, float)) and k not in ("tp_rank", "dp_rank")}
        return dict(summed, replicas=states)

    def rank_stats(self) -> list[dict]:
        """Each TP rank's own counters (of the first DP replica); one entry without tensor parallelism."""
        state = self.internal_state()
        return state.get("sparse_kv_stats_per_tp_rank") or [state.get("sparse_kv_stats", {})]
