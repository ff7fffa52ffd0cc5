"""The manager's settings from the config.

node = ManagerNode(manager_node_settings(cfg))
"""

from __future__ import annotations

from laminar.config import LaminarConfig
from laminar.manager.settings import ManagerNodeSettings
from laminar.wiring.common import node_settings, socket_max_message_bytes


def manager_node_settings(
    cfg: LaminarConfig, index: int = 0, node_id: str | None = None
) -> ManagerNodeSettings:
    """What the manager receives: the endpoints it dials and the derived bounds it applies."""
    relays = max(1, cfg.cluster.roles.get("relay", 1))
    timeline = cfg.manager.timeline_interval_s > 0
    return ManagerNodeSettings(
        node=node_settings(cfg, "manager", index, node_id),
        manager=cfg.manager,
        transport=cfg.transport,
        mode=cfg.mode,
        timeline=cfg.resolved_run_dir() / "timeline.jsonl" if timeline else None,
        bind=cfg.bind_endpoint("manager"),
        max_message_bytes=socket_max_message_bytes(cfg, "manager"),
        buffer=cfg.endpoint("buffer"),
        relays=tuple(cfg.endpoint("relay", i) for i in range(relays)),
        chain_window=cfg.relay.window,
        repack_bound_b=cfg.repack_bound_b(),
        inflight_per_rollout=cfg.inflight_per_rollout(),
        most_running=cfg.engine_max_running(),
        colocate=cfg.cluster.colocate if cfg.cluster.placement == "colocated" else None,
    )
