"""Per-socket message limits (issue 15): each server accepts what it carries, enforced by zmq.

.venv/bin/python -m pytest tests/test_socket_limits.py -q
"""

from __future__ import annotations

import asyncio
import resource

import zmq
from zmq.utils.monitor import parse_monitor_message

import laminar.protocol  # noqa: F401
from laminar.config import LaminarConfig
from laminar.transport.client import RpcClient
from laminar.transport.server import RpcServer
from laminar.transport.session import Ping, Pong
from laminar.wiring.common import socket_max_message_bytes, trajectory_bytes


def test_limits_fit_what_each_socket_carries():
    cfg = LaminarConfig.model_validate({})
    t = cfg.transport
    manager = socket_max_message_bytes(cfg, "manager")
    buffer = socket_max_message_bytes(cfg, "buffer")
    relay = socket_max_message_bytes(cfg, "relay")
    tools = socket_max_message_bytes(cfg, "tools")
    assert tools == t.control_max_message_bytes == 1 << 20
    # the manager takes ExportReplies of up to max_running partial trajectories, nothing bigger
    assert manager == max(1 << 20, cfg.rollout.max_running * trajectory_bytes(cfg)) < 64 << 20
    assert buffer >= t.buffer_min_message_bytes and buffer < 1 << 30
    assert cfg.relay.chunk_bytes < relay <= cfg.relay.chunk_bytes + (2 << 20)
    assert max(manager, buffer, relay, tools) < t.max_message_bytes
    # longer responses (and multi-turn episodes) raise the buffer's limit; the override wins
    long = LaminarConfig.model_validate({"rollout": {"sampling": {"max_tokens": 200_000}}})
    assert socket_max_message_bytes(long, "buffer") > buffer
    env = LaminarConfig.model_validate(
        {"env": {"fn": "x:y", "limits": {"max_turns": 4}}, "rollout": {"group_size": 16}}
    )
    assert trajectory_bytes(env) > trajectory_bytes(cfg)
    fixed = LaminarConfig.model_validate({"transport": {"buffer_max_message_bytes": 5 << 20}})
    assert socket_max_message_bytes(fixed, "buffer") == 5 << 20


async def _next_event(mon, want: int, timeout: float) -> object:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        frames = await asyncio.wait_for(mon.recv_multipart(), deadline - loop.time())
        ev = parse_monitor_message(frames)
        if ev["event"] == want:
            return ev


async def test_oversized_message_is_dropped_by_zmq(zctx, ipc, fast_opts):
    limit = 64 << 10
    opts = fast_opts().with_max_message_bytes(limit)
    srv = RpcServer(zctx, ipc("manager"), "manager-0", "manager", opts)
    srv.on(Ping, lambda peer, m: Pong(payload=m.payload))
    await srv.start()
    assert srv._sock is not None and srv._sock.getsockopt(zmq.MAXMSGSIZE) == limit
    mon = srv._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    good = RpcClient(zctx, srv.endpoint, "rollout-0", "rollout", fast_opts())
    await good.connect(timeout=5)

    payload = b"\0" * (64 << 20)  # 64 MiB, a thousand times the limit
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    raw = zctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(srv.endpoint)
    received = srv.stats.received
    await raw.send_multipart([b"", b"\x09", payload], copy=False)
    await _next_event(mon, zmq.EVENT_DISCONNECTED, timeout=10)  # zmq cut the sender off

    # nothing reached Python, the server keeps serving others, and it never held the payload
    assert srv.stats.received == received and srv.stats.bad_frames == 0
    assert (await good.request(Ping(payload="still here"), timeout=2)).payload == "still here"
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert grown_kib < 32 << 10, f"peak RSS grew {grown_kib} KiB for a dropped 64 MiB message"
    # a message under the limit still gets through on a fresh connection
    assert (await good.request(Ping(payload="x" * 1000), timeout=2)).payload == "x" * 1000

    raw.close(linger=0)
    srv._sock.disable_monitor()
    mon.close(linger=0)
    await good.close()
    await srv.close()
