"""A rollout's settings from the config.

node = RolloutNode(rollout_node_settings(cfg, 0))
"""

from __future__ import annotations

from laminar.config import LaminarConfig
from laminar.rollout.settings import RolloutNodeSettings
from laminar.vision.images import image_limits
from laminar.wiring.common import node_settings, socket_max_message_bytes, weights_channel


def reserved_gpus(cfg: LaminarConfig) -> int:
    """The GPUs of a rollout's host kept for the trainer (rollout.trainer_gpus); none when
    colocated: rollout i runs on the trainer rank i's GPU."""
    if cfg.cluster.placement == "colocated":
        return 0
    if cfg.rollout.trainer_gpus is not None:
        return cfg.rollout.trainer_gpus
    return 1 if cfg.cluster.roles.get("trainer", 0) > 0 else 0


def rollout_node_settings(
    cfg: LaminarConfig, index: int = 0, node_id: str | None = None
) -> RolloutNodeSettings:
    """What rollout-`index` receives."""
    cluster = cfg.cluster
    tools = cluster.roles.get("tools", 0) > 0 or "tools" in cluster.endpoints
    return RolloutNodeSettings(
        node=node_settings(cfg, "rollout", index, node_id),
        rollout=cfg.rollout,
        model=cfg.model,
        reward=cfg.reward,
        env=cfg.env,
        agent=cfg.agent,
        transport=cfg.transport,
        mode=cfg.mode,
        buffer=cfg.endpoint("buffer"),
        buffer_max_message_bytes=socket_max_message_bytes(cfg, "buffer"),
        tools=cfg.endpoint("tools") if tools else None,
        tool_call_timeout_s=cfg.tools.call_timeout_s,
        channel=weights_channel(cfg),
        rollouts=max(1, cluster.roles.get("rollout", 1)),
        reserved_gpus=reserved_gpus(cfg),
        repack=cfg.manager.repack.enabled,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        model_name=cfg.agent.model_name or cfg.name,
        agent_endpoints=cfg.resolved_run_dir() / "agents" / "endpoints",
        image_limits=image_limits(cfg.data),
        colocate=cfg.cluster.colocate if cluster.placement == "colocated" else None,
    )
