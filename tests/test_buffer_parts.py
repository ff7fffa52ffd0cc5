"""The buffer's parts wired by hand, without a node or sockets: prompts -> trajectories -> batch ->
commit.

.venv/bin/python -m pytest tests/test_buffer_parts.py -q
"""

from __future__ import annotations

import asyncio

import numpy as np

from laminar.buffer.batches import BatchServer
from laminar.buffer.experience import ExperienceState
from laminar.buffer.holders import recover
from laminar.buffer.intake import Intake
from laminar.buffer.journal import Journal
from laminar.buffer.ledger import Ledger
from laminar.buffer.partials import PartialPool
from laminar.buffer.prompt_server import PromptServer
from laminar.buffer.prompts import PromptPool
from laminar.buffer.records import SamplesMoved
from laminar.config import LaminarConfig
from laminar.data.prompts import PromptEncoder, PromptRow
from laminar.logs import get_logger
from laminar.metrics import Metrics
from laminar.modes import Admission
from laminar.protocol.buffer import (
    BatchCommit,
    BatchRequest,
    CommitAck,
    PromptRequest,
    TrajectoryAbandoned,
    TrajectoryAck,
)
from laminar.protocol.data import PromptItem, Trajectory
from tests.pool_entries import first_entry

N = 2


def parts(journal: Journal | None = None, rows: int = 3):
    cfg = LaminarConfig.model_validate(
        {"rollout": {"group_size": N}, "trainer": {"batch_groups": 1}}
    )
    adm = Admission.for_mode(cfg.mode, cfg.trainer.batch_groups, cfg.buffer.max_staleness)
    state = ExperienceState(group_size=N, lost_member_policy="release_partial", admission=adm)
    metrics, log = Metrics(), get_logger(role="buffer", node_id="test")
    ledger = Ledger(state, journal, cfg.buffer.compact_bytes, metrics, log)
    if journal is not None:
        ledger.replay()
    pool = PromptPool(
        [PromptRow(f"p{i}", f"prompt {i}", {}, f"mem:{i}") for i in range(rows)],
        PromptEncoder(None),
        shuffle=False,
        epochs=1,
    )
    partials = PartialPool()
    return (
        ledger,
        PromptServer(cfg.buffer, N, admission=adm, ledger=ledger, pool=pool, metrics=metrics),
        Intake(ledger, partials, metrics, log),
        BatchServer(cfg.buffer, adm, ledger, pool, metrics, log),
        partials,
    )


def finished(item: PromptItem, i: int) -> Trajectory:
    return Trajectory(
        uid=f"{item.group_id}/{i}",
        group_id=item.group_id,
        prompt_uid=item.uid,
        sample_index=i,
        prompt_ids=item.prompt_ids,
        response_ids=np.arange(3, dtype=np.int32),
        logprobs=np.zeros(3, np.float32),
        version=0,
        reward=1.0,
        finish_reason="stop",
    )


async def test_parts_serve_a_group_into_a_batch_and_commit_it():
    ledger, prompts, intake, batches, partials = parts()
    reply = await prompts.serve(
        PromptRequest(rollout_id="r0", max_groups=1, version=0, request_id="q1")
    )
    assert len(reply.items) == 1 and reply.reason == ""
    item = reply.items[0]
    again = await prompts.serve(
        PromptRequest(rollout_id="r0", max_groups=1, version=0, request_id="q1")
    )
    assert [i.group_id for i in again.items] == [item.group_id]  # a retry gets the same group
    # recovery before anything started: every sample of the group, empty, from its prompt
    rec = recover(partials, ledger.state.groups, rollout_id="r0")
    assert sorted(p.uid for p in rec) == [f"{item.group_id}/{i}" for i in range(N)]
    assert all(len(p.response_ids) == 0 for p in rec)

    waiting = asyncio.ensure_future(
        batches.serve(BatchRequest(trainer_id="t", groups=1, trainer_version=0, wait_s=10.0))
    )
    assert isinstance(await intake.trajectory(finished(item, 0), "r0"), TrajectoryAck)
    dup = await intake.trajectory(finished(item, 0), "r0")
    assert isinstance(dup, TrajectoryAck) and dup.duplicate
    assert isinstance(await intake.trajectory(finished(item, 1), "r0"), TrajectoryAck)
    batch = await asyncio.wait_for(
        waiting, 5.0
    )  # served as soon as the group is whole, not at wait_s
    assert batch.batch_id and len(batch.trajectories) == N
    assert batch.staleness is not None and batch.staleness.max == 0
    commit = BatchCommit(batch_id=batch.batch_id, step=1, version=1)
    ack = await batches.commit(commit)
    assert isinstance(ack, CommitAck) and ack.ok and ledger.state.trainer_version == 1
    again = await batches.commit(commit)
    assert isinstance(again, CommitAck) and again.duplicate
    assert ledger.state.held == 0 and not ledger.state.groups


async def test_recovery_finds_a_placed_sample_on_the_rollout_it_was_placed_on():
    """A sample the manager moved from r0 to r1 (a repack, or r0's own recovery) is r1's from the
    placement on, though its record still names r0 until r1's first flush re-heads it: r1 dying
    in that window must not lose it, and r0's recovery must not take it from r1."""
    ledger, prompts, _, _, partials = parts()
    item = (await prompts.serve(PromptRequest(rollout_id="r0", max_groups=1, version=0))).items[0]
    s0, s1 = f"{item.group_id}/0", f"{item.group_id}/1"
    assert partials.apply(first_entry(item, 0, "r0", range(5))) == "appended"
    ledger.record(SamplesMoved("r1", [s0, s1]))  # s0 with its 5 tokens, s1 never started
    placed = ledger.state.placed

    r1 = {p.uid: p for p in recover(partials, ledger.state.groups, "r1", placed=placed)}
    assert sorted(r1) == [s0, s1]
    assert r1[s0].response_ids.tolist() == [0, 1, 2, 3, 4]  # the record, not a restart
    assert len(r1[s1].response_ids) == 0
    assert recover(partials, ledger.state.groups, "r0", placed=placed) == []

    # once r1 re-heads the record it names r1 as well; r0 still holds nothing
    assert partials.apply(first_entry(item, 0, "r1", range(7))) == "appended"
    assert [p.uid for p in recover(partials, ledger.state.groups, "r0", placed=placed)] == []
    assert sorted(p.uid for p in recover(partials, ledger.state.groups, "r1", placed=placed)) == [
        s0,
        s1,
    ]


async def test_parts_replay_the_same_state_from_the_journal(tmp_path):
    j = Journal(tmp_path / "b.journal", "always")
    ledger, prompts, intake, batches, _ = parts(j)
    item = (await prompts.serve(PromptRequest(rollout_id="r0", max_groups=1, version=0))).items[0]
    await intake.trajectory(finished(item, 0), "r0")
    await intake.abandoned(
        TrajectoryAbandoned(uid=f"{item.group_id}/1", group_id=item.group_id, reason="test")
    )
    batch = await batches.serve(
        BatchRequest(trainer_id="t", groups=1, trainer_version=0, wait_s=0.0)
    )
    assert len(batch.trajectories) == 1 and batch.partial_groups == 1
    live = ledger.state.summary()
    j.close()
    j2 = Journal(tmp_path / "b.journal", "never")
    replayed, *_ = parts(j2)
    assert replayed.state.summary() == live and replayed.state.cursor == prompts.pool.cursor()
    j2.close()


async def test_a_waiting_batch_request_wakes_per_plan_change_not_per_member():
    # groups of N: a member that leaves its group open changes no plan, so the trainer's
    # long-poll is not woken to plan again; the member that completes it, or one that moves an
    # open group's version, or an abandon that settles a group, wakes it
    ledger, prompts, intake, batches, _ = parts(rows=3)
    reply = await prompts.serve(
        PromptRequest(rollout_id="r0", max_groups=3, version=0, request_id="q1")
    )
    a, b, c = reply.items
    plans = 0
    plan = ledger.state.plan

    def counted(*args, **kw):
        nonlocal plans
        plans += 1
        return plan(*args, **kw)

    ledger.state.plan = counted
    waiting = asyncio.ensure_future(
        batches.serve(BatchRequest(trainer_id="t", groups=2, trainer_version=0, wait_s=10.0))
    )
    await asyncio.sleep(0)  # one turn: the request plans, finds nothing ready and waits
    assert plans == 1
    ev = ledger.changed
    assert isinstance(await intake.trajectory(finished(a, 0), "r0"), TrajectoryAck)
    assert ledger.changed is ev and not ev.is_set()  # a stays open: nobody woken
    assert isinstance(await intake.trajectory(finished(a, 1), "r0"), TrajectoryAck)
    assert ev.is_set() and ledger.changed is not ev  # a is ready: woken
    ev = ledger.changed
    newer = finished(b, 0)
    newer.version = 1  # served at 0: the open group's version moves to its oldest member's
    assert ledger.state.groups[b.group_id].version == 0
    assert isinstance(await intake.trajectory(newer, "r0"), TrajectoryAck)
    assert ev.is_set() and ledger.state.groups[b.group_id].version == 1
    ev = ledger.changed
    assert isinstance(await intake.trajectory(finished(c, 0), "r0"), TrajectoryAck)
    assert not ev.is_set()
    abandoned = TrajectoryAbandoned(uid=f"{c.group_id}/1", group_id=c.group_id, reason="gone")
    assert isinstance(await intake.abandoned(abandoned), TrajectoryAck)
    assert ev.is_set()  # c settled (partial): two ready groups, the request is served
    batch = await asyncio.wait_for(waiting, 5.0)
    assert sorted(batch.group_ids) == sorted([a.group_id, c.group_id])
