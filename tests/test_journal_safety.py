"""The buffer journal never destroys data: undecodable records stop replay, torn tails are
cut loudly and kept, `laminar journal check`, the schema upgrade from schema 1.

.venv/bin/python -m pytest tests/test_journal_safety.py -q
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest
import structlog
from structlog.testing import CapturingLogger

from laminar.buffer.admission import Admission
from laminar.buffer.experience import ExperienceState
from laminar.buffer.journal import (
    MAGIC,
    MAGIC_V1,
    SCHEMA_VERSION,
    Journal,
    JournalCorrupt,
    JournalError,
    check_journal,
    encode_record,
)
from laminar.buffer.ledger import Ledger
from laminar.cli import main as cli_main
from laminar.metrics import Metrics
from laminar.protocol.buffer import PromptRequest
from laminar.protocol.data import Trajectory
from laminar.transport.codec import REGISTRY, encode


def traj(i: int) -> Trajectory:
    return Trajectory(
        uid=f"g{i}/0",
        group_id=f"g{i}",
        prompt_uid="p",
        sample_index=0,
        prompt_ids=np.arange(3, dtype=np.int32),
        response_ids=np.arange(4, dtype=np.int32) + i,
        logprobs=np.full(4, -0.5, np.float32),
        version=i,
        reward=1.0,
        row={"answer": "x"},
    )


def raw_record(parts: list) -> bytes:
    """A record with a valid checksum around any msgpack payload (what a mismatched writer leaves)."""
    payload = msgpack.packb(parts, use_bin_type=True)
    return len(payload).to_bytes(4, "little") + zlib.crc32(payload).to_bytes(4, "little") + payload


def frames(msg) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


def write_journal(path: Path, records: list[bytes], head: bytes = MAGIC) -> list[int]:
    """Write a journal; returns each record's byte offset."""
    offs, pos = [], len(head)
    for r in records:
        offs.append(pos)
        pos += len(r)
    path.write_bytes(head + b"".join(records))
    return offs


def listing(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if not p.name.endswith(".lock")}


def replay_all(path: Path) -> list:
    j = Journal(path)
    try:
        return list(j.replay())
    finally:
        j.close()


def unused_type_id() -> int:
    return next(i for i in range(1, 0xF0) if i not in REGISTRY)


@pytest.mark.parametrize("bad", ["unknown_type", "fails_validation", "not_a_record"])
def test_undecodable_record_stops_replay_and_changes_nothing(tmp_path, bad):
    path = tmp_path / "buffer-0.journal"
    if bad == "unknown_type":
        rec = raw_record(["traj", {}, [bytes([unused_type_id()]), b"\x80"]])
    elif bad == "fails_validation":  # a Trajectory's header under another message's type byte
        rec = raw_record(["traj", {}, [bytes([PromptRequest.TYPE]), *frames(traj(1))[1:]]])
    else:
        rec = raw_record({"not": "a record"})
    offs = write_journal(
        path, [encode_record("traj", {}, [traj(0)]), rec, encode_record("commit", {"v": 1})]
    )
    before = listing(tmp_path)
    with pytest.raises(JournalCorrupt) as err:
        replay_all(path)
    assert err.value.offset == offs[1] and err.value.path == path
    text = str(err.value)
    assert (
        str(path) in text and f"byte offset {offs[1]}" in text and "Nothing was truncated" in text
    )
    assert ("'traj'" in text) == (bad != "not_a_record")
    assert listing(tmp_path) == before  # not truncated, nothing moved aside
    replay_all(tmp_path / "other")  # the lock was released: the process can go on / exit cleanly


def test_bad_checksum_in_the_middle_is_refused_not_cut(tmp_path):
    path = tmp_path / "j"
    offs = write_journal(path, [encode_record("traj", {}, [traj(i)]) for i in range(4)])
    data = bytearray(path.read_bytes())
    data[offs[1] + 20] ^= 0xFF  # a bit flip in record 1: records 2 and 3 are still good
    path.write_bytes(bytes(data))
    with pytest.raises(
        JournalCorrupt,
        match=f"byte offset {offs[1]}.*valid record follows at byte offset {offs[2]}",
    ):
        replay_all(path)
    assert path.read_bytes() == bytes(data) and listing(tmp_path) == {"j": bytes(data)}


def test_state_refusing_a_record_names_it_and_keeps_the_file(tmp_path):
    path = tmp_path / "j"
    offs = write_journal(
        path, [encode_record("stats", {"counts": {}}), encode_record("bogus", {"x": 1})]
    )
    before = path.read_bytes()
    st = ExperienceState(
        group_size=2,
        lost_member_policy="release_partial",
        admission=Admission.for_mode("laminar", 2),
    )
    ledger = Ledger(st, Journal(path), 1 << 30, Metrics(), structlog.get_logger())
    with pytest.raises(JournalCorrupt, match=f"byte offset {offs[1]} \\(kind 'bogus'\\).*refused"):
        ledger.replay()
    assert path.read_bytes() == before


def test_torn_tail_is_cut_kept_aside_and_logged_as_error(tmp_path):
    path = tmp_path / "j"
    offs = write_journal(path, [encode_record("traj", {}, [traj(i)]) for i in range(3)])
    full = path.read_bytes()
    path.write_bytes(full[:-7])  # the last record was being written when the process died
    cap = CapturingLogger()
    log = structlog.wrap_logger(
        cap, wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG), processors=[]
    )
    st = ExperienceState(
        group_size=1,
        lost_member_policy="release_partial",
        admission=Admission.for_mode("laminar", 2),
    )
    j = Journal(path)
    assert Ledger(st, j, 1 << 30, Metrics(), log).replay() == 2
    torn = len(full) - 7 - offs[2]
    assert j.stats["torn_bytes"] == torn and j.stats["torn_offset"] == offs[2]
    assert j.torn_path is not None and j.torn_path.read_bytes() == full[offs[2] : -7]
    errors = [c for c in cap.calls if c.method_name == "error"]
    assert len(errors) == 1 and errors[0].kwargs["event"] == "journal_torn_tail"
    assert errors[0].kwargs["bytes"] == torn and errors[0].kwargs["moved_to"] == str(j.torn_path)
    j.append("traj", {}, [traj(9)])
    j.close()
    assert [m[0].uid for _, _, m in replay_all(path)] == ["g0/0", "g1/0", "g9/0"]


def test_schema1_journal_is_upgraded_and_replays(tmp_path):
    # schema 1, as the code before the schema header wrote it: the 8-byte magic, then records
    path = tmp_path / "buffer-0.journal"
    old = [encode_record("traj", {"i": i}, [traj(i)]) for i in range(3)] + [
        encode_record("commit", {"v": 2})
    ]
    write_journal(path, old, head=MAGIC_V1)
    original = path.read_bytes()
    assert original.startswith(b"LAMJRNL1") and len(MAGIC) > len(MAGIC_V1)
    j = Journal(path)
    recs = list(j.replay())
    assert [(k, b) for k, b, _ in recs] == [
        ("traj", {"i": 0}),
        ("traj", {"i": 1}),
        ("traj", {"i": 2}),
        ("commit", {"v": 2}),
    ]
    assert recs[1][2][0].response_ids.tolist() == [1, 2, 3, 4]
    assert j.upgraded_from == (1, tmp_path / "buffer-0.journal.schema1")
    assert path.read_bytes()[: len(MAGIC)] == MAGIC  # rewritten in the current schema...
    assert (tmp_path / "buffer-0.journal.schema1").read_bytes() == original  # ...the old file kept
    j.append("traj", {"i": 9}, [traj(9)])
    j.close()
    assert [b.get("i") for _, b, _ in replay_all(path)] == [0, 1, 2, None, 9]
    rep = check_journal(path)
    assert rep.ok and rep.schema == SCHEMA_VERSION and rep.kinds == {"traj": 4, "commit": 1}
    # an empty schema-1 journal (what the incident left: 8 bytes) upgrades too
    (tmp_path / "e").write_bytes(MAGIC_V1)
    assert replay_all(tmp_path / "e") == [] and (tmp_path / "e").read_bytes() == MAGIC


def test_newer_schema_is_refused_untouched(tmp_path):
    path = tmp_path / "j"
    data = b"LAMJRNL-" + (SCHEMA_VERSION + 1).to_bytes(4, "little") + encode_record("x", {})
    path.write_bytes(data)
    with pytest.raises(JournalError, match="newer than this laminar"):
        replay_all(path)
    assert path.read_bytes() == data


def test_replay_in_a_fresh_process_knows_every_message(tmp_path):
    # the incident: a process that had not imported laminar.protocol decoded nothing
    path = tmp_path / "j"
    write_journal(path, [encode_record("traj", {}, [traj(i)]) for i in range(2)])
    code = (
        "import sys; from laminar.buffer.journal import Journal; j = Journal(sys.argv[1]); "
        "print(sorted(m[0].uid for _, _, m in j.replay())); j.close()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['g0/0', 'g1/0']"


def test_journal_check_clean_and_damaged_run_dirs(tmp_path, capsys):
    clean = tmp_path / "clean"
    clean.mkdir()
    write_journal(
        clean / "buffer-0.journal",
        [encode_record("traj", {}, [traj(0)]), encode_record("commit", {})],
    )
    (clean / "tools").mkdir()
    (clean / "tools" / "tools-0.journal").write_text('{"t":"done","id":"a"}\n')
    assert cli_main(["journal", "check", str(clean)]) == 0
    out = capsys.readouterr().out
    assert (
        "buffer-0.journal: ok" in out
        and "2 records (commit 1, traj 1)" in out
        and "tools-0.journal: ok" in out
    )

    bad = tmp_path / "bad"
    bad.mkdir()
    rec = raw_record(["traj", {}, [bytes([unused_type_id()]), b"\x80"]])
    offs = write_journal(
        bad / "buffer-0.journal",
        [encode_record("traj", {}, [traj(0)]), rec, encode_record("x", {})],
    )
    with open(bad / "buffer-0.journal", "ab") as f:
        f.write(encode_record("traj", {}, [traj(5)])[:30])  # a torn tail of 30 bytes
    write_journal(
        bad / "buffer-1.journal", [encode_record("a", {})], head=MAGIC_V1
    )  # schema 1: fine
    (bad / "tools").mkdir()
    (bad / "tools" / "tools-0.journal").write_bytes(b'{"t":"done","id":"a"}\nnot json\n{"t":"do')
    before = {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()}
    assert cli_main(["journal", "check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert (
        f"bad record at byte offset {offs[1]} (kind 'traj')" in out
        and "unknown message type" in out
    )
    assert f"torn tail: 30 bytes from byte offset {offs[2] + len(encode_record('x', {}))}" in out
    assert "buffer-1.journal: ok  schema 1" in out
    assert "bad line at byte offset 22" in out and "torn tail: 8 bytes" in out
    assert {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()} == before  # read-only
    assert cli_main(["journal", "check", str(tmp_path / "missing")]) == 2
    assert not any(".corrupt-" in n for n in os.listdir(bad))
