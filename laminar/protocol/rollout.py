"""Rollout commands (0x90-0x9F): what the manager asks of a rollout, over the manager's ROUTER.

    manager ──ExportRequest(uids, dest)──► rollout ──ExportReply(partials)──► manager (repack src)
    manager ──ImportRequest(partials)──► rollout ──ImportReply──► manager   (repack dest., recovery)
    manager ──RefreshRequest(min_version)──► rollout ──RefreshReply──► manager
                                                             (load the newest weights when idle)
    manager ──SleepRequest──► rollout ──SleepReply──► manager   (colocated: drain, free the device)
    manager ──WakeRequest(min_version)──► rollout ──WakeReply──► manager
                                                 (colocated: back on the device, new version loaded)
    rollout ──Heartbeat(NodeStatus(rollout=RolloutStatus))──► manager  (what repack plans from)

The rollout is the manager's RpcClient, so these arrive through the manager's
`RpcServer.request(node_id, msg)`. An import at a version other than the
rollout's is answered with ErrorReply(code="version_mismatch"): a trajectory
keeps a single policy version, so it may only resume on a rollout that holds it.
"""

from __future__ import annotations

from msgspec import field

from laminar.message import Message, message
from laminar.protocol.data import PartialTrajectory

__all__ = [
    "RolloutStatus",
    "ExportRequest",
    "ExportReply",
    "ImportRequest",
    "ImportReply",
    "RefreshRequest",
    "RefreshReply",
    "SleepRequest",
    "SleepReply",
    "WakeRequest",
    "WakeReply",
]

ASLEEP = "asleep"
"""ErrorReply.code of an ImportRequest to a colocated rollout that sleeps (placed again later)."""
VERSION_MISMATCH = "version_mismatch"
"""ErrorReply.code of an ImportRequest whose partials are not at the rollout's version."""


@message(0x90, senders=("manager",))
class ExportRequest(Message):  # manager -> rollout: abort these trajectories and hand them over
    uids: list[str] = field(default_factory=list)
    """Trajectory uids (f"{group_id}/{i}"); empty = every in-flight trajectory."""
    dest: str = ""
    """The rollout the manager means to import them on (a hint for their agents, whose calls here
    answer 421 naming it: placement may still choose another); empty: not said. Omitted on
    the wire when empty, and a message without it (an older manager's) decodes with it empty."""


@message(0x91, senders=("rollout",))
class ExportReply(Message):  # rollout -> manager
    partials: list[PartialTrajectory] = field(default_factory=list)
    """Aborted trajectories, each with every token generated so far; the rollout forgot them."""
    missing: list[str] = field(default_factory=list)
    """Requested uids the rollout no longer had (already finished, or unknown)."""
    version: int = -1


@message(0x92, senders=("manager",))
class ImportRequest(Message):  # manager -> rollout: resume these trajectories here (same version)
    partials: list[PartialTrajectory] = field(default_factory=list)


@message(0x93, senders=("rollout",))
class ImportReply(Message):  # rollout -> manager
    accepted: list[str] = field(default_factory=list)
    duplicate: list[str] = field(default_factory=list)
    """uids this rollout is already running or recently finished (an idempotent retry): left
    alone."""
    version: int = -1


@message(0x94, senders=("manager",))
class RefreshRequest(
    Message
):  # manager -> rollout: load the newest weights (>= min_version) when idle
    min_version: int = -1


@message(0x95, senders=("rollout",))
class RefreshReply(Message):  # rollout -> manager: answered at once; the load happens when idle
    version: int
    """The rollout's version now."""
    pending: bool
    """A load is queued (waiting for in-flight trajectories to finish or the version to appear)."""


@message(0x97, senders=("manager",))
class SleepRequest(Message):  # manager -> rollout (colocated): finish in-flight work, free device
    version: int = -1
    """The trainer version asking (for the log)."""


@message(0x98, senders=("rollout",))
class SleepReply(Message):  # rollout -> manager: asleep (its engine holds no device memory)
    drain_s: float
    """Waiting for the in-flight trajectories to finish (none is exported: docs/colocated.md)."""
    sleep_s: float
    """The engine's sleep itself (KV freed, weights to host)."""
    weight_bytes: int = 0
    kv_bytes: int = 0
    finished: int = 0
    """Trajectories that finished during the drain."""


@message(0x99, senders=("manager",))
class WakeRequest(Message):  # manager -> rollout (colocated): the device is yours again
    min_version: int = -1
    """The version the trainer just published: loaded before any prompt is taken (waited for up
    to cluster.colocate.wake_timeout_s; -1: the newest there is)."""


@message(0x9A, senders=("rollout",))
class WakeReply(Message):  # rollout -> manager: awake, serving `version`
    version: int
    wake_s: float
    """The engine's wake itself (weights back on the device, a fresh KV cache)."""
    handoff_s: float
    """Loading the new version into the engine (the on-device handoff: dir / cuda_ipc)."""
    weight_bytes: int = 0
    kv_bytes: int = 0


@message(0x96, senders=("rollout",))
class RolloutStatus(Message):  # rollout -> manager, inside NodeStatus.rollout on every beat
    traj_tokens: dict[str, int]
    """uid -> KV tokens it holds (prompt + generated): repack picks what to move from these."""
    kv_capacity_tokens: int
    """The engine's KV capacity in tokens (0: unknown; the manager then treats tokens as
    fractions)."""
    measured_at: float
    """Wall-clock time of the report: the manager knows how old the view it plans on is."""
    target_version: int
    """The version new prompts should run at (above `NodeStatus.version`: a load is due)."""
    groups: int = 0
    """GRPO groups in hand (each one credit)."""
    held: int = 0
    """Groups served for a version not loaded yet."""
    credits_free: int = 0
    outbox: int = 0
    """Finished trajectories not yet acked by the buffer."""
    outbox_oldest_s: float = 0.0
    scoring: int = 0
    """Finished trajectories still waiting for their reward (not in the outbox yet)."""
    scoring_oldest_s: float = 0.0
    """How long the oldest of those has waited (0 when none). With the outbox's figures: a
    sample in neither traj_tokens nor these is not on this rollout
    (laminar/manager/reconcile.py)."""
    finished: int = 0
    tokens: int = 0
    """Tokens the engine generated so far."""
    reward_errors: int = 0
    max_running: int = 0
    """Sequences its engine decodes at once (0: no engine up): the manager lists a rollout to the
    buffer as serving only once this shows (clamped to the config), and the buffer grants it
    prompts by it."""
    agent: dict[str, int] = field(default_factory=dict)
    """Its agent endpoint's refusals and failures since it started, per reason (laminar/rollout/
    openai_api.py ENDPOINT_COUNTERS: unauthorized, bad_request, too_large, refused_at_close,
    idle_expired, agent_failures, ...) and the rollout's `agent_*` counters (agent_calls,
    agent_input_tokens, agent_http_error_<code> ...: docs/agents.md "Counters"); empty without
    agents. Shown by `laminar status`, summed by
    the manager (RefusalSummary.agent) into metrics.jsonl's `agent/<reason>`."""
    asleep: bool = False
    """Colocated placement: its engine sleeps (the trainer has the device)."""
    outbox_dropped: int = 0
    """Finished samples its outbox could not send (unencodable) or the buffer refused as never
    takeable: each abandoned, so its group completed without it."""
