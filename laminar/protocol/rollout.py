"""Rollout commands (0x90-0x9F): what the manager asks of a rollout, over the manager's ROUTER.

    manager ──ExportRequest(uids)──► rollout ──ExportReply(partials)──► manager   (repack source)
    manager ──ImportRequest(partials)──► rollout ──ImportReply──► manager         (repack destination / recovery)
    manager ──RefreshRequest(min_version)──► rollout ──RefreshReply──► manager   (load newest weights when idle)

The rollout is the manager's RpcClient, so these arrive through the manager's
`RpcServer.request(node_id, msg)`. An import at a version other than the
rollout's is answered with ErrorReply(code="version_mismatch"): a trajectory
keeps a single policy version, so it may only resume on a rollout that holds it.
"""

from __future__ import annotations

from dataclasses import field

from laminar.protocol.data import PartialTrajectory
from laminar.transport.codec import Message, message

__all__ = [
    "ExportRequest",
    "ExportReply",
    "ImportRequest",
    "ImportReply",
    "RefreshRequest",
    "RefreshReply",
]

VERSION_MISMATCH = "version_mismatch"
"""ErrorReply.code of an ImportRequest whose partials are not at the rollout's version."""


@message(0x90)
class ExportRequest(Message):  # manager -> rollout: abort these trajectories and hand them over
    uids: list[str] = field(default_factory=list)
    """Trajectory uids (f"{group_id}/{i}"); empty = every in-flight trajectory."""


@message(0x91)
class ExportReply(Message):  # rollout -> manager
    partials: list[PartialTrajectory] = field(default_factory=list)
    """Aborted trajectories, each with every token generated so far; the rollout forgot them."""
    missing: list[str] = field(default_factory=list)
    """Requested uids the rollout no longer had (already finished, or unknown)."""
    version: int = -1


@message(0x92)
class ImportRequest(Message):  # manager -> rollout: resume these trajectories here (same version)
    partials: list[PartialTrajectory] = field(default_factory=list)


@message(0x93)
class ImportReply(Message):  # rollout -> manager
    accepted: list[str] = field(default_factory=list)
    duplicate: list[str] = field(default_factory=list)
    """uids this rollout is already running or recently finished (an idempotent retry): left alone."""
    version: int = -1


@message(0x94)
class RefreshRequest(
    Message
):  # manager -> rollout: load the newest weights (>= min_version) when idle
    min_version: int = -1


@message(0x95)
class RefreshReply(Message):  # rollout -> manager: answered at once; the load happens when idle
    version: int
    """The rollout's version now."""
    pending: bool
    """A load is queued (waiting for in-flight trajectories to finish or the version to appear)."""
