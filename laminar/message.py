"""The message base: what a wire message is, before any wire or catalogue exists.

    @message(0x21, senders=("rollout",), id_fields=("rollout_id",))   # one-byte type id
    class Trajectory(Message):                   # unique across the registry; who may send it
        prompt_ids: Annotated[np.ndarray, Arr(("int32",))]
        rollout_id: str

Each type declares, with its fields, who may send it: the roles in `senders` (ANY_ROLE: every
role; (): no one, a record that never goes on a socket), and the body fields (`id_fields`) that
must name the sender's own node id; a batch type names its list fields of such messages
(`nested`), each item held to its own type's table. The rpc server
(laminar/transport/server.py) checks them against the peer's handshake role and id before a
handler runs, so this is the one table of who may do what: with CURVE the role is the one the
peer's key may claim; without, the one it declared.

A leaf: it imports nothing from laminar. The message catalogue (`laminar/protocol/`) and
the wire's own session messages (`laminar/transport/session.py`) define their types on it;
the codec (`laminar/transport/codec.py`) encodes and decodes whatever is in `REGISTRY`,
so neither side imports the other:

    laminar.message ◄── laminar.protocol.*      (the catalogue)
                    ◄── laminar.transport.*     (codec, session messages, sockets)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import msgspec


class ProtocolError(ValueError):
    """A frame set that is not a valid message; the text says what was wrong."""


@dataclass(frozen=True, slots=True)
class Arr:
    """Annotation for an array field: allowed dtypes and number of dims (None = any)."""

    dtypes: tuple[str, ...]
    ndim: int | None = 1
    max_elems: int | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    """What a decoder accepts from the network."""

    max_frames: int = 4096
    max_header_bytes: int = 1 << 20
    max_message_bytes: int = 2 << 30
    max_list_len: int = 1 << 20
    """Items in one list or map."""
    max_str_len: int = 1 << 20
    """Characters in one string."""


DEFAULT_LIMITS = Limits()


class Message(msgspec.Struct, forbid_unknown_fields=True, gc=False, omit_defaults=True):
    """Base of every wire message: a mutable msgspec Struct registered with @message.

    gc=False: a message must not hold a reference cycle through itself (none does: they are
    data), or that cycle is never collected."""

    TYPE: ClassVar[int] = -1
    SENDERS: ClassVar[frozenset[str] | None] = frozenset()
    """The roles that may send it (None: any role); set by @message, empty on unregistered
    structs (they travel only inside a registered message)."""
    ID_FIELDS: ClassVar[tuple[str, ...]] = ()
    """Body fields that must equal the sender's node id; set by @message."""
    NESTED: ClassVar[tuple[str, ...]] = ()
    """List fields whose items are registered messages a sender could have sent alone: each item
    is held to its own type's senders and id fields as well; set by @message."""


ANY_ROLE: tuple[str, ...] = ("*",)
"""`senders=ANY_ROLE`: every role may send it (the wire's own handshake, liveness, echo and
plain replies). Anything a role does to another's state names its roles instead."""

REGISTRY: dict[int, type[Message]] = {}
"""Type id -> message class: every registered type, whichever module defined it."""

ON_REGISTER: list[Callable[[int], None]] = []
"""Called with a type id after (re-)registering it: the codec drops what it cached for it."""

M = TypeVar("M", bound=Message)


def message(
    type_id: int,
    *,
    senders: tuple[str, ...],
    id_fields: tuple[str, ...] = (),
    nested: tuple[str, ...] = (),
) -> Callable[[type[M]], type[M]]:
    """Class decorator: register a Message subclass under its one-byte type id, with the roles
    that may send it (`senders`: role names, ANY_ROLE, or () for none), the fields that must
    equal the sender's node id (`id_fields`), and the list fields whose items are messages held
    to their own rules too (`nested`: a batch of what could have been sent one by one)."""
    if isinstance(senders, str) or ("*" in senders and senders != ANY_ROLE):
        raise ValueError(f"senders must be a tuple of roles or ANY_ROLE, got {senders!r}")

    def wrap(cls: type[M]) -> type[M]:
        if not 0 <= type_id <= 255:
            raise ValueError(f"{cls.__name__}: type id must fit one byte, got {type_id}")
        for what, names in (("id_fields", id_fields), ("nested", nested)):
            unknown = [f for f in names if f not in cls.__struct_fields__]
            if unknown:
                raise ValueError(f"{cls.__name__}: {what} {unknown} are not fields of it")
        if type_id in REGISTRY and REGISTRY[type_id].__name__ != cls.__name__:
            raise ValueError(
                f"type id {type_id:#x} used by {REGISTRY[type_id].__name__} and {cls.__name__}"
            )
        cls.TYPE = type_id
        cls.SENDERS = None if senders == ANY_ROLE else frozenset(senders)
        cls.ID_FIELDS = tuple(id_fields)
        cls.NESTED = tuple(nested)
        REGISTRY[type_id] = cls
        for fn in ON_REGISTER:
            fn(type_id)
        return cls

    return wrap
