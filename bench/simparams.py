"""Simulator parameters: everything one run of bench/simcore.py's Sim needs, one dataclass.

    simscale.params_for(model, mode, n_gpus)   paper scale          ──► SimParams ──► simcore.Sim
    simconfig.params_from_config(cfg, n)       the emulated cluster ──┘

Hardware (decode, KV, prefill, trainer, weight movement), workload (lengths, groups, batches)
and the control plane's mechanisms (repack timing, status reports and pushes, prompt round
trips, refill rules) as bench/simcore.py and bench/simrepack.py model them; each field says
which. Tests: .venv/bin/python -m pytest tests/test_simulate.py -q
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class SimParams:
    """Everything one run needs: paper scale via `params_for`, emulation via
    `params_from_config`."""

    n_rollouts: int
    trainer_s_per_token: float
    """Trainer seconds per consumed token (prompt + response), all trainer GPUs together."""
    n_gpus: int = 0
    """Total GPUs, for per-GPU figures (0 = n_rollouts: one GPU per emulated rollout)."""
    step_time_s: float = 0.02
    """Decode step time up to bound_b running sequences; linear in the batch past it."""
    bound_b: int = 128
    max_running: int = 1024
    """Most sequences decoding at once on a rollout (vLLM max_num_seqs)."""
    kv_capacity_tokens: float = math.inf
    admit_frac: float = 0.9
    """Admit while KV stays under this; on a full KV preempt the youngest down to it."""
    prefill_tok_s: float = math.inf
    """Prefill rate; admitting P tokens stalls the rollout P / prefill_tok_s (inf = free)."""
    prompt_tokens: int = 256
    length_p50: float = 2000.0
    length_p99_over_p50: float = 10.0
    max_tokens: int = 16384
    group_size: int = 16
    batch_groups: int = 512
    """Groups per global batch (one trainer version)."""
    rollout_groups: int = 64
    """Groups a rollout holds at most (baselines) / takes as its own batch when dry (laminar)."""
    buffer_capacity_groups: int | None = None
    """Laminar: a dry rollout takes no new prompts while this many finished groups wait."""
    minibatches: int = 1
    """Optimizer updates per global batch; stream/laminar train each one as soon as its groups
    finished."""
    trainer_minibatch_floor_s: float = 0.0
    """A mini-batch update takes at least this long (FSDP traffic that compute cannot hide)."""
    global_update_s: float = 0.0
    """sync/one_step/stream: every rollout (and the trainer) stopped for the NCCL-style update."""
    actor_push_s: float = 0.0
    """laminar: trainer stall to push a version to the master relay."""
    relay_broadcast_s: float = 0.0
    """laminar: push end -> version on every relay (chain broadcast)."""
    relay_pull_s: float = 0.0
    """laminar: a rollout loads the version from its host relay (PCIe)."""
    repack: bool = True
    repack_interval_s: float = 5.0
    c_max: float = 0.9
    repack_bound_b: int | None = None
    """B for the planner (None = bound_b)."""
    repack_fixed_s: float = 0.69
    """Destination stall per repack move on top of re-prefilling the moved tokens (paper §8.4)."""
    repack_move_s: float = 0.0
    """Export -> import time of a move (>= 0): the moved trajectories decode nowhere meanwhile.
    Emulation: its measured repack round overhead (export, import and refresh RPCs)."""
    status_age_s: float = 0.0
    """Repack plans from per-rollout status reports sent every this many seconds (>= 0; the
    heartbeat, each rollout at its own phase) instead of the exact state (0)."""
    repack_period_restarts: bool = False
    """A round run right after a trainer update restarts the periodic timer (the manager's loop);
    False: periodic rounds on a fixed grid."""
    prompt_rtt_s: float = 0.0
    """laminar: a dry rollout's prompt request round trip (>= 0): it decodes nothing meanwhile."""
    prompt_during_load: bool = False
    """laminar: a dry rollout with a newer version asks for prompts while it loads it (the rollout
    node's pull loop), so it waits max(relay_pull_s, prompt_rtt_s), not their sum."""
    status_push_min_s: float = 0.0
    """Repack: rollouts also push their status on change (a sequence finished, work came or left,
    weights loaded), at most every this many seconds (> 0; rollout.status_push_min_s, on in
    laminar mode with repack); 0: only the periodic reports of status_age_s."""
    max_concurrent_moves: int | None = None
    """Repack: moves of one round in flight at once (None: all); the k-th wave of moves exports
    k * repack_move_s after the round (manager.repack.max_concurrent_moves)."""
    refill_per_group: bool = False
    """laminar: a rollout at the newest available version takes a new group whenever it holds
    fewer than rollout_groups (the rollout node's credit loop); False: only once it ran dry."""
    refill_slots: int | None = None
    """laminar and partial with refill_per_group: a rollout takes a new group whenever its
    unfinished sequences (running + queued) leave room for a whole group within this many (the
    rollout node's rollout.refill_slots: credits per sequence, not per group), however many
    groups it holds (multi-turn: at most 2x rollout_groups, as the node caps them); None: a
    credit per group (rollout_groups groups in hand)."""
    refill_versions: int = 0
    """laminar with refill_per_group: a busy rollout keeps taking groups at its version while the
    newest is fewer than this many versions ahead, and drains at that many (the rollout node's
    rollout.refill_versions); a dry one pulls the newest at once. 0: drain for anything newer."""
    repack_by_draining: bool = False
    """laminar: repack candidates are the rollouts that take nothing more at their version
    (manager.repack.candidates = draining), not those whose KV use did not rise."""
    repack_split: bool = False
    """laminar: repack may spread a source no single destination fits over several, trajectory by
    trajectory (manager.repack.split_sources)."""
    retract_waiting: bool = False
    """laminar: once a newer version is out, a draining rollout takes back its groups that have not
    started (all samples still queued, no token made) and starts them at the new version after its
    load (the rollout node's rollout.retract_unstarted), so the queue never drains at the old
    one."""
    max_staleness: int | None = None
    """Bound for stream (None = 1) and laminar (None = unbounded)."""
    settle_s: float | None = None
    """Least warm-up time and window length (None: two lifetimes of a max_tokens trajectory)."""
    tool_calls_max: int = 0
    """Multi-turn workload (0: single-turn): a trajectory makes up to this many tool calls, each
    after a model turn whose length is drawn like a whole single-turn response (length_p50,
    length_p99_over_p50: per-turn figures here); the turn after the last call answers. The
    counts follow laminar/envs/sim.py: a run of p_call coins, at most tool_calls_max."""
    p_call: float = 0.8
    """Multi-turn: probability that a model turn ends in another tool call (truncated geometric)."""
    tool_latency_p50_s: float = 1.0
    tool_latency_p99_s: float = 10.0
    """Multi-turn: lognormal sandbox latency of one call. The trajectory leaves its rollout's batch
    meanwhile (no KV, no decode slot: the others use it) and rejoins it after, prefilling only the
    tool output (prefix cache). A group all of whose open trajectories wait holds no credit (at
    most 2x credits in hand); the trajectory keeps its version: a rollout with one waiting on a
    tool does not load new weights, and repack does not move it."""
    tool_latency_max_s: float = math.inf
    """Multi-turn: the sandbox's wall-clock limit; a call drawn past it is killed there (an
    error)."""
    obs_tokens_min: int = 20
    obs_tokens_max: int = 200
    """Multi-turn: tool-output tokens per call, uniform in [min, max] (loss mask 0; trained on)."""
    fixed_window_s: tuple[float, float] | None = None
    """(start, length) of a fixed measurement window, measured as bench/cluster_run.py does (steps
    ending in it, from the last step before it); None: the steady-state window of warmup/measure
    steps and settle_s. The emulation's quick runs start their window while the start-up
    transient still shows (one_step: a batch generated during the first one's tail)."""
