"""The wire's own messages: the handshake, liveness, leaving, errors and plain replies.

    client ──Hello──► server ──Welcome──► client          (a fresh socket, before anything else)
    both ──Heartbeat(status)──► every heartbeat_interval_s (any traffic counts as a beat)
    client ──Bye──► server                                 (leaving on purpose, not a death)
    server ──ErrorReply(code)──► client                    (a request was rejected)

The rpc machinery (client.py, server.py) speaks these and nothing else of its own. What a
node reports with its heartbeats is the node layer's business: `Heartbeat.status` holds it
as an already-encoded msgpack value (`msgspec.Raw`), written inline in the header (the same
bytes as a nested struct), and `StatusCodec` turns it back into the type the node layer
names (`laminar.protocol.core.NodeStatus`), so the wire never imports a role's message.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from laminar.message import ANY_ROLE, Message, ProtocolError, message

__all__ = [
    "PROTOCOL_VERSION",
    "Hello",
    "Welcome",
    "Heartbeat",
    "Bye",
    "ErrorReply",
    "Ack",
    "Ping",
    "Pong",
    "NO_STATUS",
    "StatusCodec",
]

PROTOCOL_VERSION = 3
"""Checked at the handshake: a peer speaking another version is refused (3: the incarnation
nonce in Welcome and Hello)."""


@message(0x01, senders=ANY_ROLE)  # not dispatched: the server admits it by its own rules
class Hello(Message):  # client -> server: first message on a fresh socket
    protocol: int
    node_id: str
    role: str
    pid: int = 0
    """The client's process id (0: not said), host and node start time (wall clock; 0: not
    said): facts for logs and people, written by the client, so nothing is decided on them."""
    host: str = ""
    started: float = 0.0
    nonce: bytes = b""
    """The secret the server's last Welcome gave this client (b"": none, a new incarnation).
    Presented on a reconnect, with the same CURVE key, it lets the same process take its own
    live entry over; anyone else claiming a live node id is refused until that peer is dead."""


@message(0x02, senders=ANY_ROLE)
class Welcome(Message):  # server -> client: handshake accepted
    protocol: int
    node_id: str
    role: str
    nonce: bytes = b""
    """A secret for this incarnation of the client (random, from the server; the same on each
    reconnect of the incarnation): the client keeps it and presents it in `Hello.nonce`."""


# 0x03 is laminar.protocol.core.NodeStatus: the status a heartbeat carries

NO_STATUS = msgspec.Raw()
"""A heartbeat without a status. msgspec omits a default by identity, so this one object
(never another empty Raw, which would write a key with no value) stands for none."""


@message(0x04, senders=ANY_ROLE, id_fields=("node_id",))
class Heartbeat(Message):  # both ways, every transport.heartbeat_interval_s
    node_id: str
    seq: int
    status: msgspec.Raw = NO_STATUS
    """The sender's status, msgpack-encoded by `StatusCodec.pack` (NO_STATUS: none)."""


@message(0x05, senders=ANY_ROLE, id_fields=("node_id",))
class Bye(Message):  # client -> server: leaving on purpose (not a death)
    node_id: str
    reason: str = ""


@message(0x06, senders=ANY_ROLE)
class ErrorReply(Message):  # server -> client: the request was rejected
    code: str
    message: str


@message(0x07, senders=ANY_ROLE)
class Ack(Message):  # generic positive reply
    ok: bool = True


@message(0x08, senders=ANY_ROLE)
class Ping(Message):  # any -> any: echo test
    payload: str = ""


@message(0x09, senders=ANY_ROLE)
class Pong(Message):  # reply to Ping
    payload: str = ""


S = TypeVar("S", bound=Message)

_NIL = b"\xc0"
_ENCODER = msgspec.msgpack.Encoder()


class StatusCodec(Generic[S]):
    """A node's status type <-> `Heartbeat.status`. The status must be plain data (no arrays).

    A server reads a status in two steps: `head` on arrival (the id fields its authorization
    checks, without building the rest), `unpack` when the status is first read (Peer.status): a
    rollout pushes its status up to 20 times a second and the manager reads it a few times a
    second, so most pushes are never decoded in full."""

    def __init__(self, status_type: type[S]):
        self.status_type = status_type
        self._decoder = msgspec.msgpack.Decoder(status_type)
        ids = getattr(status_type, "ID_FIELDS", ())
        self._head = msgspec.msgpack.Decoder(
            msgspec.defstruct(f"{status_type.__name__}Head", [(f, Any, None) for f in ids])
        )

    @staticmethod
    def pack(status: Message | None) -> msgspec.Raw:
        return NO_STATUS if status is None else msgspec.Raw(_ENCODER.encode(status))

    def unpack(self, raw: msgspec.Raw) -> S | None:
        """The status a heartbeat carried (None: it carried none), or ProtocolError."""
        if not len(raw) or (len(raw) == 1 and bytes(raw) == _NIL):
            return None
        try:
            return self._decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"Heartbeat.status ({self.status_type.__name__}): {exc}") from None

    def head(self, raw: msgspec.Raw) -> Any:
        """The status's id fields (attributes; None where absent), None when the heartbeat carried
        no status, or ProtocolError when it is not a msgpack map. Skips the rest unbuilt."""
        if not len(raw) or (len(raw) == 1 and bytes(raw) == _NIL):
            return None
        try:
            return self._head.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"Heartbeat.status ({self.status_type.__name__}): {exc}") from None
