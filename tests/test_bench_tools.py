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
import cp_node  # noqa: E402


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
    got = cp_node.read_lag(path, 1.5, 2.5)
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


def test_emulated_rate_is_over_whole_steps():
    """bench/cluster_run.figures: steps that ended in the window, timed from the last one before
    it; with none before, from the first in it (its own start is unknown), so a barrier mode
    whose first step outlasts the warm-up is not credited a whole step for part of its time."""
    from cluster_run import figures

    def step(t: float, tokens: int) -> dict:
        return {"time": t, "tokens_total": tokens, "compute_s": 0.1}

    # a step before the window: all three inside count, over 12 s
    steps = [step(9.0, 100), step(13.0, 100), step(17.0, 100), step(21.0, 100)]
    out = figures(steps, [], [], 10.0, 28.0, 1)
    assert out["train_tok_s"] == pytest.approx(300 / 12.0) and out["iteration_s"] == 4.0
    # none before: the first inside only starts the count (200 tokens over 8 s, not 300 over 11)
    out = figures(steps[1:], [], [], 10.0, 28.0, 1)
    assert out["train_tok_s"] == pytest.approx(200 / 8.0) and out["iteration_s"] == 4.0
    # a lone step with none before: timed from the window's start
    out = figures(steps[1:2], [], [], 10.0, 28.0, 1)
    assert out["train_tok_s"] == pytest.approx(100 / 3.0)
