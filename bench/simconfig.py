"""The emulated cluster's config as simulator parameters: what bench/cluster.py runs, simulated.

    params_from_config(cfg, n_rollouts)   laminar.config.LaminarConfig (engine: sim) ──► SimParams
    multiturn_from_config(cfg)            its multi-turn workload (SimToolEnv, or the sim agent)

bench/cluster.py (the cross-check), bench/drain_sweep.py and bench/refill_sweep.py simulate the
very cluster they configure through these; bench/simscale.py is the paper-scale counterpart.
Tests: .venv/bin/python -m pytest tests/test_simulate.py tests/test_sim_multiturn.py -q
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simparams import SimParams  # noqa: E402

__all__ = ["SIM_AGENT", "multiturn_from_config", "params_from_config"]


def params_from_config(cfg: Any, n_rollouts: int, **overrides: Any) -> SimParams:
    """SimParams matching an emulated cluster (laminar.config.LaminarConfig with engine: sim):
    same decode model, bound B, lengths, batch, group size and trainer time per token, and the
    control plane as configured (repack plans from heartbeats plus status pushed on change where
    the rollout node pushes, moves bounded per round, a rollout refills per group and asks for
    prompts while it loads newer weights).
    Prefill costs what the sim engine charges (rollout.sim.prefill_tok_s); weight movement, repack
    moves and prompt round trips cost nothing here unless overridden with measured values
    (bench/cluster.py `measured_latencies`)."""
    sim, ro = cfg.rollout.sim, cfg.rollout
    pushes = (
        bool(getattr(ro, "status_push", False))
        and cfg.mode == "laminar"
        and cfg.manager.repack.enabled
    )
    prm = SimParams(
        n_rollouts=n_rollouts,
        n_gpus=n_rollouts,
        trainer_s_per_token=cfg.trainer.sim_time_per_token_s,
        step_time_s=sim.step_time_s,
        bound_b=sim.bound_b,
        max_running=ro.max_running,
        kv_capacity_tokens=sim.kv_capacity_tokens,
        prompt_tokens=overrides.pop("prompt_tokens", 32),
        length_p50=sim.length_p50,
        length_p99_over_p50=sim.length_p99_over_p50,
        max_tokens=ro.sampling.max_tokens,
        group_size=ro.group_size,
        batch_groups=cfg.trainer.batch_groups,
        rollout_groups=ro.credits,
        buffer_capacity_groups=max(1, cfg.buffer.capacity // ro.group_size),
        repack=cfg.manager.repack.enabled,
        repack_interval_s=cfg.manager.repack.interval_s,
        c_max=cfg.manager.repack.c_max,
        repack_bound_b=cfg.repack_bound_b(),
        repack_fixed_s=0.0,
        max_staleness=cfg.buffer.max_staleness,
        # the control plane as configured: the manager plans from heartbeats, restarts its timer
        # after an update round; a rollout tops up its credits between versions
        status_age_s=cfg.transport.heartbeat_interval_s,
        # pushes on change, switched on where RolloutNode.main spawns its status-push loop
        status_push_min_s=ro.status_push_min_s if pushes else 0.0,
        max_concurrent_moves=cfg.manager.repack.max_concurrent_moves,
        repack_period_restarts=True,
        refill_per_group=True,
        # groups never started go to the next version (rollout.retract_unstarted; only matters
        # with a queue: credits x group_size > max_running)
        retract_waiting=ro.retract_unstarted,
        refill_slots=ro.refill_slots,
        refill_versions=ro.refill_versions if cfg.mode == "laminar" else 0,
        repack_by_draining=cfg.manager.repack.candidates == "draining",
        repack_split=cfg.manager.repack.split_sources,
        # the sim engine's prefill charge (rollout.sim.prefill_tok_s; None: free)
        prefill_tok_s=sim.prefill_tok_s or math.inf,
        # the sim engine's weight-load pause (rollout.sim.load_time_s): every load pays it, a
        # laminar rollout's pull and partial's global update alike (measured values override)
        relay_pull_s=sim.load_time_s,
        global_update_s=sim.load_time_s,
        prompt_during_load=True,  # the pull loop asks while it loads, in every mode
        **multiturn_from_config(cfg),
    )
    return replace(prm, **overrides)


SIM_AGENT = "laminar.agents.sim:sim_tool_agent"


def multiturn_from_config(cfg: Any) -> dict[str, Any]:
    """SimParams of the emulation's multi-turn workload (env.fn laminar.envs.sim:SimToolEnv, or
    the same draws from the black-box agent laminar.agents.sim:sim_tool_agent): the environment's
    own draws (its kwargs, its defaults) within the episode limits; {} otherwise. The agent's
    HTTP path is not modelled."""
    from laminar.envs.sim import SimToolEnv

    if cfg.env.fn is None and cfg.agent.fn == SIM_AGENT:
        kwargs = {k: v for k, v in cfg.agent.kwargs.items() if k != "client_call"}
        env = SimToolEnv(**kwargs)
        calls = min(env.max_calls, cfg.agent.max_calls - 1)
    elif cfg.env.fn is None:
        return {}
    elif cfg.env.fn != "laminar.envs.sim:SimToolEnv":
        raise ValueError(f"the simulator models only laminar.envs.sim:SimToolEnv, not {cfg.env.fn}")
    else:
        env, lim = SimToolEnv(**cfg.env.kwargs), cfg.env.limits
        calls = min(env.max_calls, lim.max_tool_calls, lim.max_turns - 1)
    return {
        "tool_calls_max": calls,
        "p_call": env.p_call,
        "tool_latency_p50_s": env.latency_p50_s,
        "tool_latency_p99_s": env.latency_p99_s,
        "obs_tokens_min": env.obs_min,
        "tool_latency_max_s": math.inf if env.latency_max_s is None else env.latency_max_s,
        "obs_tokens_max": env.obs_max,
    }
