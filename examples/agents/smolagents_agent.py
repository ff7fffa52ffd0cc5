"""A smolagents ToolCallingAgent trained through Laminar's endpoint.

    agent:
      fn: examples.agents.smolagents_agent:run
    reward:
      fn: laminar.tasks.tooluse:reward        # scores the transcript (the agent returns None)

    pip install smolagents                    # (the `frameworks` extra)

smolagents is synchronous: its OpenAIModel takes a sync `openai.OpenAI` client. Laminar's
`blocking_client(client)` is one on the episode's own failover transport (its calls run on the
agent worker's event loop), so a repack move is followed as for an async agent; the agent runs
in a thread (`asyncio.to_thread`) so that loop stays free. `OpenAIModel(api_base=...,
api_key=...)` would build a client of its own: it works until the episode's first move, then
answers `421 episode_moved` (docs/agents.md).

smolagents writes its own system prompt and wraps the task ("New task:\\n..."): the sample's
prompt is what that first call rendered (docs/agents.md "The sample's prompt").
"""

from __future__ import annotations

import asyncio
from typing import Any

from smolagents import OpenAIModel, ToolCallingAgent, tool

from laminar.agents.failover import blocking_client
from laminar.tools import builtin


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % **).

    Args:
        expression: the expression, e.g. "12*7".
    """
    return builtin.calculator(expression)


async def run(row: dict[str, Any], client: Any) -> None:
    # tool_choice "auto": smolagents asks "required", which only an engine that constrains
    # decoding can enforce (the torch engine refuses it: docs/agents.md)
    model = OpenAIModel(model_id="policy", client=blocking_client(client), tool_choice="auto")
    agent = ToolCallingAgent(tools=[calculator], model=model, max_steps=3, verbosity_level=0)
    await asyncio.to_thread(agent.run, row["prompt"])
    return None
