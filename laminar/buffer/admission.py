"""Admission control and batch planning: how the four modes bound staleness (pure, no I/O).

    adm = Admission.from_config(cfg)                        # mode rules from laminar.manager.staleness
    d = admit(adm, rollout_version=3, requested=4, trainer_version=3, next_version=4, unconsumed={3: 5})
    plan = plan_batch(adm, want=8, batch_version=4, groups=[GroupInfo(...)...], preference=[...])

Versions: the trainer starts at 0; the step that trains the batch served at version
v produces v + 1. A group's version is the weight version of its rollout (the
version the rollout reported when the prompt was served, replaced by the real
trajectory version once a member arrives: a rollout may refresh before it starts).
Staleness of a consumed trajectory = batch version - trajectory version.

The guarantee. With bound k (mode sync: 0, one_step: 1, stream: 1 or
buffer.max_staleness, laminar: buffer.max_staleness or none), a group of version v
must be consumed by a batch of version <= v + k. Call `next_version` V the version
of the next batch to be served (trainer version, or one past the newest served
batch), and B = trainer.batch_groups. Batches V .. v+k have room for
(v + k + 1 - V) * B groups, so the unconsumed groups (served, not yet in a batch)
are all consumable in time iff, for every version d,

    unconsumed(version <= d)  <=  (d + k + 1 - V) * B                 (*)

(a Hall condition: the groups due by batch d need that many slots). This is
AReaL's capacity rule, (v + k + 1) * B groups started by version v, applied per
rollout version instead of at the trainer's version, because a Laminar rollout
may lag the trainer. Two places keep (*) true:

  * `admit` serves a rollout at version r only while (*) holds with the new
    groups counted at r (and never when r + k < V: that rollout must refresh
    first, reply reason "need_version" with min_version);
  * `plan_batch` serves a batch only if (*) still holds after it, for the next
    batch version: it must take, for every d, at least
    need(d) = unconsumed(<= d) - (d + k - V) * B groups of version <= d. It takes
    the oldest ready groups first until every need(d) is met (earliest deadline
    first), fills the rest in the sampling order, and waits (long-poll) when the
    old groups it must take are still generating: with a bound, the trainer
    waits for the long tail instead of outrunning it.

Together: no consumed trajectory has staleness > k, as long as the trainer asks
for B groups per batch and versions advance by one per batch. Groups that can
no longer meet their deadline (the trainer jumped versions, e.g. a restart from a
later checkpoint) are "expired": dropped and counted, never served.

Modes (laminar.manager.staleness.policy_for, shared with the simulator):
  * sync: k = 0, global updates: a rollout behind the trainer gets no prompts
    (min_version = trainer version); B groups per version, the batch waits for all.
  * one_step: k = 1, global updates, whole batches: batch j is the j-th B groups
    in serve order and waits for all of them (generation of j+1 overlaps training j).
  * stream: k = 1 (or max_staleness), global updates, batches of the first ready groups.
  * laminar: k = max_staleness (None = unbounded: admission only by capacity),
    no global updates: rollouts refresh when idle; min_version only when the bound needs it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from laminar.config import LaminarConfig
from laminar.manager.staleness import ModePolicy, policy_for

__all__ = [
    "Admission",
    "Decision",
    "GroupInfo",
    "BatchPlan",
    "admit",
    "hall_room",
    "plan_batch",
    "next_batch_version",
]


@dataclass(frozen=True)
class Admission:
    policy: ModePolicy
    batch_groups: int

    @property
    def bound(self) -> int | None:
        return self.policy.max_staleness

    @classmethod
    def for_mode(cls, mode: str, batch_groups: int, max_staleness: int | None = None) -> Admission:
        return cls(policy_for(mode, max_staleness), batch_groups)

    @classmethod
    def from_config(cls, cfg: LaminarConfig) -> Admission:
        return cls.for_mode(cfg.mode, cfg.trainer.batch_groups, cfg.buffer.max_staleness)


@dataclass(frozen=True)
class Decision:
    groups: int
    """How many groups may be served now."""
    reason: str = ""
    """Why none: "need_version" (refresh weights first) or "staleness" (wait for the trainer)."""
    min_version: int = -1
    """The lowest rollout version that may be served (-1: any)."""


def next_batch_version(trainer_version: int, last_batch_version: int) -> int:
    """Version of the next batch: the trainer's, or one past the newest batch already served."""
    return max(trainer_version, last_batch_version + 1)


def hall_room(
    k: int,
    batch_groups: int,
    next_version: int,
    rollout_version: int,
    unconsumed: Mapping[int, int],
) -> int:
    """Most groups of `rollout_version` that can be added while (*) holds for every version."""
    r = rollout_version
    if r + k < next_version:
        return 0
    below = sum(c for v, c in unconsumed.items() if v <= r)
    room = (r + k + 1 - next_version) * batch_groups - below
    for v in sorted(v for v in unconsumed if v > r):
        below += unconsumed[v]
        room = min(room, (v + k + 1 - next_version) * batch_groups - below)
    return max(0, room)


def admit(
    adm: Admission,
    *,
    rollout_version: int,
    requested: int,
    trainer_version: int,
    next_version: int,
    unconsumed: Mapping[int, int],
) -> Decision:
    """How many new groups a rollout at `rollout_version` may start now."""
    k = adm.bound
    floor = trainer_version if adm.policy.global_update else -1
    if k is not None:
        floor = max(floor, next_version - k)
    if rollout_version < floor:
        return Decision(0, "need_version", floor)
    shown = floor if adm.policy.global_update else -1
    if k is None:
        return Decision(requested, "", shown)
    room = hall_room(k, adm.batch_groups, next_version, rollout_version, unconsumed)
    if room > 0:
        return Decision(min(requested, room), "", shown)
    # a newer version (up to the trainer's) may have room where this one has none
    for v in range(rollout_version + 1, trainer_version + 1):
        if hall_room(k, adm.batch_groups, next_version, v, unconsumed) > 0:
            return Decision(0, "need_version", v)
    return Decision(0, "staleness", shown)


@dataclass(frozen=True)
class GroupInfo:
    """An unconsumed group as the planner sees it."""

    key: str
    version: int
    ready: bool
    serial: int
    """Serve order (whole-batch modes batch by it)."""


@dataclass
class BatchPlan:
    take: list[str] = field(default_factory=list)
    """Groups to serve, in batch order; empty = wait."""
    expired: list[str] = field(default_factory=list)
    """Ready groups past their deadline: drop them."""
    doomed: int = 0
    """Groups still generating that are already past their deadline (dropped when they finish)."""
    wait: str = ""
    """Why nothing is served yet: not_enough | staleness | whole_batch."""


def plan_batch(
    adm: Admission,
    *,
    want: int,
    batch_version: int,
    groups: list[GroupInfo],
    preference: list[str],
    final: bool = False,
) -> BatchPlan:
    """Choose `want` ready groups for the batch of `batch_version`, or say why to wait.

    `groups`: every unconsumed group (generating or ready); `preference`: the keys of
    the ready groups in sampling order (FIFO...). `final`: no more groups will ever
    be served (prompt epochs done), so a short last batch is allowed.
    """
    k = adm.bound
    plan = BatchPlan()
    live: list[GroupInfo] = []
    for g in groups:
        if k is not None and g.version + k < batch_version:
            if g.ready:
                plan.expired.append(g.key)
            else:
                plan.doomed += 1
        else:
            live.append(g)
    ready = {g.key: g for g in live if g.ready}
    generating = len(live) - len(ready)
    short_ok = final and generating == 0
    if adm.policy.whole_batch:
        head = sorted(live, key=lambda g: g.serial)[:want]
        if len(head) < want and not short_ok:
            plan.wait = "not_enough"
        elif not all(g.ready for g in head):
            plan.wait = "whole_batch"
        else:
            plan.take = [g.key for g in head]
        return plan
    order = [key for key in preference if key in ready]
    if len(order) < want and not short_ok:
        plan.wait = "not_enough"
        return plan
    size = min(want, len(order))
    if k is None:
        plan.take = order[:size]
        return plan
    # earliest deadline first, only as far as (*) needs for the next batch version
    rank = {key: i for i, key in enumerate(order)}
    by_age = sorted(order, key=lambda key: (ready[key].version, rank[key]))
    live_at = Counter(g.version for g in live)
    ready_at = Counter(g.version for g in ready.values())
    below = ready_below = must = 0
    for v in sorted(live_at):
        below += live_at[v]
        ready_below += ready_at[v]
        need = below - (v + k - batch_version) * adm.batch_groups
        if need > ready_below and need <= size:
            plan.wait = "staleness"  # the old groups it must take are still generating
            return plan
        must = max(must, min(need, size))
    take = by_age[:must]
    chosen = set(take)
    take += [key for key in order if key not in chosen][: size - len(take)]
    plan.take = take
    return plan
