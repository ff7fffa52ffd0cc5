"""ToolEnv: the model calls tools with <tool_call>{json}</tool_call> until it answers.

    env:
      fn: laminar.envs.tool_env:ToolEnv
      kwargs: {tools: [calculator, python]}       # the names the tools node serves
    reward:
      fn: laminar.tasks.tooluse:reward            # scores the decoded completion

Each model turn ends at "</tool_call>" (the stop string) or EOS. `step` parses the
turn's calls (laminar/envs/toolcall.py):

  * no call               -> done: the model answered; reward.fn scores the completion
  * calls                 -> each runs through ctx.tools with its deterministic id
                             ctx.call_id(k) (concurrently; results kept in call order),
                             and the results come back as one tool turn, one tool
                             message per call ("error: ..." for a failed one)
  * a malformed call, an unknown tool, no tools node (ctx.tools None)
                          -> an error message in its place, nothing runs
  * calls past ctx.calls_left() (the episode's max_tool_calls)
                          -> "error: tool call limit reached", nothing runs

`StepResult.tool_results` holds one ToolResult per call the model made within the limit
(ok False with error_kind bad_call / unknown_tool / unavailable when it did not run),
so the rollout's count of tool calls bounds malformed spam as well.

State is a plain dict (turns, tool_calls, history of calls and results): a pure
function of the row, the model's turns and the tool results, so replay on another
rollout (tool calls answered from the tools node's cache) rebuilds it exactly.

Chat models: the prompt must tell the model which tools exist. `system_prompt()` gives
the tool descriptions in the Hermes / Qwen style; put it in the dataset's prompt as the
system message (prompts are tokenized by the buffer, not by the environment):
`{"prompt": [{"role": "system", "content": env.system_prompt()}, {"role": "user", ...}]}`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

from laminar.envs.base import Environment, StepContext, StepResult, ToolResult
from laminar.envs.toolcall import CALL_CLOSE, ParsedCall, parse_tool_calls, tool_messages

BUILTIN_DESCRIPTIONS: dict[str, tuple[str, dict[str, str]]] = {
    "calculator": (
        "Evaluate an arithmetic expression (+ - * / // % **).",
        {"expression": "string"},
    ),
    "python": (
        "Run Python code; what it prints and its last expression's value come back.",
        {"code": "string"},
    ),
}
"""Descriptions of the tools node's built-ins (laminar/tools/builtin.py) for `system_prompt`."""


class ToolEnv(Environment):
    """Generic tool-calling environment: the model calls tools until it answers without one."""

    stop = (CALL_CLOSE,)

    def __init__(
        self,
        tools: Sequence[str] = ("python", "calculator"),
        concurrent: bool = True,
        descriptions: Mapping[str, str] | None = None,
    ):
        """`tools`: the names the model may call (what the tools node serves); `concurrent`:
        run a turn's calls at once (results stay in call order); `descriptions`: text per
        tool name for `system_prompt` (built-ins have their own)."""
        if isinstance(tools, str) or not tools or not all(isinstance(t, str) and t for t in tools):
            raise ValueError(
                f"ToolEnv(tools=...) must be a non-empty list of tool names, got {tools!r}"
            )
        self.tools = tuple(tools)
        self.concurrent = concurrent
        self.descriptions = dict(descriptions or {})

    def system_prompt(self) -> str:
        """The tools and the call format, for the system message of a chat model's prompt."""
        lines = []
        for name in self.tools:
            desc, params = BUILTIN_DESCRIPTIONS.get(name, ("", {}))
            spec = {
                "name": name,
                "description": self.descriptions.get(name, desc),
                "parameters": {
                    "type": "object",
                    "properties": {k: {"type": v} for k, v in params.items()},
                },
            }
            lines.append(json.dumps(spec))
        return (
            "You may call tools. The tools are:\n<tools>\n" + "\n".join(lines) + "\n</tools>\n"
            "To call one, write a JSON object with its name and arguments in tags:\n"
            '<tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call>\n'
            "The result comes back in <tool_response></tool_response>. "
            "Answer without a tool call when you are done."
        )

    def reset(self, row: dict[str, Any], prompt: str) -> dict[str, Any]:
        return {"turns": 0, "tool_calls": 0, "history": [], "answer": None}

    async def _run(self, ctx: StepContext, call: ParsedCall) -> ToolResult:
        cid = ctx.call_id(call.index, call.name, call.arguments)
        if call.name not in self.tools:
            return ToolResult(
                cid,
                call.name,
                ok=False,
                error_kind="unknown_tool",
                error=f"unknown tool {call.name!r} (tools: {', '.join(self.tools)})",
            )
        if ctx.tools is None:
            return ToolResult(
                cid,
                call.name,
                ok=False,
                error_kind="unavailable",
                error="tools are not available (no tools node)",
            )
        try:
            return await ctx.tools.call(cid, call.name, call.arguments, ctx.timeout_s)
        # a client must answer with a ToolResult; a bug in one is an error observation
        except Exception as exc:
            return ToolResult(
                cid,
                call.name,
                ok=False,
                error_kind="client_error",
                error=f"{type(exc).__name__}: {exc}",
            )

    async def step(self, state: dict[str, Any], ctx: StepContext, model_text: str) -> StepResult:
        calls, errors = parse_tool_calls(model_text)
        state["turns"] += 1
        if not calls and not errors:
            state["answer"] = model_text
            return StepResult(done=True)
        items: list[ParsedCall | str] = [""] * (len(calls) + len(errors))
        for c in calls:
            items[c.index] = c
        for e in errors:
            items[e.index] = e.message
        allowed, refused = items[: ctx.calls_left()], len(items) - ctx.calls_left()

        async def one(item: ParsedCall | str, k: int) -> ToolResult:
            if isinstance(item, str):
                return ToolResult(ctx.call_id(k), "", ok=False, error_kind="bad_call", error=item)
            return await self._run(ctx, item)

        coros = [one(item, k) for k, item in enumerate(allowed)]
        if self.concurrent:
            results = list(await asyncio.gather(*coros))
        else:
            results = [await c for c in coros]
        shown: list[ToolResult | str] = list(results)
        if refused > 0:
            limit = ctx.max_tool_calls
            shown += [f"tool call limit reached (max_tool_calls={limit})"] * refused
        state["tool_calls"] += len(results)
        state["history"].append(
            {
                "turn": ctx.turn,
                "calls": [
                    {"name": r.name, "ok": r.ok, "output": r.output, "error": r.error}
                    for r in results
                ],
                "refused": max(0, refused),
            }
        )
        return StepResult(
            observation=tool_messages(shown),
            role="tool",
            done=False,
            tool_results=results,
            info={"refused": max(0, refused)},
        )
