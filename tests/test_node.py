"""Node lifecycle: supervision, graceful stop bounds, registration, and compute() that keeps
heartbeats alive.

    .venv/bin/python -m pytest tests/test_node.py -q

The nodes here are small Node subclasses (no role modules), so these tests pin the
runtime in laminar/node.py and nothing else. The manager is a bare RpcServer at the
config's manager endpoint.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import TypeVar

import pytest

import laminar.protocol  # noqa: F401
from laminar.config import LaminarConfig, config_from_dict
from laminar.node import NODE_STATUS, Node, NodeFailed, run_nodes
from laminar.protocol.core import NodeStatus
from laminar.transport.client import RpcClient
from laminar.transport.server import RpcServer
from laminar.transport.session import Ping, Pong
from laminar.transport.sockets import Context, SocketOptions, new_context
from laminar.wiring.common import node_settings, socket_options

SLACK_S = 0.3


@pytest.fixture
def cfg(short_dir):
    return config_from_dict(
        {
            "name": f"t{os.getpid()}",
            "cluster": {"transport": "ipc", "ipc_dir": str(short_dir)},
            "transport": {
                "heartbeat_interval_s": 0.1,
                "heartbeat_liveness": 4,
                "handshake_timeout_s": 1.0,
                "startup_timeout_s": 5.0,
                "stop_timeout_s": 0.4,
                "request_timeout_s": 1.0,
                "request_retries": 0,
                "reconnect_backoff_s": 0.02,
                "reconnect_backoff_max_s": 0.1,
            },
        }
    )


N = TypeVar("N", bound=Node)


def make(cls: type[N], cfg: LaminarConfig, ctx: Context, index: int = 0) -> N:
    """A node of `cls` (its role from the class) wired from `cfg`."""
    return cls(node_settings(cfg, cls.role, index), ctx)


class Solo(Node):
    """A node that needs no manager; records what the lifecycle did to it."""

    role = "solo"
    registers_with_manager = False

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.events: list[str] = []

    async def drain(self) -> None:
        self.events.append("drain")

    async def teardown(self) -> None:
        self.events.append("teardown")


def busy(seconds: float) -> int:
    """Pure-Python work that holds the GIL (the worst case for a loop sharing the process)."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
    return n


# ---- supervision -----------------------------------------------------------------------------


async def test_a_dying_background_task_stops_the_node_loudly(cfg, zctx):
    class Boom(Solo):
        async def main(self) -> None:
            self.spawn(self._work(), "worker")
            await self.stopping.wait()

        async def _work(self) -> None:
            await asyncio.sleep(0.05)  # some work, then a bug
            raise RuntimeError("kaput")

    node = make(Boom, cfg, zctx)
    node.on_close(lambda: node.events.append("closer"))
    t0 = time.monotonic()
    with pytest.raises(NodeFailed, match="worker died") as info:
        await asyncio.wait_for(node.run(), 5)
    assert time.monotonic() - t0 <= 0.05 + cfg.transport.stop_timeout_s + SLACK_S
    assert isinstance(info.value.__cause__, RuntimeError) and "kaput" in str(info.value.__cause__)
    assert node.stopped.is_set() and "teardown" in node.events and "closer" in node.events


async def test_a_dying_transport_task_stops_the_node_loudly(cfg, zctx):
    """server() and client() start their sockets' tasks through the node's spawn: a server reader
    (here: its peer-join callback raising) or a client heartbeat (its server-dead callback
    raising) that dies stops the node like any other supervised task."""

    def boom(*_: object) -> None:
        raise RuntimeError("kaput")

    class Serving(Solo):
        async def setup(self) -> None:
            await self.server(cfg.endpoint("trainer"), on_peer_join=boom).start()

    node = make(Serving, cfg, zctx)
    task = asyncio.ensure_future(node.run())
    await node.wait_ready(5)
    peer = RpcClient(zctx, cfg.endpoint("trainer"), "peer-0", "peer", node.opts)
    await peer.connect(timeout=5)  # WELCOME goes out before the join callback runs
    with pytest.raises(NodeFailed, match="server-reader died") as info:
        await asyncio.wait_for(task, 5)
    assert "kaput" in str(info.value.__cause__)
    await peer.close(say_bye=False)

    upstream = RpcServer(zctx, cfg.endpoint("buffer"), "buffer-0", "buffer", node.opts)
    await upstream.start()

    class Client(Solo):
        async def setup(self) -> None:
            await self.client(cfg.endpoint("buffer"), on_server_dead=boom).connect(timeout=5)

    node = make(Client, cfg, zctx)
    task = asyncio.ensure_future(node.run())
    await node.wait_ready(5)
    await upstream.close()  # the node's client declares it dead and its callback raises
    with pytest.raises(NodeFailed, match="client-heartbeat died"):
        await asyncio.wait_for(task, 5)


async def test_main_raising_is_a_node_failure_and_main_returning_is_a_clean_stop(cfg, zctx):
    class Bad(Solo):
        async def main(self) -> None:
            raise ValueError("bad main")

    class Done(Solo):
        async def main(self) -> None:
            self.events.append("work")

    with pytest.raises(NodeFailed) as info:
        await asyncio.wait_for(make(Bad, cfg, zctx).run(), 5)
    assert isinstance(info.value.__cause__, ValueError)
    done = make(Done, cfg, zctx)
    await asyncio.wait_for(done.run(), 5)
    assert done.stop_reason == "main finished" and done.events == ["work", "teardown"]


# ---- stopping --------------------------------------------------------------------------------


async def test_sigterm_drains_and_stops_within_the_bound(cfg, zctx):
    node = make(Solo, cfg, zctx)
    runner = asyncio.create_task(run_nodes([node]))  # installs the SIGTERM/SIGINT handlers
    await node.wait_ready(5)
    t0 = time.monotonic()
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(runner, 5)
    assert time.monotonic() - t0 <= cfg.transport.stop_timeout_s + SLACK_S
    assert node.stop_reason == "signal SIGTERM" and node.events == ["drain", "teardown"]


async def test_a_stuck_drain_is_cut_at_stop_timeout(cfg, zctx):
    class Stuck(Solo):
        async def drain(self) -> None:
            await asyncio.Event().wait()  # never finishes

    node = make(Stuck, cfg, zctx)
    task = asyncio.create_task(node.run())
    await node.wait_ready(5)
    t0 = time.monotonic()
    node.request_stop("test")
    await asyncio.wait_for(task, 5)
    assert (
        cfg.transport.stop_timeout_s
        <= time.monotonic() - t0
        <= cfg.transport.stop_timeout_s + SLACK_S
    )


# ---- registration ------------------------------------------------------------------------------


async def test_node_registers_with_the_manager_and_heartbeats_its_status(cfg, zctx, wait_until):
    class Member(Node):
        role = "tools"  # a node role: only those report a NodeStatus

        def status(self) -> NodeStatus:
            return NodeStatus(node_id=self.node_id, role=self.role, version=7, kv_use=0.25)

    manager = RpcServer(
        zctx,
        cfg.endpoint("manager"),
        "manager-0",
        "manager",
        socket_options(cfg),
        peer_status=NODE_STATUS,
    )
    await manager.start()
    nodes = [make(Member, cfg, zctx, i) for i in range(2)]
    tasks = [asyncio.create_task(n.run()) for n in nodes]
    await asyncio.gather(*(n.wait_ready(5) for n in nodes))
    await wait_until(
        lambda: (
            all(p.status is not None for p in manager.peers.values()) and len(manager.peers) == 2
        ),
        2,
        "both nodes' status at the manager",
    )
    assert (
        manager.peers["tools-1"].status.version == 7 and manager.peers["tools-0"].pid == os.getpid()
    )
    # a graceful stop says Bye (the node leaves); a crash does not (the manager sees a death)
    nodes[0].request_stop("done")
    await asyncio.wait_for(tasks[0], 5)
    await wait_until(lambda: "tools-0" not in manager.peers, 2, "tools-0 leaving")
    nodes[1].say_bye = False
    tasks[1].cancel()
    await asyncio.gather(tasks[1], return_exceptions=True)
    await wait_until(lambda: not manager.peers["tools-1"].alive, 2, "tools-1 declared dead")
    assert manager.stats.peers_dead == 1
    await manager.close()


async def test_node_without_a_manager_fails_to_start_in_time(cfg, zctx):
    class Lonely(Node):
        role = "lonely"

    node = make(
        Lonely,
        cfg.model_copy(
            update={"transport": cfg.transport.model_copy(update={"startup_timeout_s": 0.3})}
        ),
        zctx,
    )
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(node.run(), 5)
    assert time.monotonic() - t0 <= 0.3 + SLACK_S and node.stopped.is_set()


# ---- compute off the loop ----------------------------------------------------------------------


class PeerThread(threading.Thread):
    """An RpcClient on its own thread and event loop: a peer that keeps running while ours
    blocks."""

    def __init__(self, endpoint: str, opts: SocketOptions):
        super().__init__(daemon=True)
        self.endpoint, self.opts = endpoint, opts
        self.connected = threading.Event()
        self.client: RpcClient | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        ctx = new_context()
        self.loop, self.done = asyncio.get_running_loop(), asyncio.Event()
        self.client = RpcClient(ctx, self.endpoint, "peer-0", "peer", self.opts)
        try:
            await self.client.connect(timeout=5)
            self.connected.set()
            await self.done.wait()
        except BaseException as exc:  # reported to the test thread
            self.error = exc
            self.connected.set()
        finally:
            await self.client.close()
            ctx.destroy(linger=0)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.done.set)
        self.join(5)


async def test_compute_keeps_heartbeats_flowing_while_blocking_work_runs(cfg, zctx, wait_until):
    class Worker(Solo):
        async def setup(self) -> None:
            self.srv = self.server(cfg.endpoint("trainer"))
            self.srv.on(Ping, lambda peer, m: Pong(payload=m.payload))
            await self.srv.start()

    # 0.1 s beats, dead after 0.4 s (the cfg fixture): far below the 1.5 s of work, yet tolerant
    # of a loaded machine where three threads (loop, worker, peer) share two cores with other jobs
    node = make(Worker, cfg, zctx)
    task = asyncio.create_task(node.run())
    await node.wait_ready(5)
    peer = PeerThread(cfg.endpoint("trainer"), node.opts)
    peer.start()
    assert await asyncio.to_thread(peer.connected.wait, 5) and peer.error is None
    await wait_until(lambda: peer.client.stats.received >= 3, 2, "first heartbeats")
    before = peer.client.stats.received
    assert await node.compute(busy, 1.5) > 0  # 1.5 s holding the GIL, on the node's worker thread
    beats = peer.client.stats.received - before
    assert beats >= 5, f"only {beats} heartbeats reached the peer in 1.5 s (expect ~15)"
    assert peer.client.stats.peers_dead == 0 and node.srv.stats.peers_dead == 0
    # control: the same work on the event loop itself starves the beats, and the peer notices
    busy(1.2)
    await wait_until(
        lambda: peer.client.stats.peers_dead >= 1, 3, "the peer declaring the blocked node dead"
    )
    with pytest.raises(ZeroDivisionError):  # errors from compute reach the caller
        await node.compute(lambda: 1 / 0)
    peer.stop()
    node.request_stop("test")
    await asyncio.wait_for(task, 5)
