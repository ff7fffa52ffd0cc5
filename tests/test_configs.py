"""Every file in configs/ loads and validates against the config schema (model and data paths
need not exist: only the schema is checked), and the multi-host configs keep their choices.

    .venv/bin/python -m pytest tests/test_configs.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from laminar.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.y*ml"))


def test_the_launcher_configs_exist() -> None:
    assert {"qwen2.5-7b-vllm.yaml", "slurm_cpu.yaml", "gpu_qwen.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_validates(path: Path) -> None:
    cfg = load_config(path)  # raises ConfigError naming the field on any schema problem
    assert cfg.name, f"{path.name}: a run name (endpoints and run_dir derive from it)"
    assert cfg.rollout.engine in ("torch", "vllm", "sim")


def test_qwen_7b_config_is_vllm_fsdp2_bf16_one_relay_per_host() -> None:
    cfg = load_config(ROOT / "configs" / "qwen2.5-7b-vllm.yaml")
    assert cfg.rollout.engine == "vllm"
    assert cfg.trainer.engine == "torch"  # FSDP2 under torchrun (laminar/trainer/dist.py)
    assert cfg.model.dtype == "bfloat16" and cfg.model.device == "cuda"
    assert cfg.cluster.transport == "tcp"
    # one relay per host: the launchers override the count with the host count
    assert cfg.cluster.roles["relay"] == 1
    over = load_config(ROOT / "configs" / "qwen2.5-7b-vllm.yaml", ["cluster.roles.relay=4"])
    assert over.cluster.roles["relay"] == 4 and over.cluster.roles["trainer"] == 1


def test_slurm_cpu_config_runs_without_a_model() -> None:
    cfg = load_config(ROOT / "configs" / "slurm_cpu.yaml")
    assert cfg.rollout.engine == "sim" and cfg.trainer.engine == "sim"
    assert cfg.model.path is None and cfg.rollout.weights == "relay"
