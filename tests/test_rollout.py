"""Rollout node against a fake buffer and a fake engine (tests/rollout_fakes.py), over inproc.

    .venv/bin/python -m pytest tests/test_rollout.py -q

A real ManagerNode runs too, so heartbeats (NodeStatus) and manager commands
(Export/Import/Refresh) go through the real sockets.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
from fake_engine import FakeEngine
from rollout_fakes import (
    expected_response,
    harness,
    make_cfg,
    make_items,
    uids_of,
    wait_for,
    write_weights,
)

from laminar.protocol.rollout import (
    ExportReply,
    ExportRequest,
    ImportReply,
    ImportRequest,
    RefreshReply,
    RefreshRequest,
)
from laminar.transport.sockets import RemoteError, Wiring
from laminar.wiring.common import relay_links, socket_options
from laminar.wiring.nodes import build_node

# ---- tests -------------------------------------------------------------------------------


async def test_groups_flow_with_credits_and_partials(tmp_path):
    items = make_items(12, n=3)
    cfg = make_cfg(tmp_path)
    async with harness(cfg, items) as h:
        engines = [FakeEngine(), FakeEngine()]
        for e in engines:
            await h.add_rollout(e)
        await h.wait_stored(uids_of(items), 20)
        stored = h.state.stored
        for uid, t in stored.items():
            assert t.response_ids.tolist() == expected_response(uid), uid
            assert len(t.logprobs) == len(t.response_ids) and t.logprobs.dtype == np.float32
            assert t.version == 0 and t.finish_reason == "length" and t.reward in (0.0, 1.0)
            assert t.rollout_id in ("rollout-0", "rollout-1") and t.sample_index == int(
                uid.rsplit("/", 1)[1]
            )
            assert t.timings["t_finish"] >= t.timings["t_first_token"] >= t.timings["t_start"] > 0
        h.check_arrivals()
        assert all(r.max_groups <= cfg.rollout.credits for r in h.state.requests)
        assert all(e.peak_groups <= cfg.rollout.credits for e in engines)
        assert {t.rollout_id for t in stored.values()} == {"rollout-0", "rollout-1"}
        assert sum(r.metrics.counters.get("partial_chunks", 0) for r in h.rollouts) > 0
        assert not h.state.partials, "finished trajectories must supersede their partial records"
        # heartbeats carry the rollout's engine stats to the manager
        await wait_for(
            lambda: h.manager.srv.peers["rollout-0"].status is not None, 5, "a status heartbeat"
        )
        st = h.manager.srv.peers["rollout-0"].status
        assert (
            st.version == 0
            and st.role == "rollout"
            and st.rollout is not None
            and st.rollout.credits_free >= 0
            and st.rollout.outbox >= 0
        )


async def test_buffer_cut_off_loses_nothing_and_duplicates_nothing(tmp_path):
    items = make_items(30, n=2)
    cfg = make_cfg(tmp_path, rollout__credits=4)
    async with harness(cfg, items) as h:
        for _ in range(2):
            await h.add_rollout(FakeEngine(step_s=0.004))
        await wait_for(lambda: len(h.state.stored) >= 8, 10, "some trajectories before the cut")
        await h.buffer.stop()
        # the rollouts keep generating: the groups in hand finish while the buffer is away
        await wait_for(
            lambda: sum(len(r.outbox) for r in h.rollouts) >= 4,
            10,
            "finished work piling up in outboxes",
        )
        # the outage itself (the behaviour under test), longer than dead_after_s
        await asyncio.sleep(2.0)
        await h.buffer.start()  # same endpoint, same (journaled) state
        await h.wait_stored(uids_of(items), 30)
        assert set(h.state.stored) == uids_of(items)
        # a resend whose first copy was stored (ack lost in the cut) is deduplicated
        h.check_arrivals()
        assert sum(r.outbox.stats["retries"] for r in h.rollouts) > 0
        for uid, t in h.state.stored.items():
            assert t.response_ids.tolist() == expected_response(uid)


async def test_prompt_request_retry_gets_the_same_groups_back(tmp_path):
    items = make_items(6, n=2)
    cfg = make_cfg(tmp_path)
    async with harness(cfg, items) as h:
        # > request_timeout_s: the first served reply is lost to the rollout
        h.state.stall_next_reply_s = 2.0
        node = await h.add_rollout(FakeEngine())
        await h.wait_stored(uids_of(items), 20)
        first = h.state.requests[0]
        assert h.state.requests[1].request_id == first.request_id  # retried as is
        assert node.metrics.counters["prompt_request_failed"] >= 1
        h.check_arrivals()
        assert set(h.state.stored) == uids_of(items)


async def test_weights_load_only_when_idle_and_groups_keep_one_version(tmp_path):
    items = make_items(16, n=2)
    cfg = make_cfg(tmp_path)
    async with harness(cfg, items) as h:
        engine = FakeEngine(step_s=0.003)
        node = await h.add_rollout(engine)
        await wait_for(lambda: len(h.state.stored) >= 4, 10, "a few groups at version 0")
        write_weights(tmp_path, 1)
        await wait_for(lambda: engine.loads == [1], 10, "the rollout to load v1 when idle")
        await h.wait_stored(uids_of(items), 20)
        # FakeEngine.load_weights asserts nothing was running; every group is on one version
        versions = {}
        for t in h.state.stored.values():
            versions.setdefault(t.group_id, set()).add(t.version)
        assert all(len(v) == 1 for v in versions.values())
        assert {t.version for t in h.state.stored.values()} == {0, 1}
        assert node.gate.version == 1 and h.state.requests[-1].version == 1


async def test_weights_from_the_relay(tmp_path):
    """rollout.weights=relay: the trainer pushes v1 to the relay; the idle rollout pulls and loads
    it."""
    import torch

    from laminar.logs import get_logger
    from laminar.supervise import detached_spawn
    from laminar.weights.pusher import WeightPusher

    items = make_items(2, n=2)
    cfg = make_cfg(tmp_path, rollout__weights="relay", relay={"shm_prefix": f"lamt{os.getpid()}"})
    async with harness(cfg, items) as h:
        await h.start_node(build_node(cfg, "relay", 0, ctx=h.ctx))
        engine = FakeEngine()
        node = await h.add_rollout(engine)
        assert node.source.name == "relay"
        await h.wait_stored(uids_of(items), 10)
        log = get_logger(role="trainer", node_id="trainer-0")
        wiring = Wiring(h.ctx, socket_options(cfg), "trainer-0", "trainer", log, detached_spawn)
        pusher = WeightPusher(relay_links(cfg), wiring)
        await pusher.start()
        try:
            await pusher.push(1, {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
            await wait_for(lambda: engine.loads == [1], 10, "the rollout to pull v1 from the relay")
        finally:
            await pusher.close()
        assert engine.last_weights["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        more = make_items(1, n=2, prefix="q")
        h.state.prompts.extend(more)
        await h.wait_stored(uids_of(more), 10)
        assert {h.state.stored[u].version for u in uids_of(more)} == {1}


async def test_min_version_from_buffer_in_a_global_mode(tmp_path):
    write_weights(tmp_path, 1)
    items = make_items(2, n=2)
    cfg = make_cfg(tmp_path, mode="sync")
    async with harness(cfg, items) as h:
        engine = FakeEngine()
        await h.add_rollout(engine)
        await h.wait_stored(uids_of(items), 10)
        assert engine.loads == []  # sync mode: a newer version alone does not trigger a load
        assert {t.version for t in h.state.stored.values()} == {0}
        more = make_items(2, n=2, prefix="q")
        h.state.min_version = 1
        h.state.prompts.extend(more)
        await h.wait_stored(uids_of(more), 10)
        assert engine.loads == [1]
        assert {h.state.stored[u].version for u in uids_of(more)} == {1}


async def test_export_then_import_completes_the_trajectory(tmp_path):
    items = make_items(2, n=2)
    cfg = make_cfg(tmp_path)
    async with harness(cfg, items) as h:
        src = await h.add_rollout(FakeEngine(hold=True))  # never finishes: a draining long tail
        await h.add_rollout(FakeEngine())
        all_uids = uids_of(items)
        await wait_for(
            lambda: (
                set(src.table.seqs) == all_uids
                and not src.engine.running.keys() - all_uids
                and all(
                    len(s["ids"]) >= min(s["end"], s["cap"]) - 1
                    for s in src.engine.running.values()
                )
            ),
            10,
            "the source to generate all it can",
        )
        srv = h.manager.srv
        reply = await srv.request(
            "rollout-0", ExportRequest(uids=[*sorted(all_uids), "nope/0"]), timeout=5
        )
        assert isinstance(reply, ExportReply) and reply.missing == ["nope/0"] and reply.version == 0
        assert {p.uid for p in reply.partials} == all_uids
        for p in reply.partials:
            assert (
                p.response_ids.tolist() == expected_response(p.uid)[:-1]
                and p.rollout_id == "rollout-0"
            )
        assert not src.table.seqs and not src.table.groups  # forgotten: its credits are free again
        reply2 = await srv.request("rollout-1", ImportRequest(partials=reply.partials), timeout=5)
        assert isinstance(reply2, ImportReply) and set(reply2.accepted) == all_uids
        again = await srv.request(
            "rollout-1", ImportRequest(partials=reply.partials[:1]), timeout=5
        )
        assert (
            again.duplicate == [reply.partials[0].uid] and not again.accepted
        )  # running or finished
        await h.wait_stored(all_uids, 10)
        for uid in all_uids:
            t = h.state.stored[uid]
            assert t.response_ids.tolist() == expected_response(uid)  # same as never interrupted
            assert np.allclose(t.logprobs, -0.01 * np.arange(1, len(t.response_ids) + 1))
            assert t.rollout_id == "rollout-1" and t.resumed == 1 and t.version == 0
        h.check_arrivals()


async def test_import_at_another_version_is_rejected(tmp_path):
    items = make_items(1, n=2)
    cfg = make_cfg(tmp_path)
    async with harness(cfg, items) as h:
        src = await h.add_rollout(FakeEngine(hold=True))
        other = FakeEngine()
        other.version = 1  # as if it had loaded v1
        dst = await h.add_rollout(other)
        assert dst.gate.version == 1
        await wait_for(lambda: len(src.table.seqs) == 2, 10, "the source to start its group")
        reply = await h.manager.srv.request("rollout-0", ExportRequest(), timeout=5)
        assert len(reply.partials) == 2
        with pytest.raises(RemoteError) as info:
            await h.manager.srv.request(
                "rollout-1", ImportRequest(partials=reply.partials), timeout=5
            )
        assert info.value.code == "version_mismatch"
        assert not dst.table.seqs and dst.metrics.counters.get("import_rejected") == 2
        # the same partials resume fine on a rollout at their version (the source itself here)
        src.engine.hold = False
        ok = await h.manager.srv.request(
            "rollout-0", ImportRequest(partials=reply.partials), timeout=5
        )
        assert len(ok.accepted) == 2
        await h.wait_stored(uids_of(items), 10)


async def test_refresh_request_loads_newest_when_idle(tmp_path):
    cfg = make_cfg(tmp_path, mode="one_step")
    async with harness(cfg, []) as h:
        engine = FakeEngine()
        await h.add_rollout(engine)
        write_weights(tmp_path, 2)
        reply = await h.manager.srv.request("rollout-0", RefreshRequest(min_version=2), timeout=5)
        assert isinstance(reply, RefreshReply) and reply.version == 0 and reply.pending
        await wait_for(lambda: engine.loads == [2], 10, "the refresh to load v2")
        await wait_for(
            lambda: h.state.requests and h.state.requests[-1].version == 2, 5, "asking at v2"
        )


async def test_refresh_to_a_version_that_never_comes_does_not_stall_the_rollout(tmp_path):
    cfg = make_cfg(tmp_path, mode="one_step", rollout__refresh_wait_s=0.3)
    async with harness(cfg, []) as h:
        engine = FakeEngine()
        node = await h.add_rollout(engine)
        reply = await h.manager.srv.request("rollout-0", RefreshRequest(min_version=5), timeout=5)
        assert reply.pending
        items = make_items(2, n=2)
        h.state.prompts.extend(items)
        # no v5 anywhere: after refresh_wait_s it goes on at the version it has
        await h.wait_stored(uids_of(items), 10)
        assert engine.loads == [] and node.gate.version == 0


# ---- rewards on the rollout -----------------------------------------------------------------


def reward_by_answer(prompt, completion, answer=None, **row):
    return {"reward": float(prompt.endswith(str(answer))), "checked": 1.0}


def reward_raises(prompt, completion, **row):
    raise RuntimeError("judge unavailable")


@pytest.mark.parametrize("fn", ["reward_by_answer", "reward_raises"])
async def test_reward_runner_on_the_rollout(tmp_path, fn):
    items = make_items(3, n=2)
    # torch kind with an injected engine and no model: no tokenizer, the completion is "", the
    # reward fn runs
    cfg = make_cfg(
        tmp_path,
        reward={"fn": f"{__name__}:{fn}", "workers": 0, "timeout_s": 5.0},
        rollout__engine="torch",
    )
    async with harness(cfg, items) as h:
        node = await h.add_rollout(FakeEngine())
        await h.wait_stored(uids_of(items), 10)
        for t in h.state.stored.values():
            if fn == "reward_by_answer":
                assert t.reward == 1.0 and t.reward_info == {"checked": 1.0}
                assert "reward_s" in t.timings
            else:
                assert t.reward is None and "judge unavailable" in t.reward_error
                assert t.reward_error_kind == "exception" and t.reward_info == {}
        if fn == "reward_raises":
            assert node.rewards.stats["errors"] == 6


async def test_bad_reward_spec_fails_the_rollout_at_startup(tmp_path):
    cfg = make_cfg(
        tmp_path, reward={"fn": "laminar.no_such_mod:fn", "workers": 0}, rollout__engine="torch"
    )
    async with harness(cfg, []) as h:
        node = build_node(cfg, "rollout", 0, ctx=h.ctx, engine=FakeEngine())
        with pytest.raises(Exception, match="cannot import module"):
            await asyncio.wait_for(node.run(), 10)


async def test_stop_drains_in_flight_work_and_flushes_the_outbox(tmp_path):
    items = make_items(8, n=2)
    cfg = make_cfg(tmp_path, rollout__credits=3)
    async with harness(cfg, items) as h:
        node = await h.add_rollout(FakeEngine(step_s=0.005))
        await wait_for(
            lambda: len(node.table.groups) == 3 and len(h.state.stored) >= 1, 10, "groups in flight"
        )
        in_hand = set(node.table.seqs) | set(h.state.stored)
        asked = len(h.state.requests)
        node.request_stop("test drain")
        await asyncio.wait_for(node.stopped.wait(), 10)
        assert in_hand <= set(h.state.stored), "in-flight work was not finished and delivered"
        h.check_arrivals()
        assert len(h.state.stored) < len(uids_of(items))  # it stopped taking prompts
        assert len(h.state.requests) <= asked + 1  # at most the one already on its way


def test_rollout_messages_round_trip_through_the_codec():
    from laminar.protocol.data import PartialTrajectory
    from laminar.transport.codec import decode, encode

    p = PartialTrajectory(
        uid="g/0",
        group_id="g",
        prompt_uid="u",
        sample_index=0,
        prompt_ids=np.arange(5, dtype=np.int32),
        response_ids=np.arange(3, dtype=np.int32),
        logprobs=np.full(3, -0.5, np.float32),
        version=2,
        n=4,
        row={"answer": "7"},
    )
    for msg in (
        ExportRequest(uids=["g/0"]),
        ExportReply(partials=[p], missing=["x/1"], version=2),
        ImportRequest(partials=[p]),
        ImportReply(accepted=["g/0"], version=2),
        RefreshRequest(min_version=3),
        RefreshReply(version=2, pending=True),
    ):
        back = decode(encode(msg))
        assert type(back) is type(msg)
        if isinstance(msg, (ExportReply, ImportRequest)):
            q = back.partials[0]
            assert (
                q.response_ids.tolist() == [0, 1, 2] and q.version == 2 and q.row == {"answer": "7"}
            )
        else:
            assert back == msg


# ---- refill: prompts asked for while the weights load ---------------------------------------


class _FlakySource:
    """A weight source (announce-style: no tensors) at version 1 from the start, whose first load
    fails."""

    name = "flaky"
    last_source = ""

    def __init__(self) -> None:
        from laminar.weights.announce import AnnounceSubscriber

        self.inner = AnnounceSubscriber()
        self.inner.announce(1)
        self.failures = 1

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def announce(self, version: int) -> None:
        self.inner.announce(version)

    def latest_version(self) -> int:
        return self.inner.latest_version()

    async def wait_newer(self, than: int, timeout: float) -> int:
        return await self.inner.wait_newer(than, timeout)

    async def load_into(self, engine) -> int:
        from laminar.weights.channel import WeightsUnavailable

        if self.failures:
            self.failures -= 1
            raise WeightsUnavailable("relay restarting (test)")
        return await self.inner.load_into(engine)


async def test_idle_rollout_asks_for_prompts_while_loading_and_never_runs_them_below_that_version(
    tmp_path,
):
    """Refill: an idle rollout with a newer version available sends its PromptRequest (declaring
    the version it is loading) while the load runs. When that load fails, the groups it was
    served wait for the declared version instead of running on the old weights."""
    items = make_items(4, n=2)
    cfg = make_cfg(tmp_path, mode="laminar", rollout__weights="announce")
    async with harness(cfg, items) as h:
        engine = FakeEngine()
        node = build_node(cfg, "rollout", 0, ctx=h.ctx, engine=engine, weight_source=_FlakySource())
        await h.start_node(node)
        await h.wait_stored(uids_of(items), 20)
        first = h.state.requests[0]
        assert first.version == 1  # asked for v1 while still at v0 (the load in flight)
        assert (
            node.metrics.counters.get("prompts_deferred", 0) >= 1
        )  # the first load failed meanwhile
        assert engine.loads == [1] and node.gate.version == 1
        assert {t.version for t in h.state.stored.values()} == {1}
