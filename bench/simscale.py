"""Paper-scale parameters for the simulator: Qwen2.5 7B/32B/72B on H800-80GB, 64-1024 GPUs.

    MODELS[name] (ModelSpec: decode step, KV bytes, FSDP bandwidth, weight-sync times)
        + allocation (paper Table 2 for laminar; a rollout_frac split for one_step/stream;
          co-located sync) ──► params_for(model, mode, n_gpus) ──► SimParams ──► simcore.Sim

Sources: the Laminar paper (reference/laminar_paper.md) where it gives a number; otherwise an
estimate for H800-80GB (989 dense BF16 TFLOP/s, 3.35 TB/s HBM) reasoned in the comment.
Used by bench/simulate.py (the sweep); tests: .venv/bin/python -m pytest tests/test_simulate.py -q
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from simparams import SimParams


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params_b: float  # Qwen2.5 parameter count (billions)
    tp_laminar: int  # rollout TP: paper App. A.2 (7B: TP=1 for Laminar, 2 for the baselines)
    tp_baseline: int
    step_time_s: dict[int, float]
    """Decode step at <= B sequences, per TP. Weights-read bound (bytes/TP / 3.35 TB/s) plus
    kernel-launch and all-reduce overhead; paper Fig. 4: batch 8 ~ batch 64 latency."""
    layers: int  # Qwen2.5 config: KV bytes/token = 2 (K, V) * layers * kv_heads * 128 * 2 B
    kv_heads: int
    bound_b: int  # roofline decode bound B (paper: "largest memory-bound batch"); 128 estimated
    fsdp_gb_s: float
    """Per-GPU bandwidth of the trainer's FSDP group: 7B shards over 8 GPUs (one node, NVLink),
    32B/72B over 16/32 (paper App. A.2), i.e. across nodes on 8x400 Gb/s IB per node."""
    actor_push_s: float  # paper §8.3: 0.64 s (32B), 1.40 s (72B); 7B scaled by size
    relay_broadcast_s: float  # paper §4.2: 72B to 127 relays < 1.6 s; others scaled by size
    global_update_base_s: float  # NCCL-style update, all rollouts stopped (paper: Laminar cuts the
    # rollout wait by up to 37% vs it; absolute values only in a figure, so estimated)
    laminar_rollout_gpus: dict[int, int]  # paper Table 2: total GPUs -> rollout GPUs (Laminar)

    @property
    def weight_gb(self) -> float:
        return 2 * self.params_b

    def kv_tokens(self, tp: int, mem_util: float) -> int:
        """KV capacity of a replica whose engine may use mem_util of each 80 GB GPU, after the
        weights and ~2 GB/GPU of activations and CUDA graphs."""
        free = mem_util * tp * 80e9 - self.weight_gb * 1e9 - 2e9 * tp
        return int(free / (2 * self.layers * self.kv_heads * 128 * 2))

    def prefill_tok_s(self, tp: int) -> float:
        return 0.4 * 989e12 * tp / (2 * self.params_b * 1e9)  # 40% MFU, 2 FLOPs/param/token

    def train_tok_s_per_gpu(self) -> float:
        return TRAIN_MFU * 989e12 / (8 * self.params_b * 1e9)

    def minibatch_floor_s(self) -> float:
        # two all-gathers of the weights (forward, backward) + one reduce-scatter of the grads
        return 3 * self.weight_gb / self.fsdp_gb_s

    def sat_tok_s(self, tp: int) -> float:
        return self.bound_b / self.step_time_s[tp]  # decode throughput of a saturated replica


MODELS: dict[str, ModelSpec] = {
    "7B": ModelSpec(
        name="7B",
        params_b=7.6,
        layers=28,
        kv_heads=4,
        tp_laminar=1,
        tp_baseline=2,
        step_time_s={1: 0.010, 2: 0.007},
        bound_b=128,
        fsdp_gb_s=150.0,
        actor_push_s=0.3,
        relay_broadcast_s=0.3,
        global_update_base_s=1.5,
        laminar_rollout_gpus={16: 8, 32: 8, 64: 24, 128: 48, 256: 64},
    ),
    "32B": ModelSpec(
        name="32B",
        params_b=32.8,
        layers=64,
        kv_heads=8,
        tp_laminar=4,
        tp_baseline=4,
        step_time_s={4: 0.025},
        bound_b=128,
        fsdp_gb_s=40.0,
        actor_push_s=0.64,
        relay_broadcast_s=0.8,
        global_update_base_s=2.5,
        laminar_rollout_gpus={32: 16, 64: 32, 128: 64, 256: 128, 512: 256},
    ),
    "72B": ModelSpec(
        name="72B",
        params_b=72.7,
        layers=80,
        kv_heads=8,
        tp_laminar=8,
        tp_baseline=8,
        step_time_s={8: 0.030},
        bound_b=128,
        fsdp_gb_s=40.0,
        actor_push_s=1.40,
        relay_broadcast_s=1.6,
        global_update_base_s=4.0,
        laminar_rollout_gpus={64: 32, 128: 64, 256: 128},
    ),
}
MINIBATCHES = 16  # paper §6: 16 mini-batch updates per iteration in the throughput runs
TRAIN_MFU = 0.35
"""Trainer compute: 8 FLOPs/param/token (forward + backward + the old-logprob forward) at 35%
MFU. Cross-check (`balance` in the JSON): at the paper's own Laminar allocation rows from 32
GPUs up, this trainer consumes 0.7x-1.3x what the rollouts decode when saturated, i.e. the
paper's split is about balanced under these constants - training is neither the bottleneck nor
negligible. (7B on 16 GPUs, 8/8, is the exception at 0.44: trainer-bound.)"""
LAMINAR_INFLIGHT = 4
ROLLOUT_MEM_UTIL = 0.9  # a rollout that owns its GPUs (vLLM's default gpu_memory_utilization)
COLOCATED_MEM_UTIL = 0.5
"""sync is co-located (verl): the FSDP actor shares the GPUs, so its vLLM runs at a lower
gpu_memory_utilization (verl recipes use 0.4-0.6) and gets ~40% of a dedicated rollout's KV."""
REFILL_VERSIONS = 3
"""laminar (and laminar_norepack) at paper scale: the drain rule of issue 44
(rollout.refill_versions K = 3, repack candidates `draining`): a rollout takes a new group whenever
one of its own finishes (credits per group, laminar_groups of them) while the newest version is
fewer than K ahead of its own, drains at K, and a dry one loads the newest at once. Sources stay
whole (split sources with K = 3: 341k against 350k tok/s at 32B on 1024 GPUs, one seed;
bench/README.md, issue 44 third session). The emulated cluster runs K = 2 since the buffer's
open-groups cap was fixed, for its staleness bar; here K = 2 (with retract_waiting) read 1.063 /
1.018 against partial at 1024 GPUs, 32B / 72B, where K = 3 reads 1.070 / 1.025, and staleness is no
bar at paper scale. The paper's own rule (take a batch, drain it, pull) stays in use for the
repack-in-isolation runs of §8.4 (bench/simulate.py, PAPER_DRAIN)."""
PCIE_GB_S = 20.0  # pinned host -> GPU copy per GPU (relay pull)


MULTITURN: dict[str, Any] = dict(
    tool_calls_max=8,  # paper §8: "at most 8 tool calls" (DAPO-Math with a code sandbox, ReTool)
    p_call=0.8,  # a run of calls: mean ~3.3 calls, 0.8^8 = 17% use all 8 (estimate)
    length_p50=600.0,  # per model turn; p99 = 10x p50 as for whole responses (paper §2.2), so a
    length_p99_over_p50=10.0,  # ~4-turn trajectory has a median near the math task's 2000
    tool_latency_p50_s=1.0,  # sandbox run of a short Python snippet (estimate; paper Fig. 2 shows
    tool_latency_p99_s=20.0,  # the latencies long-tailed but gives no numbers)
    tool_latency_max_s=60.0,  # the sandbox's wall-clock limit (3x p99; a call past it is killed)
    obs_tokens_min=20,
    obs_tokens_max=200,
)
"""The multi-turn tool-calling workload (paper Fig. 12: the ReTool 7B checkpoint): overrides of
params_for's single-turn SimParams. Run by bench/simulate.py (summary `*_multiturn`)."""
MULTITURN_MODEL = "7B"
"""The paper's tool-calling runs use the ReTool 7B checkpoint."""


def balance(spec: ModelSpec, n_gpus: int) -> float:
    """Trainer capacity / saturated decode capacity for Laminar at n_gpus (1 = balanced)."""
    ro = laminar_rollout_gpus(spec, n_gpus)
    mb_tokens = 8192 * (256 + 3120) / MINIBATCHES  # mean of the clipped lognormal: 3120 tokens
    mb_s = max(mb_tokens / (spec.train_tok_s_per_gpu() * (n_gpus - ro)), spec.minibatch_floor_s())
    return (mb_tokens / mb_s) / (ro / spec.tp_laminar * spec.sat_tok_s(spec.tp_laminar))


def laminar_rollout_gpus(spec: ModelSpec, n_gpus: int) -> int:
    """Paper Table 2, or its nearest row's rollout fraction outside the table (documented
    extrapolation: 7B past 256 GPUs, 72B past 256 GPUs whose parsed rows do not add up)."""
    table = spec.laminar_rollout_gpus
    if n_gpus in table:
        return table[n_gpus]
    below = [k for k in table if k <= n_gpus]
    row = max(below) if below else min(table)
    return round_tp(n_gpus * table[row] / row, spec.tp_laminar)


def laminar_groups(n_rollouts: int) -> int:
    """A Laminar rollout's own batch: the rollouts together hold LAMINAR_INFLIGHT global batches,
    each at most 1024 trajectories (max concurrency, paper App. A.2). The paper leaves the size
    open; without this cap 128 rollouts x 1024 would hold 16 global batches at once and the
    staleness would be set by over-production rather than by the policy."""
    return min(64, max(1, math.ceil(LAMINAR_INFLIGHT * 512 / n_rollouts)))


def round_tp(gpus: float, tp: int) -> int:
    return max(tp, int(round(gpus / tp)) * tp)


def params_for(
    model: str, mode: str, n_gpus: int, rollout_frac: float | None = None, **overrides: Any
) -> SimParams:
    """Paper-scale parameters: sync is co-located (every GPU generates, then trains); one_step
    and stream split the GPUs at rollout_frac (default 0.5); laminar uses the paper's table, or
    rollout_frac when given (bench/simulate.py sweeps laminar on the grid of the others too);
    partial (AReaL) splits at rollout_frac with Laminar's TP (the paper: TP 1 for 7B in Laminar
    and AReaL, 2 in the others) and Laminar's in-flight budget per rollout (laminar_groups), so
    the two differ only in how versions reach the rollouts."""
    spec = MODELS[model]
    if mode == "sync":
        tp, ro_gpus, train_gpus = spec.tp_baseline, n_gpus, n_gpus
    elif mode in ("one_step", "stream", "partial"):
        tp = spec.tp_laminar if mode == "partial" else spec.tp_baseline
        ro_gpus = min(
            n_gpus - tp, round_tp(n_gpus * (0.5 if rollout_frac is None else rollout_frac), tp)
        )
        train_gpus = n_gpus - ro_gpus
    else:
        tp = spec.tp_laminar
        ro_gpus = (
            laminar_rollout_gpus(spec, n_gpus)
            if rollout_frac is None
            else round_tp(n_gpus * rollout_frac, tp)
        )
        train_gpus = n_gpus - ro_gpus
    prm = SimParams(
        n_rollouts=ro_gpus // tp,
        n_gpus=n_gpus,
        trainer_s_per_token=1.0 / (spec.train_tok_s_per_gpu() * train_gpus),
        step_time_s=spec.step_time_s[tp],
        bound_b=spec.bound_b,
        max_running=1024,  # paper App. A.2: max concurrency per replica in the throughput runs
        kv_capacity_tokens=spec.kv_tokens(
            tp, COLOCATED_MEM_UTIL if mode == "sync" else ROLLOUT_MEM_UTIL
        ),
        prefill_tok_s=spec.prefill_tok_s(tp),
        prompt_tokens=256,  # DAPO-Math prompts are short (max input 2K)
        length_p50=2000.0,  # p99 ~ 10x p50 (paper §2.2), clipped at the 16K output cap (§8)
        length_p99_over_p50=10.0,
        max_tokens=16384,
        group_size=16,
        batch_groups=512,  # 8192 = 512 prompts x 16 (paper §6, strong scaling)
        rollout_groups=laminar_groups(ro_gpus // tp)
        if mode.startswith("laminar") or mode == "partial"
        else 64,
        buffer_capacity_groups=2 * 512,
        minibatches=MINIBATCHES,
        trainer_minibatch_floor_s=spec.minibatch_floor_s(),
        global_update_s=spec.global_update_base_s + 0.25 * math.log2(max(1.0, ro_gpus / 8)),
        actor_push_s=spec.actor_push_s,
        relay_broadcast_s=spec.relay_broadcast_s,
        relay_pull_s=spec.weight_gb / tp / PCIE_GB_S,
        repack_interval_s=5.0,
        c_max=0.9,
        repack_fixed_s=0.69,  # paper §8.4: measured repack overhead
        # partial (AReaL): a rollout tops its concurrency up as groups finish (stream generation);
        # laminar: the same between versions, under its refill budget (REFILL_VERSIONS)
        refill_per_group=mode == "partial" or mode.startswith("laminar"),
        refill_versions=REFILL_VERSIONS if mode.startswith("laminar") else 0,
        repack_by_draining=mode.startswith("laminar"),
    )
    if mode == "partial":  # the trainer broadcasts each version itself (NCCL): it stalls for it
        prm = replace(prm, actor_push_s=prm.global_update_s)
    return replace(prm, **overrides)
