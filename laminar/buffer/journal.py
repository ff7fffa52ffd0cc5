"""Append-only journal of msgpack records: the buffer's durable memory.

    j = Journal(run_dir / "buffer-0.journal", fsync="batch")
    for rec in j.replay(): state.apply(rec)             # at start
    off = j.append(TrajectoryAccepted(trajectory=t))    # write() to the OS
    await j.durable(off)                                 # per the fsync policy
    j.close()

The file's format, its schema upgrades and the offline readers (check_journal, read_records)
are laminar/buffer/journal_format.py.

Damage, and what replay does (it never loses a record whose checksum is valid):
  * a torn tail - the last record short or with a bad checksum, and no valid record
    after it - is what a crash mid-write leaves: it is copied to `<file>.corrupt-<ms>`,
    the file is cut there (stats torn_bytes / torn_path; the ledger logs an error);
  * a record with a valid checksum that does not decode (unknown message type, failed
    validation, not a record), or a bad checksum with valid records after it, raises
    JournalCorrupt naming the file, the byte offset and the record type, and changes
    nothing on disk: a code or schema mismatch must be fixed, not papered over (a schema-2
    record that does not upgrade is refused alike).

Durability (BufferConfig.fsync), decided per record before the node acks it:
  * every record is written to the OS with os.write before anything is acked, so
    a killed buffer *process* (kill -9) loses nothing that was acknowledged;
  * always: also fsync'ed before the ack (group commit: concurrent appends share
    one fsync run on the journal's own thread) - survives a power loss;
  * batch: fsync'ed every `fsync_interval_s` by a background task - a power loss
    may drop the last interval;
  * never: the OS decides when the data reaches the disk.

One writer: `<file>.lock` is flock'ed while the journal is open, so a second
buffer on the same run_dir fails at start instead of interleaving records.

Compaction: `await compact(snapshot)` replaces the file with a snapshot of the state (records)
plus the records appended while it was written; the snapshot is encoded and written on
a thread of its own, so the event loop keeps serving (a live buffer's state can be GBs).
`rewrite(records)` is the blocking form (replay, schema upgrade). Either writes a temp
file, fsyncs it, renames it over the journal and fsyncs the directory. `written` and
`synced` count bytes across compactions: a durable() offset stays valid through one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from laminar.buffer.journal_format import (
    MAGIC,
    RECORD_HEAD,
    SCHEMA_VERSION,
    JournalCorrupt,
    JournalError,
    decode_record,
    kind_of,
    next_valid,
    read_header,
    record_head,
    record_parts,
    scan_records,
    upgrade_payload,
)
from laminar.buffer.records import JournalRecord
from laminar.message import ProtocolError

__all__ = ["Journal"]


class Journal:
    def __init__(
        self, path: str | os.PathLike, fsync: str = "batch", fsync_interval_s: float = 0.05
    ):
        if fsync not in ("always", "batch", "never"):
            raise ValueError(f"fsync policy must be always|batch|never, got {fsync!r}")
        self.path = Path(path)
        self.policy = fsync
        self.fsync_interval_s = fsync_interval_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = -1
        self._lock_fd = -1
        self._pos = 0
        """The file's size: where the next record goes."""
        self.written = 0
        """Bytes handed to the OS so far, counted across compactions (durable() offsets are
        these)."""
        self.synced = 0
        """Of `written`, the bytes known to be on disk (fsync'ed)."""
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="journal")
        self._compactor: concurrent.futures.ThreadPoolExecutor | None = None
        """The thread that encodes and writes a snapshot (not `_io`: fsyncs must not queue behind
        it)."""
        self._tail: list[bytes] | None = None
        """While a compaction runs: the records appended since its snapshot was taken."""
        self._sync: asyncio.Future[None] | None = None
        """The fsync in flight (an executor future, not a task: its awaiters see its error)."""
        self.stats = {
            "records": 0,
            "bytes": 0,
            "fsyncs": 0,
            "torn_bytes": 0,
            "replayed": 0,
            "bad_records": 0,
            "torn_offset": -1,
            "upgraded_from_schema": 0,
        }
        self.torn_path: Path | None = None
        """Where replay moved a torn tail."""
        self.upgraded_from: tuple[int, Path] | None = None
        """(schema, kept old file) when replay upgraded an older journal."""

    # ---- open + replay ---------------------------------------------------------------
    def _lock(self) -> None:
        # one writer per journal: a second buffer on the same run_dir would interleave records
        lock_path = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JournalError(
                f"{self.path} is in use by another buffer (lock {lock_path})"
            ) from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def replay(self) -> Iterator[JournalRecord]:
        """Yield every record, then leave the file open for appends after the last one."""
        for _, rec in self.replay_at():
            yield rec

    def replay_at(self) -> Iterator[tuple[int, JournalRecord]]:
        """replay(), each record with its byte offset (for errors that name it)."""
        if self._lock_fd < 0:
            self._lock()
        if not self.path.exists() or self.path.stat().st_size == 0:
            self._open_new()
            return
        data = self.path.read_bytes()
        try:
            head = read_header(self.path, data)
        except JournalError:
            self._unlock()
            raise
        if head is None:  # torn while writing the header of a new file
            self._open_new()
            return
        schema, good = head
        upgraded: list[bytes] = []
        for off, payload in scan_records(data, good):
            good = off + RECORD_HEAD.size + len(payload)  # the record as it is on disk
            try:
                if schema != SCHEMA_VERSION:
                    current = upgrade_payload(schema, payload)
                    upgraded.append(current)
                else:
                    current = payload
                rec = decode_record(current)
            except ProtocolError as exc:
                self.stats["bad_records"] += 1
                self._unlock()
                raise JournalCorrupt(self.path, off, kind_of(payload), str(exc)) from None
            self.stats["replayed"] += 1
            yield off, rec
        if good < len(data):
            later = next_valid(data, good + 1)
            if later is not None:
                self.stats["bad_records"] += 1
                self._unlock()
                raise JournalCorrupt(
                    self.path,
                    good,
                    kind_of(data[good + RECORD_HEAD.size :][: 1 << 16]),
                    f"bad checksum or length, and a valid record follows at byte "
                    f"offset {later}: damage in the middle of the file",
                )
            self._quarantine(data[good:], good)
        if schema != SCHEMA_VERSION:
            self._upgrade_file(schema, upgraded)
        else:
            self._open_existing(good)

    def _quarantine(self, tail: bytes, offset: int) -> None:
        """Keep the torn tail beside the journal (durably), then cut the journal before it."""
        stamp, n = int(time.time() * 1000), 0
        while True:  # a unique name: two tails cut within one millisecond must not collide
            suffix = f".corrupt-{stamp}" + (f"-{n}" if n else "")
            aside = self.path.with_name(self.path.name + suffix)
            try:
                fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileExistsError:
                n += 1
        try:
            _write_all(fd, tail)
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(self.path.parent)
        with open(self.path, "r+b") as f:
            f.truncate(offset)
            f.flush()
            os.fsync(f.fileno())
        self.stats["torn_bytes"] = len(tail)
        self.stats["torn_offset"] = offset
        self.torn_path = aside

    def _upgrade_file(self, schema: int, payloads: list[bytes]) -> None:
        """Rewrite an older-schema journal in the current one; the old file stays as
        <file>.schema<n>."""
        records = [record_head(p) + p for p in payloads]
        old = self.path.with_name(f"{self.path.name}.schema{schema}")
        if old.exists():
            old = old.with_name(f"{old.name}-{int(time.time() * 1000)}")
        os.link(self.path, old)  # the same inode: the old bytes stay, no copy
        self.rewrite(records)
        self.upgraded_from = (schema, old)
        self.stats["upgraded_from_schema"] = schema

    def _open_new(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _write_all(fd, MAGIC)
        os.fsync(fd)
        _fsync_dir(self.path.parent)
        self._fd = fd
        self._pos = len(MAGIC)
        self.written = self.synced = self._pos

    def _open_existing(self, size: int) -> None:
        fd = os.open(self.path, os.O_WRONLY)
        os.lseek(fd, size, os.SEEK_SET)
        self._fd = fd
        self._pos = size
        self.written = self.synced = max(self.written, size)

    @property
    def size(self) -> int:
        """The file's size in bytes."""
        return self._pos

    @property
    def compacting(self) -> bool:
        return self._tail is not None

    # ---- append + durability ---------------------------------------------------------
    def append(self, record: JournalRecord) -> int:
        """Write one record to the OS; returns the offset that `durable()` must reach."""
        if self._fd < 0:
            raise JournalError("journal is not open (call replay() first)")
        head, payload = record_parts(record)
        size = len(head) + len(payload)
        try:
            _write_parts(self._fd, head, payload)
        except OSError:
            # a half-written record would hide every later one at replay: cut it off
            os.ftruncate(self._fd, self._pos)
            os.lseek(self._fd, self._pos, os.SEEK_SET)
            raise
        if self._tail is not None:
            self._tail.append(head + payload)
        self._pos += size
        self.written += size
        self.stats["records"] += 1
        self.stats["bytes"] += size
        return self.written

    def waits(self, offset: int) -> bool:
        """Whether durable(offset) would wait (an fsync before the ack)."""
        return self.policy == "always" and self.synced < offset

    async def durable(self, offset: int) -> None:
        """Return once the record ending at `offset` is as durable as the policy promises."""
        if self.policy != "always":
            return  # already in the OS page cache: survives a process crash
        while self.synced < offset:
            await asyncio.shield(self._start_sync())

    def _start_sync(self) -> asyncio.Future[None]:
        """The fsync in flight, or a new one covering everything written so far (group commit)."""
        if self._sync is None or self._sync.done():
            target = self.written
            fut = asyncio.get_running_loop().run_in_executor(self._io, os.fsync, self._fd)
            # registered before any awaiter's: `synced` moves before they look at it again
            fut.add_done_callback(lambda f: self._synced(f, target))
            self._sync = fut
        return self._sync

    def _synced(self, fut: asyncio.Future[None], target: int) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.stats["fsyncs"] += 1
            self.synced = max(self.synced, target)

    async def quiesce(self) -> None:
        """Wait for the fsync in flight (before the file is swapped by `rewrite`)."""
        if self._sync is not None and not self._sync.done():
            await asyncio.shield(self._sync)

    async def run_flusher(self) -> None:
        """fsync=batch: flush every fsync_interval_s while there is unsynced data (runs until
        cancelled)."""
        if self.policy != "batch":
            return
        while True:
            await asyncio.sleep(self.fsync_interval_s)  # a timer
            if self.written > self.synced and self._fd >= 0:
                await asyncio.shield(self._start_sync())

    def sync_now(self) -> None:
        if self._fd >= 0 and self.written > self.synced:
            os.fsync(self._fd)
            self.stats["fsyncs"] += 1
            self.synced = self.written

    # ---- compaction ------------------------------------------------------------------
    async def compact(self, snapshot: Sequence[JournalRecord]) -> None:
        """Replace the journal with `snapshot` plus every record appended while it is written.

        The snapshot (the state when it was taken, as records that nobody mutates) is
        encoded, written and fsync'ed on a thread of its own while appends go on to the live
        file and are kept aside; those are then written after it, and the new file replaces
        the old one (rename, directory fsync). A crash at any point leaves the
        old file whole. The event loop never encodes or writes the snapshot itself.
        """
        if self._fd < 0:
            raise JournalError("journal is not open (call replay() first)")
        if self._tail is not None:
            raise JournalError("a compaction is already running")
        if self._compactor is None:
            self._compactor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="journal-compact"
            )
        tmp = self.path.with_name(self.path.name + ".compact")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        stop = threading.Event()
        work: concurrent.futures.Future[int] | None = None
        self._tail = []
        try:
            work = self._compactor.submit(_write_snapshot, fd, snapshot, stop)
            size = await asyncio.wrap_future(work)
            # catch up with the appends kept aside, on the thread while they are many
            while sum(map(len, self._tail)) > _TAIL_ON_LOOP_BYTES:
                recs, self._tail = self._tail, []
                work = self._compactor.submit(_write_records, fd, recs, True)
                size += await asyncio.wrap_future(work)
            await self.quiesce()  # no fsync in flight on the file being replaced
            size += _write_records(fd, self._tail, True)  # the last few, here: no append in between
            os.replace(tmp, self.path)
            _fsync_dir(self.path.parent)
        except BaseException:
            # cancelled (the node stops) or failed: the thread must be done with fd before it closes
            stop.set()
            if work is not None:
                concurrent.futures.wait([work])
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        finally:
            self._tail = None
        os.close(self._fd)
        self._fd, self._pos = fd, size
        self.synced = self.written  # everything written is in the new file, fsync'ed

    def rewrite(self, records: list[bytes]) -> None:
        """Atomically replace the journal with these encoded records (blocking: replay, upgrade)."""
        tmp = self.path.with_name(self.path.name + ".compact")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, MAGIC)
            size = len(MAGIC) + _write_records(fd, records, True)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        if self._fd >= 0:
            os.close(self._fd)
        self._open_existing(size)

    def close(self) -> None:
        self._io.shutdown(wait=True)  # an fsync still running must not see its fd closed
        if self._compactor is not None:
            self._compactor.shutdown(wait=True)
        if self._fd >= 0:
            try:
                self.sync_now()
            finally:
                os.close(self._fd)
                self._fd = -1
        if self._lock_fd >= 0:
            os.close(
                self._lock_fd
            )  # releases the flock (the kernel also does when the process dies)
            self._lock_fd = -1


_TAIL_ON_LOOP_BYTES = 1 << 20
"""A compaction writes at most this much of the records appended meanwhile on the event loop."""


def _write_snapshot(
    fd: int,
    snapshot: Sequence[JournalRecord],
    stop: threading.Event,
) -> int:
    """Header + every record of the snapshot, encoded here, then fsync; returns the bytes
    written."""
    _write_all(fd, MAGIC)
    size = len(MAGIC)
    for record in snapshot:
        if stop.is_set():
            raise JournalError("compaction stopped")
        head, payload = record_parts(record)
        _write_parts(fd, head, payload)
        size += len(head) + len(payload)
    os.fsync(fd)
    return size


def _write_records(fd: int, records: list[bytes], sync: bool) -> int:
    size = 0
    for rec in records:
        _write_all(fd, rec)
        size += len(rec)
    if sync:
        os.fsync(fd)
    return size


def _write_parts(fd: int, head: bytes, payload: bytes) -> None:
    """head + payload, one system call unless the OS takes less (then the rest as _write_all)."""
    n = os.writev(fd, (head, payload))
    if n < len(head):
        _write_all(fd, head[n:])
        n = len(head)
    if n - len(head) < len(payload):
        _write_all(fd, memoryview(payload)[n - len(head) :])


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _fsync_dir(path: Path) -> None:
    try:
        dfd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
