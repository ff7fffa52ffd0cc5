"""Identity per role (issue 15): CURVE keys per role, id collisions, the ready barrier, log hygiene.

.venv/bin/python -m pytest tests/test_identity.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import structlog
from structlog.testing import capture_logs

import laminar.protocol  # noqa: F401
from laminar.cli import main as cli_main
from laminar.config import LaminarConfig
from laminar.logs import RateLimitedLog, configure_logging, get_logger
from laminar.transport.client import RpcClient
from laminar.transport.security import Security
from laminar.transport.server import RpcServer
from laminar.transport.session import Ping, Pong
from laminar.transport.sockets import RemoteError, RequestTimeout
from laminar.transport.streams import Publisher, Subscriber
from laminar.wiring.common import plaintext_tcp_warning


@pytest.fixture
def role_keys(tmp_path, capsys):
    """`laminar keys DIR --roles ...`: the server pair plus one pair per role."""
    root = tmp_path / "keys"
    assert cli_main(["keys", str(root), "--roles", "manager,rollout,trainer"]) == 0
    assert "roles.json" in capsys.readouterr().out
    table = json.loads((root / "roles.json").read_text())
    assert sorted(e["name"] for e in table.values()) == ["manager", "node", "rollout", "trainer"]
    for role in ("node", "manager", "rollout", "trainer"):
        assert (root / f"{role}.key_secret").stat().st_mode & 0o077 == 0
        assert (root / "authorized" / f"{role}.key").exists()
    return root


async def _server(zctx, endpoint, opts):
    srv = RpcServer(zctx, endpoint, "manager-0", "manager", opts)
    srv.on(Ping, lambda peer, m: Pong(payload=f"{peer.node_id}:{m.payload}"))
    await srv.start()
    return srv


async def test_curve_per_role_refuses_a_spoofed_role(zctx, tcp, fast_opts, role_keys):
    srv = await _server(zctx, tcp(), fast_opts(security=Security.for_role(role_keys, "manager")))
    rollout_key = fast_opts(security=Security.for_role(role_keys, "rollout"))
    # the rollout key claims its own role: admitted
    good = RpcClient(zctx, srv.endpoint, "rollout-0", "rollout", rollout_key)
    await good.connect(timeout=5)
    assert (await good.request(Ping(payload="a"), timeout=2)).payload == "rollout-0:a"
    # the same key claiming the trainer role (or a trainer's node id) is refused at once
    for node_id, role in (("trainer-0", "trainer"), ("trainer-0", "rollout")):
        fake = RpcClient(zctx, srv.endpoint, node_id, role, rollout_key)
        with pytest.raises(RemoteError) as err:
            await fake.connect(timeout=3)
        assert err.value.code == "identity_refused"
        await fake.close()
    assert srv.stats.refused_identity == 2 and set(srv.peers) == {"rollout-0"}
    # only the trainer key may be the trainer
    trainer = RpcClient(
        zctx,
        srv.endpoint,
        "trainer-0",
        "trainer",
        fast_opts(security=Security.for_role(role_keys, "trainer")),
    )
    await trainer.connect(timeout=5)
    assert (await trainer.request(Ping(payload="b"), timeout=2)).payload == "trainer-0:b"
    assert (await good.request(Ping(payload="c"), timeout=2)).payload == "rollout-0:c"
    await trainer.close()
    await good.close()
    await srv.close()


async def test_host_key_claims_only_its_roles(zctx, tcp, fast_opts, role_keys, capsys):
    assert cli_main(["keys", str(role_keys), "--name", "host-3", "--roles", "rollout,tools"]) == 0
    srv = await _server(zctx, tcp(), fast_opts(security=Security.for_role(role_keys, "manager")))
    host = fast_opts(security=Security(role_keys, "host-3"))
    ok = RpcClient(zctx, srv.endpoint, "tools-1", "tools", host)
    await ok.connect(timeout=5)
    bad = RpcClient(zctx, srv.endpoint, "buffer-0", "buffer", host)
    with pytest.raises(RemoteError, match="may claim"):
        await bad.connect(timeout=3)
    assert srv.stats.refused_identity == 1 and set(srv.peers) == {"tools-1"}
    await bad.close()
    await ok.close()
    await srv.close()


async def test_id_collision_never_evicts_a_live_peer(zctx, ipc, fast_opts, wait_until):
    opts = fast_opts()
    srv = await _server(zctx, ipc("mgr"), opts)
    live = RpcClient(zctx, srv.endpoint, "rollout-0", "rollout", opts, started=1.0)
    await live.connect(timeout=5)
    holder = srv.peers["rollout-0"].identity
    # another process (its own options, another start time) claims rollout-0 while the holder
    # heartbeats
    impostor = RpcClient(zctx, srv.endpoint, "rollout-0", "rollout", fast_opts(), started=2.0)
    with pytest.raises(RequestTimeout, match="id_in_use"):
        await impostor.connect(timeout=opts.dead_after_s * 2)
    assert srv.stats.refused_id_in_use >= 1
    assert srv.peers["rollout-0"].identity == holder and srv.peers["rollout-0"].alive
    assert (await live.request(Ping(payload="x"), timeout=2)).payload == "rollout-0:x"
    # the holder dies without a word: once liveness declares it dead, the newcomer gets in
    await live.close(say_bye=False)
    await wait_until(lambda: not srv.peers["rollout-0"].alive, 5, "holder declared dead")
    await impostor.connect(timeout=5)
    assert srv.peers["rollout-0"].started == 2.0
    assert (await impostor.request(Ping(payload="y"), timeout=2)).payload == "rollout-0:y"
    await impostor.close()
    await srv.close()


async def test_same_process_reconnect_takes_its_entry_over(zctx, ipc, fast_opts):
    opts = fast_opts()
    srv = await _server(zctx, ipc("mgr"), opts)
    cli = RpcClient(zctx, srv.endpoint, "rollout-0", "rollout", opts, started=1.0)
    await cli.connect(timeout=5)
    first = srv.peers["rollout-0"].identity
    incarnation = srv.peers["rollout-0"].incarnation
    await cli.connect(timeout=5)  # a fresh socket from the same process (its own reconnect)
    assert srv.peers["rollout-0"].identity != first and srv.stats.refused_id_in_use == 0
    assert srv.peers["rollout-0"].incarnation == incarnation  # not a restart
    await cli.close()
    await srv.close()


async def test_copying_pid_host_and_start_time_takes_no_live_entry(
    zctx, ipc, fast_opts, wait_until
):
    """Issue 29: "same process" is the nonce the server issued, never what a HELLO says about
    itself. Here both clients live in one process, so pid and host match, and the impostor copies
    the start time and makes up a nonce: refused while the holder lives, counted per claimed id."""
    opts = fast_opts()
    srv = await _server(zctx, ipc("mgr"), opts)
    live = RpcClient(zctx, srv.endpoint, "rollout-0", "rollout", opts, started=1.0)
    await live.connect(timeout=5)
    holder = srv.peers["rollout-0"]
    assert len(holder.nonce) >= 16 and opts.nonces[(srv.endpoint, "rollout-0")] == holder.nonce
    other = fast_opts()  # another process: its own options
    other.nonces[(srv.endpoint, "rollout-0")] = b"\x00" * 16
    impostor = RpcClient(zctx, srv.endpoint, "rollout-0", "rollout", other, started=1.0)
    assert (impostor._hello.pid, impostor._hello.host) == (holder.pid, holder.host)
    with pytest.raises(RequestTimeout, match="id_in_use"):
        await impostor.connect(timeout=opts.dead_after_s * 2)
    assert srv.peers["rollout-0"] is holder and holder.alive
    assert srv.refusals["rollout-0"].refused_hello >= 1 and srv.refused.refused_hello >= 1
    assert (await live.request(Ping(payload="x"), timeout=2)).payload == "rollout-0:x"
    # the holder dies: the impostor is a new incarnation (a new nonce and number), not a reconnect
    await live.close(say_bye=False)
    await wait_until(lambda: not holder.alive, 5, "holder declared dead")
    await impostor.connect(timeout=5)
    new = srv.peers["rollout-0"]
    assert new.incarnation != holder.incarnation and new.nonce != holder.nonce
    await impostor.close()
    await srv.close()


async def test_a_reconnect_needs_the_nonce_and_the_same_key(zctx, tcp, fast_opts, role_keys):
    """With CURVE, the nonce alone is not enough: another key that may claim the id (a host's
    rollout key), presenting the holder's nonce, is refused; the holder's own reconnect on a
    fresh socket (a new routing id) takes its entry over."""
    assert cli_main(["keys", str(role_keys), "--name", "host-3", "--roles", "rollout"]) == 0
    srv = await _server(zctx, tcp(), fast_opts(security=Security.for_role(role_keys, "manager")))
    rollout_key = fast_opts(security=Security.for_role(role_keys, "rollout"))
    live = RpcClient(zctx, srv.endpoint, "rollout-0", "rollout", rollout_key)
    await live.connect(timeout=5)
    holder = srv.peers["rollout-0"]
    host_key = fast_opts(security=Security(role_keys, "host-3"))
    host_key.nonces[(srv.endpoint, "rollout-0")] = holder.nonce  # a leaked nonce
    other = RpcClient(zctx, srv.endpoint, "rollout-0", "rollout", host_key)
    with pytest.raises(RequestTimeout, match="id_in_use"):
        await other.connect(timeout=1.0)
    assert srv.peers["rollout-0"] is holder
    await live.connect(timeout=5)  # its own reconnect: same key, its nonce
    again = srv.peers["rollout-0"]
    assert again.identity != holder.identity and again.incarnation == holder.incarnation
    assert again.key == holder.key is not None
    assert (await live.request(Ping(payload="y"), timeout=2)).payload == "rollout-0:y"
    await other.close()
    await live.close()
    await srv.close()


async def test_every_socket_of_one_node_is_one_incarnation(zctx, ipc, fast_opts):
    """A node's clients share its options and so the nonce: a second socket of the same node to
    the same server (a relay probing its upstream again) takes the entry over at once."""
    opts = fast_opts()
    srv = await _server(zctx, ipc("mgr"), opts)
    first = RpcClient(zctx, srv.endpoint, "relay-1", "relay", opts)
    await first.connect(timeout=5)
    holder = srv.peers["relay-1"]
    second = RpcClient(zctx, srv.endpoint, "relay-1", "relay", opts)
    await second.connect(timeout=2)
    again = srv.peers["relay-1"]
    assert again.identity != holder.identity and again.incarnation == holder.incarnation
    assert srv.stats.refused_id_in_use == 0
    assert (await second.request(Ping(payload="z"), timeout=2)).payload == "relay-1:z"
    await second.close()
    await first.close(say_bye=False)
    await srv.close()


async def test_routing_ids_are_random(zctx, ipc, fast_opts):
    """zmq's own routing ids are a counter (0 + 4 bytes) that a stranger could claim once a
    peer's connection dropped; ours are random, so a live entry cannot be reached by guessing."""
    opts = fast_opts()
    srv = await _server(zctx, ipc("mgr"), opts)
    clients = [RpcClient(zctx, srv.endpoint, f"rollout-{i}", "rollout", opts) for i in range(2)]
    for c in clients:
        await c.connect(timeout=5)
    ids = [srv.peers[f"rollout-{i}"].identity for i in range(2)]
    assert all(len(i) == 16 and i[0] != 0 for i in ids) and ids[0] != ids[1]
    for c in clients:
        await c.close()
    await srv.close()


async def test_ready_barrier_accepts_only_members(zctx, ipc, fast_opts):
    opts = fast_opts()
    members = {"rollout-0"}
    pub = Publisher(zctx, ipc("pub"), "relay-0", opts, members=lambda: members)
    await pub.start()
    fake = Subscriber(zctx, pub.endpoint, "rollout-999.w1", ["weights"], opts)
    fake.start()
    with pytest.raises(RequestTimeout):
        await pub.wait_for(1, timeout=0.5)
    with pytest.raises(RequestTimeout):
        await pub.wait_for({"rollout-999.w1"}, timeout=0.3)
    assert "rollout-999.w1" in pub.subscribers and pub.ready == set()
    real = Subscriber(zctx, pub.endpoint, "rollout-0", ["weights"], opts)
    real.start()
    await pub.wait_for({"rollout-0"}, timeout=5)
    assert pub.ready == {"rollout-0"}
    # a member that joins later (HELLO after its subscription) satisfies the barrier then
    members.add("rollout-999")
    await pub.wait_for(2, timeout=5)
    fake.close()
    real.close()
    await pub.close()


def test_plaintext_tcp_is_warned_about():
    tcp_cfg = LaminarConfig.model_validate({"cluster": {"transport": "tcp"}})
    assert "WITHOUT CURVE" in (plaintext_tcp_warning(tcp_cfg) or "")
    curve = LaminarConfig.model_validate(
        {"cluster": {"transport": "tcp"}, "security": {"keys_dir": "/k"}}
    )
    assert plaintext_tcp_warning(curve) is None
    assert (
        plaintext_tcp_warning(LaminarConfig.model_validate({"cluster": {"transport": "ipc"}}))
        is None
    )


# ---- log hygiene ----------------------------------------------------------------------


def test_json_logs_carry_no_bare_nan(capsys):
    configure_logging("info", json_logs=True)
    try:
        get_logger(role="test").info(
            "metrics",
            loss=float("nan"),
            grads=[1.0, float("inf"), {"x": float("-inf")}],
            np_val=np.float32("nan"),
            ok=0.5,
        )
        line = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        structlog.reset_defaults()

    def strict(const: str) -> None:
        raise AssertionError(f"bare {const} in a JSON log line: {line}")

    rec = json.loads(line, parse_constant=strict)
    assert rec["loss"] is None and rec["np_val"] is None and rec["ok"] == 0.5
    assert rec["grads"] == [1.0, None, {"x": None}]


def test_rate_limited_log_counts_and_summarises():
    now = [0.0]
    with capture_logs() as logs:
        bad = RateLimitedLog(
            structlog.get_logger(), "bad_message", first=3, every_s=5.0, clock=lambda: now[0]
        )
        for i in range(1000):
            now[0] = i * 0.01  # 1000 bad messages over 10 s
            bad.warning(error=f"e{i}")
        now[0] = 20.0
        bad.flush()
        bad.flush()  # nothing pending: no line
    full = [e for e in logs if e["event"] == "bad_message"]
    summaries = [e for e in logs if e["event"] == "bad_message_summary"]
    assert [e["error"] for e in full] == ["e0", "e1", "e2"]
    assert 2 <= len(summaries) <= 3
    assert sum(e["suppressed"] for e in summaries) == 997 and bad.total == 1000
    assert summaries[-1]["last_error"] == "e999"


async def test_server_bad_message_logs_are_rate_limited(zctx, ipc, fast_opts, wait_until):
    import zmq

    srv = await _server(zctx, ipc("srv"), fast_opts())
    raw = zctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(srv.endpoint)
    with capture_logs() as logs:
        for _ in range(300):
            await raw.send_multipart([b"", b"\x7f", b"garbage"])
        await wait_until(lambda: srv.stats.bad_frames >= 300, 10, "300 bad messages counted")
    lines = [e for e in logs if e["event"].startswith("bad_message")]
    assert srv.stats.bad_frames == 300
    assert len(lines) <= 10, f"{len(lines)} log lines for 300 bad messages"
    raw.close(linger=0)
    await srv.close()
