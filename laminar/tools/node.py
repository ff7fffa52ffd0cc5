"""Tools node: runs the tool calls of multi-turn episodes in a sandbox, each call id at most once.

    rollout (env step) ──ToolCallRequest(call_id, name, arguments, timeout_s)──► ToolsNode
        ToolCache.run(call_id):  seen? ─yes─► stored result (cached=True)
                                 running? ─► await the first run
                                 new ─► journal "start" (side effects) ─► SandboxPool.run ─►
                                        worker ─fork─► child (netns, rlimits) ─► journal "done"
    ◄──ToolCallReply(ok, output | error + error_kind, seconds, cached)──┘
    anyone ──ToolStatsRequest──► ToolStatsReply(pool + cache counters)
    heartbeat status extra: calls, errors by kind, latency p50/p99, queue depth, restarts

What blocks what: each request runs in its own handler task (RpcServer), so a slow tool never
blocks the socket; a handler waits for a free sandbox worker (at most tools.max_queue wait;
beyond that the answer is error_kind busy at once) and for its call's journal fsync, done off
the event loop. Setup reads the journal before the server binds, so a restarted tools node
(same run_dir) answers every call id it ever ran from the journal and never runs one twice.
The only background work is the pool restarting a worker that died or hung.

A bad request (empty call id, negative or non-finite timeout) gets an ErrorReply and is
counted; a bad tool call (unknown tool, wrong arguments) is an answer: an error observation.

Run: laminar node --role tools --config configs/tool_demo.yaml   (cluster.roles.tools: 1)
"""

from __future__ import annotations

import math
from typing import Any

from laminar.envs.base import ToolResult
from laminar.node import Node
from laminar.protocol.core import NodeStatus
from laminar.protocol.tools import ToolCallReply, ToolCallRequest, ToolStatsReply, ToolStatsRequest
from laminar.tools.cache import ToolCache
from laminar.tools.registry import Registry
from laminar.tools.sandbox import SandboxPool
from laminar.tools.settings import ToolsNodeSettings
from laminar.transport.session import ErrorReply
from laminar.transport.sockets import Context, Peer

MAX_CALL_ID = 512


def reply_of(res: ToolResult) -> ToolCallReply:
    return ToolCallReply(
        call_id=res.call_id,
        ok=res.ok,
        output=res.output,
        error=res.error,
        error_kind=res.error_kind,
        seconds=res.seconds,
        cached=res.cached,
        truncated=res.truncated,
    )


class ToolsNode(Node):
    role = "tools"

    def __init__(self, settings: ToolsNodeSettings, ctx: Context | None = None):
        super().__init__(settings.node, ctx)
        self.settings = settings

    async def setup(self) -> None:
        s = self.settings
        tc = s.tools
        self.bad_requests = 0
        self.registry = Registry.from_entries(tc.tools)
        self.cache = ToolCache(s.journal)
        loaded = await self.compute(self.cache.load)
        self.pool = SandboxPool(tc, self.registry, self.spawn)
        await self.pool.start()
        self.on_close(self.pool.close)
        self.on_close(self.cache.close)
        self.log.info(
            "tools_ready",
            tools=self.registry.names(),
            network=self.pool.network,
            journaled_results=loaded,
        )
        self.srv = self.server(s.bind, max_message_bytes=s.max_message_bytes)
        self.srv.on(ToolCallRequest, self._on_call)
        self.srv.on(ToolStatsRequest, self._on_stats)
        await self.srv.start()

    async def _on_call(self, peer: Peer, req: ToolCallRequest) -> ToolCallReply | ErrorReply:
        problem = ""
        if not req.call_id or len(req.call_id) > MAX_CALL_ID:
            problem = f"call_id must be 1..{MAX_CALL_ID} characters"
        elif not req.name:
            problem = "name is empty"
        elif not math.isfinite(req.timeout_s) or req.timeout_s < 0:
            problem = f"timeout_s must be >= 0, got {req.timeout_s}"
        if problem:
            self.bad_requests += 1
            self.log.warning("bad_tool_request", peer=peer.node_id, error=problem)
            return ErrorReply(code="bad_request", message=problem)
        if self.pool.refusal(req.call_id, req.name, req.arguments) is not None:
            # an error observation, not a bad request: refused (and counted) by the pool, not kept
            return reply_of(await self.pool.run(req.call_id, req.name, req.arguments))
        res = await self.cache.run(
            req.call_id,
            req.name,
            self.registry.tools[req.name].side_effects,
            lambda: self.pool.run(req.call_id, req.name, req.arguments, req.timeout_s),
        )
        return reply_of(res)

    def _on_stats(self, peer: Peer, req: ToolStatsRequest) -> ToolStatsReply:
        return ToolStatsReply(stats=self.stats())

    def stats(self) -> dict[str, Any]:
        return {
            **self.pool.stats(),
            **self.cache.stats(),
            "bad_requests": self.bad_requests,
            "tools": self.registry.names(),
        }

    def status(self) -> NodeStatus:
        # the pool and cache are built in setup() before the server and the manager client exist,
        # so nothing asks for a status before them
        st = self.stats()
        return NodeStatus(
            node_id=self.node_id,
            role=self.role,
            running=st["running"],
            waiting=st["queue_depth"],
            extra=st,
        )
