"""An OpenAI Agents SDK agent with instructions, trained through Laminar's endpoint.

    agent:
      fn: examples.agents.openai_agents_sdk:run
    reward:
      fn: laminar.tasks.tooluse:reward        # scores the transcript (the agent returns None)

    pip install openai-agents                 # (the `agents-sdk` extra)

Plain Agents SDK code: the model is `OpenAIChatCompletionsModel(openai_client=client)`, the
client Laminar bound to the episode (the endpoint serves /v1/chat/completions), so its calls
follow the episode across repack moves. The instructions become a system message: the sample's
prompt is what the first call rendered (docs/agents.md). Tracing is off: it would export spans
over the network. laminar/demo/tooldemo/sdk_agent.py is the same agent without instructions.
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


async def run(row: dict[str, Any], client: Any) -> None:
    agent = Agent(
        name="calculator-agent",
        instructions="Answer with #<number>. Use the calculator for products.",
        tools=[calculator],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
    )
    try:
        await Runner.run(agent, row["prompt"], max_turns=4)
    except AgentsException:  # too many turns, a malformed tool call: the transcript scores it
        pass
    return None
