"""The buffer's settings from the config: the node's BufferNodeSettings, and what offline tools
read of a buffer (its ExperienceState for journal replays, the audit's warning settings).

    settings = buffer_node_settings(cfg, 0)     # -> BufferNode(settings)
    state = experience_state(cfg)               # laminar fates, journal replays in tests
"""

from __future__ import annotations

import json
from pathlib import Path

from laminar.buffer.audit import AuditSettings
from laminar.buffer.experience import ExperienceState
from laminar.buffer.owners import SampleLimits
from laminar.buffer.settings import BufferNodeSettings, StateSettings
from laminar.config import LaminarConfig
from laminar.models.moe import MoeShape
from laminar.modes import Admission
from laminar.wiring.common import node_settings, socket_max_message_bytes


def admission(cfg: LaminarConfig) -> Admission:
    """What the buffer admits and serves in this run's mode."""
    return Admission.for_mode(cfg.mode, cfg.trainer.batch_groups, cfg.buffer.max_staleness)


def state_settings(cfg: LaminarConfig) -> StateSettings:
    """What a buffer of this config builds its ExperienceState from."""
    bc = cfg.buffer
    return StateSettings(
        group_size=cfg.rollout.group_size,
        lost_member_policy=bc.lost_member_policy,
        admission=admission(cfg),
        sampling=bc.sampling,
        seed=cfg.seed,
    )


def experience_state(cfg: LaminarConfig) -> ExperienceState:
    """The state a buffer of this config keeps (offline replays of its journal)."""
    return state_settings(cfg).new_state()


def audit_settings(cfg: LaminarConfig) -> AuditSettings:
    """What the per-length audit's warning reads of the config (the node; `laminar fates`)."""
    bc = cfg.buffer
    bound = admission(cfg).bound
    return AuditSettings(bc.audit_warn_ratio, cfg.mode, bound, bc.lost_member_policy)


def model_vocab(model_path: str | None) -> int | None:
    """vocab_size from the model's config.json (multimodal: its text_config); None without."""
    if not model_path:
        return None
    try:
        raw = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (raw, raw.get("text_config") or {}):
        v = section.get("vocab_size") if isinstance(section, dict) else None
        if isinstance(v, int) and v > 0:
            return v
    return None


def model_moe(model_path: str | None) -> MoeShape | None:
    """The MoE shape from the model's config.json (routes are checked against it); None: dense or
    no readable config."""
    if not model_path:
        return None
    try:
        raw = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return MoeShape.of_config(raw) if isinstance(raw, dict) else None


def sample_limits(cfg: LaminarConfig) -> SampleLimits:
    """What a rollout's sample must satisfy (blocking: reads the model's config.json).

    Token ids: below the model's vocab_size; a sim engine draws response ids below
    rollout.sim.vocab_size and, without a model, its prompts are UTF-8 bytes (< 256). A real
    engine whose model declares no vocab_size: ids are not checked."""
    vocab = model_vocab(cfg.model.path)
    if cfg.rollout.engine == "sim":
        vocab = max(cfg.rollout.sim.vocab_size, vocab or 256)
    longest = cfg.rollout.sampling.max_tokens
    if cfg.env.fn is not None or agent_prompts(cfg):
        longest = cfg.env.limits.max_total_tokens or longest
    return SampleLimits(
        reward_min=cfg.reward.min_value,
        reward_max=cfg.reward.max_value,
        vocab=vocab,
        max_response_tokens=longest,
        # an agent renders its own prompt (a served one is compared token by token instead)
        max_prompt_tokens=cfg.data.max_prompt_tokens if agent_prompts(cfg) else None,
        moe=model_moe(cfg.model.path),
    )


def agent_prompts(cfg: LaminarConfig) -> bool:
    """Are the run's samples black-box agent episodes, whose prompts their agents render?"""
    return bool(cfg.agent.fn or cfg.agent.remote)


def buffer_node_settings(
    cfg: LaminarConfig, index: int = 0, node_id: str | None = None
) -> BufferNodeSettings:
    """What buffer-`index` receives (blocking: sample_limits reads the model's config.json)."""
    return BufferNodeSettings(
        node=node_settings(cfg, "buffer", index, node_id),
        buffer=cfg.buffer,
        data=cfg.data,
        trainer=cfg.trainer,
        mode=cfg.mode,
        state=state_settings(cfg),
        audit=audit_settings(cfg),
        limits=sample_limits(cfg),
        model_path=cfg.model.path,
        agent_prompts=agent_prompts(cfg),
        reward_fn=cfg.reward.fn,
        group_size=cfg.rollout.group_size,
        groups_per_rollout=cfg.groups_per_rollout(),
        groups_in_hand=cfg.groups_in_hand(),
        inflight_per_rollout=cfg.inflight_per_rollout(),
        run_dir=cfg.resolved_run_dir(),
        endpoint=cfg.bind_endpoint("buffer"),
        max_message_bytes=socket_max_message_bytes(cfg, "buffer"),
    )
