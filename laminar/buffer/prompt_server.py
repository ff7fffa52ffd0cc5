"""Serving prompts: a PromptRequest -> admission, capacity, the pool -> a journaled PromptReply.

    server = PromptServer(cfg.buffer, cfg.rollout.group_size, admission=admission, ledger=ledger,
                          pool=pool, metrics=metrics, leases=leases, log=log, members=members)
    reply = await server.serve(req)           # acked only after its GroupsServed record is durable

Order of the checks (the reply's reason names the first that says no):
  1. a retry of the rollout's last request (same request_id): the same groups again;
  2. no prompt dataset: empty;
  2a. the rollout must be one the manager lists as serving (laminar/buffer/members.py: alive,
     its engine up): not_member;
  2b. max_groups is capped so the rollout holds at most its share of open groups
     (buffer.max_groups_per_rollout, laminar/config.py groups_per_rollout()), and no more than
     its engine can start (Members.cap): rollout_full;
  2c. open groups whose lease ran out (laminar/buffer/leases.py), or that their holder never
     started while it stopped asking and working, held by another rollout:
     served again to this one, alone in the reply (a journaled GroupsReserved record), when
     admission lets this rollout take work at all;
  3. global_update (sync / one_step / stream): no work at a new version while older groups
     are still generating, so the update reaches every rollout at once (not partial: its older
     groups continue under the new version);
  4. admission (laminar/modes.py): need_version (+ min_version) | staleness;
  5. capacity (held + generating + n <= buffer.capacity): full;
  6. the pool: empty | epochs_done.
A refusal carries retry_after_s. The served groups, the pool cursor after them and the
request id go into one GroupsServed record; if it cannot be written the cursor is put back,
so those rows are served again later.
"""

from __future__ import annotations

import structlog

from laminar.buffer.leases import Leases
from laminar.buffer.ledger import Ledger
from laminar.buffer.members import Members
from laminar.buffer.prompts import PromptPool
from laminar.buffer.records import GroupsReserved, GroupsServed, ServedGroup
from laminar.config import BufferConfig, TrainerConfig
from laminar.metrics import Metrics
from laminar.modes import Admission, admit
from laminar.protocol.buffer import PromptReply, PromptRequest

__all__ = ["PromptServer", "check_capacity"]


def check_capacity(
    cap: int, n: int, tc: TrainerConfig, log: structlog.typing.FilteringBoundLogger
) -> None:
    """Warn when buffer.capacity `cap` can never hold what the trainer asks for (groups of
    `n` = rollout.group_size)."""
    b = tc.batch_groups
    if cap < n * b:
        log.warning(
            "capacity_below_batch",
            capacity=cap,
            needed=n * b,
            hint="buffer.capacity < rollout.group_size * trainer.batch_groups: "
            "no batch can ever fill",
        )
    if tc.commit == "checkpoint":
        need = (tc.checkpoint_every + 1) * b * n
        if cap < need:
            log.warning(
                "capacity_below_uncommitted",
                capacity=cap,
                needed=need,
                hint="trainer.commit=checkpoint keeps checkpoint_every batches "
                "uncommitted in the buffer",
            )


class PromptServer:
    def __init__(
        self,
        bc: BufferConfig,
        group_size: int,
        *,
        admission: Admission,
        ledger: Ledger,
        pool: PromptPool | None,
        metrics: Metrics,
        leases: Leases | None = None,
        log: structlog.typing.FilteringBoundLogger | None = None,
        per_rollout: int | None = None,
        members: Members | None = None,
    ):
        self.capacity = bc.capacity
        self.per_rollout = per_rollout if per_rollout is not None else bc.capacity
        """Open groups one rollout may hold (laminar/config.py groups_per_rollout())."""
        self.retry_after_s = bc.retry_after_s
        self.n = group_size
        self.admission = admission
        self.ledger = ledger
        self.pool = pool
        self.metrics = metrics
        if leases is None:
            leases = Leases(bc.lease_s, unstarted_s=bc.unstarted_lease())
        self.leases = leases
        self.members = members
        """The manager's serving rollouts (None: anyone may ask, tests of the rules alone)."""
        self.log = log if log is not None else structlog.get_logger("buffer")
        self.rollout_versions: dict[str, int] = {}
        """The version each rollout reported with its last request (stats)."""

    async def serve(self, req: PromptRequest) -> PromptReply:
        st = self.ledger.state
        self.rollout_versions[req.rollout_id] = req.version
        if req.request_id:
            last = st.last_reply.get(req.rollout_id)
            if last is not None and last[0] == req.request_id:  # a retry of a request we served
                self.metrics.count("prompt_request_retries")
                items = [
                    g.item
                    for gid in last[1]
                    if (g := st.groups.get(gid)) is not None and g.item is not None
                ]
                await self.ledger.durable()  # the first reply may still be on its way to the disk
                return PromptReply(items=items)
        wait = self.retry_after_s
        if self.pool is None:
            return PromptReply(retry_after_s=wait, reason="empty")
        # work goes to the rollouts the manager lists as serving, as much as each can start
        cap = self.per_rollout
        if self.members is not None:
            member_cap = self.members.cap(req.rollout_id)
            if member_cap is None:
                self.metrics.count("prompts_refused_not_member")
                return PromptReply(retry_after_s=wait, reason="not_member")
            cap = member_cap
        # a claim of room is capped by the rollout's share: it never holds more open groups
        room_here = cap - st.open_held[req.rollout_id]
        if req.max_groups > room_here:
            self.metrics.count("prompt_requests_capped")
            if room_here <= 0:
                self.metrics.count("prompts_refused_rollout_full")
                return PromptReply(retry_after_s=wait, reason="rollout_full")
            req.max_groups = room_here
        self.leases.asked(req.rollout_id)  # it has room and wants work: it is not idle
        again = await self._serve_expired(req)
        if again is not None:
            return again
        if (
            self.admission.policy.global_update
            and not self.admission.policy.interrupts  # partial: old groups continue at the new one
            and st.open_before(req.version)
        ):
            self.metrics.count("prompts_refused_global_update")
            return PromptReply(retry_after_s=wait, reason="global_update")
        n = self.n
        room = (self.capacity - st.held - st.pending) // n
        dec = admit(
            self.admission,
            rollout_version=req.version,
            requested=max(0, req.max_groups),
            trainer_version=st.trainer_version,
            next_version=st.next_version,
            unconsumed=st.unconsumed_by_version() if self.admission.bound is not None else {},
        )
        if dec.groups <= 0 and dec.reason:
            self.metrics.count(f"prompts_refused_{dec.reason}")
            return PromptReply(retry_after_s=wait, reason=dec.reason, min_version=dec.min_version)
        if room <= 0:
            self.metrics.count("prompts_refused_full")
            return PromptReply(retry_after_s=wait, reason="full", min_version=dec.min_version)
        k = min(req.max_groups, room, dec.groups)
        if k <= 0:
            return PromptReply(retry_after_s=wait, min_version=dec.min_version)
        cursor = self.pool.cursor()
        items, why = self.pool.next_items(k, n)
        if not items:
            return PromptReply(retry_after_s=wait, reason=why, min_version=dec.min_version)
        served = GroupsServed(
            groups=[
                ServedGroup(group_id=it.group_id, uid=it.uid, n=n, version=req.version, item=it)
                for it in items
            ],
            rollout_id=req.rollout_id,
            version=req.version,
            request_id=req.request_id,
            cursor=self.pool.cursor(),
        )
        try:
            off = self.ledger.record(served)
        except Exception:
            self.pool.restore(cursor)  # not journaled: serve these rows again later
            raise
        for it in items:
            self.leases.served(it.group_id)
        self.metrics.count("prompts_served", len(items))
        await self.ledger.durable(off)
        return PromptReply(items=items, min_version=dec.min_version)

    async def _serve_expired(self, req: PromptRequest) -> PromptReply | None:
        """Open groups whose holder went silent for a lease, served again to this rollout."""
        st = self.ledger.state
        groups = self.leases.expired(st.groups, req.rollout_id, req.max_groups)
        if not groups:
            return None
        dec = admit(
            self.admission,
            rollout_version=req.version,
            requested=len(groups),
            trainer_version=st.trainer_version,
            next_version=st.next_version,
            unconsumed=st.unconsumed_by_version() if self.admission.bound is not None else {},
        )
        if dec.groups <= 0:
            return None  # this rollout may take no work now: the normal path says why
        groups = groups[: dec.groups]
        for g in groups:
            self.log.warning(
                "lease_expired",
                group_id=g.group_id,
                holder=g.rollout_id,
                to=req.rollout_id,
                silent_s=round(self.leases.silent_for(g.group_id), 1),
                finished=g.finished,
                n=g.n,
            )
        gids = [g.group_id for g in groups]
        off = self.ledger.record(GroupsReserved(req.rollout_id, gids, req.request_id))
        for gid in gids:
            self.leases.served(gid)
        self.metrics.count("groups_reserved", len(gids))
        await self.ledger.durable(off)
        return PromptReply(items=[g.item for g in groups if g.item is not None])
