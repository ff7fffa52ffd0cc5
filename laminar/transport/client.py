"""RpcClient: the DEALER side of the RPC pair (handshake, heartbeats, deadlines, reconnects).

    client = RpcClient(ctx, endpoint, "rollout-0", "rollout", opts=opts, spawn=node.spawn)
    await client.connect()                          # HELLO/WELCOME with a deadline
    reply = await client.request(PromptRequest(...), timeout=2.0)

A client whose server goes silent for `dead_after_s` declares it dead, fails every
pending request, and reconnects on a fresh socket with doubling backoff. A server that
restarted under the same endpoint faster than that answers `unknown_peer` (to a
request, a heartbeat or any one-way message): the client handshakes again on the live socket. A
client without a status sends no heartbeat while its other traffic is at least one an interval,
and one with a status none while it pushes its status (`beat`) at least once an interval.

`request()` fails only with a TransportError (RequestTimeout after its attempts, RemoteError
for an error reply): when the client's own machinery cancels something the caller waits on
(a socket dropped under a blocked send, a handshake-again ended by `close()`), the caller gets
a transport error, never a CancelledError; a cancellation of the caller's task propagates.
`close()` says Bye (the server forgets the peer: a leave, not a death) and lets the socket
deliver it before it goes.
The reader, heartbeat, reconnect and handler tasks start through `spawn` (a node's
supervised spawn): if one dies, its node stops loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from laminar.message import Message, ProtocolError
from laminar.supervise import Spawn, detached_spawn
from laminar.transport.codec import decode, encode
from laminar.transport.session import (
    NO_STATUS,
    PROTOCOL_VERSION,
    Ack,
    Bye,
    ErrorReply,
    Heartbeat,
    Hello,
    StatusCodec,
    Welcome,
)
from laminar.transport.sockets import (
    Dispatcher,
    Handler,
    PeerDead,
    Pending,
    Receiver,
    RemoteError,
    RequestTimeout,
    SendTimeout,
    SocketOptions,
    SocketStats,
    TransportError,
    attach,
    being_cancelled,
    send_within,
)

log = structlog.get_logger("laminar.transport")

_BYE_LINGER_MS = 500
"""How long a closed socket may still deliver its Bye (the context's end waits that long at most,
only while the server is out of reach)."""


class RpcClient:
    """DEALER side with handshake, two-way heartbeats and reconnect on a fresh socket."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        node_id: str,
        role: str,
        opts: SocketOptions | None = None,
        status: Callable[[], Message | None] | None = None,
        on_server_dead: Callable[[], Any] | None = None,
        on_connect: Callable[[], Any] | None = None,
        started: float = 0.0,
        spawn: Spawn = detached_spawn,
    ):
        self.ctx, self.endpoint, self.node_id, self.role = ctx, endpoint, node_id, role
        self.opts = opts or SocketOptions()
        self.stats = SocketStats()
        self.server_id: str | None = None
        self.server_status: msgspec.Raw = NO_STATUS
        """What the server's last heartbeat carried, still encoded (decoded only by whoever
        reads it: `StatusCodec.unpack`)."""
        self._status, self._on_server_dead, self._on_connect = status, on_server_dead, on_connect
        # pid, host and started are facts for the server's logs; what lets this node take its own
        # live entry over on a fresh socket is the nonce the server's Welcome gave it (kept in
        # opts.nonces, which every client of the node shares)
        self._nonce_key = (endpoint, node_id)
        self._hello = Hello(
            protocol=PROTOCOL_VERSION,
            node_id=node_id,
            role=role,
            pid=os.getpid(),
            host=socket.gethostname(),
            started=started,
        )
        self._spawn = spawn
        self._disp = Dispatcher()
        self._pending = Pending()
        self._sock: zmq.asyncio.Socket | None = None
        self._reader_task: asyncio.Task[Any] | None = None
        self._hb_task: asyncio.Task[Any] | None = None
        self._connected = asyncio.Event()
        self._last_seen = time.monotonic()
        self._last_sent = 0.0
        """When this client last queued a message other than a beat (time.monotonic()): a
        status-less beat within the interval after it is skipped."""
        self._last_pushed = 0.0
        """When the node last pushed its status (`beat`): the timer's beat within the interval
        after it is skipped."""
        self._seq = 0
        self._closed = False
        self._reconnecting: asyncio.Task[Any] | None = None
        self._rehello: asyncio.Task[TransportError | None] | None = None
        self.log = log.bind(node_id=node_id, socket="client", endpoint=endpoint)

    def on(self, msg_type: type[Message], handler: Handler) -> None:
        """Register a handler for server-initiated messages (commands)."""
        self._disp.on(msg_type, handler)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def tasks(self) -> list[asyncio.Task[Any]]:
        return [t for t in (self._hb_task, self._reader_task) if t is not None]

    def _new_socket(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.opts.sndhwm)
        sock.setsockopt(zmq.RCVHWM, self.opts.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.opts.limits.max_message_bytes)
        # queue only to completed connections, so nothing piles up for a dead server
        sock.setsockopt(zmq.IMMEDIATE, 1)
        # a random routing id per socket: the ROUTER keys its peers by it, and zmq's own ids are
        # a counter that a stranger could claim once this connection drops (a leading 0 byte is
        # zmq's own; 1 keeps ours apart)
        sock.setsockopt(zmq.ROUTING_ID, b"\x01" + secrets.token_bytes(15))
        attach(sock, self.endpoint, False, self.opts)
        return sock

    async def connect(self, timeout: float | None = None) -> None:
        """Open a socket and handshake, retrying with backoff until `timeout` (default
        handshake_timeout_s)."""
        deadline = time.monotonic() + (timeout or self.opts.handshake_timeout_s)
        backoff = self.opts.reconnect_backoff_s
        while True:
            try:
                await self._open_and_handshake(
                    min(self.opts.handshake_timeout_s, max(0.05, deadline - time.monotonic()))
                )
                break
            except (RequestTimeout, RemoteError, PeerDead) as exc:
                if isinstance(exc, RemoteError) and exc.code in (
                    "protocol_version",
                    "identity_refused",  # our key may not claim this role: retrying cannot help
                ):
                    raise
                if time.monotonic() + backoff > deadline:
                    raise RequestTimeout(f"handshake with {self.endpoint} failed: {exc}") from None
                await asyncio.sleep(backoff)  # reconnect backoff, not synchronisation
                backoff = min(backoff * 2, self.opts.reconnect_backoff_max_s)
        if self._hb_task is None:
            self._hb_task = self._spawn(self._heartbeat(), "client-heartbeat")

    async def _open_and_handshake(self, timeout: float) -> None:
        await self._close_socket()
        self._sock = self._new_socket()
        self._reader_task = self._spawn(self._reader(self._sock), "client-reader")
        await self._handshake(timeout)

    async def _handshake(self, timeout: float) -> None:
        nonce = self.opts.nonces.get(self._nonce_key, b"")
        hello = msgspec.structs.replace(self._hello, nonce=nonce)
        reply = await self._request_once(hello, timeout)
        if not isinstance(reply, Welcome):
            raise TransportError(f"handshake: expected Welcome, got {type(reply).__name__}")
        # kept for the next handshake: the server knows this incarnation by it
        self.opts.nonces[self._nonce_key] = reply.nonce
        self.server_id = reply.node_id
        self._last_seen = time.monotonic()
        self._connected.set()
        self.log.debug("connected", server=reply.node_id)
        if self._on_connect is not None:
            res = self._on_connect()
            if asyncio.iscoroutine(res):
                await res

    async def _handshake_again(self) -> None:
        """The server answered `unknown_peer`: it restarted under the same endpoint and the socket
        reconnected underneath us before heartbeats noticed. Handshake again on the live socket (one
        attempt shared by all callers that hit it); if that fails, fall back to a full reconnect.
        Raises TransportError on failure."""
        if self._rehello is None or self._rehello.done():
            self._rehello = self._spawn(self._run_handshake_again(), "client-rehello")
        # shielded: one caller giving up must not end the attempt the others wait on
        failed = await asyncio.shield(self._rehello)
        if failed is not None:
            raise failed

    async def _run_handshake_again(self) -> TransportError | None:
        """One handshake-again; its failure is returned (to the callers waiting on it), not raised,
        so the supervised task ends cleanly either way."""
        self.stats.rehandshakes += 1
        self.log.info("server_forgot_us", server=self.server_id)
        try:
            await self._handshake(self.opts.handshake_timeout_s)
        except (TransportError, zmq.ZMQError) as exc:
            self.log.warning("rehandshake_failed", error=str(exc))
            if not self._closed and (self._reconnecting is None or self._reconnecting.done()):
                self._connected.clear()
                self._reconnecting = self._spawn(self._reconnect_forever(), "client-reconnect")
            return (
                exc
                if isinstance(exc, TransportError)
                else TransportError(f"handshake again: {exc}")
            )
        return None

    async def _close_socket(self, linger_ms: int = 0) -> None:
        self._connected.clear()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader_task
            self._reader_task = None
        if self._sock is not None:
            self._sock.close(linger=linger_ms)
            self._sock = None

    async def close(self, say_bye: bool = True) -> None:
        self._closed = True
        linger_ms = 0
        if say_bye and self._sock is not None and self.connected:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self._send_raw(b"", Bye(node_id=self.node_id, reason="close")), 0.5
                )
                # queued is not sent: a socket closed with linger 0 may drop the Bye, and the
                # server then declares a normal stop a death
                linger_ms = _BYE_LINGER_MS
        for t in (self._hb_task, self._reconnecting, self._rehello):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self._disp.cancel_all()
        self._pending.fail_all(PeerDead("client closed"))
        await self._close_socket(linger_ms)

    async def _send_raw(self, rid: bytes, msg: Message, timeout: float | None = None) -> None:
        if self._sock is None:
            raise PeerDead(f"not connected to {self.endpoint}")
        await send_within(self._sock, [rid, *encode(msg)], timeout or self.opts.request_timeout_s)
        self.stats.sent += 1
        if type(msg) is not Heartbeat:  # a beat is not traffic that stands in for the next one
            self._last_sent = time.monotonic()

    async def send(self, msg: Message) -> None:
        """One-way message (no reply)."""
        await self._send_raw(b"", msg)

    async def _request_once(self, msg: Message, timeout: float) -> Message:
        rid, fut = self._pending.new()
        deadline = time.monotonic() + timeout
        try:
            # the send is inside the deadline too: with IMMEDIATE a dead server blocks it
            await self._send_raw(rid, msg, timeout)
            return await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
        except SendTimeout:
            self.stats.timeouts += 1
            raise RequestTimeout(
                f"{type(msg).__name__} to {self.endpoint}: could not send in {timeout:.2f}s"
            ) from None
        except TimeoutError:
            self.stats.timeouts += 1
            raise RequestTimeout(
                f"{type(msg).__name__} to {self.endpoint}: no reply in {timeout:.2f}s"
            ) from None
        finally:
            self._pending.drop(rid)

    async def request(
        self, msg: Message, timeout: float | None = None, retries: int | None = None
    ) -> Message:
        """Send a request and await its reply; each attempt has a deadline. Requests must be
        idempotent.

        Raises RequestTimeout when every attempt failed and RemoteError when the server answered
        with an error; CancelledError only when the caller's own task is being cancelled."""
        timeout = timeout or self.opts.request_timeout_s
        retries = self.opts.request_retries if retries is None else retries
        last: Exception | None = None
        attempts, forgotten = retries + 1, False
        while attempts > 0:
            attempts -= 1
            if not self.connected:
                try:
                    await asyncio.wait_for(self._connected.wait(), timeout)
                except TimeoutError:
                    last = RequestTimeout(f"not connected to {self.endpoint} within {timeout:.2f}s")
                    continue
            try:
                return await self._request_once(msg, timeout)
            except (RequestTimeout, PeerDead) as exc:
                last = exc
                continue
            except RemoteError as exc:
                if exc.code != "unknown_peer" or forgotten:
                    raise
                forgotten, last = True, exc
            except asyncio.CancelledError:
                if being_cancelled():
                    raise
                last = PeerDead(f"{type(msg).__name__} to {self.endpoint}: connection dropped")
                continue
            # the server never processed the request: handshake again, then one extra attempt
            try:
                await self._handshake_again()
            except (TransportError, zmq.ZMQError) as exc:
                last = exc
                continue
            except asyncio.CancelledError:  # close() ended the handshake the caller waited on
                if being_cancelled():
                    raise
                last = PeerDead(f"handshake with {self.endpoint} dropped")
                continue
            attempts += 1
        assert last is not None
        raise last if isinstance(last, RequestTimeout) else RequestTimeout(str(last))

    def _bad(self, what: str) -> None:
        self.stats.bad_frames += 1
        self.stats.last_error = what
        self.log.warning("bad_message", error=what)

    async def _reader(self, sock: zmq.asyncio.Socket) -> None:
        rx = Receiver(sock)
        while True:
            frames = await rx.recv()
            self.stats.received += 1
            self._last_seen = time.monotonic()
            if len(frames) < 2:
                self._bad("too few frames")
                continue
            rid = frames[0].bytes
            try:
                msg = decode(frames[1:], self.opts.limits)
            except ProtocolError as exc:
                self._bad(str(exc))
                continue
            if isinstance(msg, Heartbeat):
                self.server_status = msg.status
                continue
            if rid[:1] == b"R":
                self._pending.resolve(rid, msg)
                continue
            if isinstance(msg, ErrorReply) and msg.code == "unknown_peer" and self.connected:
                # the server restarted and saw our heartbeat: handshake again in the background
                if self._rehello is None or self._rehello.done():
                    self._rehello = self._spawn(self._run_handshake_again(), "client-rehello")
                continue
            handler = self._disp.handlers.get(type(msg))
            if handler is None:
                self.stats.unhandled += 1
                self._bad(f"no handler for {type(msg).__name__}")
                if rid[:1] == b"Q":
                    with contextlib.suppress(Exception):
                        await self._send_raw(
                            b"R" + rid[1:], ErrorReply(code="unhandled", message=type(msg).__name__)
                        )
                continue
            self._disp.track(self._spawn(self._handle(handler, rid, msg), "client-handler"))

    async def _handle(self, handler: Handler, rid: bytes, msg: Message) -> None:
        try:
            reply = await self._disp.call(handler, None, msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.handler_errors += 1
            self.log.exception("handler_error", msg=type(msg).__name__)
            reply = ErrorReply(code="handler", message=f"{type(exc).__name__}: {exc}")
        if rid[:1] == b"Q":
            with contextlib.suppress(Exception):
                await self._send_raw(b"R" + rid[1:], reply if reply is not None else Ack())

    async def _heartbeat(self) -> None:
        interval = self.opts.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)  # a timer, not synchronisation
            if self._reconnecting is not None and not self._reconnecting.done():
                continue
            if self.connected and time.monotonic() - self._last_seen > self.opts.dead_after_s:
                self.stats.peers_dead += 1
                self.log.warning(
                    "server_dead", silent_s=round(time.monotonic() - self._last_seen, 2)
                )
                self._connected.clear()
                self._pending.fail_all(PeerDead(f"server {self.endpoint} is dead"))
                if self._on_server_dead is not None:
                    res = self._on_server_dead()
                    if asyncio.iscoroutine(res):
                        await res
                self._reconnecting = self._spawn(self._reconnect_forever(), "client-reconnect")
                continue
            if self.connected:
                # the server counts any message as a beat: a beat without a status only says
                # "alive", which the traffic just sent said; one with a status is due unless the
                # node pushed its status within the interval (the push carried it, fresher)
                said = self._last_sent if self._status is None else self._last_pushed
                if time.monotonic() - said < interval:
                    self.stats.heartbeats_skipped += 1
                    continue
                try:  # bounded: a blocked beat must not stop the liveness check above
                    await self._beat(interval)
                except (TransportError, zmq.ZMQError):
                    self.stats.heartbeats_dropped += 1

    async def beat(self, timeout: float | None = None) -> None:
        """Push the current status now, as a heartbeat (a node whose status just changed; the
        timer beats every interval the node did not push). Raises TransportError / ZMQError."""
        await self._beat(timeout)
        self._last_pushed = time.monotonic()

    async def _beat(self, timeout: float | None) -> None:
        self._seq += 1
        status = StatusCodec.pack(self._status() if self._status else None)
        await self._send_raw(
            b"", Heartbeat(node_id=self.node_id, seq=self._seq, status=status), timeout
        )

    async def _reconnect_forever(self) -> None:
        backoff = self.opts.reconnect_backoff_s
        while not self._closed:
            self.stats.reconnects += 1
            try:
                await self._open_and_handshake(self.opts.handshake_timeout_s)
                self.log.info("reconnected", server=self.server_id)
                return
            except (TransportError, zmq.ZMQError) as exc:
                self.log.debug("reconnect_failed", error=str(exc), backoff_s=backoff)
            await asyncio.sleep(backoff)  # reconnect backoff
            backoff = min(backoff * 2, self.opts.reconnect_backoff_max_s)
