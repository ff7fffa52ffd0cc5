"""The silent stall: verl-style rows, a reward that reads a missing field, the buffer's warning.

    .venv/bin/python -m pytest tests/test_stall_warning.py -q

Before issue 16 every reward on such rows was None, every group was dropped, the trainer
waited forever and nothing said why. Now the buffer's StallWatch (laminar/buffer/health.py)
warns, naming the field and the counts, the warning is counted and shows in
`laminar status`; and the built-in rewards read `reward_model.ground_truth`, so a verl
parquet trains with them end to end (the last test: tiny torch model, real cluster).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
import yaml

from laminar.buffer.experience import ExperienceState
from laminar.buffer.health import StallWatch, none_cause
from laminar.buffer.ledger import Ledger
from laminar.buffer.records import GroupsServed, ServedGroup, TrajectoryAccepted
from laminar.config import BufferConfig
from laminar.metrics import Metrics
from laminar.modes import Admission
from laminar.protocol.buffer import TrajectoryAck
from laminar.protocol.data import PromptItem, Trajectory
from laminar.rewards.runner import RewardRunner
from tests.test_buffer_node import Harness, make_cfg, prompts

VERL_ROWS = [
    {
        "data_source": "toy/add",
        "prompt": [{"role": "user", "content": f"{i}+{i}="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"index": i},
    }
    for i in range(12)
]


def reads_answer(prompt: str, completion: str, **row: Any) -> float:
    """A TRL-style reward: the reference must be a top-level `answer` column."""
    return float(completion.strip() == row["answer"])


def traj(
    item: PromptItem, i: int, reward: float | None, error: str = "", error_kind: str = ""
) -> Trajectory:
    return Trajectory(
        uid=f"{item.group_id}/{i}",
        group_id=item.group_id,
        prompt_uid=item.uid,
        sample_index=i,
        prompt_ids=item.prompt_ids,
        response_ids=np.arange(3, dtype=np.int32),
        logprobs=np.full(3, -1.0, np.float32),
        version=0,
        reward=reward,
        reward_error=error,
        reward_error_kind=error_kind,
        rollout_id="r0",  # the sender's own id (tests' rollout client r0)
        prompt=item.prompt,
        row=item.row,
    )


async def test_missing_field_warns_with_counts_and_shows_in_status(tmp_path: Path, capsys) -> None:
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in VERL_ROWS))
    cfg = make_cfg(tmp_path, transport="ipc", buffer={"stall_window": 8, "stall_warn_after_s": 600})
    runner = RewardRunner("tests.test_stall_warning:reads_answer", workers=0)
    await runner.start()
    h = await Harness(cfg).start()
    try:
        ro = await h.client("r0")
        items = (await prompts(ro, 6)).items
        assert len(items) == 6
        # the loader kept the verl columns; the chat prompt became text
        assert items[0].row["reward_model"]["style"] == "rule"
        assert {"data_source", "reward_model", "extra_info"} <= items[0].row.keys()
        assert items[0].prompt.endswith("=")
        for it in items:
            for i in range(it.n):
                res = await runner.score(it.prompt, "4", it.row)
                assert res.reward is None and res.error_kind == "exception"
                t = traj(it, i, res.reward, res.error, res.error_kind)
                assert isinstance(await ro.request(t), TrajectoryAck)
        buf = h.buffer
        warning = buf.health.warnings["rewards_none"]
        assert "reward None for 8/8 of the last trajectories" in warning
        assert "'answer'" in warning and "KeyError" in warning
        assert "row fields: ability, data_source, extra_info, reward_model" in warning
        assert "reward_model.ground_truth" in warning  # the verl hint
        assert "6 groups dropped so far (no_usable_member: 6)" in warning
        # rate-limited: 12 trajectories, one warning logged and counted
        assert buf.metrics.counters["warn_rewards_none"] == 1
        assert buf.metrics.counters["reward_none"] == 12
        assert buf.status().warnings == [warning]
        assert buf.stats().warnings == {"rewards_none": warning}

        # `laminar status` shows it once the manager has the buffer's heartbeat
        from laminar.launch.status import fetch_status, status_main
        from laminar.transport.sockets import TransportError

        def buffer_warnings() -> list[str]:
            try:
                reply = fetch_status(cfg, timeout=1.0)
            except TransportError:
                return []
            return [
                w for e in reply.nodes if e.role == "buffer" and e.status for w in e.status.warnings
            ]

        deadline = asyncio.get_running_loop().time() + 10
        while not await asyncio.to_thread(buffer_warnings):
            assert asyncio.get_running_loop().time() < deadline, "status never showed the warning"
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        capsys.readouterr()
        assert await asyncio.to_thread(status_main, str(path), [], False, 2.0) == 0
        out = capsys.readouterr().out
        assert "WARNING buffer-0: reward None for" in out and "'answer'" in out
    finally:
        await h.close()
        await runner.close()
        shutil.rmtree(cfg.cluster.ipc_dir, ignore_errors=True)


def _watch(tmp_path: Path, clock: list[float], **knobs: Any) -> tuple[StallWatch, Ledger, Metrics]:
    state = ExperienceState(
        group_size=2,
        lost_member_policy="release_partial",
        admission=Admission.for_mode("laminar", 2),
    )
    metrics = Metrics()
    ledger = Ledger(state, None, 1 << 20, metrics, structlog.get_logger("test"))
    bc = BufferConfig(**{"stall_window": 64, "stall_warn_after_s": 30.0, **knobs})
    watch = StallWatch(
        bc, "my.rewards:score", state, metrics, structlog.get_logger("test"), clock=lambda: clock[0]
    )
    return watch, ledger, metrics


def _serve(ledger: Ledger, k: int, start: int = 0) -> list[PromptItem]:
    items = [
        PromptItem(
            uid=f"p{j}",
            group_id=f"p{j}@0#{j}",
            prompt_ids=np.arange(2, dtype=np.int32),
            n=2,
            prompt=f"q{j}",
            row={"question": f"q{j}"},
        )
        for j in range(start, start + k)
    ]
    ledger.record(GroupsServed([ServedGroup(it.group_id, it.uid, 2, 0, item=it) for it in items]))
    return items


def _arrive(watch: StallWatch, ledger: Ledger, t: Trajectory) -> None:
    ledger.record(TrajectoryAccepted(t))
    watch.observe(t)


def test_stall_warns_after_n_seconds_rate_limited_and_clears(tmp_path: Path) -> None:
    clock = [100.0]
    # the None fraction alone would not warn (threshold 1.0): this is the time-based check
    watch, ledger, metrics = _watch(tmp_path, clock, stall_warn_none_frac=1.0)
    items = _serve(ledger, 4)
    _arrive(watch, ledger, traj(items[0], 0, 1.0))  # a usable member, its group still open
    for it in items[1:]:  # groups whose samples all come back without a reward: dropped
        for i in range(2):
            _arrive(watch, ledger, traj(it, i, None))
    assert watch.warnings == {}
    clock[0] += 29.0
    watch.check()
    assert watch.warnings == {}
    clock[0] += 2.0  # 31 s without a ready group while 7 trajectories arrived
    watch.check()
    text = watch.warnings["stalled"]
    assert "no whole group became ready for 31 s while 7 trajectories arrived" in text
    assert "1 groups still open" in text
    assert "3 groups dropped so far (no_usable_member: 3)" in text
    assert "reward None for 6/7" in text and "returned None" in text
    assert metrics.counters["warn_stalled"] == 1
    clock[0] += 10.0
    watch.check()
    assert metrics.counters["warn_stalled"] == 1  # still stalled, not logged again yet
    clock[0] += 25.0
    watch.check()
    assert metrics.counters["warn_stalled"] == 2  # repeated once per stall_warn_after_s
    _arrive(watch, ledger, traj(items[0], 1, 0.0))  # the first group is complete: ready
    assert "stalled" not in watch.warnings


def test_none_fraction_is_judged_over_the_window(tmp_path: Path) -> None:
    clock = [0.0]
    watch, ledger, metrics = _watch(tmp_path, clock, stall_window=8, stall_warn_none_frac=0.5)
    items = _serve(ledger, 10)
    samples = [(it, i) for it in items for i in range(2)]

    def arrive(k: int, reward: float | None) -> None:
        for _ in range(k):
            it, i = samples.pop(0)
            _arrive(watch, ledger, traj(it, i, reward))

    arrive(4, None)  # 4/4 None, but fewer than 8 judged: no verdict yet
    assert watch.warnings == {}
    arrive(4, 1.0)  # 4/8: not more than half
    arrive(4, None)  # the window slides: each new None pushes an old one out, still 4/8
    assert watch.warnings == {}
    arrive(1, None)  # 5/8
    assert "reward None for 5/8" in watch.warnings["rewards_none"]
    arrive(3, 0.0)  # the usable ones leave the window first: 5/8
    assert "rewards_none" in watch.warnings
    arrive(1, 0.0)  # 4/8: cleared
    assert "rewards_none" not in watch.warnings
    assert metrics.counters["warn_rewards_none"] == 1


@pytest.mark.parametrize(
    ("err", "finish", "builtin", "cause", "field"),
    [
        (
            ("KeyError: 'answer'", "exception"),
            "stop",
            False,
            "the reward read a field the row does not have: 'answer'",
            "answer",
        ),
        (
            ("TypeError: score() missing 1 required positional argument: 'solution'", "exception"),
            "stop",
            False,
            "does not have: 'solution'",
            "solution",
        ),
        (
            ("ValueError: bad", "exception"),
            "stop",
            False,
            "the reward failed (exception): ValueError: bad",
            None,
        ),
        (
            ("reward exceeded 10.0s", "timeout"),
            "stop",
            False,
            "failed (timeout)",
            None,
        ),
        (
            ("engine error", "engine"),
            "error",
            False,
            "the engine failed",
            None,
        ),
        (
            ("", ""),
            "stop",
            True,
            "found no 'answer' or 'ground_truth' or 'reward_model.ground_truth'",
            "answer",
        ),
        (("", ""), "stop", False, "the reward returned None", ""),
    ],
)
def test_none_cause(
    err: tuple[str, str], finish: str, builtin: bool, cause: str, field: str | None
) -> None:
    item = PromptItem(uid="p", group_id="p@0#0", prompt_ids=np.arange(2, dtype=np.int32), n=1)
    t = traj(item, 0, None, *err)
    t.finish_reason = finish
    got, got_field = none_cause(t, builtin)
    assert cause in got and got_field == field


async def test_verl_parquet_with_builtin_reward_trains_on_a_real_cluster(tmp_path: Path) -> None:
    """The issue's report, end to end: verl parquet + built-in reward used to drop every group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from laminar.cluster import LocalCluster
    from laminar.config import config_from_dict
    from laminar.models.tiny import build_tiny_model

    model = build_tiny_model(
        tmp_path / "model", hidden=32, layers=1, heads=2, kv_heads=1, max_positions=128
    )
    pq.write_table(pa.Table.from_pylist(VERL_ROWS[:4]), tmp_path / "train.parquet")
    cfg = config_from_dict(
        {
            "name": "verl-e2e",
            "run_dir": str(tmp_path / "run"),
            "cluster": {"transport": "inproc", "roles": {"manager": 1, "buffer": 1, "rollout": 1}},
            "transport": {
                "heartbeat_interval_s": 0.1,
                "heartbeat_liveness": 10,
                "startup_timeout_s": 30.0,
                "stop_timeout_s": 5.0,
            },
            "model": {"path": str(model)},
            "data": {"train": str(tmp_path / "train.parquet"), "epochs": 1, "shuffle": False},
            "reward": {"fn": "laminar.rewards.builtin:math_verify", "workers": 0},
            "rollout": {
                "engine": "torch",
                "group_size": 2,
                "credits": 4,
                "sampling": {"max_tokens": 6},
            },
            "buffer": {"retry_after_s": 0.05, "stall_window": 8},
        }
    )
    async with LocalCluster(cfg) as cluster:
        buf = cluster.node("buffer-0")
        deadline = asyncio.get_running_loop().time() + 60
        while buf.state.counts["trajectories"] < 8:
            cluster.check()
            assert asyncio.get_running_loop().time() < deadline, dict(buf.state.counts)
            await asyncio.sleep(
                0.05
            )  # poll of a condition with no event of its own, under a deadline
        trajs = [t for g in buf.state.groups.values() for t in g.members.values()]
        assert len(trajs) == 8 and all(t.reward in (0.0, 1.0) for t in trajs), [
            (t.reward_error_kind, t.reward_error) for t in trajs
        ]
        assert buf.state.counts["groups_ready"] == 4 and buf.state.counts["groups_dropped"] == 0
        assert buf.health.warnings == {} and buf.status().warnings == []
