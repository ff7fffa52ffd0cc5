"""FSDP2 across 2 CPU processes (gloo) matches the single-process trainer.

    .venv/bin/python -m pytest tests/test_trainer_fsdp.py -q -m slow

torchrun starts tests/fsdp_worker.py on 2 ranks: rank 0 broadcasts each batch, each
rank trains on its share of the micro-batches (zero-weight dummies keep the
collectives aligned), gradients are reduce-scattered; then the full state dict and a
checkpoint are gathered on rank 0. The same three steps run here in one process; the
losses, gradient norms, weights and the checkpoint must agree (to float tolerance:
the reduction order differs).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from laminar.trainer import checkpoint as ck
from laminar.trainer.torch_trainer import TorchTrainer
from laminar.wiring.common import socket_options
from laminar.wiring.trainer import trainer_settings
from tests.test_trainer import make_cfg, make_trajs

ROOT = Path(__file__).resolve().parents[1]


def assert_matches_one_process(
    res: dict, out: Path, model: str, tmp_path: Path, trajs: Callable[..., list] = make_trajs
) -> TorchTrainer:
    """The three steps tests/fsdp_worker.py ran on 2 ranks (`res`, its result.json; `out`, its
    directory), run again in this process on `trajs(seed=...)`: losses, grad norms and the
    gathered weights match. Returns the one-process policy for further checks."""
    ref = TorchTrainer(
        trainer_settings(make_cfg(model, tmp_path / "ref", micro_batch_tokens=48)), model
    )
    assert_steps_match(res, out, ref, [(trajs(seed=seed), None) for seed in (1, 2, 1)])
    return ref


def assert_steps_match(res: dict, out: Path, ref: TorchTrainer, batches: list) -> None:
    """`batches` ((trajectories, images or None) each), the steps the 2-rank worker ran, run
    again by `ref` in this process: losses, grad norms and the gathered weights match."""
    assert res["world"] == 2
    losses, norms = [], []
    for trajs, images in batches:
        m = ref.train_step(ref.prepare(trajs, images))
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    print(f"\n2 ranks: losses {res['losses']} vs one process {losses}")
    assert res["losses"] == pytest.approx(losses, abs=1e-5)
    assert res["grad_norms"] == pytest.approx(norms, rel=1e-4)
    weights = torch.load(out / "weights.pt", weights_only=True)
    mine = ref.model.full_state_dict()
    assert weights.keys() == mine.keys()
    for k in mine:
        assert torch.allclose(weights[k], mine[k], atol=1e-5), k


@pytest.mark.slow
def test_two_rank_fsdp_matches_one_process(tmp_path):
    from laminar.models.tiny import build_tiny_model

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
        "torchrun"
    )
    if torchrun is None:
        pytest.skip("torchrun not found")
    model = str(build_tiny_model(tmp_path / "model", hidden=32, layers=2, heads=2, kv_heads=1))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc_per_node",
            "2",
            str(ROOT / "tests" / "fsdp_worker.py"),
            model,
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((out / "result.json").read_text())
    ref = assert_matches_one_process(res, out, model, tmp_path)
    mine = ref.model.full_state_dict()
    # the checkpoint rank 0 gathered resumes in a single process
    resumed = TorchTrainer(
        trainer_settings(make_cfg(model, tmp_path / "ref")), str(Path(res["checkpoint"]) / "model")
    )
    ck.restore_trainer(resumed, res["checkpoint"])
    assert resumed.scheduler.state_dict()["last_epoch"] == 3
    for k, v in resumed.model.full_state_dict().items():
        assert torch.allclose(v, mine[k], atol=1e-5), k
    osd = ck.optimizer_state(resumed.model.module, resumed.optimizer)["state"]
    assert set(osd) == set(ck.optimizer_state(ref.model.module, ref.optimizer)["state"])


@pytest.mark.slow
async def test_two_rank_trainer_node_against_the_buffer_protocol(tmp_path, short_dir):
    """The whole node under torchrun: rank 0 talks to a fake buffer/manager, rank 1 follows."""
    import asyncio

    import yaml

    from laminar.config import load_config
    from laminar.models.tiny import build_tiny_model
    from laminar.transport.sockets import new_context
    from tests.test_trainer_node import FakeBuffer, FakeManager, groups_of

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
        "torchrun"
    )
    if torchrun is None:
        pytest.skip("torchrun not found")
    model = str(build_tiny_model(tmp_path / "model", hidden=32, layers=2, heads=2, kv_heads=1))
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(
        yaml.safe_dump(
            {
                "name": "fsdpnode",
                "run_dir": str(tmp_path / "run"),
                "model": {"path": model},
                "cluster": {"transport": "ipc", "ipc_dir": str(short_dir), "roles": {"relay": 0}},
                "transport": {
                    "heartbeat_interval_s": 0.2,
                    "heartbeat_liveness": 10,
                    "startup_timeout_s": 120,
                },
                "trainer": {
                    "total_steps": 3,
                    "batch_groups": 2,
                    "checkpoint_every": 2,
                    "batch_wait_s": 0.5,
                    "micro_batch_tokens": 48,
                    "lr": 1e-3,
                    "checkpoint_format": "full",  # resumed below in one process
                },
            }
        )
    )
    cfg = load_config(cfg_path)
    ctx = new_context()
    opts = socket_options(cfg)
    buf = FakeBuffer(ctx, cfg.endpoint("buffer"), opts, groups_of(make_trajs(n_groups=6, group=2)))
    mgr = FakeManager(ctx, cfg.endpoint("manager"), opts)
    await buf.srv.start()
    await mgr.srv.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = await asyncio.create_subprocess_exec(
        torchrun,
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "laminar",
        "node",
        "--role",
        "trainer",
        "--config",
        str(cfg_path),
        cwd=str(ROOT),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 300)
    except TimeoutError:
        proc.kill()  # the torchrun this test started, by its handle
        await proc.wait()
        raise
    finally:
        await buf.srv.close()
        await mgr.srv.close()
        ctx.destroy(linger=0)
    assert proc.returncode == 0, err.decode()[-4000:]
    assert [(c.step, c.version) for c in buf.commits] == [(1, 1), (2, 2), (3, 3)]
    assert [m.version for m in mgr.published] == [1, 2, 3]
    run = cfg.resolved_run_dir()
    assert (run / "weights" / "v3.safetensors").is_file()
    assert ck.latest_checkpoint(run).name == "step_00000003"
    resumed = TorchTrainer(
        trainer_settings(make_cfg(model, tmp_path / "x")), str(ck.latest_checkpoint(run) / "model")
    )
    ck.restore_trainer(resumed, ck.latest_checkpoint(run))
    from safetensors.torch import load_file

    pushed = load_file(str(run / "weights" / "v3.safetensors"))
    for k, v in resumed.model.full_state_dict().items():
        assert torch.equal(pushed[k], v), k
