"""Trainer messages (0xA0-0xAF): version announcements and the FSDP rank command.

trainer ──VersionPublished (one-way)──► manager          after every pushed version
trainer rank 0 ──RankCommand──► trainer ranks 1..N-1    over torch.distributed, never a socket
"""

from __future__ import annotations

from msgspec import field

from laminar.message import Message, message
from laminar.protocol.data import Trajectory

__all__ = ["VersionPublished", "RankCommand"]


@message(0xA0, senders=("trainer",), id_fields=("trainer_id",))
class VersionPublished(Message):  # trainer -> manager (and anyone tracking the trainer version)
    trainer_id: str
    version: int
    """The new policy version (monotonic across trainer restarts)."""
    step: int
    """Optimizer steps behind this version (equals version unless a crash rolled steps back)."""
    uri: str = ""
    """Where the weights are when they did not go through the relay tier (direct handoff file)."""
    handoff: str = "direct"
    """direct (safetensors file in run_dir/weights) | relay (pushed to the master relay) | nccl
    (broadcast group) | cuda_ipc (device buffer + IPC handle) | sim (no weights)."""
    num_bytes: int = 0
    stall_s: float = 0.0
    """How long the trainer was blocked handing the weights off."""
    digest: str = ""
    """What a rollout's engine must serve at this version (laminar/weights/digest.py over the
    exported tensors); the manager passes it on in its status (NodeStatus.expected_digests)."""


@message(0xA1, senders=("trainer",))
class RankCommand(Message):  # trainer rank 0 -> other ranks (codec frames over dist.broadcast)
    kind: str
    """init | step | export | checkpoint | stop: the collective every rank runs next."""
    step: int = 0
    """checkpoint: the step it holds."""
    version: int = 0
    trajectories: list[Trajectory] = field(default_factory=list)
    """step: the batch every rank trains on (each takes its share of the micro-batches)."""
    path: str = ""
    """init: the checkpoint every rank resumes from ("" = fresh start)."""
