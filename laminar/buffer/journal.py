"""Append-only journal of msgpack records: the buffer's durable memory.

    j = Journal(run_dir / "buffer-0.journal", fsync="batch")
    for rec in j.replay(): state.apply(rec)             # at start
    off = j.append(TrajectoryAccepted(trajectory=t))    # write() to the OS
    await j.durable(off)                                 # per the fsync policy
    j.close()
    report = check_journal(path)      # offline, read-only (`laminar journal check RUN_DIR`)

On disk: a 12-byte header (`LAMJRNL-` + u32 SCHEMA_VERSION), then records
`[u32 length][u32 crc32][payload]` (little endian). The payload is a msgpack list of
the frames of one typed record (laminar/buffer/records.py) as the wire codec
(laminar.transport.codec) encodes it, so a journaled Trajectory is decoded and validated by
the very code that decodes it off the network, arrays included; a decoded message that is
not a record is refused. This module imports the records and laminar.protocol itself: a
process that replays a journal knows every type.

The schema version is the journal's own, independent of the wire's PROTOCOL_VERSION.
Schema 1 (before the header existed) is the 8-byte magic `LAMJRNL1` and schema-2 records.
Schema 2's payload was msgpack `[kind: str, body: dict, msg_frames...]`; upgrade 2 -> 3
turns each into its typed record (records.from_schema2).
An older schema is read through `_UPGRADES` (payload n -> payload n+1) and, once the
whole file replayed, rewritten atomically in the current schema; the old file is kept
as `<file>.schema<n>` (a hard link: no copy).

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
import collections
import concurrent.futures
import fcntl
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

import laminar.protocol  # noqa: F401  - registers every message type that a record may hold
from laminar.buffer.records import RECORD_TYPES, JournalRecord, from_schema2
from laminar.message import REGISTRY, Limits, ProtocolError
from laminar.transport.codec import decode, encode

__all__ = [
    "Journal",
    "JournalCorrupt",
    "JournalError",
    "JournalReport",
    "SCHEMA_VERSION",
    "check_journal",
    "decode_record",
    "encode_record",
    "read_records",
]

SCHEMA_VERSION = 3
"""The journal's record format; bump it (and add an _UPGRADES step) when records change."""
_SIGNATURE = b"LAMJRNL-"
_FILE_HEAD = struct.Struct("<8sI")
MAGIC = _FILE_HEAD.pack(_SIGNATURE, SCHEMA_VERSION)
"""The first bytes of a journal of the current schema."""
MAGIC_V1 = b"LAMJRNL1"
"""Schema 1: this magic, then records (no version field)."""
_HEAD = struct.Struct("<II")
MAX_RECORD_BYTES = 1 << 31


def _upgrade_2(payload: bytes) -> bytes:
    """A schema-2 payload, msgpack `[kind, body dict, msg_frames...]`, as its typed record."""
    try:
        parts = msgpack.unpackb(payload, raw=False)
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(f"journal record is not msgpack: {exc}") from None
    if (
        not isinstance(parts, list)
        or len(parts) < 2
        or not isinstance(parts[0], str)
        or not isinstance(parts[1], dict)
    ):
        raise ProtocolError("schema-2 journal record must be [kind, body, msgs...]")
    msgs = []
    for i, frames in enumerate(parts[2:]):
        if not isinstance(frames, list):
            raise ProtocolError(f"message {i} of the record is not a list of frames")
        try:
            msgs.append(decode(frames, _LIMITS))
        except ProtocolError as exc:
            raise ProtocolError(f"message {i} of the record: {exc}") from None
    try:
        rec = from_schema2(parts[0], parts[1], msgs)
    except (KeyError, TypeError, ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise ProtocolError(f"schema-2 record cannot be upgraded ({why})") from None
    return _payload(rec)


_UPGRADES: dict[int, Callable[[bytes], bytes]] = {
    1: lambda payload: payload,  # 1 -> 2: only the file header changed
    2: _upgrade_2,  # 2 -> 3: (kind, body dict, msgs) -> a typed record
}
"""schema n -> a function turning a schema-n record payload into a schema n+1 one (raises
ProtocolError when it cannot)."""

# replay is not the network: a record holds what this buffer accepted, whatever the
# sockets' limits are today (they may shrink); only the record size bounds it
_LIMITS = Limits(
    max_frames=1 << 20,
    max_header_bytes=MAX_RECORD_BYTES,
    max_message_bytes=MAX_RECORD_BYTES,
    max_list_len=1 << 31,
    max_str_len=1 << 31,
)


class JournalError(RuntimeError):
    """The journal file cannot be used (wrong magic, newer schema, in use)."""


class JournalCorrupt(JournalError):
    """A record that cannot be replayed; nothing on disk was changed."""

    def __init__(self, path: Path, offset: int, kind: str, reason: str):
        self.path, self.offset, self.kind, self.reason = path, offset, kind, reason
        super().__init__(
            f"{path}: record at byte offset {offset} (kind {kind}) cannot be replayed: {reason}. "
            "Nothing was truncated or moved. Check it with `laminar journal check <run_dir>`; "
            "if laminar was upgraded, run the version that wrote it, or move the file away to "
            "start afresh."
        )


def _payload(rec: JournalRecord) -> bytes:
    # the codec's frames are bytes or flat memoryviews of the arrays, both packed as bin in place
    # (no copy of a trajectory's arrays before the one into the payload)
    return msgpack.packb(encode(rec), use_bin_type=True)


def _record_parts(rec: JournalRecord) -> tuple[bytes, bytes]:
    """One record as its header and payload (written together, without joining them)."""
    payload = _payload(rec)
    return _HEAD.pack(len(payload), zlib.crc32(payload)), payload


def encode_record(rec: JournalRecord) -> bytes:
    """One record (header + payload) ready to append."""
    head, payload = _record_parts(rec)
    return head + payload


def decode_record(payload: bytes) -> JournalRecord:
    """Inverse of encode_record's payload; raises ProtocolError when it is not a record."""
    try:
        frames = msgpack.unpackb(payload, raw=False)
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(f"journal record is not msgpack: {exc}") from None
    if not isinstance(frames, list) or not frames:
        raise ProtocolError("journal record must be a list of codec frames")
    rec = decode(frames, _LIMITS)
    if not isinstance(rec, RECORD_TYPES):
        raise ProtocolError(f"{type(rec).__name__} is a message, not a journal record")
    return rec


def _kind_of(payload: bytes) -> str:
    """The record's type (schema 2: its kind) for an error message, as far as the payload tells."""
    try:
        parts = msgpack.unpackb(payload, raw=False)
    except Exception:
        return "unknown (not msgpack)"
    if isinstance(parts, list) and parts and isinstance(parts[0], str):
        return repr(parts[0])  # a schema-2 record that did not upgrade
    if isinstance(parts, list) and parts and isinstance(parts[0], bytes) and len(parts[0]) == 1:
        cls = REGISTRY.get(parts[0][0])
        return cls.__name__ if cls is not None else f"unknown type {parts[0][0]:#04x}"
    return "unknown (not a record)"


def _read_header(path: Path, data: bytes) -> tuple[int, int] | None:
    """(schema, offset of the first record), or None for a file torn while its header was
    written."""
    if data.startswith(MAGIC_V1):
        return 1, len(MAGIC_V1)
    if data.startswith(_SIGNATURE) and len(data) >= _FILE_HEAD.size:
        schema = _FILE_HEAD.unpack_from(data)[1]
        if schema > SCHEMA_VERSION:
            raise JournalError(
                f"{path} has journal schema {schema}, newer than this laminar's "
                f"{SCHEMA_VERSION}: run the laminar version that wrote it"
            )
        if schema != SCHEMA_VERSION and schema not in _UPGRADES:
            raise JournalError(f"{path}: journal schema {schema} is not one this laminar can read")
        return schema, _FILE_HEAD.size
    if len(data) < _FILE_HEAD.size and MAGIC.startswith(data):
        return None
    raise JournalError(
        f"{path} is not a laminar journal (bad magic); move it away or use another run_dir"
    )


def _upgrade(schema: int, payload: bytes) -> bytes:
    for s in range(schema, SCHEMA_VERSION):
        payload = _UPGRADES[s](payload)
    return payload


def _records(data: bytes, pos: int) -> Iterator[tuple[int, bytes]]:
    """(offset, payload) of each record whose checksum holds, from `pos` up to the first that does
    not."""
    view = memoryview(data)
    while pos + _HEAD.size <= len(data):
        length, crc = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + length
        if length == 0 or length > MAX_RECORD_BYTES or end > len(data):
            return  # never written (a record is at least a msgpack list): torn, or damaged
        payload = view[pos + _HEAD.size : end]
        if zlib.crc32(payload) != crc:
            return
        yield pos, bytes(payload)
        pos = end


def _next_valid(data: bytes, start: int) -> int | None:
    """Offset of the first record with a valid checksum at or after `start`, if any.

    A crash tears only the last record: a valid record after a bad one means damage in
    the middle of the file, which replay must not cut off with the tail.
    """
    n = len(data)
    head = _HEAD
    for pos in range(start, n - head.size + 1):
        length, crc = head.unpack_from(data, pos)
        if (
            0 < length <= n - pos - head.size
            and zlib.crc32(data[pos + 8 : pos + 8 + length]) == crc
        ):
            return pos
    return None


@dataclass
class JournalReport:
    """What `check_journal` found in one file (read-only)."""

    path: Path
    schema: int | None = None
    size: int = 0
    records: int = 0
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    """Record type name -> records."""
    bad: list[tuple[int, str, str]] = field(default_factory=list)
    """(offset, kind, reason) of each record with a valid checksum that does not decode."""
    torn_offset: int | None = None
    torn_bytes: int = 0
    error: str | None = None
    """A problem with the file as a whole (bad magic, newer schema, damage mid-file)."""

    @property
    def ok(self) -> bool:
        return not self.bad and not self.torn_bytes and self.error is None


def check_journal(path: str | os.PathLike[str]) -> JournalReport:
    """Verify every record of a journal without changing it (no lock: safe beside a live buffer)."""
    rep = JournalReport(Path(path))
    data = rep.path.read_bytes()
    rep.size = len(data)
    try:
        head = _read_header(rep.path, data)
    except JournalError as exc:
        rep.error = str(exc)
        return rep
    if head is None:
        rep.schema, rep.torn_offset, rep.torn_bytes = SCHEMA_VERSION, 0, len(data)
        return rep
    rep.schema, stop = head
    for off, payload in _records(data, stop):
        stop = off + _HEAD.size + len(payload)
        try:
            rec = decode_record(_upgrade(rep.schema, payload))
        except ProtocolError as exc:
            rep.bad.append((off, _kind_of(payload), str(exc)))
            continue
        rep.records += 1
        rep.kinds[type(rec).__name__] += 1
    if stop < len(data):
        later = _next_valid(data, stop + 1)
        if later is None:
            rep.torn_offset, rep.torn_bytes = stop, len(data) - stop
        else:
            rep.error = (
                f"bad record at byte offset {stop} with a valid record at {later} after it: "
                "damage in the middle of the file (replay refuses it)"
            )
    return rep


def read_records(path: str | os.PathLike[str]) -> Iterator[JournalRecord]:
    """Every decodable record of a journal, read-only (no lock, nothing cut or moved: safe beside
    a live buffer, whose record being appended ends the read). Raises JournalError for a file
    that is not a journal; a record that does not decode is skipped."""
    p = Path(path)
    data = p.read_bytes()  # one read of one inode: a compaction's rename does not tear it
    head = _read_header(p, data)
    if head is None:
        return
    schema, pos = head
    for _off, payload in _records(data, pos):
        try:
            yield decode_record(_upgrade(schema, payload))
        except ProtocolError:
            continue


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
            head = _read_header(self.path, data)
        except JournalError:
            self._unlock()
            raise
        if head is None:  # torn while writing the header of a new file
            self._open_new()
            return
        schema, good = head
        upgraded: list[bytes] = []
        for off, payload in _records(data, good):
            good = off + _HEAD.size + len(payload)  # the record as it is on disk
            try:
                if schema != SCHEMA_VERSION:
                    current = _upgrade(schema, payload)
                    upgraded.append(current)
                else:
                    current = payload
                rec = decode_record(current)
            except ProtocolError as exc:
                self.stats["bad_records"] += 1
                self._unlock()
                raise JournalCorrupt(self.path, off, _kind_of(payload), str(exc)) from None
            self.stats["replayed"] += 1
            yield off, rec
        if good < len(data):
            later = _next_valid(data, good + 1)
            if later is not None:
                self.stats["bad_records"] += 1
                self._unlock()
                raise JournalCorrupt(
                    self.path,
                    good,
                    _kind_of(data[good + _HEAD.size :][: 1 << 16]),
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
        records = [_HEAD.pack(len(p), zlib.crc32(p)) + p for p in payloads]
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
        head, payload = _record_parts(record)
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
        head, payload = _record_parts(record)
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
