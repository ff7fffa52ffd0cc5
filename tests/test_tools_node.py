"""The tools node over ipc: a manager and a ToolsNode in this process, RemoteToolClient as a
rollout.

    .venv/bin/python -m pytest tests/test_tools_node.py -q

Covers: calls through the transport, error observations (a hostile call, bad arguments, an
unknown tool), exactly-once by call id across retries, concurrent repeats and a node restart
on the same run_dir, bad requests (ErrorReply, counted, the node keeps serving), stats in
ToolStatsReply and the heartbeat status, and a client whose node is gone (an observation, not
an exception).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from laminar.config import LaminarConfig, config_from_dict
from laminar.node import Node
from laminar.protocol.tools import ToolCallRequest, ToolStatsReply, ToolStatsRequest
from laminar.rollout.tool_client import RemoteToolClient
from laminar.transport.client import RpcClient
from laminar.transport.sockets import RemoteError, new_context
from laminar.wiring.common import socket_options
from laminar.wiring.nodes import build_node

APPEND = "test_tools_sandbox:append_line"


def make_cfg(tmp: Path) -> LaminarConfig:
    return config_from_dict(
        {
            "name": f"tn{os.getpid()}",
            "run_dir": str(tmp / "run"),
            "cluster": {
                "transport": "ipc",
                "ipc_dir": tempfile.mkdtemp(prefix="lamt-", dir="/tmp"),
            },
            "transport": {
                "heartbeat_interval_s": 0.05,
                "heartbeat_liveness": 20,
                "handshake_timeout_s": 1.0,
                "request_timeout_s": 5.0,
                "request_retries": 0,
                "stop_timeout_s": 2.0,
            },
            "tools": {
                "tools": ["python", "calculator", APPEND],
                "workers": 2,
                "wall_s": 1.0,
                "memory_mb": 64,
                "max_output_bytes": 1024,
                "call_timeout_s": 10.0,
            },
        }
    )


async def start(node: Node) -> asyncio.Task[None]:
    task = asyncio.create_task(node.run())
    ready = asyncio.create_task(node.ready.wait())
    done, _ = await asyncio.wait({task, ready}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    assert ready in done, task.result() if task.done() else "node not ready in 60 s"
    return task


async def stop(node: Node, task: asyncio.Task[None]) -> None:
    node.request_stop("test over")
    await asyncio.wait_for(task, 20)


@pytest.fixture
def cfg(tmp_path):
    cfg = make_cfg(tmp_path)
    yield cfg
    shutil.rmtree(cfg.ipc_dir(), ignore_errors=True)


async def test_tools_node_serves_calls_once_per_id(cfg, tmp_path):
    ctx = new_context()
    manager = build_node(cfg, "manager", ctx=ctx)
    m_task = await start(manager)
    tools = build_node(cfg, "tools", ctx=ctx)
    t_task = await start(tools)
    cli = RpcClient(ctx, cfg.endpoint("tools"), "rollout-0", "rollout", socket_options(cfg))
    try:
        await cli.connect(timeout=5)
        client = RemoteToolClient(cli, cfg.tools.call_timeout_s)
        res = await client.call("u#t0#c0", "python", {"code": "print('hi')\n2 ** 70"})
        assert res.ok and res.output == f"hi\n{2**70}" and not res.cached and res.seconds > 0
        again = await client.call("u#t0#c0", "python", {"code": "print('hi')\n2 ** 70"})
        assert again.cached and again.output == res.output
        calc = await client.call(
            "u#t0#c1", "calculator", {"expression": "99999999999 * 99999999999"}
        )
        assert calc.ok and calc.output == str(99999999999**2)

        # hostile and wrong calls are observations; the node keeps serving
        hang = await client.call("u#t1#c0", "python", {"code": "while True: pass"})
        assert hang.error_kind == "timeout" and not hang.ok
        assert (await client.call("u#t1#c1", "python", {"cmd": "1"})).error_kind == "bad_call"
        assert (await client.call("u#t1#c2", "shell", {})).error_kind == "unknown_tool"

        # a side-effecting call: two concurrent repeats and a retry run it once
        target = tmp_path / "effects.txt"
        args = {"path": str(target), "text": "x"}
        a, b = await asyncio.gather(
            client.call("u#t2#c0", "append_line", args), client.call("u#t2#c0", "append_line", args)
        )
        c = await client.call("u#t2#c0", "append_line", args)
        assert a.output == b.output == c.output == "1" and c.cached
        assert target.read_text() == "x\n"

        # a bad request: ErrorReply (RemoteError raw, bad_call through the client), counted
        with pytest.raises(RemoteError, match="call_id"):
            await cli.request(ToolCallRequest(call_id="", name="python", arguments={"code": "1"}))
        bad = await client.call("u#t3#c0", "python", {"code": "1"}, timeout_s=float("nan"))
        assert bad.error_kind == "bad_call"

        # its figures are for people: asked as `cli` (a rollout may only call tools)
        with pytest.raises(RemoteError, match="unauthorized"):
            await cli.request(ToolStatsRequest())
        probe = RpcClient(ctx, cfg.endpoint("tools"), "cli-0", "cli", socket_options(cfg))
        await probe.connect(timeout=5)
        try:
            stats = await probe.request(ToolStatsRequest())
        finally:
            await probe.close()
        assert isinstance(stats, ToolStatsReply)
        st = stats.stats
        assert st["bad_requests"] == 2 and st["cache_hits"] >= 2 and st["cache_joined"] == 1
        assert st["errors_by_kind"]["timeout"] == 1 and st["errors_by_kind"]["bad_call"] == 1
        assert st["latency_p99_s"] >= 1.0 and st["network"] in ("netns", "userns+netns", "none")
        assert tools.status().extra["calls"] == st["calls"]
    finally:
        await cli.close()
        await stop(tools, t_task)

    # restarted on the same run_dir: the journal answers; nothing runs twice
    tools2 = build_node(cfg, "tools", ctx=ctx)
    t2_task = await start(tools2)
    cli2 = RpcClient(ctx, cfg.endpoint("tools"), "rollout-1", "rollout", socket_options(cfg))
    try:
        await cli2.connect(timeout=5)
        client2 = RemoteToolClient(cli2, cfg.tools.call_timeout_s)
        replay = await client2.call("u#t2#c0", "append_line", args)
        assert replay.cached and replay.output == "1" and target.read_text() == "x\n"
        assert (await client2.call("u#t0#c0", "python", {"code": "0"})).output == res.output
    finally:
        await cli2.close()
        await stop(tools2, t2_task)

    # the node is gone: a call is an observation, never an exception
    cli3 = RpcClient(ctx, cfg.endpoint("tools"), "rollout-2", "rollout", socket_options(cfg))
    try:
        lost = await RemoteToolClient(cli3, 0.3, retries=0).call("u#t4#c0", "python", {"code": "1"})
        assert not lost.ok and lost.error_kind in ("timeout", "unreachable")
    finally:
        await cli3.close()
        await stop(manager, m_task)
        ctx.destroy(linger=0)
