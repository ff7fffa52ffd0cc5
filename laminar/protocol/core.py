"""Core messages: handshake, heartbeats, generic replies, node status."""

from __future__ import annotations

from typing import Any

from msgspec import field

from laminar.protocol.rollout import RolloutStatus
from laminar.transport.codec import Message, message

__all__ = [
    "Hello",
    "Welcome",
    "Heartbeat",
    "Bye",
    "ErrorReply",
    "Ack",
    "NodeStatus",
    "Ping",
    "Pong",
]


@message(0x01)
class Hello(Message):  # client -> server: first message on a fresh socket
    protocol: int
    node_id: str
    role: str
    info: dict[str, Any] = field(default_factory=dict)


@message(0x02)
class Welcome(Message):  # server -> client: handshake accepted
    protocol: int
    node_id: str
    role: str
    info: dict[str, Any] = field(default_factory=dict)


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
    rollout: RolloutStatus | None = None
    """Rollouts only: per-trajectory KV and delivery state (typed: the manager's repack reads it)."""
    extra: dict[str, Any] = field(default_factory=dict)


@message(0x04)
class Heartbeat(Message):  # both ways, every transport.heartbeat_interval_s
    node_id: str
    seq: int
    status: NodeStatus | None = None


@message(0x05)
class Bye(Message):  # client -> server: leaving on purpose (not a death)
    node_id: str
    reason: str = ""


@message(0x06)
class ErrorReply(Message):  # server -> client: the request was rejected
    code: str
    message: str


@message(0x07)
class Ack(Message):  # generic positive reply
    ok: bool = True
    info: dict[str, Any] = field(default_factory=dict)


@message(0x08)
class Ping(Message):  # any -> any: echo test
    payload: str = ""


@message(0x09)
class Pong(Message):  # reply to Ping
    payload: str = ""
