"""Node base class: lifecycle, supervision, manager registration, logging, metrics.

    start ─► setup() ─► register (manager) ─► ready ─► main() … ─► drain() ─► teardown() ─► stopped
                                               ▲ SIGTERM/SIGINT or stop() or a supervised task dying

Anatomy (vLLM-style): socket reader tasks decode and hand work to handlers; heavy
compute runs off the event loop (`await self.compute(fn, ...)` uses a dedicated
worker thread) so heartbeats keep flowing while a model trains or generates.

Every background task starts through `spawn()` (one Supervisor per node): the node's
own loops, its parts' `run()` loops, and the transport's reader/heartbeat tasks
(`server()` / `client()` hand `self.spawn` to the RpcServer / RpcClient they build;
parts that build transport objects get `node.spawn` as a `Spawn` dependency). One
that raises stops the node loudly: the error is logged, `run()` re-raises it as
NodeFailed, and the process exits non-zero. Nothing hangs silently.

A node never sees the config tree: the base reads its NodeSettings (node id, socket options,
the manager's endpoint, start and stop bounds) and each role's node its own settings object
(laminar/<role>/settings.py), both built by the wiring layer (laminar/wiring/; `build_node`
makes a node of a role from the config).

Subclasses set `role`, and override `setup`, `main`, `drain`, `teardown`, `status`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import heapq
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, TypeVar

from laminar.logs import get_logger
from laminar.metrics import Metrics
from laminar.node_settings import NodeSettings
from laminar.protocol.core import MAX_PEER_ROWS, NodeStatus, PeerRefusals, RefusalSummary
from laminar.supervise import Supervisor
from laminar.transport.client import RpcClient
from laminar.transport.server import RpcServer
from laminar.transport.session import StatusCodec
from laminar.transport.sockets import Context, Wiring, new_context

T = TypeVar("T")

NODE_STATUS = StatusCodec(NodeStatus)
"""What every node's heartbeats carry, and how a server reads its clients' (Peer.status)."""


class NodeFailed(RuntimeError):
    """A supervised task of the node died; the node stopped."""


class Node:
    role: ClassVar[str] = "node"
    registers_with_manager: bool = True

    def __init__(self, settings: NodeSettings, ctx: Context | None = None):
        self.node_settings = settings
        self.index = settings.index
        self.node_id = settings.node_id
        self._own_ctx = ctx is None
        self.ctx = ctx if ctx is not None else new_context()
        self.opts = settings.socket
        self.log = get_logger(role=self.role, node_id=self.node_id)
        self.metrics = Metrics()
        self.ready = asyncio.Event()
        self.stopping = asyncio.Event()
        self.stopped = asyncio.Event()
        self.failure: BaseException | None = None
        self.stop_reason = ""
        self.manager: RpcClient | None = None
        self.supervisor = Supervisor(self.node_id, on_exit=self._task_exited)
        self._servers: list[RpcServer[NodeStatus]] = []
        self._clients: list[RpcClient] = []
        self._closers: list[Callable[[], Any]] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._main_task: asyncio.Task[Any] | None = None
        self.say_bye = True
        """False = close client sockets without Bye, so peers see a death (tests that emulate a
        crash)."""
        self.started_at = time.time()

    # ---- hooks ----------------------------------------------------------------------
    async def setup(self) -> None:
        """Bind servers, connect clients. Runs before registration with the manager."""

    async def main(self) -> None:
        """The node's work. Default: serve until asked to stop."""
        await self.stopping.wait()

    async def drain(self) -> None:
        """Finish or hand over in-flight work (bounded by transport.stop_timeout_s)."""

    async def teardown(self) -> None:
        """Release resources that setup() took (sockets are closed by the base)."""

    def status(self) -> NodeStatus:
        """What goes to the manager with every heartbeat (the base adds `refusals`)."""
        return NodeStatus(node_id=self.node_id, role=self.role)

    def refused_trajectories(self) -> dict[str, int]:
        """Trajectories this node refused, per peer (the buffer's intake says; none elsewhere)."""
        return {}

    def refusal_summary(self) -> RefusalSummary | None:
        """What this node's servers refused, in total and for the most refused peers (None:
        nothing yet): `NodeStatus.refusals`, which `laminar status` shows."""
        summary = RefusalSummary()
        rows: dict[str, PeerRefusals] = {}
        for peer, n in self.refused_trajectories().items():
            summary.refused_trajectories += n
            rows[peer] = PeerRefusals(peer=peer, refused_trajectories=n)
        for srv in self._servers:
            summary.unauthorized += srv.refused.unauthorized
            summary.bad += srv.refused.bad
            summary.refused_hellos += srv.refused.refused_hello
            summary.refused_ids += srv.refused.refused_ids
            for peer, counts in srv.refusals.items():
                row = rows.setdefault(peer, PeerRefusals(peer=peer))
                row.unauthorized += counts.unauthorized
                row.bad += counts.bad
                row.refused_hellos += counts.refused_hello
                row.refused_ids += counts.refused_ids
        if not summary.total():
            return None
        summary.peers = heapq.nlargest(MAX_PEER_ROWS, rows.values(), key=PeerRefusals.total)
        return summary

    def beat_status(self) -> NodeStatus:
        """`status()` plus what every node reports alike: what its heartbeats carry."""
        status = self.status()
        status.refusals = self.refusal_summary()
        return status

    # ---- helpers for subclasses ---------------------------------------------------
    def server(
        self,
        endpoint: str,
        max_message_bytes: int | None = None,
        beat_status: bool = True,
        **kw: Any,
    ) -> RpcServer[NodeStatus]:
        """An RpcServer whose tasks run under this node's supervisor; closed at shutdown.
        `max_message_bytes`: its inbound limit (zmq MAXMSGSIZE; laminar/wiring/common.py
        `socket_max_message_bytes` sizes it). `beat_status`: its heartbeats carry this node's
        status (False, for a server whose clients never read it: they carry none, and a client
        that got other traffic within the interval gets no beat)."""
        opts = (
            self.opts
            if max_message_bytes is None
            else self.opts.with_max_message_bytes(max_message_bytes)
        )
        srv = RpcServer(
            self.ctx,
            endpoint,
            self.node_id,
            self.role,
            opts,
            status=self.beat_status if beat_status else None,
            spawn=self.spawn,
            peer_status=NODE_STATUS,
            **kw,
        )
        self._servers.append(srv)
        return srv

    def wiring(self) -> Wiring:
        """What a transport object needs to open sockets on this node's behalf."""
        return Wiring(self.ctx, self.opts, self.node_id, self.role, self.log, self.spawn)

    def client(self, endpoint: str, **kw: Any) -> RpcClient:
        """An RpcClient whose tasks run under this node's supervisor; closed at shutdown."""
        cli = RpcClient(
            self.ctx, endpoint, self.node_id, self.role, self.opts, spawn=self.spawn, **kw
        )
        self._clients.append(cli)
        return cli

    def on_close(self, fn: Callable[[], Any]) -> None:
        """Register a cleanup (sync or async) run at teardown, last registered first."""
        self._closers.append(fn)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Start a supervised background task: if it raises, the node stops loudly."""
        return self.supervisor.spawn(coro, name)

    def _task_exited(self, task: asyncio.Task[Any], exc: BaseException | None) -> None:
        if exc is not None and self.failure is None:
            self.failure = exc
            # first: a failing log call must not block the stop
            self.request_stop(f"task {task.get_name()} died")
            try:
                self.log.error(
                    "task_died",
                    task=task.get_name(),
                    error=f"{type(exc).__name__}: {exc}",
                    exc_info=exc,
                )
            except Exception:  # noqa: BLE001 - logging is best effort here
                pass
        elif exc is None and task is self._main_task:
            # main() returning is the node's work being done (e.g. the trainer's last step)
            self.request_stop("main finished")

    async def compute(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run blocking compute off the event loop on this node's worker thread."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=self.node_id
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kw))

    def request_stop(self, reason: str = "requested") -> None:
        if not self.stopping.is_set():
            self.stop_reason = reason
            self.stopping.set()
            self.log.info("stopping", reason=reason)

    async def wait_ready(self, timeout: float) -> None:
        await asyncio.wait_for(self.ready.wait(), timeout)

    # ---- lifecycle ------------------------------------------------------------------
    async def _register(self) -> None:
        self.manager = self.client(
            self.node_settings.manager, status=self.beat_status, started=self.started_at
        )
        await self.manager.connect(timeout=self.node_settings.startup_timeout_s)

    async def run(self) -> None:
        """Run the whole lifecycle; raises NodeFailed if a supervised task died."""
        self.log.info("starting")
        if self.node_settings.plaintext_warning is not None:
            self.log.warning("tcp_without_curve", warning=self.node_settings.plaintext_warning)
        try:
            await self.setup()
            if self.registers_with_manager:
                await self._register()
            self.ready.set()
            self.log.info("ready", startup_s=round(time.time() - self.started_at, 3))
            main = self._main_task = self.spawn(self.main(), "main")
            await self.stopping.wait()
            if not main.done():
                try:
                    await asyncio.wait_for(self.drain(), self.node_settings.stop_timeout_s)
                except TimeoutError:
                    self.log.warning("drain_timeout", timeout_s=self.node_settings.stop_timeout_s)
        finally:
            await self._shutdown()
        if self.failure is not None:
            raise NodeFailed(f"{self.node_id}: {self.stop_reason}") from self.failure

    async def _shutdown(self) -> None:
        self.stopping.set()
        await self.supervisor.cancel_all(timeout=2.0)
        # the heartbeats stopped with the tasks above: the Byes go now, not after teardown and
        # the closers (an engine, a worker pool, an HTTP server can take longer to close than a
        # peer's dead_after_s), or the manager logs a normal stop as node_dead
        for cli in self._clients:
            await cli.close(say_bye=self.say_bye)
        try:
            await asyncio.wait_for(self.teardown(), self.node_settings.stop_timeout_s)
        except Exception as exc:  # teardown must not mask the original failure
            self.log.error("teardown_failed", error=f"{type(exc).__name__}: {exc}")
        for fn in reversed(self._closers):
            with contextlib.suppress(Exception):
                res = fn()
                if asyncio.iscoroutine(res):
                    await asyncio.wait_for(res, 5.0)
        for srv in self._servers:
            await srv.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._own_ctx:
            self.ctx.destroy(linger=0)
        self.stopped.set()
        self.log.info("stopped", reason=self.stop_reason or "done")


def install_signal_handlers(nodes: list[Node]) -> None:
    loop = asyncio.get_running_loop()

    def stop_all(sig: signal.Signals) -> None:
        for n in nodes:
            n.request_stop(f"signal {sig.name}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_all, sig)


async def run_nodes(nodes: list[Node]) -> None:
    """Run several nodes in this process (one per role, or many emulated rollouts); fail if any
    fails."""
    install_signal_handlers(nodes)
    tasks = [asyncio.create_task(n.run(), name=n.node_id) for n in nodes]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        # one finished (done or failed): stop the rest of this process's nodes too
        for n in nodes:
            n.request_stop("sibling stopped")
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for t in tasks:
            t.cancel()
    for t in tasks:
        exc = t.exception()
        if exc is not None:
            raise exc
