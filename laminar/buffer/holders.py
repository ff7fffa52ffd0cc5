"""Who holds an in-flight sample, by the partial pool's records: the manager's questions.

    recover(pool, state.groups, rollout_id="rollout-3", placed=state.placed)
        # PartialsRequest(rollout_id): every sample a dead rollout holds, to resume elsewhere
    recover(pool, state.groups, uids=["g/0"])        # PartialsRequest(uids): those samples
    pages = HeldPages()
    held, more = pages.page(pool, state.placed, ["rollout-1", ...], round_id, max_uids=4096)
        # HeldRequest: the uids each live rollout holds (laminar/manager/reconcile.py)

A sample is held by the rollout the manager placed it on (SamplesPlaced, ExperienceState.placed)
from the placement on, else by the rollout that last reported it (its record), else, never
started, by the one its group was served to. Recovery answers with the records plus, for each
sample of an open group that was handed out but never reported a header, an empty
PartialTrajectory built from the group's prompt: resuming a sample that never started is
starting it. The reconciliation's answer is made by one pass over the records per round and
served in pages (each page is a msgpack header, which transport.max_header_bytes bounds).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import numpy as np

from laminar.buffer.experience import OPEN, Group
from laminar.buffer.partials import PartialPool
from laminar.protocol.data import PartialTrajectory

__all__ = ["HeldPages", "held_by", "recover"]

_EMPTY_I = np.zeros(0, np.int32)
_EMPTY_F = np.zeros(0, np.float32)


def held_by(
    pool: PartialPool, rollout_ids: list[str], placed: Mapping[str, str] | None = None
) -> dict[str, list[str]]:
    """What a HeldRequest asks for: the uids with a record that each of `rollout_ids` holds, by
    the owner `recover` goes by (the placement, else the record's last reporter). Rollouts that
    hold none are left out."""
    placed = placed if placed is not None else {}
    wanted = set(rollout_ids)
    out: dict[str, list[str]] = {}
    for uid, r in pool.records.items():
        owner = placed.get(uid, r.header.rollout_id)
        if owner in wanted:
            out.setdefault(owner, []).append(uid)
    return out


class HeldPages:
    """A reconciliation round's answer (HeldRequest), made once per round by one pass over the
    records and served in pages: a round costs one pass however many pages it takes."""

    def __init__(self) -> None:
        self._round: int | None = None
        self._left: deque[tuple[str, list[str]]] = deque()

    def page(
        self,
        pool: PartialPool,
        placed: Mapping[str, str],
        rollout_ids: list[str],
        round_id: int,
        max_uids: int,
    ) -> tuple[dict[str, list[str]], bool]:
        """The next page of round `round_id` (a new round id: made now), and whether more
        follow. Whole rollouts while they fit in `max_uids`; a rollout holding more than that
        has its first `max_uids` in uid order (the rest wait for a later round)."""
        if round_id != self._round:
            self._round = round_id
            self._left = deque(sorted(held_by(pool, rollout_ids, placed).items()))
        out: dict[str, list[str]] = {}
        n, cap = 0, max(1, max_uids)
        while self._left and (not out or n + len(self._left[0][1]) <= cap):
            rid, uids = self._left.popleft()
            out[rid] = sorted(uids)[:cap]
            n += len(out[rid])
        return out, bool(self._left)


def recover(
    pool: PartialPool,
    groups: Mapping[str, Group],
    rollout_id: str = "",
    uids: list[str] | None = None,
    placed: Mapping[str, str] | None = None,
) -> list[PartialTrajectory]:
    """What a PartialsRequest asks for: in-flight records and never-started samples of open groups.

    `uids` given: those samples; otherwise every sample `rollout_id` holds. A sample the manager
    placed on a rollout (`placed`: ExperienceState.placed, from SamplesMoved) is that rollout's
    from the placement on, whatever its record says: the rollout it moved to re-heads the record
    only with its first flush, so a rollout that dies within that window still holds it, and the
    source it left holds it no more. Any other sample is held by the rollout that last reported
    it (its record), else by the one its group was served to (never started).
    """
    placed = placed if placed is not None else {}
    if uids:
        out = pool.query(uids=uids)
    else:
        held = [
            u for u, r in pool.records.items() if placed.get(u, r.header.rollout_id) == rollout_id
        ]
        out = pool.query(uids=held) if held else []
    have = {p.uid for p in out} | set(pool.records)
    if uids:
        wanted = [(u.rpartition("/")[0], u.rpartition("/")[2]) for u in uids if u not in have]
        targets = [(g, int(i)) for gid, i in wanted if i.isdigit() and (g := groups.get(gid))]
    else:
        targets = [
            (g, i)
            for g in groups.values()
            if g.rollout_id == rollout_id
            for i in range(g.n)
            if placed.get(f"{g.group_id}/{i}", rollout_id) == rollout_id
        ]
        for uid, dest in placed.items():  # never started where it was placed
            gid, _, idx = uid.rpartition("/")
            g = groups.get(gid)
            if dest == rollout_id and g is not None and g.rollout_id != rollout_id:
                targets.append((g, int(idx)))
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
        out.append(
            PartialTrajectory(
                uid=uid,
                group_id=g.group_id,
                prompt_uid=g.prompt_uid,
                sample_index=i,
                prompt_ids=g.item.prompt_ids,
                response_ids=_EMPTY_I,
                logprobs=_EMPTY_F,
                version=g.version,
                n=g.n,
                prompt=g.item.prompt,
                row=g.item.row,
                rollout_id=g.rollout_id,
                image_digests=g.item.image_digests,
            )
        )
    return out
