"""Tool calls (rollout -> tools node): one sandboxed call, answered once per call id.

    rollout ──ToolCallRequest(call_id, name, arguments)──► tools node ──► sandbox worker
            ◄──ToolCallReply(ok, output | error, seconds, cached)──┘

The call id is deterministic (`f"{uid}#t{turn}#c{k}#<digest of name+arguments>"`, see
laminar.protocol.data.ToolRecord): the tools node runs each id at most once and answers a repeat (a
retried request, an episode replayed on another rollout after its first one died) from its journaled
cache, waiting for the first run when it is still going.
"""

from __future__ import annotations

from typing import Any

from msgspec import field

from laminar.message import Message, message

__all__ = ["ToolCallRequest", "ToolCallReply", "ToolStatsRequest", "ToolStatsReply"]


@message(0xB0, senders=("rollout",))
class ToolCallRequest(Message):
    call_id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    """The model's arguments to the tool, as it wrote them: data the tool validates itself."""
    timeout_s: float = 0.0
    """Wall-clock limit for this call (0: the tools node's tools.wall_s); never above it."""


@message(0xB1, senders=("tools",))
class ToolCallReply(Message):
    call_id: str
    ok: bool
    output: str = ""
    """What the tool printed / returned (truncated to tools.max_output_bytes)."""
    error: str = ""
    """Why it failed, as the model will read it."""
    error_kind: str = ""
    """timeout | crash | memory | output_limit | network | bad_call | unknown_tool | busy."""
    seconds: float = 0.0
    cached: bool = False
    truncated: bool = False


@message(0xB2, senders=("cli", "manager"))
class ToolStatsRequest(Message):
    pass


@message(0xB3, senders=("tools",))
class ToolStatsReply(Message):
    stats: dict[str, Any] = field(default_factory=dict)
    """Pool and cache counters by name (calls, errors_by_kind, latency_p99_s ...): shown to
    people and tests, never read by code to decide anything."""
