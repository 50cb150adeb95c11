"""bench.host_prepare on the CPU: its per-step timing and phase split hold together, cold or warm."""

import json
import sys

import pytest

from bench import host_prepare


@pytest.mark.parametrize("evict_mb", [0, 8])
def test_host_prepare_on_cpu(tmp_path, monkeypatch, evict_mb):
    out = tmp_path / "host.json"
    monkeypatch.setattr(sys, "argv", ["host_prepare", "--out", str(out), "--device", "cpu", "--batch", "2",
                                      "--context", "2048", "--layers", "4", "--steps", "30",
                                      "--evict-mb", str(evict_mb)])
    host_prepare.main()
    r = json.loads(out.read_text())
    assert r["device"].startswith("CPU") and r["evict_mb"] == evict_mb
    p = r["step_ms"]
    assert 0 < p["p10"] <= p["median"] <= p["p90"]
    means = r["phase_ms_per_step"]
    # the manager's phases lie inside the step's preparation, which lies inside the timed step
    assert 0 <= sum(means[k] for k in host_prepare.PREPARE_PHASES) <= means["decode_prepare_s"] + 0.002
    assert means["decode_prepare_s"] <= r["host_ms_per_step"] + 0.002
    assert all(v >= 0 for v in r["phase_median_ms"].values())
    # 180 decode steps past a 2048-token prompt at budget 1024 leave the recent window: chunks were grafted
    assert r["grafts"] > 0 and r["decode_host_syncs"] == 0
    assert r["release_ms"]["median"] > 0 and r["release_syncs"] == 0
    # every timed step without a graft counts once, by its cuts; 2 requests cut at most a few chunks a step
    split = r["step_ms_by_cuts"]
    assert 0 < sum(v["steps"] for v in split.values()) <= r["steps"] and set(split) <= {"0", "1", "2", "3", "4"}
    assert "0" in split and all(v["median"] > 0 for v in split.values())
