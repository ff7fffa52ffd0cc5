"""The in-process tool client: what an environment step calls (laminar.envs.base.ToolClient)
when the tools run in this process (tests, the embedded API) instead of on the tools node.

    tools = LocalToolClient(pool, cache)
    res = await tools.call(ctx.call_id(0), "python", {"code": "2**100"}, timeout_s=5.0)

It keeps the tools node's exactly-once rule: the cache runs each call id at most once. A rollout
reaches the tools node through laminar/rollout/tool_client.py.
"""

from __future__ import annotations

from typing import Any

from laminar.envs.base import ToolResult
from laminar.tools.cache import ToolCache
from laminar.tools.sandbox import SandboxPool


class LocalToolClient:
    """ToolClient over an in-process pool and cache (same exactly-once rule as the tools node)."""

    def __init__(self, pool: SandboxPool, cache: ToolCache):
        self.pool, self.cache = pool, cache

    async def call(
        self, call_id: str, name: str, arguments: dict[str, Any], timeout_s: float = 0.0
    ) -> ToolResult:
        if self.pool.refusal(call_id, name, arguments) is not None:
            return await self.pool.run(call_id, name, arguments)  # refused there too, and counted
        tool = self.pool.registry.tools[name]
        side_effects = tool.side_effects
        return await self.cache.run(
            call_id, name, side_effects, lambda: self.pool.run(call_id, name, arguments, timeout_s)
        )
