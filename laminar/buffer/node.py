"""Buffer node: prompt pool, partial-response pool, experience buffer and its durable journal.

    rollout ──PromptRequest(credits, version)──► PromptServer ──► PromptReply
    rollout ──PartialBatch (one-way)───────────► PartialPool ◄──PartialsRequest── manager
    rollout ──Trajectory / TrajectoryAbandoned─► Intake ─► Ledger ─► TrajectoryAck
    trainer ──BatchRequest (long-poll)─────────► BatchServer ─► Ledger ─► BatchReply
    trainer ──BatchCommit──────────────────────► BatchServer ─► Ledger ─► groups freed
    anyone  ──BufferStatsRequest───────────────► BufferStats: counters, staleness histograms

    PromptServer: retry table, expired leases, admission, capacity, pool. PartialsRequest: the
    manager's recovery (records + unstarted samples). TrajectoryAck: once the record is durable.
    BatchServer: plans whole ready groups. Ledger: each change a typed journal record
    (laminar/buffer/records.py: TrajectoryAccepted, MemberAbandoned, BatchServed, ...).

This module only wires the parts (laminar/buffer/*): each handler hands the decoded
request to one part and returns its reply. The parts share one Ledger
(laminar/buffer/ledger.py): every change of the experience state is a journal record,
appended then applied by laminar.buffer.experience.ExperienceState, live and at replay
alike, so a buffer restarted on the same run_dir (even after kill -9) comes back with
every acknowledged trajectory, every outstanding batch and every commit. Nothing is
acked before its record is written (and fsync'ed when buffer.fsync=always).

What blocks what: setup replays the journal and loads the prompts on the node's compute
thread before the server binds; a BatchRequest long-polls (up to min(wait_s,
buffer.max_wait_s)) and is woken by the Ledger when a member finishes or is abandoned,
a batch is committed or requeued. The node's own loops are the journal flusher
(fsync=batch) and the compactor: once the file outgrows its mark, a snapshot of the
state is written on the journal's thread while records go on being appended and acked.
Rules: admission / batch planning laminar/modes.py, prompt
serving laminar/buffer/prompt_server.py, batches and commits laminar/buffer/batches.py.

Run: laminar node --role buffer --config configs/skeleton.yaml
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter

import msgspec

from laminar.buffer.batches import BatchServer
from laminar.buffer.experience import OPEN, OUTSTANDING, READY, ExperienceState
from laminar.buffer.health import StallWatch
from laminar.buffer.intake import Intake
from laminar.buffer.journal import Journal
from laminar.buffer.leases import Leases
from laminar.buffer.ledger import Ledger
from laminar.buffer.partials import PartialPool, recover
from laminar.buffer.prompt_server import PromptServer, check_capacity
from laminar.buffer.prompts import PromptPool, open_pool
from laminar.config import LaminarConfig
from laminar.modes import Admission
from laminar.node import Node, socket_max_message_bytes
from laminar.protocol.buffer import (
    BatchCommit,
    BatchReply,
    BatchRequest,
    BufferStats,
    BufferStatsRequest,
    CommitAck,
    JournalFigures,
    PartialsReply,
    PartialsRequest,
    PromptPoolFigures,
    PromptReply,
    PromptRequest,
    StalenessFigures,
    TrajectoryAbandoned,
    TrajectoryAck,
)
from laminar.protocol.core import NodeStatus
from laminar.protocol.data import PartialBatch, PartialChunk, Trajectory
from laminar.transport.session import ErrorReply
from laminar.transport.sockets import Peer


def experience_state(cfg: LaminarConfig, admission: Admission | None = None) -> ExperienceState:
    """The state a buffer of this config keeps (the node; offline replays of its journal)."""
    bc = cfg.buffer
    return ExperienceState(
        group_size=cfg.rollout.group_size,
        lost_member_policy=bc.lost_member_policy,
        admission=admission
        or Admission.for_mode(cfg.mode, cfg.trainer.batch_groups, bc.max_staleness),
        sampling=bc.sampling,
        seed=cfg.seed,
    )


class BufferNode(Node):
    role = "buffer"

    async def setup(self) -> None:
        cfg, bc = self.cfg, self.cfg.buffer
        self.admission = Admission.for_mode(cfg.mode, cfg.trainer.batch_groups, bc.max_staleness)
        self.state = experience_state(cfg, self.admission)
        self.partials = PartialPool()
        # before anything that awaits: status() reads it
        self.health = StallWatch(bc, cfg.reward.fn, self.state, self.metrics, self.log)
        self.journal: Journal | None = None  # set before anything can fail: teardown reads it
        check_capacity(bc.capacity, cfg.rollout.group_size, cfg.trainer, self.log)
        self.pool: PromptPool | None = await self.compute(
            open_pool, cfg.data, cfg.model.path, self.metrics, self.log
        )
        if bc.journal:
            path = cfg.resolved_run_dir() / f"buffer-{self.index}.journal"
            self.journal = Journal(path, bc.fsync, bc.fsync_interval_s)
        self.ledger = Ledger(self.state, self.journal, bc.compact_bytes, self.metrics, self.log)
        if self.journal is not None:
            await self.compute(self.ledger.replay)
            if self.state.cursor is not None and self.pool is not None:
                warn = self.pool.restore(self.state.cursor)
                if warn:
                    self.log.warning("prompt_cursor_mismatch", detail=warn)
            await self.ledger.compact_if_due()
        self.leases = Leases(bc.lease_s)
        self.leases.seed(self.state.groups)  # replayed open groups: a fresh lease from now
        self.prompts = PromptServer(
            bc,
            cfg.rollout.group_size,
            admission=self.admission,
            ledger=self.ledger,
            pool=self.pool,
            metrics=self.metrics,
            leases=self.leases,
            log=self.log,
        )
        self.intake = Intake(self.ledger, self.partials, self.metrics, self.log)
        self.batches = BatchServer(
            bc, self.admission, self.ledger, self.pool, self.metrics, self.log
        )
        self.srv = self.server(
            cfg.bind_endpoint("buffer"), max_message_bytes=socket_max_message_bytes(cfg, "buffer")
        )
        self.srv.on(PromptRequest, self._on_prompts)
        self.srv.on(PartialBatch, self._on_partial_batch)
        self.srv.on(PartialChunk, self._on_chunk)
        self.srv.on(Trajectory, self._on_trajectory)
        self.srv.on(TrajectoryAbandoned, self._on_abandoned)
        self.srv.on(BatchRequest, self._on_batch)
        self.srv.on(BatchCommit, self._on_commit)
        self.srv.on(PartialsRequest, self._on_partials)
        self.srv.on(BufferStatsRequest, self._on_stats)
        await self.srv.start()

    async def main(self) -> None:
        if self.journal is not None:
            self.spawn(self.journal.run_flusher(), "journal-flusher")
            self.spawn(self.ledger.run_compactor(), "journal-compactor")
        self.spawn(self._watch_stall(), "stall-watch")
        await self.stopping.wait()

    async def _watch_stall(self) -> None:
        """The stall warning also when arrivals stopped (e.g. the last prompts all dropped)."""
        every = self.cfg.buffer.stall_warn_after_s / 2
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), every)
            self.health.check()

    async def teardown(self) -> None:
        if self.journal is not None:
            self.journal.close()

    # ---- handlers: one part each --------------------------------------------------------
    async def _on_prompts(self, peer: Peer, req: PromptRequest) -> PromptReply:
        return await self.prompts.serve(req)

    def _on_partial_batch(self, peer: Peer, b: PartialBatch) -> None:
        self.leases.touch_many({u.rpartition("/")[0] for u in b.uids})  # progress on their groups
        for res, k in self.partials.apply_batch(b).items():
            if res in ("bad", "unknown", "gap"):
                self.metrics.count(f"chunks_{res}", k)

    def _on_chunk(self, peer: Peer, chunk: PartialChunk) -> None:
        self.leases.touch(chunk.uid.rpartition("/")[0])  # progress on its group
        res = self.partials.apply(chunk)
        if res in ("bad", "unknown", "gap"):
            self.metrics.count(f"chunks_{res}")

    async def _on_trajectory(self, peer: Peer, t: Trajectory) -> TrajectoryAck | ErrorReply:
        self.leases.touch(t.group_id)
        reply = await self.intake.trajectory(t, peer.node_id)
        if isinstance(reply, TrajectoryAck) and not (
            reply.duplicate or reply.ignored
        ):  # stored now
            self.health.observe(t)
        return reply

    async def _on_abandoned(
        self, peer: Peer, msg: TrajectoryAbandoned
    ) -> TrajectoryAck | ErrorReply:
        self.leases.touch(msg.group_id)
        return await self.intake.abandoned(msg)

    def _on_partials(self, peer: Peer, req: PartialsRequest) -> PartialsReply:
        return PartialsReply(
            partials=recover(self.partials, self.state.groups, req.rollout_id, req.uids)
        )

    async def _on_batch(self, peer: Peer, req: BatchRequest) -> BatchReply | ErrorReply:
        return await self.batches.serve(req)

    async def _on_commit(self, peer: Peer, c: BatchCommit) -> CommitAck | ErrorReply:
        return await self.batches.commit(c)

    # ---- stats --------------------------------------------------------------------------
    def _on_stats(self, peer: Peer, req: BufferStatsRequest) -> BufferStats:
        return self.stats()

    def stats(self) -> BufferStats:
        st, bc = self.state, self.cfg.buffer
        states = Counter(g.state for g in st.groups.values())
        prompts = journal = None
        if self.pool is not None:
            pool = self.pool
            prompts = PromptPoolFigures(
                rows=len(pool.rows),
                epoch=pool.epoch,
                pos=pool.pos,
                serial=pool.serial,
                bad_rows=len(pool.bad),
                exhausted=pool.exhausted,
            )
        if self.journal is not None:
            j = self.journal
            journal = JournalFigures(path=str(j.path), size=j.size, **j.stats)
        return BufferStats(
            mode=self.cfg.mode,
            bound=self.admission.bound,
            capacity=bc.capacity,
            trainer_version=st.trainer_version,
            next_version=st.next_version,
            held=st.held,
            pending=st.pending,
            groups_open=states[OPEN],
            groups_ready=states[READY],
            groups_outstanding=states[OUTSTANDING],
            outstanding_batches=len(st.outstanding()),
            closed_groups=len(st.closed),
            counts=dict(st.counts),
            counters=dict(self.metrics.counters),
            partials={"in_flight": len(self.partials), **self.partials.counts},
            rollout_versions=dict(self.prompts.rollout_versions),
            warnings=dict(self.health.warnings),
            staleness_finish=msgspec.convert(st.finish_hist.summary(), StalenessFigures),
            staleness_consumed=msgspec.convert(st.consumed_hist.summary(), StalenessFigures),
            prompts=prompts,
            journal=journal,
        )

    def status(self) -> NodeStatus:
        st = self.state  # built first thing in setup(), before any server can ask for status
        mean = st.consumed_hist.mean()
        return NodeStatus(
            node_id=self.node_id,
            role=self.role,
            version=st.trainer_version,
            inflight=st.pending,
            staleness=0.0 if math.isnan(mean) else mean,
            extra={
                "prompts_served": st.counts["groups_served"],
                "held": st.held,
                "groups_ready": sum(1 for g in st.groups.values() if g.state == "ready"),
                "outstanding_batches": len(st.outstanding()),
                "staleness_max": max(st.consumed_hist.counts, default=0),
            },
            warnings=list(self.health.warnings.values()),
        )
