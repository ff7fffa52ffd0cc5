"""Buffer node: prompt pool, partial-response pool, experience buffer and its durable journal.

    rollout ──PromptRequest(credits, version)──► PromptServer (retry table, expired leases, admission, capacity, pool) ──► PromptReply
    rollout ──PartialBatch (one-way)───────────► PartialPool ◄──PartialsRequest── manager (recover: records + unstarted samples)
    rollout ──Trajectory / TrajectoryAbandoned─► Intake ─► Ledger "traj" / "abandon" ─► Ack (after durable)
    trainer ──BatchRequest (long-poll)─────────► BatchServer: plan whole ready groups ─► Ledger "batch" ─► BatchReply
    trainer ──BatchCommit──────────────────────► BatchServer ─► Ledger "commit" ─► groups freed
    anyone  ──BufferStats──────────────────────► counters, staleness histograms

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
Rules: admission / batch planning laminar/buffer/admission.py, prompt
serving laminar/buffer/prompt_server.py, batches and commits laminar/buffer/batches.py.

Run: laminar node --role buffer --config configs/skeleton.yaml
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any

from laminar.buffer.admission import Admission
from laminar.buffer.batches import BatchServer
from laminar.buffer.experience import ExperienceState
from laminar.buffer.health import StallWatch
from laminar.buffer.intake import Intake
from laminar.buffer.journal import Journal
from laminar.buffer.leases import Leases
from laminar.buffer.ledger import Ledger
from laminar.buffer.partials import PartialPool, recover
from laminar.buffer.prompt_server import PromptServer, check_capacity
from laminar.buffer.prompts import PromptPool, open_pool
from laminar.node import Node
from laminar.protocol.buffer import (
    BatchCommit,
    BatchReply,
    BatchRequest,
    BufferStats,
    PartialsReply,
    PartialsRequest,
    PromptReply,
    PromptRequest,
    TrajectoryAbandoned,
)
from laminar.protocol.core import Ack, ErrorReply, NodeStatus
from laminar.protocol.data import PartialBatch, PartialChunk, Trajectory
from laminar.transport.sockets import Peer, socket_max_message_bytes


class BufferNode(Node):
    role = "buffer"

    async def setup(self) -> None:
        cfg, bc = self.cfg, self.cfg.buffer
        self.admission = Admission.from_config(cfg)
        self.state = ExperienceState.from_config(cfg, self.admission)
        self.partials = PartialPool()
        # before anything that awaits: status() reads it
        self.health = StallWatch(bc, cfg.reward.fn, self.state, self.metrics, self.log)
        self.journal: Journal | None = None  # set before anything can fail: teardown reads it
        check_capacity(cfg, self.log)
        self.pool: PromptPool | None = await self.compute(open_pool, cfg, self.metrics, self.log)
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
            self.admission,
            self.ledger,
            self.pool,
            self.metrics,
            self.leases,
            self.log,
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
        self.srv.on(BufferStats, self._on_stats)
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

    async def _on_trajectory(self, peer: Peer, t: Trajectory) -> Ack | ErrorReply:
        self.leases.touch(t.group_id)
        reply = await self.intake.trajectory(t, peer.node_id)
        if isinstance(reply, Ack) and not reply.info:  # stored now (not a duplicate or late)
            self.health.observe(t)
        return reply

    async def _on_abandoned(self, peer: Peer, msg: TrajectoryAbandoned) -> Ack | ErrorReply:
        self.leases.touch(msg.group_id)
        return await self.intake.abandoned(msg)

    def _on_partials(self, peer: Peer, req: PartialsRequest) -> PartialsReply:
        return PartialsReply(
            partials=recover(self.partials, self.state.groups, req.rollout_id, req.uids)
        )

    async def _on_batch(self, peer: Peer, req: BatchRequest) -> BatchReply | ErrorReply:
        return await self.batches.serve(req)

    async def _on_commit(self, peer: Peer, c: BatchCommit) -> Ack | ErrorReply:
        return await self.batches.commit(c)

    # ---- stats --------------------------------------------------------------------------
    def _on_stats(self, peer: Peer, req: BufferStats) -> BufferStats:
        return BufferStats(stats=self.stats())

    def stats(self) -> dict[str, Any]:
        st, bc = self.state, self.cfg.buffer
        out: dict[str, Any] = {
            "mode": self.cfg.mode,
            "bound": self.admission.bound,
            "capacity": bc.capacity,
            **st.summary(),
        }
        out["staleness_finish"] = st.finish_hist.summary()
        out["staleness_consumed"] = st.consumed_hist.summary()
        out["partials"] = {"in_flight": len(self.partials), **self.partials.counts}
        out["counters"] = dict(self.metrics.counters)
        out["rollout_versions"] = dict(self.prompts.rollout_versions)
        out["warnings"] = dict(self.health.warnings)
        if self.pool is not None:
            out["prompts"] = {
                "rows": len(self.pool.rows),
                "epoch": self.pool.epoch,
                "pos": self.pool.pos,
                "serial": self.pool.serial,
                "bad_rows": len(self.pool.bad),
                "exhausted": self.pool.exhausted,
            }
        if self.journal is not None:
            out["journal"] = {
                "path": str(self.journal.path),
                "size": self.journal.size,
                **self.journal.stats,
            }
        return out

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
                "warnings": list(self.health.warnings.values()),
            },
        )
