"""A LangGraph ReAct agent (LangChain's ChatOpenAI) trained through Laminar's endpoint.

    agent:
      fn: examples.agents.langgraph_agent:run
    reward:
      fn: laminar.tasks.tooluse:reward        # scores the transcript (the agent returns None)

    pip install langgraph langchain-openai    # (the `frameworks` extra)

Plain LangGraph code; the one Laminar-specific part is the model: ChatOpenAI gets the client
Laminar bound to the episode (`async_client=client.chat.completions, root_async_client=client`),
so every call goes through the episode's failover transport and follows it when a repack moves
it to another rollout. `ChatOpenAI(base_url=client.base_url, api_key=client.api_key)` would
build a client of its own: its calls work until the first move, then answer
`421 episode_moved` and the episode starts again from its prompt (docs/agents.md).
"""

from __future__ import annotations

from typing import Any

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from laminar.tools import builtin


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % **)."""
    return builtin.calculator(expression)


async def run(row: dict[str, Any], client: Any) -> None:
    model = ChatOpenAI(
        model="policy",
        async_client=client.chat.completions,  # Laminar's client: failover survives moves
        root_async_client=client,
        api_key=client.api_key,  # (ChatOpenAI checks for one; the calls use the client's)
        base_url=str(client.base_url),
        max_retries=0,
    )
    agent = create_react_agent(model, [calculator])
    await agent.ainvoke({"messages": [("user", row["prompt"])]}, {"recursion_limit": 8})
    return None
