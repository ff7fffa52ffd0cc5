"""Multi-turn episodes on the rollout (laminar/rollout/episodes.py), in process, over inproc.

    .venv/bin/python -m pytest tests/test_rollout_multiturn.py -q

A real ManagerNode and the fake buffer of tests/rollout_fakes.py; rollouts run a
turn-aware fake engine, a scripted environment that calls a tool every turn, and an in
process ToolClient that runs each call id at most once (tests/multiturn_fakes.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from fake_engine import FakeEngine, turn_len
from multiturn_fakes import FakeTools, ScriptedEnv, expected_episode
from rollout_fakes import harness, make_cfg, make_items, uids_of, wait_for

from laminar.engines.base import TokenEvent
from laminar.envs.base import call_id
from laminar.envs.replay import split_segments
from laminar.protocol.rollout import ExportReply, ExportRequest, ImportReply, ImportRequest
from laminar.rollout.node import RolloutNode
from laminar.wiring.nodes import build_node


async def add(
    h: Any, env: ScriptedEnv, tools: Any, engine: FakeEngine | None = None
) -> RolloutNode:
    node = build_node(
        h.cfg,
        "rollout",
        len(h.rollouts),
        ctx=h.ctx,
        engine=engine or FakeEngine(turns=True),
        env=env,
        tools=tools,
    )
    return await h.start_node(node)


def check_episode(t: Any, turns: int) -> None:
    ids, mask = expected_episode(t.uid, turns)
    assert t.response_ids.tolist() == ids, t.uid
    assert (
        t.loss_mask is not None and t.loss_mask.dtype == np.uint8 and t.loss_mask.tolist() == mask
    )
    lps = t.logprobs
    env = t.loss_mask == 0
    assert np.all(lps[env] == 0.0)
    assert np.allclose(lps[~env], -0.01 * (np.flatnonzero(~env) + 1))  # the engine's own logprobs
    assert t.turns == turns and t.version == 0


async def test_episode_tokens_loss_mask_and_tool_records(tmp_path):
    items = make_items(2, n=2)
    cfg = make_cfg(tmp_path)
    tools, env = FakeTools(), ScriptedEnv(turns=3)
    async with harness(cfg, items) as h:
        node = await add(h, env, tools)
        await h.wait_stored(uids_of(items), 20)
        for uid, t in h.state.stored.items():
            check_episode(t, 3)
            assert t.finish_reason == "stop" and t.reward == 1.0
            assert t.reward_info == {"seen": 3, "calls": 3}
            assert [r.call_id for r in t.tool_calls] == [call_id(uid, k, 0) for k in range(3)]
            assert all(r.ok and not r.cached and r.turn == k for k, r in enumerate(t.tool_calls))
        assert set(tools.runs.values()) == {1} and len(tools.runs) == 4 * 3
        # every later turn went back in at the episode's version, after all its tokens so far
        engine = node.engine
        assert isinstance(engine, FakeEngine)
        resubmits = [r for r in engine.submitted if r.single]
        assert len(resubmits) == 4 * 2
        for r in resubmits:
            assert r.version == 0 and r.turn in (1, 2) and r.turn_start == len(r.resume_ids)
            assert (
                "</call>" in r.params.stop
                and r.params.max_tokens == cfg.rollout.sampling.max_tokens
            )
        assert (
            node.metrics.counters["tool_calls"] == 12
            and node.metrics.counters["env_tokens"] == 4 * 2 * 3
        )
        assert not h.state.partials


@pytest.mark.parametrize(
    "limits, env_kw, reason, turns, calls",
    [
        ({"max_turns": 2}, {"turns": 5}, "turns", 2, 2),
        ({"max_tool_calls": 1}, {"turns": 3}, "stop", 3, 1),
        ({"max_total_tokens": 14}, {"turns": 9}, "length", None, None),
        ({"turn_timeout_s": 0.3}, {"turns": 3, "tool": "hang"}, "timeout", 1, 0),
        ({"max_turn_tokens": 2}, {"turns": 2}, "stop", 2, 2),
    ],
)
async def test_episode_limits(tmp_path, limits, env_kw, reason, turns, calls):
    items = make_items(2, n=1)
    cfg = make_cfg(tmp_path, env={"limits": limits})
    tools, env = FakeTools(), ScriptedEnv(**env_kw)
    async with harness(cfg, items) as h:
        node = await add(h, env, tools)
        await h.wait_stored(uids_of(items), 20)
        for uid, t in h.state.stored.items():
            assert t.finish_reason == reason, (uid, t.finish_reason)
            assert len(t.loss_mask) == len(t.response_ids) == len(t.logprobs)
            if turns is not None:
                assert t.turns == turns
            if calls is not None:
                assert len(t.tool_calls) == calls
            if "max_total_tokens" in limits:
                assert len(t.response_ids) <= limits["max_total_tokens"]
            if "max_turn_tokens" in limits:  # every model turn cut at 2 tokens, and still answered
                runs = [
                    g.end - g.start
                    for g in split_segments(t.response_ids, t.loss_mask)
                    if g.kind == "model"
                ]
                assert runs == [min(2, turn_len(uid, k)) for k in range(len(runs))]
        if reason == "timeout":
            assert node.metrics.counters["env_step_timeouts"] == 2
        assert node.table.seqs == {} and not any(
            t.done() for t in h.tasks
        )  # the rollout keeps running


async def test_a_waiting_episode_frees_the_engine_for_other_work(tmp_path):
    items = make_items(4, n=2)
    cfg = make_cfg(
        tmp_path,
        rollout={
            "engine": "sim",
            "credits": 1,
            "partial_chunk_tokens": 8,
            "weights": "dir",
            "prompt_retry_s": 0.05,
        },
    )
    tools, env = FakeTools(gate_turn=0), ScriptedEnv(turns=2)
    engine = FakeEngine(turns=True)
    async with harness(cfg, items) as h:
        node = await add(h, env, tools, engine)
        first = "p0@0"
        # the first group's episodes wait on their tool: its credit is free, so a second group runs
        await wait_for(
            lambda: any(r.req_id == "p1@0" for r in engine.submitted), 10, "a second group"
        )
        assert all(node.table.seqs[u].waiting for u in node.table.groups[first].open)
        # hard cap: 2 x credits groups in hand, however many wait
        await wait_for(
            lambda: (
                len(node.table.groups) == 2 and all(s.waiting for s in node.table.seqs.values())
            ),
            10,
            "both groups waiting",
        )
        assert node.feeder.free_credits() == 0 and "p2@0" not in node.table.groups
        assert node.engine.stats().running == 0  # nothing of theirs held in the engine
        tools.gate.set()
        await h.wait_stored(uids_of(items), 20)
        for t in h.state.stored.values():
            check_episode(t, 2)
        assert set(tools.runs.values()) == {1}


@pytest.mark.parametrize("where", ["waiting_turn0", "waiting_turn1", "mid_turn1"])
async def test_repack_moves_an_episode_between_turns(tmp_path, where):
    """Export from rollout-0, import into rollout-1 (same version): the episode finishes there
    with the same tokens as if it never moved, and the side-effecting tool ran once per call id."""
    items = make_items(2, n=2)
    cfg = make_cfg(tmp_path)
    gate_turn = {"waiting_turn0": 0, "waiting_turn1": 1, "mid_turn1": None}[where]
    tools = FakeTools(gate_turn=gate_turn)
    src_engine = FakeEngine(turns=True, hold_turn=1 if where == "mid_turn1" else None)
    env0, env1 = ScriptedEnv(turns=3), ScriptedEnv(turns=3)
    async with harness(cfg, items) as h:
        src = await add(h, env0, tools, src_engine)
        all_uids = uids_of(items)
        expect = {call_id(u, gate_turn, 0) for u in all_uids} if gate_turn is not None else set()

        def cond() -> bool:
            seqs = src.table.seqs.values()
            if where == "mid_turn1":  # parked one token into turn 1
                return set(src.table.seqs) == all_uids and all(
                    s.turn == 1 and not s.waiting and s.length == s.turn_start + 1 for s in seqs
                )
            return expect <= tools.started and all(s.waiting for s in seqs)  # mid-tool-call

        await wait_for(cond, 10, f"every episode at {where}")
        dst = await add(h, env1, tools)
        srv = h.manager.srv
        reply = await srv.request("rollout-0", ExportRequest(uids=sorted(all_uids)), timeout=5)
        assert isinstance(reply, ExportReply) and {p.uid for p in reply.partials} == all_uids
        for p in reply.partials:
            assert p.loss_mask is not None and len(p.loss_mask) == len(p.response_ids)
            assert p.awaiting_env == (where != "mid_turn1")
            ids, mask = expected_episode(p.uid, 3)
            assert p.response_ids.tolist() == ids[: len(p.response_ids)]
            assert p.loss_mask.tolist() == mask[: len(p.response_ids)]
        assert not src.table.seqs and src.metrics.counters.get("exported_waiting", 0) == (
            0 if where == "mid_turn1" else 4
        )
        got = await srv.request("rollout-1", ImportRequest(partials=reply.partials), timeout=5)
        assert isinstance(got, ImportReply) and set(got.accepted) == all_uids
        tools.gate.set()
        await h.wait_stored(all_uids, 20)
        for uid in all_uids:
            t = h.state.stored[uid]
            check_episode(t, 3)  # the same prefix, and the same episode as if it never moved
            assert t.rollout_id == "rollout-1" and t.resumed == 1 and t.finish_reason == "stop"
            assert [r.call_id for r in t.tool_calls] == [call_id(uid, k, 0) for k in range(3)]
        assert set(tools.runs.values()) == {1} and len(tools.runs) == 12  # never twice
        assert dst.metrics.counters["episodes_replayed"] == 4
        assert dst.metrics.counters.get("replay_mismatch", 0) == 0
        replayed = sum(c for (u, turn, replay), c in env1.steps.items() if replay)
        assert replayed == {"waiting_turn0": 0, "waiting_turn1": 4, "mid_turn1": 4}[where]
        if (
            where == "waiting_turn1"
        ):  # the step cut by the export ran again, its call waited for the first run
            assert all(t.tool_calls[1].cached for t in h.state.stored.values())
        h.check_arrivals()


def test_awaiting_env_reaches_the_partial_pool_and_comes_back():
    """The flag travels with the chunk that reaches the record's end; a flip alone is an empty
    chunk."""
    from laminar.buffer.partials import PartialPool
    from laminar.rollout.tracking import SeqState

    item = make_items(1, n=1)[0]
    seq = SeqState.from_item(item, 0, version=0, now=1.0, multi_turn=True)
    pool = PartialPool()

    def send() -> None:
        msg, upto = seq.chunk("rollout-0")
        assert pool.apply(msg) in ("appended", "duplicate")
        seq.sent_upto, seq.sent_awaiting = upto, msg.awaiting_env

    seq.append(np.array([5, 6, 7], np.int32), np.array([-1, -1, -1], np.float32), 1.0)
    send()
    seq.awaiting_env = True  # the model turn ended: its step runs
    send()  # no new tokens, only the flag
    (p,) = pool.query(uids=[seq.uid])
    assert p.awaiting_env and p.loss_mask.tolist() == [1, 1, 1]
    seq.append_env(np.array([100, 101], np.int32))
    seq.awaiting_env = False
    send()
    (p,) = pool.query(uids=[seq.uid])
    assert not p.awaiting_env and p.loss_mask.tolist() == [1, 1, 1, 0, 0]
    assert p.logprobs.tolist() == [-1, -1, -1, 0, 0]
    back = SeqState.from_partial(p, now=2.0, multi_turn=True)
    assert (
        back.mask is not None and back.mask.copy().tolist() == [1, 1, 1, 0, 0] and back.resumed == 1
    )


class _TurnEndsDuringAbort(FakeEngine):
    """An abort that loses the race: each sequence's model turn ends (final "stop" event) while
    the abort is on its way, so the abort hands back nothing and the episode went to its env
    step."""

    async def abort(self, seq_ids: Any) -> list[Any]:
        for sid in list(seq_ids):
            s = self.running.pop(sid, None)
            if s is not None:
                self._emit(
                    TokenEvent(
                        sid, np.zeros(0, np.int32), np.zeros(0, np.float32), "stop", s["version"]
                    )
                )
        await asyncio.sleep(0.05)  # the events loop handles those turn ends meanwhile
        return []


async def test_export_takes_an_episode_whose_turn_ended_during_the_abort(tmp_path):
    items = make_items(2, n=2)
    cfg = make_cfg(tmp_path)
    tools = FakeTools()
    src_engine = _TurnEndsDuringAbort(turns=True, hold_turn=1)  # parked one token into turn 1
    async with harness(cfg, items) as h:
        src = await add(h, ScriptedEnv(turns=3), tools, src_engine)
        all_uids = uids_of(items)
        await wait_for(
            lambda: (
                set(src.table.seqs) == all_uids
                and all(s.turn == 1 and not s.waiting for s in src.table.seqs.values())
            ),
            10,
            "every episode generating turn 1",
        )
        await add(h, ScriptedEnv(turns=3), tools)
        srv = h.manager.srv
        reply = await srv.request("rollout-0", ExportRequest(uids=sorted(all_uids)), timeout=5)
        # none is left behind half-owned (waiting, its step stood down): all of them moved
        assert isinstance(reply, ExportReply) and {p.uid for p in reply.partials} == all_uids
        assert all(p.awaiting_env for p in reply.partials) and not src.table.seqs
        got = await srv.request("rollout-1", ImportRequest(partials=reply.partials), timeout=5)
        assert isinstance(got, ImportReply) and set(got.accepted) == all_uids
        await h.wait_stored(all_uids, 20)
        assert all(h.state.stored[u].rollout_id == "rollout-1" for u in all_uids)
        assert set(tools.runs.values()) == {1}  # no call id ran twice
