"""Buffer messages (0x30-0x4F): prompt pool, experience buffer, batches, partial pool queries.

    rollout ──PromptRequest──► buffer ──PromptReply(items)──► rollout     (credit-based: ask for room)
    rollout ──PartialChunk (one-way)──► buffer                               (partial-response pool)
    rollout ──Trajectory (request)──► buffer ──Ack──► rollout                 (resent until acked, dedup by uid)
    trainer ──BatchRequest──► buffer ──BatchReply(trajectories)──► trainer   (long-poll, whole groups)
    trainer ──BatchCommit──► buffer ──Ack                                     (exactly-once consumption)
    manager ──PartialsRequest──► buffer ──PartialsReply──► manager           (recovery of a dead rollout)

A reply that acknowledges a change (prompts served, a trajectory, a batch, a commit) is sent
only once the buffer's journal record of it is durable (buffer.fsync).
"""

from __future__ import annotations

from typing import Any

from msgspec import field

from laminar.protocol.data import PartialTrajectory, PromptItem, Trajectory
from laminar.transport.codec import Message, message

__all__ = [
    "PromptRequest",
    "PromptReply",
    "BatchRequest",
    "BatchReply",
    "BatchCommit",
    "PartialsRequest",
    "PartialsReply",
    "TrajectoryAbandoned",
    "BufferStats",
]


@message(0x30)
class PromptRequest(Message):  # rollout -> buffer
    rollout_id: str
    max_groups: int
    """Credits: how many more groups the rollout has room for."""
    version: int
    """The rollout's current weight version (admission control / modes)."""
    request_id: str = ""
    """Optional: a retry with the same (rollout_id, request_id) gets the same groups back, not new ones."""


@message(0x31)
class PromptReply(Message):  # buffer -> rollout
    items: list[PromptItem] = field(default_factory=list)
    retry_after_s: float = 0.0
    """When items is empty: ask again after this long."""
    reason: str = ""
    """Why nothing was served: empty | full | staleness | need_version | epochs_done | global_update."""
    min_version: int = -1
    """The version the rollout must load before new prompts are served (modes with global updates)."""


@message(0x32)
class BatchRequest(Message):  # trainer -> buffer
    trainer_id: str
    groups: int
    trainer_version: int
    wait_s: float = 1.0
    """Long-poll: wait up to this long for enough whole groups."""
    restart: bool = False
    """First request after a trainer (re)start: batches served but never committed go back to the queue front."""


@message(0x33)
class BatchReply(Message):  # buffer -> trainer
    batch_id: str = ""
    trajectories: list[Trajectory] = field(default_factory=list)
    """Whole groups, FIFO; empty when not enough groups arrived within wait_s."""
    info: dict[str, Any] = field(default_factory=dict)


@message(0x34)
class BatchCommit(Message):  # trainer -> buffer: the step that consumed batch_id committed
    batch_id: str
    step: int
    version: int
    """The trainer version after the step."""


@message(0x35)
class PartialsRequest(Message):  # manager -> buffer
    rollout_id: str = ""
    """All in-flight trajectories last reported by this rollout (empty: use uids)."""
    uids: list[str] = field(default_factory=list)


@message(0x36)
class PartialsReply(Message):  # buffer -> manager
    partials: list[PartialTrajectory] = field(default_factory=list)


@message(0x37)
class TrajectoryAbandoned(Message):  # rollout/manager -> buffer: this sample is lost for good
    uid: str
    group_id: str
    reason: str = ""


@message(0x38)
class BufferStats(Message):  # buffer -> anyone asking (status, tests, benches)
    stats: dict[str, Any] = field(default_factory=dict)
