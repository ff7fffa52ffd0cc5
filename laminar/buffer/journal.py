"""Append-only journal of msgpack records: the buffer's durable memory.

    j = Journal(run_dir / "buffer-0.journal", fsync="batch")
    for kind, body, msgs in j.replay(): state.apply(kind, body, msgs)   # at start
    off = j.append("traj", {}, [trajectory])                             # write() to the OS
    await j.durable(off)                                                  # per the fsync policy
    j.close()

On disk: an 8-byte file magic, then records `[u32 length][u32 crc32][payload]`
(little endian). The payload is msgpack `[kind, body, msg_frames...]` where each
message is stored as the frames of the wire codec (laminar.transport.codec), so a
journaled Trajectory is decoded and validated by the very code that decodes it
off the network, arrays included.

A crash can leave a torn last record (short, or with a bad checksum). Replay stops
at the first bad record, copies whatever follows it to `<file>.corrupt-<time>`
for inspection, truncates the file there, and appends after the last good record.

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

Compaction: `rewrite(records)` atomically replaces the file with a snapshot
(write a temp file, fsync, rename, fsync the directory).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import os
import struct
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack

from laminar.transport.codec import Message, ProtocolError, decode, encode

__all__ = ["Journal", "JournalError", "encode_record", "decode_record"]

MAGIC = b"LAMJRNL1"
_HEAD = struct.Struct("<II")
MAX_RECORD_BYTES = 1 << 31


class JournalError(RuntimeError):
    """The journal file cannot be used (wrong magic, unreadable)."""


def _frame_bytes(frame: Any) -> bytes:
    return frame if isinstance(frame, bytes) else bytes(frame)


def encode_record(kind: str, body: dict[str, Any], msgs: Sequence[Message] = ()) -> bytes:
    """One record (header + payload) ready to append."""
    parts: list[Any] = [kind, body]
    for m in msgs:
        parts.append([_frame_bytes(f) for f in encode(m)])
    payload = msgpack.packb(parts, use_bin_type=True)
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def decode_record(payload: bytes) -> tuple[str, dict[str, Any], list[Message]]:
    """Inverse of encode_record's payload; raises ProtocolError when it is not a record."""
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
        raise ProtocolError("journal record must be [kind, body, msgs...]")
    msgs = []
    for frames in parts[2:]:
        if not isinstance(frames, list):
            raise ProtocolError("journal message must be a list of frames")
        msgs.append(decode(frames))
    return parts[0], parts[1], msgs


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
        self.written = 0
        """Bytes handed to the OS (file offset of the end of the last record)."""
        self.synced = 0
        """Bytes known to be on disk (fsync'ed)."""
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="journal")
        self._sync: asyncio.Future[None] | None = None
        """The fsync in flight (an executor future, not a task: its awaiters see its error)."""
        self.stats = {
            "records": 0,
            "bytes": 0,
            "fsyncs": 0,
            "torn_bytes": 0,
            "replayed": 0,
            "bad_records": 0,
        }

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

    def replay(self) -> Iterator[tuple[str, dict[str, Any], list[Message]]]:
        """Yield every good record, then leave the file open for appends after the last one."""
        if self._lock_fd < 0:
            self._lock()
        if not self.path.exists() or self.path.stat().st_size == 0:
            self._open_new()
            return
        with open(self.path, "rb") as f:
            data = f.read()
        if not data.startswith(MAGIC):
            if len(data) < len(MAGIC) and MAGIC.startswith(data):  # torn while writing the magic
                self._open_new()
                return
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise JournalError(
                f"{self.path} is not a laminar journal (bad magic); move it away or use another run_dir"
            )
        pos = len(MAGIC)
        good = pos
        view = memoryview(data)
        while pos < len(data):
            if pos + _HEAD.size > len(data):
                break
            length, crc = _HEAD.unpack_from(data, pos)
            end = pos + _HEAD.size + length
            if length > MAX_RECORD_BYTES or end > len(data):
                break
            payload = view[pos + _HEAD.size : end]
            if zlib.crc32(payload) != crc:
                break
            try:
                rec = decode_record(bytes(payload))
            except ProtocolError:
                self.stats["bad_records"] += 1
                break
            pos = good = end
            self.stats["replayed"] += 1
            yield rec
        if good < len(data):
            self._quarantine(data[good:], good)
        self._open_existing(good)

    def _quarantine(self, tail: bytes, offset: int) -> None:
        self.stats["torn_bytes"] = len(tail)
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time() * 1000)}")
        aside.write_bytes(tail)
        with open(self.path, "r+b") as f:
            f.truncate(offset)
            f.flush()
            os.fsync(f.fileno())

    def _open_new(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _write_all(fd, MAGIC)
        os.fsync(fd)
        _fsync_dir(self.path.parent)
        self._fd = fd
        self.written = self.synced = len(MAGIC)

    def _open_existing(self, size: int) -> None:
        fd = os.open(self.path, os.O_WRONLY)
        os.lseek(fd, size, os.SEEK_SET)
        self._fd = fd
        self.written = self.synced = size

    @property
    def size(self) -> int:
        return self.written

    # ---- append + durability ---------------------------------------------------------
    def append(self, kind: str, body: dict[str, Any], msgs: Sequence[Message] = ()) -> int:
        """Write one record to the OS; returns the offset that `durable()` must reach."""
        if self._fd < 0:
            raise JournalError("journal is not open (call replay() first)")
        rec = encode_record(kind, body, msgs)
        try:
            _write_all(self._fd, rec)
        except OSError:
            # a half-written record would hide every later one at replay: cut it off
            os.ftruncate(self._fd, self.written)
            os.lseek(self._fd, self.written, os.SEEK_SET)
            raise
        self.written += len(rec)
        self.stats["records"] += 1
        self.stats["bytes"] += len(rec)
        return self.written

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
        """fsync=batch: flush every fsync_interval_s while there is unsynced data (runs until cancelled)."""
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
    def rewrite(self, records: list[bytes]) -> None:
        """Atomically replace the journal with these encoded records (a snapshot)."""
        tmp = self.path.with_name(self.path.name + ".compact")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, MAGIC)
            size = len(MAGIC)
            for rec in records:
                _write_all(fd, rec)
                size += len(rec)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        if self._fd >= 0:
            os.close(self._fd)
        self._open_existing(size)

    def close(self) -> None:
        self._io.shutdown(wait=True)  # an fsync still running must not see its fd closed
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


def _write_all(fd: int, data: bytes) -> None:
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
