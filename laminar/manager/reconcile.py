"""Reconciliation: samples the buffer holds on a live rollout that the rollout no longer runs.

    rec = Reconciler(placer, connect_buffer, 10.0, metrics, log)
    entry = await rec.round(trainer_version, skip=lambda: {"rollout-3"})   # every interval
    #  {"suspects": 4, "stranded": 2, "placed": {"rollout-1": 2}}

A sample in flight lives on one rollout and has a partial record in the buffer, which names
that rollout as its holder (the placement, else its last reporter). Recovery of a dead rollout
goes by that name. One window is left where the holder is alive and does not run the sample:
a repack move exports samples from their source (which forgets them) and the manager places
them; a manager killed in between, or an export whose reply was lost, leaves them with nobody
until their group's lease runs out (buffer.lease_s, 600 s by default).

Each round asks the buffer which samples it holds on each live rollout (HeldRequest: one pass
over its records, read in pages) and reads each rollout's latest status
(RolloutStatus.traj_tokens names every sample it runs or waits on). A sample the buffer puts
on a rollout whose status does not name it is a suspect. It is stranded when the next round
finds the same: the buffer still puts it on that rollout, and a newer status (by the rollout's
own clock) still does not name it. Then its record is asked for (PartialsRequest) and placed as
a recovery places a dead rollout's samples.

What must never be taken for stranded, and how it is left alone:
- a sample being placed (imported somewhere, announced to the buffer first) or an orphan
  waiting for a home: `Placer.held()`;
- the samples of a move under way (exported, not yet in the placer's hands): the source is
  skipped while `Repacker.moving` has it;
- a finished sample still on the rollout (no longer in traj_tokens, its record not yet closed
  by the trajectory): waiting for its reward (RolloutStatus.scoring) or for the buffer's ack
  (its outbox). A suspect is stranded only if the rollout's oldest such trajectory is younger
  than the suspect's first miss, so it cannot be that one;
- a rollout the manager is recovering, asleep (colocated), or with no status: skipped.
A wrong call costs work, never data: the buffer takes a sample from the rollout it was last
placed on and keeps the first finished copy of a uid.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import structlog

from laminar.manager.placement import ORPHAN, Placer
from laminar.metrics import Metrics
from laminar.protocol.buffer import HeldReply, HeldRequest, PartialsReply, PartialsRequest
from laminar.protocol.rollout import RolloutStatus
from laminar.transport.client import RpcClient
from laminar.transport.sockets import RemoteError, TransportError

__all__ = ["Reconciler", "Suspect", "judge"]

HELD_REPLY_BYTES = 256 << 10
"""Aim for a HeldReply page: its uids travel in the msgpack header, which
transport.max_header_bytes bounds (1 MiB by default)."""
UID_BYTES = 64
"""Generous bytes of one uid in a HeldReply (a group id, "/", the index, msgpack framing)."""
MAX_PAGES = 10_000
"""Pages one round reads at most (a buffer that kept answering `more` would hold it forever)."""


@dataclass(frozen=True)
class Suspect:
    rollout_id: str
    """The rollout the buffer put it on when it was first missed."""
    measured_at: float
    """RolloutStatus.measured_at (the rollout's clock) of the status that did not name it."""


def judge(
    held: Mapping[str, list[str]],
    statuses: Mapping[str, RolloutStatus],
    suspects: Mapping[str, Suspect],
    in_hand: set[str],
) -> tuple[dict[str, Suspect], dict[str, list[str]]]:
    """One round's verdicts: (the suspects to carry to the next round, the stranded samples by
    the rollout the buffer puts them on). `held`: the buffer's answer; `statuses`: the rollouts
    judged this round (a rollout not in it judges none of its samples); `suspects`: the last
    round's; `in_hand`: uids the placer has (never suspects)."""
    keep: dict[str, Suspect] = {}
    stranded: dict[str, list[str]] = defaultdict(list)
    for rid, uids in held.items():
        st = statuses.get(rid)
        if st is None:
            continue
        named = st.traj_tokens
        for uid in uids:
            if uid in named or uid in in_hand:
                continue
            prev = suspects.get(uid)
            if prev is None or prev.rollout_id != rid:  # first missed here
                keep[uid] = Suspect(rid, st.measured_at)
            elif st.measured_at <= prev.measured_at or (
                # no newer status since; or a newer one, but the sample may still be finishing
                # there (scored, then in the outbox): a trajectory there finished before the
                # first miss (the oldest waits longer than the time between the two statuses)
                _unacked_oldest_s(st) >= st.measured_at - prev.measured_at
            ):
                keep[uid] = prev
            else:
                stranded[rid].append(uid)
    return keep, dict(stranded)


def _unacked_oldest_s(st: RolloutStatus) -> float:
    """How long the rollout's oldest finished, unacked trajectory has waited (its reward or the
    buffer's ack; 0 when none)."""
    return max(
        st.outbox_oldest_s if st.outbox > 0 else 0.0,
        st.scoring_oldest_s if st.scoring > 0 else 0.0,
    )


class Reconciler:
    """The rounds' state (the suspects) and their I/O; see the module docstring."""

    def __init__(
        self,
        placer: Placer,
        buffer: Callable[[], Awaitable[RpcClient]],
        request_timeout_s: float,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ):
        self.placer, self.buffer = placer, buffer
        self.request_timeout_s = request_timeout_s
        self.max_uids = HELD_REPLY_BYTES // UID_BYTES
        """uids in one page of the buffer's answer."""
        self.metrics, self.log = metrics, log
        self.suspects: dict[str, Suspect] = {}
        """uid -> when and where it was first missed (carried from round to round)."""

    def _statuses(self, skip: set[str]) -> dict[str, RolloutStatus]:
        out = {}
        for p in self.placer.live():
            s = p.status
            if p.node_id in skip or s is None or s.rollout is None or s.rollout.asleep:
                continue
            out[p.node_id] = s.rollout
        return out

    async def round(self, trainer_version: int, skip: Callable[[], set[str]]) -> dict[str, object]:
        """Ask, judge, and place what is stranded. `skip()`: the rollouts to leave alone (being
        recovered, the source of a move under way), read before the question and again before
        the verdicts (a move may have begun meanwhile)."""
        ids = [p.node_id for p in self.placer.live() if p.node_id not in skip()]
        if not ids:
            self.suspects = {}
            return {"suspects": 0, "stranded": 0, "placed": {}}
        failed: dict[str, object] = {"suspects": len(self.suspects), "failed": True}
        held: dict[str, list[str]] = {}
        # unique across manager restarts: the buffer serves a round's pages from one pass
        ask = HeldRequest(rollout_ids=ids, round=time.time_ns(), max_uids=self.max_uids)
        try:
            buf = await self.buffer()
            for _ in range(MAX_PAGES):
                rep = await buf.request(ask, timeout=self.request_timeout_s)
                if not isinstance(rep, HeldReply):
                    return failed
                held.update(rep.held)
                if not rep.more:
                    break
        except (TransportError, RemoteError) as exc:
            self.log.warning("reconcile_ask_failed", error=str(exc))
            return failed
        # statuses read after the buffer answered
        self.suspects, stranded = judge(
            held, self._statuses(skip()), self.suspects, self.placer.held()
        )
        self.metrics.count("reconcile_rounds")
        found = 0
        placed: dict[str, int] = defaultdict(int)
        for rid, uids in stranded.items():
            try:
                got = await buf.request(PartialsRequest(uids=uids), timeout=self.request_timeout_s)
            except (TransportError, RemoteError) as exc:
                self.log.warning("reconcile_partials_failed", rollout=rid, error=str(exc))
                continue
            if not isinstance(got, PartialsReply) or not got.partials:
                continue
            found += len(got.partials)
            self.metrics.count("reconciled_stranded", len(got.partials))
            self.log.warning(
                "stranded_samples",
                rollout=rid,
                count=len(got.partials),
                tokens=int(sum(len(p.response_ids) for p in got.partials)),
            )
            # the rollout that lost them last: it may be what lost them
            placing = await self.placer.place(got.partials, trainer_version, source=rid)
            for k, v in placing.items():
                placed[k] += v
        return {
            "suspects": len(self.suspects),
            "stranded": found,
            "placed": {k: v for k, v in placed.items() if k != ORPHAN},
            "orphans": placed.get(ORPHAN, 0),
        }
