"""Trainer messages (0xA0-0xAF): version announcements and the FSDP rank command.

trainer ──VersionPublished (one-way)──► manager          after every pushed version
trainer rank 0 ──RankCommand──► trainer ranks 1..N-1    over torch.distributed, never a socket
trainer ──DeviceRequest──► manager ──DeviceGrant──► trainer   (colocated: rollouts asleep)
trainer ──DeviceRelease(version)──► manager ──DeviceReleased──► trainer (rollouts awake on it)
"""

from __future__ import annotations

from msgspec import field

from laminar.message import Message, message
from laminar.protocol.data import Trajectory

__all__ = [
    "VersionPublished",
    "RankCommand",
    "DeviceRequest",
    "DeviceGrant",
    "DeviceRelease",
    "DeviceReleased",
]


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
    images: dict[str, bytes] = field(default_factory=dict)
    """step, vision-language models: the batch's images by digest (rank 0 fetched and checked
    them; every rank remakes its micro-batches' pixel inputs from them)."""
    path: str = ""
    """init: the checkpoint every rank resumes from ("" = fresh start)."""


@message(0xA2, senders=("trainer",))
class DeviceRequest(Message):  # trainer -> manager (colocated): put my device's rollouts to sleep
    version: int
    """The trainer's version (the batch it is about to train)."""


@message(0xA3, senders=("manager",))
class DeviceGrant(Message):  # manager -> trainer: every colocated rollout is asleep (or gone)
    rollouts: int
    """Rollouts that went to sleep."""
    drain_s: float = 0.0
    """Longest wait for a rollout's in-flight trajectories to finish."""
    sleep_s: float = 0.0
    """Longest engine sleep."""
    weight_bytes: int = 0
    kv_bytes: int = 0
    failed: list[str] = field(default_factory=list)
    """Rollouts that did not answer in time (dead, or past cluster.colocate.sleep_timeout_s)."""


@message(0xA4, senders=("trainer",))
class DeviceRelease(Message):  # trainer -> manager (colocated): wake the rollouts on `version`
    version: int


@message(0xA5, senders=("manager",))
class DeviceReleased(Message):  # manager -> trainer: the rollouts are awake, serving `version`
    rollouts: int
    wake_s: float = 0.0
    handoff_s: float = 0.0
    weight_bytes: int = 0
    kv_bytes: int = 0
    failed: list[str] = field(default_factory=list)
