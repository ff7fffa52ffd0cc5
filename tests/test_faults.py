"""Failure isolation with real processes and `kill -9`: nothing lost, nothing consumed twice.

    .venv/bin/python -m pytest tests/test_faults.py -q -m slow

Each test starts its own nodes as `python -m laminar node --role ROLE ...` processes (manager,
buffer, sim trainer, rollout-0 alone, rollouts 1-3 in one process) over ipc in a private
directory, kills one by pid with SIGKILL mid-run, restarts it where the scenario says so, and
lets the job run to its natural end: one epoch of P prompts (data.epochs = 1), after which the
trainer finishes on its own ("data exhausted"). Then, from the files the nodes wrote:

  * consumption (trainer run_dir/consumed.jsonl; a restarted trainer re-logs the steps after its
    checkpoint, so the last record of each step counts): every prompt consumed exactly once as a
    whole group of n samples, no uid twice;
  * the buffer journal, replayed offline: every group committed, nothing held, dropped or abandoned;
  * the manager's timeline (run_dir/timeline.jsonl): death detected within 3 s of the kill
    (heartbeats every 0.25 s, dead after 8 missed = 2 s), recovery, a rejoin.

The rollout kill also runs in mode partial (AReaL-style partial rollout: trajectories span
versions), where recovery continues a dead rollout's partials under a newer version.

Trainer commits are checkpoint-gated (trainer.commit=checkpoint, checkpoint_every=1), which is
the exactly-once setting; with commit=step a trainer crash loses (never repeats) the updates
since its last checkpoint. Tests stop only the processes they started, by pid.
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
from tests.sim_cluster import PROCESS_FAULT_TRANSPORT, read_jsonl, write_prompts

pytestmark = pytest.mark.slow

PROMPTS = 48
GROUP = 2
DEADLINE_S = 150.0  # start-up of five Python processes plus the run, on 2 busy cores


class Procs:
    """The nodes of one test: start by role, kill -9 by name, stop all (only these pids)."""

    def __init__(self, tmp: Path, ipc_dir: Path, mode: str = "laminar"):
        self.tmp = tmp
        cfg = {
            "name": "faults",
            "mode": mode,
            "run_dir": str(tmp / "run"),
            "cluster": {
                "transport": "ipc",
                "ipc_dir": str(ipc_dir),
                "roles": {"manager": 1, "buffer": 1, "relay": 0, "trainer": 1, "rollout": 4},
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
                "partial_chunk_tokens": 16,
                "prompt_retry_s": 0.1,
                "refresh_wait_s": 2.0,
                "sampling": {"max_tokens": 1000},
                "sim": {
                    "step_time_s": 0.01,
                    "bound_b": 8,
                    "length_p50": 100,
                    "length_p99_over_p50": 10,
                    "kv_capacity_tokens": 8 * 1100,
                },
            },
            "trainer": {
                "engine": "sim",
                "batch_groups": 4,
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
        self.log_files: dict[str, list[Path]] = {}

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
        path = self.tmp / f"{name}.{len(self.started)}.log"
        self.log_files.setdefault(name, []).append(path)
        log = open(path, "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        self.started.append(proc)

    def start_all(self) -> None:
        self.start("manager", "manager")
        self.start("buffer", "buffer")
        self.start("trainer", "trainer")
        self.start("rollout-0", "rollout", 0)
        self.start("rollouts", "rollout", 1, 3)

    def kill9(self, name: str) -> float:
        t = time.time()
        os.kill(self.procs[name].pid, signal.SIGKILL)
        assert self.procs[name].wait(10) == -signal.SIGKILL
        return t

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

    # ---- what the nodes wrote -------------------------------------------------------------
    def timeline(self) -> list[dict]:
        return read_jsonl(self.run_dir / "timeline.jsonl")

    def steps(self) -> list[dict]:
        return read_jsonl(self.run_dir / "consumed.jsonl")

    def status(self) -> dict:
        from laminar.launch.status import fetch_status

        reply = fetch_status(self.cfg, timeout=1.0)
        return {e.node_id: e for e in reply.nodes}

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

    def wait_all_registered(self) -> None:
        want = {"buffer-0", "trainer-0", "rollout-0", "rollout-1", "rollout-2", "rollout-3"}
        self.wait(
            lambda: want <= {k for k, e in self.status().items() if e.alive},
            "every node registered",
        )

    def wait_trainer_done(self) -> None:
        self.wait(lambda: self.procs["trainer"].poll() == 0, "the trainer finishing the epoch")

    def check_exactly_once(self) -> list[dict]:
        """Every prompt consumed once, as a whole group; the journal agrees. Returns the effective
        steps."""
        last: dict[int, dict] = {}
        for rec in self.steps():  # a restarted trainer re-logs the steps after its checkpoint
            last[rec["step"]] = rec
        eff = [last[k] for k in sorted(last)]
        uids = [u for rec in eff for u in rec["uids"]]
        dup = [u for u, c in Counter(uids).items() if c > 1]
        assert not dup, f"consumed twice: {dup[:5]}"
        groups = Counter(u.rpartition("/")[0] for u in uids)
        assert set(groups.values()) == {GROUP}, "a consumed group was not whole"
        prompts = Counter(g.split("@")[0] for g in groups)
        assert len(prompts) == PROMPTS and set(prompts.values()) == {1}, (
            "a prompt was lost or consumed twice"
        )
        self.check_journal(len(groups))
        return eff

    def check_journal(self, n_groups: int) -> None:
        from laminar.journal_check import replay_buffer_journal
        from laminar.wiring.buffer import experience_state

        journal = self.run_dir / "buffer-0.journal"
        s = replay_buffer_journal(journal, experience_state(self.cfg))[0].summary()
        assert s["held"] == 0 and s["pending"] == 0 and s["outstanding_batches"] == 0, s
        assert (
            s.get("groups_committed") == n_groups
            and not s.get("groups_dropped")
            and not s.get("abandoned")
        ), s


@pytest.fixture
def procs(tmp_path, short_dir):
    p = Procs(tmp_path, short_dir)
    yield p
    p.stop_all()


def events(p: Procs, kind: str, node: str) -> list[dict]:
    return [
        e for e in p.timeline() if e["event"] == kind and e.get("node", e.get("rollout")) == node
    ]


def test_killed_rollout_is_detected_within_3s_its_work_recovered_and_it_rejoins(procs):
    procs.start_all()
    procs.wait_all_registered()
    procs.wait(
        lambda: len(procs.steps()) >= 2 and procs.status()["rollout-0"].status.inflight > 0,
        "training under way, rollout-0 generating",
    )
    t_kill = procs.kill9("rollout-0")
    dead = procs.wait(
        lambda: events(procs, "dead", "rollout-0"), "the manager declaring rollout-0 dead", 10
    )
    detect_s = dead[0]["t"] - t_kill
    print(f"death detected {detect_s:.2f} s after kill -9")
    assert detect_s <= 3.0
    rec = procs.wait(
        lambda: events(procs, "recovery", "rollout-0"), "recovery of rollout-0's trajectories", 15
    )
    assert rec[0]["trajectories"] >= 1 and rec[0]["orphans"] == 0, rec
    procs.start("rollout-0", "rollout", 0)  # the same node comes back: re-admitted, takes new work
    procs.wait(
        lambda: [e for e in events(procs, "join", "rollout-0") if e.get("rejoin")],
        "rollout-0 rejoining",
    )
    procs.wait(
        lambda: [
            e
            for e in events(procs, "rollout", "rollout-0")
            if e["t"] > dead[0]["t"] and e["inflight"]
        ],
        "the rejoined rollout generating",
    )
    procs.wait_trainer_done()
    procs.stop_all()
    procs.check_exactly_once()


def test_killed_rollout_in_partial_mode_loses_nothing_and_duplicates_nothing(tmp_path, short_dir):
    """Mode partial (AReaL-style): updates interrupt the rollouts' trajectories, which continue
    under the new version. kill -9 of a rollout mid-trajectory: its partials (tokens spanning
    versions) resume on a live rollout at their newest version or later; every prompt is still
    consumed exactly once."""
    procs = Procs(tmp_path, short_dir, mode="partial")
    try:
        procs.start_all()
        procs.wait_all_registered()
        procs.wait(
            lambda: len(procs.steps()) >= 2 and procs.status()["rollout-0"].status.inflight > 0,
            "training under way, rollout-0 generating",
        )
        procs.kill9("rollout-0")
        rec = procs.wait(
            lambda: events(procs, "recovery", "rollout-0"), "recovery of rollout-0's work", 15
        )
        assert rec[0]["trajectories"] >= 1 and rec[0]["orphans"] == 0, rec
        procs.wait_trainer_done()
        procs.stop_all()
        procs.check_exactly_once()
        spanned = sum(
            m.get("spanning_versions", 0) for m in read_jsonl(procs.run_dir / "metrics.jsonl")
        )
        assert spanned > 0, "no consumed trajectory spanned versions: nothing was interrupted"
    finally:
        procs.stop_all()


def test_killed_buffer_restarts_from_its_journal_and_training_continues(procs):
    procs.start_all()
    procs.wait_all_registered()
    procs.wait(lambda: len(procs.steps()) >= 3, "three training steps")
    procs.kill9("buffer")
    before = len(procs.steps())
    time.sleep(1.5)  # the outage itself: rollouts hold finished trajectories in their outboxes
    procs.start("buffer", "buffer")
    procs.wait_trainer_done()
    procs.stop_all()
    eff = procs.check_exactly_once()
    assert len(eff) > before, "training did not continue after the buffer restart"


def test_killed_trainer_resumes_from_its_checkpoint_while_rollouts_keep_generating(procs):
    procs.start_all()
    procs.wait_all_registered()
    procs.wait(lambda: len(procs.steps()) >= 3, "three training steps")
    procs.kill9("trainer")

    def served() -> int:
        return procs.status()["buffer-0"].status.extra["prompts_served"]

    def held() -> int:
        return procs.status()["buffer-0"].status.extra["held"]

    s0, h0 = procs.wait(lambda: (served(), held()), "buffer status")
    # the outage: rollouts keep generating, the buffer keeps accepting finished trajectories
    procs.wait(
        lambda: held() > h0 + GROUP, "the buffer accepting trajectories without a trainer", 20
    )
    assert served() >= s0
    procs.start("trainer", "trainer")  # trainer.resume=auto: from the newest checkpoint in run_dir
    procs.wait_trainer_done()
    procs.stop_all()
    eff = procs.check_exactly_once()
    assert [r["step"] for r in eff] == list(range(1, len(eff) + 1))
    restarted = procs.log_files["trainer"][-1].read_text()
    assert '"event": "resumed"' in restarted, restarted[-2000:]
