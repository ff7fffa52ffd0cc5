"""FSDP2 with the mixed-precision policy and per-decoder-layer activation checkpointing, 2 CPU
ranks (gloo), against the single-process step: same loss, same gradients.

    .venv/bin/python -m pytest tests/test_trainer_fsdp_mp.py -q            # fp32 policy
    .venv/bin/python -m pytest tests/test_trainer_fsdp_mp.py -q -m slow    # bf16 params on gloo

Tolerances: with param_dtype float32 the two differ only by the reduction order (loss 1e-6,
gradients 1e-6 absolute); with bfloat16 parameters and compute (fp32 reduction) the 2-rank step
rounds every layer's weights and activations to bf16, so the loss (~0.016 here) agrees to 2e-4
absolute and every gradient tensor to cosine similarity 0.999 (and 2e-3 absolute).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from laminar.trainer.batch import TrainBatch
from laminar.trainer.torch_trainer import TorchTrainer
from laminar.wiring.trainer import trainer_settings
from tests.test_trainer import make_cfg, make_trajs

ROOT = Path(__file__).resolve().parents[1]


def _two_ranks(model: str, out: Path, *settings: str) -> tuple[dict, dict[str, torch.Tensor]]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
        "torchrun"
    )
    if torchrun is None:
        pytest.skip("torchrun not found")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [torchrun, "--standalone", "--nproc_per_node", "2"]
    argv += [str(ROOT / "tests" / "fsdp_mp_worker.py"), model, str(out), *settings]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((out / "result.json").read_text())
    return res, torch.load(out / "grads.pt", weights_only=True)


def _one_process(
    model: str, run: Path, **trainer
) -> tuple[TorchTrainer, dict, dict[str, torch.Tensor]]:
    cfg = make_cfg(model, run, micro_batch_tokens=48, forward="hf", **trainer)
    policy = TorchTrainer(trainer_settings(cfg), model)
    m = policy.train_step(TrainBatch.build(make_trajs(seed=1)))
    grads = {n: p.grad for n, p in policy.model.module.named_parameters()}
    assert all(g is not None for g in grads.values())
    return policy, m, grads


@pytest.fixture
def model(tmp_path):
    from laminar.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path / "model", hidden=32, layers=2, heads=2, kv_heads=1))


def test_checkpointing_changes_nothing_but_memory_in_one_process(model, tmp_path):
    _, m_off, g_off = _one_process(model, tmp_path / "a")
    policy, m_on, g_on = _one_process(model, tmp_path / "b", activation_checkpointing=True)
    assert policy.model.checkpointing
    assert m_on["loss"] == m_off["loss"]
    for n in g_off:
        assert torch.equal(g_on[n], g_off[n]), n


def test_two_ranks_mixed_precision_policy_and_checkpointing_match_one_process(model, tmp_path):
    res, grads = _two_ranks(
        model, tmp_path / "out", "activation_checkpointing=true", "param_dtype=float32"
    )
    assert res["checkpointing"]
    _, m, ref = _one_process(model, tmp_path / "ref", activation_checkpointing=True)
    assert res["loss"] == pytest.approx(m["loss"], abs=1e-6)
    assert grads.keys() == ref.keys()
    for n in ref:
        assert torch.allclose(grads[n], ref[n], atol=1e-6, rtol=0), n
    assert max(float(g.abs().max()) for g in ref.values()) > 1e-3  # not a trivially zero gradient


@pytest.mark.slow
def test_two_ranks_bf16_parameters_fp32_reduction_match_one_process(model, tmp_path):
    res, grads = _two_ranks(
        model, tmp_path / "out", "activation_checkpointing=true", "param_dtype=bfloat16"
    )
    _, m, ref = _one_process(model, tmp_path / "ref")
    assert res["loss"] == pytest.approx(m["loss"], abs=2e-4)
    for n in ref:
        cos = torch.nn.functional.cosine_similarity(grads[n].flatten(), ref[n].flatten(), dim=0)
        assert float(cos) > 0.999, n
        assert torch.allclose(grads[n], ref[n], atol=2e-3, rtol=0), n
    assert any(not torch.equal(grads[n], ref[n]) for n in ref)  # bf16 did round something
