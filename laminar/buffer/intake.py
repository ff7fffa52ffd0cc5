"""Finished and abandoned samples: Trajectory / TrajectoryAbandoned -> a journaled TrajectoryAck.

    intake = Intake(ledger, partials, metrics, log, owners=owners, limits=limits, refusals=r)
    reply = await intake.trajectory(t, peer_id)   # TrajectoryAck once its record is durable
    reply = await intake.abandoned(msg, peer_id)  # TrajectoryAck once its record is durable

A trajectory is checked by ExperienceState.check_trajectory: bad input gets an
ErrorReply (the sender drops it), a duplicate or a late member a TrajectoryAck that says so
(the sender stops resending; nothing is stored twice). A member from a peer that may not
send it (laminar/buffer/owners.py: never served to it, or moved to another rollout) gets
TrajectoryAck(refused="not_owner") whether or not its real copy already arrived (a duplicate
ack would tell a stranger the sample finished); a new member out of
the configured limits (reward range, vocabulary, length) gets TrajectoryAck(refused=why):
counted per peer, never stored. Any other new member is journaled and acked only once
durable. Either way the sample's partial-pool record is dropped: it
finished. Abandons follow the same rules with check_abandoned.

Multi-turn trajectories: a loss_mask whose length differs from the response (or with
values other than 0/1) is bad input, rejected with the reason. Environment tokens (mask 0)
should carry logprob 0.0; one that does not is accepted and counted
(`env_logprob_nonzero`): the trainer never reads an environment token's logprob (it is
masked out of the loss), so the sample is still exact, but the count shows a rollout bug.
"""

from __future__ import annotations

import numpy as np
import structlog

from laminar.buffer.ledger import Ledger
from laminar.buffer.owners import Owners, Refusals, SampleLimits
from laminar.buffer.partials import PartialPool
from laminar.buffer.records import MemberAbandoned, TrajectoryAccepted
from laminar.metrics import Metrics
from laminar.protocol.buffer import Refusal, TrajectoryAbandoned, TrajectoryAck
from laminar.protocol.data import Trajectory
from laminar.transport.session import ErrorReply

__all__ = ["Intake"]


class Intake:
    def __init__(
        self,
        ledger: Ledger,
        partials: PartialPool,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        *,
        owners: Owners | None = None,
        limits: SampleLimits | None = None,
        refusals: Refusals | None = None,
    ):
        self.ledger = ledger
        self.partials = partials
        self.metrics = metrics
        self.log = log
        self.owners = owners
        """None: any peer may send any sample (tests of the state alone)."""
        self.limits = limits or SampleLimits()
        self.refusals = refusals or Refusals(metrics, log)

    async def trajectory(self, t: Trajectory, peer_id: str) -> TrajectoryAck | ErrorReply:
        reply, off = self.take_trajectory(t, peer_id)
        if off is not None:
            await self.ledger.durable(off)
        return reply

    async def abandoned(
        self, msg: TrajectoryAbandoned, peer_id: str = ""
    ) -> TrajectoryAck | ErrorReply:
        reply, off = self.take_abandoned(msg, peer_id)
        if off is not None:
            await self.ledger.durable(off)
        return reply

    def take_trajectory(
        self, t: Trajectory, peer_id: str
    ) -> tuple[TrajectoryAck | ErrorReply, int | None]:
        """The reply, and the journal offset that must be durable before it goes (None: it may go
        now). Everything but that wait, so the node answers without a task when nothing waits."""
        st = self.ledger.state
        verdict, why = st.check_trajectory(t)
        if verdict == "bad":
            self.metrics.count("trajectories_rejected")
            self.log.warning("bad_trajectory", uid=t.uid, error=why, peer=peer_id)
            return ErrorReply(code="protocol", message=why), None
        if verdict == "ok":
            refused: Refusal | None = None
            if self.owners is not None:
                refused = self.owners.refusal(t.group_id, t.sample_index, peer_id)
            if refused is None:
                refused = self.limits.refusal(t)
            if refused is None and self.owners is not None:
                refused = self.owners.prompt_refusal(t.group_id, t.prompt_uid, t.prompt_ids)
            if refused is not None:  # before anything changes: the owner's record stays
                self.refusals.count(peer_id, refused, uid=t.uid)
                return TrajectoryAck(refused=refused), None
        elif self.owners is not None and not self._own_copy(t, peer_id):
            # a finished or late sample: a non-owner learns no more than of a running one
            refused = self.owners.refusal(t.group_id, t.sample_index, peer_id)
            if refused is not None:
                self.refusals.count(peer_id, refused, uid=t.uid)
                return TrajectoryAck(refused=refused), None
        self.partials.remove(t.uid)
        if verdict != "ok":
            self.metrics.count(f"trajectories_{verdict}")
            # the first copy may still be on its way to the disk: wait for all that was written
            written = self.ledger.written
            if verdict == "duplicate":
                return TrajectoryAck(duplicate=True), written
            return TrajectoryAck(ignored=why), written
        if t.loss_mask is not None and np.any(t.logprobs[t.loss_mask == 0] != 0.0):
            self.metrics.count("env_logprob_nonzero")
        t.staleness_at_finish = st.trainer_version - t.version
        return TrajectoryAck(), self.ledger.record(TrajectoryAccepted(t))

    def take_abandoned(
        self, msg: TrajectoryAbandoned, peer_id: str = ""
    ) -> tuple[TrajectoryAck | ErrorReply, int | None]:
        """As take_trajectory, for an abandoned sample."""
        verdict, why, idx = self.ledger.state.check_abandoned(msg.uid, msg.group_id)
        if verdict == "bad":
            self.metrics.count("abandons_rejected")
            return ErrorReply(code="protocol", message=why), None
        known = verdict == "ok" or msg.group_id in self.ledger.state.groups
        if known and self.owners is not None:  # finished or not, the same answer to a non-owner
            refused = self.owners.refusal(msg.group_id, idx, peer_id)
            if refused is not None:
                self.refusals.count(peer_id, refused, uid=msg.uid)
                return TrajectoryAck(refused=refused), None
        self.partials.remove(msg.uid)
        if verdict != "ok":
            self.metrics.count("abandons_ignored")
            return TrajectoryAck(ignored=why), None
        off = self.ledger.record(MemberAbandoned(msg.group_id, idx, msg.uid, msg.reason))
        self.log.info("trajectory_abandoned", uid=msg.uid, reason=msg.reason)
        return TrajectoryAck(), off

    def _own_copy(self, t: Trajectory, peer_id: str) -> bool:
        """Did `peer_id` send the stored copy of this sample (a retry of its own: a duplicate)?"""
        g = self.ledger.state.groups.get(t.group_id)
        stored = g.members.get(t.sample_index) if g is not None else None
        return stored is not None and stored.rollout_id == peer_id
