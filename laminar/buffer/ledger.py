"""The buffer's durable state: every change is a journal record, appended, then applied.

    ledger = Ledger(state, journal, compact_bytes, metrics, log)   # journal None: memory only
    n = ledger.replay()                        # at start (blocking: run it off the event loop)
    off = ledger.record(TrajectoryAccepted(t))  # write() to the OS, then ExperienceState.apply
    await ledger.durable(off)                  # per buffer.fsync; only then is anything acked
    if not ledger.waits(off): ...              # ... or at once, when the policy has no wait
    changed = ledger.changed; await changed.wait()   # a batch long-poll waking on plan changes
    await ledger.compact_if_due()          # at start: snapshot rewrite if the file outgrew its mark
    await ledger.run_compactor()           # a node task: the same, off the loop, as records arrive

The one writer of ExperienceState (laminar/buffer/experience.py): the prompt server,
the intake and the batch server all change it through `record`, so the live state and
a replay of the file are the same sequence of `apply` calls. A record that fails to
append is not applied (the caller undoes whatever it had taken, e.g. the pool cursor).
"""

from __future__ import annotations

import asyncio
import time

import structlog

from laminar.buffer.experience import ExperienceState
from laminar.buffer.journal import Journal
from laminar.buffer.journal_format import SCHEMA_VERSION, JournalCorrupt
from laminar.buffer.records import BatchCommitted, BatchesRequeued, JournalRecord
from laminar.metrics import Metrics

__all__ = ["Ledger"]

_WAKES = (BatchCommitted, BatchesRequeued)
"""Record types that may make a waiting batch servable (or change its version) whatever they
change; any other record wakes it only when it changed what a batch plan reads
(ExperienceState.plan_changes: a group settled or was dropped, an open group's version moved).
A member that leaves its group open wakes nobody: with groups of n samples, a waiting trainer
plans once per group instead of n times."""


class Ledger:
    def __init__(
        self,
        state: ExperienceState,
        journal: Journal | None,
        compact_bytes: int,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ):
        self.state = state
        self.journal = journal
        self.compact_bytes = compact_bytes
        self._compact_at = compact_bytes
        self.metrics = metrics
        self.log = log
        self.changed = asyncio.Event()
        """Set (and replaced by a fresh one) when an applied record may have made a batch
        servable (see _WAKES)."""
        self._due = asyncio.Event()
        """Set when the journal outgrew its compaction mark (run_compactor waits on it)."""

    def replay(self) -> int:
        """Apply every record of the journal (blocking I/O); returns how many.

        Raises JournalCorrupt (file, offset, kind) for a record that does not decode or that
        the state refuses; the journal is left exactly as it was.
        """
        if self.journal is None:
            return 0
        t0 = time.monotonic()
        n = 0
        for off, rec in self.journal.replay_at():
            try:
                self.state.apply(rec)
            except (
                Exception
            ) as exc:  # a record this code cannot apply: stop, name it, keep the file
                self.journal.close()
                raise JournalCorrupt(
                    self.journal.path,
                    off,
                    type(rec).__name__,
                    f"the buffer state refused it ({type(exc).__name__}: {exc})",
                ) from exc
            n += 1
        j = self.journal
        summary = self.state.summary()
        self.log.info(
            "journal_replayed",
            path=str(j.path),
            records=n,
            bytes=j.size,
            torn_bytes=j.stats["torn_bytes"],
            seconds=round(time.monotonic() - t0, 3),
            **{k: summary[k] for k in ("held", "groups_ready", "outstanding_batches")},
        )
        if j.torn_path is not None:
            self.log.error(
                "journal_torn_tail",
                path=str(j.path),
                bytes=j.stats["torn_bytes"],
                offset=j.stats["torn_offset"],
                moved_to=str(j.torn_path),
                detail="a record cut short by a crash (or a bad checksum at the end) was cut "
                "from the journal and kept aside",
            )
        if j.upgraded_from is not None:
            self.log.warning(
                "journal_upgraded",
                path=str(j.path),
                from_schema=j.upgraded_from[0],
                to_schema=SCHEMA_VERSION,
                old_file=str(j.upgraded_from[1]),
            )
        return n

    def record(self, rec: JournalRecord) -> int:
        """Append a record (when journaling) and apply it; returns the offset to make durable."""
        if self.journal is None:
            off = 0
        else:
            off = self.journal.append(rec)
            if self._outgrown() and not self.journal.compacting:
                self._due.set()
        before = self.state.plan_changes
        self.state.apply(rec)
        if self.state.plan_changes != before or isinstance(rec, _WAKES):
            self.changed.set()
            self.changed = asyncio.Event()
        return off

    @property
    def written(self) -> int:
        """The offset of everything written so far (what a durable() without one waits for)."""
        return 0 if self.journal is None else self.journal.written

    def waits(self, offset: int) -> bool:
        """Whether `durable(offset)` would wait (fsync=always and not yet fsync'ed): else an ack
        may go at once, without a task to await it."""
        return self.journal is not None and self.journal.waits(offset)

    async def durable(self, offset: int | None = None) -> None:
        """Return once the record ending at `offset` (default: everything written) is durable."""
        if self.journal is not None:
            await self.journal.durable(self.journal.written if offset is None else offset)

    async def compact_if_due(self) -> None:
        """Compact now if the file outgrew its mark (at start, before serving)."""
        if self._outgrown():
            await self.compact()

    async def run_compactor(self) -> None:
        """Compacts whenever a record took the file past its mark (runs until cancelled).

        The snapshot is written on the journal's own thread while records go on being
        appended and acked: a commit never waits for a compaction.
        """
        while True:
            await self._due.wait()
            self._due.clear()
            if self._outgrown():
                await self.compact()

    def _outgrown(self) -> bool:
        return self.journal is not None and self.journal.size > self._compact_at

    async def compact(self) -> None:
        assert self.journal is not None
        before = self.journal.size
        t0 = time.monotonic()
        snapshot = self.state.snapshot()  # on the loop: references only, encoded on the thread
        taken_s = time.monotonic() - t0
        # no await between the snapshot and compact() starting to keep appends aside (it does so
        # before its first await): every record after the snapshot lands in the new file too
        await self.journal.compact(snapshot)
        after = self.journal.size
        # a snapshot already near the mark would be rewritten at every commit
        self._compact_at = max(self.compact_bytes, 2 * after)
        self.metrics.count("compactions")
        self.log.info(
            "journal_compacted",
            before=before,
            after=after,
            records=len(snapshot),
            snapshot_s=round(taken_s, 4),
            seconds=round(time.monotonic() - t0, 3),
        )
