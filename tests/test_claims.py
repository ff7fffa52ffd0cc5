"""Only what was served comes back, and claims are bounded (issue 29, deliverables 3 and 5).

    .venv/bin/python -m pytest tests/test_claims.py -q

A buffer node over inproc (tests/test_buffer_node.py's harness) with clients as rollouts and a
manager: a trajectory, abandon or partial entry is taken only from the rollout its sample was
served (or placed) to, with a reward in reward.min_value..max_value and token ids in the
vocabulary; refusals are acked as such, counted per peer and reason and never trained. A
PromptRequest leases at most the rollout's share; a status claiming 3,000,000 in-flight samples
makes the manager's repack round build no more than the configured bound.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import structlog
from pydantic import ValidationError

from laminar.buffer.members import Members
from laminar.config import RewardConfig, config_from_dict
from laminar.manager.moves import Repacker
from laminar.manager.placement import ORPHAN, Placer
from laminar.manager.repack import Move
from laminar.metrics import Metrics
from laminar.protocol.buffer import (
    PartialsRequest,
    SamplesPlaced,
    TrajectoryAbandoned,
    TrajectoryAck,
)
from laminar.protocol.core import NodeStatus
from laminar.protocol.data import PartialChunk, PartialTrajectory, PromptItem
from laminar.protocol.rollout import (
    VERSION_MISMATCH,
    ExportReply,
    ExportRequest,
    ImportReply,
    ImportRequest,
    RolloutStatus,
)
from laminar.rollout.outbox import Outbox
from laminar.transport.client import RpcClient
from laminar.transport.session import Ack, StatusCodec
from laminar.transport.sockets import Peer, RemoteError
from tests import test_buffer_node
from tests.pool_entries import first_entry
from tests.test_buffer_node import N, batch, finished, prompts, stats

SIM = {"rollout": {"group_size": N, "engine": "sim"}}
"""A sim engine without a model: token ids lie below rollout.sim.vocab_size (32000)."""


harness = test_buffer_node.harness
"""A manager + a buffer node of the given sections (tests/test_buffer_node.py's fixture)."""


async def test_never_served_group_is_refused_and_not_trained(harness):
    h = await harness(**SIM)
    ro, tr = await h.client("r0"), await h.client("t0", "trainer")
    item = (await prompts(ro, 1)).items[0]
    forged = finished(item, 0, 0)
    forged.group_id = forged.prompt_uid + "@0#999"  # a group nobody was served
    forged.uid = f"{forged.group_id}/0"
    ack = await ro.request(forged)
    assert isinstance(ack, TrajectoryAck) and ack.refused == "not_served"
    gone = TrajectoryAbandoned(uid=forged.uid, group_id=forged.group_id)
    assert (await ro.request(gone)).ignored  # abandoning what does not exist changes nothing
    s = await stats(tr)
    assert s.refused == {"r0": {"not_served": 1}}
    assert s.counts.get("trajectories", 0) == 0 and s.groups_ready == 0
    assert (await batch(tr, 0)).trajectories == []


async def test_another_rollouts_sample_is_refused_and_the_owners_copy_taken(harness):
    h = await harness(**SIM)
    r0, r1, tr = await h.client("r0"), await h.client("r1"), await h.client("t0", "trainer")
    items = (await prompts(r0, 2, rid="r0")).items
    stolen = finished(items[0], 0, 0, reward=1.0, rollout="r1")
    ack = await r1.request(stolen)
    assert isinstance(ack, TrajectoryAck) and ack.refused == "not_owner"
    # an abandon of another rollout's sample is refused too (the group stays whole)
    gone = TrajectoryAbandoned(uid=f"{items[0].group_id}/1", group_id=items[0].group_id)
    assert (await r1.request(gone)).refused == "not_owner"
    for it in items:  # the real owner's copies: taken, not refused as duplicates
        for i in range(it.n):
            own = await r0.request(finished(it, i, 0, reward=0.25 * i))
            assert isinstance(own, TrajectoryAck) and not (own.refused or own.duplicate)
    b = await batch(tr, 0)
    assert len(b.trajectories) == 2 * N and {t.rollout_id for t in b.trajectories} == {"r0"}
    assert sorted(t.reward for t in b.trajectories) == sorted([0.25 * i for i in range(N)] * 2)
    s = await stats(tr)
    assert s.refused == {"r1": {"not_owner": 2}} and s.counters["refused_not_owner"] == 2


async def test_rewards_out_of_range_or_not_finite_are_refused(harness):
    h = await harness(**SIM)
    ro, tr = await h.client("r0"), await h.client("t0", "trainer")
    item = (await prompts(ro, 1)).items[0]
    for bad in (1e6, -11.0, math.nan, math.inf):
        ack = await ro.request(finished(item, 0, 0, reward=bad))
        assert ack.refused == "reward_range", bad
    none = await ro.request(finished(item, 1, 0, reward=None))  # no reward: stored, unusable
    assert not none.refused
    assert not (await ro.request(finished(item, 0, 0, reward=10.0))).refused  # the bound itself
    s = await stats(tr)
    assert s.refused == {"r0": {"reward_range": 4}}
    assert s.counts["trajectories"] == 2 and s.counts["unusable"] == 1
    b = await batch(tr, 0, groups=1)
    assert [t.reward for t in b.trajectories] == [10.0]


async def test_token_ids_outside_the_vocabulary_are_refused(harness):
    h = await harness(**SIM)
    ro, tr = await h.client("r0"), await h.client("t0", "trainer")
    item = (await prompts(ro, 1)).items[0]
    high = finished(item, 0, 0)
    high.response_ids = np.array([1, 32000, 2], np.int32)  # the sim vocabulary is [0, 32000)
    assert (await ro.request(high)).refused == "token_range"
    neg = finished(item, 0, 0)
    neg.prompt_ids = np.array([-1, *item.prompt_ids.tolist()], np.int32)
    assert (await ro.request(neg)).refused == "token_range"
    long = finished(item, 0, 0, tokens=257)  # rollout.sampling.max_tokens = 256
    assert (await ro.request(long)).refused == "too_long"
    # a partial entry out of the vocabulary is refused as a whole batch, never kept
    await ro.send(
        PartialChunk(
            uid=high.uid,
            version=0,
            offset=0,
            token_ids=np.array([5, 1 << 20], np.int32),
            logprobs=np.zeros(2, np.float32),
            rollout_id="r0",
        )
    )
    assert not (await ro.request(finished(item, 0, 0))).refused
    s = await stats(tr)
    assert s.refused == {"r0": {"token_range": 3, "too_long": 1}}
    assert s.counts["trajectories"] == 1


async def test_a_sample_with_another_prompt_than_served_is_refused(harness):
    """A served group's sample must come back with the prompt it was served with: another
    prompt's token ids (or uid) under a served group id would train a forged prompt."""
    h = await harness(**SIM)
    ro, tr = await h.client("r0"), await h.client("t0", "trainer")
    mgr = await h.client("m0", "manager")
    item = (await prompts(ro, 1)).items[0]
    forged = finished(item, 0, 0)
    forged.prompt_ids = np.asarray(item.prompt_ids, np.int32)[::-1].copy() + 1
    assert (await ro.request(forged)).refused == "prompt_mismatch"
    renamed = finished(item, 0, 0)
    renamed.prompt_uid = item.uid + "-other"
    assert (await ro.request(renamed)).refused == "prompt_mismatch"
    # a partial header with another prompt starts no record
    uid = f"{item.group_id}/1"
    await ro.send(
        PartialChunk(
            uid=uid,
            version=0,
            offset=0,
            token_ids=np.array([5, 6], np.int32),
            logprobs=np.zeros(2, np.float32),
            rollout_id="r0",
            header=PartialTrajectory(
                uid=uid,
                group_id=item.group_id,
                prompt_uid=item.uid,
                sample_index=1,
                prompt_ids=np.array([7, 7, 7], np.int32),
                response_ids=np.zeros(0, np.int32),
                logprobs=np.zeros(0, np.float32),
                version=0,
                n=N,
                rollout_id="r0",
            ),
        )
    )
    assert (await mgr.request(PartialsRequest(uids=[uid]))).partials[0].response_ids.size == 0
    for i in range(N):  # the served prompt: taken, trained
        assert not (await ro.request(finished(item, i, 0))).refused
    s = await stats(tr)
    assert s.refused == {"r0": {"prompt_mismatch": 3}}
    b = await batch(tr, 0, groups=1)
    assert len(b.trajectories) == N
    assert all(t.prompt_ids.tolist() == list(item.prompt_ids) for t in b.trajectories)


async def test_an_agent_runs_sample_is_bound_to_its_row_not_to_a_rendering(harness):
    """Agent runs (issue 47): a sample's prompt is what its agent's first call rendered (a system
    message, the task in the agent's words), so its tokens may differ from the served rendering,
    a group's samples from each other; the row (prompt uid), the group and the owner bind it as
    strictly as before, and the prompt is at most data.max_prompt_tokens."""
    h = await harness(**SIM, agent={"remote": True}, data={"max_prompt_tokens": 64})
    ro, r1 = await h.client("r0"), await h.client("r1")
    tr, mgr = await h.client("t0", "trainer"), await h.client("m0", "manager")
    item = (await prompts(ro, 1, rid="r0")).items[0]
    served = np.asarray(item.prompt_ids, np.int32)
    rendered = [np.concatenate([np.full(i + 2, 40 + i, np.int32), served]) for i in range(N)]
    own = finished(item, 0, 0)
    own.prompt_ids = rendered[0]
    assert not (await ro.request(own)).refused
    renamed = finished(item, 1, 0)
    renamed.prompt_uid, renamed.prompt_ids = item.uid + "-other", rendered[1]
    assert (await ro.request(renamed)).refused == "prompt_mismatch"
    stolen = finished(item, 1, 0, rollout="r1")
    stolen.prompt_ids = rendered[1]
    assert (await r1.request(stolen)).refused == "not_owner"
    long = finished(item, 1, 0)
    long.prompt_ids = np.full(65, 5, np.int32)
    assert (await ro.request(long)).refused == "too_long"
    # a partial header with the agent's prompt starts the record, which carries that prompt
    uid = f"{item.group_id}/1"
    await ro.send(
        PartialChunk(
            uid=uid,
            version=0,
            offset=0,
            token_ids=np.array([5, 6], np.int32),
            logprobs=np.zeros(2, np.float32),
            rollout_id="r0",
            header=PartialTrajectory(
                uid=uid,
                group_id=item.group_id,
                prompt_uid=item.uid,
                sample_index=1,
                prompt_ids=rendered[1],
                response_ids=np.zeros(0, np.int32),
                logprobs=np.zeros(0, np.float32),
                version=0,
                n=N,
                rollout_id="r0",
            ),
        )
    )
    (p,) = (await mgr.request(PartialsRequest(uids=[uid]))).partials
    assert p.prompt_ids.tolist() == rendered[1].tolist() and p.response_ids.tolist() == [5, 6]
    for i in range(1, N):
        t = finished(item, i, 0)
        t.prompt_ids = rendered[i]
        assert not (await ro.request(t)).refused
    s = await stats(tr)
    assert s.refused == {"r0": {"prompt_mismatch": 1, "too_long": 1}, "r1": {"not_owner": 1}}
    b = await batch(tr, 0, groups=1)
    got = {t.sample_index: t.prompt_ids.tolist() for t in b.trajectories}
    assert got == {i: rendered[i].tolist() for i in range(N)}  # one group, its agents' prompts


async def test_a_moved_sample_comes_only_from_its_new_rollout(harness):
    """The manager's SamplesPlaced (sent before its ImportRequest) moves a sample: from then on
    its tokens and its trajectory are taken from the destination alone."""
    h = await harness(**SIM)
    r0, r1 = await h.client("r0"), await h.client("r1")
    mgr = await h.client("m0", "manager")
    item = (await prompts(r0, 1, rid="r0")).items[0]
    uid = f"{item.group_id}/0"

    def header(rollout: str) -> PartialTrajectory:
        return PartialTrajectory(
            uid=uid,
            group_id=item.group_id,
            prompt_uid=item.uid,
            sample_index=0,
            prompt_ids=item.prompt_ids,
            response_ids=np.zeros(0, np.int32),
            logprobs=np.zeros(0, np.float32),
            version=0,
            n=N,
            rollout_id=rollout,
        )

    def chunk(rollout: str, offset: int, ids: list[int], hdr: bool) -> PartialChunk:
        return PartialChunk(
            uid=uid,
            version=0,
            offset=offset,
            token_ids=np.asarray(ids, np.int32),
            logprobs=np.full(len(ids), -0.1, np.float32),
            rollout_id=rollout,
            header=header(rollout) if hdr else None,
        )

    async def record() -> tuple[list[int], str]:
        got = (await mgr.request(PartialsRequest(uids=[uid]))).partials
        return (got[0].response_ids.tolist(), got[0].rollout_id) if got else ([], "")

    async def refused(peer: str) -> int:
        return (await stats(mgr)).refused.get(peer, {}).get("not_owner", 0)

    # one-way sends on other sockets than the manager's: wait until each is in before the next
    await r0.send(chunk("r0", 0, [1, 2], True))
    assert await until(record, ([1, 2], "r0"))
    await r1.send(chunk("r1", 0, [7, 7, 7], True))  # not r1's: refused, r0's record kept
    await r1.send(chunk("r1", 2, [7], False))
    assert await until(lambda: refused("r1"), 2)
    assert await record() == ([1, 2], "r0")
    assert isinstance(await mgr.request(SamplesPlaced(dest="r1", uids=[uid])), Ack)
    await r1.send(chunk("r1", 0, [1, 2, 3], True))  # the destination resumes it
    assert await until(record, ([1, 2, 3], "r1"))
    await r0.send(chunk("r0", 2, [9], False))  # the source's late entry: not its record now
    assert await until(lambda: refused("r0"), 1)
    assert await record() == ([1, 2, 3], "r1")
    assert (await r0.request(finished(item, 0, 0))).refused == "not_owner"
    assert not (await r1.request(finished(item, 0, 0, rollout="r1"))).refused
    assert not (await r0.request(finished(item, 1, 0))).refused  # r0 still holds sample 1
    s = await stats(mgr)
    assert s.refused == {"r1": {"not_owner": 2}, "r0": {"not_owner": 2}}
    assert s.groups_ready == 1


async def a_started_sample(h: Any) -> tuple[RpcClient, RpcClient, PromptItem]:
    """Clients of the harness's buffer as rollout r0 and as the manager, and a group served to
    r0 whose sample 0 has made tokens [1, 2, 3] (sent as its first partial entry)."""
    r0 = await h.client("r0")
    mgr = await h.client("m0", "manager")
    item = (await prompts(r0, 1, rid="r0")).items[0]
    await r0.send(first_entry(item, 0, "r0", [1, 2, 3]))
    return r0, mgr, item


async def test_a_moved_sample_is_recovered_with_the_rollout_it_was_placed_on(harness):
    """A rollout killed after it imported a moved sample but before its first flush re-headed the
    record: the manager's recovery of it (PartialsRequest by rollout) still gets the sample, with
    the tokens the source sent, and the source's recovery no longer does."""
    r0, mgr, item = await a_started_sample(await harness(**SIM))
    moved, kept = f"{item.group_id}/0", f"{item.group_id}/1"

    async def held(rollout: str) -> dict[str, list[int]]:
        got = (await mgr.request(PartialsRequest(rollout_id=rollout))).partials
        return {p.uid: p.response_ids.tolist() for p in got}

    assert await until(lambda: held("r0"), {moved: [1, 2, 3], kept: []})
    assert isinstance(await mgr.request(SamplesPlaced(dest="r1", uids=[moved])), Ack)
    assert await held("r1") == {moved: [1, 2, 3]}  # r1 died before it flushed: not lost
    assert await held("r0") == {kept: []}  # r0 holds only what stayed with it


async def test_a_placement_survives_a_buffer_restart(harness):
    h = await harness(transport="ipc", **SIM)
    r0, mgr = await h.client("r0"), await h.client("m0", "manager")
    item = (await prompts(r0, 1, rid="r0")).items[0]
    uids = [f"{item.group_id}/{i}" for i in range(N)]
    assert isinstance(await mgr.request(SamplesPlaced(dest="r1", uids=uids)), Ack)
    await h.stop_buffer()
    await h.start_buffer()
    r0, r1 = await h.client("r0"), await h.client("r1")
    assert h.buffer.state.placed == {u: "r1" for u in uids}  # journaled
    assert (await r0.request(finished(item, 0, 0))).refused == "not_owner"
    for i in range(N):
        assert not (await r1.request(finished(item, i, 0, rollout="r1"))).refused
    assert h.buffer.state.placed == {}  # finished: nothing is placed any more
    tr = await h.client("t0", "trainer")
    assert len((await batch(tr, 0, groups=1)).trajectories) == N


async def test_a_rollout_leases_at_most_its_share(harness):
    # capacity 128 over 4 rollouts of groups of N=2: a share of 16 open groups each
    h = await harness(buffer={"capacity": 128}, cluster={"roles": {"rollout": 4}})
    r0, r1 = await h.client("r0"), await h.client("r1")
    assert h.cfg.groups_per_rollout() == 16
    got = await prompts(r0, 10**12, rid="r0")
    assert len(got.items) == 16
    again = await prompts(r0, 10**12, rid="r0")
    assert again.items == [] and again.reason == "rollout_full"
    assert len((await prompts(r1, 10**12, rid="r1")).items) == 16  # the other's share is intact
    for i in range(N):  # a group finishing gives its holder room for one more
        await r0.request(finished(got.items[0], i, 0))
    assert len((await prompts(r0, 10**12, rid="r0")).items) == 1
    s = await stats(await h.client("t0", "trainer"))
    assert s.counters["prompts_refused_rollout_full"] == 1 and s.pending == 32 * N


def test_groups_per_rollout_never_starves_a_rollouts_own_credits():
    cfg = config_from_dict({"buffer": {"capacity": 16}, "rollout": {"credits": 4, "group_size": 4}})
    assert cfg.groups_per_rollout() == 8  # 2 x credits, above capacity's share (2)
    cfg = config_from_dict({"buffer": {"capacity": 16, "max_groups_per_rollout": 3}})
    assert cfg.groups_per_rollout() == 3


def test_credits_per_sequence_leave_room_for_a_group_per_straggler():
    # refill_slots 12, groups of 4: a rollout asks whenever its unfinished sequences leave room
    # for a group, so under long tails it holds one open group per straggler: up to 12 open
    # groups (+2 on their way), not the 3 whole groups its slots hold
    cfg = config_from_dict(
        {"buffer": {"capacity": 64}, "rollout": {"credits": 2, "group_size": 4, "refill_slots": 12}}
    )
    assert cfg.groups_in_hand() == 14 and cfg.groups_per_rollout() == 14
    # the manager's last heartbeat lists r0 as serving, with a decode batch of 8
    status = StatusCodec.pack(NodeStatus(node_id="m0", role="manager", serving={"r0": 8}))
    members = Members(
        share=cfg.groups_per_rollout(),
        in_hand=cfg.groups_in_hand(),
        group_size=4,
        source=lambda: status,
    )
    assert members.cap("r0") == 14 and members.cap("r1") is None


def test_reward_range_must_be_ordered_and_finite():
    assert RewardConfig().min_value <= 0.0 and RewardConfig().max_value >= 1.0  # built-ins: 0..1
    with pytest.raises(ValidationError, match="min_value"):
        RewardConfig(min_value=1.0, max_value=0.0)
    with pytest.raises(ValidationError):
        RewardConfig(max_value=math.inf)


async def until(probe: Callable[[], Awaitable[object]], want: object, timeout: float = 5.0) -> bool:
    """Whether `await probe()` came to equal `want` within `timeout` (one-way messages on
    another socket arrive in their own time)."""
    deadline = time.monotonic() + timeout
    while (got := await probe()) != want and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # poll interval of a deadline-bounded wait
    return got == want


class _Server:
    """What the Placer and the Repacker use of the manager's RpcServer: its peers, and requests
    answered from `replies` (by message type), recorded in `sent`."""

    def __init__(self, peers: list[Peer], replies: dict[type, object] | None = None):
        self.peers = {p.node_id: p for p in peers}
        self.replies = replies or {}
        self.sent: list[tuple[str, object]] = []

    async def request(self, node_id: str, msg: object, timeout: float | None = None) -> object:
        self.sent.append((node_id, msg))
        reply = self.replies[type(msg)]
        if isinstance(reply, Exception):
            raise reply
        return reply


def _repacker(
    statuses: list[NodeStatus], bound: int, replies: dict[type, object] | None = None
) -> tuple[Repacker, Metrics]:
    peers = [
        Peer(node_id=s.node_id, role="rollout", identity=s.node_id.encode(), status=s)
        for s in statuses
    ]
    metrics, log = Metrics(), structlog.get_logger("test")
    srv = _Server(peers, replies)
    placer = Placer(srv, 8, 1.0, metrics, log)  # type: ignore[arg-type]
    cfg = config_from_dict({"buffer": {"capacity": bound}})
    repack = cfg.manager.repack
    rep = Repacker(srv, placer, repack, metrics, log, max_inflight=bound)  # type: ignore[arg-type]
    return rep, metrics


def test_a_status_claiming_millions_in_flight_builds_no_more_than_the_bound():
    liar = NodeStatus(node_id="rollout-0", role="rollout", version=0, running=2, inflight=3_000_000)
    honest = NodeStatus(node_id="rollout-1", role="rollout", version=0, running=2, inflight=2)
    rep, metrics = _repacker([liar, honest], bound=64)
    for _ in range(3):  # rounds re-read the same status: clamped each time, counted once
        loads = {r.node_id: r for r in rep.rollout_loads()}
        assert len(loads["rollout-0"].trajectories) == 64 and loads["rollout-0"].running == 2
        assert len(loads["rollout-1"].trajectories) == 2
    assert metrics.counters["status_claims_clamped"] == 1 and rep.claims == {"rollout-0": 1}
    # a per-trajectory list longer than the bound (or a negative count) is planned on not at all
    toks = {f"u{i}": 10 for i in range(65)}
    listing = NodeStatus(
        node_id="rollout-0",
        role="rollout",
        version=0,
        running=2,
        kv_use=math.nan,
        rollout=RolloutStatus(
            traj_tokens=toks, kv_capacity_tokens=1000, measured_at=0.0, target_version=0
        ),
    )
    rep, metrics = _repacker([listing], bound=64)
    assert rep.rollout_loads() == [] and metrics.counters["status_claims_refused"] == 1


def _partial(uid: str) -> PartialTrajectory:
    group_id, _, i = uid.rpartition("/")
    return PartialTrajectory(
        uid=uid,
        group_id=group_id,
        prompt_uid="p",
        sample_index=int(i),
        prompt_ids=np.zeros(2, np.int32),
        response_ids=np.zeros(0, np.int32),
        logprobs=np.zeros(0, np.float32),
        version=0,
        n=2,
    )


async def test_an_export_answered_with_more_than_asked_moves_only_what_was_asked():
    statuses = [
        NodeStatus(node_id=f"rollout-{i}", role="rollout", version=0, running=1, inflight=1)
        for i in range(2)
    ]
    export = ExportReply(partials=[_partial(u) for u in ("g/0", "h/0", "k/1")])
    replies = {ExportRequest: export, ImportRequest: ImportReply(accepted=["g/0"])}
    rep, metrics = _repacker(statuses, bound=64, replies=replies)
    move = Move(source="rollout-0", dest="rollout-1", traj_ids=("g/0",), version=0)
    out = await rep.move(move, refresh=False, trainer_version=0)
    srv: _Server = rep.srv  # type: ignore[assignment]
    imports = [m for _, m in srv.sent if isinstance(m, ImportRequest)]
    assert out["moved"] == 1 and [p.uid for m in imports for p in m.partials] == ["g/0"]
    # the export names the destination: the agents of moved episodes look there first
    assert [m.dest for _, m in srv.sent if isinstance(m, ExportRequest)] == ["rollout-1"]
    assert metrics.counters["move_export_unasked"] == 2


async def test_a_rollout_that_answered_version_mismatch_is_usable_again_on_its_next_status():
    def status() -> NodeStatus:
        return NodeStatus(node_id="rollout-0", role="rollout", version=0, running=1, inflight=1)

    replies = {ImportRequest: RemoteError(VERSION_MISMATCH, "refreshed")}
    rep, metrics = _repacker([status()], bound=64, replies=replies)
    placer, peer = rep.placer, rep.srv.peers["rollout-0"]
    assert await placer.place([_partial("g/0")], trainer_version=0) == {ORPHAN: 1}
    assert metrics.counters["import_version_mismatch"] == 1 and not placer.usable(peer)
    for _ in range(20):  # each beat brings a new status; a freed one's id() is often reused
        peer.status = None
        peer.status = status()
        assert placer.usable(peer)


class _Client:
    def __init__(self, reply: object):
        self.reply, self.sent = reply, 0

    async def request(self, msg: object, timeout: float, retries: int) -> object:
        self.sent += 1
        return self.reply


async def test_the_outbox_stops_sending_a_refused_trajectory():
    cli = _Client(TrajectoryAck(refused="not_owner"))
    box = Outbox(cli, structlog.get_logger("test"), concurrency=1)  # type: ignore[arg-type]
    task = asyncio.create_task(box.run())
    box.put(TrajectoryAbandoned(uid="g/0", group_id="g"))
    assert await box.flush(5.0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert cli.sent == 1 and box.stats["refused"] == 1 and box.stats["acked"] == 0
