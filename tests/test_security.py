"""CURVE over tcp: keys from `laminar keys DIR`; an authorised client works, anyone else gets
nothing through.

.venv/bin/python -m pytest tests/test_security.py -q
"""

from __future__ import annotations

import time

import pytest

import laminar.protocol  # noqa: F401
from laminar.cli import main as cli_main
from laminar.transport.client import RpcClient
from laminar.transport.security import Security
from laminar.transport.server import RpcServer
from laminar.transport.session import Ping, Pong
from laminar.transport.sockets import RequestTimeout
from laminar.transport.streams import PullStream, PushStream


@pytest.fixture
def cluster_keys(tmp_path, capsys):
    """The cluster's keys made through the CLI, plus a second, unrelated key pair."""
    assert cli_main(["keys", str(tmp_path / "cluster")]) == 0
    assert "authorized" in capsys.readouterr().out
    assert cli_main(["keys", str(tmp_path / "stranger")]) == 0
    root = tmp_path / "cluster"
    assert (root / "node.key").exists() and (root / "authorized" / "node.key").exists()
    assert (root / "node.key_secret").stat().st_mode & 0o077 == 0, "secret key readable by others"
    return root, tmp_path / "stranger"


async def _curve_server(zctx, endpoint, opts):
    calls = []
    srv = RpcServer(zctx, endpoint, "srv-0", "test", opts)
    srv.on(Ping, lambda peer, m: calls.append(m) or Pong(payload=m.payload))
    await srv.start()
    return srv, calls


async def test_authorised_client_works_over_curve(zctx, tcp, fast_opts, cluster_keys):
    root, _ = cluster_keys
    opts = fast_opts(security=Security(root))
    srv, calls = await _curve_server(zctx, tcp(), opts)
    cli = RpcClient(zctx, srv.endpoint, "cli-0", "test", opts)
    await cli.connect(timeout=5)
    assert (await cli.request(Ping(payload="secret"), timeout=2)).payload == "secret"
    assert len(calls) == 1 and "cli-0" in srv.peers
    await cli.close()
    await srv.close()


@pytest.mark.parametrize("who", ["unknown_key", "no_curve"])
async def test_unauthorised_client_gets_nothing_through(zctx, tcp, fast_opts, cluster_keys, who):
    root, stranger = cluster_keys
    srv, calls = await _curve_server(zctx, tcp(), fast_opts(security=Security(root)))
    # the stranger even knows the server's public key; its own key is simply not authorised
    bad_sec = (
        Security(stranger, server_key=str(root / "node.key")) if who == "unknown_key" else None
    )
    cli = RpcClient(zctx, srv.endpoint, "intruder-0", "test", fast_opts(security=bad_sec))
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout):
        await cli.connect(timeout=0.5)
    assert time.monotonic() - t0 <= 0.5 + 0.5
    assert calls == [] and srv.peers == {} and srv.stats.received == 0
    # the cluster's own client still gets in while the stranger keeps knocking
    good = RpcClient(zctx, srv.endpoint, "cli-0", "test", fast_opts(security=Security(root)))
    await good.connect(timeout=5)
    assert (await good.request(Ping(payload="ok"), timeout=2)).payload == "ok"
    assert set(srv.peers) == {"cli-0"}
    await good.close()
    await cli.close()
    await srv.close()


async def test_curve_streams_refuse_strangers(zctx, tcp, fast_opts, cluster_keys):
    root, stranger = cluster_keys
    ep = tcp()
    pull = PullStream(zctx, ep, bind=True, opts=fast_opts(security=Security(root)))
    bad = PushStream(
        zctx, ep, opts=fast_opts(security=Security(stranger, server_key=str(root / "node.key")))
    )
    good = PushStream(zctx, ep, opts=fast_opts(security=Security(root)))
    # PUSH queues until a connection completes; the stranger's never does, so its message never
    # arrives
    await bad.send(Ping(payload="intruder"), timeout=1)
    await good.send(Ping(payload="member"), timeout=1)
    assert await pull.recv(timeout=5) == Ping(payload="member")
    with pytest.raises(TimeoutError):
        await pull.recv(timeout=0.5)
    for s in (bad, good, pull):
        s.close()
