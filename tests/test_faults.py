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

import time
from pathlib import Path

import pytest

from tests.procs import Procs, fault_config
from tests.sim_cluster import read_jsonl

pytestmark = pytest.mark.slow

PROMPTS = 48
GROUP = 2
ROLLOUTS = {"rollout-0", "rollout-1", "rollout-2", "rollout-3"}


def cluster(tmp: Path, ipc_dir: Path, mode: str = "laminar") -> Procs:
    cfg = fault_config(
        tmp,
        ipc_dir,
        name="faults",
        prompts=PROMPTS,
        group=GROUP,
        roles={"manager": 1, "buffer": 1, "relay": 0, "trainer": 1, "rollout": 4},
        over={
            "mode": mode,
            "rollout": {
                "partial_chunk_tokens": 16,
                "sampling": {"max_tokens": 1000},
                "sim": {
                    "step_time_s": 0.01,
                    "length_p50": 100,
                    "length_p99_over_p50": 10,
                    "kv_capacity_tokens": 8 * 1100,
                },
            },
            "trainer": {"batch_groups": 4},
            "manager": {"repack": {"interval_s": 1.0}},
        },
    )
    return Procs(tmp, cfg)


def start_all(procs: Procs) -> None:
    """Manager, buffer, sim trainer, rollout-0 alone and rollouts 1-3 in one process."""
    procs.start("manager", "manager")
    procs.start("buffer", "buffer")
    procs.start("trainer", "trainer")
    procs.start("rollout-0", "rollout", 0)
    procs.start("rollouts", "rollout", 1, 3)
    procs.wait_registered({"buffer-0", "trainer-0", *ROLLOUTS})


@pytest.fixture
def procs(tmp_path, short_dir):
    p = cluster(tmp_path, short_dir)
    yield p
    p.stop_all()


def events(p: Procs, kind: str, node: str) -> list[dict]:
    return [
        e for e in p.timeline() if e["event"] == kind and e.get("node", e.get("rollout")) == node
    ]


def test_killed_rollout_is_detected_within_3s_its_work_recovered_and_it_rejoins(procs):
    start_all(procs)
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
    procs.check_exactly_once(PROMPTS, GROUP)


def test_killed_rollout_in_partial_mode_loses_nothing_and_duplicates_nothing(tmp_path, short_dir):
    """Mode partial (AReaL-style): updates interrupt the rollouts' trajectories, which continue
    under the new version. kill -9 of a rollout mid-trajectory: its partials (tokens spanning
    versions) resume on a live rollout at their newest version or later; every prompt is still
    consumed exactly once."""
    procs = cluster(tmp_path, short_dir, mode="partial")
    try:
        start_all(procs)
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
        procs.check_exactly_once(PROMPTS, GROUP)
        spanned = sum(
            m.get("spanning_versions", 0) for m in read_jsonl(procs.run_dir / "metrics.jsonl")
        )
        assert spanned > 0, "no consumed trajectory spanned versions: nothing was interrupted"
    finally:
        procs.stop_all()


def test_killed_buffer_restarts_from_its_journal_and_training_continues(procs):
    start_all(procs)
    procs.wait(lambda: len(procs.steps()) >= 3, "three training steps")
    procs.kill9("buffer")
    before = len(procs.steps())
    time.sleep(1.5)  # the outage itself: rollouts hold finished trajectories in their outboxes
    procs.start("buffer", "buffer")
    procs.wait_trainer_done()
    procs.stop_all()
    eff, _ = procs.check_exactly_once(PROMPTS, GROUP)
    assert len(eff) > before, "training did not continue after the buffer restart"


def test_killed_trainer_resumes_from_its_checkpoint_while_rollouts_keep_generating(procs):
    start_all(procs)
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
    eff, _ = procs.check_exactly_once(PROMPTS, GROUP)
    assert [r["step"] for r in eff] == list(range(1, len(eff) + 1))
    restarted = procs.log("trainer")
    assert '"event": "resumed"' in restarted, restarted[-2000:]
