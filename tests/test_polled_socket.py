"""PolledSocket (laminar/transport/polled.py): a ROUTER read and written from the loop's reader on
its descriptor. No message is left unread when a send takes the wake-up in, bursts gathered by a
busy reader arrive whole and in order, a lone message after a busy spell still wakes the reader,
a send to a peer at its HWM times out, and closing wakes a waiting reader."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import zmq
import zmq.asyncio

from laminar.transport.polled import PolledSocket
from laminar.transport.sockets import PeerDead, SendTimeout


async def _pair(
    tmp_path, hwm: int = 1000
) -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket, zmq.asyncio.Socket, PolledSocket]:
    ctx = zmq.asyncio.Context()
    ep = f"ipc://{tmp_path}/s-{uuid.uuid4().hex[:6]}.sock"
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, hwm)
    router.bind(ep)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"peer")
    dealer.setsockopt(zmq.RCVHWM, hwm)
    dealer.connect(ep)
    return ctx, router, dealer, PolledSocket(router)


def _close(ctx: zmq.asyncio.Context, io: PolledSocket, *socks: zmq.asyncio.Socket) -> None:
    io.close()
    for s in socks:
        s.close(linger=0)
    ctx.term()


async def test_every_message_arrives_while_sends_take_the_wakeups_in(tmp_path):
    ctx, router, dealer, io = await _pair(tmp_path)
    n = 2000

    async def client() -> None:
        for i in range(n):
            await dealer.send_multipart([b"", str(i).encode()])
            if i % 50 == 0:
                await asyncio.sleep(0.001)  # spells of quiet: the reader waits on the descriptor

    async def replier() -> None:  # sends from another task while the reader waits
        while True:
            await asyncio.sleep(0.0005)
            io.send_now([b"peer", b"", b"beat"])

    got: list[int] = []

    async def reader() -> None:
        while len(got) < n:
            frames = await io.recv()
            got.append(int(frames[-1].bytes))

    beats = asyncio.ensure_future(replier())
    try:
        await asyncio.wait_for(asyncio.gather(client(), reader()), 20)
    finally:
        beats.cancel()
        _close(ctx, io, router, dealer)
    assert got == list(range(n))  # whole, in order, none left behind


async def test_a_lone_message_after_a_busy_spell_wakes_the_reader(tmp_path):
    ctx, router, dealer, io = await _pair(tmp_path)
    try:
        for i in range(500):  # a burst: the reader goes into its gathering mode
            await dealer.send_multipart([b"", b"%d" % i])
        for i in range(500):
            assert (await asyncio.wait_for(io.recv(), 5))[-1].bytes == b"%d" % i
        for k in range(3):  # then one at a time, with quiet between: each still arrives
            await asyncio.sleep(0.05)
            await dealer.send_multipart([b"", b"late%d" % k])
            frames = await asyncio.wait_for(io.recv(), 5)
            assert frames[0].bytes == b"peer" and frames[-1].bytes == b"late%d" % k
        # the counters the control-plane bench reads (messages per wake-up): every message
        # counted; a reader that finds the socket empty waits on the descriptor once (after a
        # pause to gather, if it took two or more since it last waited)
        assert io.received == 503
        gathers, waits = io.gathers, io.waits
        waiting = asyncio.ensure_future(io.recv())
        await asyncio.sleep(0.05)
        await dealer.send_multipart([b"", b"last"])
        assert (await asyncio.wait_for(waiting, 5))[-1].bytes == b"last"
        assert io.received == 504 and io.waits == waits + 1 and io.gathers - gathers in (0, 1)
    finally:
        _close(ctx, io, router, dealer)


async def test_a_send_to_a_peer_at_its_hwm_times_out(tmp_path):
    ctx, router, dealer, io = await _pair(tmp_path, hwm=4)
    try:
        await dealer.send_multipart([b"", b"hello"])  # the router learns the peer's identity
        await asyncio.wait_for(io.recv(), 5)
        with pytest.raises(SendTimeout):  # the dealer never reads: its pipe fills
            for _ in range(10_000):
                await io.send([b"peer", b"", b"x" * 1024], timeout=0.2)
        with pytest.raises(zmq.ZMQError):  # no such peer (ROUTER_MANDATORY)
            io.send_now([b"nobody", b"", b"x"])
    finally:
        _close(ctx, io, router, dealer)


async def test_closing_wakes_a_waiting_reader(tmp_path):
    ctx, router, dealer, io = await _pair(tmp_path)
    waiting = asyncio.ensure_future(io.recv())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    io.close()
    with pytest.raises(PeerDead):
        await asyncio.wait_for(waiting, 5)
    router.close(linger=0)
    dealer.close(linger=0)
    ctx.term()


async def test_a_busy_reader_does_not_make_the_loop_spin(tmp_path):
    """Messages queued while the reader is away (awaiting something else): the descriptor's
    callback takes the signal in, so the loop does not call it at every turn meanwhile."""
    ctx, router, dealer, io = await _pair(tmp_path)
    calls = 0
    on_fd = io._on_fd

    def counted() -> None:
        nonlocal calls
        calls += 1
        on_fd()

    loop = asyncio.get_running_loop()
    loop.remove_reader(io._fd)
    loop.add_reader(io._fd, counted)
    try:
        for i in range(5):
            await dealer.send_multipart([b"", b"%d" % i])
        await asyncio.sleep(0.3)  # the reader is away: nobody receives
        assert calls < 50  # a spinning loop would call it thousands of times in 0.3 s
        for i in range(5):
            assert (await asyncio.wait_for(io.recv(), 5))[-1].bytes == b"%d" % i
    finally:
        _close(ctx, io, router, dealer)
