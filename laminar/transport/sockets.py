"""What the RPC and stream sockets share: errors, options, stats, peers, attach, sends with a
deadline.

    opts = socket_options(cfg, role)      # laminar/wiring/common.py: the config made plain settings
    ctx = new_context()
    attach(sock, "tcp://10.0.0.1:5555", bind=False, opts=opts)   # CURVE on tcp, then connect
    await send_within(sock, frames, timeout=2.0)              # SendTimeout / PeerDead, never a hang

The socket kinds build on this module and never on each other:

    sockets.py ◄── server.py   RpcServer (ROUTER: manager, buffer, relay)
               ◄── client.py   RpcClient (DEALER: handshake, heartbeats, reconnect)
               ◄── streams.py  Publisher/Subscriber (PUB/SUB + READY barrier), PushStream/PullStream

Wire envelope of the RPC pair (after the ROUTER identity frame): [kind+rid, type byte, header,
*arrays]. The first frame is b"" (one-way), b"Q"+8 bytes (request) or b"R"+8 bytes (reply).
`Pending` holds a side's outstanding requests by rid, `Dispatcher` its type -> handler table.

Liveness (Paranoid Pirate): both sides send a Heartbeat every `heartbeat_interval_s` and count
any traffic as a beat; a peer silent for `heartbeat_liveness` intervals is dead. A beat that
carries no status is skipped when the side sent that peer something else within the last
interval (the traffic was the beat), and a client's beat that carries its status when the node
pushed its status within the interval; so a busy connection's silence is still at most two
intervals.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio
from structlog.typing import FilteringBoundLogger

from laminar.message import DEFAULT_LIMITS, Limits, Message
from laminar.supervise import Spawn
from laminar.transport.security import Security
from laminar.transport.session import ErrorReply


class TransportError(RuntimeError):
    """Base of transport failures that callers can handle."""


class RequestTimeout(TransportError, TimeoutError):
    """No reply within the deadline (after all retries)."""


class SendTimeout(RequestTimeout):
    """A send could not be queued within its deadline (no live connection, or the peer's HWM is
    full)."""


class PeerDead(TransportError):
    """The peer was declared dead (missed heartbeats) or is unknown."""


class RemoteError(TransportError):
    """The peer answered with an ErrorReply."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class IdBound:
    """How many live ids of one role a server admits at once: a HELLO past it is refused
    (ErrorReply `too_many_<role>s`). The `reserved` ids (the run's own) hold their slots whether
    live or not and are always admitted (one process per id still: a live id is its holder's);
    any other id only while fewer than `most - len(reserved)` other such ids are live. A peer
    declared dead frees its slot, and an id never counts against itself: a restart under the
    same id is admitted once the old process is dead."""

    role: str
    most: int
    reserved: frozenset[str] = frozenset()

    @property
    def others(self) -> int:
        """Live ids of the role, beyond the reserved ones, admitted at once."""
        return max(0, self.most - len(self.reserved))


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
    id_bound: IdBound | None = None
    """Servers: the bound on one role's live ids (None: any number is admitted)."""
    nonces: dict[tuple[str, str], bytes] = field(default_factory=dict, repr=False)
    """(endpoint, node id) -> the secret that server's Welcome gave this node: every RpcClient
    built with these options presents it, so all sockets of one node are one incarnation to the
    server (`socket_options` makes one per node: a restarted node, or a stranger, has none)."""

    @property
    def dead_after_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_liveness

    def with_max_message_bytes(self, n: int) -> SocketOptions:
        """These options with another inbound size limit: zmq MAXMSGSIZE (a peer sending a
        bigger frame is disconnected before Python sees a byte) and the codec's total check."""
        return replace(self, limits=replace(self.limits, max_message_bytes=n))


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
    heartbeats_skipped: int = 0
    """Beats not sent: a status-less one after other traffic to the peer within the interval, or a
    client's timer beat after the node pushed its status within it."""
    refused_identity: int = 0
    """HELLOs whose claimed role or node id their CURVE key may not claim."""
    refused_id_in_use: int = 0
    """HELLOs claiming the node id of a live peer (never evicted: refused until it is dead)."""
    refused_over_bound: int = 0
    """HELLOs of new ids past the bound on their role's live ids (SocketOptions.id_bound)."""
    unauthorized: int = 0
    """Messages a peer's role may not send, or naming another node in an id field."""
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class RefusalCounts:
    """What a server refused from one peer (`RpcServer.refusals`) or from all of them
    (`RpcServer.refused`)."""

    unauthorized: int = 0
    """Messages its role may not send, or whose id fields name another node (message.py)."""
    bad: int = 0
    """Malformed messages: undecodable, unknown or unhandled types, failed validation, another
    protocol version (SocketStats.bad_frames, per peer)."""
    refused_hello: int = 0
    """HELLOs refused: a role or node id its key may not claim, a live peer's node id, or a new
    id past the bound on its role's live ids."""
    refused_ids: int = 0
    """HELLOs of new ids refused at the bound on their role's live ids (`SocketOptions.id_bound`;
    also in refused_hello): counted under the key that claimed them."""


S = TypeVar("S", bound=Message)


@dataclass
class Peer(Generic[S]):
    """A client known to a server (it said HELLO); `status` is what its heartbeats last
    carried, decoded as the server's status type (see session.StatusCodec)."""

    node_id: str
    role: str
    identity: bytes
    pid: int = 0
    """The peer's process id, host and node start time, as its Hello said (0 / "": not said):
    for logs and people only, since the client writes them."""
    host: str = ""
    started: float = 0.0
    key: str | None = None
    """The CURVE public key (z85) ZAP authenticated for its HELLO (None: no CURVE)."""
    nonce: bytes = field(default=b"", repr=False)
    """The secret this incarnation got in its Welcome: a HELLO presenting it (with the same key)
    is this peer reconnecting."""
    incarnation: int = 0
    """Which admission of a new process under this id it is (the server's own count): the same
    on a reconnect of one process, another after a restart."""
    last_seen: float = field(default_factory=time.monotonic)
    last_sent: float = 0.0
    """When the server last queued a message to it (time.monotonic()): a beat within the interval
    after it is skipped when the server's beats carry no status."""
    alive: bool = True
    _held: Any = field(default=None, init=False, repr=False, compare=False)
    """The encoded status of its latest heartbeat, not read yet (None: none held)."""
    _decode: Callable[[Any, Any], S | None] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _status: S | None = field(default=None, init=False, repr=False, compare=False)
    _decoded_at: float = field(default=0.0, init=False, repr=False, compare=False)
    """When `_status` became the latest (time.monotonic()): recent_status's age."""
    status: S | None = None
    """Its latest status (a property below: a held heartbeat status is decoded when read)."""
    joined_at: float = field(default_factory=time.time)

    def hold_status(self, raw: Any, decode: Callable[[Any, Any], S | None]) -> None:
        """A heartbeat's status, decoded by `decode(peer, raw)` when `status` is next read (one
        decode however many heartbeats came since). `decode` answers None for a status it cannot
        decode (and says so): the last good one stays, as when such a heartbeat was dropped."""
        self._held, self._decode = raw, decode

    def _get_status(self) -> S | None:
        raw = self._held
        if raw is not None:
            self._held = None
            assert self._decode is not None
            st = self._decode(self, raw)
            if st is not None:
                self._status, self._decoded_at = st, time.monotonic()
        return self._status

    def recent_status(self, max_age_s: float) -> S | None:
        """Its status as last read, while that read is under `max_age_s` old; else `status`
        (the latest). For periodic summaries that a status a moment old serves as well: a
        rollout pushes up to 20 statuses a second, so a summary over every rollout that read
        `status` each time would decode most of them (the manager's refusal sums and serving
        list, read at every heartbeat)."""
        if self._held is not None and (
            self._status is None or time.monotonic() - self._decoded_at >= max_age_s
        ):
            return self._get_status()
        return self._status

    def _set_status(self, status: S | None) -> None:
        self._held, self._status, self._decoded_at = None, status, time.monotonic()


# after @dataclass made `status` a field (an __init__ argument): reads and writes go through the
# held heartbeat status
Peer.status = property(Peer._get_status, Peer._set_status)  # type: ignore[misc]


Handler = Callable[[Peer[Any], Any], Awaitable[Message | None] | Message | None]
"""`handler(peer, msg) -> reply | None`, sync or async (a client's handlers get peer=None)."""


Context = zmq.asyncio.Context
"""The zmq context type, named here so code outside the transport never imports zmq."""


def new_context() -> Context:
    return zmq.asyncio.Context()


@dataclass(frozen=True)
class Wiring:
    """What an object that opens sockets for a node takes from it: the zmq context, the
    socket options (CURVE, heartbeats), the node's id and role, a logger bound to the node,
    and the node's supervised spawn. A node hands out `node.wiring()`; tests build their own."""

    ctx: Context
    opts: SocketOptions
    node_id: str
    role: str
    log: FilteringBoundLogger
    spawn: Spawn


def attach(sock: zmq.Socket, endpoint: str, bind: bool, opts: SocketOptions) -> None:
    """CURVE (tcp only: ipc/inproc stay on this host) as server or client, then bind or connect."""
    if opts.security is not None and endpoint.startswith("tcp://"):
        (opts.security.apply_server if bind else opts.security.apply_client)(sock)
    if bind:
        if endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://") :]
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class Receiver:
    """The messages of a zmq.asyncio socket, taken straight off the socket while some are queued.

    An asyncio receive costs a future, its callbacks and an io-state update per message (about
    50 us in pyzmq 26); a queued message needs none of that, so while messages wait they are
    read with a non-blocking receive on a synchronous shadow of the same socket, and the loop
    gets a turn after every `burst` of them (an asyncio receive of a queued message returns
    without yielding, so without that turn a busy socket would keep every other task waiting).
    """

    def __init__(self, sock: zmq.asyncio.Socket, burst: int = 64):
        self._sock = sock
        self._raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._burst = burst
        self._left = 0

    async def recv(self) -> list[zmq.Frame]:
        if self._left > 0:
            self._left -= 1
            try:
                return self._raw.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._left = 0
        else:
            await asyncio.sleep(0)
        self._left = self._burst
        return await self._sock.recv_multipart(copy=False)


async def send_within(sock: zmq.asyncio.Socket, frames: list[Any], timeout: float | None) -> None:
    """send_multipart with a deadline: a DEALER with no live pipe (IMMEDIATE) or a peer at its
    HWM blocks a send indefinitely, and a dead peer must become an error, never a hang."""
    fut: asyncio.Future[Any] = sock.send_multipart(frames, copy=False)  # type: ignore[assignment]
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
        if not being_cancelled():
            raise PeerDead("socket closed while a send was pending (peer declared dead)") from None
        raise


def being_cancelled() -> bool:
    """Whether the current task has a cancel() pending: a CancelledError it sees is then its own,
    else the error came from a future someone else cancelled (a socket closed under a wait)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


_rid_counter = itertools.count(1)


class Pending:
    """Outstanding requests keyed by rid (b"Q" + 8 bytes); a reply carries b"R" + the same 8."""

    def __init__(self) -> None:
        self.futures: dict[bytes, asyncio.Future[Message]] = {}

    def new(self) -> tuple[bytes, asyncio.Future[Message]]:
        rid = b"Q" + next(_rid_counter).to_bytes(8, "little")
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
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
                # a caller still blocked in its send never awaits this future; awaiting it
                # still raises, this only keeps asyncio from logging "never retrieved"
                fut.exception()
        self.futures.clear()


class Dispatcher:
    """Type -> handler table of one side, and the handler tasks in flight."""

    def __init__(self) -> None:
        self.handlers: dict[type, Handler] = {}
        self.tasks: set[asyncio.Task[Any]] = set()

    def on(self, msg_type: type[Message], handler: Handler) -> None:
        self.handlers[msg_type] = handler

    async def call(self, handler: Handler, peer: Any, msg: Message) -> Message | None:
        result = handler(peer, msg)
        if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
            return await result
        return result

    def track(self, task: asyncio.Task[Any]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def cancel_all(self) -> None:
        for t in list(self.tasks):
            t.cancel()
