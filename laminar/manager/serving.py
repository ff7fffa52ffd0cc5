"""Which rollouts may be served prompts: the manager's view, carried to the buffer.

    rollout ──Heartbeat(NodeStatus(rollout=RolloutStatus(max_running)))──► manager
    manager: serving_rollouts(srv.peers.values(), most_running) ──► NodeStatus.serving
    manager ──Heartbeat(NodeStatus(serving={id: max_running}))──► buffer (laminar/buffer/members.py)

A rollout id the transport admitted (laminar/transport/server.py: a bounded number of live ids)
is listed only while it is alive and its last heartbeat showed an engine up, with the sequences
that engine runs at once: what it says, clamped to what the config lets a rollout run. The
buffer grants prompts by this figure, so a key holder who mints ids gets nothing for an id that
never runs an engine, and no more than one engine's worth for one that claims to.
"""

from __future__ import annotations

from collections.abc import Iterable

from laminar.protocol.core import NodeStatus
from laminar.transport.sockets import Peer

__all__ = ["serving_rollouts"]


def serving_rollouts(
    peers: Iterable[Peer[NodeStatus]], most_running: int, max_age_s: float = 0.0
) -> dict[str, int]:
    """Live rollout id -> sequences its engine runs at once (at most `most_running`), for the
    rollouts whose last status showed an engine up. A status read under `max_age_s` ago serves
    (Peer.recent_status; 0: the latest) while it shows an engine up; one that shows none is read
    again, so a rollout whose engine came up is listed at once (one that went down may stay
    listed up to `max_age_s` longer: its prompts are recovered like any dead rollout's)."""
    out: dict[str, int] = {}
    for p in peers:
        if not p.alive or p.role != "rollout":
            continue
        status = p.recent_status(max_age_s)
        if status is None or status.rollout is None or status.rollout.max_running <= 0:
            status = p.status
        if status is None or status.rollout is None:
            continue
        running = min(status.rollout.max_running, most_running)
        if running > 0:
            out[p.node_id] = running
    return out
