"""Manager messages (0x70-0x8F): status queries, repack commands, recovery, relay chain."""

from __future__ import annotations

from msgspec import field

from laminar.message import Message, message
from laminar.protocol.core import NodeStatus

__all__ = ["StatusRequest", "StatusReply", "NodeEntry"]


@message(0x70, senders=("cli",))
class StatusRequest(Message):  # cli -> manager
    pass


@message(0x71, senders=("manager",))
class NodeEntry(Message):  # one row of `laminar status`
    node_id: str
    role: str
    alive: bool
    last_beat_s: float
    """Seconds since the last message from this node."""
    status: NodeStatus | None = None
    pid: int = 0
    deaths: int = 0
    """Times the manager declared this node id dead (silent for transport.heartbeat_liveness
    beats): one back from a long stall is `alive` again, and this says it was not."""
    last_death_s: float = -1.0
    """Seconds since the last of those (-1: never)."""


@message(0x72, senders=("manager",))
class StatusReply(Message):  # manager -> cli
    nodes: list[NodeEntry] = field(default_factory=list)
    trainer_version: int = -1
    mode: str = ""
