"""The batched partial stream: PartialBatch (one message per rollout per flush window) folds into
the partial pool exactly as the same entries sent as PartialChunks, and the rollout's deliverer
sends one batch per window.

    .venv/bin/python -m pytest tests/test_partial_batch.py -q
"""

from __future__ import annotations

import asyncio
import gc
import random
import weakref
from collections import Counter
from typing import Any

import numpy as np
import pytest

import laminar.buffer.partial_records as records_mod
from laminar.buffer.partials import PartialPool
from laminar.logs import get_logger
from laminar.metrics import Metrics
from laminar.protocol.data import PartialBatch, PartialChunk, PartialTrajectory, PromptItem
from laminar.rollout.deliver import Deliverer, partial_batch
from laminar.rollout.sequences import SequenceTable
from laminar.rollout.tracking import SeqState
from laminar.transport.codec import decode, encode


def header(uid: str, version: int, rid: str) -> PartialTrajectory:
    return PartialTrajectory(
        uid=uid,
        group_id=uid.rpartition("/")[0],
        prompt_uid="p",
        sample_index=int(uid[-1]),
        prompt_ids=np.arange(3, dtype=np.int32),
        response_ids=np.zeros(0, np.int32),
        logprobs=np.zeros(0, np.float32),
        version=version,
        n=4,
        rollout_id=rid,
    )


def random_chunks(rng: random.Random, masked: bool, n: int = 400) -> list[PartialChunk]:
    """A stream with every case the pool's rules name: in-order, resends, overlaps, gaps, restarts
    by a header, unknown uids, other versions, awaiting flips, empty entries."""
    uids = [f"g{k}/{i}" for k in range(3) for i in range(2)]
    oracle = PartialPool()  # where the receiving pool stands, so most entries are in order
    out = []
    for _ in range(n):
        uid = rng.choice(uids)
        have = oracle.length(uid)
        r = rng.random()
        ver = 0 if rng.random() > 0.05 else 1
        if have is None or r < 0.05:  # (re)start with a header (or an unknown uid, no header)
            off, hdr = 0, (header(uid, ver, "r0") if rng.random() > 0.1 else None)
        elif r < 0.15:
            off, hdr = max(0, have - rng.randint(1, 5)), None  # a resend / an overlap
        elif r < 0.2:
            off, hdr = have + rng.randint(1, 3), None  # a gap
        else:
            off, hdr = have, None
        k = rng.choice([0, 1, 2, 5, 8])
        ids = np.arange(off, off + k, dtype=np.int32) + 1000 * uids.index(uid)
        lps = -np.arange(off, off + k, dtype=np.float32) / 100
        mask = np.array([rng.randint(0, 1) for _ in range(k)], np.uint8) if masked else None
        out.append(
            PartialChunk(
                uid=uid,
                version=ver,
                offset=off,
                token_ids=ids,
                logprobs=lps,
                rollout_id="r0",
                header=hdr,
                loss_mask=mask,
                awaiting_env=rng.random() < 0.3,
            )
        )
        oracle.apply(copy_chunk(out[-1]))
    return out


def as_batch(chunks: list[PartialChunk]) -> PartialBatch:
    at = [i for i, c in enumerate(chunks) if c.header is not None]
    masks = [c.loss_mask for c in chunks]
    return PartialBatch(
        rollout_id="r0",
        uids=[c.uid for c in chunks],
        versions=np.array([c.version for c in chunks], np.int64),
        offsets=np.array([c.offset for c in chunks], np.int64),
        lengths=np.array([len(c.token_ids) for c in chunks], np.int64),
        token_ids=np.concatenate([c.token_ids for c in chunks]),
        logprobs=np.concatenate([c.logprobs for c in chunks]),
        awaiting_env=np.array([c.awaiting_env for c in chunks], np.uint8),
        loss_mask=None if masks[0] is None else np.concatenate(masks),  # type: ignore[arg-type]
        headers=[chunks[i].header for i in at],  # type: ignore[misc]
        header_at=np.array(at, np.int64) if at else None,
    )


def copy_chunk(c: PartialChunk) -> PartialChunk:
    """Both pools take ownership of headers (they strip their arrays): each gets its own."""
    return decode(encode(c))  # type: ignore[return-value]


def snapshot(pool: PartialPool) -> dict[str, Any]:
    return snap(pool, sorted(pool.records))


def snap(pool: PartialPool, uids: list[str]) -> dict[str, Any]:
    out = {}
    for p in pool.query(uids=uids):
        out[p.uid] = (
            p.response_ids.tolist(),
            p.logprobs.tolist(),
            None if p.loss_mask is None else p.loss_mask.tolist(),
            p.awaiting_env,
            p.version,
            p.rollout_id,
        )
    return out


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_a_batch_folds_exactly_as_its_entries_sent_as_chunks(seed: int, masked: bool):
    rng = random.Random(seed)
    chunks = random_chunks(rng, masked)
    one, batched = PartialPool(), PartialPool()
    removed = set()
    i = 0
    while i < len(chunks):
        k = rng.randint(1, 40)
        part = chunks[i : i + k]
        for c in part:
            one.apply(copy_chunk(c))
        # through the codec, as the buffer gets it
        got = decode(encode(as_batch([copy_chunk(c) for c in part])))
        assert isinstance(got, PartialBatch)
        batched.apply_batch(got)
        i += k
        if rng.random() < 0.2 and one.records:  # a trajectory finished in between
            uid = rng.choice(sorted(one.records))
            assert one.remove(uid) == batched.remove(uid)
            removed.add(uid)
        assert snapshot(one) == snapshot(batched)  # also compacts: the next batches fold on top
    c1, c2 = Counter(one.counts), Counter(batched.counts)
    assert c2.pop("batches") > 1
    assert c1 == c2 and c1["gaps"] and c1["overlaps"] and c1["headers"] and c1["unknown"]
    assert one.tokens == batched.tokens > 0


def runs_of(rng: random.Random, chunks: list[PartialChunk], mixed: bool) -> list[list[Any]]:
    """The chunks as batches from two senders: runs of one sender (and, mixed, of masked or
    unmasked entries), each cut into batches of 1-40 entries."""
    out: list[list[Any]] = []
    sender, masked = "r0", True
    for c in chunks:
        if rng.random() < 0.1:
            sender = "r1" if sender == "r0" else "r0"
        if mixed and rng.random() < 0.1:
            masked = not masked
        c.rollout_id = sender
        if mixed and not masked:
            c.loss_mask = None
        if (
            not out
            or out[-1][0] != sender
            or (out[-1][1][-1].loss_mask is None) != (c.loss_mask is None)
            or len(out[-1][1]) >= rng.randint(1, 40)
        ):
            out.append([sender, []])
        out[-1][1].append(c)
    return out


@pytest.mark.parametrize("masked", ["no", "yes", "mixed"])
@pytest.mark.parametrize("seed", range(4))
def test_a_senders_stream_folds_exactly_as_its_entries_sent_as_chunks(
    seed: int, masked: str, monkeypatch: pytest.MonkeyPatch
):
    """From an authenticated sender, entries that continue the sender's records take the
    stream's fast path (the window's columns kept once, the record's slot checked); what any
    query, removal or other entry sees is still exactly the per-chunk fold."""
    monkeypatch.setattr(records_mod, "SEGS_MAX", 4)  # the streams merge every few batches
    merges = Counter[str]()
    merge = records_mod.SenderStream.merge

    def counted(self: Any) -> None:
        merges["n"] += 1
        merge(self)

    monkeypatch.setattr(records_mod.SenderStream, "merge", counted)
    rng = random.Random(seed)
    chunks = random_chunks(rng, masked != "no", n=1500)
    one, batched = PartialPool(), PartialPool()
    for sender, part in runs_of(rng, chunks, masked == "mixed"):
        want = Counter(one.apply(copy_chunk(c), sender) for c in part)
        del want["appended"]
        got = decode(encode(as_batch([copy_chunk(c) for c in part])))
        assert isinstance(got, PartialBatch)
        got.rollout_id = sender
        assert batched.apply_batch(got, sender) == want
        if rng.random() < 0.15 and one.records:  # a trajectory finished in between
            uid = rng.choice(sorted(one.records))
            assert one.remove(uid) == batched.remove(uid)
        assert one.tokens == batched.tokens
        for st in batched.streams.values():  # what a stream holds: its records' tokens, bounded
            assert st.tokens == sum(e[1] - e[5] for e in st.live.values()) <= st.held
            assert len(st.segs) <= 4 and st.held <= 2 * st.tokens + records_mod.HELD_SLACK
        if rng.random() < 0.1:  # a recovery or a repack reads some records (out of the stream)
            some = rng.sample(sorted(one.records), min(3, len(one.records)))
            assert snap(one, some + some[:1]) == snap(batched, some + some[:1])  # one named twice
    assert snapshot(one) == snapshot(batched)
    c1, c2 = Counter(one.counts), Counter(batched.counts)
    assert c2.pop("batches") > 1 and c1 == c2 and c1["gaps"] and c1["overlaps"]
    assert merges["n"] > 0 and sum(s.next_sid for s in batched.streams.values()) > 10


def test_a_senders_stream_holds_about_what_its_records_need(monkeypatch: pytest.MonkeyPatch):
    """Finished records leave their entries in the stream's stretches until a merge: the stream
    never holds more than twice its records' tokens (plus the slack), a merge keeps exactly
    theirs, and a stream whose records were all recovered (a dead rollout) holds nothing."""
    monkeypatch.setattr(records_mod, "HELD_SLACK", 0)
    pool = PartialPool()
    length = {f"g{k}/0": 0 for k in range(8)}
    serial = 8
    for _ in range(200):
        chunks = []
        for uid in list(length):
            if length[uid] >= 24 + 8 * (int(uid[1:].split("/")[0]) % 4):  # finished: a new one
                assert pool.remove(uid)
                del length[uid]
                uid = f"g{serial}/0"
                serial += 1
                length[uid] = 0
            off = length[uid]
            chunks.append(
                PartialChunk(
                    uid=uid,
                    version=0,
                    offset=off,
                    token_ids=np.arange(off, off + 4, dtype=np.int32),
                    logprobs=np.zeros(4, np.float32),
                    rollout_id="r0",
                    header=header(uid, 0, "r0") if off == 0 else None,
                )
            )
            length[uid] = off + 4
        assert not pool.apply_batch(as_batch(chunks), "r0")
        st = pool.streams["r0"]
        assert st.held <= 2 * st.tokens and pool.tokens == sum(length.values())
    assert serial > 40 and len(st.segs) < 50  # merged along the way
    recovered = {p.uid: p.response_ids.tolist() for p in pool.query("r0")}
    assert recovered == {u: list(range(n)) for u, n in length.items()}
    assert not st.live and not st.segs and st.held == 0


def test_resends_and_gaps_on_a_stream_take_nothing_out(monkeypatch: pytest.MonkeyPatch):
    """A gap, a duplicate, another version or an overlapping resend of a record on its sender's
    stream is decided from the slot: the record stays in the stream (taking it out scans the
    stream, which a peer sending such entries must not be able to make the buffer do per entry)."""
    taken = Counter[str]()
    take_many = records_mod.SenderStream.take_many

    def counted(self: Any, recs: list[Any]) -> None:
        taken["n"] += len(recs)
        take_many(self, recs)

    monkeypatch.setattr(records_mod.SenderStream, "take_many", counted)
    pool = PartialPool()

    def entry(off: int, k: int, version: int = 0, head: bool = False) -> PartialChunk:
        return PartialChunk(
            uid="g/0",
            version=version,
            offset=off,
            token_ids=np.arange(off, off + k, dtype=np.int32),
            logprobs=np.zeros(k, np.float32),
            rollout_id="r0",
            header=header("g/0", 0, "r0") if head else None,
        )

    pool.apply_batch(as_batch([entry(0, 4, head=True)]), "r0")
    pool.apply_batch(as_batch([entry(4, 4)]), "r0")  # joined: on the stream from here
    assert pool.records["g/0"].stream is not None and taken["n"] == 0
    got = pool.apply_batch(
        as_batch([entry(12, 2), entry(2, 3), entry(8, 2, version=1), entry(6, 6), entry(12, 0)]),
        "r0",
    )
    assert got == Counter(gap=1, duplicate=2, bad=1)  # the overlap (6..12) appended its 8..12
    assert taken["n"] == 0 and pool.records["g/0"].stream is not None
    assert pool.length("g/0") == 12
    (p,) = pool.query("r0")
    assert taken["n"] == 1 and p.response_ids.tolist() == list(range(12))
    assert pool.counts["gaps"] == pool.counts["overlaps"] == pool.counts["version_mismatch"] == 1


PIECES = 32


def test_records_copy_their_tokens_and_pin_no_batch():
    """A record copies its entries out of the batch: the received arrays are let go with the
    message, however many batches the record spans."""
    pool = PartialPool()
    uid = "g/0"
    pool.apply(
        PartialChunk(
            uid=uid,
            version=0,
            offset=0,
            token_ids=np.zeros(0, np.int32),
            logprobs=np.zeros(0, np.float32),
            rollout_id="r0",
            header=header(uid, 0, ""),
        )
    )
    frames = []
    for k in range(3 * PIECES):
        b = as_batch(
            [
                PartialChunk(
                    uid=uid,
                    version=0,
                    offset=2 * k,
                    token_ids=np.array([2 * k, 2 * k + 1], np.int32),
                    logprobs=np.full(2, -0.5, np.float32),
                    rollout_id="r0",
                )
            ]
        )
        assert not pool.apply_batch(b)
        frames.append(weakref.ref(b.token_ids))
        del b
    gc.collect()
    assert all(f() is None for f in frames)
    (p,) = pool.query("r0")
    assert p.response_ids.tolist() == list(range(6 * PIECES)) and p.response_ids.dtype == np.int32
    assert p.loss_mask is None and p.rollout_id == "r0" and pool.counts["chunks"] == 3 * PIECES


def test_a_malformed_batch_is_refused_whole_and_counted():
    pool = PartialPool()
    good = [
        PartialChunk(
            uid="g/0",
            version=0,
            offset=0,
            token_ids=np.arange(4, dtype=np.int32),
            logprobs=np.zeros(4, np.float32),
            rollout_id="r0",
            header=header("g/0", 0, "r0"),
        )
    ]

    def bad(**kw: Any) -> PartialBatch:
        b = as_batch([copy_chunk(c) for c in good])
        for k, v in kw.items():
            setattr(b, k, v)
        return b

    cases = [
        bad(lengths=np.array([5], np.int64)),  # tokens do not match the lengths
        bad(offsets=np.array([-1], np.int64)),
        bad(versions=np.array([0, 0], np.int64)),  # columns of different lengths
        bad(loss_mask=np.array([1, 1, 2, 1], np.uint8)),
        bad(loss_mask=np.array([1, 1], np.uint8)),
        bad(header_at=np.array([3], np.int64)),
        bad(header_at=None),
        bad(headers=[header("g/9", 0, "r0")]),  # a header of another uid
        bad(headers=[header("g/0", 7, "r0")]),  # of another version
    ]
    for b in cases:
        assert pool.apply_batch(b) == Counter(bad=1)
    assert len(pool) == 0 and pool.counts["bad"] + pool.counts["bad_loss_mask"] == len(cases)
    assert not pool.apply_batch(as_batch(good)) and pool.length("g/0") == 4


# ---- the rollout side -------------------------------------------------------------------------
class FakeBuffer:
    connected = True

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.fail = 0

    async def send(self, msg: Any) -> None:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("pipe full")
        self.sent.append(decode(encode(msg)))


def item(k: int) -> PromptItem:
    return PromptItem(uid=f"p{k}", group_id=f"g{k}", prompt_ids=np.arange(4, dtype=np.int32), n=1)


def deliverer(
    flush_s: float, buf: FakeBuffer, multi_turn: bool = False
) -> tuple[Deliverer, SequenceTable]:
    table = SequenceTable(
        engine=None,
        params=None,
        notify=(),
        multi_turn=multi_turn,
        metrics=Metrics(),
        log=get_logger(role="rollout", node_id="t"),
    )  # type: ignore[arg-type]
    d = Deliverer(
        "rollout-0",
        buf,  # type: ignore[arg-type]
        table,
        outbox=None,  # type: ignore[arg-type]
        latest_version=lambda: 3,
        rewards=None,
        tokenizer=None,
        spawn=None,  # type: ignore[arg-type]
        metrics=Metrics(),
        log=get_logger(role="rollout", node_id="t"),
        flush_s=flush_s,
    )
    return d, table


def add_seq(table: SequenceTable, k: int, multi_turn: bool = False) -> SeqState:
    seq = SeqState.from_item(item(k), 0, version=3, now=1.0, multi_turn=multi_turn)
    table.seqs[seq.uid] = seq
    return seq


async def test_the_deliverer_sends_one_batch_per_window_and_the_pool_rebuilds_each_sequence():
    buf = FakeBuffer()
    d, table = deliverer(0.2, buf, multi_turn=True)
    seqs = [add_seq(table, k, multi_turn=True) for k in range(5)]
    pool = PartialPool()
    task = asyncio.create_task(d.stream())
    try:
        for step in range(3):
            for s in seqs:
                s.append(
                    np.arange(7, dtype=np.int32) + 10 * step, np.full(7, -1.0, np.float32), 1.0
                )
                if step == 1 and s is seqs[0]:
                    s.append_env(np.array([99, 98], np.int32))
                    s.awaiting_env = True
                table.mark_dirty(s.uid)
            async with asyncio.timeout(5):
                while len(buf.sent) < step + 1:
                    await asyncio.sleep(0.01)
        # three windows: three messages, each with every sequence, headers only in the first
        assert len(buf.sent) == 3 and all(
            isinstance(m, PartialBatch) and len(m.uids) == 5 for m in buf.sent
        )
        assert [len(m.headers) for m in buf.sent] == [5, 0, 0]
        for m in buf.sent:
            assert not pool.apply_batch(m)
    finally:
        task.cancel()
    for s in seqs:
        (p,) = pool.query(uids=[s.uid])
        assert p.response_ids.tolist() == s.ids.copy().tolist() and p.version == 3
        assert (
            s.mask is not None
            and p.loss_mask is not None
            and p.loss_mask.tolist() == s.mask.copy().tolist()
        )
        assert (
            p.awaiting_env == s.awaiting_env
            and s.sent_upto == s.length
            and p.rollout_id == "rollout-0"
        )
    assert d.metrics.counters["partial_batches"] == 3 and d.metrics.counters["partial_chunks"] == 15


async def test_a_failed_send_keeps_the_marks_and_the_next_flush_resends():
    buf = FakeBuffer()
    d, table = deliverer(0.0, buf)
    seqs = [add_seq(table, k) for k in range(3)]
    for s in seqs:
        s.append(np.arange(4, dtype=np.int32), np.zeros(4, np.float32), 1.0)
        table.mark_dirty(s.uid)
    buf.fail = 1
    await d.flush_partials()
    assert (
        not buf.sent
        and table.unsent == {s.uid for s in seqs}
        and all(s.sent_upto == 0 for s in seqs)
    )
    await d.flush_partials()
    (m,) = buf.sent
    assert sorted(m.uids) == sorted(table.unsent | {s.uid for s in seqs}) and len(m.headers) == 3
    assert not table.unsent and all(s.sent_upto == 4 for s in seqs)
    await d.flush_partials()  # nothing new: nothing sent
    assert len(buf.sent) == 1


def test_a_large_flush_is_split_by_size():
    table_seqs = []
    for k in range(4):
        s = SeqState.from_item(item(k), 0, version=0, now=1.0)
        s.append(np.arange(100, dtype=np.int32), np.zeros(100, np.float32), 1.0)
        table_seqs.append(s)
    buf = FakeBuffer()
    d, table = deliverer(0.0, buf)
    d.max_batch_bytes = 2 * (100 * 9 + 64 + 4 * 4 + 512)  # two sequences with their headers
    for s in table_seqs:
        table.seqs[s.uid] = s
        table.mark_dirty(s.uid)
    asyncio.run(d.flush_partials())
    assert [len(m.uids) for m in buf.sent] == [2, 2]
    pool = PartialPool()
    for m in buf.sent:
        pool.apply_batch(m)
    assert pool.tokens == 400


def test_partial_batch_of_nothing_new_is_an_empty_entry_with_its_flag():
    s = SeqState.from_item(item(0), 0, version=0, now=1.0, multi_turn=True)
    s.append(np.arange(3, dtype=np.int32), np.zeros(3, np.float32), 1.0)
    s.sent_upto = 3
    s.awaiting_env = True
    msg, upto = partial_batch([s], "rollout-0")
    assert upto == [3] and msg.lengths.tolist() == [0] and msg.offsets.tolist() == [3]
    assert msg.awaiting_env.tolist() == [1] and msg.header_at is None and len(msg.token_ids) == 0


def test_the_control_plane_bench_drives_the_configured_flush_window():
    import importlib.util
    from pathlib import Path

    from laminar.config import RolloutConfig

    path = Path(__file__).resolve().parents[1] / "bench/cp_workload.py"
    spec = importlib.util.spec_from_file_location("cp_workload", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ro = RolloutConfig()
    assert mod.FLUSH_S == ro.partial_flush_s and mod.CHUNK_TOKENS == ro.partial_chunk_tokens
    assert mod.STATUS_PUSH_MIN_S == ro.status_push_min_s
