"""Buffer node over inproc (a manager and a buffer node in this process, RpcClients as
rollouts/trainer).

    .venv/bin/python -m pytest tests/test_buffer_node.py -q

Covers: prompts -> trajectories -> batches -> commits, trainer-crash semantics (requeue,
exactly-once, also across a buffer restart), back-pressure, the staleness bound with fake rollouts
in every mode, the partial pool and recovery query, bad input, the prompt cursor across restarts,
long-poll wakeup. The kill -9 test with real processes is tests/test_buffer_process.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from laminar.buffer.node import BufferNode
from laminar.config import config_from_dict
from laminar.protocol.buffer import (
    DELIVERIES_MAX_ITEMS,
    BatchCommit,
    BatchReply,
    BatchRequest,
    BufferStats,
    BufferStatsRequest,
    CommitAck,
    Deliveries,
    DeliveryAcks,
    PartialsRequest,
    PromptReply,
    PromptRequest,
    TrajectoryAbandoned,
    TrajectoryAck,
)
from laminar.protocol.data import PartialChunk, PromptItem, Trajectory
from laminar.transport.client import RpcClient
from laminar.transport.sockets import RemoteError, new_context
from laminar.wiring.common import socket_options
from laminar.wiring.nodes import build_node
from tests.pool_entries import first_entry
from tests.serving import serving_rollout, until_members

N, B = 2, 2


def make_cfg(tmp: Path, rows: int = 20, transport: str = "inproc", **sections):
    data = tmp / "train.jsonl"
    if not data.exists():
        data.write_text(
            "".join(
                json.dumps({"prompt": f"{i}+{i}?", "answer": str(2 * i)}) + "\n"
                for i in range(rows)
            )
        )
    base = {
        "name": f"bt{uuid.uuid4().hex[:8]}",
        "run_dir": str(tmp / "run"),
        "mode": "laminar",
        # restart tests use ipc: an inproc name stays taken until zmq reaps the closed socket
        "cluster": {
            "transport": transport,
            "ipc_dir": tempfile.mkdtemp(prefix="lamb-", dir="/tmp"),
            # fake rollouts r0, r1, ... are none of the run's own ids (rollout-0, rollout-1)
            "max_rollouts": 8,
        },
        "transport": {
            "heartbeat_interval_s": 0.05,
            "heartbeat_liveness": 20,
            "handshake_timeout_s": 1.0,
            "request_timeout_s": 5.0,
            "request_retries": 0,
            "stop_timeout_s": 2.0,
        },
        "data": {"train": str(data), "seed": 1},
        "rollout": {"group_size": N},
        "trainer": {"batch_groups": B},
        "buffer": {"fsync": "batch"},
    }
    for key, val in sections.items():
        if isinstance(val, dict):
            base.setdefault(key, {}).update(val)
        else:
            base[key] = val
    return config_from_dict(base)


class Harness:
    """A manager + a buffer node on one zmq context; clients speak to the buffer like rollouts
    do."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.ctx = new_context()
        self.tasks: list[asyncio.Task] = []
        self.clients: list[RpcClient] = []
        self.rollouts: list[str] = []
        """Client ids that beat to the manager as serving rollouts (tests/serving.py)."""
        self.buffer: BufferNode | None = None
        self._buffer_task: asyncio.Task | None = None

    async def _start(self, node):
        task = asyncio.create_task(node.run())
        ready = asyncio.create_task(node.ready.wait())
        done, _ = await asyncio.wait({task, ready}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert ready in done, task.result() if task.done() else "node not ready in 30 s"
        return task

    async def start(self) -> Harness:
        self.manager = build_node(self.cfg, "manager", ctx=self.ctx)
        self.tasks.append(await self._start(self.manager))
        await self.start_buffer()
        return self

    async def start_buffer(self) -> BufferNode:
        self.buffer = build_node(self.cfg, "buffer", ctx=self.ctx)
        self._buffer_task = await self._start(self.buffer)
        await until_members(self.buffer, self.rollouts)
        return self.buffer

    async def stop_buffer(self) -> None:
        self.buffer.request_stop("test restart")
        await asyncio.wait_for(self._buffer_task, 10)

    async def client(self, name: str, role: str = "rollout") -> RpcClient:
        opts = socket_options(self.cfg)
        cli = RpcClient(self.ctx, self.cfg.endpoint("buffer"), name, role, opts)
        await cli.connect(timeout=5)
        self.clients.append(cli)
        if role == "rollout" and name not in self.rollouts:
            self.clients.append(await serving_rollout(self.ctx, self.cfg, name, opts))
            self.rollouts.append(name)
            assert self.buffer is not None
            await until_members(self.buffer, [name])
        return cli

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
        if self.buffer is not None and not self._buffer_task.done():
            await self.stop_buffer()
        self.manager.request_stop("test over")
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.cfg.ipc_dir(), ignore_errors=True)


@pytest.fixture
async def harness(tmp_path):
    made: list[Harness] = []

    async def make(**sections) -> Harness:
        h = await Harness(make_cfg(tmp_path, **sections)).start()
        made.append(h)
        return h

    yield make
    for h in made:
        await h.close()


def finished(
    item: PromptItem,
    i: int,
    version: int,
    reward: float | None = 1.0,
    rollout: str = "r0",
    tokens: int = 3,
) -> Trajectory:
    ids = np.arange(tokens, dtype=np.int32) + i
    return Trajectory(
        uid=f"{item.group_id}/{i}",
        group_id=item.group_id,
        prompt_uid=item.uid,
        sample_index=i,
        prompt_ids=item.prompt_ids,
        response_ids=ids,
        logprobs=np.full(tokens, -1.0, np.float32),
        version=version,
        reward=reward,
        rollout_id=rollout,
        prompt=item.prompt,
        row=item.row,
    )


async def prompts(
    cli: RpcClient, k: int, version: int = 0, rid: str | None = None, **kw
) -> PromptReply:
    """A PromptRequest from `cli`, whose id it names unless `rid` says otherwise."""
    rid = cli.node_id if rid is None else rid
    reply = await cli.request(PromptRequest(rollout_id=rid, max_groups=k, version=version, **kw))
    assert isinstance(reply, PromptReply)
    return reply


async def complete(
    cli: RpcClient, items: list[PromptItem], version: int = 0, tokens: int = 3
) -> None:
    for it in items:
        for i in range(it.n):
            assert isinstance(
                await cli.request(finished(it, i, version, tokens=tokens)), TrajectoryAck
            )


async def batch(
    cli: RpcClient, version: int, wait_s: float = 0.0, restart: bool = False, groups: int = B
) -> BatchReply:
    reply = await cli.request(
        BatchRequest(
            trainer_id=cli.node_id,
            groups=groups,
            trainer_version=version,
            wait_s=wait_s,
            restart=restart,
        )
    )
    assert isinstance(reply, BatchReply)
    return reply


def group_ids(reply: BatchReply) -> list[str]:
    return sorted({t.group_id for t in reply.trajectories})


async def stats(cli: RpcClient) -> BufferStats:
    reply = await cli.request(BufferStatsRequest())
    assert isinstance(reply, BufferStats)
    return reply


async def test_prompts_trajectories_batch_commit(harness):
    h = await harness()
    ro, tr = await h.client("r0"), await h.client("t0", "trainer")
    rep = await prompts(ro, 3)
    assert len(rep.items) == 3 and all(it.n == N for it in rep.items) and rep.min_version == -1
    assert len({it.group_id for it in rep.items}) == 3 and rep.items[0].row["answer"]
    assert (
        rep.items[0].prompt_ids.dtype == np.int32
        and bytes(rep.items[0].prompt_ids.tolist()).decode() == rep.items[0].prompt
    )
    empty = await batch(tr, 0)
    assert empty.trajectories == [] and empty.wait == "not_enough"
    await complete(ro, rep.items)
    dup = await ro.request(finished(rep.items[0], 0, 0))
    assert isinstance(dup, TrajectoryAck) and dup.duplicate
    b = await batch(tr, 0)
    assert (
        b.batch_id
        and len(b.trajectories) == B * N
        and group_ids(b) == sorted(it.group_id for it in rep.items[:B])
    )
    assert b.staleness is not None and b.staleness.max == 0 and b.version == 0
    ack = await tr.request(BatchCommit(batch_id=b.batch_id, step=1, version=1))
    assert isinstance(ack, CommitAck) and ack.ok
    again = await tr.request(BatchCommit(batch_id=b.batch_id, step=1, version=1))
    assert again.ok and again.duplicate  # idempotent
    s = await stats(tr)
    assert s.counts["groups_committed"] == B and s.held == N and s.counts["trajectories"] == 3 * N
    assert s.staleness_consumed.count == B * N and s.trainer_version == 1
    st = h.buffer.status()
    assert st.version == 1 and st.extra["groups_ready"] == 1 and st.extra["held"] == N


async def test_trainer_restart_requeues_and_commits_are_never_served_again(harness):
    h = await harness(rows=8, transport="ipc")
    ro, tr = await h.client("r0"), await h.client("t0", "trainer")
    items = (await prompts(ro, 4)).items
    await complete(ro, items)
    first = await batch(tr, 0)
    # the trainer dies before committing; its replacement says restart=True
    second = await batch(tr, 0, restart=True)
    assert group_ids(second) == group_ids(first) and second.batch_id != first.batch_id
    assert second.requeued_groups == B
    late = await tr.request(BatchCommit(batch_id=first.batch_id, step=1, version=1))
    assert late.ok is False and "restart" in late.reason  # the dead trainer's batch
    assert (await tr.request(BatchCommit(batch_id=second.batch_id, step=1, version=1))).ok
    third = await batch(tr, 1)
    assert set(group_ids(third)).isdisjoint(group_ids(second))
    # across a buffer restart: the uncommitted third batch comes back, committed groups never do
    await h.stop_buffer()
    await h.start_buffer()
    tr2 = await h.client("t0b", "trainer")
    again = await batch(tr2, 1, restart=True)
    assert group_ids(again) == group_ids(third)
    assert (await tr2.request(BatchCommit(batch_id=again.batch_id, step=2, version=2))).ok
    dup = await tr2.request(BatchCommit(batch_id=second.batch_id, step=1, version=1))
    assert dup.ok and dup.duplicate
    with pytest.raises(RemoteError, match="unknown_batch"):
        await tr2.request(BatchCommit(batch_id="b-nonexistent", step=3, version=3))
    assert (await batch(tr2, 2)).trajectories == []  # all four groups consumed exactly once
    ro2 = await h.client("r0b")
    # a rollout resending after the restart
    resent = await ro2.request(finished(items[0], 0, 0, rollout="r0b"))
    assert resent.ignored and not resent.duplicate
    s = await stats(tr2)
    assert s.counts["groups_committed"] == 4 and s.held == 0 and s.counts["batches_requeued"] == 2


async def test_full_buffer_stops_serving_prompts(harness):
    h = await harness(buffer={"capacity": 2 * N})
    ro, tr = await h.client("r0"), await h.client("t0", "trainer")
    items = (await prompts(ro, 5)).items
    assert len(items) == 2  # room for two groups of N
    full = await prompts(ro, 1)
    assert full.items == [] and full.reason == "full" and full.retry_after_s > 0
    await complete(ro, items)
    assert (await prompts(ro, 1)).reason == "full"  # finished but unconsumed still counts
    b = await batch(tr, 0)
    assert (await prompts(ro, 1)).reason == "full"  # served but uncommitted still counts
    await tr.request(BatchCommit(batch_id=b.batch_id, step=1, version=1))
    assert len((await prompts(ro, 5)).items) == 2
    assert (await stats(tr)).counters["prompts_refused_full"] == 3


@pytest.mark.parametrize(
    "mode,bound,limit",
    [
        ("laminar", 1, 1),
        ("laminar", 0, 0),
        ("sync", None, 0),
        ("one_step", None, 1),
        ("stream", None, 1),
    ],
)
async def test_staleness_bound_with_fake_rollouts(harness, mode, bound, limit):
    """Rollouts at lagging versions, long-tailed sample times; no consumed trajectory is staler than
    the bound."""
    h = await harness(rows=200, mode=mode, buffer={"max_staleness": bound})
    trainer_cli = await h.client("t0", "trainer")
    published = {"v": 0}
    steps, seen = 8, []

    async def rollout(rid: str, seed: int) -> None:
        rng = random.Random(seed)
        cli = await h.client(rid)
        version = 0
        while published["v"] < steps:
            if rng.random() < 0.3:
                version = published["v"]  # idle: pull the newest weights (sometimes)
            rep = await prompts(cli, rng.randint(1, 2), version, rid)
            if rep.reason == "need_version":
                version = max(version, min(rep.min_version, published["v"]))
            if not rep.items:
                await asyncio.sleep(0.005)  # retry_after, shortened
                continue
            for it in rep.items:
                for i in range(it.n):
                    await asyncio.sleep(
                        rng.expovariate(1 / 0.004) * (10 if rng.random() < 0.1 else 1)
                    )  # generation
                    await cli.request(finished(it, i, version, rollout=rid))

    async def trainer() -> None:
        v = 0
        while v < steps:
            b = await batch(trainer_cli, v, wait_s=0.5)
            if not b.trajectories:
                continue
            seen.extend(b.version - t.version for t in b.trajectories)
            assert b.staleness is not None and b.staleness.max <= limit, b.staleness
            v = b.version + 1
            await trainer_cli.request(BatchCommit(batch_id=b.batch_id, step=v, version=v))
            published["v"] = v

    workers = [asyncio.create_task(rollout(f"r{i}", i)) for i in range(3)]
    await asyncio.wait_for(trainer(), 60)
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    s = await stats(trainer_cli)
    assert len(seen) >= steps * B * N - steps and max(seen) <= limit
    assert s.staleness_consumed.max <= limit and s.counts.get("groups_dropped", 0) == 0


async def test_partial_pool_and_recovery_query(harness):
    h = await harness()
    ro, mgr = await h.client("r0"), await h.client("m0", "manager")
    item = (await prompts(ro, 1, rid="r0")).items[0]
    uid = f"{item.group_id}/0"

    def chunk(offset, ids):
        return PartialChunk(
            uid=uid,
            version=0,
            offset=offset,
            token_ids=np.asarray(ids, np.int32),
            logprobs=np.full(len(ids), -0.1, np.float32),
            rollout_id="r0",
        )

    await ro.send(first_entry(item, 0, "r0", [1, 2, 3]))
    await ro.send(chunk(3, [4, 5]))
    await ro.send(chunk(2, [3, 4, 5, 6]))  # overlap: only 6 is new
    await ro.send(chunk(4, [5]))  # duplicate
    await ro.send(chunk(9, [9]))  # gap: ignored
    # the manager asks (only it may), on another socket: until the one-way chunks are in
    deadline = time.monotonic() + 5
    while True:
        reply = await mgr.request(PartialsRequest(rollout_id="r0"))
        by_uid = {p.uid: p for p in reply.partials}
        if (uid in by_uid and len(by_uid[uid].response_ids) == 6) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)  # poll interval of a deadline-bounded wait
    assert by_uid[uid].response_ids.tolist() == [1, 2, 3, 4, 5, 6] and by_uid[
        uid
    ].logprobs.shape == (6,)
    assert by_uid[f"{item.group_id}/1"].response_ids.tolist() == []  # handed out, not started
    assert by_uid[f"{item.group_id}/1"].prompt_ids.tolist() == item.prompt_ids.tolist()
    assert (await mgr.request(PartialsRequest(uids=[uid]))).partials[0].uid == uid
    assert (await mgr.request(PartialsRequest(rollout_id="other"))).partials == []
    await ro.request(finished(item, 0, 0))
    await ro.request(
        TrajectoryAbandoned(uid=f"{item.group_id}/1", group_id=item.group_id, reason="test")
    )
    assert (await mgr.request(PartialsRequest(rollout_id="r0"))).partials == []
    s = await stats(mgr)
    assert s.partials["gaps"] == 1 and s.partials["duplicates"] == 1 and s.partials["overlaps"] == 1
    assert (
        s.counts["groups_ready"] == 1 and s.counts["abandoned"] == 1
    )  # release_partial: released with one member


async def test_bad_input_is_rejected_and_counted(harness):
    h = await harness()
    ro, tr = await h.client("r0"), await h.client("t0", "trainer")
    item = (await prompts(ro, 1)).items[0]
    bad = finished(item, 0, 0)
    bad.logprobs = np.zeros(1, np.float32)
    with pytest.raises(RemoteError, match="protocol"):
        await ro.request(bad)
    with pytest.raises(RemoteError, match="outside group"):
        await ro.request(finished(item, 7, 0))
    with pytest.raises(RemoteError, match="protocol"):
        await ro.request(TrajectoryAbandoned(uid="nonsense", group_id=item.group_id))
    with pytest.raises(RemoteError, match="protocol"):
        await tr.request(BatchRequest(trainer_id="t0", groups=0, trainer_version=0))
    await ro.send(
        PartialChunk(
            uid="nobody/0",
            version=0,
            offset=3,
            token_ids=np.zeros(1, np.int32),
            logprobs=np.zeros(1, np.float32),
            rollout_id="r0",
        )
    )
    s = await stats(tr)
    assert s.counters["trajectories_rejected"] == 2 and s.partials["unknown"] == 1
    assert isinstance(await ro.request(finished(item, 0, 0)), TrajectoryAck)  # still serving


@pytest.mark.parametrize("fsync", ["batch", "always"])
async def test_deliveries_answer_each_item_as_it_would_be_answered_alone(harness, fsync):
    """One Deliveries with a duplicate, a new sample, a malformed one, another rollout's and an
    abandon: one ack each, in order, as each would get alone (fsync=always: once durable)."""
    h = await harness(buffer={"fsync": fsync})
    ro, other, tr = await h.client("r0"), await h.client("r1"), await h.client("t0", "trainer")
    a, b = (await prompts(ro, 2)).items
    (c,) = (await prompts(other, 1)).items
    assert isinstance(await ro.request(finished(a, 0, 0)), TrajectoryAck)
    bad = finished(b, 0, 0)
    bad.logprobs = np.zeros(1, np.float32)
    reply = await ro.request(
        Deliveries(
            trajectories=[finished(a, 0, 0), finished(a, 1, 0), bad, finished(c, 0, 0)],
            abandoned=[TrajectoryAbandoned(uid=f"{b.group_id}/1", group_id=b.group_id)],
        )
    )
    assert isinstance(reply, DeliveryAcks)
    dup, new, rejected, theirs, abandon = reply.acks
    assert dup == TrajectoryAck(duplicate=True) and new == TrajectoryAck()
    assert rejected.rejected and not rejected.refused
    assert theirs == TrajectoryAck(refused="not_owner") and abandon == TrajectoryAck()
    s = await stats(tr)
    assert s.counts["groups_ready"] == 1  # a's two members
    assert s.counters["trajectories_rejected"] == 1 and s.refused["r0"] == {"not_owner": 1}
    assert s.counts["abandoned"] == 1
    too_many = Deliveries(
        abandoned=[
            TrajectoryAbandoned(uid=f"{b.group_id}/0", group_id=b.group_id)
            for _ in range(DELIVERIES_MAX_ITEMS + 1)
        ]
    )
    with pytest.raises(RemoteError, match="protocol"):
        await ro.request(too_many)
    assert (await stats(tr)).counts["abandoned"] == 1  # nothing of it was taken


async def test_prompt_cursor_and_state_survive_restart(harness):
    h = await harness(rows=5, transport="ipc")
    ro = await h.client("r0")
    first = (await prompts(ro, 3, request_id="q1")).items
    retry = (await prompts(ro, 3, request_id="q1")).items  # the reply was lost: same groups again
    assert [it.group_id for it in retry] == [it.group_id for it in first]
    await complete(ro, first[:1])
    await h.stop_buffer()
    await h.start_buffer()
    ro2 = await h.client("r0b")
    after = (await prompts(ro2, 4)).items
    ids = [it.group_id for it in first + after]
    assert [int(g.rsplit("#", 1)[1]) for g in ids] == list(range(7)) and len(set(ids)) == 7
    uids = [it.uid for it in first + after]
    assert len(set(uids[:5])) == 5 and after[-1].group_id.split("@")[1].startswith(
        "1#"
    )  # epoch 1 began
    s = await stats(await h.client("t0", "trainer"))
    assert s.held == N and s.counts["groups_ready"] == 1 and s.pending == 6 * N


async def test_long_poll_wakes_when_a_group_completes(harness):
    h = await harness(trainer={"batch_groups": 1})
    ro, tr = await h.client("r0"), await h.client("t0", "trainer")
    item = (await prompts(ro, 1)).items[0]
    await ro.request(finished(item, 0, 0))
    t0 = time.monotonic()
    pending = asyncio.ensure_future(batch(tr, 0, wait_s=4.0, groups=1))
    await ro.request(finished(item, 1, 0))
    b = await pending
    assert len(b.trajectories) == N and time.monotonic() - t0 < 2.0


async def test_journal_compaction_keeps_the_live_state(harness):
    h = await harness(
        rows=40,
        transport="ipc",
        # ~16 KiB per trajectory, 4 a step: the file passes 160 KiB in the third step, after two
        # batches were committed, so the first compaction drops those (~130 KiB) whenever it
        # runs. (At 64 KiB it began in the first step, before any commit, and when it was slow
        # it took the whole test's appends into its tail and dropped nothing.)
        buffer={"compact_bytes": 160 << 10},
        rollout={"sampling": {"max_tokens": 2000}},  # longer responses are refused
    )
    ro, tr = await h.client("r0"), await h.client("t0", "trainer")
    for step in range(4):
        await complete(ro, (await prompts(ro, B)).items, tokens=2000)
        b = await batch(tr, step)
        await tr.request(BatchCommit(batch_id=b.batch_id, step=step + 1, version=step + 1))
    await complete(ro, (await prompts(ro, B + 1)).items, tokens=2000)
    outstanding = await batch(tr, 4)

    # a compaction runs beside the traffic (its snapshot written on the journal's thread; no ack
    # waits for it), so it may still be running here: wait until it finished
    def compacted(s: BufferStats) -> bool:
        j = s.journal
        return s.counters.get("compactions", 0) >= 1 and j is not None and j.size < j.bytes

    deadline = time.monotonic() + 20.0
    while not compacted(before := await stats(tr)):
        assert time.monotonic() < deadline, f"no compaction dropped the committed groups: {before}"
        await asyncio.sleep(0.05)  # polling the buffer's own figures, bounded by the deadline
    await h.stop_buffer()
    await h.start_buffer()
    tr2 = await h.client("t0b", "trainer")
    after = await stats(tr2)
    for key in ("held", "groups_ready", "groups_outstanding", "trainer_version"):
        assert getattr(after, key) == getattr(before, key), key
    for key in ("groups_ready", "groups_committed", "trajectories"):
        assert after.counts[key] == before.counts[key], key
    assert after.staleness_consumed == before.staleness_consumed
    assert after.prompts is not None and before.prompts is not None
    assert after.prompts.serial == before.prompts.serial
    again = await batch(tr2, 4, restart=True)
    assert group_ids(again) == group_ids(outstanding)
    assert (await tr2.request(BatchCommit(batch_id=again.batch_id, step=5, version=5))).ok
    assert (await stats(tr2)).counts["groups_committed"] == 5 * B


async def test_epochs_done_gives_a_short_last_batch_then_exhausted(harness):
    h = await harness(rows=3, data={"epochs": 1})
    ro, tr = await h.client("r0"), await h.client("t0", "trainer")
    items = (await prompts(ro, 5)).items
    assert len(items) == 3
    done = await prompts(ro, 1)
    assert done.items == [] and done.reason == "epochs_done"
    await complete(ro, items)
    first = await batch(tr, 0)
    assert len(group_ids(first)) == B
    assert (await tr.request(BatchCommit(batch_id=first.batch_id, step=1, version=1))).ok
    last = await batch(tr, 1)
    assert len(group_ids(last)) == 1  # the data ran out: a shorter final batch
    assert (await batch(tr, 2)).exhausted is False  # outstanding until committed
    assert (await tr.request(BatchCommit(batch_id=last.batch_id, step=2, version=2))).ok
    assert (await batch(tr, 2)).exhausted is True


async def test_prompts_use_the_model_tokenizer_and_chat_template(harness, tmp_path):
    from laminar.models.tiny import char_tokenizer, load_tokenizer

    tok = char_tokenizer("0123456789+?=:abcdefghijklmnopqrstuvwxyz \n")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}assistant:"
    )
    tok.save_pretrained(tmp_path / "tok")
    h = await harness(model={"path": str(tmp_path / "tok")}, data={"max_prompt_tokens": 20})
    ro = await h.client("r0")
    item = (await prompts(ro, 1)).items[0]
    assert (
        load_tokenizer(tmp_path / "tok").decode(item.prompt_ids)
        == f"user:{item.prompt}\nassistant:"
    )
