"""Samples the buffer holds on a live rollout that runs them no more are found and placed again
(laminar/manager/reconcile.py).

    .venv/bin/python -m pytest tests/test_reconcile.py -q

The verdicts alone (`judge`), then a round against a real buffer node (tests/test_buffer_node.py's
harness) with the manager's rollouts faked: a sample a repack export took off its rollout, whose
placement the manager never made (it died, or lost the export's reply), is recovered with the
tokens the buffer holds, announced and imported elsewhere, and the buffer takes it from there.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog

from laminar.manager.placement import Placer
from laminar.manager.reconcile import Reconciler, Suspect, judge
from laminar.metrics import Metrics
from laminar.protocol.buffer import HeldReply, HeldRequest, PartialsRequest, SamplesPlaced
from laminar.protocol.core import NodeStatus
from laminar.protocol.rollout import ImportReply, ImportRequest, RolloutStatus
from laminar.transport.session import Ack
from laminar.transport.sockets import Peer, RemoteError
from tests import test_buffer_node
from tests.pool_entries import first_entry
from tests.test_buffer_node import N, finished
from tests.test_claims import SIM, _Server, a_started_sample, until

harness = test_buffer_node.harness


def _rs(names: dict[str, int], at: float, outbox: int = 0, oldest: float = 0.0) -> RolloutStatus:
    return RolloutStatus(
        traj_tokens=names,
        kv_capacity_tokens=1000,
        measured_at=at,
        target_version=0,
        outbox=outbox,
        outbox_oldest_s=oldest,
    )


def test_a_sample_missing_from_two_statuses_in_a_row_is_stranded():
    held = {"r0": ["g/0", "g/1"]}
    keep, out = judge(held, {"r0": _rs({"g/1": 5}, 100.0)}, {}, set())
    assert out == {} and keep == {"g/0": Suspect("r0", 100.0)}
    # the same status read again proves nothing new: still a suspect, first miss kept
    keep2, out = judge(held, {"r0": _rs({"g/1": 5}, 100.0)}, keep, set())
    assert out == {} and keep2 == keep
    keep3, out = judge(held, {"r0": _rs({"g/1": 6}, 115.0)}, keep2, set())
    assert out == {"r0": ["g/0"]} and keep3 == {}


def test_a_sample_named_again_or_in_the_placers_hands_is_never_stranded():
    held = {"r0": ["g/0"]}
    keep, _ = judge(held, {"r0": _rs({}, 100.0)}, {}, set())
    keep, out = judge(held, {"r0": _rs({"g/0": 9}, 115.0)}, keep, set())  # imported meanwhile
    assert out == {} and keep == {}
    keep, _ = judge(held, {"r0": _rs({}, 100.0)}, {}, {"g/0"})
    assert keep == {}
    keep, out = judge(held, {"r0": _rs({}, 115.0)}, {"g/0": Suspect("r0", 100.0)}, {"g/0"})
    assert out == {} and keep == {}


def test_a_rollout_not_judged_or_a_new_holder_starts_over():
    suspects = {"g/0": Suspect("r0", 100.0)}
    # r0 skipped this round (a move under way, being recovered): nothing is judged, nothing kept
    keep, out = judge({"r0": ["g/0"]}, {}, suspects, set())
    assert out == {} and keep == {}
    # the buffer puts it on r1 now (placed there): a first miss on r1, not a second on r0
    keep, out = judge({"r1": ["g/0"]}, {"r1": _rs({}, 120.0)}, suspects, set())
    assert out == {} and keep == {"g/0": Suspect("r1", 120.0)}


def test_a_sample_that_may_sit_in_the_outbox_waits():
    suspects = {"g/0": Suspect("r0", 100.0)}
    held = {"r0": ["g/0"]}
    # an unacked trajectory 20 s old at 115: finished before the first miss, so it may be g/0
    keep, out = judge(held, {"r0": _rs({}, 115.0, outbox=1, oldest=20.0)}, suspects, set())
    assert out == {} and keep == suspects
    # the outbox's oldest is 5 s old: finished after g/0 was first missed, so not g/0
    keep, out = judge(held, {"r0": _rs({}, 115.0, outbox=1, oldest=5.0)}, suspects, set())
    assert out == {"r0": ["g/0"]} and keep == {}


def _status(node: str, names: dict[str, int], at: float) -> NodeStatus:
    return NodeStatus(node_id=node, role="rollout", version=0, running=1, rollout=_rs(names, at))


async def test_a_sample_exported_and_never_placed_is_recovered_and_taken_from_its_new_rollout(
    harness,
):
    h = await harness(**SIM)
    r0, mgr, item = await a_started_sample(h)
    r1 = await h.client("r1")
    lost, kept = f"{item.group_id}/0", f"{item.group_id}/1"
    await r0.send(first_entry(item, 1, "r0", [4]))

    async def held() -> dict[str, list[str]]:
        rep = await mgr.request(HeldRequest(rollout_ids=["r0", "r1"], round=time.time_ns()))
        assert isinstance(rep, HeldReply)
        return {k: sorted(v) for k, v in rep.held.items()}

    assert await until(held, {"r0": sorted([lost, kept])})
    # r0 exported `lost` to a manager that died before placing it: r0's statuses name `kept` only
    t = time.time()
    peers = [
        Peer(node_id="r0", role="rollout", identity=b"r0", status=_status("r0", {kept: 5}, t)),
        Peer(node_id="r1", role="rollout", identity=b"r1", status=_status("r1", {}, t)),
    ]
    srv = _Server(peers, {ImportRequest: ImportReply(accepted=[lost])})
    metrics, log = Metrics(), structlog.get_logger("test")

    async def buffer():
        return mgr

    placer = Placer(srv, 8, 5.0, metrics, log, buffer=buffer)  # type: ignore[arg-type]
    rec = Reconciler(placer, buffer, 5.0, metrics, log)  # type: ignore[arg-type]
    rec.max_uids = 1  # pages of one uid: the round reads them all
    first = await rec.round(0, set)
    assert first["stranded"] == 0 and rec.suspects == {lost: Suspect("r0", t)}
    # a move from r0 begins: r0 is left alone, and its suspects start over afterwards
    assert (await rec.round(0, lambda: {"r0"}))["stranded"] == 0 and rec.suspects == {}
    await rec.round(0, set)
    peers[0].status = _status("r0", {kept: 6}, t + 15)
    second = await rec.round(0, set)
    assert second["stranded"] == 1 and second["placed"] == {"r1": 1}
    imports = [(n, m) for n, m in srv.sent if isinstance(m, ImportRequest)]
    assert [(n, [(p.uid, p.response_ids.tolist()) for p in m.partials]) for n, m in imports] == [
        ("r1", [(lost, [1, 2, 3])])
    ]
    assert metrics.counters["reconciled_stranded"] == 1
    assert await held() == {"r0": [kept], "r1": [lost]}
    # the buffer takes it from r1 alone now; r0's copy (had it one) is refused
    assert (await r0.request(finished(item, 0, 0))).refused == "not_owner"
    assert not (await r1.request(finished(item, 0, 0, rollout="r1"))).refused
    assert N == 2


async def test_held_names_each_sample_by_the_owner_recovery_uses(harness):
    r0, mgr, item = await a_started_sample(await harness(**SIM))
    moved, kept = f"{item.group_id}/0", f"{item.group_id}/1"
    await r0.send(first_entry(item, 1, "r0", [4]))

    async def held(ids: list[str]) -> dict[str, list[str]]:
        rep = await mgr.request(HeldRequest(rollout_ids=ids, round=time.time_ns()))
        assert isinstance(rep, HeldReply)
        return {k: sorted(v) for k, v in rep.held.items()}

    assert await until(lambda: held(["r0"]), {"r0": sorted([moved, kept])})
    assert isinstance(await mgr.request(SamplesPlaced(dest="r1", uids=[moved])), Ack)
    assert await held(["r0", "r1"]) == {"r0": [kept], "r1": [moved]}
    assert await held(["r1"]) == {"r1": [moved]}  # only the rollouts asked about
    got = (await mgr.request(PartialsRequest(uids=[moved]))).partials
    assert [p.response_ids.tolist() for p in got] == [[1, 2, 3]]
    # a rollout may not ask (the manager's question alone)
    with pytest.raises(RemoteError, match="unauthorized"):
        await r0.request(HeldRequest(rollout_ids=["r0"]))


def test_a_sample_waiting_for_its_reward_waits_too():
    suspects = {"g/0": Suspect("r0", 100.0)}
    held = {"r0": ["g/0"]}
    st = _rs({}, 115.0)
    st.scoring, st.scoring_oldest_s = 1, 16.0  # finished before the first miss: may be g/0
    keep, out = judge(held, {"r0": st}, suspects, set())
    assert out == {} and keep == suspects
    st.scoring_oldest_s = 3.0
    assert judge(held, {"r0": st}, suspects, set())[1] == {"r0": ["g/0"]}


async def test_the_rollout_counts_a_finished_sample_from_its_finish_until_acked():
    """What the rollout's status says of a finished sample the table forgot: waiting for its
    reward (scoring), then in the outbox with its wait counted from the finish, reward included,
    so `judge` cannot take a slowly scored sample for stranded."""
    from laminar.rewards.runner import RewardResult
    from laminar.rollout.deliver import Deliverer
    from laminar.rollout.outbox import Outbox
    from laminar.rollout.tracking import SeqState
    from tests.test_partial_batch import item

    release = asyncio.Event()

    class SlowReward:
        async def score(self, prompt, completion, row):
            await release.wait()
            return RewardResult(1.0)

    log = structlog.get_logger("test")
    outbox = Outbox(None, log)  # type: ignore[arg-type]  # its senders are not run
    d = Deliverer(
        "r0",
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        outbox=outbox,
        latest_version=lambda: 0,
        rewards=SlowReward(),  # type: ignore[arg-type]
        tokenizer=None,
        spawn=lambda coro, name: asyncio.create_task(coro, name=name),  # type: ignore[arg-type]
        metrics=Metrics(),
        log=log,
    )
    seq = SeqState.from_item(item(0), 0, version=0, now=1.0)
    assert d.scoring() == (0, 0.0)
    t0 = time.monotonic()
    d.finished(seq, "stop")
    t1 = time.monotonic()
    n, _ = d.scoring()
    assert n == 1 and len(outbox) == 0
    async with asyncio.timeout(5):
        while time.monotonic() - t0 < 0.05:  # some reward time passes
            await asyncio.sleep(0.01)
        release.set()
        while not len(outbox):
            await asyncio.sleep(0.01)
    put = time.monotonic()
    assert d.scoring() == (0, 0.0) and len(outbox) == 1
    # its wait counts from the finish, not from the put after the reward's 0.05 s
    assert t0 <= outbox.oldest_since[seq.uid] <= t1 < put - 0.04


def test_a_round_is_one_pass_served_in_pages(monkeypatch):
    from types import SimpleNamespace

    from laminar.buffer import holders
    from laminar.buffer.holders import HeldPages
    from laminar.buffer.partials import PartialPool

    pool = PartialPool()
    for r, n in (("r0", 3), ("r1", 1), ("r2", 5)):
        for k in range(n):
            pool.records[f"{r}g/{k}"] = SimpleNamespace(header=SimpleNamespace(rollout_id=r))  # type: ignore[assignment]
    passes = 0
    real = holders.held_by

    def counted(*a, **kw):
        nonlocal passes
        passes += 1
        return real(*a, **kw)

    monkeypatch.setattr(holders, "held_by", counted)
    pages = HeldPages()
    ids = ["r0", "r1", "r2"]
    got = [pages.page(pool, {"r2g/0": "r1"}, ids, 7, max_uids=4) for _ in range(3)]
    # whole rollouts while they fit, a rollout over a page cut to its first max_uids
    assert got == [
        ({"r0": ["r0g/0", "r0g/1", "r0g/2"]}, True),
        ({"r1": ["r1g/0", "r2g/0"]}, True),
        ({"r2": ["r2g/1", "r2g/2", "r2g/3", "r2g/4"]}, False),
    ]
    assert passes == 1  # one pass over the records for the round
    assert pages.page(pool, {}, ["r1"], 8, max_uids=4) == ({"r1": ["r1g/0"]}, False)  # a new round
