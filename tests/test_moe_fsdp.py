"""MoE routing replay in HF's padded forward, which FSDP2-sharded trainers run: it trains exactly as
the packed forward's replay does, activation checkpointing included, and two gloo ranks under
FSDP2 (checkpointing on) match one process.

    .venv/bin/python -m pytest tests/test_moe_fsdp.py -q            # one process
    .venv/bin/python -m pytest tests/test_moe_fsdp.py -q -m slow    # + 2 ranks under torchrun

The routes are random (distinct experts per token, far from what the routers would pick), so a
forward that ignored them would train differently: the replay-off run shows by how much.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from laminar.models.moe import MoeShape
from laminar.models.tiny import build_tiny_model
from laminar.protocol.data import Trajectory
from laminar.trainer.batch import TrainBatch
from laminar.trainer.torch_trainer import TorchTrainer
from laminar.wiring.trainer import trainer_settings
from tests.test_trainer import make_cfg, make_trajs
from tests.test_trainer_fsdp import assert_matches_one_process

ROOT = Path(__file__).resolve().parents[1]


def routed_trajs(model: str) -> Callable[..., list[Trajectory]]:
    """make_trajs(seed=...) with routes: every position a rollout would have fed (prompt and each
    response token but the last), k distinct random experts of the model's in each MoE layer; a
    group's samples share their prompt's (the engine prefills it once)."""
    shape = MoeShape.of_config(json.loads((Path(model) / "config.json").read_text()))
    assert shape is not None

    def make(seed: int) -> list[Trajectory]:
        trajs = make_trajs(seed=seed)
        rng = np.random.default_rng(100 + seed)

        def draw(n: int) -> np.ndarray:
            order = np.argsort(rng.random((n, len(shape.layers), shape.experts)), -1)
            return order[..., : shape.top_k].astype(shape.dtype)

        prompts: dict[str, np.ndarray] = {}
        for t in trajs:
            p = prompts.setdefault(t.group_id, draw(len(t.prompt_ids)))
            t.routes = np.concatenate([p, draw(len(t.response_ids) - 1)])
        return trajs

    return make


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "m"
    return str(build_tiny_model(path, hidden=32, layers=2, kind="moe", experts=8))


def _train(model: str, run: Path, steps=(1, 2), replay=True, **trainer) -> list[float]:
    cfg = make_cfg(model, run, micro_batch_tokens=48, **trainer)
    cfg.model.moe.routing_replay = replay
    policy = TorchTrainer(trainer_settings(cfg), model)
    trajs = routed_trajs(model)
    return [policy.train_step(TrainBatch.build(trajs(seed=s)))["loss"] for s in steps]


def test_hf_forward_replays_as_the_packed_one_does(moe_model, tmp_path):
    packed = _train(moe_model, tmp_path / "a")
    hf = _train(moe_model, tmp_path / "b", forward="hf", activation_checkpointing=False)
    # checkpointing recomputes each layer in backward with the routes it was given
    hf_ckpt = _train(moe_model, tmp_path / "c", forward="hf", activation_checkpointing=True)
    live = _train(moe_model, tmp_path / "d", forward="hf", replay=False)
    print(f"\npacked {packed} hf {hf} hf+ckpt {hf_ckpt} live {live}")
    assert hf == pytest.approx(packed, rel=1e-5)
    assert hf_ckpt == pytest.approx(packed, rel=1e-5)
    # the second step trains weights the first step's routes shaped: live routing ends elsewhere
    assert live[1] != pytest.approx(packed[1], rel=1e-2)


@pytest.mark.slow
def test_two_rank_fsdp_replays_routes_as_one_process(moe_model, tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
        "torchrun"
    )
    if torchrun is None:
        pytest.skip("torchrun not found")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    worker = str(ROOT / "tests" / "fsdp_worker.py")
    cmd = [torchrun, "--standalone", "--nproc_per_node", "2", worker, moe_model, str(out), "routes"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((out / "result.json").read_text())
    # the one-process trainer runs the packed forward, FSDP2 HF's padded one: both replay
    assert_matches_one_process(res, out, moe_model, tmp_path, routed_trajs(moe_model))
    live = _train(moe_model, tmp_path / "live", steps=(1, 2, 1), replay=False)
    assert live[2] != pytest.approx(res["losses"][2], rel=1e-2)
