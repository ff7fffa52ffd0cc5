"""A rollout killed (SIGKILL) while its episodes are mid-tool-call: nothing lost, nothing twice.

    .venv/bin/python -m pytest tests/test_multiturn_faults.py -q      (~20 s: six processes)

Real processes over ipc in a private directory (the pattern of tests/test_faults.py):
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

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from laminar.config import load_config
from laminar.envs.base import call_id
from laminar.protocol.data import Trajectory
from tests.sim_cluster import PROCESS_FAULT_TRANSPORT, read_jsonl, write_prompts

PROMPTS = 12
GROUP = 2
TURNS = 3
DEADLINE_S = 150.0
TESTS_DIR = Path(__file__).resolve().parent


class Procs:
    """The nodes of this test: start by role, kill -9 by name, stop all (only these pids)."""

    def __init__(self, tmp: Path, ipc_dir: Path):
        self.tmp = tmp
        self.effects = tmp / "effects.txt"
        cfg = {
            "name": "mtfaults",
            "mode": "laminar",
            "run_dir": str(tmp / "run"),
            "cluster": {
                "transport": "ipc",
                "ipc_dir": str(ipc_dir),
                "roles": {
                    "manager": 1,
                    "buffer": 1,
                    "relay": 0,
                    "trainer": 1,
                    "tools": 1,
                    "rollout": 3,
                },
            },
            "transport": dict(PROCESS_FAULT_TRANSPORT),
            "data": {
                "train": str(write_prompts(tmp / "prompts.jsonl", PROMPTS)),
                "epochs": 1,
                "shuffle": False,
            },
            "rollout": {
                "engine": "sim",
                "group_size": GROUP,
                "credits": 2,
                "max_running": 8,
                "partial_chunk_tokens": 8,
                "prompt_retry_s": 0.1,
                "refresh_wait_s": 2.0,
                "sampling": {"max_tokens": 400},
                "sim": {
                    "step_time_s": 0.01,
                    "bound_b": 8,
                    "length_p50": 12,
                    "length_p99_over_p50": 3,
                    "kv_capacity_tokens": 8 * 500,
                },
            },
            "env": {
                "fn": "multiturn_fakes:ScriptedEnv",
                "kwargs": {"turns": TURNS, "tool": "append_call", "path": str(self.effects)},
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
            "trainer": {
                "engine": "sim",
                "batch_groups": 2,
                "total_steps": 1000,
                "sim_time_per_token_s": 2e-4,
                "checkpoint_every": 1,
                "commit": "checkpoint",
                "batch_wait_s": 0.5,
            },
            "buffer": {"fsync": "always", "retry_after_s": 0.1},
            "manager": {"repack": {"interval_s": 1.0}, "timeline_interval_s": 0.25},
            "logging": {"level": "info"},
        }
        self.cfg_path = tmp / "config.yaml"
        self.cfg_path.write_text(yaml.safe_dump(cfg))
        self.cfg = load_config(self.cfg_path)
        self.run_dir = Path(cfg["run_dir"])
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: list[subprocess.Popen] = []
        # the env and the tool live in tests/multiturn_fakes.py: rollouts, the tools node and its
        # sandbox workers import them by name
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(TESTS_DIR), self.env.get("PYTHONPATH", "")) if p
        )

    def start(self, name: str, role: str, index: int = 0, count: int = 1) -> None:
        cmd = [
            sys.executable,
            "-m",
            "laminar",
            "node",
            "--role",
            role,
            "--index",
            str(index),
            "--count",
            str(count),
            "--config",
            str(self.cfg_path),
        ]
        log = open(self.tmp / f"{name}.{len(self.started)}.log", "w")
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
        )
        self.procs[name] = proc
        self.started.append(proc)

    def kill9(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGKILL)
        assert self.procs[name].wait(10) == -signal.SIGKILL

    def stop_all(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.started:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def logs(self) -> str:
        return "\n".join(
            f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.tmp.glob("*.log"))
        )

    def status(self) -> dict:
        from laminar.launch.status import fetch_status

        return {e.node_id: e for e in fetch_status(self.cfg, timeout=1.0).nodes}

    def wait(self, cond, what: str, timeout: float = DEADLINE_S, every: float = 0.2):
        """Poll a condition (files or the manager's table) against a deadline; returns its value."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"{name} exited with {p.returncode}\n{self.logs()}")
            try:
                value = cond()
            except Exception:  # the manager is not up yet / a file is mid-write
                value = None
            if value:
                return value
            time.sleep(every)  # polling processes and files; no event to wait on across processes
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")

    def effects_lines(self) -> list[str]:
        return self.effects.read_text().splitlines() if self.effects.exists() else []


@pytest.fixture
def procs(tmp_path, short_dir):
    p = Procs(tmp_path, short_dir)
    yield p
    p.stop_all()


def journal_trajectories(p: Procs) -> tuple[dict, list[Trajectory]]:
    from laminar.journal_check import replay_buffer_journal
    from laminar.wiring.buffer import experience_state

    state, trajs = replay_buffer_journal(p.run_dir / "buffer-0.journal", experience_state(p.cfg))
    return state.summary(), trajs


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
    want = {"buffer-0", "trainer-0", "tools-0", "rollout-0", "rollout-1", "rollout-2"}
    procs.wait(
        lambda: want <= {k for k, e in procs.status().items() if e.alive}, "every node registered"
    )
    # rollout-0 mid-episode: it has episodes in hand and tool calls have started (~1 s each, so its
    # episodes spend most of their time waiting on one)
    procs.wait(
        lambda: procs.status()["rollout-0"].status.inflight >= 2 and procs.effects_lines(),
        "rollout-0 with episodes in flight, tool calls under way",
    )
    procs.kill9("rollout-0")
    procs.wait(lambda: procs.procs["trainer"].poll() == 0, "the trainer finishing the epoch")
    procs.stop_all()

    # every prompt consumed exactly once, as a whole group (the last record of each step counts)
    last: dict[int, dict] = {}
    for rec in read_jsonl(procs.run_dir / "consumed.jsonl"):
        last[rec["step"]] = rec
    uids = [u for k in sorted(last) for u in last[k]["uids"]]
    assert not [u for u, c in Counter(uids).items() if c > 1], "consumed twice"
    groups = Counter(u.rpartition("/")[0] for u in uids)
    assert set(groups.values()) == {GROUP} and len({g.split("@")[0] for g in groups}) == PROMPTS
    summary, trajs = journal_trajectories(procs)
    assert (
        summary["held"] == 0 and summary["pending"] == 0 and summary["outstanding_batches"] == 0
    ), summary
    assert summary.get("groups_committed") == len(groups) and not summary.get("groups_dropped"), (
        summary
    )
    assert not summary.get("abandoned"), summary

    # a side-effecting call never ran twice; every consumed episode made its calls
    lines = procs.effects_lines()
    dup = [c for c, n in Counter(lines).items() if n > 1]
    assert not dup, f"side-effecting tool ran twice: {dup[:5]}"
    assert {call_id(u, k, 0) for u in uids for k in range(TURNS)} <= set(lines)

    # the rest is counted: recovery of rollout-0's trajectories, resumed episodes with cached calls
    timeline = read_jsonl(procs.run_dir / "timeline.jsonl")
    rec = [
        e
        for e in timeline
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
