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

Multi-turn trajectories send each chunk's slice of the loss mask (1 = model token,
0 = environment token). The pool keeps it next to the tokens; a chunk without one is
all model tokens. A recovered record carries the mask, or None when no chunk had one
(single-turn records stay exactly as they were). A mask whose length differs from its
tokens (chunk or header), or with a value other than 0/1, makes the chunk bad input.

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


def _bad_mask(mask: np.ndarray | None, n: int) -> bool:
    return mask is not None and (len(mask) != n or (n > 0 and int(mask.max()) > 1))


@dataclass
class _Record:
    header: PartialTrajectory
    ids: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray | None] = field(default_factory=list)
    """Per stored piece: its loss mask, None = all model tokens (no array kept for single-turn)."""
    length: int = 0
    awaiting_env: bool = False
    """Multi-turn: as the latest chunk reaching the record's end said (the resumer runs the env step)."""

    def add(self, ids: np.ndarray, logprobs: np.ndarray, mask: np.ndarray | None) -> None:
        if len(ids):
            # copies: the received frames would otherwise stay pinned for the trajectory's lifetime
            self.ids.append(np.array(ids, dtype=np.int32))
            self.logprobs.append(np.array(logprobs, dtype=np.float32))
            self.masks.append(None if mask is None else np.array(mask, dtype=np.uint8))
            self.length += len(ids)

    def loss_mask(self) -> np.ndarray | None:
        if all(m is None for m in self.masks):
            return None
        return np.concatenate(
            [
                np.ones(len(i), np.uint8) if m is None else m
                for i, m in zip(self.ids, self.masks, strict=True)
            ]
        )

    def materialize(self) -> PartialTrajectory:
        h = self.header
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int32)
        lps = np.concatenate(self.logprobs) if self.logprobs else np.zeros(0, np.float32)
        mask = self.loss_mask()
        if len(self.ids) > 1:  # keep it compact for the next query
            self.ids, self.logprobs, self.masks = [ids], [lps], [mask]
        return PartialTrajectory(uid=h.uid, group_id=h.group_id, prompt_uid=h.prompt_uid,
                                 sample_index=h.sample_index, prompt_ids=h.prompt_ids, response_ids=ids,
                                 logprobs=lps, version=h.version, n=h.n, prompt=h.prompt, row=h.row,
                                 rollout_id=h.rollout_id, resumed=h.resumed, t_start=h.t_start,
                                 loss_mask=mask, awaiting_env=self.awaiting_env)  # fmt: skip


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
        if _bad_mask(c.loss_mask, len(c.token_ids)):
            self.counts["bad_loss_mask"] += 1
            return "bad"
        if c.header is not None:
            h = c.header
            if h.uid != c.uid or len(h.response_ids) != len(h.logprobs) or h.version != c.version:
                self.counts["bad"] += 1
                return "bad"
            if _bad_mask(h.loss_mask, len(h.response_ids)):
                self.counts["bad_loss_mask"] += 1
                return "bad"
            if not h.rollout_id:
                h.rollout_id = c.rollout_id
            rec = _Record(header=h)
            rec.add(h.response_ids, h.logprobs, h.loss_mask)
            h.response_ids, h.logprobs = np.zeros(0, np.int32), np.zeros(0, np.float32)
            h.loss_mask = None
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
        if c.offset + len(c.token_ids) >= rec.length:  # the chunk reaches the end: its flag holds
            rec.awaiting_env = c.awaiting_env
        if skip >= len(c.token_ids):
            if len(c.token_ids):
                self.counts["duplicates"] += 1
            return "duplicate"
        if skip:
            self.counts["overlaps"] += 1
        mask = None if c.loss_mask is None else c.loss_mask[skip:]
        rec.add(c.token_ids[skip:], c.logprobs[skip:], mask)
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
