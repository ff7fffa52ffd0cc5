"""Which cores or GPU a rollout's engine gets: derived from the rollout's index and the host.

    p = derive_placement(index=1, rollouts=2, device="cpu", cpus=[0, 1], gpus=0)
    p.env        # {"VLLM_CPU_OMP_THREADS_BIND": "1"}      (cuda: {"CUDA_VISIBLE_DEVICES": "1"})
    p.describe() # "rollout 1 of 2 on cpu: cores [1]"      (the rollout logs it)
    p = host_placement(index, rollouts, device)            # the same, with the host's resources

Why: vLLM picks cores and devices per process, not per host. On CPU its automatic OpenMP
binding put two engines of one host both on core 0 (and reserved core 1 for nothing); on GPU
every engine would start on device 0. Here the host's usable cores (the process's affinity
mask) are cut into `rollouts` contiguous, disjoint slices and rollout `index` takes slice
`index % rollouts`; GPUs are dealt the same way, `gpus_per_rollout` each (tensor parallel).
Only when there are more rollouts than cores (or GPUs) do slices repeat, and the placement
says so (`shared`), so an overcommitted host is visible in the log, never an accident.

An explicit setting in the environment (CUDA_VISIBLE_DEVICES or VLLM_CPU_OMP_THREADS_BIND
set by the user or a launcher) wins: `host_placement` keeps it and says so. The trainer's GPUs
(`reserved`, the first ones: the trainer of `laminar run` is on cuda:0) are kept apart; torch
engines take `torch_device(p, model.device)` (cuda:<index>), vLLM engines the environment.
A pure function plus a thin reader of the host, so the derivation is unit-tested without one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Device = Literal["cpu", "cuda"]
CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"
CUDA_DEVICES = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Placement:
    index: int
    rollouts: int
    device: Device
    cores: tuple[int, ...] = ()
    gpus: tuple[int, ...] = ()
    shared: bool = False
    """More rollouts than cores / GPUs: this slice is also another rollout's."""
    kept: bool = False
    """The environment already named the cores / devices: left as it was."""
    env: dict[str, str] = field(default_factory=dict)
    """What the engine process must be started with."""

    def describe(self) -> str:
        where = f"cores {list(self.cores)}" if self.device == "cpu" else f"gpus {list(self.gpus)}"
        note = (
            " (from the environment)"
            if self.kept
            else " (shared with another rollout)"
            if self.shared
            else ""
        )
        return f"rollout {self.index} of {self.rollouts} on {self.device}: {where}{note}"


def _slice(items: Sequence[int], index: int, parts: int, per: int) -> tuple[tuple[int, ...], bool]:
    """Slice `index % parts` of `items` cut into `parts` contiguous slices of `per` (wrapping)."""
    n = len(items)
    start = (index % parts) * per
    shared = parts * per > n
    return tuple(items[(start + k) % n] for k in range(min(per, n))), shared


def _ranges(cores: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the list syntax VLLM_CPU_OMP_THREADS_BIND takes)."""
    out: list[str] = []
    run: list[int] = []
    for c in cores:
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def derive_placement(
    index: int,
    rollouts: int,
    device: Device,
    cpus: Sequence[int],
    gpus: int,
    gpus_per_rollout: int = 1,
    env: Mapping[str, str] | None = None,
    reserved: int = 0,
) -> Placement:
    """The cores (cpu) or GPUs (cuda) of rollout `index` among `rollouts` on a host with `cpus`
    usable core ids and `gpus` visible devices, the first `reserved` GPUs kept for the trainer
    (when no other GPU is left, rollouts share them, and the placement says so). Pure: no side
    effects, no host reads."""
    if rollouts < 1 or not 0 <= index:
        raise ValueError(f"placement needs index >= 0 and rollouts >= 1 (got {index}, {rollouts})")
    env = env or {}
    if device == "cpu":
        if env.get(CPU_BIND):
            return Placement(index, rollouts, device, kept=True, env={CPU_BIND: env[CPU_BIND]})
        usable = sorted(set(cpus))
        if not usable:
            raise ValueError("placement: no usable CPU cores")
        per = max(1, len(usable) // rollouts)
        cores, shared = _slice(usable, index, rollouts, per)
        return Placement(
            index, rollouts, device, cores=cores, shared=shared, env={CPU_BIND: _ranges(cores)}
        )
    if env.get(CUDA_DEVICES):
        return Placement(index, rollouts, device, kept=True, env={CUDA_DEVICES: env[CUDA_DEVICES]})
    if gpus < 1:
        raise ValueError("placement: device cuda but no GPU is visible (check nvidia-smi)")
    per = max(1, gpus_per_rollout)
    if per > gpus:
        raise ValueError(
            f"placement: {per} GPUs per rollout (tensor_parallel_size) but {gpus} visible"
        )
    pool = list(range(min(reserved, gpus), gpus)) or list(range(gpus))
    ids, shared = _slice(pool, index, max(1, len(pool) // per), per)
    shared = shared or rollouts * per > len(pool) or pool[0] < reserved
    return Placement(
        index,
        rollouts,
        device,
        gpus=ids,
        shared=shared,
        env={CUDA_DEVICES: ",".join(map(str, ids))},
    )


def host_cpus() -> list[int]:
    """Core ids this process may run on (its affinity mask: honours taskset and cgroup cpusets)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def host_gpus() -> int:
    """Visible CUDA devices, counted without initialising CUDA in this process (the engine will)."""
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no torch / no driver: no GPU
        return 0


def host_placement(
    index: int, rollouts: int, device: Device, gpus_per_rollout: int = 1, reserved: int = 0
) -> Placement:
    """derive_placement with this host's cores, GPUs and environment."""
    gpus = host_gpus() if device == "cuda" and not os.environ.get(CUDA_DEVICES) else 0
    return derive_placement(
        index, rollouts, device, host_cpus(), gpus, gpus_per_rollout, os.environ, reserved
    )


def torch_device(p: Placement, configured: str) -> str:
    """The torch device a torch-engine rollout runs on: `cuda:<its GPU>` when the placement
    dealt one (the process sees every GPU: CUDA is already initialised, so the environment
    cannot narrow it any more), else what the config says."""
    if p.device != "cuda" or p.kept or not p.gpus or configured != "cuda":
        return configured
    return f"cuda:{p.gpus[0]}"
