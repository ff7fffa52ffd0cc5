"""Asynchronous sharded checkpoints (trainer.checkpoint_async): training goes on while the shards
are written, and a checkpoint counts only once they are on disk.

    .venv/bin/python -m pytest tests/test_checkpoint_async.py -q

The writer is gated (a DCP FileSystemWriter whose write_data waits on an event), so "the save is
still in flight" is a fact the test holds, not a race it hopes to win. One process
(checkpoint_format=sharded on world 1: the same DCP code path as FSDP's ranks, without the group).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from laminar.trainer import checkpoint as ck
from laminar.trainer.batch import TrainBatch
from laminar.trainer.torch_trainer import TorchTrainer
from laminar.wiring.trainer import trainer_settings
from tests.test_trainer import make_cfg, make_trajs, params
from tests.test_trainer_node import harness  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parents[1]
GATE_DEADLINE_S = 120.0


class GatedWriter(FileSystemWriter):
    """Writes nothing until `gate` is set (`entered` says the writer thread got there)."""

    def __init__(self, path: str, gate: threading.Event, entered: threading.Event):
        super().__init__(path)
        self.gate, self.entered = gate, entered

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        self.entered.set()
        if not self.gate.wait(GATE_DEADLINE_S):
            raise TimeoutError("the test never opened the gate")
        return super().write_data(plan, planner)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from laminar.models.tiny import build_tiny_model

    return str(
        build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2, heads=2, kv_heads=1)
    )


def policy_of(tiny: str, run: Path) -> TorchTrainer:
    cfg = make_cfg(tiny, run, checkpoint_format="sharded", checkpoint_async=True, warmup_steps=2)
    return TorchTrainer(trainer_settings(cfg), tiny)


def step(policy: TorchTrainer, seed: int) -> float:
    return policy.train_step(TrainBatch.build(make_trajs(seed=seed)))["loss"]


def test_training_goes_on_while_the_save_is_in_flight(tiny, tmp_path, monkeypatch):
    run = tmp_path / "run"
    policy = policy_of(tiny, run)
    step(policy, 1)
    first = policy.save(run, 1, {"version": 1, "frontier": {}}, keep=3)
    assert first.wait() == run / "checkpoints" / "step_00000001"
    step(policy, 2)
    at_save = params(policy)
    gate, entered = threading.Event(), threading.Event()
    monkeypatch.setattr(ck, "storage_writer", lambda path: GatedWriter(path, gate, entered))
    pending = policy.save(run, 2, {"version": 2, "frontier": {}}, keep=3)
    try:
        assert entered.wait(GATE_DEADLINE_S)  # the writer thread holds the save
        step(policy, 3)  # a whole training step while the shards are not written
        assert not pending.done()
        assert params(policy)["model.norm.weight"].ne(at_save["model.norm.weight"]).any()
        # not a checkpoint yet: resume would pick step 1
        assert ck.latest_checkpoint(run) == run / "checkpoints" / "step_00000001"
        assert not (run / "checkpoints" / ".tmp-step_00000002" / "meta.json").exists()
    finally:
        gate.set()
    assert pending.wait() == run / "checkpoints" / "step_00000002"
    assert ck.latest_checkpoint(run) == run / "checkpoints" / "step_00000002"
    meta = json.loads((run / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["step"] == 2 and meta["version"] == 2
    # the checkpoint holds the weights as staged (after step 2), not as they were when written
    fresh = policy_of(tiny, run)
    assert ck.restore_trainer(fresh, run / "checkpoints" / "step_00000002")["step"] == 2
    got = params(fresh)
    assert all(torch.equal(got[k], at_save[k]) for k in at_save)
    assert fresh.scheduler.state_dict()["last_epoch"] == 2


def test_the_next_save_waits_for_the_one_in_flight(tiny, tmp_path, monkeypatch):
    """At most one save in flight: the second one waits (PendingSave.waited_s > 0) and both land
    in order."""
    run = tmp_path / "run"
    policy = policy_of(tiny, run)
    step(policy, 1)
    gate, entered = threading.Event(), threading.Event()
    monkeypatch.setattr(ck, "storage_writer", lambda path: GatedWriter(path, gate, entered))
    first = policy.save(run, 1, {"version": 1}, keep=3)
    assert entered.wait(GATE_DEADLINE_S)
    step(policy, 2)
    waiting = threading.Event()
    land = first.wait

    def wait_and_tell():  # the second save got to waiting for the first
        waiting.set()
        return land()

    first.wait = wait_and_tell  # type: ignore[method-assign]
    saved: list[ck.PendingSave] = []
    second_save = threading.Thread(
        target=lambda: saved.append(policy.save(run, 2, {"version": 2}, keep=3))
    )
    second_save.start()
    try:
        assert waiting.wait(GATE_DEADLINE_S)
        assert not first.done()  # still gated: the second save is waiting on it
    finally:
        gate.set()
        second_save.join(GATE_DEADLINE_S)
    (second,) = saved
    assert first.done() and second.waited_s > 0
    assert first.wait() is not None and second.wait() is not None
    assert [p.name for p in ck.list_checkpoints(run)] == ["step_00000001", "step_00000002"]


KILLED = """
import os, signal, sys, threading
from pathlib import Path
sys.path.insert(0, {root!r})
from laminar.trainer import checkpoint as ck
from tests.test_checkpoint_async import GatedWriter, policy_of, step
run = Path({run!r})
policy = policy_of({tiny!r}, run)
step(policy, 1)
policy.save(run, 1, {meta1}, keep=3).wait()
step(policy, 2)
gate, entered = threading.Event(), threading.Event()
ck.storage_writer = lambda path: GatedWriter(path, gate, entered)
policy.save(run, 2, {meta2}, keep=3)  # staged, not written
assert entered.wait(60)
step(policy, 3)
os.kill(os.getpid(), signal.SIGKILL)  # killed between staging and completion
"""


def owed(batch: str, step: int) -> dict:
    return {"uncommitted": [{"batch_id": batch, "step": step, "version": step}]}


def test_a_kill_after_staging_resumes_from_the_previous_checkpoint(tiny, tmp_path):
    """Nothing of the save in flight counts: resume finds step 1 with its frontier (the batches
    after it were never committed in commit=checkpoint mode, so the buffer serves them again),
    and the next step's loss is the uninterrupted run's."""
    run = tmp_path / "run"
    meta1 = {"version": 1, "frontier": owed("b1", 1)}
    meta2 = {"version": 2, "frontier": owed("b2", 2)}
    code = KILLED.format(root=str(ROOT), tiny=tiny, run=str(run), meta1=meta1, meta2=meta2)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -9, proc.stderr[-3000:]
    root = run / "checkpoints"
    assert (root / ".tmp-step_00000002").is_dir()  # the staged save, never completed
    assert ck.remove_partial(run) == 1  # what open_trainer does first
    assert ck.latest_checkpoint(run) == root / "step_00000001"
    resumed = policy_of(tiny, run)
    meta = ck.restore_trainer(resumed, root / "step_00000001")
    assert meta["frontier"] == meta1["frontier"] and meta["step"] == 1
    # the uninterrupted run: step 1, then step 2 on the same batch the resumed trainer is served
    straight = policy_of(tiny, tmp_path / "straight")
    step(straight, 1)
    assert step(resumed, 2) == pytest.approx(step(straight, 2), abs=1e-6)


async def test_the_trainer_node_trains_on_while_a_checkpoint_lands_and_commits_after(
    tiny,
    tmp_path,
    harness,  # noqa: F811 - the fixture imported above
    monkeypatch,
):
    """commit=checkpoint, a sharded async checkpoint every 2 steps: step_2's shards are held
    until step 3 has trained (if the node waited for the disk, step 3 would never train and the
    gate would never open), and every commit goes out only once a checkpoint holding its step is
    on disk."""
    from tests.test_trainer_node import groups_of, node_cfg, run_trainer

    ctx, make = harness
    cfg = node_cfg(
        tmp_path,
        tiny,
        total_steps=4,
        checkpoint_every=2,
        commit="checkpoint",
        checkpoint_format="sharded",
        checkpoint_async=True,
    )
    buf, _ = await make(cfg, groups_of(make_trajs(n_groups=8, group=2)))
    gate, entered = threading.Event(), threading.Event()

    def writer(path: str) -> FileSystemWriter:
        held = ".tmp-step_00000002" in path
        return GatedWriter(path, gate, entered) if held else FileSystemWriter(path)

    monkeypatch.setattr(ck, "storage_writer", writer)
    trained: list[bool] = []  # per step: was step_2's save in flight while it trained?
    train_step = TorchTrainer.train_step

    def counting(self: TorchTrainer, batch: TrainBatch) -> dict[str, float]:
        out = train_step(self, batch)
        trained.append(entered.is_set() and not gate.is_set())
        if len(trained) == 3:
            gate.set()  # step 3 trained: let step_2's shards be written
        return out

    monkeypatch.setattr(TorchTrainer, "train_step", counting)
    ckpts = cfg.resolved_run_dir() / "checkpoints"
    seen: list[tuple[int, list[str]]] = []

    async def hook(c):
        on_disk = sorted(p.name for p in ckpts.iterdir() if (p / "meta.json").is_file())
        seen.append((c.step, on_disk))

    buf.commit_hook = hook
    try:
        node = await run_trainer(cfg, ctx, timeout=180)
    finally:
        gate.set()
    assert node.step == 4 and trained == [False, False, True, False]
    assert [s for s, _ in seen] == [1, 2, 3, 4]
    for step, on_disk in seen:
        assert any(int(name.split("_")[1]) >= step for name in on_disk), (step, on_disk)
    assert [p.name for p in ck.list_checkpoints(cfg.resolved_run_dir())] == [
        "step_00000002",
        "step_00000004",
    ]
