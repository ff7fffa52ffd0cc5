"""Experience buffer state: groups, batches and exactly-once consumption, rebuilt from the journal.

    state = ExperienceState(group_size=8, lost_member_policy="release_partial", admission=adm)
    state.apply(GroupsServed(groups=[...]))     # every change is a journal record applied here
    state.apply(TrajectoryAccepted(t))          # (laminar/buffer/records.py), live (after the
    state.apply(BatchServed(...))               # append) and at replay alike, so a restarted
    state.apply(BatchCommitted(...))            # buffer reaches the same state
    state.apply(GroupsReserved(...))            # an open group whose lease ran out: a new holder
    state.apply(SamplesMoved(dest, uids))       # open samples the manager placed elsewhere

Group life:  open ──all n finished──► ready ──batch──► outstanding ──commit──► committed
               │                         ▲                 │
               │ lost member (policy)    └──requeue────────┘  (trainer restart)
               └──────────────► dropped  (drop_group, no usable member, or expired)

A member is lost for good when TrajectoryAbandoned names it or it finished unusable
(reward None or NaN, or finish_reason "error"). release_partial: the group is
released once every member finished or was abandoned, with its usable members;
drop_group: the group is dropped at the first loss (late members are acked and
ignored). Members are keyed by (group_id, sample_index): a resent trajectory is
acked again but stored once, and members of committed or dropped groups are
ignored, so nothing is ever consumed twice. Committed and dropped group ids are
kept (and carried through compaction) for that reason.

Capacity: `held` counts trajectories of live groups (open, ready, outstanding),
`pending` the samples still generating in open groups; prompts are served only
while held + pending + n <= capacity.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, assert_never

import numpy as np

from laminar.buffer.audit import FateAudit
from laminar.buffer.records import (
    BatchCommitted,
    BatchesRequeued,
    BatchServed,
    ClosedBatch,
    GroupsDropped,
    GroupsReserved,
    GroupsServed,
    JournalRecord,
    MemberAbandoned,
    PoolCursor,
    SamplesMoved,
    ServedGroup,
    StateCounters,
    StateSnapshot,
    TrajectoryAccepted,
)
from laminar.buffer.sampling import resolve_sampler
from laminar.modes import (
    Admission,
    BatchPlan,
    GroupInfo,
    StalenessStats,
    next_batch_version,
    plan_batch,
)
from laminar.protocol.data import PromptItem, Trajectory

__all__ = ["ExperienceState", "Group", "BatchRecord", "usable"]

OPEN, READY, OUTSTANDING, COMMITTED, DROPPED = (
    "open",
    "ready",
    "outstanding",
    "committed",
    "dropped",
)


def usable(t: Trajectory) -> bool:
    """May this finished trajectory be trained on?"""
    return t.reward is not None and math.isfinite(t.reward) and t.finish_reason != "error"


def _take(counts: Counter[int], version: int) -> None:
    """One group of `version` fewer in `counts` (a version at zero leaves it)."""
    left = counts[version] - 1
    if left > 0:
        counts[version] = left
    else:
        del counts[version]


@dataclass(eq=False)
class Group:
    group_id: str
    prompt_uid: str
    n: int
    served_version: int
    rollout_id: str
    serial: int
    item: PromptItem | None = None
    members: dict[int, Trajectory] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    state: str = OPEN
    batch_id: str = ""
    ready_seq: int = 0
    front: bool = False
    former: set[str] = field(default_factory=set)
    """Rollouts that held the group before a lease ran out (their copies are still taken)."""
    _oldest: tuple[int, int] = (0, 0)
    """(members counted, their lowest version): `version` is asked for every group at every batch
    plan, and members are only ever added, so the minimum is kept rather than recomputed."""

    @property
    def version(self) -> int:
        if not self.members:
            return self.served_version
        count, low = self._oldest
        if count != len(self.members):
            low = min(t.version for t in self.members.values())
            self._oldest = (len(self.members), low)
        return low

    @property
    def finished(self) -> int:
        return len(self.members.keys() | self.lost)

    def usable_members(self) -> list[Trajectory]:
        return [self.members[i] for i in sorted(self.members) if i not in self.lost]

    def rewards(self) -> list[float]:
        return [t.reward for t in self.usable_members() if t.reward is not None]


@dataclass
class BatchRecord:
    batch_id: str
    version: int
    group_ids: list[str]
    trainer_id: str = ""
    state: str = OUTSTANDING  # outstanding | committed | requeued


class ExperienceState:
    """Built from StateSettings (laminar/buffer/settings.py) by the buffer node, also for offline
    replays of its journal."""

    def __init__(
        self,
        *,
        group_size: int,
        lost_member_policy: str,
        admission: Admission,
        sampling: str = "fifo",
        seed: int = 0,
    ):
        self.group_size = group_size
        self.policy = lost_member_policy
        self.admission = admission
        self.order = resolve_sampler(sampling)
        self.rng = random.Random(seed)
        self.groups: dict[str, Group] = {}
        """Live groups: open, ready or outstanding."""
        self.closed: dict[str, str] = {}
        """Committed or dropped group id -> state (dedup forever)."""
        self.batches: dict[str, BatchRecord] = {}
        self._outstanding: dict[str, None] = {}
        """Ids of served, uncommitted batches (ordered)."""
        self._ready: dict[str, Group] = {}
        """The groups in state READY (kept as they change: a waiting trainer asks at every
        arrival)."""
        self._open: Counter[int] = Counter()
        """Version -> groups in state OPEN (kept as they change: a trainer's timed-out request,
        the stall check and, with global updates, every prompt request read it, with thousands
        of groups live)."""
        self._unconsumed: Counter[int] = Counter()
        """Version -> groups OPEN or READY (kept as they change: with a staleness bound every
        prompt request's admission reads it)."""
        self.trainer_version = 0
        self.last_batch_version = -1
        self.held = 0
        self.pending = 0
        self.serial = 0
        self.ready_seq = 0
        self.plan_changes = 0
        """Bumped by every change a batch plan reads (`plan`): a group left OPEN (ready or
        dropped), an open group's version moved. The ledger wakes a waiting batch request on it,
        not on every member that arrives (laminar/buffer/ledger.py)."""
        self.cursor: PoolCursor | None = None
        self.open_held: Counter[str] = Counter()
        """Rollout id -> open groups it holds (the prompt server's per-rollout cap)."""
        self.placed: dict[str, str] = {}
        """Unfinished sample (f"{group_id}/{index}" of an open group) -> the rollout the manager
        placed it on (SamplesMoved): taken from that rollout alone (laminar/buffer/owners.py)."""
        self.last_reply: dict[str, tuple[str, list[str]]] = {}
        """rollout_id -> (request_id, group ids) of its last PromptRequest (idempotent retries)."""
        self.finish_hist = StalenessStats()
        self.consumed_hist = StalenessStats()
        self.counts: Counter[str] = Counter()
        self.fates = FateAudit()
        """Each finished trajectory's fate by length and difficulty (laminar/buffer/audit.py),
        counted per group as it is committed or dropped."""

    # ---- views -----------------------------------------------------------------------
    @property
    def next_version(self) -> int:
        return next_batch_version(self.trainer_version, self.last_batch_version)

    def in_state(self, state: str) -> list[Group]:
        if state == READY:
            return list(self._ready.values())
        return [g for g in self.groups.values() if g.state == state]

    def unconsumed(self) -> list[Group]:
        return [g for g in self.groups.values() if g.state in (OPEN, READY)]

    def unconsumed_by_version(self) -> Counter[int]:
        return Counter(self._unconsumed)

    def open_groups(self) -> int:
        return sum(self._open.values())

    def open_before(self, version: int) -> bool:
        """Whether a group older than `version` is still open."""
        return any(v < version for v in self._open)

    def outstanding(self) -> list[BatchRecord]:
        return [self.batches[bid] for bid in self._outstanding]

    # ---- validation (no mutation) ------------------------------------------------------
    def check_trajectory(self, t: Trajectory) -> tuple[str, str]:
        """("ok" | "duplicate" | "late" | "bad", why) for an arriving trajectory."""
        if len(t.response_ids) != len(t.logprobs):
            return (
                "bad",
                f"{t.uid}: {len(t.response_ids)} response tokens but {len(t.logprobs)} logprobs",
            )
        if t.loss_mask is not None and len(t.loss_mask) != len(t.response_ids):
            return (
                "bad",
                f"{t.uid}: loss_mask has {len(t.loss_mask)} entries for {len(t.response_ids)} "
                "response tokens",
            )
        if t.loss_mask is not None and len(t.loss_mask) and int(t.loss_mask.max()) > 1:
            return "bad", f"{t.uid}: loss_mask values must be 0 (environment) or 1 (model)"
        tv = t.token_versions
        if tv is not None and (
            len(tv) != len(t.response_ids)
            or (len(tv) and (int(tv.min()) < t.version or bool(np.any(np.diff(tv) < 0))))
        ):
            return (
                "bad",
                f"{t.uid}: token_versions must be one per response token, non-decreasing, none "
                f"below the trajectory's version {t.version}",
            )
        if t.routes is not None and len(t.routes) > len(t.prompt_ids) + len(t.response_ids):
            return (
                "bad",
                f"{t.uid}: routes cover {len(t.routes)} positions of a "
                f"{len(t.prompt_ids) + len(t.response_ids)}-token sequence",
            )
        if t.turns < 1:
            return "bad", f"{t.uid}: turns {t.turns} < 1"
        if not t.group_id or not t.uid:
            return "bad", "trajectory needs uid and group_id"
        if t.version < 0:
            return "bad", f"{t.uid}: version {t.version} < 0"
        if t.group_id in self.closed:
            return "late", f"group {t.group_id} is {self.closed[t.group_id]}"
        g = self.groups.get(t.group_id)
        n = g.n if g is not None else self.group_size
        if not 0 <= t.sample_index < n:
            return "bad", f"{t.uid}: sample_index {t.sample_index} outside group of {n}"
        if g is not None and t.sample_index in g.members:
            return "duplicate", t.uid
        if g is not None and g.state != OPEN:
            return "late", f"group {t.group_id} is {g.state}"
        return "ok", ""

    def check_abandoned(self, uid: str, group_id: str) -> tuple[str, str, int]:
        """("ok" | "ignore" | "bad", why, sample index)."""
        head, sep, tail = uid.rpartition("/")
        if not sep or head != group_id or not tail.isdigit():
            return "bad", f"abandoned uid {uid!r} is not '{group_id}/<sample_index>'", -1
        idx = int(tail)
        g = self.groups.get(group_id)
        if g is None or g.state != OPEN:
            return (
                "ignore",
                f"group {group_id} is {self.closed.get(group_id, g.state if g else 'unknown')}",
                idx,
            )
        if idx >= g.n or idx in g.members or idx in g.lost:
            return "ignore", f"{uid} already finished", idx
        return "ok", "", idx

    # ---- replayable changes -------------------------------------------------------------
    def apply(self, rec: JournalRecord) -> None:
        """Apply one journal record (live, after its append, and at replay alike)."""
        match rec:
            case TrajectoryAccepted():
                self._apply_traj(rec.trajectory)
            case GroupsServed():
                self._apply_served(rec)
            case GroupsReserved():
                self._apply_reserve(rec)
            case SamplesMoved():
                self._apply_moved(rec)
            case MemberAbandoned():
                self._apply_abandon(rec)
            case GroupsDropped():
                self._apply_drop(rec)
            case BatchServed():
                self._apply_batch(rec)
            case BatchCommitted():
                self._apply_commit(rec)
            case BatchesRequeued():
                self._apply_requeue(rec)
            case StateSnapshot():
                self._apply_snapshot(rec)
            case StateCounters():
                self._apply_counters(rec)
            case _:
                assert_never(rec)

    def _apply_served(self, rec: GroupsServed) -> None:
        for spec in rec.groups:
            g = self._new_group(
                spec.group_id,
                spec.uid,
                spec.n,
                spec.version,
                spec.rollout_id or rec.rollout_id,
                spec.item,
                spec.serial,
            )
            g.front = spec.front
        if rec.cursor is not None:
            self.cursor = rec.cursor
        if rec.request_id:
            self.last_reply[rec.rollout_id] = (rec.request_id, [s.group_id for s in rec.groups])
        self.counts["groups_served"] += len(rec.groups)

    def _apply_reserve(self, rec: GroupsReserved) -> None:
        # an open group whose lease ran out, served again (laminar/buffer/leases.py): only its
        # holder changes; its members stay keyed by sample index, so nothing is counted twice
        gids = [
            gid
            for gid in rec.group_ids
            if (g := self.groups.get(gid)) is not None and g.state == OPEN
        ]
        for gid in gids:
            g = self.groups[gid]
            g.former.add(g.rollout_id)
            # placed samples go too: their rollout went silent as well, the new holder runs all
            self._unhold(g)
            self.open_held[rec.rollout_id] += 1
            g.rollout_id = rec.rollout_id
        if rec.request_id:
            self.last_reply[rec.rollout_id] = (rec.request_id, gids)
        self.counts["groups_reserved"] += len(gids)

    def _apply_moved(self, rec: SamplesMoved) -> None:
        for uid in rec.uids:
            gid, _, idx = uid.rpartition("/")
            g = self.groups.get(gid)
            if g is None or g.state != OPEN or not idx.isdigit() or int(idx) >= g.n:
                continue  # finished or never served: nothing to take from anyone
            i = int(idx)
            if i not in g.members and i not in g.lost:
                self.placed[f"{gid}/{i}"] = rec.dest

    def _new_group(
        self,
        gid: str,
        uid: str,
        n: int,
        version: int,
        rollout_id: str,
        item: PromptItem | None,
        serial: int | None = None,
    ) -> Group:
        g = Group(
            gid, uid, n, version, rollout_id, self.serial if serial is None else int(serial), item
        )
        self.serial = max(self.serial, g.serial) + 1
        self.groups[gid] = g
        self._open[version] += 1
        self._unconsumed[version] += 1
        self.pending += n
        self.open_held[rollout_id] += 1
        return g

    def _apply_traj(self, t: Trajectory) -> None:
        if t.group_id in self.closed:
            return
        g = self.groups.get(t.group_id)
        if g is None:  # its served record was never journaled (e.g. lost with a torn tail)
            self.counts["unknown_group"] += 1
            g = self._new_group(
                t.group_id, t.prompt_uid, self.group_size, t.version, t.rollout_id, None
            )
        if g.state != OPEN or t.sample_index in g.members:
            return
        was_finished = t.sample_index in g.lost
        g.lost.discard(t.sample_index)  # a member reported lost came back after all: keep its data
        before = g.version
        g.members[t.sample_index] = t
        if t.version != before and g.version != before:  # its oldest member sets its version
            for counts in (self._open, self._unconsumed):
                _take(counts, before)
                counts[g.version] += 1
            self.plan_changes += 1
        self.placed.pop(f"{g.group_id}/{t.sample_index}", None)
        self.held += 1
        if not was_finished:
            self.pending -= 1
        if not usable(t):
            g.lost.add(t.sample_index)
            self.counts["unusable"] += 1
        self.finish_hist.add(t.staleness_at_finish)
        self.counts["trajectories"] += 1
        self._settle(g)

    def _apply_abandon(self, rec: MemberAbandoned) -> None:
        g = self.groups.get(rec.group_id)
        idx = rec.sample_index
        if g is None or g.state != OPEN or idx in g.members or idx in g.lost:
            return
        g.lost.add(idx)
        self.placed.pop(f"{g.group_id}/{idx}", None)
        self.pending -= 1
        self.counts["abandoned"] += 1
        self._settle(g)

    def _settle(self, g: Group) -> None:
        """Release or drop a group per the lost-member policy."""
        if g.lost and self.policy == "drop_group":
            self._drop(g, "lost_member")
        elif g.finished >= g.n:
            if not g.usable_members():
                self._drop(g, "no_usable_member")
            else:
                g.state = READY
                self.plan_changes += 1
                _take(self._open, g.version)
                self._unhold(g)
                self._ready[g.group_id] = g
                self.ready_seq += 1
                g.ready_seq = self.ready_seq
                self.counts["groups_ready"] += 1
                if g.lost:
                    self.counts["groups_partial"] += 1

    def _unhold(self, g: Group) -> None:
        """An open group is no longer generating: its rollout holds one group fewer, and none of
        its samples is placed anywhere."""
        if self.placed:
            for i in range(g.n):
                self.placed.pop(f"{g.group_id}/{i}", None)
        left = self.open_held[g.rollout_id] - 1
        if left > 0:
            self.open_held[g.rollout_id] = left
        else:
            self.open_held.pop(g.rollout_id, None)

    def _uncount(self, g: Group) -> None:
        """`g` leaves its state (dropped, or into a batch): out of the kept counts."""
        if g.state == OPEN:
            _take(self._open, g.version)
        if g.state in (OPEN, READY):
            _take(self._unconsumed, g.version)

    def _drop(self, g: Group, reason: str) -> None:
        self.plan_changes += 1
        if g.state == OPEN:
            self.pending -= g.n - g.finished
            self._unhold(g)
        self._uncount(g)
        self.held -= len(g.members)
        self.fates.drop(g.members.values(), len(g.lost - g.members.keys()), reason)
        self._ready.pop(g.group_id, None)
        g.state = DROPPED
        self.closed[g.group_id] = DROPPED
        del self.groups[g.group_id]
        self.counts["groups_dropped"] += 1
        self.counts[f"dropped_{reason}"] += 1

    def _apply_drop(self, rec: GroupsDropped) -> None:
        for gid in rec.group_ids:
            g = self.groups.get(gid)
            if g is not None and g.state in (OPEN, READY):
                self._drop(g, rec.reason)

    def _apply_batch(self, rec: BatchServed) -> None:
        b = BatchRecord(rec.batch_id, rec.version, list(rec.group_ids), rec.trainer_id)
        for gid in b.group_ids:
            g = self.groups[gid]
            self._uncount(g)
            g.state, g.batch_id, g.front = OUTSTANDING, b.batch_id, False
            self._ready.pop(gid, None)
        self.batches[b.batch_id] = b
        self._outstanding[b.batch_id] = None
        self.last_batch_version = max(self.last_batch_version, b.version)
        self.counts["batches_served"] += 1

    def _apply_commit(self, rec: BatchCommitted) -> None:
        b = self.batches.get(rec.batch_id)
        if b is None or b.state != OUTSTANDING:
            return
        for gid in b.group_ids:
            g = self.groups.pop(gid)
            usable = g.usable_members()
            for t in usable:
                self.consumed_hist.add(b.version - t.version)
            failed = [g.members[i] for i in sorted(g.lost) if i in g.members]
            self.fates.commit(usable, failed, b.version, len(g.lost) - len(failed))
            self.held -= len(g.members)
            g.state = COMMITTED
            g.members.clear()
            self.closed[gid] = COMMITTED
        b.state = COMMITTED
        self._outstanding.pop(b.batch_id, None)
        self.trainer_version = max(self.trainer_version, rec.version)
        self.counts["batches_committed"] += 1
        self.counts["groups_committed"] += len(b.group_ids)

    def _apply_requeue(self, rec: BatchesRequeued) -> None:
        for b in self.outstanding():
            b.state = "requeued"
            for gid in b.group_ids:
                g = self.groups[gid]
                if g.state not in (OPEN, READY):
                    self._unconsumed[g.version] += 1
                g.state, g.batch_id, g.front = READY, "", True
                self._ready[gid] = g
            self.counts["batches_requeued"] += 1
        self._outstanding.clear()
        # the restarted trainer's version is authoritative (it may have resumed an older checkpoint)
        self.trainer_version = rec.trainer_version
        self.last_batch_version = self.trainer_version - 1

    def _apply_snapshot(self, rec: StateSnapshot) -> None:
        self.trainer_version = rec.trainer_version
        self.last_batch_version = rec.last_batch_version
        self.closed.update(rec.closed)
        for bid, b in rec.batches.items():
            self.batches[bid] = BatchRecord(bid, b.version, [], state=b.state)
        self.cursor = rec.cursor
        self.serial = max(self.serial, rec.serial)

    def _apply_counters(self, rec: StateCounters) -> None:
        # last record of a snapshot: the counters as they were (replaying the live groups
        # recounted them)
        self.counts = Counter(rec.counts)
        self.finish_hist.counts = Counter(rec.finish_hist)
        self.consumed_hist.counts = Counter(rec.consumed_hist)
        self.fates = FateAudit(rec.fates)

    # ---- batches ----------------------------------------------------------------------
    def plan(self, want: int, batch_version: int, final: bool) -> BatchPlan:
        # A waiting trainer asks again at every plan change (a group settles, a version moves),
        # so the cases that need only the ready groups skip the full plan over every unconsumed
        # group (what plan_batch would decide):
        ready = self.in_state(READY)
        k = self.admission.bound
        if not self.admission.policy.whole_batch:
            if k is None:  # unbounded: the first `want` ready groups in sampling order
                if len(ready) < want and not (final and self.open_groups() == 0):
                    return BatchPlan(wait="not_enough")
                order = self.order(ready, self.rng)
                return BatchPlan(take=order[:want])
            if len(ready) < want and not final:  # too few to take any; past-bound ones still drop
                expired = [g.group_id for g in ready if g.version + k < batch_version]
                return BatchPlan(expired=expired, wait="not_enough")
        groups = self.unconsumed()
        infos = [GroupInfo(g.group_id, g.version, g.state == READY, g.serial) for g in groups]
        return plan_batch(
            self.admission,
            want=want,
            batch_version=batch_version,
            groups=infos,
            preference=self.order(ready, self.rng),
            final=final,
        )

    def batch_trajectories(self, b: BatchRecord) -> list[Trajectory]:
        return [t for gid in b.group_ids for t in self.groups[gid].usable_members()]

    # ---- compaction -------------------------------------------------------------------
    def snapshot(self) -> list[JournalRecord]:
        """Records that rebuild this state from scratch (what compaction writes).

        Cheap and detached: records hold fresh containers and the stored (never mutated)
        Trajectory / PromptItem objects, so they can be encoded on another thread while this
        state keeps changing.
        """
        batches = {
            b.batch_id: ClosedBatch(b.state, b.version)
            for b in self.batches.values()
            if b.state != OUTSTANDING
        }
        recs: list[JournalRecord] = [
            StateSnapshot(
                trainer_version=self.trainer_version,
                last_batch_version=self.last_batch_version,
                closed=dict(self.closed),
                serial=self.serial,
                cursor=self.cursor,  # never mutated: replaced by the next served record
                batches=batches,
            )
        ]
        live = sorted(self.groups.values(), key=lambda g: (g.state == OPEN, g.ready_seq, g.serial))
        for g in live:
            spec = ServedGroup(
                group_id=g.group_id,
                uid=g.prompt_uid,
                n=g.n,
                version=g.served_version,
                rollout_id=g.rollout_id,
                serial=g.serial,
                item=g.item,
                front=g.front,
            )
            recs.append(GroupsServed(groups=[spec]))
            for i in sorted(g.members):
                recs.append(TrajectoryAccepted(g.members[i]))
            for i in sorted(g.lost - g.members.keys()):
                recs.append(MemberAbandoned(g.group_id, i))
        moved: dict[str, list[str]] = {}
        for uid, dest in self.placed.items():
            moved.setdefault(dest, []).append(uid)
        recs += [SamplesMoved(dest, uids) for dest, uids in sorted(moved.items())]
        for b in self.outstanding():
            recs.append(BatchServed(b.batch_id, b.version, list(b.group_ids), b.trainer_id))
        recs.append(
            StateCounters(
                counts=dict(self.counts),
                finish_hist=dict(self.finish_hist.counts),
                consumed_hist=dict(self.consumed_hist.counts),
                fates=self.fates.counts(),
            )
        )
        return recs

    # ---- stats ------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        states = Counter(g.state for g in self.groups.values())
        return {
            "trainer_version": self.trainer_version,
            "next_version": self.next_version,
            "held": self.held,
            "pending": self.pending,
            "groups_open": states[OPEN],
            "groups_ready": states[READY],
            "groups_outstanding": states[OUTSTANDING],
            "outstanding_batches": len(self.outstanding()),
            "closed_groups": len(self.closed),
            **{k: v for k, v in self.counts.items()},
        }
