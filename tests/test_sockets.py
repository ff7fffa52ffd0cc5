"""Sockets: bad input never stops a server, liveness bounds, deadlines, no leaked cancellations,
PUB/SUB barrier, PUSH/PULL HWM.

    .venv/bin/python -m pytest tests/test_sockets.py -q

Heartbeats run every 100 ms with 4 beats to death (fast_opts), so "dead within the
bound" means within interval*liveness (0.4 s) plus one check interval plus a slack
for a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import msgpack
import pytest
import zmq

import laminar.protocol  # noqa: F401
from laminar.protocol.manager import StatusRequest
from laminar.transport.client import RpcClient
from laminar.transport.codec import decode, encode
from laminar.transport.server import RpcServer
from laminar.transport.session import (
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    Ping,
    Pong,
    StatusCodec,
    Welcome,
)
from laminar.transport.sockets import PeerDead, RemoteError, RequestTimeout, TransportError
from laminar.transport.streams import Publisher, PullStream, PushStream, Subscriber

SLACK_S = 0.3  # scheduling noise on 2 busy cores


def _rid(n: int) -> bytes:
    return b"Q" + n.to_bytes(8, "little")


async def _echo_server(zctx, endpoint, opts, **kw) -> RpcServer:
    srv = RpcServer(zctx, endpoint, "srv-0", "test", opts, **kw)
    srv.on(Ping, lambda peer, m: Pong(payload=m.payload))
    await srv.start()
    return srv


async def _recv_all(sock, timeout: float) -> list[list[bytes]]:
    out = []
    while True:
        try:
            out.append(await asyncio.wait_for(sock.recv_multipart(), timeout))
        except TimeoutError:
            return out


# ---- bad input -------------------------------------------------------------------------------


def _garbage(rng: random.Random) -> list[list[bytes]]:
    ping = encode(Ping(payload="x"))
    fixed = [
        [b"only-one-frame"],  # too few frames for an envelope
        [b"", b"\xff"],  # one frame after the rid: not a message
        [b"Xbadrid", *ping],  # malformed request id
        [_rid(1), b"\xfe", msgpack.packb({})],  # unknown message type
        [_rid(2), bytes((Ping.TYPE,)), msgpack.packb({"payload": 5})],  # wrong field type
        [_rid(3), bytes((Ping.TYPE,)), b"\xc1\xc1"],  # header is not msgpack
        [_rid(4), *ping, b"extra-frame"],  # unreferenced frame
        [_rid(5), *ping],  # valid, but before Hello
        [
            _rid(6),
            *encode(Hello(protocol=PROTOCOL_VERSION + 99, node_id="old", role="x")),
        ],  # wrong protocol
    ]
    rand = [
        [rng.randbytes(rng.randint(0, 24)) for _ in range(rng.randint(1, 5))] for _ in range(150)
    ]
    return fixed * 10 + rand


async def test_server_keeps_serving_through_a_flood_of_malformed_frames(
    zctx, ipc, fast_opts, wait_until
):
    ep = ipc("flood")
    srv = await _echo_server(zctx, ep, fast_opts())
    good = RpcClient(zctx, ep, "good-0", "test", fast_opts(request_timeout_s=3.0))
    await good.connect()
    bad = zctx.socket(zmq.DEALER)
    bad.linger = 0
    bad.connect(ep)
    garbage = _garbage(random.Random(7))

    async def flood() -> None:
        for frames in garbage:
            await bad.send_multipart(frames)

    async def serve_good() -> list[str]:
        return [(await good.request(Ping(payload=f"p{i}"))).payload for i in range(60)]

    _, payloads = await asyncio.gather(flood(), serve_good())
    assert payloads == [f"p{i}" for i in range(60)]
    # every bad message is counted exactly once, as a bad frame or as traffic from an unknown peer
    await wait_until(
        lambda: srv.stats.bad_frames + srv.stats.unknown_peer >= len(garbage),
        5,
        "all garbage counted",
    )
    assert srv.stats.bad_frames + srv.stats.unknown_peer == len(garbage)
    assert srv.stats.unknown_peer >= 10 and srv.stats.bad_frames >= 80
    assert all(not t.done() for t in srv.tasks), "a server task died"
    assert set(srv.peers) == {"good-0"}
    # replies where a reply is possible: typed errors saying what was wrong
    codes = {decode(f[1:]).code for f in await _recv_all(bad, 0.3) if len(f) > 2}
    assert {"protocol", "unknown_peer", "protocol_version"} <= codes
    assert (await good.request(Ping(payload="after"))).payload == "after"
    await good.close()
    bad.close()
    await srv.close()


async def test_registered_peer_sending_garbage_is_counted_and_still_served(zctx, ipc, fast_opts):
    ep = ipc("peer")
    srv = await _echo_server(zctx, ep, fast_opts())
    raw = zctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(ep)
    await raw.send_multipart(
        [_rid(1), *encode(Hello(protocol=PROTOCOL_VERSION, node_id="raw-0", role="cli"))]
    )
    assert isinstance(decode((await asyncio.wait_for(raw.recv_multipart(), 2))[1:]), Welcome)
    await raw.send_multipart([_rid(2), bytes((Ping.TYPE,)), msgpack.packb({"payload": [1]})])
    # a type this server has no handler for (from a role that may send it)
    await raw.send_multipart([_rid(3), *encode(StatusRequest())])
    await raw.send_multipart([_rid(4), *encode(Ping(payload="ok"))])
    replies = {}
    while len(replies) < 3:
        frames = await asyncio.wait_for(raw.recv_multipart(), 2)
        if frames[0][:1] == b"R":
            replies[frames[0][1:]] = decode(frames[1:])
    assert isinstance(replies[_rid(2)[1:]], ErrorReply) and replies[_rid(2)[1:]].code == "protocol"
    assert "payload" in replies[_rid(2)[1:]].message
    assert replies[_rid(3)[1:]].code == "unhandled"
    assert replies[_rid(4)[1:]] == Pong(payload="ok")
    assert srv.stats.bad_frames == 2 and srv.stats.unhandled == 1
    raw.close()
    await srv.close()


async def test_client_survives_garbage_from_its_server(zctx, ipc, fast_opts, wait_until):
    ep = ipc("evil")
    router = zctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(ep)
    cli = RpcClient(zctx, ep, "cli-0", "test", fast_opts(heartbeat_interval_s=0.5))

    async def evil_server() -> None:
        ident, rid, *_ = await router.recv_multipart()
        await router.send_multipart(
            [
                ident,
                b"R" + rid[1:],
                *encode(Welcome(protocol=PROTOCOL_VERSION, node_id="evil", role="x")),
            ]
        )
        for frames in (
            [b"\x00"],
            [b"", b"\xfe", b""],
            [b"R" + bytes(8), b"\x09", b"\xc1"],
            [b"Q" + bytes(8), *encode(Ping())],
        ):
            await router.send_multipart([ident, *frames])

    await asyncio.gather(cli.connect(timeout=2), evil_server())
    await wait_until(
        lambda: cli.stats.bad_frames >= 3 and cli.stats.unhandled >= 1,
        2,
        "client counted the garbage",
    )
    assert cli.connected and all(not t.done() for t in cli.tasks)
    await cli.close()
    router.close()


# ---- liveness --------------------------------------------------------------------------------


async def test_server_detects_a_dead_client_within_the_bound(zctx, ipc, fast_opts, wait_until):
    opts = fast_opts()
    died: dict[str, float] = {}
    srv = await _echo_server(
        zctx, ipc("hb"), opts, on_peer_dead=lambda p: died.setdefault(p.node_id, time.monotonic())
    )
    cli = RpcClient(zctx, srv.endpoint, "cli-0", "test", opts)
    await cli.connect()
    # alive while it beats: 6 heartbeat periods (1.5 death bounds) and no death
    await wait_until(lambda: cli.stats.received >= 6, 3, "6 server heartbeats")
    assert srv.stats.peers_dead == 0 and srv.peers["cli-0"].alive
    await cli.close(say_bye=False)  # vanishes without a word
    last_seen = srv.peers["cli-0"].last_seen
    await wait_until(lambda: "cli-0" in died, 3, "server noticing the dead client")
    delay = died["cli-0"] - last_seen
    assert opts.dead_after_s <= delay <= opts.dead_after_s + opts.heartbeat_interval_s + SLACK_S, (
        delay
    )
    assert not srv.peers["cli-0"].alive and srv.stats.peers_dead == 1
    with pytest.raises(PeerDead):
        await srv.send("cli-0", Ping())
    await srv.close()


async def test_client_detects_dead_server_and_reconnects_on_a_fresh_socket(
    zctx, ipc, fast_opts, wait_until
):
    opts = fast_opts()
    ep = ipc("hb2")
    srv = await _echo_server(zctx, ep, opts)
    died: list[float] = []
    cli = RpcClient(
        zctx, ep, "cli-0", "test", opts, on_server_dead=lambda: died.append(time.monotonic())
    )
    await cli.connect()
    await wait_until(lambda: cli.stats.received >= 3, 2, "server heartbeats")
    old_sock = cli._sock
    t_close = time.monotonic()
    await srv.close()
    await wait_until(lambda: bool(died), 3, "client noticing the dead server")
    assert died[0] - t_close <= opts.dead_after_s + opts.heartbeat_interval_s + SLACK_S, (
        died[0] - t_close
    )
    assert not cli.connected
    with pytest.raises(RequestTimeout):  # while the server is down: a bounded failure, not a hang
        await cli.request(Ping(payload="down"), timeout=0.2, retries=0)
    srv2 = await _echo_server(zctx, ep, opts)
    await wait_until(lambda: cli.connected, 3, "client reconnecting to the new server")
    assert cli._sock is not old_sock and cli.stats.reconnects >= 1
    assert "cli-0" in srv2.peers
    assert (await cli.request(Ping(payload="back"), timeout=1)).payload == "back"
    await cli.close()
    await srv2.close()


async def test_request_to_a_server_restarted_under_us_handshakes_again(zctx, ipc, fast_opts):
    """The server restarts on the same endpoint faster than heartbeats notice: the socket reconnects
    underneath, the new server answers unknown_peer, and the client handshakes again and retries."""
    # beats far apart: neither death detection nor the heartbeat path can recover, only the request
    # path
    opts = fast_opts(heartbeat_interval_s=30, heartbeat_liveness=100)
    ep = ipc("restart")
    srv = await _echo_server(zctx, ep, opts)
    cli = RpcClient(zctx, ep, "cli-0", "test", opts)
    await cli.connect()
    await srv.close()
    srv2 = await _echo_server(zctx, ep, opts)
    # a first attempt may still go down the old, dying pipe and time out; a later one reaches srv2
    rep = await cli.request(Ping(payload="again"), timeout=0.5, retries=4)
    assert rep.payload == "again"
    assert cli.stats.rehandshakes >= 1 and cli.stats.reconnects == 0
    assert "cli-0" in srv2.peers and srv2.stats.unknown_peer >= 1
    await cli.close()
    await srv2.close()


async def _client_of_a_restarted_server(
    zctx, ep: str, opts
) -> tuple[RpcClient, RpcServer, list[str]]:
    """A connected client whose server then restarted on the same endpoint: (the client, the new
    server, one entry per on_connect the client ran)."""
    srv = await _echo_server(zctx, ep, opts)
    joined: list[str] = []
    cli = RpcClient(zctx, ep, "cli-0", "test", opts, on_connect=lambda: joined.append("x"))
    await cli.connect()
    await srv.close()
    return cli, await _echo_server(zctx, ep, opts), joined


async def test_idle_client_rejoins_a_restarted_server_from_its_heartbeat(
    zctx, ipc, fast_opts, wait_until
):
    """An idle client only sends heartbeats; the restarted server answers one with unknown_peer,
    so the client rejoins (and the server can reach it again) without waiting to declare it dead."""
    opts = fast_opts(heartbeat_liveness=100)
    cli, srv2, joined = await _client_of_a_restarted_server(zctx, ipc("restart-idle"), opts)
    # both ends: the server registered it, and the client got Welcome and ran on_connect again
    await wait_until(
        lambda: "cli-0" in srv2.peers and len(joined) >= 2, 3, "the idle client rejoining"
    )
    assert cli.stats.rehandshakes >= 1 and cli.stats.reconnects == 0
    assert (await cli.request(Ping(payload="ok"), timeout=1)).payload == "ok"
    await cli.close()
    await srv2.close()


async def _ping_every(cli: RpcClient, period_s: float, until: float, one_way: bool) -> int:
    """Traffic at least once an interval: a Ping every `period_s` (a pacing timer) until
    `until`; returns how many went."""
    n = 0
    while time.monotonic() < until:
        if one_way:
            await cli.send(Ping(payload="busy"))
        else:
            await cli.request(Ping(payload="busy"), timeout=1)
        n += 1
        await asyncio.sleep(period_s)
    return n


async def test_a_busy_connection_beats_with_its_traffic_and_stays_alive(
    zctx, ipc, fast_opts, wait_until
):
    """Neither side has a status to carry: while requests and replies go at least once an
    interval, both skip their beats, and nobody is declared dead over several death bounds;
    once the traffic stops the beats come back and the connection stays up."""
    opts = fast_opts()
    srv = await _echo_server(zctx, ipc("busy"), opts)
    cli = RpcClient(zctx, srv.endpoint, "cli-0", "test", opts)
    await cli.connect()
    t0 = time.monotonic()
    busy_s = 4 * opts.dead_after_s
    await _ping_every(cli, opts.heartbeat_interval_s / 4, t0 + busy_s, one_way=False)
    ticks = busy_s / opts.heartbeat_interval_s
    # most ticks found traffic in their interval (a stalled loop may let a beat through)
    assert cli.stats.heartbeats_skipped >= ticks / 2, (cli.stats.heartbeats_skipped, ticks)
    assert srv.stats.heartbeats_skipped >= ticks / 2, (srv.stats.heartbeats_skipped, ticks)
    assert srv.stats.peers_dead == 0 and srv.peers["cli-0"].alive
    assert cli.stats.peers_dead == 0 and cli.connected
    # quiet: beats again on both sides (each counts what the other sent), alive past the bound
    sent, received = cli.stats.sent, cli.stats.received
    await wait_until(
        lambda: cli.stats.sent >= sent + 6 and cli.stats.received >= received + 6,
        3,
        "beats resuming on a quiet connection",
    )
    assert srv.stats.peers_dead == 0 and cli.stats.peers_dead == 0
    assert (await cli.request(Ping(payload="ok"), timeout=1)).payload == "ok"
    await cli.close()
    await srv.close()


async def test_a_server_with_a_status_beats_every_interval_whatever_the_traffic(
    zctx, ipc, fast_opts, wait_until
):
    """A beat that carries the server's status (the manager's, which its clients read) is
    never skipped: each interval brings it, however busy the connection."""
    opts = fast_opts()
    srv = await _echo_server(zctx, ipc("busy-status"), opts, status=lambda: Pong(payload="st"))
    cli = RpcClient(zctx, srv.endpoint, "cli-0", "test", opts)
    await cli.connect()
    seen: list[bytes] = []
    until = time.monotonic() + 3 * opts.dead_after_s
    while time.monotonic() < until:
        cli.server_status = b""  # type: ignore[assignment]
        await cli.request(Ping(payload="busy"), timeout=1)
        await asyncio.sleep(opts.heartbeat_interval_s / 4)  # a pacing timer
        seen.append(bytes(cli.server_status))
    assert srv.stats.heartbeats_skipped == 0
    assert sum(1 for s in seen if s) >= 3  # beats kept landing between the requests
    await cli.close()
    await srv.close()


async def test_a_client_pushing_its_status_skips_the_timer_beat_and_stays_fresh(
    zctx, ipc, fast_opts, wait_until
):
    """A node that pushes its status (`beat`) at least once an interval sends no timer beat: the
    server's copy stays as fresh as the pushes, nobody is declared dead, and once the pushes stop
    the timer beats carry the status again."""
    opts = fast_opts()
    srv = await _echo_server(zctx, ipc("pushes"), opts, peer_status=StatusCodec(Pong))
    n = [0]

    def status() -> Pong:
        return Pong(payload=str(n[0]))

    cli = RpcClient(zctx, srv.endpoint, "cli-0", "test", opts, status=status)
    await cli.connect()
    until = time.monotonic() + 4 * opts.dead_after_s
    while time.monotonic() < until:
        n[0] += 1
        await cli.beat()
        await asyncio.sleep(opts.heartbeat_interval_s / 4)  # the push rate bound (a timer)
    ticks = 4 * opts.dead_after_s / opts.heartbeat_interval_s
    assert cli.stats.heartbeats_skipped >= ticks / 2, (cli.stats.heartbeats_skipped, ticks)
    assert srv.stats.peers_dead == 0 and srv.peers["cli-0"].alive
    await wait_until(
        lambda: (st := srv.peers["cli-0"].status) is not None and st.payload == str(n[0]),
        1,
        "the last push at the server",
    )
    # no more pushes: the timer carries the status again (a change shows within the bound)
    n[0] += 1
    await wait_until(
        lambda: srv.peers["cli-0"].status.payload == str(n[0]),
        opts.heartbeat_interval_s + SLACK_S,
        "the timer's beat carrying the new status",
    )
    assert srv.stats.peers_dead == 0
    await cli.close()
    await srv.close()


async def test_a_busy_one_way_client_rejoins_a_restarted_server_from_its_traffic(
    zctx, ipc, fast_opts, wait_until
):
    """A client whose one-way messages stand in for its beats still learns that the server
    restarted under it: the new server answers an unknown peer's one-way message with
    unknown_peer, and the client handshakes again. Beats are 30 s apart here, so nothing else
    can tell it."""
    opts = fast_opts(heartbeat_interval_s=30, heartbeat_liveness=100)
    cli, srv2, joined = await _client_of_a_restarted_server(zctx, ipc("restart-busy"), opts)
    pinging = asyncio.create_task(_ping_every(cli, 0.02, time.monotonic() + 5, one_way=True))
    try:
        await wait_until(
            lambda: "cli-0" in srv2.peers and len(joined) >= 2, 3, "the busy client rejoining"
        )
    finally:
        pinging.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pinging
    assert srv2.stats.unknown_peer >= 1 and cli.stats.rehandshakes >= 1
    assert cli.stats.reconnects == 0
    assert (await cli.request(Ping(payload="ok"), timeout=1)).payload == "ok"
    await cli.close()
    await srv2.close()


# ---- deadlines -------------------------------------------------------------------------------


async def test_connect_to_nobody_times_out(zctx, ipc, fast_opts):
    cli = RpcClient(zctx, ipc("nobody"), "cli-0", "test", fast_opts())
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout):
        await cli.connect(timeout=0.3)
    assert time.monotonic() - t0 <= 0.3 + SLACK_S
    await cli.close()


async def test_request_to_a_server_that_just_died_times_out(zctx, ipc, fast_opts):
    """The server dies between two requests, before heartbeats could notice: deadline, not hang."""
    opts = fast_opts(
        heartbeat_interval_s=5.0
    )  # liveness would take 20 s: only the deadline can save us
    srv = await _echo_server(zctx, ipc("gone"), opts)
    cli = RpcClient(zctx, srv.endpoint, "cli-0", "test", opts)
    await cli.connect()
    assert (await cli.request(Ping(payload="1"))).payload == "1"
    await srv.close()
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout):
        await cli.request(Ping(payload="2"), timeout=0.2, retries=2)
    assert time.monotonic() - t0 <= 3 * 0.2 + SLACK_S
    await cli.close()


async def test_a_send_dropped_under_a_dead_server_is_a_transport_error(zctx, ipc, fast_opts):
    """Requests blocked in their send (IMMEDIATE: no live pipe) when the client declares the server
    dead and drops the socket: each caller gets a RequestTimeout well before its deadline, never
    the CancelledError that pyzmq puts on the dropped sends."""
    opts = fast_opts()
    srv = await _echo_server(zctx, ipc("drop"), opts)
    cli = RpcClient(zctx, srv.endpoint, "cli-0", "test", opts)
    await cli.connect()
    await srv.close()
    t0 = time.monotonic()
    results = await asyncio.gather(
        *(cli.request(Ping(payload=str(i)), timeout=5.0, retries=0) for i in range(8)),
        return_exceptions=True,
    )
    assert all(isinstance(r, RequestTimeout) for r in results), results
    assert time.monotonic() - t0 < opts.dead_after_s + 2 * opts.heartbeat_interval_s + 1.0
    await cli.close()


async def test_close_during_a_handshake_again_fails_the_waiting_request_not_cancels_it(
    zctx, ipc, fast_opts, wait_until
):
    """A request that hit `unknown_peer` waits on the shared handshake-again; close() ends that
    handshake. The caller was not cancelled, so it must see a TransportError, not CancelledError."""
    ep = ipc("rehello")
    router = zctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(ep)
    hellos: list[bytes] = []

    async def forgetful_server() -> None:  # welcomes once, then forgets the client and goes quiet
        while True:
            ident, rid, *frames = await router.recv_multipart()
            msg = decode(frames)
            if isinstance(msg, Hello):
                hellos.append(rid)
                if len(hellos) == 1:
                    welcome = Welcome(protocol=PROTOCOL_VERSION, node_id="srv", role="x")
                    await router.send_multipart([ident, b"R" + rid[1:], *encode(welcome)])
            elif isinstance(msg, Ping):
                no = ErrorReply(code="unknown_peer", message="send Hello first")
                await router.send_multipart([ident, b"R" + rid[1:], *encode(no)])

    server = asyncio.ensure_future(forgetful_server())
    cli = RpcClient(
        zctx, ep, "cli-0", "test", fast_opts(heartbeat_interval_s=30, handshake_timeout_s=10)
    )
    await cli.connect(timeout=2)
    caller = asyncio.ensure_future(cli.request(Ping(), timeout=10, retries=0))
    await wait_until(lambda: len(hellos) == 2, 3, "the client handshaking again")
    await cli.close()
    with pytest.raises(TransportError):
        await asyncio.wait_for(caller, 2)
    assert not caller.cancelled()
    server.cancel()
    router.close()


async def test_cancelling_the_caller_of_a_request_still_cancels_it(zctx, ipc, fast_opts):
    started, never = asyncio.Event(), asyncio.Event()

    async def hang(peer, msg):
        started.set()
        await never.wait()

    srv = RpcServer(zctx, ipc("cancel"), "srv-0", "test", fast_opts())
    srv.on(Ping, hang)
    await srv.start()
    cli = RpcClient(zctx, srv.endpoint, "cli-0", "test", fast_opts())
    await cli.connect()
    caller = asyncio.ensure_future(cli.request(Ping(), timeout=10, retries=0))
    await asyncio.wait_for(started.wait(), 2)  # the request is under way: cancel the caller itself
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, 2)
    srv.on(Ping, lambda peer, m: Pong(payload="still works"))
    assert (await cli.request(Ping(), timeout=2)).payload == "still works"
    await cli.close()
    await srv.close()


async def test_request_to_a_hung_handler_times_out(zctx, ipc, fast_opts):
    never = asyncio.Event()
    srv = RpcServer(zctx, ipc("hung"), "srv-0", "test", fast_opts())
    calls = []

    async def hang(peer, msg):
        calls.append(msg)
        await never.wait()

    srv.on(Ping, hang)
    await srv.start()
    cli = RpcClient(zctx, srv.endpoint, "cli-0", "test", fast_opts())
    await cli.connect()
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout):
        await cli.request(Ping(), timeout=0.15, retries=1)
    assert 0.3 <= time.monotonic() - t0 <= 0.3 + SLACK_S
    assert len(calls) == 2 and cli.stats.timeouts == 2
    # server -> client request to a client that has no handler: an error reply, and to a gone
    # client: PeerDead
    with pytest.raises(RemoteError, match="unhandled"):
        await srv.request("cli-0", Ping(), timeout=1)
    await cli.close(say_bye=False)
    t0 = time.monotonic()
    with pytest.raises(TransportError):
        await srv.request("cli-0", Ping(), timeout=0.2)
    assert time.monotonic() - t0 <= 0.2 + SLACK_S
    await srv.close()


async def test_handler_error_becomes_a_remote_error(zctx, ipc, fast_opts):
    # slow heartbeats: the dev console renders the handler's traceback on the loop, which
    # can take longer than 4 fast beats on a loaded machine (liveness is not under test here)
    opts = fast_opts(heartbeat_interval_s=2.0)
    srv = RpcServer(zctx, ipc("err"), "srv-0", "test", opts)
    srv.on(Ping, lambda peer, m: 1 / 0)
    await srv.start()
    cli = RpcClient(zctx, srv.endpoint, "cli-0", "test", opts)
    await cli.connect()
    with pytest.raises(RemoteError, match="ZeroDivisionError"):
        await cli.request(Ping(), timeout=10)
    assert srv.stats.handler_errors == 1 and all(not t.done() for t in srv.tasks)
    await cli.close()
    await srv.close()


# ---- PUB/SUB barrier and PUSH/PULL back-pressure -----------------------------------------------


@pytest.mark.parametrize("transport", ["inproc", "ipc", "tcp"])
async def test_publisher_barrier_means_no_subscriber_misses_the_first_message(
    zctx, ipc, tcp, fast_opts, transport
):
    for round_ in range(
        5
    ):  # fresh publisher and subscribers each round: joiner races would show up
        ep = {"inproc": f"inproc://pub-{round_}", "ipc": ipc(f"pub{round_}"), "tcp": tcp()}[
            transport
        ]
        pub = Publisher(zctx, ep, "relay-0", fast_opts())
        await pub.start()
        subs = [Subscriber(zctx, ep, f"rollout-{i}", ["weights"], fast_opts()) for i in range(4)]
        for s in subs:
            s.start()
        await pub.wait_for({s.node_id for s in subs}, timeout=5)
        await pub.publish("weights", Ping(payload=f"v{round_}"))
        for s in subs:
            topic, msg = await s.recv(timeout=2)
            assert (topic, msg) == ("weights", Ping(payload=f"v{round_}"))
        for s in subs:
            s.close()
        await pub.close()


async def test_publisher_wait_for_times_out_and_tracks_leavers(zctx, ipc, fast_opts, wait_until):
    pub = Publisher(zctx, ipc("pub"), "relay-0", fast_opts())
    await pub.start()
    with pytest.raises(RequestTimeout, match="rollout-9"):
        await pub.wait_for({"rollout-9"}, timeout=0.1)
    sub = Subscriber(zctx, pub.endpoint, "rollout-0", ["t"], fast_opts())
    sub.start()
    await pub.wait_for(1, timeout=5)
    sub.close()
    await wait_until(lambda: "rollout-0" not in pub.subscribers, 3, "the subscriber leaving")
    await pub.close()


@pytest.mark.parametrize("transport", ["inproc", "ipc"])
async def test_push_pull_is_bounded_by_the_high_water_mark(zctx, ipc, fast_opts, transport):
    hwm = 8
    ep = "inproc://stream" if transport == "inproc" else ipc("stream")
    pull = PullStream(zctx, ep, bind=True, opts=fast_opts(rcvhwm=hwm))
    push = PushStream(zctx, ep, bind=False, opts=fast_opts(sndhwm=hwm))
    big = Pong(payload="x" * (256 << 10))  # big messages, so kernel socket buffers hold only a few
    sent = 0
    with pytest.raises(TimeoutError):
        for _ in range(1000):
            await push.send(big, timeout=0.2)
            sent += 1
    # sender-side queue + receiver-side queue (+ a few in kernel buffers for ipc), never unbounded
    bound = 2 * hwm if transport == "inproc" else 2 * hwm + 16
    assert hwm <= sent <= bound, sent
    for _ in range(sent):  # nothing sent was lost, and draining releases the back-pressure
        assert await pull.recv(timeout=2) == big
    await push.send(Pong(payload="after"), timeout=2)
    assert await pull.recv(timeout=2) == Pong(payload="after")
    push.close()
    pull.close()
