"""The rollout's outbox sending several finished samples in one Deliveries (rollout.deliver_
window_frac): who waits how long, what goes together, and that each sample still meets the fate
it would meet alone (acked, refused, rejected, unencodable, retried).

    .venv/bin/python -m pytest tests/test_outbox.py -q

The buffer's side (each item answered as if alone, one reply once durable) is in
tests/test_buffer_node.py; the nested items' sender rules in tests/test_authorization.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import structlog

from laminar.message import Message
from laminar.protocol.buffer import Deliveries, DeliveryAcks, TrajectoryAbandoned, TrajectoryAck
from laminar.protocol.data import Trajectory
from laminar.rollout.outbox import MAX_ITEMS, Outbox
from laminar.transport import codec
from laminar.transport.sockets import PeerDead, RemoteError
from tests.rollout_fakes import a_trajectory


def _trajectory(uid: str, gen_s: float = 1.0, **over: Any) -> Trajectory:
    return a_trajectory(uid, timings={"gen_s": gen_s}, **over)


class _Buffer:
    """An RpcClient stand-in: encodes each request as the real one does, answers each sample with
    `answer(sample)` (a TrajectoryAck, or an exception to raise for a sample sent alone)."""

    def __init__(self, answer: Callable[[Message], Any] = lambda m: TrajectoryAck()):
        self.answer, self.sent = answer, []
        self.arrived = asyncio.Event()

    async def request(self, msg: Any, timeout: float, retries: int) -> Any:
        codec.encode(msg)  # what RpcClient does first: raises what the wire cannot carry
        self.sent.append(msg)
        self.arrived.set()
        if isinstance(msg, Deliveries):
            items = [*msg.trajectories, *msg.abandoned]
            if any(isinstance(self.answer(m), Exception) for m in items):
                raise RemoteError("protocol", "a malformed item")
            return DeliveryAcks(acks=[self.answer(m) for m in items])
        reply = self.answer(msg)
        if isinstance(reply, Exception):
            raise reply
        return reply


def _outbox(buf: _Buffer, frac: float = 0.5, most: float = 1.0) -> Outbox:
    return Outbox(
        buf,  # type: ignore[arg-type]
        structlog.get_logger("test"),
        concurrency=2,
        backoff_s=0.01,
        window_frac=frac,
        window_max_s=most,
    )


async def _running(box: Outbox) -> asyncio.Task[None]:
    return asyncio.create_task(box.run())


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _deliver(box: Outbox, msgs: list[Message], wait_until: Any) -> None:
    """Put `msgs`, run the outbox until nothing is pending, stop it."""
    for m in msgs:
        box.put(m)
    task = await _running(box)
    try:
        await wait_until(lambda: not box.pending, 5, "all settled")
    finally:
        await _stop(task)


def _uids(msg: Message) -> list[str]:
    if isinstance(msg, Deliveries):
        return [m.uid for m in (*msg.trajectories, *msg.abandoned)]
    return [msg.uid]  # type: ignore[attr-defined]


def test_the_window_is_a_share_of_the_mean_generation_time_capped():
    box = _outbox(_Buffer(), frac=0.1, most=0.5)
    assert box.window_s() == 0.0  # nothing finished yet: nothing to wait for
    box.put(_trajectory("g/0", gen_s=2.0))
    assert box.window_s() == pytest.approx(0.2)
    for i in range(1, 200):  # the running mean follows the recent ones
        box.put(_trajectory(f"g/{i}", gen_s=20.0))
    assert box.gen_s_mean == pytest.approx(20.0, rel=0.01)
    assert box.window_s() == 0.5  # capped (rollout.partial_flush_s)
    off = _outbox(_Buffer(), frac=0.0)
    off.put(_trajectory("g/0", gen_s=2.0))
    assert off.window_s() == 0.0


async def test_a_window_of_finished_samples_goes_as_one_message_each_acked(wait_until):
    buf = _Buffer()
    box = _outbox(buf, frac=0.1)  # window 0.1 s of the 1 s mean
    abandon = TrajectoryAbandoned(uid="g/3", group_id="g", reason="engine abort")
    await _deliver(box, [*(_trajectory(f"g/{i}") for i in range(3)), abandon], wait_until)
    assert len(buf.sent) == 1 and isinstance(buf.sent[0], Deliveries)
    assert _uids(buf.sent[0]) == ["g/0", "g/1", "g/2", "g/3"]
    assert box.stats["acked"] == 4 and box.stats["messages"] == 1


async def test_without_a_window_each_sample_goes_alone_at_once(wait_until):
    buf = _Buffer()
    await _deliver(_outbox(buf, frac=0.0), [_trajectory(f"g/{i}") for i in range(3)], wait_until)
    assert [type(m).__name__ for m in buf.sent] == ["Trajectory"] * 3


async def test_a_sample_waits_its_window_for_others_then_goes(wait_until):
    """One sample waits (up to the window from when it was put) and one put meanwhile goes with
    it; a sample alone in its window goes as a plain Trajectory."""
    buf = _Buffer()
    box = _outbox(buf, frac=0.3)  # 0.3 s
    task = await _running(box)
    try:
        box.put(_trajectory("g/0"))
        t0 = asyncio.get_running_loop().time()
        await asyncio.sleep(0)  # the collector takes g/0 and waits
        box.put(_trajectory("g/1"))
        await wait_until(lambda: not box.pending, 5, "both acked")
        waited = asyncio.get_running_loop().time() - t0
        box.put(_trajectory("h/0"))
        await wait_until(lambda: not box.pending, 5, "the lone one acked")
    finally:
        await _stop(task)
    assert waited >= 0.25  # its window, not at once
    assert [_uids(m) for m in buf.sent] == [["g/0", "g/1"], ["h/0"]]
    assert isinstance(buf.sent[1], Trajectory)


async def test_flush_sends_at_once_without_waiting_for_the_window():
    buf = _Buffer()
    box = _outbox(buf, frac=0.5, most=10.0)  # a 0.5 s window
    box.put(_trajectory("g/0"))
    box.put(_trajectory("g/1"))
    task = await _running(box)
    try:
        t0 = asyncio.get_running_loop().time()
        assert await box.flush(timeout=5.0)
        assert asyncio.get_running_loop().time() - t0 < 0.4
    finally:
        await _stop(task)
    assert box.stats["acked"] == 2


async def test_each_sample_meets_its_own_fate_in_a_shared_message(wait_until):
    """Acked, acked as a duplicate, refused as never takeable (its member abandoned next),
    refused as another's (nothing abandoned), rejected as malformed (abandoned next)."""
    fates = {
        "g/0": TrajectoryAck(),
        "g/1": TrajectoryAck(duplicate=True),
        "g/2": TrajectoryAck(refused="reward_range"),
        "g/3": TrajectoryAck(refused="not_owner"),
        "g/4": TrajectoryAck(rejected="logprobs and response_ids differ in length"),
    }
    buf = _Buffer(lambda m: fates[m.uid] if isinstance(m, Trajectory) else TrajectoryAck())
    box = _outbox(buf, frac=0.1)
    for uid in fates:
        box.put(_trajectory(uid))
    task = await _running(box)
    try:
        await wait_until(lambda: not box.pending and box.stats["abandoned"] == 2, 5, "settled")
    finally:
        await _stop(task)
    assert box.stats["acked"] == 2 + 2  # g/0, g/1 and the two abandons
    assert box.stats["refused"] == 2 and box.stats["rejected"] == 1
    abandons = [m for msg in buf.sent for m in getattr(msg, "abandoned", [msg])]
    abandons = [m for m in abandons if isinstance(m, TrajectoryAbandoned)]
    assert sorted((a.uid, a.reason) for a in abandons) == [
        ("g/2", "refused_reward_range"),
        ("g/4", "rejected"),
    ]


async def test_a_message_rejected_whole_is_split_so_only_the_bad_sample_is_lost(wait_until):
    """A malformed item the buffer could not even decode (ErrorReply "protocol" for the whole
    Deliveries) and one the wire cannot carry: each item goes alone next, the good ones are
    acked and only the bad ones are dropped and abandoned."""
    bad = RemoteError("protocol", "bad logprobs")

    def answer(m: Message) -> Any:
        return bad if isinstance(m, Trajectory) and m.uid == "g/1" else TrajectoryAck()

    buf = _Buffer(answer)
    box = _outbox(buf, frac=0.1)
    box.put(_trajectory("g/0"))
    box.put(_trajectory("g/1"))
    box.put(_trajectory("g/2", reward_info={"big": 2**64}))  # no msgpack integer holds it
    box.put(_trajectory("g/3"))
    task = await _running(box)
    try:
        await wait_until(lambda: not box.pending and box.stats["abandoned"] == 2, 5, "settled")
    finally:
        await _stop(task)
    assert box.stats["split"] >= 1
    assert box.stats["acked"] == 2 + 2  # g/0, g/3 and the two abandons
    assert box.stats["rejected"] == 1 and box.stats["unencodable"] == 1
    delivered = [u for m in buf.sent for u in _uids(m) if not isinstance(m, Deliveries)]
    assert {"g/0", "g/3"} <= set(delivered)


async def test_a_transport_failure_puts_every_sample_back(wait_until):
    failures = [PeerDead("buffer restarting")]

    class Flaky(_Buffer):
        async def request(self, msg: Any, timeout: float, retries: int) -> Any:
            if failures:
                self.sent.append(msg)
                raise failures.pop()
            return await super().request(msg, timeout, retries)

    buf = Flaky()
    box = _outbox(buf, frac=0.1)
    await _deliver(box, [_trajectory(f"g/{i}") for i in range(5)], wait_until)
    assert box.stats["retries"] == 1 and box.stats["acked"] == 5
    assert sorted(_uids(buf.sent[0])) == sorted(_uids(buf.sent[1])) == [f"g/{i}" for i in range(5)]


async def test_a_message_carries_at_most_max_items(wait_until):
    buf = _Buffer()
    box = _outbox(buf, frac=0.1)
    n = MAX_ITEMS + 5
    await _deliver(box, [_trajectory(f"g/{i}") for i in range(n)], wait_until)
    sizes = sorted(len(_uids(m)) for m in buf.sent)
    assert max(sizes) == MAX_ITEMS and sum(sizes) == n and box.stats["acked"] == n
