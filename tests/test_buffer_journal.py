"""Buffer journal: round trip, torn tails, corruption, fsync policies, atomic rewrite, compaction.

.venv/bin/python -m pytest tests/test_buffer_journal.py -q
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from laminar.buffer.journal import Journal
from laminar.buffer.journal_format import MAGIC, JournalError, encode_record
from laminar.buffer.records import (
    BatchCommitted,
    GroupsDropped,
    StateSnapshot,
    TrajectoryAccepted,
)
from laminar.protocol.data import Trajectory


def traj(i: int, n_tokens: int = 5) -> Trajectory:
    return Trajectory(
        uid=f"g{i}/0",
        group_id=f"g{i}",
        prompt_uid="p",
        sample_index=0,
        prompt_ids=np.arange(3, dtype=np.int32),
        response_ids=np.arange(n_tokens, dtype=np.int32) + i,
        logprobs=np.full(n_tokens, -0.5, np.float32),
        version=i,
        reward=1.0,
        row={"answer": "x"},
    )


def acc(i: int, n_tokens: int = 5) -> TrajectoryAccepted:
    return TrajectoryAccepted(traj(i, n_tokens))


def mark(name: str) -> GroupsDropped:
    """A small record that carries a name (what the tests look for after a replay)."""
    return GroupsDropped([name])


def names(recs) -> list[str]:
    """Each record as a word: a mark's name, a trajectory's uid, else the record type."""
    out = []
    for r in recs:
        if isinstance(r, GroupsDropped):
            out.append(r.group_ids[0])
        elif isinstance(r, TrajectoryAccepted):
            out.append(r.trajectory.uid)
        else:
            out.append(type(r).__name__)
    return out


def read_all(path, **kw):
    j = Journal(path, **kw)
    recs = list(j.replay())
    return j, recs


def records(path):
    """Replay and close (the journal is locked while open)."""
    j, recs = read_all(path)
    j.close()
    return recs


def test_round_trip_with_arrays(tmp_path):
    path = tmp_path / "j"
    j, recs = read_all(path)
    assert recs == [] and path.read_bytes() == MAGIC
    for i in range(3):
        j.append(acc(i))
    j.append(BatchCommitted("b1", step=1, version=2))
    j.close()
    j2, recs = read_all(path)
    assert names(recs) == ["g0/0", "g1/0", "g2/0", "BatchCommitted"]
    assert recs[3] == BatchCommitted("b1", step=1, version=2)
    t = recs[2].trajectory
    assert isinstance(t, Trajectory) and t.uid == "g2/0" and t.row == {"answer": "x"}
    assert t.response_ids.tolist() == [2, 3, 4, 5, 6] and t.logprobs.dtype == np.float32
    j2.append(acc(3))  # appends continue after the last record
    j2.close()
    assert len(records(path)) == 5


@pytest.mark.parametrize("takes", [3, 8, 40])
def test_an_append_the_os_takes_in_part_is_written_whole(tmp_path, monkeypatch, takes):
    """A record goes as its header and payload in one writev; where the OS takes fewer bytes (a
    full disk, a signal), the rest follows, so every record replays whole and in order."""
    path = tmp_path / "j"
    j, _ = read_all(path)
    writev = os.writev

    def short(fd, parts):  # the first `takes` bytes of the record only (header 8 bytes)
        return writev(fd, [b"".join(bytes(p) for p in parts)[:takes]])

    monkeypatch.setattr(os, "writev", short)
    for i in range(3):
        j.append(acc(i, n_tokens=20))
    monkeypatch.setattr(os, "writev", writev)
    j.append(mark("after"))
    j.close()
    assert names(records(path)) == ["g0/0", "g1/0", "g2/0", "after"]


@pytest.mark.parametrize("cut", [1, 5, 9, 20])
def test_torn_tail_is_dropped_and_kept_aside(tmp_path, cut):
    path = tmp_path / "j"
    j, _ = read_all(path)
    for i in range(4):
        j.append(acc(i))
    j.close()
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - cut)  # the last record was being written when the process died
    j2, recs = read_all(path)
    assert names(recs) == ["g0/0", "g1/0", "g2/0"]
    assert j2.stats["torn_bytes"] > 0
    aside = [p for p in os.listdir(tmp_path) if ".corrupt-" in p]
    assert len(aside) == 1
    j2.append(acc(9))
    j2.close()
    assert names(records(path)) == ["g0/0", "g1/0", "g2/0", "g9/0"]


def test_bad_checksum_and_garbage_tail(tmp_path):
    path = tmp_path / "j"
    j, _ = read_all(path)
    j.append(mark("a"))
    j.append(mark("b"))
    j.close()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # flip a bit in the last payload
    path.write_bytes(bytes(data) + b"\x00garbage")
    j2, recs = read_all(path)
    assert names(recs) == ["a"]
    j2.close()
    path.write_bytes(MAGIC + b"\x05\x00")  # a header cut short
    assert records(path) == []
    path.write_bytes(MAGIC[:3])  # died while writing the magic of a new file
    assert records(path) == []


def test_bad_magic_is_refused(tmp_path):
    path = tmp_path / "j"
    path.write_bytes(b"something else entirely")
    with pytest.raises(JournalError, match="not a laminar journal"):
        read_all(path)


async def test_fsync_always_waits_for_disk(tmp_path):
    import asyncio

    j, _ = read_all(tmp_path / "j", fsync="always")
    offs = [j.append(acc(i)) for i in range(5)]
    assert j.synced < offs[-1]
    await asyncio.gather(
        *(j.durable(o) for o in offs)
    )  # concurrent acks share fsyncs (group commit)
    assert j.synced >= offs[-1] and 1 <= j.stats["fsyncs"] <= 5
    j.close()


async def test_fsync_batch_flusher_and_never(tmp_path, wait_until):
    import asyncio

    j, _ = read_all(tmp_path / "b", fsync="batch", fsync_interval_s=0.01)
    task = asyncio.ensure_future(j.run_flusher())
    off = j.append(mark("x"))
    await j.durable(off)  # batch: acked once written to the OS, flushed by the background task
    await wait_until(lambda: j.synced >= off, 5.0, "the batch flusher to fsync")
    assert j.stats["fsyncs"] >= 1
    task.cancel()
    j.close()
    n, _ = read_all(tmp_path / "n", fsync="never")
    n.append(mark("x"))
    await n.durable(n.written)
    assert n.stats["fsyncs"] == 0
    n.close()
    with pytest.raises(ValueError):
        Journal(tmp_path / "z", fsync="sometimes")


def test_rewrite_replaces_atomically(tmp_path):
    path = tmp_path / "j"
    j, _ = read_all(path)
    for i in range(10):
        j.append(acc(i, 100))
    big = j.size
    j.rewrite([encode_record(StateSnapshot(1, 0)), encode_record(acc(7))])
    assert j.size < big and not (tmp_path / "j.compact").exists()
    j.append(mark("after"))
    j.close()
    assert names(records(path)) == ["StateSnapshot", "g7/0", "after"]


def test_second_writer_is_refused(tmp_path):
    j, _ = read_all(tmp_path / "j")
    with pytest.raises(JournalError, match="in use by another buffer"):
        read_all(tmp_path / "j")
    j.close()
    read_all(tmp_path / "j")[0].close()  # free again once the first one closed


class GatedSnapshot(list):
    """A snapshot whose encoding (on the compaction thread) waits until the test opens the gate:
    the test appends records in between, deterministically, while the compaction is running."""

    def __init__(self, items):
        import threading

        super().__init__(items)
        self.started, self.gate = threading.Event(), threading.Event()

    def __iter__(self):
        self.started.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return super().__iter__()


async def _wait_thread_event(ev):
    import asyncio

    assert await asyncio.to_thread(ev.wait, 10), "the compaction thread never started"


async def test_compaction_runs_off_the_loop_and_keeps_records_appended_meanwhile(tmp_path):
    import asyncio

    path = tmp_path / "j"
    j, _ = read_all(path, fsync="always")
    for i in range(10):
        j.append(acc(i, 100))
    before_size = j.size
    first = j.written
    snap = GatedSnapshot([StateSnapshot(1, 0), acc(7)])
    task = asyncio.ensure_future(j.compact(snap))
    await _wait_thread_event(snap.started)
    # the snapshot is being encoded on its thread: the loop still appends, acks and fsyncs
    assert j.compacting
    offs = [j.append(acc(100 + i)) for i in range(3)]
    await j.durable(offs[-1])
    snap.gate.set()
    await asyncio.wait_for(task, 10)
    assert not j.compacting and j.size < before_size
    assert not (tmp_path / "j.compact").exists()
    # offsets handed out before the compaction stay valid: they are already durable
    assert j.written >= offs[-1] > first and j.synced == j.written
    await j.durable(offs[-1])
    j.append(mark("after"))
    j.close()
    recs = records(path)
    assert names(recs) == ["StateSnapshot", "g7/0", "g100/0", "g101/0", "g102/0", "after"]


async def test_a_cancelled_compaction_leaves_the_journal_whole(tmp_path):
    import asyncio

    path = tmp_path / "j"
    j, _ = read_all(path)
    for i in range(5):
        j.append(acc(i))
    snap = GatedSnapshot([StateSnapshot(1, 0)])
    task = asyncio.ensure_future(j.compact(snap))
    await _wait_thread_event(snap.started)
    j.append(mark("meanwhile"))
    task.cancel()
    snap.gate.set()  # the thread sees the stop between records
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not j.compacting and not (tmp_path / "j.compact").exists()
    j.append(mark("after"))
    j.close()
    assert names(records(path)) == [f"g{i}/0" for i in range(5)] + ["meanwhile", "after"]
