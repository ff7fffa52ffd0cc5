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

Subclasses set `role`, and override `setup`, `main`, `drain`, `teardown`, `status`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import heapq
import importlib
import signal
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from laminar.config import ROLES, ConfigError, LaminarConfig, Role
from laminar.logs import get_logger
from laminar.message import Limits
from laminar.metrics import Metrics
from laminar.protocol.core import MAX_PEER_ROWS, NodeStatus, PeerRefusals, RefusalSummary
from laminar.supervise import Supervisor
from laminar.transport.client import RpcClient
from laminar.transport.security import Security
from laminar.transport.server import RpcServer
from laminar.transport.session import StatusCodec
from laminar.transport.sockets import Context, IdBound, SocketOptions, Wiring, new_context
from laminar.weights.channel import ChannelSettings, WeightsMode
from laminar.weights.group import GroupSettings
from laminar.weights.relay_client import RelayLinks

T = TypeVar("T")

NODE_STATUS = StatusCodec(NodeStatus)
"""What every node's heartbeats carry, and how a server reads its clients' (Peer.status)."""


class NodeFailed(RuntimeError):
    """A supervised task of the node died; the node stopped."""


class Node:
    role: ClassVar[str] = "node"
    registers_with_manager: bool = True

    def __init__(
        self,
        cfg: LaminarConfig,
        index: int = 0,
        ctx: Context | None = None,
        node_id: str | None = None,
    ):
        self.cfg = cfg
        self.index = index
        self.node_id = node_id or f"{self.role}-{index}"
        self._own_ctx = ctx is None
        self.ctx = ctx if ctx is not None else new_context()
        self.opts = socket_options(cfg, self.role)
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
        self, endpoint: str, max_message_bytes: int | None = None, **kw: Any
    ) -> RpcServer[NodeStatus]:
        """An RpcServer whose tasks run under this node's supervisor; closed at shutdown.
        `max_message_bytes`: its inbound limit (zmq MAXMSGSIZE; see socket_max_message_bytes)."""
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
            status=self.beat_status,
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
            self.cfg.endpoint("manager"),
            status=self.beat_status,
            started=self.started_at,
        )
        await self.manager.connect(timeout=self.cfg.transport.startup_timeout_s)

    async def run(self) -> None:
        """Run the whole lifecycle; raises NodeFailed if a supervised task died."""
        self.log.info("starting")
        if (plaintext := plaintext_tcp_warning(self.cfg)) is not None:
            self.log.warning("tcp_without_curve", warning=plaintext)
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
                    await asyncio.wait_for(self.drain(), self.cfg.transport.stop_timeout_s)
                except TimeoutError:
                    self.log.warning("drain_timeout", timeout_s=self.cfg.transport.stop_timeout_s)
        finally:
            await self._shutdown()
        if self.failure is not None:
            raise NodeFailed(f"{self.node_id}: {self.stop_reason}") from self.failure

    async def _shutdown(self) -> None:
        self.stopping.set()
        await self.supervisor.cancel_all(timeout=2.0)
        try:
            await asyncio.wait_for(self.teardown(), self.cfg.transport.stop_timeout_s)
        except Exception as exc:  # teardown must not mask the original failure
            self.log.error("teardown_failed", error=f"{type(exc).__name__}: {exc}")
        for fn in reversed(self._closers):
            with contextlib.suppress(Exception):
                res = fn()
                if asyncio.iscoroutine(res):
                    await asyncio.wait_for(res, 5.0)
        for cli in self._clients:
            await cli.close(say_bye=self.say_bye)
        for srv in self._servers:
            await srv.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._own_ctx:
            self.ctx.destroy(linger=0)
        self.stopped.set()
        self.log.info("stopped", reason=self.stop_reason or "done")


def socket_options(cfg: LaminarConfig, role: str = "node") -> SocketOptions:
    """The transport settings of a node of `role`: heartbeats, deadlines, limits and its
    CURVE keys (none when `security.keys_dir` is unset)."""
    t = cfg.transport
    keys = cfg.security.keys_dir
    return SocketOptions(
        heartbeat_interval_s=t.heartbeat_interval_s,
        heartbeat_liveness=t.heartbeat_liveness,
        handshake_timeout_s=t.handshake_timeout_s,
        request_timeout_s=t.request_timeout_s,
        request_retries=t.request_retries,
        reconnect_backoff_s=t.reconnect_backoff_s,
        reconnect_backoff_max_s=t.reconnect_backoff_max_s,
        sndhwm=t.sndhwm,
        rcvhwm=t.rcvhwm,
        limits=Limits(max_header_bytes=t.max_header_bytes, max_message_bytes=t.max_message_bytes),
        security=Security.for_role(keys, role, cfg.security.key_name) if keys else None,
        id_bound=IdBound(
            "rollout", cfg.cluster.live_rollouts_bound(), frozenset(cfg.cluster.rollout_ids())
        ),
    )


# Sizing the per-socket limits (issue 15): a socket accepts what it carries, not 2 GiB.
_BYTES_PER_TOKEN = 64
"""Generous bytes per trajectory token on the wire: id + logprob + mask arrays (9 B) plus the
token's share of text, info and msgpack overhead."""


def trajectory_bytes(cfg: LaminarConfig) -> int:
    """Upper bound of one trajectory on the wire: prompt plus the longest episode (multi-turn
    env limits: model and environment tokens together) at `_BYTES_PER_TOKEN`."""
    episode = cfg.rollout.sampling.max_tokens
    if cfg.env.fn is not None:
        limits = cfg.env.limits
        episode = max(episode, limits.max_total_tokens or 0, limits.max_turns * episode)
    return (cfg.data.max_prompt_tokens + episode) * _BYTES_PER_TOKEN


def socket_max_message_bytes(cfg: LaminarConfig, service: str) -> int:
    """MAXMSGSIZE of a server socket by what it carries:

    - manager: heartbeats, status, moves; ExportReply hands over up to max_running partial
      trajectories, so max(control limit, max_running x trajectory);
    - buffer: a whole group of trajectories (derived; `transport.buffer_max_message_bytes`
      overrides, `buffer_min_message_bytes` is the floor);
    - relay / relay_data: one weight chunk plus its header;
    - anything else (tools, control): `transport.control_max_message_bytes`.
    Never above `transport.max_message_bytes`."""
    t = cfg.transport
    if service == "manager":
        n = max(t.control_max_message_bytes, cfg.rollout.max_running * trajectory_bytes(cfg))
    elif service == "buffer":
        derived = max(t.buffer_min_message_bytes, cfg.rollout.group_size * trajectory_bytes(cfg))
        n = t.buffer_max_message_bytes or derived
    elif service in ("relay", "relay_data"):
        n = cfg.relay.chunk_bytes + t.max_header_bytes + (64 << 10)
    else:
        n = t.control_max_message_bytes
    return min(n, t.max_message_bytes)


def relay_links(cfg: LaminarConfig) -> RelayLinks:
    """Where the relays listen and how long their clients wait (every relay index the
    cluster runs, and at least this rollout's `rollout.relay_index`)."""
    n = max(1, cfg.cluster.roles.get("relay", 1), cfg.rollout.relay_index + 1)
    return RelayLinks(
        control=tuple(cfg.endpoint("relay", i) for i in range(n)),
        pub=tuple(cfg.endpoint("relay_pub", i) for i in range(n)),
        startup_timeout_s=cfg.transport.startup_timeout_s,
        request_timeout_s=cfg.transport.request_timeout_s,
        probe_timeout_s=cfg.relay.probe_timeout_s,
        chunk_bytes=cfg.relay.chunk_bytes,
        window=cfg.relay.window,
    )


def weights_group(cfg: LaminarConfig) -> GroupSettings:
    """The weights store and broadcast group of a run (rollout.weights nccl / cuda_ipc): the
    rollouts rollout-0 .. rollout-{cluster.roles.rollout - 1} may join."""
    g = cfg.rollout.weights_group
    host, port = cfg.weights_store()
    backend = g.backend
    if backend == "auto":
        backend = "nccl" if cfg.model.device.startswith("cuda") else "gloo"
    rollouts = cfg.cluster.roles.get("rollout", 1)
    return GroupSettings(
        host=host,
        port=port,
        backend=backend,
        members=tuple(f"rollout-{i}" for i in range(max(1, rollouts))),
        bound_s=g.bound_s,
        beat_s=g.beat_s,
        connect_timeout_s=cfg.transport.startup_timeout_s,
    )


def weights_mode(cfg: LaminarConfig) -> WeightsMode:
    """How weights move in this run; both ends derive it from the same config, so they agree:
    `rollout.weights` when set; `auto` is relay when the config runs relays, else announce
    when either end is a sim engine (one end has no tensors), else dir."""
    if cfg.rollout.weights != "auto":
        return cfg.rollout.weights
    if cfg.cluster.roles.get("relay", 0) > 0:
        return "relay"
    if cfg.trainer.engine == "sim" or cfg.rollout.engine == "sim":
        return "announce"
    return "dir"


def weights_channel(cfg: LaminarConfig) -> ChannelSettings:
    """The weights channel of this run, as both ends open it."""
    mode = weights_mode(cfg)
    gpu = mode in ("nccl", "cuda_ipc")
    relays = mode == "relay" or (gpu and cfg.cluster.roles.get("relay", 0) > 0)
    return ChannelSettings(
        mode=mode,
        dir=Path(cfg.resolved_run_dir()) / "weights",
        relay=relay_links(cfg) if relays else None,
        relay_index=cfg.rollout.relay_index,
        group=weights_group(cfg) if gpu else None,
        device=cfg.model.device,
        lease_ttl_s=cfg.rollout.weights_group.lease_ttl_s,
    )


def plaintext_tcp_warning(cfg: LaminarConfig) -> str | None:
    """The loud startup warning when tcp endpoints run without CURVE, else None."""
    if cfg.security.keys_dir:
        return None
    tcp = [e for e in _endpoints(cfg) if e.startswith("tcp://")]
    if not tcp:
        return None
    return (
        f"tcp endpoints {tcp[:3]} run WITHOUT CURVE: anyone who reaches them can read the "
        "traffic and claim any role or node id (a fake trainer can take batches). Make keys with "
        "`laminar keys DIR --roles ...` and set security.keys_dir"
    )


def _endpoints(cfg: LaminarConfig) -> list[str]:
    out = []
    for role in ("manager", "buffer", "relay", "tools"):
        try:
            out.append(cfg.endpoint(role))
        except ConfigError:
            continue
    return out


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


def node_class(role: Role) -> type[Node]:
    """The node class of a role: `laminar.<role>.node.<Role>Node`, imported on first use."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; use one of {list(ROLES)}")
    module = importlib.import_module(f"laminar.{role}.node")
    cls: type[Node] = getattr(module, f"{role.capitalize()}Node")
    return cls
