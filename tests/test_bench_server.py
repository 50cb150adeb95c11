"""bench.server.Server stops its server's whole process group, also when the driver is stopped by SIGTERM (as
`timeout` does on the GPU machine) while the server is still starting: a server left behind holds the GPU memory
the next one needs."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a fake launcher: it starts a child (a scheduler stands in), prints both pids and never becomes healthy
FAKE_LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)
""")

DRIVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from bench.server import Server
    srv = Server("unused", log_path={log!r}, timeout=600)
    srv.args = [sys.executable, "-c", {launcher!r}]
    print("starting", flush=True)
    with srv:
        pass
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:   # a zombie awaiting its reaper holds no memory
        return f.read().split(")")[-1].split()[0] != "Z"


def child_pid(log: Path, wait_s: float = 60) -> int:
    """The pid the fake launcher wrote into its server's log, once it is there (the driver creates the log just
    after printing "starting": later, on a busy machine)."""
    deadline = time.time() + wait_s
    while not (log.exists() and log.read_text().strip()) and time.time() < deadline:
        time.sleep(0.1)
    return int(log.read_text().split()[0])


def test_sigterm_while_starting_stops_the_server_and_its_children(tmp_path):
    log = tmp_path / "server.log"
    code = DRIVER.format(root=str(ROOT), log=str(log), launcher=FAKE_LAUNCHER)
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert driver.stdout.readline().strip() == "starting"
    child = child_pid(log, wait_s=30)
    assert alive(child)
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(60) == 128 + signal.SIGTERM
    assert not alive(child), "the server's child outlived the driver"


def test_run_driver_timeout_lets_the_driver_stop_its_server(tmp_path):
    """A test's timeout on a driver (bench.fidelity, bench.stress) must not orphan the driver's server:
    ``subprocess.run`` would SIGKILL the driver, and the server, in a session of its own, would keep its CPU or
    GPU for the rest of the run. ``run_driver`` sends SIGTERM first."""
    import pytest

    from bench.server import run_driver

    log = tmp_path / "server.log"
    code = DRIVER.format(root=str(ROOT), log=str(log), launcher=FAKE_LAUNCHER)
    t0 = time.time()
    with pytest.raises(subprocess.TimeoutExpired):
        run_driver([sys.executable, "-c", code], timeout=8)
    child = child_pid(log, wait_s=0)   # the fake scheduler, started before the timeout
    assert not alive(child), "the server's child outlived the driver"
    assert time.time() - t0 < 60


def test_sigterm_to_the_test_run_lets_a_running_driver_stop_its_server(tmp_path):
    """`timeout` stops a GPU test run with SIGTERM. The test session turns it into KeyboardInterrupt
    (tests/conftest.py), so a test inside ``run_driver`` still stops its driver, which stops its server; by
    default SIGTERM would end pytest at once and leave the server holding the GPU."""
    import threading

    import pytest

    from bench.server import run_driver

    log = tmp_path / "server.log"
    code = DRIVER.format(root=str(ROOT), log=str(log), launcher=FAKE_LAUNCHER)

    def stop_once_started():
        child_pid(log)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run_driver([sys.executable, "-c", code], timeout=120)
    child = child_pid(log, wait_s=0)
    assert not alive(child), "the server's child outlived the interrupted test"


# a fake launcher that becomes healthy at once on the port it is given
FAKE_HEALTHY = textwrap.dedent("""
    import http.server, sys

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")


def _fake_servers(tmp_path, keys, start_s: float = 0.0):
    """Fake servers that become healthy ``start_s`` after their launch."""
    from bench.server import Server

    slow = f"import time; time.sleep({start_s})\n" + FAKE_HEALTHY
    servers = {}
    for key in keys:
        srv = servers[key] = Server("unused", log_path=str(tmp_path / f"{key}.log"), timeout=60)
        srv.args = [sys.executable, "-c", slow, str(srv.port)]
    return servers


def test_lineup_starts_servers_in_groups(tmp_path):
    """bench.server.Lineup: taking a server not started yet starts it with the next in turn; taking that one starts
    nothing (it started with the group); out of turn works alike. On exit the servers started and never taken are
    stopped. The ports of servers alive together (with SGLang's derived ones) never overlap."""
    from itertools import combinations

    from bench.server import DERIVED, Lineup

    servers = _fake_servers(tmp_path, "abcde")
    assert all(abs(p - q) >= DERIVED for p, q in combinations([s.port for s in servers.values()], 2))

    def started():
        return "".join(k for k, s in servers.items() if s.proc is not None)

    with Lineup(servers) as lineup:
        with lineup.take("a") as a:
            pid_a = a.proc.pid
            assert started() == "ab"
        assert not alive(pid_a)
        with lineup.take("b"):
            assert started() == "b"
        with lineup.take("d"):   # out of turn: d and the next in turn, c
            assert started() == "cd"
        pid_c = servers["c"].proc.pid
    assert started() == "" and not alive(pid_c)


def test_cpu_servers_take_every_core_once_the_cores_are_freed(tmp_path, monkeypatch):
    """A test run holding its servers to one torch thread (OMP_NUM_THREADS=1, CI's halves) frees the cores by
    creating the file bench.server.CORES_FREED names: servers launched before it keep the inherited thread count,
    those launched after it run one thread per core, the ones constructed before it included."""
    from bench.server import CORES_FREED, Server

    freed = tmp_path / "kernels-done"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(CORES_FREED, str(freed))
    report = "import os, sys; print(os.environ['OMP_NUM_THREADS'], flush=True)"

    def threads(key: str, srv: Server) -> str:
        srv.args = [sys.executable, "-c", report]
        srv.launch().proc.wait(timeout=60)
        srv.__exit__()
        return (tmp_path / f"{key}.log").read_text().strip()

    before, after = (Server("unused", log_path=str(tmp_path / f"{k}.log")) for k in "ab")
    assert threads("a", before) == "1"
    freed.touch()
    assert threads("b", after) == str(os.cpu_count())


def test_free_ports_stay_below_the_ports_the_os_numbers_itself():
    """A server's own NCCL port comes from the OS's ephemeral range (bind to port 0): a chosen HTTP port there was
    taken before the server bound it. Every port, with SGLang's derived ports (up to +239), lies below that range."""
    from bench.server import ephemeral_floor, free_port

    floor = ephemeral_floor()
    ports = [free_port() for _ in range(200)]
    assert all(p + 239 < floor for p in ports), (floor, max(ports))
    assert len(set(ports)) > 100   # still spread, so parallel servers rarely pick the same one


def test_steady_decode_reads_the_full_batch_lines_of_the_servers_log():
    """bench.gpu_serving's steady decode rate: the median of the scheduler's decode lines at the workload's batch,
    from SGLang 0.5.15's log format; lines of smaller batches (ramp-up, the tail) do not count."""
    from bench.gpu_serving import ratios, steady_decode

    def line(n, rate):
        return (f"[2026-12-01 13:41:22] Decode batch, #running-req: {n}, #token: 4048, token usage: 0.01, "
                f"cuda graph: True, gen throughput (token/s): {rate}, #queue-req: 0")

    log = "\n".join([line(1, 173.83), line(16, 1500.0), "Prefill batch, #new-seq: 1, #running-req: 16",
                     line(16, 1625.5), line(16, 1610.25), line(8, 900.0), line(160, 1.0)])
    got = steady_decode(log, 16)
    assert got == {"batch": 16, "lines": 3, "median_tok_s": 1610.2, "max_tok_s": 1625.5}
    assert steady_decode(log, 32) is None
    base = {"output_throughput": 1.0, "errors": 0}
    r = ratios({**base, "steady_decode": steady_decode(log, 8)}, {**base, "steady_decode": got})
    assert r["steady_decode_ratio"] == round(1610.2 / 900.0, 3)
    assert ratios({**base, "steady_decode": None}, {**base, "steady_decode": got})["steady_decode_ratio"] is None


def test_serving_ratios_keep_the_ttft_spread_and_end_to_end_latency():
    """Lychee over dense for the TTFT's median and p99 and the mean end-to-end latency (a closed loop's mean TTFT
    can rise while every request finishes sooner); a result from before they were kept reads None, not an error."""
    from bench.gpu_serving import KEEP, ratios

    assert {"median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_e2e_latency_ms"} <= set(KEEP)
    dense = {"output_throughput": 100.0, "errors": 0, "mean_ttft_ms": 7200.0, "median_ttft_ms": 7300.0,
             "p99_ttft_ms": 19000.0, "mean_e2e_latency_ms": 18300.0}
    lychee = {**dense, "mean_ttft_ms": 8000.0, "median_ttft_ms": 13000.0, "p99_ttft_ms": 16600.0,
              "mean_e2e_latency_ms": 16100.0}
    r = ratios(dense, lychee)
    assert (r["mean_ttft_ratio"], r["median_ttft_ratio"], r["p99_ttft_ratio"], r["mean_e2e_latency_ratio"]) == \
        (round(8000 / 7200, 3), round(13000 / 7300, 3), round(16600 / 19000, 3), round(16100 / 18300, 3))
    old = {"output_throughput": 100.0, "errors": 0, "mean_ttft_ms": 7200.0}
    r = ratios(old, old)
    assert r["mean_ttft_ratio"] == 1.0 and r["p99_ttft_ratio"] is None and r["mean_e2e_latency_ratio"] is None


def test_servers_stop_without_sglangs_crash_diagnostics(monkeypatch):
    """SGLang takes the SIGTERM that stops a server for a crash and, by default, sleeps 5 s before py-spy and CUDA
    core dumps: the harness's servers turn that off, unless the caller's environment asks for it."""
    from bench.server import Server

    quiet = Server("m", "off")
    assert quiet.env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == quiet.env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    monkeypatch.setenv("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "1")
    asked = Server("m", "off", cpu=False)
    assert asked.env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"
    for s in (quiet, asked):
        s.__exit__()   # never launched: gives its ports back


def test_servers_get_their_nccl_port_from_the_claimed_ports():
    """SGLang's own NCCL port is bound port 0 let go, then bound again by the scheduler ~20 s later (a CI server
    found it taken): the harness gives one from the ports it claims, apart from every other server's, but not to a
    --dp-size server, whose replicas would all bind the one given."""
    from bench.server import DERIVED, Server, _claimed

    a, b = Server("m", "off"), Server("m", "lychee", extra=["--max-total-tokens", "4096"])
    ports = [a.port, a.nccl_port, b.port, b.nccl_port]
    for s in (a, b):
        assert s.args[s.args.index("--nccl-port") + 1] == str(s.nccl_port)
    assert all(abs(p - q) >= DERIVED for i, p in enumerate(ports) for q in ports[i + 1:]), ports
    assert set(ports) <= _claimed
    dp = Server("m", "lychee", extra=["--dp-size", "2"])
    assert dp.nccl_port is None and "--nccl-port" not in dp.args
    for s in (a, b, dp):
        s.__exit__()
    assert not set(ports + [dp.port]) & _claimed


def test_gpu_serving_records_how_long_a_server_took_to_start(tmp_path):
    """bench.gpu_serving keeps each server's start: launch to ready (measured by bench.server.Server) and the
    decode graphs' capture from SGLang's log line, where a fresh machine compiles kernels."""
    from bench.gpu_serving import server_start
    from bench.server import Server

    slow = textwrap.dedent('''
        import sys, time
        time.sleep(1.5)
        print("[2026-12-04 00:30:17] Capture target decode CUDA graph end. elapsed=141.37 s, mem usage=0.22 GB",
              flush=True)
    ''') + FAKE_HEALTHY
    srv = Server("unused", log_path=str(tmp_path / "slow.log"), timeout=60)
    srv.args = [sys.executable, "-c", slow, str(srv.port)]
    with srv:
        got = server_start(srv)
    assert got["ready_s"] == srv.ready_s >= 1.5   # its sleep comes before it serves
    assert got["decode_graph_capture_s"] == 141.37
    quiet = Server("unused", log_path=str(tmp_path / "quiet.log"), timeout=60)
    quiet.args = [sys.executable, "-c", FAKE_HEALTHY, str(quiet.port)]
    with quiet:
        assert server_start(quiet)["decode_graph_capture_s"] is None   # eager: no capture line


def test_alongside_keeps_k_servers_at_work(tmp_path):
    """bench.server.alongside (fidelity's --parallel on one GPU): k servers start together and work side by side;
    as one ends the next in turn starts; every result comes back as its work ends, and every server is stopped."""
    import threading

    from bench.server import alongside

    servers = _fake_servers(tmp_path, "abcde", 0.5)
    launched, ended, at_work, most = {}, {}, [0], [0]
    lock, d_at_work = threading.Lock(), threading.Event()

    def work(key, srv):
        launched[key] = srv.launched_at
        with lock:
            at_work[0] += 1
            most[0] = max(most[0], at_work[0])
        if key == "a":   # a works until d is at work: b, c and d take the second place one after another
            assert d_at_work.wait(60)
        elif key == "d":
            d_at_work.set()
        with lock:
            at_work[0] -= 1
        ended[key] = time.monotonic()   # the clock of Server.launched_at
        return key.upper(), srv.proc.pid

    got = dict(alongside(servers, work, 2))
    assert {k: v[0] for k, v in got.items()} == {k: k.upper() for k in "abcde"}
    assert most[0] == 2
    # a and b started together; each later server started once a place was free: c and d in the second place after
    # the work before them (a holds the first until d is at work), e after a's or d's
    assert max(launched["a"], launched["b"]) < ended["b"] < launched["c"] and ended["c"] < launched["d"]
    assert min(ended["a"], ended["d"]) < launched["e"]
    assert list(got)[0] == "b"   # results come as the work ends, not in turn
    assert all(s.proc is None for s in servers.values()) and not any(alive(pid) for _, pid in got.values())


def test_alongside_starts_no_server_whose_turn_comes_after_until(tmp_path):
    """A fidelity deadline: the servers whose turn comes after it are not started, and only the work done comes
    back."""
    from bench.server import alongside

    servers = _fake_servers(tmp_path, "abc", 0.2)
    now, started = [0.0], []

    def work(key, srv):
        started.append(key)
        now[0] = 2.0   # a works past the deadline
        return key

    assert dict(alongside(servers, work, 1, until=1.0, clock=lambda: now[0])) == {"a": "a"}
    assert started == ["a"] and all(s.proc is None for s in servers.values())


def test_alongside_yields_nothing_without_servers():
    """fidelity --after on a machine where earlier calls served every cell: no server to start, no work, no
    error (a pool of no threads raised before)."""
    from bench.server import alongside

    assert dict(alongside({}, lambda key, srv: key, 2)) == {}


def test_alongside_stops_every_server_when_one_fails(tmp_path):
    """A failure in one server's work stops the servers at work beside it and starts none of those waiting."""
    import pytest
    import requests

    from bench.server import alongside

    servers = _fake_servers(tmp_path, "abcd", 0.2)
    pids = {}
    a_at_work = threading.Event()

    def work(key, srv):
        pids[key] = srv.proc.pid
        if key == "b":   # fails while a is at work, whichever of the two got ready first
            a_at_work.wait(15)
            raise ValueError("b failed")
        a_at_work.set()
        while True:   # a's work, as a request stream: it ends only because its server is stopped under it
            requests.get(srv.url, timeout=5).raise_for_status()
            time.sleep(0.05)

    t0 = time.time()
    with pytest.raises(ValueError, match="b failed"):
        dict(alongside(servers, work, 2))
    assert time.time() - t0 < 20
    assert set(pids) == {"a", "b"}
    assert all(s.proc is None for s in servers.values()) and not any(alive(p) for p in pids.values())


ALONGSIDE_DRIVER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    import requests
    from bench.server import Server, alongside
    servers = {{}}
    for key in "abc":
        srv = servers[key] = Server("unused", log_path={log!r} + key, timeout=60)
        srv.args = [sys.executable, "-c", {launcher!r}, str(srv.port)]

    def work(key, srv):
        # one write per line: print writes the pid and its newline apart, so two threads could interleave them
        sys.stdout.write(f"{{srv.proc.pid}}\\n")
        sys.stdout.flush()
        while True:
            requests.get(srv.url, timeout=5).raise_for_status()
            time.sleep(0.05)

    list(alongside(servers, work, 2))
""")


def test_alongside_stopped_by_sigterm_stops_every_server(tmp_path):
    """`timeout` on the GPU machine stops a --parallel fidelity driver with SIGTERM: every server at work goes with
    it, none is started after, and the driver ends within seconds."""
    code = ALONGSIDE_DRIVER.format(root=str(ROOT), log=str(tmp_path / "s"), launcher=FAKE_HEALTHY)
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pids = [int(driver.stdout.readline()) for _ in range(2)]   # two at work
    assert all(alive(p) for p in pids)
    t0 = time.time()
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(60) == 128 + signal.SIGTERM
    assert time.time() - t0 < 30
    assert not any(alive(p) for p in pids)
    assert driver.stdout.read() == ""   # the third never started
