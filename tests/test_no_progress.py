"""A run that cannot train says so and stops; a normal stop is not a death.

    .venv/bin/python -m pytest tests/test_no_progress.py -q       (the `laminar run` one: -m slow)

The watch (laminar/launch/no_progress.py) on made-up buffer figures and a fake clock: the slow
start and a resumed run's old counts do not start the clock, failures before its first look
count, a slow run that progresses and a
run whose episodes are only long are never stopped, every sample refused or failing is stopped
after the bound with its reasons and counts. Then on a sim cluster's real buffer (every reward
fails, every reward out of range), `laminar run` as a process (exit 1 within the bound, naming the
reason), and a rollout that stops normally while its closers take longer than a death takes to
notice: the manager sees a leave (Bye), no node_dead, and nothing is logged at ERROR.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from laminar.agents.worker import ERROR_CHARS, episode_error
from laminar.buffer.health import none_cause
from laminar.buffer.node import BufferNode
from laminar.cluster import LocalCluster
from laminar.launch.no_progress import NoProgressWatch
from laminar.protocol.buffer import BufferStats
from laminar.protocol.data import Trajectory
from tests.sim_cluster import laminar_run, sim_config, wait_for

TIMEOUT = 60.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def figures(
    served: int = 0,
    usable: int = 0,
    unusable: int = 0,
    version: int = 0,
    refused: dict[str, int] | None = None,
    causes: dict[str, int] | None = None,
) -> BufferStats:
    return BufferStats(
        mode="laminar",
        bound=None,
        capacity=64,
        trainer_version=version,
        next_version=version + 1,
        held=0,
        pending=0,
        groups_open=0,
        groups_ready=0,
        groups_outstanding=0,
        outstanding_batches=0,
        closed_groups=0,
        counts={"groups_served": served, "trajectories": usable + unusable, "unusable": unusable},
        refused={"rollout-0": refused} if refused else {},
        unusable_causes=causes or {},
    )


def run_watch(steps: list[tuple[float, BufferStats]], resumed: bool = False) -> list[str | None]:
    """Feed (seconds after the previous look, figures) to a new watch; its answers."""
    clock = Clock()
    watch = NoProgressWatch(TIMEOUT, resumed=resumed, clock=clock)
    out = []
    for dt, stats in steps:
        clock.t += dt
        out.append(watch.observe(stats))
    return out


def test_the_slow_start_and_a_resumed_runs_counts_do_not_start_the_clock() -> None:
    # a model that loads for ten bounds: nothing served, nothing stopped
    assert run_watch([(30.0, figures())] * 20) == [None] * 20
    # a resumed run: its journal's counts (old refusals and unusable samples included) stand still
    old = figures(served=50, usable=80, unusable=20, version=10, refused={"too_long": 3})
    assert run_watch([(30.0, old)] * 20, resumed=True) == [None] * 20


def test_failures_before_the_first_look_count() -> None:
    # a small run whose every sample was refused before the buffer was first asked: nothing
    # moves after that (its open groups hold the prompts), the run still stops
    steps = [(30.0, figures(served=4, refused={"reward_range": 8}))] * 3
    got = run_watch(steps)
    assert got[:2] == [None, None]
    assert got[2] is not None and "reward_range x8" in got[2]


def test_every_sample_refused_stops_after_the_bound_naming_the_reason() -> None:
    steps = [(1.0, figures())]  # the cluster starts
    steps += [(10.0, figures(served=2 + k, refused={"prompt_mismatch": 4 * k})) for k in range(7)]
    got = run_watch(steps)
    assert got[:-1] == [None] * (len(steps) - 1)
    verdict = got[-1]  # 60 s after the first prompts were served
    assert verdict is not None and "nothing could train for 60 s" in verdict
    assert "cluster.no_progress_timeout_s=60" in verdict
    assert "while 24 samples failed or were refused" in verdict  # since the clock started
    assert "prompt_mismatch x24: refused by the buffer: the sample's prompt" in verdict


def test_every_reward_failing_stops_with_the_top_causes() -> None:
    cause = {"the reward failed (exception): ZeroDivisionError: x": 0, "the agent failed: y": 0}
    steps = [(1.0, figures())]
    for k in range(1, 8):
        cause = {c: n + (3 if "reward" in c else 1) for c, n in cause.items()}
        steps.append((10.0, figures(served=1 + k, unusable=4 * k, causes=cause)))
    got = run_watch(steps)
    verdict = got[-1]  # 60 s after the first prompts were served (the second look)
    assert got[:-1] == [None] * (len(steps) - 1) and verdict is not None
    lines = verdict.splitlines()
    assert "while 28 samples failed" in lines[0]
    assert lines[1] == "  unusable x21: the reward failed (exception): ZeroDivisionError: x"
    assert lines[2] == "  unusable x7: the agent failed: y"


def test_a_slow_run_that_progresses_is_never_stopped() -> None:
    steps = [(1.0, figures(served=1))]
    usable = failed = 0
    for k in range(1, 60):  # one usable sample every 50 s, failures all the while
        failed += 5
        usable += k % 5 == 0
        refused = {"reward_range": failed}
        steps.append((10.0, figures(served=k, usable=usable, unusable=0, refused=refused)))
    assert run_watch(steps) == [None] * len(steps)
    # or a trainer step now and then, while every new sample fails
    steps = [(1.0, figures(served=1))]
    for k in range(1, 60):
        steps.append((10.0, figures(served=k, unusable=3 * k, version=k // 5, causes={"c": k})))
    assert run_watch(steps) == [None] * len(steps)


def test_long_episodes_with_nothing_failing_are_not_stopped() -> None:
    steps = [(1.0, figures(served=1)), (1.0, figures(served=8))]
    steps += [(60.0, figures(served=8))] * 10  # ten bounds without a sample back, none failed
    assert run_watch(steps) == [None] * len(steps)


def test_a_restarted_buffer_moves_the_failure_baseline() -> None:
    steps = [(1.0, figures(served=1)), (1.0, figures(served=2))]
    steps.append((30.0, figures(served=2, refused={"not_owner": 50})))
    # the buffer restarted (journaled counts stay, refusals start over): nothing new yet
    steps.append((40.0, figures(served=2, refused={"not_owner": 2})))
    steps.append((10.0, figures(served=2, refused={"not_owner": 4})))  # 2 since the restart
    got = run_watch(steps)
    assert got[:-1] == [None] * 4
    assert got[-1] is not None and "while 2 samples failed or were refused" in got[-1]


# ---- on a sim cluster's buffer -------------------------------------------------------------


def raises(prompt: str, completion: str, **row: Any) -> float:
    raise ZeroDivisionError("the grader divided by zero")


def out_of_range(prompt: str, completion: str, **row: Any) -> float:
    return 100.0  # reward.max_value is 10: the buffer refuses every sample


def broken_cfg(tmp_path: Path, fn: str, **over: Any) -> Any:
    return sim_config(
        tmp_path,
        prompts=64,
        total_steps=5,
        reward={"sim": "fn", "fn": f"tests.test_no_progress:{fn}", "workers": 0},
        cluster={"no_progress_timeout_s": 3.0},
        **over,
    )


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        ("raises", "unusable x"),
        ("out_of_range", "reward_range x"),
    ],
)
async def test_a_real_buffer_tells_the_watch_why_nothing_trains(
    tmp_path: Path, fn: str, reason: str
) -> None:
    cfg = broken_cfg(tmp_path, fn)
    watch = NoProgressWatch(3.0, poll_s=0.2)
    verdicts: list[str] = []
    async with LocalCluster(cfg) as cluster:
        buf = cluster.node("buffer-0")
        assert isinstance(buf, BufferNode)

        def judged() -> bool:
            if watch.due():
                verdict = watch.observe(buf.stats())
                if verdict is not None:
                    verdicts.append(verdict)
            return bool(verdicts)

        took = await wait_for(judged, 60, "the no-progress verdict", cluster)
        assert cluster.node("trainer-0").step == 0
    assert took >= 3.0
    assert reason in verdicts[0], verdicts[0]
    if fn == "raises":
        assert "ZeroDivisionError: the grader divided by zero" in verdicts[0]


@pytest.mark.slow
def test_laminar_run_exits_nonzero_when_every_sample_is_refused(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = laminar_run(broken_cfg(tmp_path, "out_of_range"), tmp_path)
    took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "laminar run: nothing could train for" in proc.stderr, proc.stderr[-3000:]
    assert "reward_range x" in proc.stderr and "refused by the buffer" in proc.stderr
    assert took < 120, f"stopped after {took:.0f} s"


# ---- a normal stop ---------------------------------------------------------------------------


async def test_a_normal_stop_is_a_leave_not_a_death_and_logs_no_error(tmp_path: Path) -> None:
    cfg = sim_config(tmp_path, net="ipc", total_steps=1000)
    async with LocalCluster(cfg) as cluster:
        mgr = cluster.node("manager-0")
        leaving = cluster.node("rollout-1")
        counts = mgr.metrics.counters
        await wait_for(lambda: counts.get("joins", 0) >= 4, 30, "every node joined", cluster)

        async def slow_close() -> None:
            # an engine or worker pool that takes longer to close than a death takes to notice
            await asyncio.sleep(cfg.transport.heartbeat_interval_s * 12)

        leaving.on_close(slow_close)
        with capture_logs() as logs:
            await cluster.stop_node("rollout-1", timeout=30)
            await wait_for(lambda: counts.get("leaves", 0) >= 1, 10, "the leave", cluster)
            await asyncio.sleep(cfg.transport.heartbeat_interval_s * 10)  # past dead_after_s
        assert counts.get("deaths", 0) == 0
        assert not [e for e in logs if e["event"] in ("node_dead", "peer_dead")], logs
        assert not [e for e in logs if e["log_level"] in ("error", "critical")], logs


# ---- error texts ---------------------------------------------------------------------------


class BadRequestError(Exception):
    pass


def _call_deep(depth: int) -> None:
    if depth == 0:
        raise BadRequestError("Error code: 400 - stream is not supported " + "x" * 5000)
    _call_deep(depth - 1)


def test_an_agents_error_is_cut_at_the_end_and_blamed_on_the_agent() -> None:
    try:
        _call_deep(10)
    except BadRequestError as exc:
        text = episode_error(exc)
    assert text.startswith("BadRequestError: Error code: 400 - stream is not supported")
    assert len(text) == ERROR_CHARS
    t = Trajectory(
        uid="g/0",
        group_id="g",
        prompt_uid="p",
        sample_index=0,
        prompt_ids=np.arange(2, dtype=np.int32),
        response_ids=np.arange(0, dtype=np.int32),
        logprobs=np.zeros(0, np.float32),
        version=0,
        finish_reason="error",
        reward_error=f"exception: {text}"[:500],  # RewardResult.failure("agent", ...)
        reward_error_kind="agent",
    )
    cause, field = none_cause(t, builtin_reward=False)
    assert cause.startswith("the agent failed: exception: BadRequestError: Error code: 400")
    assert "engine" not in cause and field is None
