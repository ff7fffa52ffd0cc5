"""Cheap checks of the reliability benches' offline parts (the benches themselves run minutes).

.venv/bin/python -m pytest tests/test_bench_tools.py -q
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import chaos  # noqa: E402
import control_plane  # noqa: E402


def test_1024_gpu_rates_follow_the_simulator_results(tmp_path):
    row = {
        "rollouts": 128,
        "gen_tok_s": {"median": 320_000.0},
        "iteration_s": {"median": 10.0},
        "counts": {"steps_measured": 5},
        "staleness_finished": {"count": 5000},
    }
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"results": {"32B": {"64": {}, "1024": {"laminar": row}}}}))
    rates = control_plane.workload_rates(path)
    assert list(rates) == ["32B"]
    r = rates["32B"]
    assert r["chunks_s"] == pytest.approx(320_000 / control_plane.CHUNK_TOKENS)
    assert r["trajectories_s"] == pytest.approx(5000 / 50)
    assert r["heartbeats_s"] == pytest.approx(128 / control_plane.HEARTBEAT_S)
    assert r["status_pushes_s"] == pytest.approx(128 / control_plane.STATUS_PUSH_MIN_S)


def test_committed_simulator_results_give_a_1024_gpu_target():
    rates = control_plane.workload_rates(ROOT / "bench/results/simulate.json")
    assert rates and all(r["chunks_s"] > r["trajectories_s"] > 0 for r in rates.values())


def test_lag_window_reads_only_samples_inside_it(tmp_path):
    path = tmp_path / "lag.jsonl"
    path.write_text(
        "".join(json.dumps({"t": t, "lags": [float(t)] * 10}) + "\n" for t in (1, 2, 3))
    )
    got = control_plane.read_lag(path, 1.5, 2.5)
    assert got["p99_ms"] == 2.0 and got["samples"] == 10


def test_step_reader_follows_an_appended_file_and_skips_a_cut_line(tmp_path):
    path = tmp_path / "consumed.jsonl"
    steps = chaos.Steps(path)
    assert steps.poll() == 0
    path.write_text(json.dumps({"step": 1, "uids": []}) + "\n" + '{"step": 2, "ui')
    assert steps.poll() == 1  # the half-written line waits for its end
    with open(path, "a") as f:
        f.write('ds": []}\n' + json.dumps({"step": 2, "uids": []}) + "\n")
    assert steps.poll() == 2
    assert chaos.pct([3.0, 1.0, 2.0], 0.5) == 2.0 and chaos.pct([], 0.5) is None
