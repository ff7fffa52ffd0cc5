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

__all__ = ["NODE_ROLES", "NodeStatus", "PeerRefusals", "RefusalSummary", "MAX_PEER_ROWS"]


NODE_ROLES = ("manager", "buffer", "relay", "trainer", "tools", "rollout")
"""Every node role (laminar.config.Role): each reports its status with its heartbeats."""


MAX_PEER_ROWS = 16
"""Peers listed in a RefusalSummary, most refused first: a heartbeat stays small however many
ids a stranger claims."""


class PeerRefusals(Message):  # inside RefusalSummary: one claimed node id's refused traffic
    peer: str
    """The node id the peer claimed (in its HELLO) or was admitted as; `key:NAME` for the new ids
    a key claimed past the bound on live rollout ids (refused_ids)."""
    unauthorized: int = 0
    bad: int = 0
    refused_hellos: int = 0
    refused_trajectories: int = 0
    refused_ids: int = 0

    def total(self) -> int:
        return self.unauthorized + self.bad + self.refused_hellos + self.refused_trajectories


class RefusalSummary(Message):  # inside NodeStatus: what this node refused, since it started
    unauthorized: int = 0
    """Messages refused before a handler ran: the sender's role may not send the type, or an id
    in its body is not the sender's (the senders table in laminar/message.py)."""
    bad: int = 0
    """Malformed or invalid messages (undecodable, no handler, a handler's ProtocolError)."""
    refused_hellos: int = 0
    """Handshakes refused: a key that may not claim the role or id, a live peer's node id without
    its incarnation's nonce, a new id past the bound on live rollout ids, another protocol
    version."""
    refused_ids: int = 0
    """Of refused_hellos: new rollout ids past the bound on live ones (cluster.max_rollouts),
    `too_many_rollouts`."""
    refused_trajectories: int = 0
    """Buffer only: trajectories refused (a group not served to the sender, a reward or token id
    out of range); never trained."""
    peers: list[PeerRefusals] = field(default_factory=list)
    """Per peer, at most MAX_PEER_ROWS, most refused first (empty in cluster totals)."""
    agent: dict[str, int] = field(default_factory=dict)
    """Cluster totals only: the rollouts' agent endpoint refusals and failures per reason
    (RolloutStatus.agent, summed by the manager)."""

    def total(self) -> int:
        return self.unauthorized + self.bad + self.refused_hellos + self.refused_trajectories


@message(0x03, senders=NODE_ROLES, id_fields=("node_id",))
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
    refusals: RefusalSummary | None = None
    """What this node's servers refused, per peer (None: nothing yet): `laminar status` shows
    it."""
    cluster_refusals: RefusalSummary | None = None
    """The manager only: every node's refusals summed (no per-peer rows); its heartbeats carry
    it to the trainer, which writes it to metrics.jsonl."""
    weights_digest: str = ""
    """Rollouts: the digest of what their engine serves at `version` (empty: not attested)."""
    attest_mismatches: int = 0
    """Rollouts: loads whose served digest differed from the trainer's (each quarantined and
    reloaded); `laminar status` shows it."""
    serving: dict[str, int] = field(default_factory=dict)
    """The manager only: the live rollouts whose heartbeats show an engine up, each with the
    sequences it runs at once (clamped to the config): the buffer serves prompts to these alone
    (laminar/manager/serving.py)."""
    expected_digests: dict[int, str] = field(default_factory=dict)
    """The manager only: the digests the trainer published for its recent versions (rollouts read
    them from its heartbeats and compare their own)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Role figures for people and tests (step, loss, queue depth ...): logged and shown, never
    read by code to decide anything; a figure something branches on gets a typed field."""
