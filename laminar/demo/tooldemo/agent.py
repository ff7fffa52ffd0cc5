"""The tool demo's task as a black-box agent: an OpenAI-client loop with a calculator in `tools=`.

    agent:
      fn: laminar.demo.tooldemo.agent:run      # configs/tool_demo_agent.yaml
    reward:
      fn: laminar.tasks.tooluse:reward         # scores the transcript (the agent returns None)

The same episode the in-process ToolEnv runs (laminar/envs/tool_env.py), written the way agents
are written today: ask the model with the calculator declared as a tool; while it calls tools,
run them and send the results back as `tool` messages; stop at an answer. Laminar's endpoint
renders it into the same tokens ToolEnv makes (laminar/agents/render.py: the plain format), so
the warm-up model of the tool demo reads it unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from laminar.tools.builtin import calculator

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / // % **).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
MAX_TURNS = 3
"""A call, its answer, one more try: configs/tool_demo.yaml's env.limits.max_turns."""


def run_tool(name: str, arguments: str) -> str:
    """A tool call's result, or the error text ToolEnv would answer with."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments or "{}")
        return calculator(str(args["expression"]))
    except Exception as exc:  # the model's call was malformed: it reads why
        return f"error: {type(exc).__name__}: {exc}"


async def run(row: dict[str, Any], client: Any) -> None:
    messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
    for _ in range(MAX_TURNS):
        resp = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for tc in msg.tool_calls:
            out = run_tool(tc.function.name, tc.function.arguments)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": out})
    return None  # reward.fn scores the transcript
