"""The buffer journal never destroys data: undecodable records stop replay, torn tails are
cut loudly and kept, `laminar journal check`, the schema upgrades from schemas 1 and 2.

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

from laminar.buffer.experience import ExperienceState
from laminar.buffer.journal import Journal
from laminar.buffer.journal_format import (
    MAGIC,
    MAGIC_V1,
    SCHEMA_VERSION,
    JournalCorrupt,
    JournalError,
    check_journal,
    encode_record,
)
from laminar.buffer.ledger import Ledger
from laminar.buffer.records import (
    BatchCommitted,
    BatchesRequeued,
    BatchServed,
    ClosedBatch,
    GroupsDropped,
    GroupsReserved,
    GroupsServed,
    MemberAbandoned,
    PoolCursor,
    ServedGroup,
    StateCounters,
    StateSnapshot,
    TrajectoryAccepted,
)
from laminar.cli import main as cli_main
from laminar.message import REGISTRY
from laminar.metrics import Metrics
from laminar.modes import Admission
from laminar.protocol.buffer import PromptRequest
from laminar.protocol.data import PromptItem, Trajectory
from laminar.transport.codec import encode


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


def acc(i: int) -> TrajectoryAccepted:
    return TrajectoryAccepted(traj(i))


def raw_record(parts: list) -> bytes:
    """A record with a valid checksum around any msgpack payload (what a mismatched writer
    leaves)."""
    payload = msgpack.packb(parts, use_bin_type=True)
    return len(payload).to_bytes(4, "little") + zlib.crc32(payload).to_bytes(4, "little") + payload


def frames(msg) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


def old_record(kind: str, body: dict, msgs=()) -> bytes:
    """A record as schemas 1 and 2 wrote it: msgpack [kind, body dict, msg_frames...]."""
    return raw_record([kind, body, *[frames(m) for m in msgs]])


def schema2_head() -> bytes:
    return b"LAMJRNL-" + (2).to_bytes(4, "little")


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


@pytest.mark.parametrize(
    "bad", ["unknown_type", "fails_validation", "not_a_record", "a_wire_message"]
)
def test_undecodable_record_stops_replay_and_changes_nothing(tmp_path, bad):
    path = tmp_path / "buffer-0.journal"
    if bad == "unknown_type":
        rec = raw_record([bytes([unused_type_id()]), b"\x80"])
        kind = f"unknown type {unused_type_id():#04x}"
    elif bad == "fails_validation":  # a Trajectory's header under a record's type byte
        rec = raw_record([bytes([TrajectoryAccepted.TYPE]), *frames(traj(1))[1:]])
        kind = "TrajectoryAccepted"
    elif bad == "not_a_record":
        rec = raw_record({"not": "a record"})
        kind = "unknown (not a record)"
    else:  # a valid message of the wire catalogue, but no journal record
        rec = raw_record(frames(PromptRequest(rollout_id="r", max_groups=1, version=0)))
        kind = "PromptRequest"
    offs = write_journal(
        path, [encode_record(acc(0)), rec, encode_record(BatchCommitted("b", 1, 1))]
    )
    before = listing(tmp_path)
    with pytest.raises(JournalCorrupt) as err:
        replay_all(path)
    assert err.value.offset == offs[1] and err.value.path == path and err.value.kind == kind
    text = str(err.value)
    assert (
        str(path) in text and f"byte offset {offs[1]}" in text and "Nothing was truncated" in text
    )
    if bad == "a_wire_message":
        assert "not a journal record" in text
    assert listing(tmp_path) == before  # not truncated, nothing moved aside
    replay_all(tmp_path / "other")  # the lock was released: the process can go on / exit cleanly


def test_bad_checksum_in_the_middle_is_refused_not_cut(tmp_path):
    path = tmp_path / "j"
    offs = write_journal(path, [encode_record(acc(i)) for i in range(4)])
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
    unknown_group = BatchServed("b", 0, ["no-such-group"])
    offs = write_journal(path, [encode_record(StateCounters()), encode_record(unknown_group)])
    before = path.read_bytes()
    st = ExperienceState(
        group_size=2,
        lost_member_policy="release_partial",
        admission=Admission.for_mode("laminar", 2),
    )
    ledger = Ledger(st, Journal(path), 1 << 30, Metrics(), structlog.get_logger())
    with pytest.raises(
        JournalCorrupt, match=f"byte offset {offs[1]} \\(kind BatchServed\\).*refused"
    ):
        ledger.replay()
    assert path.read_bytes() == before


def test_torn_tail_is_cut_kept_aside_and_logged_as_error(tmp_path):
    path = tmp_path / "j"
    offs = write_journal(path, [encode_record(acc(i)) for i in range(3)])
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
    j.append(acc(9))
    j.close()
    assert [r.trajectory.uid for r in replay_all(path)] == ["g0/0", "g1/0", "g9/0"]


def test_schema1_journal_is_upgraded_and_replays(tmp_path):
    # schema 1, as the code before the schema header wrote it: the 8-byte magic, then records
    # as schema 2 wrote them (kind, body dict, messages)
    path = tmp_path / "buffer-0.journal"
    old = [old_record("traj", {}, [traj(i)]) for i in range(3)] + [
        old_record("commit", {"batch_id": "b1", "step": 1, "version": 2})
    ]
    write_journal(path, old, head=MAGIC_V1)
    original = path.read_bytes()
    assert original.startswith(b"LAMJRNL1") and len(MAGIC) > len(MAGIC_V1)
    j = Journal(path)
    recs = list(j.replay())
    assert [r.trajectory.uid for r in recs[:3]] == ["g0/0", "g1/0", "g2/0"]
    assert recs[3] == BatchCommitted("b1", step=1, version=2)
    assert recs[1].trajectory.response_ids.tolist() == [1, 2, 3, 4]
    assert j.upgraded_from == (1, tmp_path / "buffer-0.journal.schema1")
    assert path.read_bytes()[: len(MAGIC)] == MAGIC  # rewritten in the current schema...
    assert (tmp_path / "buffer-0.journal.schema1").read_bytes() == original  # ...the old file kept
    j.append(acc(9))
    j.close()
    assert [type(r).__name__ for r in replay_all(path)] == ["TrajectoryAccepted"] * 3 + [
        "BatchCommitted",
        "TrajectoryAccepted",
    ]
    rep = check_journal(path)
    assert rep.ok and rep.schema == SCHEMA_VERSION
    assert rep.kinds == {"TrajectoryAccepted": 4, "BatchCommitted": 1}
    # an empty schema-1 journal (what the incident left: 8 bytes) upgrades too
    (tmp_path / "e").write_bytes(MAGIC_V1)
    assert replay_all(tmp_path / "e") == [] and (tmp_path / "e").read_bytes() == MAGIC


def _member(gid: str, i: int, reward: float | None = 1.0) -> Trajectory:
    t = traj(0)
    t.uid, t.group_id, t.sample_index, t.version, t.reward = f"{gid}/{i}", gid, i, 0, reward
    return t


def _item(gid: str) -> PromptItem:
    return PromptItem(uid="u-" + gid, group_id=gid, prompt_ids=np.arange(2, dtype=np.int32), n=2)


def _fresh_state() -> ExperienceState:
    adm = Admission.for_mode("laminar", 2)
    return ExperienceState(group_size=2, lost_member_policy="release_partial", admission=adm)


def test_schema2_journal_of_every_kind_upgrades_to_the_same_state(tmp_path):
    # what a schema-2 buffer wrote (dict bodies), next to the typed records that mean the same
    cursor = {"epoch": 1, "pos": 3, "serial": 7, "rows": 10}
    served = {
        "rollout_id": "r0",
        "version": 0,
        "request_id": "q1",
        "cursor": cursor,
        "groups": [
            {"group_id": g, "uid": "u-" + g, "n": 2, "version": 0, "item": i}
            for i, g in enumerate("abcd")
        ],
    }
    pairs = [
        (
            old_record(
                "snapshot",
                {
                    "trainer_version": 0,
                    "last_batch_version": -1,
                    "closed": {"z": "committed"},
                    "serial": 4,
                    "cursor": None,
                    "batches": {"b0": ["committed", 0]},
                },
            ),
            StateSnapshot(0, -1, {"z": "committed"}, 4, None, {"b0": ClosedBatch("committed", 0)}),
        ),
        (
            old_record("served", served, [_item(g) for g in "abcd"]),
            GroupsServed(
                [ServedGroup(g, "u-" + g, 2, 0, item=_item(g)) for g in "abcd"],
                rollout_id="r0",
                request_id="q1",
                cursor=PoolCursor(1, 3, 7, 10),
            ),
        ),
        *[
            (old_record("traj", {}, [_member(g, i)]), TrajectoryAccepted(_member(g, i)))
            for g in "abc"
            for i in range(2)
        ],
        (
            old_record("abandon", {"group_id": "d", "sample_index": 1, "uid": "d/1"}),
            MemberAbandoned("d", 1, "d/1"),
        ),
        (
            old_record("reserve", {"rollout_id": "r1", "group_ids": ["d"]}),
            GroupsReserved("r1", ["d"]),
        ),
        (
            old_record("batch", {"batch_id": "b1", "version": 0, "group_ids": ["a"]}),
            BatchServed("b1", 0, ["a"]),
        ),
        (
            old_record("commit", {"batch_id": "b1", "step": 1, "version": 1}),
            BatchCommitted("b1", 1, 1),
        ),
        (
            old_record("batch", {"batch_id": "b2", "version": 1, "group_ids": ["b"]}),
            BatchServed("b2", 1, ["b"]),
        ),
        (old_record("requeue", {"trainer_version": 1}), BatchesRequeued(1)),
        (
            old_record("drop", {"group_ids": ["c"], "reason": "expired"}),
            GroupsDropped(["c"], "expired"),
        ),
        (
            old_record("stats", {"counts": {"x": 1}, "finish_hist": {"0": 6}, "consumed_hist": {}}),
            StateCounters({"x": 1}, {0: 6}),
        ),
    ]
    path = tmp_path / "buffer-0.journal"
    write_journal(path, [old for old, _ in pairs], head=schema2_head())
    original = path.read_bytes()
    upgraded = _fresh_state()
    j = Journal(path)
    n = Ledger(upgraded, j, 1 << 30, Metrics(), structlog.get_logger()).replay()
    assert n == len(pairs) and j.upgraded_from == (2, tmp_path / "buffer-0.journal.schema2")
    j.close()
    typed = _fresh_state()
    for _, rec in pairs:
        typed.apply(rec)
    assert upgraded.summary() == typed.summary()
    assert upgraded.closed == typed.closed and upgraded.cursor == typed.cursor
    assert upgraded.last_reply == typed.last_reply == {"r0": ("q1", list("abcd"))}
    assert upgraded.groups["d"].rollout_id == "r1" and upgraded.groups["d"].lost == {1}
    assert upgraded.groups["b"].front and upgraded.groups["b"].item is not None
    assert upgraded.finish_hist.counts == typed.finish_hist.counts == {0: 6}
    assert (tmp_path / "buffer-0.journal.schema2").read_bytes() == original
    assert path.read_bytes().startswith(MAGIC)
    # the rewritten file replays as it is, in the current schema
    assert [type(r).__name__ for r in replay_all(path)] == [type(r).__name__ for _, r in pairs]


def test_schema2_record_that_does_not_upgrade_is_refused_untouched(tmp_path):
    path = tmp_path / "buffer-0.journal"
    offs = write_journal(
        path,
        [old_record("traj", {}, [traj(0)]), old_record("bogus", {"x": 1})],
        head=schema2_head(),
    )
    before = listing(tmp_path)
    with pytest.raises(JournalCorrupt, match=f"byte offset {offs[1]} \\(kind 'bogus'\\)"):
        replay_all(path)
    assert listing(tmp_path) == before  # no rewrite, no .schema2 copy
    rep = check_journal(path)
    assert not rep.ok and rep.bad[0][:2] == (offs[1], "'bogus'")


def test_newer_schema_is_refused_untouched(tmp_path):
    path = tmp_path / "j"
    data = b"LAMJRNL-" + (SCHEMA_VERSION + 1).to_bytes(4, "little") + encode_record(acc(0))
    path.write_bytes(data)
    with pytest.raises(JournalError, match="newer than this laminar"):
        replay_all(path)
    assert path.read_bytes() == data


def test_replay_in_a_fresh_process_knows_every_message(tmp_path):
    # the incident: a process that had not imported laminar.protocol decoded nothing
    path = tmp_path / "j"
    write_journal(path, [encode_record(acc(i)) for i in range(2)])
    code = (
        "import sys; from laminar.buffer.journal import Journal; j = Journal(sys.argv[1]); "
        "print(sorted(r.trajectory.uid for r in j.replay())); j.close()"
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
        [encode_record(acc(0)), encode_record(BatchCommitted("b", 1, 1))],
    )
    (clean / "tools").mkdir()
    (clean / "tools" / "tools-0.journal").write_text('{"t":"done","id":"a"}\n')
    assert cli_main(["journal", "check", str(clean)]) == 0
    out = capsys.readouterr().out
    assert (
        "buffer-0.journal: ok" in out
        and "2 records (BatchCommitted 1, TrajectoryAccepted 1)" in out
        and "tools-0.journal: ok" in out
    )

    bad = tmp_path / "bad"
    bad.mkdir()
    rec = raw_record([bytes([unused_type_id()]), b"\x80"])
    last = encode_record(GroupsDropped(["x"]))
    offs = write_journal(bad / "buffer-0.journal", [encode_record(acc(0)), rec, last])
    with open(bad / "buffer-0.journal", "ab") as f:
        f.write(encode_record(acc(5))[:30])  # a torn tail of 30 bytes
    old = old_record("commit", {"batch_id": "b", "version": 1})
    write_journal(bad / "buffer-1.journal", [old], head=MAGIC_V1)  # schema 1: fine
    (bad / "tools").mkdir()
    (bad / "tools" / "tools-0.journal").write_bytes(b'{"t":"done","id":"a"}\nnot json\n{"t":"do')
    before = {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()}
    assert cli_main(["journal", "check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert (
        f"bad record at byte offset {offs[1]} (kind unknown type {unused_type_id():#04x})" in out
        and "unknown message type" in out
    )
    assert f"torn tail: 30 bytes from byte offset {offs[2] + len(last)}" in out
    assert "buffer-1.journal: ok  schema 1" in out
    assert "bad line at byte offset 22" in out and "torn tail: 8 bytes" in out
    assert {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()} == before  # read-only
    assert cli_main(["journal", "check", str(tmp_path / "missing")]) == 2
    assert not any(".corrupt-" in n for n in os.listdir(bad))
