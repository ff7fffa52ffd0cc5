"""The tool demo's agent written with the OpenAI Agents SDK (`pip install openai-agents`).

    agent:
      fn: laminar.demo.tooldemo.sdk_agent:run
    reward:
      fn: laminar.tasks.tooluse:reward        # scores the transcript (the agent returns None)

Plain Agents SDK code: an `Agent` with a `@function_tool` calculator, run by `Runner.run`. The
only Laminar-specific line is the model: `OpenAIChatCompletionsModel(openai_client=client)`, the
client Laminar bound to the episode (the SDK's Chat Completions model, since the endpoint
serves /v1/chat/completions). Tracing is off: it would export spans over the network.
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    AgentsException,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from laminar.tools import builtin

set_tracing_disabled(True)


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % **)."""
    return builtin.calculator(expression)


async def run(row: dict[str, Any], client: Any, instructions: str | None = None) -> None:
    """`instructions` (agent.kwargs): the agent's system prompt, as most SDK agents have one; the
    sample's prompt is what the first call rendered, system message included (docs/agents.md)."""
    agent = Agent(
        name="calculator-agent",
        instructions=instructions,
        tools=[calculator],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
    )
    try:
        await Runner.run(agent, row["prompt"], max_turns=4)
    except AgentsException:  # too many turns, a malformed tool call: the transcript scores it
        pass
    return None
