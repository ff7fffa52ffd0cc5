"""Authorization per message (issue 29): the role table each message type declares.

.venv/bin/python -m pytest tests/test_authorization.py -q

One RpcServer with a recording handler for every registered type, and one client per role:
each role sends every type it may not send, and each is refused (ErrorReply "unauthorized"),
counted per peer, and never reaches its handler. Id fields naming another node are refused
too, and with CURVE the role is the one the peer's key may claim.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal, Union

import msgspec
import numpy as np
import pytest
from structlog.testing import capture_logs

import laminar.buffer.records  # noqa: F401  (the journal records: registered, sent by no one)
import laminar.protocol  # noqa: F401  (the catalogue: every role message registered)
from laminar.cli import main as cli_main
from laminar.config import ROLES
from laminar.message import REGISTRY, Arr, Message, message
from laminar.protocol.buffer import BatchRequest, PromptRequest
from laminar.protocol.core import NodeStatus
from laminar.protocol.relay import StageRequest, WeightLayout
from laminar.protocol.trainer import VersionPublished
from laminar.transport.client import RpcClient
from laminar.transport.security import Security
from laminar.transport.server import RpcServer
from laminar.transport.session import Bye, Heartbeat, StatusCodec
from laminar.transport.sockets import RemoteError

CLI_ROLE = "cli"
"""The role `laminar status` (launch/status.py) and tooling connect with."""
ALL_ROLES = (*ROLES, CLI_ROLE)

LAMINAR_TYPES = sorted(
    (cls for cls in REGISTRY.values() if cls.__module__.startswith("laminar.")),
    key=lambda cls: cls.TYPE,
)
"""Every registered message of the system (test modules may register their own)."""


def forbidden(cls: type[Message]) -> list[str]:
    return [] if cls.SENDERS is None else [r for r in ALL_ROLES if r not in cls.SENDERS]


def _value(tp: Any) -> Any:
    """A valid value of a field type: zeros, empties, a sample of a nested struct."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        arr = next((m for m in meta if isinstance(m, Arr)), None)
        return np.zeros(1, arr.dtypes[0]) if arr is not None else _value(base)
    if origin is Literal:
        return typing.get_args(tp)[0]
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        return None if type(None) in args else _value(args[0])
    if origin is list:
        return []
    if origin is dict:
        return {}
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return sample(tp)
    return {str: "x", int: 0, float: 0.0, bool: False, bytes: b""}.get(tp)


def sample(cls: type[Any], node_id: str = "x") -> Any:
    """An instance of a message type from its required fields; id fields name `node_id`."""
    hints = typing.get_type_hints(cls, include_extras=True)
    ids = getattr(cls, "ID_FIELDS", ())
    kw = {
        f.name: node_id if f.name in ids else _value(hints[f.name])
        for f in msgspec.structs.fields(cls)
        if f.required or f.name in ids
    }
    return cls(**kw)


def test_every_message_declares_its_senders_from_known_roles():
    assert len(LAMINAR_TYPES) > 60
    for cls in LAMINAR_TYPES:
        assert cls.SENDERS is None or cls.SENDERS <= set(ALL_ROLES), cls.__name__
        for name in cls.ID_FIELDS:
            assert name in cls.__struct_fields__, (cls.__name__, name)
    # the trainer alone moves versions and batches (issue 29, item 4)
    for name in ("StageRequest", "PushChunk", "CommitRequest", "RelayReset", "BatchRequest"):
        assert _by_name(name).SENDERS == {"trainer"}, name
    assert _by_name("BatchCommit").SENDERS == {"trainer"}
    assert _by_name("VersionPublished").SENDERS == {"trainer"}
    # the relay chain is relays only; the cli only asks
    for name in ("FetchChunk", "OfferRequest", "VersionOffer", "WeightChunk"):
        assert _by_name(name).SENDERS == {"relay"}, name
    assert _by_name("ChainUpdate").SENDERS == {"manager"}
    asks = {c.__name__ for c in LAMINAR_TYPES if c.SENDERS is not None and CLI_ROLE in c.SENDERS}
    assert asks == {"StatusRequest", "BufferStatsRequest", "ChainInfoRequest", "ToolStatsRequest"}
    # journal records never go on a socket
    for cls in LAMINAR_TYPES:
        if cls.__module__ == "laminar.buffer.records":
            assert cls.SENDERS == frozenset(), cls.__name__


def test_the_decorator_refuses_a_malformed_table():
    with pytest.raises(ValueError, match="tuple of roles"):
        message(0xFE, senders="trainer")  # type: ignore[arg-type]  # a str, not a tuple
    with pytest.raises(ValueError, match="tuple of roles"):
        message(0xFE, senders=("*", "trainer"))

    class NoSuchField(Message):
        trainer_id: str

    with pytest.raises(ValueError, match="not fields"):
        message(0xFE, senders=("trainer",), id_fields=("rollout_id",))(NoSuchField)
    with pytest.raises(ValueError, match="nested"):
        message(0xFE, senders=("trainer",), nested=("items",))(NoSuchField)
    assert 0xFE not in REGISTRY


def _by_name(name: str) -> type[Message]:
    return next(c for c in LAMINAR_TYPES if c.__name__ == name)


def test_every_message_type_can_be_sampled():
    for cls in LAMINAR_TYPES:
        msg = sample(cls)
        assert type(msg) is cls


class Recorder:
    """An RpcServer that handles every registered type by recording it."""

    def __init__(self, srv: RpcServer[Any]):
        self.srv, self.calls = srv, []
        for cls in LAMINAR_TYPES:
            srv.on(cls, self.record)

    def record(self, peer: Any, msg: Message) -> None:
        self.calls.append((peer.node_id, type(msg).__name__))


@pytest.fixture
async def recorder(zctx, ipc, fast_opts):
    srv = RpcServer(
        zctx, ipc("auth"), "buffer-0", "buffer", fast_opts(), peer_status=StatusCodec(NodeStatus)
    )
    rec = Recorder(srv)
    await srv.start()
    yield rec
    await srv.close()


async def _client(zctx, srv, node_id, role, opts):
    cli = RpcClient(zctx, srv.endpoint, node_id, role, opts)
    await cli.connect(timeout=3)
    return cli


@pytest.mark.parametrize("role", ALL_ROLES)
async def test_a_role_is_refused_every_message_it_may_not_send(
    recorder, zctx, fast_opts, role, wait_until
):
    srv, node_id = recorder.srv, f"{role}-0"
    cli = await _client(zctx, srv, node_id, role, fast_opts())
    refused = [cls for cls in LAMINAR_TYPES if role in forbidden(cls)]
    assert refused, role
    try:
        for cls in refused:
            with pytest.raises(RemoteError) as err:
                await cli.request(sample(cls, node_id), timeout=2, retries=0)
            assert err.value.code == "unauthorized", cls.__name__
            assert cls.__name__ in str(err.value) and role in str(err.value)
        # a one-way message is dropped the same way (nothing to answer), and counted
        await cli.send(sample(refused[0], node_id))
        n = len(refused) + 1
        await wait_until(lambda: srv.refused.unauthorized == n, 2, "the one-way refusal")
    finally:
        await cli.close()
    assert recorder.calls == []
    assert srv.refusals[node_id].unauthorized == n
    assert srv.stats.unauthorized == n
    assert srv.refusals[node_id].bad == 0 and srv.refused.bad == 0


async def test_a_role_may_send_what_it_may_send(recorder, zctx, fast_opts):
    """The other half of the table: a message from a role it names reaches its handler."""
    clients = {r: await _client(zctx, recorder.srv, f"{r}-0", r, fast_opts()) for r in ALL_ROLES}
    sent = []
    try:
        for cls in LAMINAR_TYPES:
            if cls.SENDERS is None or cls in (Heartbeat, Bye) or cls.__name__ == "Hello":
                continue  # the wire's own: answered by the server itself, not a handler
            for role in sorted(cls.SENDERS):
                await clients[role].request(sample(cls, f"{role}-0"), timeout=2, retries=0)
                sent.append((f"{role}-0", cls.__name__))
    finally:
        for cli in clients.values():
            await cli.close()
    assert recorder.calls == sent
    assert recorder.srv.refused.unauthorized == 0


ID_TYPES = [cls for cls in LAMINAR_TYPES if cls.ID_FIELDS]


@pytest.mark.parametrize("cls", ID_TYPES, ids=lambda c: c.__name__)
async def test_an_id_field_naming_another_node_is_refused(
    recorder, zctx, fast_opts, cls, wait_until
):
    assert cls.ID_FIELDS
    role = sorted(cls.SENDERS)[0] if cls.SENDERS else "rollout"
    me, other = f"{role}-0", f"{role}-1"
    cli = await _client(zctx, recorder.srv, me, role, fast_opts())
    try:
        with pytest.raises(RemoteError) as err:
            await cli.request(sample(cls, other), timeout=2, retries=0)
        assert err.value.code == "unauthorized"
        assert other in str(err.value) and me in str(err.value)
    finally:
        await cli.close(say_bye=False)
    assert recorder.calls == []
    assert recorder.srv.refusals[me].unauthorized == 1


NESTED_TYPES = [cls for cls in LAMINAR_TYPES if cls.NESTED]


@pytest.mark.parametrize("cls", NESTED_TYPES, ids=lambda c: c.__name__)
async def test_a_batch_is_held_to_each_of_its_items_rules(recorder, zctx, fast_opts, cls):
    """A batch of what could have gone one by one (`nested`): an item naming another node is
    refused as it would be alone, and the whole message with it; items naming the sender pass."""
    assert cls.NESTED and cls.SENDERS
    role = sorted(cls.SENDERS)[0]
    me, other = f"{role}-0", f"{role}-1"
    hints = typing.get_type_hints(cls, include_extras=True)
    refused = 0
    cli = await _client(zctx, recorder.srv, me, role, fast_opts())
    try:
        for name in cls.NESTED:
            (item_type,) = typing.get_args(hints[name])
            assert item_type.SENDERS is not None and role in item_type.SENDERS, item_type
            mine = sample(cls, me)
            setattr(mine, name, [sample(item_type, me), sample(item_type, me)])
            await cli.request(mine, timeout=2, retries=0)
            if not item_type.ID_FIELDS:
                continue
            forged = sample(cls, me)
            setattr(forged, name, [sample(item_type, me), sample(item_type, other)])
            with pytest.raises(RemoteError) as err:
                await cli.request(forged, timeout=2, retries=0)
            refused += 1
            assert err.value.code == "unauthorized"
            assert f"{name}[1]" in str(err.value) and other in str(err.value)
    finally:
        await cli.close(say_bye=False)
    assert refused >= 1  # at least one item type names its sender
    assert recorder.calls == [(me, cls.__name__)] * len(cls.NESTED)
    assert recorder.srv.refusals[me].unauthorized == refused


async def test_a_heartbeat_status_naming_another_node_is_dropped(
    recorder, zctx, fast_opts, wait_until
):
    srv = recorder.srv
    mine = NodeStatus(node_id="rollout-0", role="rollout", version=3)
    cli = RpcClient(zctx, srv.endpoint, "rollout-0", "rollout", fast_opts(), status=lambda: mine)
    await cli.connect(timeout=3)
    try:
        await wait_until(lambda: srv.peers["rollout-0"].status is not None, 2, "own status")
        mine = NodeStatus(node_id="rollout-1", role="rollout", version=1_000_000)
        await wait_until(lambda: srv.refused.unauthorized >= 2, 2, "forged statuses refused")
        status = srv.peers["rollout-0"].status
        assert status is not None and status.version == 3
        assert srv.peers["rollout-0"].alive  # the beats still count as liveness
    finally:
        await cli.close()


async def test_refusals_are_logged_rate_limited(recorder, zctx, fast_opts):
    cli = await _client(zctx, recorder.srv, "rollout-0", "rollout", fast_opts())
    try:
        with capture_logs() as logs:
            for _ in range(12):
                with pytest.raises(RemoteError):
                    await cli.request(BatchRequest("rollout-0", 1, 0), timeout=2, retries=0)
    finally:
        await cli.close()
    lines = [e for e in logs if e["event"] == "unauthorized_message"]
    assert 1 <= len(lines) <= 5
    assert lines[0]["peer_role"] == "rollout" and lines[0]["msg"] == "BatchRequest"
    assert recorder.srv.refusals["rollout-0"].unauthorized == 12


async def test_with_curve_the_role_comes_from_the_key(zctx, tcp, fast_opts, tmp_path, capsys):
    """A rollout key cannot claim the trainer's role, and as a rollout it may not stage weights,
    ask for batches or announce versions; the trainer key may."""
    keys = tmp_path / "keys"
    assert cli_main(["keys", str(keys), "--roles", "relay,rollout,trainer"]) == 0
    capsys.readouterr()
    srv = RpcServer(zctx, tcp(), "relay-0", "relay", fast_opts(security=Security(keys)))
    rec = Recorder(srv)
    await srv.start()
    rollout = RpcClient(
        zctx, srv.endpoint, "rollout-0", "rollout", fast_opts(security=Security(keys, "rollout"))
    )
    trainer = RpcClient(
        zctx, srv.endpoint, "trainer-0", "trainer", fast_opts(security=Security(keys, "trainer"))
    )
    layout = WeightLayout(names=[], dtypes=[], shapes=[], offsets=[], total_bytes=0)
    try:
        await rollout.connect(timeout=5)
        await trainer.connect(timeout=5)
        for msg in (
            StageRequest(version=1_000_000, layout=layout, takeover=True),
            BatchRequest("rollout-0", 1, 0, restart=True),
            VersionPublished(trainer_id="rollout-0", version=1_000_000, step=0),
            PromptRequest("rollout-0", 1, 0),
        ):
            if type(msg) is PromptRequest:  # its own message: through
                await rollout.request(msg, timeout=2, retries=0)
                continue
            with pytest.raises(RemoteError, match="unauthorized"):
                await rollout.request(msg, timeout=2, retries=0)
        await trainer.request(StageRequest(version=1, layout=layout), timeout=2, retries=0)
    finally:
        await rollout.close()
        await trainer.close()
        await srv.close()
    assert rec.calls == [("rollout-0", "PromptRequest"), ("trainer-0", "StageRequest")]
    assert srv.refusals["rollout-0"].unauthorized == 3
