"""asyncio ZeroMQ helpers: the only module (with security.py) that touches sockets.

    server = RpcServer(ctx, "ipc:///tmp/x/buffer-0.sock", node_id="buffer-0", role="buffer", opts=opts)
    server.on(PromptRequest, handle_prompts)        # async (peer, msg) -> reply | None
    await server.start()
    client = RpcClient(ctx, endpoint, node_id="rollout-0", role="rollout", opts=opts)
    await client.connect()                          # HELLO/WELCOME with a deadline
    reply = await client.request(PromptRequest(...), timeout=2.0)

Wire envelope (after the ROUTER identity frame): [kind+rid, type byte, header, *arrays].
The first frame is b"" (one-way), b"Q"+8 bytes (request) or b"R"+8 bytes (reply).

Liveness (Paranoid Pirate): both sides send a Heartbeat every `heartbeat_interval_s`
and count any traffic as a beat. A peer silent for `heartbeat_liveness` intervals is
dead. A client whose server died closes its socket, opens a fresh one and
re-handshakes with doubling backoff. Requests have deadlines and retries, so no
wait on the network is unbounded.

Bad input from the network (undecodable frames, unknown message types, messages
from peers that never said HELLO) is answered with an ErrorReply where a reply is
possible, logged, counted in `stats`, and never stops the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq
import zmq.asyncio

from laminar.protocol.core import Ack, Bye, ErrorReply, Heartbeat, Hello, NodeStatus, Welcome
from laminar.transport.codec import (
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    Limits,
    Message,
    ProtocolError,
    decode,
    encode,
)
from laminar.transport.security import Security

log = structlog.get_logger("laminar.transport")

Handler = Callable[["Peer", Any], Awaitable[Message | None] | Message | None]


class TransportError(RuntimeError):
    """Base of transport failures that callers can handle."""


class RequestTimeout(TransportError, TimeoutError):
    """No reply within the deadline (after all retries)."""


class SendTimeout(RequestTimeout):
    """A send could not be queued within its deadline (no live connection, or the peer's HWM is full)."""


class PeerDead(TransportError):
    """The peer was declared dead (missed heartbeats) or is unknown."""


class RemoteError(TransportError):
    """The peer answered with an ErrorReply."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass
class SocketOptions:
    heartbeat_interval_s: float = 0.5
    heartbeat_liveness: int = 4
    handshake_timeout_s: float = 5.0
    request_timeout_s: float = 10.0
    request_retries: int = 3
    reconnect_backoff_s: float = 0.1
    reconnect_backoff_max_s: float = 2.0
    sndhwm: int = 1000
    rcvhwm: int = 1000
    limits: Limits = DEFAULT_LIMITS
    security: Security | None = None

    @classmethod
    def from_config(cls, cfg: Any, security: Security | None = None) -> SocketOptions:
        t = cfg.transport
        return cls(
            heartbeat_interval_s=t.heartbeat_interval_s,
            heartbeat_liveness=t.heartbeat_liveness,
            handshake_timeout_s=t.handshake_timeout_s,
            request_timeout_s=t.request_timeout_s,
            request_retries=t.request_retries,
            reconnect_backoff_s=t.reconnect_backoff_s,
            reconnect_backoff_max_s=t.reconnect_backoff_max_s,
            sndhwm=t.sndhwm,
            rcvhwm=t.rcvhwm,
            limits=Limits(max_header_bytes=t.max_header_bytes, max_message_bytes=t.max_message_bytes),
            security=security,
        )

    @property
    def dead_after_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_liveness


@dataclass
class SocketStats:
    received: int = 0
    sent: int = 0
    bad_frames: int = 0
    unknown_peer: int = 0
    unhandled: int = 0
    handler_errors: int = 0
    timeouts: int = 0
    reconnects: int = 0
    rehandshakes: int = 0
    peers_dead: int = 0
    heartbeats_dropped: int = 0
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_rid_counter = itertools.count(1)


def _new_rid() -> bytes:
    return b"Q" + next(_rid_counter).to_bytes(8, "little")


def _prepare_endpoint(endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)


def _is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def _attach(sock: zmq.Socket, endpoint: str, bind: bool, opts: SocketOptions) -> None:
    """CURVE (tcp only: ipc/inproc stay on this host) as server or client, then bind or connect."""
    if opts.security is not None and _is_tcp(endpoint):
        (opts.security.apply_server if bind else opts.security.apply_client)(sock)
    if bind:
        _prepare_endpoint(endpoint)
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


async def _send_within(sock: zmq.asyncio.Socket, frames: list[Any], timeout: float | None) -> None:
    """send_multipart with a deadline: a DEALER with no live pipe (IMMEDIATE) or a peer at its
    HWM blocks a send indefinitely, and a dead peer must become an error, never a hang."""
    fut = sock.send_multipart(frames, copy=False)
    if fut.done():  # the common case: pyzmq sent it without waiting
        fut.result()
        return
    try:
        await asyncio.wait_for(fut, timeout)  # cancelling drops the queued send; nothing half-sent
    except TimeoutError:
        raise SendTimeout(f"send blocked for {timeout:.2f}s (peer gone or not reading)") from None
    except asyncio.CancelledError:
        # pyzmq cancels a pending send when its socket is closed (reconnect after a server death);
        # unless *we* are being cancelled, that is a dead peer, not a cancellation of the caller.
        task = asyncio.current_task()
        if task is not None and task.cancelling() == 0:
            raise PeerDead("socket closed while a send was pending (peer declared dead)") from None
        raise


@dataclass
class Peer:
    """A client known to a server (it said HELLO)."""

    node_id: str
    role: str
    identity: bytes
    info: dict[str, Any] = field(default_factory=dict)
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    status: NodeStatus | None = None
    joined_at: float = field(default_factory=time.time)


class _Pending:
    """Outstanding requests keyed by rid."""

    def __init__(self) -> None:
        self.futures: dict[bytes, asyncio.Future] = {}

    def new(self) -> tuple[bytes, asyncio.Future]:
        rid = _new_rid()
        fut = asyncio.get_running_loop().create_future()
        self.futures[rid] = fut
        return rid, fut

    def resolve(self, rid: bytes, msg: Message) -> bool:
        fut = self.futures.pop(b"Q" + rid[1:], None)
        if fut is None or fut.done():
            return False
        if isinstance(msg, ErrorReply):
            fut.set_exception(RemoteError(msg.code, msg.message))
        else:
            fut.set_result(msg)
        return True

    def drop(self, rid: bytes) -> None:
        self.futures.pop(rid, None)

    def fail_all(self, exc: Exception) -> None:
        for fut in self.futures.values():
            if not fut.done():
                fut.set_exception(exc)
        self.futures.clear()


class _Dispatcher:
    """Type -> handler table shared by server and client."""

    def __init__(self) -> None:
        self.handlers: dict[type, Handler] = {}
        self.tasks: set[asyncio.Task] = set()

    def on(self, msg_type: type[Message], handler: Handler) -> None:
        self.handlers[msg_type] = handler

    async def call(self, handler: Handler, peer: Any, msg: Message) -> Message | None:
        result = handler(peer, msg)
        if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
            result = await result
        return result

    def cancel_all(self) -> None:
        for t in list(self.tasks):
            t.cancel()


class RpcServer:
    """ROUTER side: the stable node (manager, buffer, relay) that clients connect to."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        node_id: str,
        role: str,
        opts: SocketOptions | None = None,
        on_peer_dead: Callable[[Peer], Any] | None = None,
        on_peer_join: Callable[[Peer], Any] | None = None,
        status: Callable[[], NodeStatus | None] | None = None,
    ):
        self.ctx, self.endpoint, self.node_id, self.role = ctx, endpoint, node_id, role
        self.opts = opts or SocketOptions()
        self.peers: dict[str, Peer] = {}
        self._by_identity: dict[bytes, Peer] = {}
        self.stats = SocketStats()
        self._disp = _Dispatcher()
        self._pending = _Pending()
        self._on_peer_dead, self._on_peer_join, self._status = on_peer_dead, on_peer_join, status
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._seq = 0
        self.log = log.bind(node_id=node_id, socket="server", endpoint=endpoint)

    def on(self, msg_type: type[Message], handler: Handler) -> None:
        """Register `async handler(peer, msg) -> reply | None` for a message type."""
        self._disp.on(msg_type, handler)

    async def start(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, self.opts.sndhwm)
        sock.setsockopt(zmq.RCVHWM, self.opts.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.opts.limits.max_message_bytes)
        _attach(sock, self.endpoint, True, self.opts)
        self._sock = sock
        self._tasks = [
            asyncio.create_task(self._reader(), name=f"{self.node_id}:server-reader"),
            asyncio.create_task(self._heartbeat(), name=f"{self.node_id}:server-heartbeat"),
        ]

    @property
    def tasks(self) -> list[asyncio.Task]:
        return self._tasks

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._disp.cancel_all()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._pending.fail_all(PeerDead("server closed"))
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    # -- sending --------------------------------------------------------------------
    async def _send(self, identity: bytes, rid: bytes, msg: Message, timeout: float | None = None) -> None:
        if self._sock is None:
            raise PeerDead("server closed")
        frames = [identity, rid, *encode(msg)]
        try:
            await _send_within(self._sock, frames, timeout or self.opts.request_timeout_s)
            self.stats.sent += 1
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or HWM: not fatal for the server
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerDead(f"peer {identity!r} is not connected") from None
            raise TransportError(f"send failed: {exc}") from None

    def _peer(self, node_id: str) -> Peer:
        peer = self.peers.get(node_id)
        if peer is None or not peer.alive:
            raise PeerDead(f"no live peer {node_id!r}")
        return peer

    async def send(self, node_id: str, msg: Message) -> None:
        """One-way message to a connected client (a command that needs no reply)."""
        await self._send(self._peer(node_id).identity, b"", msg)

    async def request(self, node_id: str, msg: Message, timeout: float | None = None) -> Message:
        """Server-initiated request to a client (e.g. manager -> rollout export)."""
        peer = self._peer(node_id)
        rid, fut = self._pending.new()
        timeout = timeout or self.opts.request_timeout_s
        deadline = time.monotonic() + timeout
        try:
            await self._send(peer.identity, rid, msg, timeout)
            return await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            self.stats.timeouts += 1
            raise RequestTimeout(f"{type(msg).__name__} to {node_id} got no reply") from None
        finally:
            self._pending.drop(rid)

    async def broadcast(self, msg: Message, role: str | None = None) -> int:
        n = 0
        for peer in list(self.peers.values()):
            if peer.alive and (role is None or peer.role == role):
                with contextlib.suppress(TransportError):
                    await self._send(peer.identity, b"", msg)
                    n += 1
        return n

    # -- receiving --------------------------------------------------------------------
    def _bad(self, what: str) -> None:
        self.stats.bad_frames += 1
        self.stats.last_error = what
        self.log.warning("bad_message", error=what)

    async def _reply_error(self, identity: bytes, rid: bytes, code: str, text: str) -> None:
        if rid[:1] == b"Q":
            with contextlib.suppress(TransportError):
                await self._send(identity, b"R" + rid[1:], ErrorReply(code=code, message=text))

    async def _reader(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            frames = await sock.recv_multipart(copy=False)
            self.stats.received += 1
            if len(frames) < 3:
                self._bad(f"{len(frames)} frames is too few for an envelope")
                continue
            identity = frames[0].bytes
            rid = frames[1].bytes
            if rid and (len(rid) != 9 or rid[:1] not in (b"Q", b"R")):
                self._bad("malformed request-id frame")
                continue
            try:
                msg = decode(frames[2:], self.opts.limits)
            except ProtocolError as exc:
                self._bad(str(exc))
                await self._reply_error(identity, rid, "protocol", str(exc))
                continue
            peer = self._by_identity.get(identity)
            if isinstance(msg, Hello):
                await self._on_hello(identity, rid, msg)
                continue
            if peer is None:
                self.stats.unknown_peer += 1
                self.log.warning("unknown_peer", msg=type(msg).__name__)
                if isinstance(msg, Heartbeat):  # one-way: tell the client (e.g. after our restart) to handshake again
                    with contextlib.suppress(TransportError):
                        await self._send(identity, b"", ErrorReply(code="unknown_peer", message="send Hello first"))
                else:
                    await self._reply_error(identity, rid, "unknown_peer", "send Hello first")
                continue
            peer.last_seen = time.monotonic()
            if not peer.alive:  # traffic from a peer we had declared dead: it is back
                peer.alive = True
            if isinstance(msg, Heartbeat):
                if msg.status is not None:
                    peer.status = msg.status
                continue
            if isinstance(msg, Bye):
                self._forget(peer)
                continue
            if rid[:1] == b"R":
                if not self._pending.resolve(rid, msg):
                    self.log.debug("late_reply", msg=type(msg).__name__)
                continue
            handler = self._disp.handlers.get(type(msg))
            if handler is None:
                self.stats.unhandled += 1
                self._bad(f"no handler for {type(msg).__name__}")
                await self._reply_error(identity, rid, "unhandled", f"{self.role} does not handle {type(msg).__name__}")
                continue
            task = asyncio.create_task(self._handle(handler, peer, identity, rid, msg))
            self._disp.tasks.add(task)
            task.add_done_callback(self._disp.tasks.discard)

    async def _handle(self, handler: Handler, peer: Peer, identity: bytes, rid: bytes, msg: Message) -> None:
        try:
            reply = await self._disp.call(handler, peer, msg)
        except ProtocolError as exc:  # handler-level validation of a well-formed but wrong request
            self._bad(str(exc))
            await self._reply_error(identity, rid, "protocol", str(exc))
            return
        except (TransportError, asyncio.CancelledError):
            raise
        except Exception as exc:
            self.stats.handler_errors += 1
            self.log.exception("handler_error", msg=type(msg).__name__)
            await self._reply_error(identity, rid, "handler", f"{type(exc).__name__}: {exc}")
            return
        if rid[:1] == b"Q":
            with contextlib.suppress(TransportError):
                await self._send(identity, b"R" + rid[1:], reply if reply is not None else Ack())

    async def _on_hello(self, identity: bytes, rid: bytes, msg: Hello) -> None:
        if msg.protocol != PROTOCOL_VERSION:
            self._bad(f"protocol {msg.protocol} from {msg.node_id}, want {PROTOCOL_VERSION}")
            await self._reply_error(identity, rid, "protocol_version", f"server speaks {PROTOCOL_VERSION}, got {msg.protocol}")
            return
        old = self.peers.get(msg.node_id)
        if old is not None:
            self._by_identity.pop(old.identity, None)
        peer = Peer(node_id=msg.node_id, role=msg.role, identity=identity, info=dict(msg.info))
        self.peers[msg.node_id] = peer
        self._by_identity[identity] = peer
        self.log.info("peer_join", peer=msg.node_id, peer_role=msg.role, rejoin=old is not None)
        if rid[:1] == b"Q":
            with contextlib.suppress(TransportError):
                await self._send(identity, b"R" + rid[1:], Welcome(protocol=PROTOCOL_VERSION, node_id=self.node_id, role=self.role))
        if self._on_peer_join is not None:
            res = self._on_peer_join(peer)
            if asyncio.iscoroutine(res):
                await res

    def _forget(self, peer: Peer) -> None:
        self.log.info("peer_leave", peer=peer.node_id)
        self.peers.pop(peer.node_id, None)
        self._by_identity.pop(peer.identity, None)

    async def _heartbeat(self) -> None:
        interval = self.opts.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)  # a timer, not synchronisation
            self._seq += 1
            now = time.monotonic()
            status = self._status() if self._status else None
            for peer in list(self.peers.values()):
                if not peer.alive:
                    continue
                if now - peer.last_seen > self.opts.dead_after_s:
                    peer.alive = False
                    self.stats.peers_dead += 1
                    self.log.warning("peer_dead", peer=peer.node_id, silent_s=round(now - peer.last_seen, 2))
                    if self._on_peer_dead is not None:
                        res = self._on_peer_dead(peer)
                        if asyncio.iscoroutine(res):
                            await res
                    continue
                try:  # a peer that does not read must not stall the beats (and checks) of the others
                    await self._send(peer.identity, b"", Heartbeat(node_id=self.node_id, seq=self._seq, status=status), interval)
                except TransportError:
                    self.stats.heartbeats_dropped += 1


def new_context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context()


# PUB/SUB and PUSH/PULL live in streams.py; re-exported here so `from laminar.transport.sockets import Publisher` keeps working.
# The client lives in client.py; re-exported here (lazily: it imports this module's basics).
_STREAMS = ("Publisher", "Subscriber", "PushStream", "PullStream")


def __getattr__(name: str) -> Any:
    if name in _STREAMS:
        from laminar.transport import streams

        return getattr(streams, name)
    if name == "RpcClient":
        from laminar.transport.client import RpcClient

        return RpcClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
