"""The rollout node's manager-facing half: partial-pool streaming and Export/Import/Refresh.

    rollout seqs ──_mark_dirty──► [partials loop] ──PartialChunk (one-way)──► buffer partial pool
    manager ──ExportRequest──► abort in the engine, hand back PartialTrajectory (every token so far)
    manager ──ImportRequest──► resume partials of this exact version (else version_mismatch), idempotent
    manager ──RefreshRequest──► load min_version (soft: waited for rollout.refresh_wait_s)

A mixin of RolloutNode (laminar/rollout/node.py), which owns the state these methods use:
engine, seqs, groups, _recent, _dirty/_dirty_evt, _flush_lock, _load_lock, buffer, source,
version, params, metrics, log. Kept apart so each file stays readable; not used on its own.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from laminar.engines.base import GenRequest, PartialState
from laminar.protocol.core import ErrorReply
from laminar.protocol.data import PartialTrajectory
from laminar.protocol.rollout import (
    VERSION_MISMATCH,
    ExportReply,
    ExportRequest,
    ImportReply,
    ImportRequest,
    RefreshReply,
    RefreshRequest,
)
from laminar.rollout.tracking import GroupState, SeqState


class RolloutCommands:
    """Partial streaming and the manager's repack/recovery commands (see the module docstring)."""

    # ---- partial pool streaming ----------------------------------------------------------
    def _mark_dirty(self, uid: str) -> None:
        self._dirty.add(uid)
        self._dirty_evt.set()

    def _on_buffer_connect(self) -> None:
        """A (re)connected buffer may have lost the partial records: restream each from offset 0."""
        for seq in self.seqs.values():
            seq.sent_upto = 0
            self._dirty.add(seq.uid)
        self._dirty_evt.set()

    async def _partials_loop(self) -> None:
        while True:
            await self._dirty_evt.wait()
            self._dirty_evt.clear()
            await self._flush_partials()

    async def _flush_partials(self) -> None:
        async with self._flush_lock:  # one sender at a time, or a chunk could go out twice
            await self._flush_dirty()

    async def _flush_dirty(self) -> None:
        for uid in list(self._dirty):
            seq = self.seqs.get(uid)
            self._dirty.discard(uid)
            if seq is None or seq.length == seq.sent_upto and seq.sent_upto > 0:
                continue
            if not self.buffer.connected:
                self._dirty.add(uid)  # kept: resent from 0 on reconnect anyway
                continue
            msg, upto = seq.chunk(self.node_id)
            try:
                await asyncio.wait_for(self.buffer.send(msg), 1.0)
            except Exception as exc:  # best-effort stream: the final Trajectory is the acked copy
                self.metrics.count("partial_send_failed")
                self.log.debug("partial_send_failed", uid=uid, error=f"{type(exc).__name__}: {exc}")
                self._dirty.add(uid)
                return
            seq.sent_upto = max(seq.sent_upto, upto)
            self.metrics.count("partial_chunks")

    # ---- manager commands ------------------------------------------------------------------
    async def _on_export(self, peer: Any, msg: ExportRequest) -> ExportReply:
        assert self.engine is not None
        uids = list(msg.uids) or list(self.seqs)
        here = [u for u in uids if u in self.seqs and not self.seqs[u].exporting]
        for u in here:
            self.seqs[u].exporting = True
        states: list[PartialState] = await self.engine.abort(here) if here else []
        by_id = {p.seq_id: p for p in states}
        partials: list[PartialTrajectory] = []
        for u in here:
            seq = self.seqs.get(u)
            p = by_id.get(u)
            if seq is None:  # finished (final event handled) while the abort was on its way
                continue
            if p is None:
                # finished inside the engine before the abort: its queued final event completes it here
                seq.exporting = False
                continue
            partials.append(seq.partial(p.output_ids, p.logprobs, self.node_id))
            self._forget(u, finished=False)
        exported = {p.uid for p in partials}
        if partials and not self.seqs:
            self._exported_empty = True
            self.metrics.count("emptied_by_export")
        self.metrics.count("exported", len(partials))
        self.log.info("exported", count=len(partials), missing=len(uids) - len(exported))
        return ExportReply(
            partials=partials, missing=[u for u in uids if u not in exported], version=self.version
        )

    async def _on_import(self, peer: Any, msg: ImportRequest) -> ImportReply | ErrorReply:
        assert self.engine is not None
        async with self._load_lock:  # the version cannot change under an import
            wrong = [p.uid for p in msg.partials if p.version != self.version]
            if wrong:
                self.metrics.count("import_rejected", len(msg.partials))
                return ErrorReply(code=VERSION_MISMATCH, message=f"{self.node_id} is at version {self.version}; "
                                  f"{len(wrong)} partial(s) are not (e.g. {wrong[0]})")  # fmt: skip
            bad = [
                p.uid
                for p in msg.partials
                if len(p.prompt_ids) == 0 or len(p.response_ids) != len(p.logprobs)
            ]
            if bad:
                self.metrics.count("import_bad", len(bad))
                return ErrorReply(
                    code="bad_partial",
                    message=f"empty prompt or ids/logprobs length mismatch: {bad[:3]}",
                )
            accepted, duplicate = [], []
            now = time.time()
            for p in msg.partials:
                if p.uid in self.seqs or p.uid in self._recent:
                    duplicate.append(p.uid)
                    continue
                self._note_busy()
                seq = SeqState.from_partial(p, now)
                self.seqs[seq.uid] = seq
                self.groups.setdefault(seq.group_id, GroupState(seq.group_id)).open.add(seq.uid)
                state = PartialState(
                    seq.uid, seq.prompt_ids, seq.ids.copy(), seq.logprobs.copy(), seq.version
                )
                self.engine.submit(GenRequest.resume(state, self.params))
                # header + every token so far: the partial pool now knows it runs here
                self._mark_dirty(seq.uid)
                accepted.append(seq.uid)
        self.metrics.count("imported", len(accepted))
        self.log.info("imported", count=len(accepted), duplicate=len(duplicate))
        return ImportReply(accepted=accepted, duplicate=duplicate, version=self.version)

    async def _on_refresh(self, peer: Any, msg: RefreshRequest) -> RefreshReply:
        # soft: wait a while for min_version to reach the source (the relay chain may still be
        # delivering it), then load the newest there is rather than idle forever
        assert self.source is not None
        self.source.announce(msg.min_version)
        self._soft_min = max(self._soft_min, msg.min_version)
        self._soft_until = time.monotonic() + self.cfg.rollout.refresh_wait_s
        self.refresh_requested = True
        self._wake.set()
        return RefreshReply(version=self.version, pending=self._target_version() > self.version)
