"""RpcServer: the ROUTER side of the RPC pair, for the stable nodes (manager, buffer, relay).

    server = RpcServer(ctx, "ipc:///tmp/x/buffer-0.sock", node_id="buffer-0", role="buffer",
                       opts=opts, spawn=node.spawn)
    server.on(PromptRequest, handle_prompts)        # async (peer, msg) -> reply | None
    await server.start()                            # bind; reader + heartbeat tasks via `spawn`
    await server.request("rollout-0", ExportRequest(...), timeout=2.0)   # server -> client

Clients join with HELLO (answered with WELCOME) and are tracked as `peers`. A peer silent
for `opts.dead_after_s` is marked dead (`on_peer_dead`); traffic from it brings it back.
The socket is read and written through a PolledSocket (polled.py): no future per message, and
a busy reader lets messages gather for a moment before it takes them. A handler runs on the
reader's turn, in arrival order; one that awaits (a coroutine) goes on in
its own task, so a waiting handler never blocks the reader, and a one-way message or a ready
answer costs no task.

Bad input from the network (undecodable frames, unknown message types, messages from peers
that never said HELLO) is answered with an ErrorReply where a reply is possible, logged,
counted in `stats` and per peer in `refusals`, and never stops the socket. Before any handler
runs, a message is checked against its own table (laminar/message.py): the peer's role must be
in its `senders` and its `id_fields` must name the peer's node id, else it is refused
(ErrorReply "unauthorized", or dropped when one-way) and counted; a batch's `nested` items
each by their own type's table. A HELLO is admitted only
within `opts.id_bound`: a role's live ids are bounded (a new id past it: ErrorReply
"too_many_<role>s", counted under the claiming key). The reader and heartbeat
tasks start through `spawn` (a node's supervised spawn): if one dies, its node stops loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import structlog
import zmq
import zmq.asyncio

from laminar.logs import RateLimitedLog
from laminar.message import Message, ProtocolError
from laminar.supervise import Spawn, detached_spawn
from laminar.transport.codec import decode, encode
from laminar.transport.polled import PolledSocket
from laminar.transport.security import IdentityRefused, peer_key
from laminar.transport.session import (
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
    IdBound,
    Peer,
    PeerDead,
    Pending,
    RefusalCounts,
    RequestTimeout,
    SocketOptions,
    SocketStats,
    TransportError,
    attach,
)

log = structlog.get_logger("laminar.transport")

S = TypeVar("S", bound=Message)

UNKNOWN_PEER = "(unknown)"
"""`RpcServer.refusals` key of what came from no admitted peer (before or without a HELLO)."""
OTHER_PEERS = "(other)"
"""`RpcServer.refusals` key once MAX_REFUSAL_PEERS ids are counted: HELLOs may name any id."""
MAX_REFUSAL_PEERS = 1024


class RpcServer(Generic[S]):
    """ROUTER side: the stable node (manager, buffer, relay) that clients connect to.

    `status` is this node's own status for its heartbeats (None: they carry none, and a peer
    that got other traffic within the interval gets no beat); `peer_status` decodes what the
    clients' heartbeats carry into `Peer.status` (None: their statuses are not kept)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        node_id: str,
        role: str,
        opts: SocketOptions | None = None,
        on_peer_dead: Callable[[Peer[S]], Any] | None = None,
        on_peer_join: Callable[[Peer[S]], Any] | None = None,
        status: Callable[[], Message | None] | None = None,
        spawn: Spawn = detached_spawn,
        peer_status: StatusCodec[S] | None = None,
    ):
        self.ctx, self.endpoint, self.node_id, self.role = ctx, endpoint, node_id, role
        self.opts = opts or SocketOptions()
        self.peers: dict[str, Peer[S]] = {}
        self._by_identity: dict[bytes, Peer[S]] = {}
        self.stats = SocketStats()
        self.refusals: dict[str, RefusalCounts] = {}
        """Node id (as admitted, or as a refused HELLO claimed it) -> what was refused from it."""
        self.refused = RefusalCounts()
        """The same, over every peer."""
        self._disp = Dispatcher()
        self._pending = Pending()
        self._on_peer_dead, self._on_peer_join, self._status = on_peer_dead, on_peer_join, status
        self._spawn = spawn
        self._peer_status = peer_status
        self._read_status = self._status_of  # bound once: handed to every held status
        self._sock: zmq.asyncio.Socket | None = None
        self._io: PolledSocket | None = None
        """Every read and write of `_sock` (its asyncio methods are never used: see polled.py)."""
        self._tasks: list[asyncio.Task[Any]] = []
        self._seq = 0
        self._incarnations = itertools.count(1)
        self.log = log.bind(node_id=node_id, socket="server", endpoint=endpoint)
        # a fuzzer sends thousands: the first few in full, then a counted summary every few seconds
        self._bad_log = RateLimitedLog(self.log, "bad_message")
        self._unknown_log = RateLimitedLog(self.log, "unknown_peer")
        self._unauthorized_log = RateLimitedLog(self.log, "unauthorized_message")
        self._over_bound_log = RateLimitedLog(self.log, "hello_over_bound")

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
        attach(sock, self.endpoint, True, self.opts)
        self._sock = sock
        self._io = io = PolledSocket(sock)
        self._tasks = [
            self._spawn(self._reader(io), "server-reader"),
            self._spawn(self._heartbeat(), "server-heartbeat"),
        ]

    @property
    def tasks(self) -> list[asyncio.Task[Any]]:
        return self._tasks

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._disp.cancel_all()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._pending.fail_all(PeerDead("server closed"))
        if self._io is not None:
            self._io.close()
            self._io = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    # -- sending --------------------------------------------------------------------
    async def _send(
        self, identity: bytes, rid: bytes, msg: Message, timeout: float | None = None
    ) -> None:
        if self._io is None:
            raise PeerDead("server closed")
        frames = [identity, rid, *encode(msg)]
        try:
            await self._io.send(frames, timeout or self.opts.request_timeout_s)
            self.stats.sent += 1
            if type(msg) is not Heartbeat:  # a beat is not traffic that stands in for the next
                self._sent_to(identity)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or HWM: not fatal for the server
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerDead(f"peer {identity!r} is not connected") from None
            raise TransportError(f"send failed: {exc}") from None

    def _sent_to(self, identity: bytes) -> None:
        peer = self._by_identity.get(identity)
        if peer is not None:
            peer.last_sent = time.monotonic()

    def _peer(self, node_id: str) -> Peer[S]:
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
    def refusals_of(self, peer_id: str) -> RefusalCounts:
        """The counts of one peer (created at 0): what `refusals` holds for it."""
        counts = self.refusals.get(peer_id)
        if counts is None:
            if len(self.refusals) >= MAX_REFUSAL_PEERS:
                peer_id = OTHER_PEERS
            counts = self.refusals.setdefault(peer_id, RefusalCounts())
        return counts

    def _who(self, identity: bytes) -> str:
        peer = self._by_identity.get(identity)
        return UNKNOWN_PEER if peer is None else peer.node_id

    def _bad(self, what: str, peer_id: str = UNKNOWN_PEER) -> None:
        self.stats.bad_frames += 1
        self.stats.last_error = what
        self.refused.bad += 1
        self.refusals_of(peer_id).bad += 1
        self._bad_log.warning(error=what, peer=peer_id)

    def _status_of(self, peer: Peer[S], raw: Any) -> S | None:
        """A held heartbeat status, decoded when read (Peer.status); one that does not decode is
        counted and logged as a bad frame of its peer, and None."""
        assert self._peer_status is not None
        try:
            return self._peer_status.unpack(raw)
        except ProtocolError as exc:
            self._bad(str(exc), peer.node_id)
            return None

    async def _refuse(
        self,
        peer: Peer[S],
        identity: bytes,
        rid: bytes,
        msg: Any,
        kind: type[Message] | None = None,
    ) -> None:
        """`msg` is not the peer's to send (its role, or an id field naming another node): count
        it, log (rate-limited), and answer a request with ErrorReply("unauthorized"). `kind`: the
        type whose rules apply (a status's head: the status type)."""
        kind = kind or type(msg)
        text = _unauthorized(peer.role, peer.node_id, msg, kind) or "unauthorized"
        self.stats.unauthorized += 1
        self.stats.last_error = text
        self.refused.unauthorized += 1
        self.refusals_of(peer.node_id).unauthorized += 1
        self._unauthorized_log.warning(
            peer=peer.node_id, peer_role=peer.role, msg=kind.__name__, error=text
        )
        await self._reply_error(identity, rid, "unauthorized", text)

    async def _reply_error(self, identity: bytes, rid: bytes, code: str, text: str) -> None:
        if rid[:1] == b"Q":
            with contextlib.suppress(TransportError):
                await self._send(identity, b"R" + rid[1:], ErrorReply(code=code, message=text))

    async def _reader(self, rx: PolledSocket) -> None:
        while True:
            frames = await rx.recv()
            self.stats.received += 1
            if len(frames) < 3:
                who = self._who(frames[0].bytes) if frames else UNKNOWN_PEER
                self._bad(f"{len(frames)} frames is too few for an envelope", who)
                continue
            identity = frames[0].bytes
            rid = frames[1].bytes
            if rid and (len(rid) != 9 or rid[:1] not in (b"Q", b"R")):
                self._bad("malformed request-id frame", self._who(identity))
                continue
            head: Any = None  # a heartbeat status's id fields (the rest is decoded when read)
            try:
                msg = decode(frames[2:], self.opts.limits)
                if type(msg) is Heartbeat and self._peer_status is not None:
                    head = self._peer_status.head(msg.status)
            except ProtocolError as exc:
                self._bad(str(exc), self._who(identity))
                await self._reply_error(identity, rid, "protocol", str(exc))
                continue
            peer = self._by_identity.get(identity)
            if isinstance(msg, Hello):
                await self._on_hello(identity, rid, msg, peer_key(frames[2]))
                continue
            if peer is not None and not peer.alive and not self._may_return(peer):
                # declared dead, its slot taken meanwhile: it must handshake again (and wait)
                self._by_identity.pop(identity, None)
                peer = None
            if peer is None:
                self.stats.unknown_peer += 1
                self._unknown_log.warning(msg=type(msg).__name__)
                # a one-way message (a heartbeat, a partial batch) gets no reply: tell the
                # client (e.g. after our restart) to handshake again. A client whose traffic
                # stands in for its beats learns it from any message
                if not rid:
                    with contextlib.suppress(TransportError):
                        await self._send(
                            identity,
                            b"",
                            ErrorReply(code="unknown_peer", message="send Hello first"),
                        )
                else:
                    await self._reply_error(identity, rid, "unknown_peer", "send Hello first")
                continue
            peer.last_seen = time.monotonic()
            if not peer.alive:  # traffic from a peer we had declared dead: it is back
                peer.alive = True
            # authorization, before anything acts on it: the message's own table (message.py)
            # against the role and id the peer was admitted with. Cheap: a set lookup, and a
            # getattr per id field (most types have none)
            cls = type(msg)
            senders = cls.SENDERS
            if (senders is not None and peer.role not in senders) or (
                (cls.ID_FIELDS or cls.NESTED)
                and _unauthorized(peer.role, peer.node_id, msg) is not None
            ):
                await self._refuse(peer, identity, rid, msg)
                continue
            if isinstance(msg, Heartbeat):
                if head is not None:
                    assert self._peer_status is not None
                    kind = self._peer_status.status_type
                    if _unauthorized(peer.role, peer.node_id, head, kind) is None:
                        peer.hold_status(msg.status, self._read_status)
                    else:  # a status naming another node, or of a role not its own: dropped
                        await self._refuse(peer, identity, rid, head, kind)
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
                self._bad(f"no handler for {type(msg).__name__}", peer.node_id)
                await self._reply_error(
                    identity, rid, "unhandled", f"{self.role} does not handle {type(msg).__name__}"
                )
                continue
            self._dispatch(handler, peer, identity, rid, msg)

    def _dispatch(
        self, handler: Handler, peer: Peer[S], identity: bytes, rid: bytes, msg: Message
    ) -> None:
        """Run a handler on the reader's turn: a sync handler (or one whose answer is ready)
        answers at once, and only a handler that must wait (a coroutine) gets a task of its own,
        so a one-way message or a reply costs no task. Messages are handled in arrival order
        either way; a slow handler still never blocks the reader once it awaits."""
        reply: Message | None
        try:
            result = handler(peer, msg)
        except Exception as exc:
            reply = self._failed(exc, peer, msg)
        else:
            if isinstance(result, Awaitable):
                self._disp.track(
                    self._spawn(self._handle(result, peer, identity, rid, msg), "server-handler")
                )
                return
            reply = result if result is not None else Ack()
        if reply is not None and rid[:1] == b"Q":
            self._answer(identity, b"R" + rid[1:], reply)

    def _answer(self, identity: bytes, rid: bytes, reply: Message) -> None:
        """Send a reply from the reader's turn: queued without waiting (the common case), or a
        task waits for room (a peer at its HWM must not stall the reader)."""
        if self._io is None:
            return
        try:
            sent = self._io.send_now([identity, rid, *encode(reply)])
        except (zmq.ZMQError, PeerDead):  # the peer is gone (ROUTER_MANDATORY): it gets no reply
            return
        if sent:
            self.stats.sent += 1
            self._sent_to(identity)
            return
        # nothing was sent: a task that may wait sends it
        self._disp.track(self._spawn(self._send_reply(identity, rid, reply), "server-reply"))

    async def _send_reply(self, identity: bytes, rid: bytes, reply: Message) -> None:
        with contextlib.suppress(TransportError):
            await self._send(identity, rid, reply)

    def _failed(self, exc: Exception, peer: Peer[S], msg: Message) -> ErrorReply | None:
        """A handler raised: count and log it; the error reply its requester gets (None: none)."""
        if isinstance(exc, ProtocolError):  # validation of a well-formed but wrong request
            self._bad(str(exc), peer.node_id)
            return ErrorReply(code="protocol", message=str(exc))
        if isinstance(exc, TransportError):
            # the handler's own peer (or one it asked) went away: the requester gets no reply and
            # times out, as it would had the reply been lost; one bad request never stops the node
            self.stats.handler_errors += 1
            self.log.warning(
                "handler_transport_error",
                msg=type(msg).__name__,
                error=f"{type(exc).__name__}: {exc}",
            )
            return None
        self.stats.handler_errors += 1
        self.log.error("handler_error", msg=type(msg).__name__, exc_info=exc)
        return ErrorReply(code="handler", message=f"{type(exc).__name__}: {exc}")

    async def _handle(
        self, pending: Awaitable[Any], peer: Peer[S], identity: bytes, rid: bytes, msg: Message
    ) -> None:
        """The rest of a handler that awaits, on its own task; then its reply."""
        reply: Message | None
        try:
            result = await pending
            reply = result if result is not None else Ack()
        except Exception as exc:
            reply = self._failed(exc, peer, msg)
        if reply is not None and rid[:1] == b"Q":
            with contextlib.suppress(TransportError):
                await self._send(identity, b"R" + rid[1:], reply)

    async def _on_hello(
        self, identity: bytes, rid: bytes, msg: Hello, key: str | None = None
    ) -> None:
        """Admit a peer, unless its CURVE key may not claim this role/id (`key`: the z85 public
        key ZAP authenticated; None without CURVE, where the claim is unauthenticated) or the id
        belongs to a live peer: a newcomer never evicts a live node (it retries and is admitted
        once liveness declares the old one dead). The same process re-handshaking on a fresh
        socket takes its own entry over: it presents the nonce its Welcome gave it, under the
        same CURVE key; pid, host and start time are the client's word, logged, never decisive."""
        if msg.protocol != PROTOCOL_VERSION:
            self._bad(
                f"protocol {msg.protocol} from {msg.node_id}, want {PROTOCOL_VERSION}", msg.node_id
            )
            await self._reply_error(
                identity,
                rid,
                "protocol_version",
                f"server speaks {PROTOCOL_VERSION}, got {msg.protocol}",
            )
            return
        if self.opts.security is not None:
            try:
                self.opts.security.check_claim(key, msg.role, msg.node_id)
            except IdentityRefused as exc:
                self.stats.refused_identity += 1
                self.refused.refused_hello += 1
                self.refusals_of(msg.node_id).refused_hello += 1
                self.stats.last_error = str(exc)
                self.log.warning(
                    "hello_refused", peer=msg.node_id, peer_role=msg.role, error=str(exc)
                )
                await self._reply_error(identity, rid, "identity_refused", str(exc))
                return
        old = self.peers.get(msg.node_id)
        if (
            old is not None
            and old.identity != identity
            and old.alive
            and time.monotonic() - old.last_seen <= self.opts.dead_after_s
            and not _same_incarnation(old, msg, key)
        ):
            self.stats.refused_id_in_use += 1
            self.refused.refused_hello += 1
            self.refusals_of(msg.node_id).refused_hello += 1
            text = (
                f"node id {msg.node_id!r} is held by a live peer; retry after it is declared dead"
            )
            self.stats.last_error = text
            self.log.warning("hello_id_in_use", peer=msg.node_id, peer_role=msg.role)
            await self._reply_error(identity, rid, "id_in_use", text)
            return
        bound = self.opts.id_bound
        if bound is not None and msg.role == bound.role and not self._room_for(bound, msg.node_id):
            await self._refuse_over_bound(identity, rid, msg, key, bound)
            return
        if old is not None:
            self._by_identity.pop(old.identity, None)
        same = old is not None and _same_incarnation(old, msg, key)
        peer: Peer[S] = Peer(
            node_id=msg.node_id,
            role=msg.role,
            identity=identity,
            pid=msg.pid,
            host=msg.host,
            started=msg.started,
            key=key,
            nonce=old.nonce if same and old is not None else secrets.token_bytes(16),
            incarnation=old.incarnation if same and old is not None else next(self._incarnations),
        )
        self.peers[msg.node_id] = peer
        self._by_identity[identity] = peer
        self.log.info(
            "peer_join",
            peer=msg.node_id,
            peer_role=msg.role,
            rejoin=old is not None,
            reconnect=same,
            pid=msg.pid,
            host=msg.host,
        )
        if rid[:1] == b"Q":
            welcome = Welcome(
                protocol=PROTOCOL_VERSION, node_id=self.node_id, role=self.role, nonce=peer.nonce
            )
            with contextlib.suppress(TransportError):
                await self._send(identity, b"R" + rid[1:], welcome)
        if self._on_peer_join is not None:
            res = self._on_peer_join(peer)
            if asyncio.iscoroutine(res):
                await res

    def _room_for(self, bound: IdBound, node_id: str) -> bool:
        """May `node_id` (of `bound.role`) be admitted: one of the reserved ids, or fewer than
        `bound.others` other unreserved ids of the role are live (heard from within
        dead_after_s; a peer declared dead freed its slot)."""
        if node_id in bound.reserved:
            return True
        cutoff = time.monotonic() - self.opts.dead_after_s
        live = sum(
            1
            for p in self.peers.values()
            if p.role == bound.role
            and p.alive
            and p.last_seen >= cutoff
            and p.node_id != node_id
            and p.node_id not in bound.reserved
        )
        return live < bound.others

    def _may_return(self, peer: Peer[S]) -> bool:
        """May a peer declared dead come back by its traffic alone (within the id bound)?"""
        bound = self.opts.id_bound
        return bound is None or peer.role != bound.role or self._room_for(bound, peer.node_id)

    async def _refuse_over_bound(
        self, identity: bytes, rid: bytes, msg: Hello, key: str | None, bound: IdBound
    ) -> None:
        """A new id past the bound on its role's live ids: refused, counted under the key that
        claimed it (a key minting ids would otherwise fill the table with one row per id)."""
        code = f"too_many_{bound.role}s"
        security = self.opts.security
        by = f"key:{security.key_name(key) if key and security else '(none)'}"
        text = (
            f"{bound.most} {bound.role} ids are live or reserved (the run's configuration): "
            f"{msg.node_id!r} is not admitted until one is declared dead"
        )
        self.stats.refused_over_bound += 1
        self.stats.last_error = text
        self.refused.refused_hello += 1
        self.refused.refused_ids += 1
        counts = self.refusals_of(by)
        counts.refused_hello += 1
        counts.refused_ids += 1
        self._over_bound_log.warning(peer=msg.node_id, peer_role=msg.role, key=by, error=code)
        await self._reply_error(identity, rid, code, text)

    def _forget(self, peer: Peer[S]) -> None:
        self.log.info("peer_leave", peer=peer.node_id)
        self.peers.pop(peer.node_id, None)
        self._by_identity.pop(peer.identity, None)

    async def _heartbeat(self) -> None:
        interval = self.opts.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)  # a timer, not synchronisation
            self._seq += 1
            self._bad_log.flush()
            self._unknown_log.flush()
            self._unauthorized_log.flush()
            self._over_bound_log.flush()
            now = time.monotonic()
            status = StatusCodec.pack(self._status() if self._status else None)
            # a beat that carries no status says only "alive": other traffic within the interval
            # said it already (the client counts any message as a beat)
            quiet_since = now - interval if self._status is None else None
            for peer in list(self.peers.values()):
                if not peer.alive:
                    continue
                if now - peer.last_seen > self.opts.dead_after_s:
                    peer.alive = False
                    self.stats.peers_dead += 1
                    self.log.warning(
                        "peer_dead", peer=peer.node_id, silent_s=round(now - peer.last_seen, 2)
                    )
                    if self._on_peer_dead is not None:
                        res = self._on_peer_dead(peer)
                        if asyncio.iscoroutine(res):
                            await res
                    continue
                if quiet_since is not None and peer.last_sent > quiet_since:
                    self.stats.heartbeats_skipped += 1
                    continue
                # a peer that does not read must not stall the beats (and checks) of the others
                try:
                    await self._send(
                        peer.identity,
                        b"",
                        Heartbeat(node_id=self.node_id, seq=self._seq, status=status),
                        interval,
                    )
                except TransportError:
                    self.stats.heartbeats_dropped += 1


def _same_incarnation(old: Peer[Any], new: Hello, key: str | None) -> bool:
    """Whether a HELLO comes from the incarnation that holds `old` (its own reconnect on a fresh
    socket): it presents the secret nonce the server's Welcome gave that incarnation, under the
    same CURVE key (None = None without CURVE). Nothing the client merely says about itself (pid,
    host, start time) counts: anyone can copy that."""
    return bool(old.nonce) and old.key == key and hmac.compare_digest(old.nonce, new.nonce)


def _unauthorized(
    role: str, node_id: str, msg: Any, kind: type[Message] | None = None
) -> str | None:
    """Why a peer admitted as `role`/`node_id` may not send `msg` (None: it may), by the
    message's `senders` and `id_fields` (laminar/message.py); `kind`: the type whose rules apply
    when `msg` holds only its id fields (StatusCodec.head)."""
    cls = kind or type(msg)
    if cls.SENDERS is not None and role not in cls.SENDERS:
        return f"{cls.__name__} may not come from a {role} ({node_id}): senders are " + (
            ", ".join(sorted(cls.SENDERS)) or "none (never sent on a socket)"
        )
    for name in cls.ID_FIELDS:
        value = getattr(msg, name)
        if value != node_id:
            return f"{cls.__name__}.{name}={str(value)[:64]!r} is not the sender {node_id!r}"
    for name in cls.NESTED:  # a batch: each item as if it had come alone
        for i, item in enumerate(getattr(msg, name)):
            why = _unauthorized(role, node_id, item)
            if why is not None:
                return f"{cls.__name__}.{name}[{i}]: {why}"
    return None
