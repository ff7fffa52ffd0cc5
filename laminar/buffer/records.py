"""The buffer journal's records: one typed struct per change of the experience state.

    ledger.record(TrajectoryAccepted(trajectory=t))    # appended (laminar/buffer/journal.py),
    state.apply(BatchCommitted(batch_id=b, step=s, version=v))   # then applied (experience.py)

Each record is a registered message (type ids 0xC0-0xCF, beside the catalogue's ranges in
laminar/protocol/__init__.py), so the journal stores it as the wire codec's frames: a
Trajectory or PromptItem inside a record is encoded, decoded and validated by the very code
that handles it off the network, arrays included. Records never travel on a socket; no node
handles them. A field added to a record needs a default (older records lack it); a field
removed or renamed needs a journal schema bump and an upgrade step (journal_format._UPGRADES).

The state applies them with `match` on the type (ExperienceState.apply); compaction writes
a StateSnapshot, the live groups as GroupsServed / TrajectoryAccepted / MemberAbandoned /
SamplesMoved / BatchServed records, and a closing StateCounters.
"""

from __future__ import annotations

from typing import Any, get_args

from msgspec import field

from laminar.message import Message, message
from laminar.protocol.data import PromptItem, Trajectory

__all__ = [
    "RECORD_TYPES",
    "BatchCommitted",
    "BatchServed",
    "BatchesRequeued",
    "ClosedBatch",
    "FateCounts",
    "GroupsDropped",
    "GroupsReserved",
    "GroupsServed",
    "JournalRecord",
    "MemberAbandoned",
    "PoolCursor",
    "SamplesMoved",
    "ServedGroup",
    "StateCounters",
    "StateSnapshot",
    "TrajectoryAccepted",
    "from_schema2",
]


class PoolCursor(Message):  # inside GroupsServed / StateSnapshot: where the prompt pool resumes
    epoch: int = 0
    pos: int = 0
    """Rows of this epoch's permutation already served."""
    serial: int = 0
    """Group serial: group ids stay unique across restarts."""
    rows: int = -1
    """Rows in the dataset when the cursor was taken (-1: unknown); a restart with another
    count warns and clamps `pos`."""


class ServedGroup(Message):  # inside GroupsServed: one group handed to a rollout
    group_id: str
    uid: str
    """The prompt's uid."""
    n: int
    version: int
    """The rollout's weight version when served."""
    rollout_id: str = ""
    """The holder; empty: the record's rollout_id."""
    serial: int | None = None
    """None: the next serial of the state (live serving); set by compaction."""
    item: PromptItem | None = None
    """The prompt as served (None for a group whose item was not kept)."""
    front: bool = False
    """Requeued by a trainer restart: served first."""


class ClosedBatch(Message):  # inside StateSnapshot: a batch committed or requeued
    state: str
    """committed | requeued"""
    version: int


@message(0xC0, senders=())
class GroupsServed(Message):  # prompts served to a rollout (prompt_server.py)
    groups: list[ServedGroup]
    rollout_id: str = ""
    version: int = 0
    request_id: str = ""
    """The PromptRequest's id: a retry gets these groups again (idempotent)."""
    cursor: PoolCursor | None = None
    """The prompt pool's cursor after these groups."""


@message(0xC1, senders=())
class GroupsReserved(Message):  # open groups whose lease ran out, served to another rollout
    rollout_id: str
    group_ids: list[str]
    request_id: str = ""


@message(0xCA, senders=())
class SamplesMoved(Message):  # open samples the manager placed on another rollout (SamplesPlaced)
    dest: str
    uids: list[str] = field(default_factory=list)
    """f"{group_id}/{sample_index}": from now on taken from `dest` alone."""


@message(0xC2, senders=())
class TrajectoryAccepted(Message):  # a finished trajectory stored in its group (intake.py)
    trajectory: Trajectory


@message(0xC3, senders=())
class MemberAbandoned(Message):  # a group member that will never finish (TrajectoryAbandoned)
    group_id: str
    sample_index: int
    uid: str = ""
    reason: str = ""


@message(0xC4, senders=())
class GroupsDropped(Message):  # groups dropped before training (expired past the bound)
    group_ids: list[str]
    reason: str = "dropped"


@message(0xC5, senders=())
class BatchServed(Message):  # groups handed to a trainer as one batch (batches.py)
    batch_id: str
    version: int
    group_ids: list[str]
    trainer_id: str = ""


@message(0xC6, senders=())
class BatchCommitted(Message):  # the trainer applied the batch: consumed exactly once
    batch_id: str
    step: int
    version: int
    """The trainer's version after the step."""


@message(0xC7, senders=())
class BatchesRequeued(Message):  # a trainer restarted: its outstanding batches go back
    trainer_version: int
    """The restarted trainer's version (authoritative: it may have resumed an older one)."""
    trainer_id: str = ""


@message(0xC8, senders=())
class StateSnapshot(Message):  # first record of a compacted journal
    trainer_version: int
    last_batch_version: int
    closed: dict[str, str] = field(default_factory=dict)
    """Committed or dropped group id -> state (kept for dedup)."""
    serial: int = 0
    cursor: PoolCursor | None = None
    batches: dict[str, ClosedBatch] = field(default_factory=dict)
    """Batch id -> state and version of every batch that is no longer outstanding."""


class FateCounts(Message):  # inside StateCounters: the per-length audit (laminar/buffer/audit.py)
    lengths: dict[str, dict[int, int]] = field(default_factory=dict)
    """Fate (consumed, staleness, lost_member, reward_failure, ...) -> response length ->
    trajectories of committed or dropped groups."""
    staleness: dict[int, dict[int, int]] = field(default_factory=dict)
    """Consumed: response length -> staleness at consumption -> trajectories."""
    groups: dict[str, dict[str, int]] = field(default_factory=dict)
    """Fate -> group difficulty (mean usable reward to 0.01, or "none") -> trajectories."""
    group_tokens: dict[str, dict[str, int]] = field(default_factory=dict)
    """Fate -> group difficulty -> response tokens."""
    abandoned: int = 0
    """Samples of committed or dropped groups that never finished (no length)."""


@message(0xC9, senders=())
class StateCounters(Message):  # last record of a compacted journal: the counters as they were
    counts: dict[str, int] = field(default_factory=dict)
    finish_hist: dict[int, int] = field(default_factory=dict)
    """Staleness at finish -> trajectories."""
    consumed_hist: dict[int, int] = field(default_factory=dict)
    """Staleness when consumed -> trajectories."""
    fates: FateCounts | None = None
    """The per-length audit (None: written before it existed, counted from then on)."""


JournalRecord = (
    GroupsServed
    | GroupsReserved
    | SamplesMoved
    | TrajectoryAccepted
    | MemberAbandoned
    | GroupsDropped
    | BatchServed
    | BatchCommitted
    | BatchesRequeued
    | StateSnapshot
    | StateCounters
)
"""Every record the buffer journal holds."""

RECORD_TYPES: tuple[type[JournalRecord], ...] = get_args(JournalRecord)


def from_schema2(kind: str, body: dict[str, Any], msgs: list[Message]) -> JournalRecord:
    """The typed record for a schema-2 one, `(kind, body dict, messages)` (journal upgrade 2 -> 3).

    Raises KeyError, TypeError or ValueError for a body this code cannot read.
    """

    def cursor(c: dict[str, int] | None) -> PoolCursor | None:
        if c is None:
            return None
        get = c.get
        return PoolCursor(
            int(get("epoch", 0)), int(get("pos", 0)), int(get("serial", 0)), int(get("rows", -1))
        )

    match kind:
        case "served":
            served = []
            for spec in body["groups"]:
                i = spec.get("item", -1)
                item = msgs[i] if 0 <= i < len(msgs) else None
                if item is not None and not isinstance(item, PromptItem):
                    raise TypeError(f"message {i} is a {type(item).__name__}, not a PromptItem")
                serial = spec.get("serial")
                served.append(
                    ServedGroup(
                        group_id=spec["group_id"],
                        uid=spec.get("uid", ""),
                        n=int(spec["n"]),
                        version=int(spec["version"]),
                        rollout_id=spec.get("rollout_id", ""),
                        serial=None if serial is None else int(serial),
                        item=item,
                        front=bool(spec.get("front", False)),
                    )
                )
            return GroupsServed(
                groups=served,
                rollout_id=body.get("rollout_id", ""),
                version=int(body.get("version", 0)),
                request_id=body.get("request_id") or "",
                cursor=cursor(body.get("cursor")),
            )
        case "reserve":
            return GroupsReserved(
                body["rollout_id"], list(body["group_ids"]), body.get("request_id") or ""
            )
        case "traj":
            if len(msgs) != 1 or not isinstance(msgs[0], Trajectory):
                raise TypeError("a traj record holds exactly one Trajectory")
            return TrajectoryAccepted(msgs[0])
        case "abandon":
            return MemberAbandoned(
                body["group_id"],
                int(body["sample_index"]),
                body.get("uid", ""),
                body.get("reason", ""),
            )
        case "drop":
            return GroupsDropped(list(body["group_ids"]), body.get("reason", "dropped"))
        case "batch":
            return BatchServed(
                body["batch_id"],
                int(body["version"]),
                list(body["group_ids"]),
                body.get("trainer_id", ""),
            )
        case "commit":
            return BatchCommitted(body["batch_id"], int(body.get("step", 0)), int(body["version"]))
        case "requeue":
            return BatchesRequeued(int(body["trainer_version"]), body.get("trainer_id", ""))
        case "snapshot":
            return StateSnapshot(
                trainer_version=int(body["trainer_version"]),
                last_batch_version=int(body["last_batch_version"]),
                closed=dict(body["closed"]),
                serial=int(body.get("serial", 0)),
                cursor=cursor(body.get("cursor")),
                batches={b: ClosedBatch(s, int(v)) for b, (s, v) in body["batches"].items()},
            )
        case "stats":
            return StateCounters(
                counts=dict(body.get("counts", {})),
                finish_hist={int(k): v for k, v in body.get("finish_hist", {}).items()},
                consumed_hist={int(k): v for k, v in body.get("consumed_hist", {}).items()},
            )
    raise ValueError(f"unknown record kind {kind!r}")
