"""What the manager node receives (laminar/wiring/manager.py builds it from the config).

node = ManagerNode(manager_node_settings(cfg))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from laminar.config import ColocateConfig, ManagerConfig, TransportConfig
from laminar.node_settings import NodeSettings


@dataclass(frozen=True)
class ManagerNodeSettings:
    node: NodeSettings
    manager: ManagerConfig
    transport: TransportConfig
    mode: str
    timeline: Path | None
    """Where the timeline is appended (None: manager.timeline_interval_s is 0)."""
    bind: str
    max_message_bytes: int
    """Inbound limit of its socket (an ExportReply hands over up to max_running partials)."""
    buffer: str
    """The buffer's endpoint (recovery, placements)."""
    relays: tuple[str, ...]
    """Every relay's control endpoint, by index (ChainUpdate)."""
    chain_window: int
    """relay.window: the chain planner's fetch window."""
    repack_bound_b: int
    """laminar/config.py repack_bound_b(): most samples one placement claims."""
    inflight_per_rollout: int
    """Most samples one rollout holds in flight (laminar/config.py inflight_per_rollout())."""
    most_running: int
    """Most sequences a rollout's engine may run at once by the config (laminar/config.py
    engine_max_running()): a rollout's status claiming more is clamped to it (serving.py)."""
    colocate: ColocateConfig | None = None
    """cluster.placement=colocated: carry the trainer's device turns to the rollouts
    (manager/colocate.py); None: separate placement."""
