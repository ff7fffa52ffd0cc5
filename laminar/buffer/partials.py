"""Partial-response pool: the tokens of every in-flight trajectory, so a dead rollout loses nothing.

    pool = PartialPool()
    pool.apply(chunk)                        # PartialChunk from a rollout (one-way, best-effort)
    pool.remove(uid)                         # the trajectory finished (or was abandoned)
    pool.query(rollout_id="rollout-3")       # PartialTrajectory of each trajectory it last reported
    recover(pool, state.groups, rollout_id="rollout-3")   # the above + its never-started samples

Contract with the rollouts (laminar.rollout.tracking): chunks cover the response in
order, chunk.offset is the index of its first token, and the chunk at offset 0
carries a header (a PartialTrajectory with prompt, version, owner...). A header
always (re)starts the record: a resumed trajectory or a rollout whose buffer
connection came back sends one again. The pool keeps a contiguous prefix:
  * offset == length: appended;
  * offset < length: the overlapping part is ignored (a resend), the rest appended;
  * offset > length: a gap (a lost chunk) - counted, ignored until a header restarts it;
  * unknown uid without a header, or a version that differs from the record: counted, ignored.
The pool lives in memory only: after a buffer restart it fills again from headers.

Recovery (PartialsRequest from the manager, for a dead rollout): `recover` answers with
the pool's records plus, for each sample of an open group that was handed out but never
reported a header, an empty PartialTrajectory built from the group's prompt: resuming a
sample that never started is starting it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from laminar.buffer.experience import OPEN, Group
from laminar.protocol.data import PartialChunk, PartialTrajectory

__all__ = ["PartialPool", "recover"]

_EMPTY_I = np.zeros(0, np.int32)
_EMPTY_F = np.zeros(0, np.float32)


@dataclass
class _Record:
    header: PartialTrajectory
    ids: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    length: int = 0

    def add(self, ids: np.ndarray, logprobs: np.ndarray) -> None:
        if len(ids):
            # copies: the received frames would otherwise stay pinned for the trajectory's lifetime
            self.ids.append(np.array(ids, dtype=np.int32))
            self.logprobs.append(np.array(logprobs, dtype=np.float32))
            self.length += len(ids)

    def materialize(self) -> PartialTrajectory:
        h = self.header
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int32)
        lps = np.concatenate(self.logprobs) if self.logprobs else np.zeros(0, np.float32)
        if len(self.ids) > 1:  # keep it compact for the next query
            self.ids, self.logprobs = [ids], [lps]
        return PartialTrajectory(uid=h.uid, group_id=h.group_id, prompt_uid=h.prompt_uid,
                                 sample_index=h.sample_index, prompt_ids=h.prompt_ids, response_ids=ids,
                                 logprobs=lps, version=h.version, n=h.n, prompt=h.prompt, row=h.row,
                                 rollout_id=h.rollout_id, resumed=h.resumed, t_start=h.t_start)  # fmt: skip


class PartialPool:
    def __init__(self) -> None:
        self.records: dict[str, _Record] = {}
        self.counts: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self.records)

    @property
    def tokens(self) -> int:
        return sum(r.length for r in self.records.values())

    def apply(self, c: PartialChunk) -> str:
        """Fold one chunk in; returns what happened (appended | duplicate | gap | unknown | bad)."""
        if len(c.token_ids) != len(c.logprobs) or c.offset < 0:
            self.counts["bad"] += 1
            return "bad"
        if c.header is not None:
            h = c.header
            if h.uid != c.uid or len(h.response_ids) != len(h.logprobs) or h.version != c.version:
                self.counts["bad"] += 1
                return "bad"
            if not h.rollout_id:
                h.rollout_id = c.rollout_id
            rec = _Record(header=h)
            rec.add(h.response_ids, h.logprobs)
            h.response_ids, h.logprobs = np.zeros(0, np.int32), np.zeros(0, np.float32)
            self.records[c.uid] = rec
            self.counts["headers"] += 1
        found = self.records.get(c.uid)
        if found is None:
            self.counts["unknown"] += 1
            return "unknown"
        rec = found
        if c.version != rec.header.version:
            self.counts["version_mismatch"] += 1
            return "bad"
        if c.offset > rec.length:
            self.counts["gaps"] += 1
            return "gap"
        skip = rec.length - c.offset
        if skip >= len(c.token_ids):
            if len(c.token_ids):
                self.counts["duplicates"] += 1
            return "duplicate"
        if skip:
            self.counts["overlaps"] += 1
        rec.add(c.token_ids[skip:], c.logprobs[skip:])
        if c.rollout_id:
            rec.header.rollout_id = c.rollout_id
        self.counts["chunks"] += 1
        return "appended"

    def remove(self, uid: str) -> bool:
        return self.records.pop(uid, None) is not None

    def query(self, rollout_id: str = "", uids: list[str] | None = None) -> list[PartialTrajectory]:
        """In-flight trajectories last reported by `rollout_id`, or those named by `uids`."""
        if uids:
            recs = [self.records[u] for u in uids if u in self.records]
        else:
            recs = [r for r in self.records.values() if r.header.rollout_id == rollout_id]
        return [r.materialize() for r in recs]


def recover(pool: PartialPool, groups: Mapping[str, Group], rollout_id: str = "",
            uids: list[str] | None = None) -> list[PartialTrajectory]:  # fmt: skip
    """What a PartialsRequest asks for: in-flight records and never-started samples of open groups.

    `uids` given: those samples; otherwise every sample last reported by (or served to) `rollout_id`.
    """
    out = pool.query(rollout_id, uids)
    have = {p.uid for p in out} | set(pool.records)
    if uids:
        wanted = [(u.rpartition("/")[0], u.rpartition("/")[2]) for u in uids if u not in have]
        targets = [(g, int(i)) for gid, i in wanted if i.isdigit() and (g := groups.get(gid))]
    else:
        targets = [
            (g, i) for g in groups.values() if g.rollout_id == rollout_id for i in range(g.n)
        ]
    for g, i in targets:
        uid = f"{g.group_id}/{i}"
        if (
            g.state != OPEN
            or g.item is None
            or i >= g.n
            or i in g.members
            or i in g.lost
            or uid in have
        ):
            continue
        out.append(PartialTrajectory(uid=uid, group_id=g.group_id, prompt_uid=g.prompt_uid, sample_index=i,
                                     prompt_ids=g.item.prompt_ids, response_ids=_EMPTY_I, logprobs=_EMPTY_F,
                                     version=g.version, n=g.n, prompt=g.item.prompt, row=g.item.row,
                                     rollout_id=g.rollout_id))  # fmt: skip
    return out
