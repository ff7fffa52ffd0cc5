"""The buffer journal's file format: header, records, schema upgrades, and the offline readers.

    head, payload = record_parts(TrajectoryAccepted(trajectory=t))   # what Journal.append writes
    rec = decode_record(payload)                                       # what replay reads back
    report = check_journal(path)      # offline, read-only (`laminar journal check RUN_DIR`)
    for rec in read_records(path): ...                                 # offline, read-only

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

The live writer (append, durability, replay with its repairs, compaction) is
laminar/buffer/journal.py; what replay does with a damaged file is in its docstring, and
check_journal reports the same damage without changing anything.
"""

from __future__ import annotations

import collections
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

import laminar.protocol  # noqa: F401  - registers every message type that a record may hold
from laminar.buffer.records import RECORD_TYPES, JournalRecord, from_schema2
from laminar.message import REGISTRY, Limits, ProtocolError
from laminar.transport.codec import decode, encode

__all__ = [
    "MAGIC",
    "MAGIC_V1",
    "MAX_RECORD_BYTES",
    "RECORD_HEAD",
    "SCHEMA_VERSION",
    "JournalCorrupt",
    "JournalError",
    "JournalReport",
    "check_journal",
    "decode_record",
    "encode_record",
    "kind_of",
    "next_valid",
    "read_header",
    "read_records",
    "record_head",
    "record_parts",
    "scan_records",
    "upgrade_payload",
]

SCHEMA_VERSION = 3
"""The journal's record format; bump it (and add an _UPGRADES step) when records change."""
_SIGNATURE = b"LAMJRNL-"
_FILE_HEAD = struct.Struct("<8sI")
MAGIC = _FILE_HEAD.pack(_SIGNATURE, SCHEMA_VERSION)
"""The first bytes of a journal of the current schema."""
MAGIC_V1 = b"LAMJRNL1"
"""Schema 1: this magic, then records (no version field)."""
RECORD_HEAD = struct.Struct("<II")
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


def record_head(payload: bytes) -> bytes:
    """The 8 bytes before a record's payload: its length and checksum."""
    return RECORD_HEAD.pack(len(payload), zlib.crc32(payload))


def record_parts(rec: JournalRecord) -> tuple[bytes, bytes]:
    """One record as its header and payload (written together, without joining them)."""
    payload = _payload(rec)
    return record_head(payload), payload


def encode_record(rec: JournalRecord) -> bytes:
    """One record (header + payload) ready to append."""
    head, payload = record_parts(rec)
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


def kind_of(payload: bytes) -> str:
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


def read_header(path: Path, data: bytes) -> tuple[int, int] | None:
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


def upgrade_payload(schema: int, payload: bytes) -> bytes:
    for s in range(schema, SCHEMA_VERSION):
        payload = _UPGRADES[s](payload)
    return payload


def scan_records(data: bytes, pos: int) -> Iterator[tuple[int, bytes]]:
    """(offset, payload) of each record whose checksum holds, from `pos` up to the first that does
    not."""
    view = memoryview(data)
    while pos + RECORD_HEAD.size <= len(data):
        length, crc = RECORD_HEAD.unpack_from(data, pos)
        end = pos + RECORD_HEAD.size + length
        if length == 0 or length > MAX_RECORD_BYTES or end > len(data):
            return  # never written (a record is at least a msgpack list): torn, or damaged
        payload = view[pos + RECORD_HEAD.size : end]
        if zlib.crc32(payload) != crc:
            return
        yield pos, bytes(payload)
        pos = end


def next_valid(data: bytes, start: int) -> int | None:
    """Offset of the first record with a valid checksum at or after `start`, if any.

    A crash tears only the last record: a valid record after a bad one means damage in
    the middle of the file, which replay must not cut off with the tail.
    """
    n = len(data)
    head = RECORD_HEAD
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
        head = read_header(rep.path, data)
    except JournalError as exc:
        rep.error = str(exc)
        return rep
    if head is None:
        rep.schema, rep.torn_offset, rep.torn_bytes = SCHEMA_VERSION, 0, len(data)
        return rep
    rep.schema, stop = head
    for off, payload in scan_records(data, stop):
        stop = off + RECORD_HEAD.size + len(payload)
        try:
            rec = decode_record(upgrade_payload(rep.schema, payload))
        except ProtocolError as exc:
            rep.bad.append((off, kind_of(payload), str(exc)))
            continue
        rep.records += 1
        rep.kinds[type(rec).__name__] += 1
    if stop < len(data):
        later = next_valid(data, stop + 1)
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
    head = read_header(p, data)
    if head is None:
        return
    schema, pos = head
    for _off, payload in scan_records(data, pos):
        try:
            yield decode_record(upgrade_payload(schema, payload))
        except ProtocolError:
            continue
