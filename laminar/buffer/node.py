"""Buffer node: prompt pool, partial-response pool, experience buffer and its durable journal.

    rollout ──PromptRequest(credits, version)──► admission (mode, staleness, capacity) ──► PromptReply
    rollout ──PartialChunk (one-way)───────────► partial pool ◄──PartialsRequest── manager (recovery)
    rollout ──Trajectory / TrajectoryAbandoned─► journal append ─► groups ─► Ack (after durable)
    trainer ──BatchRequest (long-poll)─────────► whole ready groups ─► journal "batch" ─► BatchReply
    trainer ──BatchCommit──────────────────────► journal "commit" ─► groups freed, never served again
    anyone  ──BufferStats──────────────────────► counters, staleness histograms

Every change of the experience state is a journal record applied by
laminar.buffer.experience.ExperienceState, live and at replay alike, so a buffer
restarted on the same run_dir (even after kill -9) comes back with every
acknowledged trajectory, every outstanding batch and every commit. Nothing is
acked before its record is written (and fsync'ed when buffer.fsync=always).
Admission and batch planning rules: laminar/buffer/admission.py.

Batches. A BatchRequest long-polls (up to min(wait_s, buffer.max_wait_s)) and gets
exactly `groups` whole groups, or none when they are not there in time (info.wait
says why: not_enough | staleness | whole_batch). The one exception is the end of
the data: once the prompt epochs are done and nothing is generating, the last
groups come as a shorter batch, and an empty reply says info.exhausted=True.
info also carries the batch version and its staleness (min/max/mean/hist).
A served batch stays outstanding until BatchCommit; restart=True puts every
outstanding batch back at the front. Unblocks a long-poll: a group becoming ready,
a commit, a requeue, a drop.

Prompts. Served only while admission (mode, staleness bound, laminar/buffer/
admission.py) and capacity (held + generating + n <= buffer.capacity) allow;
otherwise reason full | staleness | need_version (+ min_version) | epochs_done | empty
| global_update (modes with global updates: no work at a new version while older groups
are still generating, so the update reaches every rollout at once) with retry_after_s. A retry with the same (rollout_id, request_id) gets the same groups.

Run: laminar node --role buffer --config configs/skeleton.yaml
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import Any

import numpy as np

from laminar.buffer.admission import Admission, admit
from laminar.buffer.experience import COMMITTED, OPEN, ExperienceState
from laminar.buffer.journal import Journal
from laminar.buffer.partials import PartialPool
from laminar.buffer.prompts import PromptEncoder, PromptPool, load_prompts
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
)  # fmt: skip
from laminar.protocol.core import Ack, ErrorReply, NodeStatus
from laminar.protocol.data import PartialChunk, PartialTrajectory, Trajectory
from laminar.transport.sockets import Peer

_EMPTY_I = np.zeros(0, np.int32)
_EMPTY_F = np.zeros(0, np.float32)


class BufferNode(Node):
    role = "buffer"

    async def setup(self) -> None:
        cfg, bc = self.cfg, self.cfg.buffer
        self.admission = Admission.from_config(cfg)
        self.state = ExperienceState(group_size=cfg.rollout.group_size, lost_member_policy=bc.lost_member_policy,
                                     admission=self.admission, sampling=bc.sampling, seed=cfg.seed)  # fmt: skip
        self.partials = PartialPool()
        self.pool: PromptPool | None = None
        self.rollout_versions: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._batch_lock = asyncio.Lock()
        self._compact_at = bc.compact_bytes
        self._check_config()
        if cfg.data.train:
            await self._load_prompts()
        self.journal: Journal | None = None
        if bc.journal:
            path = cfg.resolved_run_dir() / f"buffer-{self.index}.journal"
            self.journal = Journal(path, bc.fsync, bc.fsync_interval_s)
            t0 = time.monotonic()
            n = await self.compute(self._replay)
            self.log.info("journal_replayed", path=str(path), records=n, bytes=self.journal.size,
                          torn_bytes=self.journal.stats["torn_bytes"], seconds=round(time.monotonic() - t0, 3),
                          **{k: v for k, v in self.state.summary().items() if k in ("held", "groups_ready", "outstanding_batches")})  # fmt: skip
            if self.journal.stats["torn_bytes"]:
                self.log.warning("journal_torn_tail", bytes=self.journal.stats["torn_bytes"])
            if self.state.cursor is not None and self.pool is not None:
                warn = self.pool.restore(self.state.cursor)
                if warn:
                    self.log.warning("prompt_cursor_mismatch", detail=warn)
            if self.journal.size > self._compact_at:
                await self._compact()
        self.srv = self.server(cfg.bind_endpoint("buffer"))
        self.srv.on(PromptRequest, self._on_prompts)
        self.srv.on(PartialChunk, self._on_chunk)
        self.srv.on(Trajectory, self._on_trajectory)
        self.srv.on(TrajectoryAbandoned, self._on_abandoned)
        self.srv.on(BatchRequest, self._on_batch)
        self.srv.on(BatchCommit, self._on_commit)
        self.srv.on(PartialsRequest, self._on_partials)
        self.srv.on(BufferStats, self._on_stats)
        await self.srv.start()

    def _check_config(self) -> None:
        cfg = self.cfg
        n, cap, b = cfg.rollout.group_size, cfg.buffer.capacity, cfg.trainer.batch_groups
        if cap < n * b:
            self.log.warning("capacity_below_batch", capacity=cap, needed=n * b,
                             hint="buffer.capacity < rollout.group_size * trainer.batch_groups: no batch can ever fill")  # fmt: skip
        if getattr(cfg.trainer, "commit", "step") == "checkpoint":
            need = (cfg.trainer.checkpoint_every + 1) * b * n
            if cap < need:
                self.log.warning("capacity_below_uncommitted", capacity=cap, needed=need,
                                 hint="trainer.commit=checkpoint keeps checkpoint_every batches uncommitted in the buffer")  # fmt: skip

    async def _load_prompts(self) -> None:
        cfg = self.cfg
        rows, report = await self.compute(load_prompts, cfg.data.train)
        for err in report.errors:
            self.log.warning("bad_row", error=err)
        tok = None
        if cfg.model.path:
            from laminar.models.tiny import load_tokenizer

            tok = await self.compute(load_tokenizer, cfg.model.path)
        else:
            self.log.info(
                "byte_prompt_ids", reason="model.path not set: prompt ids are UTF-8 bytes"
            )
        encoder = PromptEncoder(tok, cfg.data.chat_template, cfg.data.max_prompt_tokens)
        self.pool = PromptPool(rows, encoder, shuffle=cfg.data.shuffle, seed=cfg.data.seed, epochs=cfg.data.epochs,
                               on_bad=self._bad_row)  # fmt: skip
        self.metrics.count("bad_rows", report.bad)
        self.log.info("prompts_loaded", files=report.files, rows=report.rows, bad=report.bad,
                      duplicate_uids=report.duplicate_uids, chat_template=encoder.use_template)  # fmt: skip

    def _bad_row(self, where: str, why: str) -> None:
        self.metrics.count("bad_rows")
        self.log.warning("bad_row", error=f"{where}: {why}")

    def _replay(self) -> int:
        assert self.journal is not None
        n = 0
        for kind, body, msgs in self.journal.replay():
            self.state.apply(kind, body, msgs)
            n += 1
        return n

    async def main(self) -> None:
        if self.journal is not None:
            self.spawn(self.journal.run_flusher(), "journal-flusher")
        await self.stopping.wait()

    async def teardown(self) -> None:
        if self.journal is not None:
            self.journal.close()

    # ---- journal plumbing -------------------------------------------------------------
    def _record(self, kind: str, body: dict[str, Any], msgs: list[Any] = ()) -> int:
        """Append a record (when journaling) and apply it; returns the offset to make durable."""
        off = self.journal.append(kind, body, msgs) if self.journal is not None else 0
        self.state.apply(kind, body, msgs)
        return off

    async def _durable(self, offset: int | None = None) -> None:
        if self.journal is not None:
            await self.journal.durable(self.journal.written if offset is None else offset)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _compact(self) -> None:
        assert self.journal is not None
        await self.journal.quiesce()  # no fsync in flight on the file being replaced
        before = self.journal.size
        t0 = time.monotonic()
        self.journal.rewrite(self.state.snapshot_records())
        after = self.journal.size
        self._compact_at = max(self.cfg.buffer.compact_bytes, 2 * after)
        self.metrics.count("compactions")
        self.log.info(
            "journal_compacted", before=before, after=after, seconds=round(time.monotonic() - t0, 3)
        )

    # ---- rollouts -----------------------------------------------------------------------
    async def _on_prompts(self, peer: Peer, req: PromptRequest) -> PromptReply:
        st, bc = self.state, self.cfg.buffer
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
                await self._durable()
                return PromptReply(items=items)
        wait = bc.retry_after_s
        if self.pool is None:
            return PromptReply(retry_after_s=wait, reason="empty")
        if self.admission.policy.global_update and any(
            g.state == OPEN and g.version < req.version for g in st.groups.values()
        ):
            # sync / one_step / stream: a new version reaches every rollout at once, once all of
            # them drained (NCCL-style): no work at it while older groups are still generating
            self.metrics.count("prompts_refused_global_update")
            return PromptReply(retry_after_s=wait, reason="global_update")
        n = self.cfg.rollout.group_size
        room = (bc.capacity - st.held - st.pending) // n
        dec = admit(self.admission, rollout_version=req.version, requested=max(0, req.max_groups),
                    trainer_version=st.trainer_version, next_version=st.next_version,
                    unconsumed=st.unconsumed_by_version() if self.admission.bound is not None else {})  # fmt: skip
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
        body = {"rollout_id": req.rollout_id, "version": req.version, "request_id": req.request_id,
                "cursor": self.pool.cursor(),
                "groups": [{"group_id": it.group_id, "uid": it.uid, "n": n, "version": req.version, "item": i}
                           for i, it in enumerate(items)]}  # fmt: skip
        try:
            off = self._record("served", body, items)
        except Exception:
            self.pool.restore(cursor)  # not journaled: serve these rows again later
            raise
        self.metrics.count("prompts_served", len(items))
        await self._durable(off)
        return PromptReply(items=items, min_version=dec.min_version)

    def _on_chunk(self, peer: Peer, chunk: PartialChunk) -> None:
        res = self.partials.apply(chunk)
        if res in ("bad", "unknown", "gap"):
            self.metrics.count(f"chunks_{res}")

    async def _on_trajectory(self, peer: Peer, t: Trajectory) -> Ack | ErrorReply:
        verdict, why = self.state.check_trajectory(t)
        if verdict == "bad":
            self.metrics.count("trajectories_rejected")
            self.log.warning("bad_trajectory", uid=t.uid, error=why, peer=peer.node_id)
            return ErrorReply(code="protocol", message=why)
        self.partials.remove(t.uid)
        if verdict != "ok":
            self.metrics.count(f"trajectories_{verdict}")
            await self._durable()  # the first copy may still be on its way to the disk
            return Ack(info={"duplicate": verdict == "duplicate", "ignored": why})
        t.staleness_at_finish = self.state.trainer_version - t.version
        off = self._record("traj", {}, [t])
        self._notify()
        await self._durable(off)
        return Ack()

    async def _on_abandoned(self, peer: Peer, msg: TrajectoryAbandoned) -> Ack | ErrorReply:
        verdict, why, idx = self.state.check_abandoned(msg.uid, msg.group_id)
        if verdict == "bad":
            self.metrics.count("abandons_rejected")
            return ErrorReply(code="protocol", message=why)
        self.partials.remove(msg.uid)
        if verdict != "ok":
            self.metrics.count("abandons_ignored")
            return Ack(info={"ignored": why})
        off = self._record("abandon", {"group_id": msg.group_id, "sample_index": idx, "uid": msg.uid,
                                       "reason": msg.reason})  # fmt: skip
        self.log.info("trajectory_abandoned", uid=msg.uid, reason=msg.reason)
        self._notify()
        await self._durable(off)
        return Ack()

    def _on_partials(self, peer: Peer, req: PartialsRequest) -> PartialsReply:
        out = self.partials.query(req.rollout_id, req.uids)
        have = {p.uid for p in out} | set(self.partials.records)
        # samples handed out but never started hold no tokens yet: resuming them is starting them
        if req.uids:
            wanted = [
                (u.rpartition("/")[0], u.rpartition("/")[2]) for u in req.uids if u not in have
            ]
            targets = [
                (g, int(i))
                for gid, i in wanted
                if i.isdigit() and (g := self.state.groups.get(gid))
            ]
        else:
            targets = [(g, i) for g in self.state.groups.values() if g.rollout_id == req.rollout_id
                       for i in range(g.n)]  # fmt: skip
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
        return PartialsReply(partials=out)

    # ---- trainer ------------------------------------------------------------------------
    async def _on_batch(self, peer: Peer, req: BatchRequest) -> BatchReply | ErrorReply:
        if req.groups <= 0:
            return ErrorReply(
                code="protocol", message=f"BatchRequest.groups must be >= 1, got {req.groups}"
            )
        st = self.state
        async with self._batch_lock:
            if req.restart:
                requeued = [b.batch_id for b in st.outstanding()]
                off = self._record(
                    "requeue",
                    {"trainer_version": req.trainer_version, "trainer_id": req.trainer_id},
                )
                self.log.info(
                    "trainer_restart",
                    trainer=req.trainer_id,
                    version=req.trainer_version,
                    requeued=requeued,
                )
                self._notify()
                await self._durable(off)
            else:
                st.trainer_version = max(st.trainer_version, req.trainer_version)
            deadline = time.monotonic() + min(max(0.0, req.wait_s), self.cfg.buffer.max_wait_s)
            while True:
                changed = self._changed
                version = max(req.trainer_version, st.next_version)
                final = self.pool is not None and self.pool.exhausted
                plan = st.plan(req.groups, version, final)
                if plan.expired:
                    self._record("drop", {"group_ids": plan.expired, "reason": "expired"})
                    self.log.warning("groups_expired", groups=len(plan.expired), batch_version=version,
                                     bound=self.admission.bound)  # fmt: skip
                if plan.take:
                    return await self._serve_batch(req, version, plan.take)
                left = deadline - time.monotonic()
                if left <= 0:
                    exhausted = final and not st.groups
                    return BatchReply(info={"wait": plan.wait, "version": version, "exhausted": exhausted,
                                            "ready": len(st.in_state("ready")), "open": st.open_groups()})  # fmt: skip
                try:
                    await asyncio.wait_for(changed.wait(), left)
                except TimeoutError:
                    pass

    async def _serve_batch(
        self, req: BatchRequest, version: int, group_ids: list[str]
    ) -> BatchReply:
        st = self.state
        requeued = sum(1 for gid in group_ids if st.groups[gid].front)
        partial = sum(1 for gid in group_ids if st.groups[gid].lost)
        batch_id = f"b-{uuid.uuid4().hex[:16]}"
        off = self._record("batch", {"batch_id": batch_id, "version": version, "group_ids": group_ids,
                                     "trainer_id": req.trainer_id})  # fmt: skip
        trajs = st.batch_trajectories(st.batches[batch_id])
        stale = [version - t.version for t in trajs]
        hist: dict[str, int] = {}
        for s in stale:
            hist[str(s)] = hist.get(str(s), 0) + 1
        info = {"version": version, "groups": len(group_ids), "trajectories": len(trajs), "group_ids": group_ids,
                "requeued_groups": requeued, "partial_groups": partial,
                "staleness": {"min": min(stale), "max": max(stale), "mean": sum(stale) / len(stale), "hist": hist}}  # fmt: skip
        self.metrics.count("batches_served")
        await self._durable(off)
        return BatchReply(batch_id=batch_id, trajectories=trajs, info=info)

    async def _on_commit(self, peer: Peer, c: BatchCommit) -> Ack | ErrorReply:
        b = self.state.batches.get(c.batch_id)
        if b is None:
            self.metrics.count("commits_unknown")
            return ErrorReply(
                code="unknown_batch", message=f"no batch {c.batch_id!r} was served by this buffer"
            )
        if b.state == COMMITTED:
            self.metrics.count("commits_duplicate")
            await self._durable()
            return Ack(info={"duplicate": True})
        if b.state != "outstanding":
            self.metrics.count("commits_requeued")
            return Ack(
                ok=False, info={"reason": f"batch {c.batch_id} was put back by a trainer restart"}
            )
        off = self._record("commit", {"batch_id": c.batch_id, "step": c.step, "version": c.version})
        self._notify()
        await self._durable(off)
        if self.journal is not None and self.journal.size > self._compact_at:
            await self._compact()
        return Ack(info={"version": self.state.trainer_version})

    # ---- stats --------------------------------------------------------------------------
    def _on_stats(self, peer: Peer, req: BufferStats) -> BufferStats:
        return BufferStats(stats=self.stats())

    def stats(self) -> dict[str, Any]:
        st, bc = self.state, self.cfg.buffer
        out: dict[str, Any] = {"mode": self.cfg.mode, "bound": self.admission.bound, "capacity": bc.capacity,
                               **st.summary()}  # fmt: skip
        out["staleness_finish"] = st.finish_hist.summary()
        out["staleness_consumed"] = st.consumed_hist.summary()
        out["partials"] = {"in_flight": len(self.partials), **self.partials.counts}
        out["counters"] = dict(self.metrics.counters)
        out["rollout_versions"] = dict(self.rollout_versions)
        if self.pool is not None:
            out["prompts"] = {"rows": len(self.pool.rows), "epoch": self.pool.epoch, "pos": self.pool.pos,
                              "serial": self.pool.serial, "bad_rows": len(self.pool.bad),
                              "exhausted": self.pool.exhausted}  # fmt: skip
        if self.journal is not None:
            out["journal"] = {
                "path": str(self.journal.path),
                "size": self.journal.size,
                **self.journal.stats,
            }
        return out

    def status(self) -> NodeStatus:
        st = getattr(self, "state", None)
        if st is None:
            return NodeStatus(node_id=self.node_id, role=self.role)
        mean = st.consumed_hist.mean()
        return NodeStatus(
            node_id=self.node_id, role=self.role, version=st.trainer_version, inflight=st.pending,
            staleness=0.0 if math.isnan(mean) else mean,
            extra={"prompts_served": st.counts["groups_served"], "held": st.held,
                   "groups_ready": sum(1 for g in st.groups.values() if g.state == "ready"),
                   "outstanding_batches": len(st.outstanding()),
                   "staleness_max": max(st.consumed_hist.counts, default=0)},
        )  # fmt: skip
