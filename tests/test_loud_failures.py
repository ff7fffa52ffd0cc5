"""Loud failure modes: a broken or hanging reward warns with its reason; 0 steps trained fails the
run.

    .venv/bin/python -m pytest tests/test_loud_failures.py -q

Before issue 15 a reward that raised, returned NaN or a string gave every sample reward None,
the trainer ended "data exhausted" after 0 steps and `laminar run` exited 0; a hanging
reward was contained by its timeout, but throughput collapsed without a word.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog

from laminar.buffer.experience import ExperienceState
from laminar.buffer.health import StallWatch
from laminar.cluster import LocalCluster
from laminar.metrics import Metrics
from laminar.modes import Admission
from laminar.node import NodeFailed
from laminar.protocol.data import Trajectory
from laminar.rewards.runner import RewardRunner
from laminar.trainer.node import NothingTrained
from tests.sim_cluster import laminar_run, sim_config

HANG = threading.Event()
"""Released at the end of the hanging-reward test: the timed-out threads then finish."""


def raises(prompt: str, completion: str, **row: Any) -> float:
    raise ZeroDivisionError("the grader divided by zero")


def nan(prompt: str, completion: str, **row: Any) -> float:
    return math.nan


def text(prompt: str, completion: str, **row: Any) -> Any:
    return "correct"


def hangs_on_odd(prompt: str, completion: str, **row: Any) -> float:
    if int(row["i"]) % 8 == 1:
        HANG.wait(30)
    return 1.0


def traj(i: int, reward: float | None, error: str = "", error_kind: str = "") -> Trajectory:
    return Trajectory(
        uid=f"g{i}/0",
        group_id=f"g{i}",
        prompt_uid=f"p{i}",
        sample_index=0,
        prompt_ids=np.arange(2, dtype=np.int32),
        response_ids=np.arange(3, dtype=np.int32),
        logprobs=np.full(3, -1.0, np.float32),
        version=0,
        reward=reward,
        reward_error=error,
        reward_error_kind=error_kind,
    )


def watch(tmp_path: Path, fn: str) -> StallWatch:
    cfg = sim_config(tmp_path, buffer={"stall_window": 16, "stall_warn_after_s": 600})
    adm = Admission.for_mode(cfg.mode, cfg.trainer.batch_groups, cfg.buffer.max_staleness)
    state = ExperienceState(group_size=1, lost_member_policy="release_partial", admission=adm)
    return StallWatch(cfg.buffer, fn, state, Metrics(), structlog.get_logger("test"))


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        ("raises", "the reward failed (exception): ZeroDivisionError: the grader divided by zero"),
        ("nan", "the reward failed (format): reward is not finite (nan)"),
        ("text", "the reward failed (format): reward must be a number or None, got str"),
    ],
)
async def test_broken_reward_warns_with_its_reason(tmp_path: Path, fn: str, reason: str) -> None:
    runner = RewardRunner(f"tests.test_loud_failures:{fn}", workers=0)
    await runner.start()
    try:
        health = watch(tmp_path, f"tests.test_loud_failures:{fn}")
        for i in range(8):
            res = await runner.score("p", "c", {"i": i})
            assert res.reward is None and res.error_kind in ("exception", "format")
            health.observe(traj(i, res.reward, res.error, res.error_kind))
    finally:
        await runner.close()
    warning = health.warnings["rewards_none"]
    assert "reward None for 8/8 of the last trajectories" in warning
    assert reason in warning, warning
    assert health.metrics.counters["warn_rewards_none"] == 1
    assert "reward_timeouts" not in health.warnings


async def test_hanging_reward_warns_with_the_timeout_count(tmp_path: Path) -> None:
    runner = RewardRunner("tests.test_loud_failures:hangs_on_odd", timeout_s=0.2, workers=0)
    await runner.start()
    health = watch(tmp_path, "tests.test_loud_failures:hangs_on_odd")
    try:
        for i in range(16):  # 2 of 16 hang: too few for the None-fraction warning
            res = await runner.score("p", "c", {"i": i})
            health.observe(traj(i, res.reward, res.error, res.error_kind))
    finally:
        HANG.set()
        await runner.close()
    assert runner.stats["timeouts"] == 2
    assert "rewards_none" not in health.warnings
    warning = health.warnings["reward_timeouts"]
    assert "timed out on 2/16 of the last trajectories (2 since start" in warning
    assert "reward exceeded 0.2s" in warning
    # the window moves on: once no timeout is left in it, the warning clears
    for i in range(16):
        health.observe(traj(100 + i, 1.0))
    assert "reward_timeouts" not in health.warnings


def _broken_cfg(tmp_path: Path) -> Any:
    return sim_config(
        tmp_path,
        prompts=8,
        total_steps=5,
        data={"epochs": 1},
        reward={"sim": "fn", "fn": "tests.test_loud_failures:raises", "workers": 0},
        buffer={"stall_window": 16},
    )


async def test_zero_steps_because_every_reward_failed_fails_the_trainer(tmp_path: Path) -> None:
    cfg = _broken_cfg(tmp_path)
    with pytest.raises(
        RuntimeError, match="node trainer-0 failed"
    ):  # LocalCluster's exit says so too
        async with LocalCluster(cfg) as cluster:
            with pytest.raises(NodeFailed) as failed:
                await cluster.wait_trainer(timeout=60)
            assert cluster.node("trainer-0").step == 0
    why = failed.value.__cause__
    assert isinstance(why, NothingTrained)
    msg = str(why)
    assert msg.startswith("trained 0 steps: the data ran out and no group was ever trainable")
    assert (
        "16 trajectories stored, 16 without a usable reward, 8 groups dropped (no_usable_member: 8)"
        in msg
    )
    assert "rewards_none" in msg and "ZeroDivisionError: the grader divided by zero" in msg


@pytest.mark.slow
def test_laminar_run_exits_nonzero_when_nothing_was_trained(tmp_path: Path) -> None:
    proc = laminar_run(_broken_cfg(tmp_path), tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "trained 0 steps" in proc.stderr
    assert "node trainer-0" in proc.stderr


def test_bench_removes_its_relay_segments_and_those_of_dead_runs() -> None:
    import importlib.util

    from laminar.weights.segment import default_shm_dir

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "bench_cluster_run", root / "bench" / "cluster_run.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)  # a pid that no longer runs (reused within this test: vanishingly unlikely)
    seg_dir = Path(default_shm_dir())
    mine = seg_dir / f"laminar-cb{os.getpid()}-relay0-0-test"
    dead = seg_dir / f"laminar-cb{gone.pid}-relay0-1-test"
    other = seg_dir / f"laminar-xb{gone.pid}-relay0-1-test"  # not a bench segment
    for p in (mine, dead, other):
        p.write_bytes(b"x")
    try:
        # at start: the dead run's (and any other dead run's left on this machine)
        assert bench.remove_segments() >= 1
        assert not dead.exists() and mine.exists() and other.exists()
        assert bench.remove_segments(os.getpid()) == 1  # at exit: this run's
        assert not mine.exists() and other.exists()
    finally:
        for p in (mine, dead, other):
            p.unlink(missing_ok=True)
