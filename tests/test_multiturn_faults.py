"""A rollout killed (SIGKILL) while its episodes are mid-tool-call: nothing lost, nothing twice.

    .venv/bin/python -m pytest tests/test_multiturn_faults.py -q      (~20 s: six processes)

Real processes over ipc in a private directory (the harness of tests/procs.py):
manager, buffer, sim trainer, a tools node, rollout-0 alone and rollouts 1-2 in one
process, all `python -m laminar node --role ROLE`. Episodes are 3-turn ScriptedEnv
episodes (tests/multiturn_fakes.py) on the sim engine; every turn's step calls the
side-effecting tool `append_call` on the tools node, which sleeps ~1 s and then appends
its call id to a file. rollout-0 is killed while it has episodes in flight (most of an
episode's time is spent waiting on that tool). Its episodes resume on the other rollouts
from the partial pool: their environment state is rebuilt by replay, tool calls answered
from the tools node's cache. Then, from what the nodes wrote:

  * every prompt consumed exactly once as a whole group (trainer consumed.jsonl), and the
    buffer journal agrees (nothing held, dropped or abandoned);
  * no call id in the side-effect file twice, and every consumed episode's 3 calls there;
  * the rest is counted: the manager recovered rollout-0's trajectories, and some delivered
    trajectory says it was resumed with cached tool calls.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from laminar.envs.base import call_id
from tests.procs import Procs, fault_config

PROMPTS = 12
GROUP = 2
TURNS = 3
TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture
def procs(tmp_path, short_dir):
    effects = tmp_path / "effects.txt"
    cfg = fault_config(
        tmp_path,
        short_dir,
        name="mtfaults",
        prompts=PROMPTS,
        group=GROUP,
        roles={"manager": 1, "buffer": 1, "relay": 0, "trainer": 1, "tools": 1, "rollout": 3},
        over={
            "rollout": {
                "partial_chunk_tokens": 8,
                "sampling": {"max_tokens": 400},
                "sim": {
                    "step_time_s": 0.01,
                    "length_p50": 12,
                    "length_p99_over_p50": 3,
                    "kv_capacity_tokens": 8 * 500,
                },
            },
            "env": {
                "fn": "multiturn_fakes:ScriptedEnv",
                "kwargs": {"turns": TURNS, "tool": "append_call", "path": str(effects)},
                "limits": {"turn_timeout_s": 30.0, "episode_timeout_s": 120.0},
            },
            "tools": {
                "tools": ["multiturn_fakes:append_call"],
                "workers": 6,
                "wall_s": 10.0,
                "cpu_s": 5.0,
                "memory_mb": 2048,
                "call_timeout_s": 30.0,
            },
            "trainer": {"batch_groups": 2},
            "manager": {"repack": {"interval_s": 1.0}},
        },
    )
    # the env and the tool live in tests/multiturn_fakes.py: rollouts, the tools node and its
    # sandbox workers import them by name
    p = Procs(tmp_path, cfg, pythonpath=[TESTS_DIR])
    yield p
    p.stop_all()


def effects_lines(p: Procs) -> list[str]:
    effects = p.tmp / "effects.txt"
    return effects.read_text().splitlines() if effects.exists() else []


def test_rollout_killed_mid_tool_call_loses_nothing_and_runs_no_call_twice(procs):
    for name, role, index, count in [
        ("manager", "manager", 0, 1),
        ("buffer", "buffer", 0, 1),
        ("trainer", "trainer", 0, 1),
        ("tools", "tools", 0, 1),
        ("rollout-0", "rollout", 0, 1),
        ("rollouts", "rollout", 1, 2),
    ]:
        procs.start(name, role, index, count)
    procs.wait_registered(
        {"buffer-0", "trainer-0", "tools-0", "rollout-0", "rollout-1", "rollout-2"}
    )
    # rollout-0 mid-episode: it has episodes in hand and tool calls have started (~1 s each, so its
    # episodes spend most of their time waiting on one)
    procs.wait(
        lambda: procs.status()["rollout-0"].status.inflight >= 2 and effects_lines(procs),
        "rollout-0 with episodes in flight, tool calls under way",
    )
    procs.kill9("rollout-0")
    procs.wait_trainer_done()
    procs.stop_all()

    # every prompt consumed exactly once, as a whole group; the buffer journal agrees
    steps, trajs = procs.check_exactly_once(PROMPTS, GROUP)
    uids = [u for rec in steps for u in rec["uids"]]

    # a side-effecting call never ran twice; every consumed episode made its calls
    lines = effects_lines(procs)
    dup = [c for c, n in Counter(lines).items() if n > 1]
    assert not dup, f"side-effecting tool ran twice: {dup[:5]}"
    assert {call_id(u, k, 0) for u in uids for k in range(TURNS)} <= set(lines)

    # the rest is counted: recovery of rollout-0's trajectories, resumed episodes with cached calls
    rec = [
        e
        for e in procs.timeline()
        if e["event"] == "recovery" and e.get("rollout", e.get("node")) == "rollout-0"
    ]
    assert rec and rec[0]["trajectories"] >= 1, rec
    by_uid = {t.uid: t for t in trajs}
    moved = [t for t in by_uid.values() if t.resumed >= 1]
    cached = sum(r.cached for t in moved for r in t.tool_calls)
    print(
        f"{len(moved)} episodes resumed elsewhere, {cached} of their calls answered from the cache"
    )
    assert moved, "no episode resumed elsewhere"
    assert any(r.cached for t in moved for r in t.tool_calls), (
        "no replayed or repeated call hit the cache"
    )
    for t in by_uid.values():
        assert t.loss_mask is not None and len(t.loss_mask) == len(t.response_ids)
        assert t.turns == TURNS and t.finish_reason == "stop" and len(t.tool_calls) == TURNS, (
            t.uid,
            t.turns,
        )
        assert [r.call_id for r in t.tool_calls] == [call_id(t.uid, k, 0) for k in range(TURNS)]
