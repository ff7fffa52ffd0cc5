"""The tool demo's tools in process, for its held-out episodes (laminar/tasks/evaluate.py).

    tools = DirectToolClient(["calculator"])       # a ToolClient (laminar/envs/base.py)
    res = evaluate_model(path, rows, tooluse.verify, episodes=Episodes(env, tools, limits))

The tools node's built-in functions, called directly: the demo's only tool is the calculator,
plain arithmetic on a parsed AST, and a snapshot curve runs thousands of calls, each of which
would cost a sandbox round trip. The RL run itself calls them through the tools node and its
sandbox.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from laminar.envs.base import ToolResult


class DirectToolClient:
    """ToolClient that calls the tools node's built-in functions in this process (trusted
    arithmetic only: no sandbox, no cache; a call id is never repeated within one eval)."""

    def __init__(self, names: Sequence[str] = ("calculator",)):
        from laminar.tools.builtin import BUILTINS

        unknown = [n for n in names if n not in BUILTINS]
        if unknown:
            raise ValueError(
                f"DirectToolClient: no built-in tool {unknown} (have {sorted(BUILTINS)})"
            )
        self.fns: dict[str, Callable[..., str]] = {n: BUILTINS[n][0] for n in names}

    async def call(
        self, call_id: str, name: str, arguments: dict[str, Any], timeout_s: float = 0.0
    ) -> ToolResult:
        fn = self.fns.get(name)
        if fn is None:
            return ToolResult(
                call_id, name, False, error=f"unknown tool {name!r}", error_kind="unknown_tool"
            )
        t0 = time.perf_counter()
        try:
            out = fn(**arguments)
        except Exception as exc:  # the tool's error is the model's observation
            return ToolResult(
                call_id,
                name,
                False,
                error=f"{type(exc).__name__}: {exc}",
                error_kind="error",
                seconds=time.perf_counter() - t0,
            )
        return ToolResult(call_id, name, True, output=str(out), seconds=time.perf_counter() - t0)
