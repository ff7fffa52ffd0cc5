"""Node status: what every node reports to the manager with its heartbeats.

The wire's own messages (Hello, Welcome, Heartbeat, Bye, ErrorReply, Ack, Ping, Pong) live
in `laminar/transport/session.py`; a heartbeat carries a NodeStatus encoded inline
(`session.StatusCodec(NodeStatus)` at both ends, wired by `laminar/node.py`).
"""

from __future__ import annotations

from typing import Any

from msgspec import field

from laminar.message import Message, message
from laminar.protocol.relay import RelayStatus
from laminar.protocol.rollout import RolloutStatus

__all__ = ["NodeStatus"]


@message(0x03)
class NodeStatus(Message):  # carried by heartbeats: what the manager needs to know about a node
    node_id: str
    role: str
    version: int = -1
    kv_use: float = 0.0
    running: int = 0
    waiting: int = 0
    inflight: int = 0
    staleness: float = 0.0
    state: str = ""
    """Empty while the node serves; `starting_engine`: a rollout whose engine is still starting."""
    warnings: list[str] = field(default_factory=list)
    """What needs an operator's eye, one line each (`laminar status` prints them)."""
    rollout: RolloutStatus | None = None
    """Rollouts only: per-trajectory KV and delivery state (typed: the manager's repack reads
    it)."""
    relay: RelayStatus | None = None
    """Relays only: the chain as the relay sees it (the manager's straggler watch reads it)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Role figures for people and tests (step, loss, queue depth ...): logged and shown, never
    read by code to decide anything; a figure something branches on gets a typed field."""
