"""kill -9 in a colocated run (docs/colocated.md, Failures): real node processes over ipc (manager,
buffer, torch trainer, one torch rollout sharing "the device"), one epoch of PROMPTS prompts in
mode sync with checkpoint-gated commits (the exactly-once setting).

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_colocate_faults.py -q -m slow

Each test kills one node at a chosen point of the sleep / wake cycle, restarts it as a
supervisor would (`laminar run`'s restart is tests/test_supervision.py's), and checks that the
run finishes its epoch with every prompt consumed exactly once as a whole group and the buffer
journal clean (tests/procs.py check_exactly_once):

  * the rollout, while generating (its trajectories recovered from the partial pool);
  * the rollout, asleep while the trainer holds the device (its restart joins asleep and is
    woken with the new version);
  * the trainer, while it holds the device (the manager wakes the rollout; the restarted trainer
    resumes from its checkpoint and asks for the device again).

The states are reached deterministically through tests/colocate_faults.py: the trainer holds the
device at a chosen step until the test writes a file, the rollout's engine stops a few decode
steps into a batch (trajectories in flight) for the kill while generating, and the rollout
ignores end-of-sequence so its trajectories run max_tokens long. Tests stop only the processes
they started.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.procs import Procs, fault_config

pytestmark = pytest.mark.slow

PROMPTS = 12
GROUP = 2
HOLD_STEP = 2
FAULTS = str(Path(__file__).resolve().parent / "colocate_faults.py")
NO_EOS = (FAULTS, "no-eos")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from laminar.models.tiny import build_tiny_model
    from laminar.tasks import countup

    shape = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "max_positions": 128}
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", alphabet=countup.ALPHABET, **shape
    )


def colocated(tmp: Path, ipc_dir: Path, model: Path) -> Procs:
    from laminar.tasks import countup

    data = tmp / "countup.jsonl"
    rows = [countup.make_prompt(10 + i, 1 + i % 5, 90) for i in range(PROMPTS)]
    data.write_text(
        "".join(
            json.dumps({"uid": f"p{i}", "prompt": p, "answer": countup.answer_of(p)}) + "\n"
            for i, p in enumerate(rows)
        )
    )
    cfg = fault_config(
        tmp,
        ipc_dir,
        name="colocate-faults",
        prompts=PROMPTS,
        group=GROUP,
        roles={"manager": 1, "buffer": 1, "relay": 0, "trainer": 1, "rollout": 1},
        over={
            "mode": "sync",
            "cluster": {
                "placement": "colocated",
                "threads_per_process": 1,
                "colocate": {"sleep_timeout_s": 30.0, "wake_timeout_s": 30.0},
            },
            "model": {"path": str(model)},
            "data": {"train": str(data)},
            "reward": {"fn": "laminar.tasks.countup:reward", "workers": 0},
            "rollout": {
                "engine": "torch",
                "weights": "dir",
                "partial_chunk_tokens": 8,  # the buffer holds what a killed rollout generated
                "sampling": {"max_tokens": 64},
            },
            "trainer": {"engine": "torch", "batch_groups": 2, "lr": 1e-3},
        },
    )
    return Procs(tmp, cfg)


@pytest.fixture
def procs(tmp_path, short_dir, tiny_model):
    p = colocated(tmp_path, short_dir, tiny_model)
    yield p
    p.stop_all()


def events(p: Procs, kind: str, node: str | None = None) -> list[dict[str, Any]]:
    return [
        e
        for e in p.timeline()
        if e["event"] == kind and node in (None, e.get("node", e.get("rollout")))
    ]


def rollout_asleep(p: Procs) -> bool:
    entry = p.status()["rollout-0"]
    return bool(entry.alive and entry.status.rollout and entry.status.rollout.asleep)


def hold_at(p: Procs, step: int) -> tuple[str, ...]:
    """The trainer's command: hold the device at `step` until p.tmp/release exists."""
    return (FAULTS, "hold", str(p.tmp), str(step))


def check_cycles(p: Procs) -> list[dict[str, Any]]:
    """Every prompt once, the journal clean; every logged step went through a sleep / wake cycle.
    Returns the effective steps."""
    eff, _ = p.check_exactly_once(PROMPTS, GROUP)
    assert [r["step"] for r in eff] == list(range(1, PROMPTS // 2 + 1))
    rows = [
        json.loads(line) for line in (p.run_dir / "metrics.jsonl").open() if "colocate/" in line
    ]
    assert {r["step"] for r in rows} == {r["step"] for r in eff}, "a step without a cycle"
    assert all(r["colocate/trainer_onload_bytes"] > 0 for r in rows)
    return eff


def start_all(
    procs: Procs, trainer_via: tuple[str, ...] = (), rollout_via: tuple[str, ...] = NO_EOS
) -> None:
    procs.start("manager", "manager")
    procs.start("buffer", "buffer")
    procs.start("trainer", "trainer", via=trainer_via)
    procs.start("rollout-0", "rollout", 0, via=rollout_via)
    procs.wait_registered({"buffer-0", "trainer-0", "rollout-0"})


def test_colocated_rollout_killed_while_generating_is_recovered_and_rejoins(procs):
    start_all(procs, rollout_via=(*NO_EOS, "hold-gen", str(procs.tmp)))
    procs.wait(
        lambda: len(procs.steps()) >= 1 and (procs.tmp / "generating").exists(),
        "a step trained, rollout-0 mid-generation of the next batch",
    )
    procs.wait(  # (the engine is stopped mid-batch: the status settles on this)
        lambda: procs.status()["rollout-0"].status.inflight > 0 and not rollout_asleep(procs),
        "rollout-0 awake with trajectories in flight",
        30,
    )
    procs.kill9("rollout-0")
    procs.wait(lambda: events(procs, "dead", "rollout-0"), "rollout-0 declared dead", 15)
    rec = procs.wait(lambda: events(procs, "recovery", "rollout-0"), "recovery of its work", 20)
    # no other rollout: its partials wait as orphans and go to its restart (no trajectory lost)
    assert rec[0]["trajectories"] >= 1 and rec[0]["orphans"] == rec[0]["trajectories"], rec
    procs.start("rollout-0", "rollout", 0, via=NO_EOS)  # as the supervisor would
    procs.wait(
        lambda: [e for e in events(procs, "join", "rollout-0") if e.get("rejoin")],
        "rollout-0 rejoining",
    )
    procs.wait_trainer_done()
    procs.stop_all()
    rows = check_cycles(procs)
    assert len(rows) == PROMPTS // 2


def test_colocated_rollout_killed_asleep_restarts_asleep_and_wakes_on_the_new_version(procs):
    start_all(procs, trainer_via=hold_at(procs, HOLD_STEP))
    procs.wait(
        lambda: (procs.tmp / "holding").exists() and rollout_asleep(procs),
        "the trainer holding the device, rollout-0 asleep",
    )
    procs.kill9("rollout-0")
    dead = procs.wait(lambda: events(procs, "dead", "rollout-0"), "rollout-0 declared dead", 15)
    procs.start("rollout-0", "rollout", 0, via=NO_EOS)
    # it joins while the trainer still holds the device: the manager puts it to sleep at once
    procs.wait(
        lambda: (
            [e for e in events(procs, "join", "rollout-0") if e["t"] > dead[0]["t"]]
            and rollout_asleep(procs)
        ),
        "the restarted rollout-0 joining asleep",
    )
    (procs.tmp / "release").write_text("go")
    awake = procs.wait(
        lambda: [e for e in events(procs, "colocate_awake") if e["version"] >= HOLD_STEP],
        "the restarted rollout-0 woken with the trainer's new version",
    )
    assert awake[0]["rollouts"] == 1, awake
    procs.wait_trainer_done()
    procs.stop_all()
    check_cycles(procs)
    # the restart kept its trajectories: nothing was in flight while it slept
    rec = events(procs, "recovery", "rollout-0")
    assert rec and rec[0]["trajectories"] == 0 and rec[0]["orphans"] == 0, rec


def test_colocated_trainer_killed_holding_the_device_wakes_the_rollout_and_resumes(procs):
    start_all(procs, trainer_via=hold_at(procs, HOLD_STEP))
    procs.wait(
        lambda: (procs.tmp / "holding").exists() and rollout_asleep(procs),
        "the trainer holding the device, rollout-0 asleep",
    )
    procs.kill9("trainer")
    procs.wait(lambda: events(procs, "dead", "trainer-0"), "trainer-0 declared dead", 15)
    gone = procs.wait(
        lambda: events(procs, "colocate_trainer_gone"), "the manager waking the rollout", 15
    )
    assert gone[0]["version"] == HOLD_STEP - 1, gone
    procs.wait(lambda: not rollout_asleep(procs), "rollout-0 awake without a trainer", 30)
    procs.start("trainer", "trainer")  # trainer.resume=auto: from its newest checkpoint
    procs.wait_trainer_done()
    procs.stop_all()
    check_cycles(procs)
    restarted = procs.log("trainer")
    assert '"event": "resumed"' in restarted, restarted[-2000:]
