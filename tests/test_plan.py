"""`laminar plan`: the trainer's traced peak against a real step, depth extrapolation, verdicts.

    .venv/bin/python -m pytest tests/test_plan.py -q              # small models, ~1 min
    .venv/bin/python -m pytest tests/test_plan.py -q -m slow      # 7B/32B/72B configs, minutes

The real step's peak is measured in a child process from its resident set (tests/plan_measure.py:
glibc's mmap threshold pinned low so freed tensors leave the resident set at once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from laminar.cli import main
from laminar.config import LaminarConfig, load_config
from laminar.plan.command import check_before_start
from laminar.plan.memory import GIB, Hardware, make_plan
from laminar.plan.trainer import trace_trainer
from laminar.wiring.trainer import trainer_settings

ROOT = Path(__file__).resolve().parents[1]


def _shape(layers: int, hidden: int = 256, vocab: int = 8192) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    }


def _config(tmp_path: Path, model: Path, **trainer) -> Path:
    cfg = {
        "name": "plan-small",
        "run_dir": str(tmp_path / "run"),
        "model": {"path": str(model), "device": "cpu"},
        "rollout": {"max_model_len": 512, "sampling": {"max_tokens": 384}},
        "trainer": {
            "micro_batch_tokens": 2048,
            "logprob_chunk_tokens": 256,
            "eval_every": 0,
            **trainer,
        },
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _moe_shape(layers: int, hidden: int = 256, vocab: int = 8192) -> dict:
    return {
        **_shape(layers, hidden, vocab),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "head_dim": hidden // 4,
        "moe_intermediate_size": hidden,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    }


@pytest.fixture
def small_moe(tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    shape = {k: v for k, v in _moe_shape(2).items() if k != "architectures"}
    path = tmp_path / "moe"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape)).save_pretrained(path)
    return path


@pytest.fixture
def small_model(tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**{k: v for k, v in _shape(2).items() if k != "architectures"})
    path = tmp_path / "model"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def _planned_and_measured(
    cfg_path: Path, model: Path, tmp_path: Path
) -> tuple[LaminarConfig, Any, int]:
    """The config, the traced plan of its trainer, and the peak bytes of one real step measured in
    a fresh process (tests/plan_measure.py)."""
    out = tmp_path / "measured.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "plan_measure.py"), str(cfg_path), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(out.read_text())["peak_bytes"]
    cfg = load_config(cfg_path)
    planned = trace_trainer(trainer_settings(cfg), model, world=1, device="cpu")
    print(f"\nplanned {planned.peak_bytes / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    return cfg, planned, measured


@pytest.mark.parametrize(
    "checkpointing", [pytest.param(False, marks=pytest.mark.slow), True]
)  # the default suite runs one (time); both agree within 8%
def test_traced_trainer_peak_agrees_with_the_measured_real_step(
    small_model, tmp_path, checkpointing
):
    cfg_path = _config(tmp_path, small_model, activation_checkpointing=checkpointing)
    cfg, planned, measured = _planned_and_measured(cfg_path, small_model, tmp_path)
    assert planned.traced_layers == [2]  # traced whole, nothing extrapolated
    assert abs(planned.peak_bytes - measured) <= 0.15 * measured
    # the state alone (fp32 params + AdamW) is ~90 MiB: the activations are a real share
    assert planned.peak_bytes > 1.5 * 92e6


def test_moe_traced_peak_agrees_with_the_measured_real_step(small_moe, tmp_path):
    """The tiny MoE on CPU: the trace (experts at a balanced load, plan/trainer.py) against the real
    step (HF's experts module, the routing the random router gives)."""
    cfg_path = _config(tmp_path, small_moe, activation_checkpointing=True)
    cfg, planned, measured = _planned_and_measured(cfg_path, small_moe, tmp_path)
    assert abs(planned.peak_bytes - measured) <= 0.15 * measured
    plan = make_plan(cfg, Hardware(gpu_gib=80, gpus_per_node=8, trainer_gpus=1))
    assert plan.moe is not None
    # 2 layers x 8 experts x gate/up/down of 256 x 256; routers 2 x 8 x 256; one process here
    assert plan.moe.expert_params == 2 * 8 * 3 * 256 * 256
    assert plan.moe.router_params == 2 * 8 * 256
    assert plan.moe.expert_state_bytes == plan.moe.expert_params * 16
    assert planned.params > plan.moe.expert_params + plan.moe.router_params


@pytest.mark.slow
def test_qwen3_30b_a3b_plan_counts_experts_per_gpu(capsys):
    cfg = load_config(ROOT / "configs" / "qwen3-30b-a3b-vllm.yaml")
    plan = make_plan(cfg, Hardware(gpu_gib=80, gpus_per_node=8, trainer_gpus=8, trainer_nodes=2))
    m = plan.moe
    assert m is not None and m.experts == 128 and m.top_k == 8 and m.moe_layers == 48
    assert 28.5e9 < m.expert_params < 29.5e9  # 48 x 128 x 3 x 2048 x 768
    assert 3.0e9 < m.active_params < 3.6e9
    assert m.expert_state_bytes == m.expert_params * 16 // 16
    assert m.ep == 16 and m.gathered_layer_bytes_ep * 16 == m.gathered_layer_bytes
    assert plan.fits, plan.notes
    assert any("expert parallelism x16" in n for n in plan.notes)


def test_depth_extrapolation_matches_a_full_trace(tmp_path):
    shape_dir = tmp_path / "shape"
    shape_dir.mkdir()
    (shape_dir / "config.json").write_text(json.dumps(_shape(6, hidden=64, vocab=2048)))
    cfg = load_config(_config(tmp_path, shape_dir, activation_checkpointing=True))
    settings = trainer_settings(cfg)
    full = trace_trainer(settings, shape_dir, world=2, device="cuda", max_traced_layers=6)
    scaled = trace_trainer(settings, shape_dir, world=2, device="cuda", max_traced_layers=4)
    assert full.traced_layers == [6] and scaled.traced_layers == [2, 4]
    assert abs(scaled.peak_bytes - full.peak_bytes) <= 0.03 * full.peak_bytes
    assert scaled.params == full.params


def test_plan_refuses_naming_process_figure_and_field(small_model, tmp_path, capsys):
    cfg_path = _config(tmp_path, small_model, activation_checkpointing=True)
    # 0.25 GiB x 0.9: the trainer's ~0.3 GiB at 8x the micro-batch does not fit
    argv = ["plan", str(cfg_path), "--gpu-mem", "0.25", "--trainer-gpus", "2"]
    assert main([*argv, "trainer.micro_batch_tokens=16384"]) == 1
    err = capsys.readouterr().err
    assert "trainer rank needs" in err and "trainer.micro_batch_tokens" in err
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "trainer rank" in out and "fits" in out


def test_check_before_start_plans_gpu_configs_only(small_model, tmp_path):
    cfg = load_config(_config(tmp_path, small_model))
    assert check_before_start(cfg, 80.0) is None  # everything on the CPU: nothing to plan
    cfg.model.device = "cuda"
    plan = check_before_start(cfg, 0.05)
    assert plan is not None and not plan.fits
    assert plan.processes[0].process == "trainer rank"
    # one GPU on this host: trainer and torch rollout share it, and the plan adds them up
    together = plan.processes[-1]
    assert together.process == "trainer rank + rollout (torch)"
    assert together.peak_bytes == plan.processes[0].peak_bytes + plan.processes[1].peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "argv"),
    [
        ("qwen2.5-7b-vllm.yaml", []),
        ("qwen2.5-32b-vllm.yaml", ["--trainer-gpus", "8", "--trainer-nodes", "2"]),
        ("qwen2.5-72b-vllm.yaml", ["--trainer-gpus", "8", "--trainer-nodes", "4"]),
    ],
)
def test_example_configs_fit_80gb_gpus(config, argv, capsys):
    code = main(["plan", str(ROOT / "configs" / config), "--gpu-mem", "80", *argv])
    out = capsys.readouterr().out
    print(out)
    assert code == 0, out


@pytest.mark.slow
def test_7b_with_eight_times_the_micro_batch_does_not_fit(capsys):
    cfg = load_config(
        ROOT / "configs" / "qwen2.5-7b-vllm.yaml", ["trainer.micro_batch_tokens=131072"]
    )
    plan = make_plan(cfg, Hardware(gpu_gib=80, gpus_per_node=8))
    trainer = plan.processes[0]
    assert not plan.fits and not trainer.fits
    assert trainer.field == "trainer.micro_batch_tokens"
    assert trainer.peak_bytes > 72 * GIB


def test_config_get_prints_one_resolved_setting(capsys):
    """What the sbatch reads its stop grace and thread count with."""
    cfg = str(ROOT / "configs" / "qwen2.5-7b-vllm.yaml")
    assert main(["config", cfg, "--get", "transport.stop_timeout_s"]) == 0
    assert capsys.readouterr().out.strip() == "180.0"
    assert (
        main(
            ["config", cfg, "--get", "cluster.threads_per_process", "cluster.threads_per_process=7"]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == "7"
    assert main(["config", cfg, "--get", "transport.no_such_key"]) == 2


def test_torch_rollout_kv_figure_is_the_engines_own_pool(small_model, tmp_path):
    """The plan's torch-rollout figure counts the paged pool of rollout.kv_capacity_tokens (not
    max_running x max_model_len) and the lean forward's fused copies; both equal what an engine
    built from the same settings allocates."""
    from laminar.engines.torch_engine import TorchEngine
    from laminar.models.decoder_lm import load_model

    overrides = ["trainer.engine=sim", "model.device=cuda", "rollout.max_running=64"]
    cfg = load_config(
        _config(tmp_path, small_model), [*overrides, "rollout.kv_capacity_tokens=1000"]
    )
    (rollout,) = [p for p in make_plan(cfg, Hardware()).processes if p.process == "rollout (torch)"]
    cfg.model.device = "cpu"
    engine = TorchEngine.from_config(
        cfg.rollout, cfg.model, model=load_model(str(small_model), "float32", "cpu")
    )
    assert engine.lean is not None and engine.capacity == 1008  # 63 blocks of 16
    fused = sum(w.numel() * 4 for w, _ in engine.lean.qkv) + sum(
        w.numel() * 4 for w in engine.lean.gate_up
    )
    weights = make_plan(cfg, Hardware()).weight_version_bytes
    # a decode step gathers one layer's K and V for 64 rows of up to 512 positions
    gather = 64 * 512 * 2 * engine.cache.k[0][0, 0].numel() * 4
    assert rollout.peak_bytes == weights + fused + engine.cache.nbytes + gather
    # unset: the pool is what the rows could hold at most, 64 x 512 positions
    unset = load_config(_config(tmp_path, small_model), overrides)
    (big,) = [p for p in make_plan(unset, Hardware()).processes if p.process == "rollout (torch)"]
    per_position = engine.cache.nbytes // (64 * 16)  # 63 blocks + the null block
    assert big.peak_bytes - rollout.peak_bytes == (64 * 512 + 16 - 64 * 16) * per_position
    # too big for the GPU: the verdict names kv_capacity_tokens
    tiny_gpu = make_plan(unset, Hardware(gpu_gib=0.08)).processes[-1]
    assert not tiny_gpu.fits and tiny_gpu.field == "rollout.kv_capacity_tokens", tiny_gpu
    fit = int(tiny_gpu.advice.split()[1])
    capped = load_config(
        _config(tmp_path, small_model), [*overrides, f"rollout.kv_capacity_tokens={fit}"]
    )
    assert make_plan(capped, Hardware(gpu_gib=0.08)).processes[-1].fits


@pytest.mark.slow
def test_colocated_one_gpu_config_fits_and_names_the_field_once_it_does_not(capsys):
    """configs/colocated_1gpu_1.5b.yaml: the trainer and vLLM time-share one 80 GiB GPU; the
    plan's one line is the larger phase plus what stays resident (docs/colocated.md)."""
    path = str(ROOT / "configs" / "colocated_1gpu_1.5b.yaml")
    argv = ["--gpu-mem", "80", "--gpus-per-node", "1", "--trainer-gpus", "1"]
    assert main(["plan", path, *argv]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "colocated GPU" in out and "trainer phase" in out and "rollout phase" in out
    hw = Hardware(gpu_gib=80, gpus_per_node=1, trainer_gpus=1)
    # AdamW state kept on the device beside vLLM: the offload setting is named
    kept = make_plan(load_config(path, ["cluster.colocate.offload_optimizer=false"]), hw)
    (gpu,) = kept.processes
    assert not gpu.fits and gpu.field == "cluster.colocate.offload_optimizer"
    # a batch past what the trainer phase holds: the trainer's field is named
    big = make_plan(load_config(path, ["trainer.micro_batch_tokens=262144"]), hw)
    (gpu,) = big.processes
    assert not gpu.fits and gpu.field == "trainer.micro_batch_tokens", gpu
