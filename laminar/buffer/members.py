"""Who may be served prompts, and how many open groups each may hold: the manager's list.

    members = Members(share=s.groups_per_rollout, in_hand=s.groups_in_hand,   # BufferNodeSettings
                      group_size=s.group_size, source=lambda: manager.server_status)
    members.cap("rollout-3")        # None: not a serving member; else the open groups it may hold

    rollout ──Heartbeat(max_running)──► manager ──Heartbeat(NodeStatus.serving)──► buffer
    (laminar/manager/serving.py)                      PromptServer ──Members.cap(id)──► groups

A rollout id is a member while the manager's last heartbeat lists it as serving: admitted by the
transport (a bounded number of live ids), alive, and with an engine up, reporting the sequences
it runs at once (clamped by the manager to the config). Admission is not work: an id that never
shows an engine gets no prompts, and one that does gets no more than it can start at once,
`ceil(max_running / group_size)` groups, or what the config's own flow control asks for
(`groups_in_hand`: 2 x credits, or refill_slots + 2), whichever is larger, and never
past the rollout's share of the buffer (`groups_per_rollout`). Before the first list (a buffer
that just started) nobody is a member: asking again after retry_after_s finds it.

The list is read from the manager's last heartbeat when a request asks, decoded once per
heartbeat (the raw status is compared by identity).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from laminar.protocol.core import NodeStatus
from laminar.transport.session import StatusCodec

__all__ = ["Members"]

_STATUS = StatusCodec(NodeStatus)


class Members:
    def __init__(
        self,
        *,
        share: int,
        in_hand: int,
        group_size: int,
        source: Callable[[], msgspec.Raw],
    ):
        self.share, self.in_hand, self.n = share, in_hand, group_size
        self.source = source
        """The manager's status as its last heartbeat carried it (raw)."""
        self._raw: msgspec.Raw | None = None
        self.serving: dict[str, int] | None = None
        """Member id -> sequences its engine runs at once; None: no list from the manager yet."""

    def _refresh(self) -> None:
        raw = self.source()
        if raw is self._raw:
            return
        self._raw = raw
        status = _STATUS.unpack(raw)
        if status is not None:
            self.serving = status.serving

    def cap(self, rollout_id: str) -> int | None:
        """Open groups `rollout_id` may hold at once (None: it is no serving member)."""
        self._refresh()
        running = (self.serving or {}).get(rollout_id)
        if running is None:
            return None
        return min(self.share, max(self.in_hand, -(-running // self.n)))
