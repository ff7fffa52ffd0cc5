"""`laminar plan CONFIG [--gpu-mem GiB] [--gpus-per-node N] [key=value ...]`: print the memory
plan (laminar/plan/memory.py); exit 0 when every process fits, 1 when one does not (its line
names the setting to change), 2 for a broken config or a missing model shape.

`laminar run` and launchers/slurm_laminar.sbatch run it before starting anything
(`check_before_start`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from laminar.config import LaminarConfig
from laminar.plan.memory import (
    GIB,
    Hardware,
    Plan,
    ProcessPlan,
    format_plan,
    make_plan,
    refusal,
)


def plan_main(config: str, overrides: list[str], hw: Hardware, as_json: bool) -> int:
    from laminar.config import load_config

    cfg = load_config(config, overrides)
    try:
        plan = make_plan(cfg, hw, Path(config).name)
    except FileNotFoundError as exc:
        print(f"laminar plan: {exc}", file=sys.stderr)
        return 2
    print(plan.to_json() if as_json else format_plan(plan))
    if not plan.fits:
        print(f"laminar plan: does not fit: {refusal(plan)}", file=sys.stderr)
        return 1
    return 0


def uses_gpu(cfg: LaminarConfig) -> bool:
    """Does any process of this config hold a model on a GPU (else there is nothing to plan)?"""
    trainer = cfg.trainer.engine == "torch" and cfg.model.device.startswith("cuda")
    return trainer or cfg.rollout.engine == "vllm"


def check_before_start(cfg: LaminarConfig, gpu_gib: float | None) -> Plan | None:
    """The plan of a config about to start on this host's GPUs (None: no GPU to plan for)."""
    if not uses_gpu(cfg):
        return None
    if gpu_gib is None:
        import torch

        if not torch.cuda.is_available():
            return None
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / (1 << 30)
        gpus = torch.cuda.device_count()
    else:
        gpus = 1
    # one host: the trainer runs as one process (laminar run starts no torchrun)
    hw = Hardware(gpu_gib=gpu_gib, gpus_per_node=gpus, trainer_gpus=1)
    plan = make_plan(cfg, hw)
    if gpus == 1 and cfg.cluster.placement != "colocated":  # one GPU: the figures add up
        plan.processes.append(shared_gpu(plan.processes, int(gpu_gib * GIB * hw.limit)))
    return plan


def shared_gpu(processes: list[ProcessPlan], limit: int) -> ProcessPlan:
    """The processes of a one-GPU host together (vLLM's figure is the share it takes)."""
    names = [p.process for p in processes if not p.process.startswith("trainer rank 0 +")]
    total = sum(p.peak_bytes for p in processes if p.process in names)
    together = ProcessPlan(" + ".join(names), total, limit, "on the one GPU of this host")
    if not together.fits:
        together.field = "rollout.vllm.gpu_memory_utilization"
        together.advice = "lower it, or the trainer's figure (see its line)"
    return together
