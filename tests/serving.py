"""Fake rollouts that the manager lists as serving, so a buffer serves them prompts.

    mgr_cli = await serving_rollout(ctx, cfg, "r0")     # beats a status with an engine up
    await until_members(buffer_node, ["r0"])             # the buffer heard it from the manager

A buffer serves prompts only to the rollouts the manager's heartbeats list as serving
(laminar/buffer/members.py): a test client that speaks to the buffer like a rollout also
beats to the manager, as a rollout does, with a status that shows its engine's max_running.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from laminar.config import LaminarConfig
from laminar.protocol.core import NodeStatus
from laminar.protocol.rollout import RolloutStatus
from laminar.transport.client import RpcClient
from laminar.transport.sockets import SocketOptions
from laminar.wiring.common import socket_options


def rollout_status(node_id: str, max_running: int, **kw: Any) -> NodeStatus:
    """A rollout's heartbeat status with its engine up, running `max_running` at once."""
    status = RolloutStatus(
        traj_tokens={},
        kv_capacity_tokens=0,
        measured_at=time.time(),
        target_version=0,
        max_running=max_running,
    )
    return NodeStatus(node_id=node_id, role="rollout", rollout=status, **kw)


async def serving_rollout(
    ctx: Any,
    cfg: LaminarConfig,
    node_id: str,
    opts: SocketOptions | None = None,
    max_running: int | None = None,
    timeout: float = 10.0,
) -> RpcClient:
    """A client of the manager under `node_id` that beats a serving rollout's status."""
    running = cfg.rollout.max_running if max_running is None else max_running
    cli = RpcClient(
        ctx,
        cfg.endpoint("manager"),
        node_id,
        "rollout",
        opts or socket_options(cfg, "rollout"),
        status=lambda: rollout_status(node_id, running),
    )
    await cli.connect(timeout=timeout)
    await cli.beat()
    return cli


async def until_members(buffer: Any, ids: Iterable[str], timeout: float = 10.0) -> None:
    """Wait until the buffer node's Members lists every id (the manager's next heartbeats)."""
    want = list(ids)
    deadline = time.monotonic() + timeout
    while not all(buffer.prompts.members.cap(i) is not None for i in want):
        assert time.monotonic() < deadline, f"{want} not serving members of {buffer.node_id}"
        await asyncio.sleep(0.02)
