"""Serving batches to the trainer: BatchRequest long-polls -> whole groups; BatchCommit frees them.

    batches = BatchServer(cfg.buffer, admission, ledger, pool, metrics, log)
    reply = await batches.serve(req)     # BatchReply (maybe empty, info.wait says why) | ErrorReply
    reply = await batches.commit(c)      # CommitAck (ok False: put back) | ErrorReply

serve: one request at a time (a lock), so two trainers' long-polls never plan over the
same ready groups. restart=True first journals BatchesRequeued (every outstanding batch goes
back to the queue front, the trainer's version is taken as it is). Then it plans with
ExperienceState.plan (laminar/modes.py) until a plan takes groups or the
deadline, min(wait_s, buffer.max_wait_s), passes; each ledger change that may make a batch
servable (a group became ready or was dropped, an open group's version moved, a commit, a
requeue) wakes it: not a member that leaves its group open. Groups past
their staleness deadline are journaled as dropped on the way. A served batch is a BatchServed
record, durable before the reply; info carries its version and staleness (min/max/mean/hist).
An empty reply carries info.wait (not_enough | staleness | whole_batch), and
info.exhausted once the prompt epochs are done and no group is left.

commit: an outstanding batch becomes a BatchCommitted record (its groups are freed and never
served again), durable before the CommitAck; a duplicate commit is acked again; a batch put
back by a trainer restart gets ok=False.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import structlog

from laminar.buffer.experience import COMMITTED, OUTSTANDING
from laminar.buffer.ledger import Ledger
from laminar.buffer.prompts import PromptPool
from laminar.buffer.records import BatchCommitted, BatchesRequeued, BatchServed, GroupsDropped
from laminar.config import BufferConfig
from laminar.metrics import Metrics
from laminar.modes import Admission
from laminar.protocol.buffer import (
    BatchCommit,
    BatchReply,
    BatchRequest,
    BatchStaleness,
    CommitAck,
)
from laminar.transport.session import ErrorReply

__all__ = ["BatchServer"]


class BatchServer:
    def __init__(
        self,
        bc: BufferConfig,
        admission: Admission,
        ledger: Ledger,
        pool: PromptPool | None,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ):
        self.max_wait_s = bc.max_wait_s
        self.admission = admission
        self.ledger = ledger
        self.pool = pool
        self.metrics = metrics
        self.log = log
        self._lock = asyncio.Lock()

    async def serve(self, req: BatchRequest) -> BatchReply | ErrorReply:
        if req.groups <= 0:
            return ErrorReply(
                code="protocol", message=f"BatchRequest.groups must be >= 1, got {req.groups}"
            )
        st = self.ledger.state
        async with self._lock:
            if req.restart:
                requeued = [b.batch_id for b in st.outstanding()]
                off = self.ledger.record(BatchesRequeued(req.trainer_version, req.trainer_id))
                self.log.info(
                    "trainer_restart",
                    trainer=req.trainer_id,
                    version=req.trainer_version,
                    requeued=requeued,
                )
                await self.ledger.durable(off)
            else:
                # not journaled: a restarted buffer hears it again with the trainer's next request
                st.trainer_version = max(st.trainer_version, req.trainer_version)
            deadline = time.monotonic() + min(max(0.0, req.wait_s), self.max_wait_s)
            while True:
                changed = self.ledger.changed
                version = max(req.trainer_version, st.next_version)
                final = self.pool is not None and self.pool.exhausted
                plan = st.plan(req.groups, version, final)
                if plan.expired:
                    self.ledger.record(GroupsDropped(plan.expired, reason="expired"))
                    self.log.warning(
                        "groups_expired",
                        groups=len(plan.expired),
                        batch_version=version,
                        bound=self.admission.bound,
                    )
                if plan.take:
                    return await self._serve(req, version, plan.take)
                left = deadline - time.monotonic()
                if left <= 0:
                    exhausted = final and not st.groups
                    return BatchReply(
                        version=version,
                        wait=plan.wait,
                        exhausted=exhausted,
                        ready=len(st.in_state("ready")),
                        open=st.open_groups(),
                    )
                try:  # woken per plan change: a timer, not wait_for's task per wake
                    async with asyncio.timeout(left):
                        await changed.wait()
                except TimeoutError:
                    pass

    async def _serve(self, req: BatchRequest, version: int, group_ids: list[str]) -> BatchReply:
        st = self.ledger.state
        requeued = sum(1 for gid in group_ids if st.groups[gid].front)
        partial = sum(1 for gid in group_ids if st.groups[gid].lost)
        batch_id = f"b-{uuid.uuid4().hex[:16]}"
        off = self.ledger.record(BatchServed(batch_id, version, group_ids, req.trainer_id))
        trajs = st.batch_trajectories(st.batches[batch_id])
        stale = [version - t.version for t in trajs]
        hist: dict[str, int] = {}
        for s in stale:
            hist[str(s)] = hist.get(str(s), 0) + 1
        staleness = BatchStaleness(
            min=min(stale), max=max(stale), mean=sum(stale) / len(stale), hist=hist
        )
        self.metrics.count("batches_served")
        await self.ledger.durable(off)
        return BatchReply(
            batch_id=batch_id,
            trajectories=trajs,
            version=version,
            group_ids=group_ids,
            requeued_groups=requeued,
            partial_groups=partial,
            staleness=staleness,
        )

    async def commit(self, c: BatchCommit) -> CommitAck | ErrorReply:
        st = self.ledger.state
        b = st.batches.get(c.batch_id)
        if b is None:
            self.metrics.count("commits_unknown")
            return ErrorReply(
                code="unknown_batch", message=f"no batch {c.batch_id!r} was served by this buffer"
            )
        if b.state == COMMITTED:
            self.metrics.count("commits_duplicate")
            await self.ledger.durable()
            return CommitAck(duplicate=True)
        if b.state != OUTSTANDING:
            self.metrics.count("commits_requeued")
            return CommitAck(
                ok=False, reason=f"batch {c.batch_id} was put back by a trainer restart"
            )
        off = self.ledger.record(BatchCommitted(c.batch_id, c.step, c.version))
        await self.ledger.durable(off)
        return CommitAck(version=st.trainer_version)
