"""Real relay processes on this host, for tests and bench/weights.py.

    with RelayProcs(tmp_dir, n_relays=4, overrides={"relay.chunk_bytes": 1 << 20}) as procs:
        await procs.wait_ready(timeout=30)          # every relay answers ChainInfo
        pusher = procs.pusher("trainer-0")           # WeightPusher to the master (this process)
        puller = procs.puller("rollout-0", relay_index=1)   # WeightPuller of relay 1
        procs.kill(1)                               # SIGKILL by pid (only processes started here)

Each relay is `python -m laminar node --role relay --index i --config <tmp>/config.yaml`,
plus one manager (`--role manager`), because every node registers with the manager.
ipc endpoints live in a private directory; segments use a private shm prefix and are
removed at exit, also those a SIGKILLed relay left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from laminar.config import apply_overrides, config_from_dict
from laminar.logs import get_logger
from laminar.message import Message
from laminar.protocol.relay import ChainInfo, ChainInfoRequest, ChainUpdate
from laminar.supervise import detached_spawn
from laminar.transport.client import RpcClient
from laminar.transport.sockets import Context, TransportError, Wiring, new_context
from laminar.weights.puller import WeightPuller
from laminar.weights.pusher import WeightPusher
from laminar.weights.segment import default_shm_dir
from laminar.wiring.common import relay_links, socket_options


class RelayProcs:
    live: set[RelayProcs] = (
        set()
    )  # started and not yet stopped (a bench's SIGTERM handler stops them)

    def __init__(
        self,
        tmp_dir: str | Path,
        n_relays: int,
        overrides: dict[str, Any] | None = None,
        log_dir: str | Path | None = None,
        corrupt_chunks: list[int] | None = None,
    ):
        self.corrupt_chunks = corrupt_chunks or []
        """Chunk indices every relay corrupts once per version (tests/relay_faults.py)."""
        self.dir = Path(tmp_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.n = n_relays
        tag = uuid.uuid4().hex[:8]
        data: dict[str, Any] = {
            "name": f"rt{tag}",
            "run_dir": str(self.dir / "run"),  # the manager's timeline etc. stay in the temp dir
            "cluster": {
                "transport": "ipc",
                "ipc_dir": str(self.dir / "ipc"),
                "roles": {"manager": 1, "relay": n_relays},
            },
            "transport": {
                "heartbeat_interval_s": 0.2,
                "heartbeat_liveness": 5,
                "handshake_timeout_s": 1.0,
                "request_timeout_s": 5.0,
            },
            "relay": {"shm_prefix": f"lamt{tag}", "probe_timeout_s": 0.5, "upstream_grace_s": 20.0},
            "logging": {"level": "info", "json_logs": True},
        }
        apply_overrides(
            data,
            [
                f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}"
                for k, v in (overrides or {}).items()
            ],
        )
        self.cfg = config_from_dict(data)
        self.config_path = self.dir / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(self.cfg.model_dump(mode="json")))
        self.log_dir = Path(log_dir) if log_dir else self.dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.opts = socket_options(self.cfg)
        self._ctx: Context | None = None

    # ---- processes -------------------------------------------------------------------------
    def _spawn(self, role: str, index: int) -> None:
        name = f"{role}-{index}"
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        entry = ["-m", "laminar"]
        if role == "relay" and self.corrupt_chunks:
            faults = str(Path(__file__).with_name("relay_faults.py"))
            entry = [faults, ",".join(map(str, self.corrupt_chunks))]
        cmd = [
            sys.executable,
            *entry,
            "node",
            "--role",
            role,
            "--index",
            str(index),
            "--config",
            str(self.config_path),
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()

    def start(self) -> RelayProcs:
        RelayProcs.live.add(self)
        self._spawn("manager", 0)
        for i in range(self.n):
            self._spawn("relay", i)
        return self

    def restart(self, index: int) -> None:
        self._spawn("relay", index)

    def pid(self, index: int) -> int:
        return self.procs[f"relay-{index}"].pid

    def kill(self, index: int) -> None:
        """SIGKILL one relay (a crash: no drain, segments left behind)."""
        p = self.procs[f"relay-{index}"]
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        self.remove_segments()
        RelayProcs.live.discard(self)

    def remove_segments(self) -> int:
        seg_dir, prefix, n = (
            self.cfg.relay.shm_dir or default_shm_dir(),
            self.cfg.relay.shm_prefix + "-",
            0,
        )
        for name in os.listdir(seg_dir):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(seg_dir, name))
                    n += 1
        return n

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        return (
            "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            if path.exists()
            else ""
        )

    def __enter__(self) -> RelayProcs:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- clients ---------------------------------------------------------------------------
    @property
    def ctx(self) -> Context:
        if self._ctx is None:
            self._ctx = new_context()
        return self._ctx

    def pusher(self, node_id: str = "trainer-0") -> WeightPusher:
        """A trainer end in this process (its background tasks are detached: logged if they die)."""
        return WeightPusher(relay_links(self.cfg), self._wiring(node_id, "trainer"))

    def puller(self, node_id: str = "rollout-0", relay_index: int = 0) -> WeightPuller:
        """A rollout end in this process, reading relay `relay_index`."""
        return WeightPuller(
            relay_links(self.cfg), self._wiring(node_id, "rollout"), relay_index=relay_index
        )

    def _wiring(self, node_id: str, role: str) -> Wiring:
        log = get_logger(role=role, node_id=node_id)
        return Wiring(self.ctx, self.opts, node_id, role, log, detached_spawn)

    async def _rpc(self, index: int, msg: Message, timeout: float, role: str = "cli") -> Message:
        """One request to relay `index` from a fresh client of `role` (one that may send it)."""
        node_id = f"{role}-probe-{uuid.uuid4().hex[:6]}"
        cli = RpcClient(self.ctx, self.cfg.endpoint("relay", index), node_id, role, self.opts)
        try:
            await cli.connect(timeout=timeout)
            return await cli.request(msg, timeout=timeout, retries=0)
        finally:
            await cli.close(say_bye=True)

    async def info(self, index: int, timeout: float = 1.0) -> ChainInfo | None:
        try:
            reply = await self._rpc(index, ChainInfoRequest(), timeout)
        except TransportError:
            return None
        return reply if isinstance(reply, ChainInfo) else None

    async def infos(self, indices: list[int] | None = None) -> dict[int, ChainInfo | None]:
        idx = list(range(self.n)) if indices is None else indices
        return dict(zip(idx, await asyncio.gather(*(self.info(i) for i in idx)), strict=True))

    async def wait_ready(self, timeout: float = 60.0, indices: list[int] | None = None) -> None:
        deadline = time.monotonic() + timeout
        idx = list(range(self.n)) if indices is None else indices
        while True:
            infos = await self.infos(idx)
            if all(v is not None for v in infos.values()):
                return
            for name, p in self.procs.items():
                if (
                    p.poll() is not None
                    and name.startswith("relay")
                    and int(name.split("-")[1]) in idx
                ):
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"relays not ready in {timeout}s: {[i for i, v in infos.items() if v is None]}"
                )
            await asyncio.sleep(0.05)  # poll interval of a deadline-bounded wait

    async def wait_chain(
        self, indices: list[int] | None = None, timeout: float = 30.0
    ) -> list[int]:
        """Until the listed relays agree on one chain that holds them all; returns its order
        (master first)."""
        idx = sorted(range(self.n) if indices is None else indices)
        deadline = time.monotonic() + timeout
        while True:
            infos = await self.infos(idx)
            views = {(tuple(v.order), v.master) for v in infos.values() if v is not None}
            if len(views) == 1 and None not in infos.values():
                order, master = views.pop()
                if sorted(order) == idx and master == order[0]:
                    return list(order)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"relays {idx} do not agree on a chain after {timeout}s: {infos}"
                )
            await asyncio.sleep(0.05)  # poll interval of a deadline-bounded wait

    async def wait_version(
        self, version: int, indices: list[int], timeout: float
    ) -> dict[int, ChainInfo]:
        """Until every listed relay has `version` complete; returns their ChainInfo."""
        deadline = time.monotonic() + timeout
        while True:
            infos = await self.infos(indices)
            if all(v is not None and v.version >= version for v in infos.values()):
                return infos  # type: ignore[return-value]
            if time.monotonic() > deadline:
                raise TimeoutError(f"version {version} not everywhere after {timeout}s: {infos}")
            await asyncio.sleep(0.02)  # poll interval of a deadline-bounded wait

    async def set_chain(
        self, order: list[int], epoch: int, indices: list[int] | None = None
    ) -> None:
        """Send ChainUpdate to relays (as the manager would)."""
        for i in range(self.n) if indices is None else indices:
            await self._rpc(i, ChainUpdate(epoch=epoch, order=order), 2.0, role="manager")

    async def close_clients(self) -> None:
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
