"""Embedded API: every role of a config in this process, over inproc.

    from laminar.cluster import LocalCluster

    async with LocalCluster(cfg) as cluster:
        buffer = cluster.node("buffer-0")
        await cluster.wait_trainer(timeout=600)      # until the trainer finishes its steps

Tests, notebooks and emulated-scale benchmarks use it. `roles` names the nodes this process
starts (default: every role of the config); the config's `cluster.roles` stays the run's
membership, so a cluster whose rollouts run in another process (bench/cluster_run.py) still
sizes its shares and admits its rollout ids by the real count. Nodes start in dependency
order (manager, buffer, relays, trainer, rollouts), each must become ready within
transport.startup_timeout_s, and leaving the block stops them in reverse order.
A node that fails makes `check()` (and the exit of the block) raise. Each node
supervises its own background tasks; the cluster only holds one `run()` task per node.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from laminar.config import ROLES, LaminarConfig, Role
from laminar.node import Node
from laminar.transport.sockets import new_context
from laminar.wiring.nodes import build_node


class LocalCluster:
    def __init__(
        self, cfg: LaminarConfig, transport: str = "inproc", roles: dict[str, int] | None = None
    ):
        data = cfg.model_dump()
        data["cluster"]["transport"] = transport
        self.cfg = LaminarConfig.model_validate(data)
        self.start_roles = dict(cfg.cluster.roles if roles is None else roles)
        """How many nodes of each role this process starts."""
        self.ctx = new_context()
        self.nodes: dict[str, Node] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def node(self, node_id: str) -> Node:
        return self.nodes[node_id]

    def role(self, role: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.role == role]

    async def add(self, role: Role, index: int, timeout: float | None = None, **kw: Any) -> Node:
        """Start one more node (e.g. restart a killed rollout) and wait until it is ready."""
        node = build_node(self.cfg, role, index, ctx=self.ctx, **kw)
        self.nodes[node.node_id] = node
        task = asyncio.create_task(node.run(), name=node.node_id)
        self._tasks[node.node_id] = task
        ready = asyncio.create_task(node.ready.wait())
        done, _ = await asyncio.wait(
            {ready, task},
            timeout=timeout or self.cfg.transport.startup_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if ready not in done:
            ready.cancel()
            if task.done():
                task.result()  # raises the node's failure
            raise TimeoutError(
                f"{node.node_id} not ready within "
                f"{timeout or self.cfg.transport.startup_timeout_s}s"
            )
        return node

    async def stop_node(self, node_id: str, timeout: float = 10.0) -> None:
        node = self.nodes[node_id]
        # already stopped or killed (awaiting a killed one re-raises its cancel)
        if self._tasks[node_id].done():
            return
        node.request_stop("cluster stop")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._tasks[node_id], timeout)

    async def kill_node(self, node_id: str) -> None:
        """Abrupt death for tests: cancel the node without draining and without a Bye,
        so its peers see a death (missed heartbeats), not a departure."""
        self.nodes[node_id].say_bye = False
        task = self._tasks[node_id]
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

    def check(self) -> None:
        for node_id, task in self._tasks.items():
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"node {node_id} failed") from task.exception()

    async def wait_trainer(self, timeout: float) -> None:
        tasks = [self._tasks[n.node_id] for n in self.role("trainer")]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout)

    async def __aenter__(self) -> LocalCluster:
        try:
            for role in ROLES:
                for i in range(self.start_roles.get(role, 0)):
                    await self.add(role, i)
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        for node_id in reversed(list(self.nodes)):
            await self.stop_node(node_id)
        self.ctx.destroy(linger=0)

    async def __aexit__(self, *exc: Any) -> None:
        failed = None
        try:
            self.check()
        except RuntimeError as e:
            failed = e
        await self.close()
        if failed is not None and exc[0] is None:
            raise failed
