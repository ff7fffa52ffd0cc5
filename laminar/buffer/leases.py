"""Leases on served groups: a group whose rollout went silent is served again to another one.

    leases = Leases(cfg.buffer.lease_s, unstarted_s=cfg.buffer.unstarted_lease())  # clock= tests
    leases.seed(state.groups)                        # after replay: every open group, a fresh lease
    leases.served(group_id)                          # served (again): a fresh lease, not started
    leases.touch(group_id)                           # progress: a chunk, a trajectory, an abandon
    leases.asked(rollout_id)                         # a rollout with room asked for prompts
    for g in leases.expired(state.groups, rollout_id, k): ...  # to serve again, oldest first

A rollout that takes a group and then neither streams a chunk of it nor finishes or
abandons any of its samples for `buffer.lease_s` seconds holds it for nothing: a rollout
that is alive but wedged is never declared dead by the manager, so its groups would stay
open forever (and, with a global update, block every new version). The prompt server
then serves the group again, to a rollout other than its holder, recording a GroupsReserved
journal record that names the new holder.

Exactly once: members are keyed by (group_id, sample_index) in ExperienceState, so
whichever copy of a sample arrives first is stored and the other is acked as a duplicate
(or as late, once the group was released): a group served twice is still counted and
trained once.

Unused leases come back sooner: a group its holder never started (no progress since it was
served) is served again once `unstarted_s` passed and, for that long, the holder neither asked
for prompts with room to take them nor made progress on any group it holds: an id that took
work and went quiet (a key holder minting ids, a rollout whose engine wedged before starting
anything) keeps it for `unstarted_s` (default a minute), not `lease_s`. A working rollout's
queued groups stay with it: it makes progress on the others, or asks for more. A scan of the
unstarted groups that finds no holder idle is not made again for QUIET_S (only time can make
one idle), so prompt requests do not each walk thousands of busy holders' queued groups.

The clock is the buffer's own, not journaled: after a restart every open group starts a
fresh lease (`seed`). That only delays a re-serve by at most one lease; it never serves a
group early.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

from laminar.buffer.experience import OPEN, Group

__all__ = ["Leases"]

QUIET_S = 1.0
"""After a scan of the unstarted groups found no idle holder, how long the next waits (at most a
tenth of unstarted_s): a group whose holder turned idle meanwhile is served again that late."""


class Leases:
    def __init__(
        self,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
        unstarted_s: float | None = None,
    ):
        self.lease_s = lease_s
        self.unstarted_s = lease_s if unstarted_s is None else min(unstarted_s, lease_s)
        self.clock = clock
        self._last: OrderedDict[str, float] = OrderedDict()
        """Open group id -> the time of its last progress, oldest first."""
        self._unstarted: OrderedDict[str, float] = OrderedDict()
        """Served group id -> when it was served, oldest first, until its first progress."""
        self._asked: dict[str, float] = {}
        """Rollout id -> when it last asked for prompts with room for them."""
        self._quiet = (0.0, float("-inf"))
        """[from, until): no unstarted group can be served again in it (see _unused)."""

    def __len__(self) -> int:
        return len(self._last)

    def seed(self, groups: Mapping[str, Group]) -> None:
        """Give every open group a fresh lease (at start, after the journal was replayed)."""
        now = self.clock()
        for gid, g in groups.items():
            if g.state == OPEN and gid not in self._last:
                self._last[gid] = now

    def served(self, group_id: str) -> None:
        """A new group was served: its lease starts now, and it is not started yet."""
        now = self.clock()
        self._last[group_id] = now
        self._last.move_to_end(group_id)
        self._unstarted[group_id] = now
        self._unstarted.move_to_end(group_id)

    def asked(self, rollout_id: str) -> None:
        """`rollout_id` asked for prompts, with room for them: it is not idle."""
        self._asked[rollout_id] = self.clock()

    def touch(self, group_id: str) -> None:
        """Progress on a group (a chunk, a finished or abandoned sample): renew its lease."""
        self.touch_many((group_id,))

    def touch_many(self, group_ids: Iterable[str]) -> None:
        """Progress on several groups at once (a rollout's partial batch): one clock read."""
        now, last, unstarted = self.clock(), self._last, self._unstarted
        for gid in group_ids:
            if gid in last:
                last[gid] = now
                last.move_to_end(gid)
                unstarted.pop(gid, None)

    def silent_for(self, group_id: str) -> float:
        """Seconds since the group's last progress (0 when it holds no lease)."""
        last = self._last.get(group_id)
        return 0.0 if last is None else self.clock() - last

    def expired(self, groups: Mapping[str, Group], rollout_id: str, limit: int) -> list[Group]:
        """Up to `limit` open groups whose lease ran out, held by a rollout other than
        `rollout_id`, oldest first. Groups no longer open are forgotten on the way."""
        if limit <= 0 or not self._last:
            return []
        deadline = self.clock() - self.lease_s
        out: list[Group] = []
        gone: list[str] = []
        for gid, last in self._last.items():
            if last > deadline:
                break  # ordered by last progress: the rest are younger
            g = groups.get(gid)
            if g is None or g.state != OPEN:
                gone.append(gid)
                continue
            if g.rollout_id == rollout_id or g.item is None:
                continue  # the holder itself asking, or nothing to serve it with
            out.append(g)
            if len(out) >= limit:
                break
        for gid in gone:
            del self._last[gid]
            self._unstarted.pop(gid, None)
        if len(out) < limit and self._unstarted:
            out += self._unused(groups, rollout_id, limit - len(out), {g.group_id for g in out})
        return out

    def _unused(
        self, groups: Mapping[str, Group], rollout_id: str, limit: int, taken: set[str]
    ) -> list[Group]:
        """Up to `limit` groups never started, served over unstarted_s ago to a holder other than
        `rollout_id` that has been idle as long (no request with room, no progress on any of its
        groups). Cheap when nothing is that old: the oldest unstarted group is looked at first."""
        now = self.clock()
        if self._quiet[0] <= now < self._quiet[1]:
            return []
        cutoff = now - self.unstarted_s
        cands: list[Group] = []
        gone: list[str] = []
        for gid, served_at in self._unstarted.items():
            if served_at > cutoff:
                break  # ordered by serving time: the rest are younger
            g = groups.get(gid)
            if g is None or g.state != OPEN:
                gone.append(gid)
            elif g.item is not None:  # every holder's: the quiet window below is everyone's
                cands.append(g)
        for gid in gone:
            del self._unstarted[gid]
        holders = {g.rollout_id for g in cands if self._asked.get(g.rollout_id, -1.0) <= cutoff}
        if holders:  # progress on a started group of theirs since the cutoff: not idle
            for gid, last in reversed(self._last.items()):
                if last <= cutoff:
                    break
                g = groups.get(gid)
                if g is not None and g.rollout_id in holders and gid not in self._unstarted:
                    holders.discard(g.rollout_id)
                    if not holders:
                        break
        if not holders:
            if not cands:
                return []
            # old groups, but no holder idle: only time can change that (an ask or progress
            # makes a holder less idle; a group turns old only as time passes), so the next scan
            # waits a moment. Without it every prompt request scanned every old unstarted group
            # of busy holders (thousands while rollouts hold served prompts unstarted)
            self._quiet = (now, now + min(QUIET_S, self.unstarted_s / 10))
            return []
        return [
            g
            for g in cands
            if g.rollout_id in holders and g.rollout_id != rollout_id and g.group_id not in taken
        ][:limit]
