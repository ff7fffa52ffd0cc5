"""Buffer node: prompt pool, partial-response pool, experience buffer and its durable journal.

    rollout ──PromptRequest(credits, version)──► PromptServer ──► PromptReply
    rollout ──PartialBatch (one-way)───────────► PartialPool ◄──PartialsRequest── manager
    rollout ──Trajectory / TrajectoryAbandoned─► Intake ─► Ledger ─► TrajectoryAck
    rollout ──Deliveries (several of those)────► Intake ─► Ledger ─► DeliveryAcks (one ack each)
    trainer ──BatchRequest (long-poll)─────────► BatchServer ─► Ledger ─► BatchReply
    trainer ──BatchCommit──────────────────────► BatchServer ─► Ledger ─► groups freed
    manager ──SamplesPlaced(dest, uids)────────► Ledger (SamplesMoved): those come from dest now
    manager ──HeldRequest(rollout_ids)─────────► PartialPool: whose records each rollout holds
    anyone  ──BufferStatsRequest───────────────► BufferStats: counters, staleness histograms
    rollout, trainer ──ImageFetch(digests)──────► ImageStore: its prompts' images by digest

Only what was served comes back (laminar/buffer/owners.py): a trajectory, an abandon or a
partial entry is taken only from the rollout its group was served to (or the manager placed
the sample on), judged by the authenticated peer, never a body field; rewards, token ids and
lengths must lie in the configured ranges. What is refused is acked as refused, counted per
peer and reason (BufferStats.refused) and never stored. Prompts go only to the rollouts the
manager's heartbeats list as serving (laminar/buffer/members.py), each holding at most what its
engine can start and its share of open groups (BufferNodeSettings.groups_per_rollout).

    PromptServer: retry table, expired leases, admission, capacity, pool. PartialsRequest: the
    manager's recovery (records + unstarted samples); HeldRequest its reconciliation (which
    records each rollout holds, by the same owner). TrajectoryAck: once the record is durable.
    BatchServer: plans whole ready groups. Ledger: each change a typed journal record
    (laminar/buffer/records.py: TrajectoryAccepted, MemberAbandoned, BatchServed, ...).

This module only wires the parts (laminar/buffer/*) from its BufferNodeSettings
(laminar/buffer/settings.py, built by laminar/wiring/buffer.py): each handler hands the decoded
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
from collections.abc import Awaitable

import msgspec

from laminar.buffer.batches import BatchServer
from laminar.buffer.experience import OPEN, OUTSTANDING, READY
from laminar.buffer.health import FateWatch, StallWatch
from laminar.buffer.holders import HeldPages, recover
from laminar.buffer.intake import Intake
from laminar.buffer.journal import Journal
from laminar.buffer.leases import Leases
from laminar.buffer.ledger import Ledger
from laminar.buffer.members import Members
from laminar.buffer.owners import Owners, Refusals
from laminar.buffer.partials import REFUSED, PartialPool
from laminar.buffer.prompt_server import PromptServer, check_capacity
from laminar.buffer.prompts import PromptPool, open_pool
from laminar.buffer.records import SamplesMoved
from laminar.buffer.settings import BufferNodeSettings
from laminar.node import Node
from laminar.protocol.buffer import (
    DELIVERIES_MAX_ITEMS,
    BatchCommit,
    BatchReply,
    BatchRequest,
    BufferStats,
    BufferStatsRequest,
    CommitAck,
    Deliveries,
    DeliveryAcks,
    HeldReply,
    HeldRequest,
    ImageBlobs,
    ImageFetch,
    ImagePut,
    ImagePutReply,
    JournalFigures,
    PartialsReply,
    PartialsRequest,
    PromptPoolFigures,
    PromptReply,
    PromptRequest,
    SamplesPlaced,
    StalenessFigures,
    TrajectoryAbandoned,
    TrajectoryAck,
)
from laminar.protocol.core import NodeStatus
from laminar.protocol.data import PartialBatch, PartialChunk, Trajectory
from laminar.transport.session import NO_STATUS, Ack, ErrorReply
from laminar.transport.sockets import Context, Peer
from laminar.vision.images import BadImage, check_image, image_limits
from laminar.vision.store import ImageStore


class BufferNode(Node):
    role = "buffer"

    def __init__(self, settings: BufferNodeSettings, ctx: Context | None = None):
        super().__init__(settings.node, ctx)
        self.settings = settings

    async def setup(self) -> None:
        s, bc = self.settings, self.settings.buffer
        self.admission = s.state.admission
        self.state = s.state.new_state()
        # before anything that awaits: status() reads them
        self.refusals = Refusals(self.metrics, self.log)
        self.health = StallWatch(bc, s.reward_fn, self.state, self.metrics, self.log)
        self.fates = FateWatch(bc, s.audit, self.state)
        self.journal: Journal | None = None  # set before anything can fail: teardown reads it
        self.limits = s.limits
        if self.limits.vocab is None and s.model_path:
            self.log.warning(
                "vocab_unknown",
                model=s.model_path,
                detail="no vocab_size in the model's config.json: token ids are not checked",
            )
        self.owners = Owners(self.state, agent_prompts=s.agent_prompts)
        self.partials = PartialPool(
            self.owners,
            vocab=self.limits.vocab,
            max_response_tokens=self.limits.max_response_tokens,
            max_prompt_tokens=self.limits.max_prompt_tokens,
            # a rollout holds at most the samples the buffer has generating
            max_entries=s.inflight_per_rollout,
            moe=self.limits.moe,
        )
        self.held_pages = HeldPages()
        """The manager's reconciliation round, answered in pages (HeldRequest)."""
        check_capacity(bc.capacity, s.group_size, s.trainer, self.log)
        self.pool: PromptPool | None = await self.compute(
            open_pool, s.data, s.model_path, self.metrics, self.log
        )
        # the owner of its prompts' images: receivers fetch them by digest (docs/vision.md)
        # and of the images later turns added (ImagePut), kept on disk in the run directory
        self.images = ImageStore.of_rows(
            self.pool.rows if self.pool is not None else (), s.run_dir / "images"
        )
        self.image_limits = image_limits(s.data)
        if bc.journal:
            path = s.run_dir / f"buffer-{self.index}.journal"
            self.journal = Journal(path, bc.fsync, bc.fsync_interval_s)
        self.ledger = Ledger(self.state, self.journal, bc.compact_bytes, self.metrics, self.log)
        if self.journal is not None:
            await self.compute(self.ledger.replay)
            if self.state.cursor is not None and self.pool is not None:
                warn = self.pool.restore(self.state.cursor)
                if warn:
                    self.log.warning("prompt_cursor_mismatch", detail=warn)
            await self.ledger.compact_if_due()
        self.leases = Leases(bc.lease_s, unstarted_s=bc.unstarted_lease())
        self.leases.seed(self.state.groups)  # replayed open groups: a fresh lease from now
        self.prompts = PromptServer(
            bc,
            s.group_size,
            admission=self.admission,
            ledger=self.ledger,
            pool=self.pool,
            metrics=self.metrics,
            leases=self.leases,
            log=self.log,
            per_rollout=s.groups_per_rollout,
            members=Members(
                share=s.groups_per_rollout,
                in_hand=s.groups_in_hand,
                group_size=s.group_size,
                source=lambda: self.manager.server_status if self.manager else NO_STATUS,
            ),
        )
        self.intake = Intake(
            self.ledger,
            self.partials,
            self.metrics,
            self.log,
            owners=self.owners,
            limits=self.limits,
            refusals=self.refusals,
        )
        self.batches = BatchServer(
            bc, self.admission, self.ledger, self.pool, self.metrics, self.log
        )
        # its clients read the manager's status, never the buffer's: its beats carry none, and a
        # client that got an ack or a batch within the interval gets no beat
        self.srv = self.server(s.endpoint, max_message_bytes=s.max_message_bytes, beat_status=False)
        self.srv.on(PromptRequest, self._on_prompts)
        self.srv.on(PartialBatch, self._on_partial_batch)
        self.srv.on(PartialChunk, self._on_chunk)
        self.srv.on(Trajectory, self._on_trajectory)
        self.srv.on(TrajectoryAbandoned, self._on_abandoned)
        self.srv.on(Deliveries, self._on_deliveries)
        self.srv.on(BatchRequest, self._on_batch)
        self.srv.on(BatchCommit, self._on_commit)
        self.srv.on(PartialsRequest, self._on_partials)
        self.srv.on(HeldRequest, self._on_held)
        self.srv.on(SamplesPlaced, self._on_placed)
        self.srv.on(BufferStatsRequest, self._on_stats)
        self.srv.on(ImageFetch, self._on_images)
        self.srv.on(ImagePut, self._on_image_put)
        await self.srv.start()

    async def main(self) -> None:
        if self.journal is not None:
            self.spawn(self.journal.run_flusher(), "journal-flusher")
            self.spawn(self.ledger.run_compactor(), "journal-compactor")
        self.spawn(self._watch_stall(), "stall-watch")
        await self.stopping.wait()

    async def _watch_stall(self) -> None:
        """The stall warning also when arrivals stopped (e.g. the last prompts all dropped)."""
        every = self.settings.buffer.stall_warn_after_s / 2
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
        results = self.partials.apply_batch(b, peer.node_id)
        for res, k in results.items():
            if res in REFUSED:
                self.refusals.count(peer.node_id, res, k, what="partial_batch")
            elif res in ("bad", "unknown", "gap", "late"):
                self.metrics.count(f"chunks_{res}", k)
        # progress on their groups: only the entries folded into records this peer holds
        self.leases.touch_many(self.partials.progressed)

    def _on_chunk(self, peer: Peer, chunk: PartialChunk) -> None:
        res = self.partials.apply(chunk, peer.node_id)
        if res in REFUSED:
            self.refusals.count(peer.node_id, res, what="partial_chunk")
            return
        self.leases.touch(chunk.uid.rpartition("/")[0])  # progress on its group
        if res in ("bad", "unknown", "gap", "late"):
            self.metrics.count(f"chunks_{res}")

    def _on_placed(self, peer: Peer, msg: SamplesPlaced) -> Ack:
        # written to the OS before the ack (a kill -9 of the buffer keeps it); not awaited
        # durable: a move waits for no fsync. Bounded: only unfinished samples of open groups
        # are kept, at most what the buffer has generating
        uids = msg.uids[: self.settings.inflight_per_rollout]
        self.ledger.record(SamplesMoved(msg.dest, uids))
        self.metrics.count("samples_placed", len(uids))
        return Ack()

    # a trajectory or an abandon is answered at once unless its record must be fsync'ed first
    # (buffer.fsync=always): then the wait gets a task of its own (transport/server.py)
    def _on_trajectory(
        self, peer: Peer, t: Trajectory
    ) -> TrajectoryAck | ErrorReply | Awaitable[TrajectoryAck | ErrorReply]:
        reply, off = self.intake.take_trajectory(t, peer.node_id)
        if off is not None and self.ledger.waits(off):
            return self._trajectory_durable(t, reply, off)
        return self._trajectory_taken(t, reply)

    async def _trajectory_durable(
        self, t: Trajectory, reply: TrajectoryAck | ErrorReply, off: int
    ) -> TrajectoryAck | ErrorReply:
        await self.ledger.durable(off)
        return self._trajectory_taken(t, reply)

    def _trajectory_taken(
        self, t: Trajectory, reply: TrajectoryAck | ErrorReply
    ) -> TrajectoryAck | ErrorReply:
        if isinstance(reply, TrajectoryAck) and reply.refused:
            return reply  # no progress on the group: a refused copy renews no lease
        self.leases.touch(t.group_id)
        if isinstance(reply, TrajectoryAck) and not (reply.duplicate or reply.ignored):
            self.health.observe(t)  # stored now
        return reply

    def _on_abandoned(
        self, peer: Peer, msg: TrajectoryAbandoned
    ) -> TrajectoryAck | ErrorReply | Awaitable[TrajectoryAck | ErrorReply]:
        reply, off = self._take_abandoned(peer, msg)
        if off is not None and self.ledger.waits(off):
            return self._when_durable(reply, off)
        return reply

    def _take_abandoned(
        self, peer: Peer, msg: TrajectoryAbandoned
    ) -> tuple[TrajectoryAck | ErrorReply, int | None]:
        reply, off = self.intake.take_abandoned(msg, peer.node_id)
        if not (isinstance(reply, TrajectoryAck) and reply.refused):
            self.leases.touch(msg.group_id)  # progress on its group, unless refused
        return reply, off

    def _on_deliveries(
        self, peer: Peer, d: Deliveries
    ) -> DeliveryAcks | ErrorReply | Awaitable[DeliveryAcks]:
        """Each item as if it had come alone (the server checked each one's sender rules), one
        reply for all once the last record that must be durable is."""
        if len(d.trajectories) + len(d.abandoned) > DELIVERIES_MAX_ITEMS:
            self.metrics.count("deliveries_rejected")
            return ErrorReply(
                code="protocol", message=f"more than {DELIVERIES_MAX_ITEMS} items in one message"
            )
        taken = [self.intake.take_trajectory(t, peer.node_id) for t in d.trajectories]
        taken += [self._take_abandoned(peer, a) for a in d.abandoned]
        replies = [reply for reply, _ in taken]
        waits = [off for _, off in taken if off is not None and self.ledger.waits(off)]
        if waits:
            return self._deliveries_durable(d, replies, max(waits))
        return self._deliveries_taken(d, replies)

    async def _deliveries_durable(
        self, d: Deliveries, replies: list[TrajectoryAck | ErrorReply], off: int
    ) -> DeliveryAcks:
        await self.ledger.durable(off)
        return self._deliveries_taken(d, replies)

    def _deliveries_taken(
        self, d: Deliveries, replies: list[TrajectoryAck | ErrorReply]
    ) -> DeliveryAcks:
        for t, reply in zip(d.trajectories, replies[: len(d.trajectories)], strict=True):
            self._trajectory_taken(t, reply)
        return DeliveryAcks(
            acks=[
                r if isinstance(r, TrajectoryAck) else TrajectoryAck(rejected=r.message or r.code)
                for r in replies
            ]
        )

    async def _when_durable(
        self, reply: TrajectoryAck | ErrorReply, off: int
    ) -> TrajectoryAck | ErrorReply:
        await self.ledger.durable(off)
        return reply

    def _on_images(self, peer: Peer, req: ImageFetch) -> ImageBlobs:
        found, data, missing = self.images.serve(req.digests)
        self.metrics.count("image_bytes_served", sum(len(d) for d in data))
        if missing:
            self.metrics.count("images_missing", len(missing))
            self.log.warning("images_missing", peer=peer.node_id, count=len(missing))
        return ImageBlobs(digests=found, data=data, missing=missing)

    async def _on_image_put(self, peer: Peer, req: ImagePut) -> ImagePutReply | ErrorReply:
        """Images a rollout's episode added in a later turn: each checked (digest, size, decode)
        and kept on disk before the reply, so a trajectory that names one can always be served."""
        if len(req.digests) != len(req.data):
            self.metrics.count("bad_images_put")
            return ErrorReply(
                code="bad_request", message=f"{len(req.data)} images for {len(req.digests)} digests"
            )
        stored, refused, reason = [], [], ""
        for d, data in zip(req.digests, req.data, strict=True):
            if self.images.holds(d):
                stored.append(d)
                continue
            try:
                await self.compute(self._keep_image, d, data)
            except (BadImage, ValueError, OSError) as exc:
                refused.append(d)
                reason = reason or str(exc)
                continue
            stored.append(d)
            self.metrics.count("images_put")
            self.metrics.count("image_bytes_put", len(data))
        if refused:
            self.metrics.count("bad_images_put", len(refused))
            self.log.warning("bad_images_put", peer=peer.node_id, count=len(refused), error=reason)
        return ImagePutReply(stored=stored, refused=refused, reason=reason)

    def _keep_image(self, digest: str, data: bytes) -> None:
        check_image(data, digest, self.image_limits)  # decodes: off the event loop
        self.images.put(digest, data)

    def _on_partials(self, peer: Peer, req: PartialsRequest) -> PartialsReply:
        return PartialsReply(
            partials=recover(
                self.partials, self.state.groups, req.rollout_id, req.uids, self.state.placed
            )
        )

    def _on_held(self, peer: Peer, req: HeldRequest) -> HeldReply:
        held, more = self.held_pages.page(
            self.partials, self.state.placed, req.rollout_ids, req.round, req.max_uids
        )
        return HeldReply(held=held, more=more)

    async def _on_batch(self, peer: Peer, req: BatchRequest) -> BatchReply | ErrorReply:
        reply = await self.batches.serve(req)
        if isinstance(reply, BatchReply) and reply.trajectories:
            if self.fates.due():  # per served batch at most, never per trajectory
                self.refresh_audit()
            reply.audit = self.fates.summary
        return reply

    def refresh_audit(self) -> None:
        """Remake the per-length audit and judge its warning (laminar/buffer/audit.py)."""
        self.fates.refresh()
        self.health.hold(FateWatch.KIND, self.fates.warning)

    async def _on_commit(self, peer: Peer, c: BatchCommit) -> CommitAck | ErrorReply:
        return await self.batches.commit(c)

    # ---- stats --------------------------------------------------------------------------
    def _on_stats(self, peer: Peer, req: BufferStatsRequest) -> BufferStats:
        return self.stats()

    def stats(self) -> BufferStats:
        st, bc = self.state, self.settings.buffer
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
            mode=self.settings.mode,
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
            refused=self.refusals.figures(),
            audit=self.fates.summary,
            unusable_causes=dict(self.health.totals.most_common()),
        )

    def refused_trajectories(self) -> dict[str, int]:
        return {peer: sum(c.values()) for peer, c in self.refusals.by_peer.items()}

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
                "groups_ready": len(st.in_state(READY)),  # the state's index: no scan per beat
                "outstanding_batches": len(st.outstanding()),
                "staleness_max": max(st.consumed_hist.counts, default=0),
            },
            warnings=list(self.health.warnings.values()),
        )
