"""sim_tool_agent: SimToolEnv's emulated tool-calling episodes, driven as a black-box agent.

    agent:
      fn: laminar.agents.sim:sim_tool_agent
      kwargs: {seed: 0, max_calls: 8, p_call: 0.8, latency_p50_s: 0.1, latency_p99_s: 2.0,
               latency_max_s: 6.0, obs_min: 10, obs_max: 100}
    rollout: {engine: sim}

The same draws as laminar/envs/sim.py (tool calls per episode from (seed, uid), each call's
sandbox latency and output length from (seed, call id)), but the loop is an agent's: it calls
/v1/chat/completions, sleeps the call's latency as if it ran a tool, adds the output as a user
message and calls again, then returns the episode's reward. With no tokenizer (sim engines) a
message of n - 2 bytes becomes exactly n tokens ("\\n" + text + "\\n"), so the episode's shape
matches SimToolEnv's. bench/cluster.py --workload multiturn --agents runs it at scale.

kwargs `client_call`: "create" (default) calls `client.chat.completions.create`, as agents are
written; "post" sends the same request through the same client with `client.post(...,
cast_to=ChatCompletion)`, the client's documented way to skip its per-call parameter transform
(~2.5 ms of CPU a call, growing with the conversation). The cluster bench uses "post": there 64
emulated rollouts and all their agents share 2 cores, while a real agent's client runs on its
own host's CPUs; bench/agent_overhead.py measures the full `create` path.
"""

from __future__ import annotations

import asyncio
from typing import Any

from laminar.envs.base import call_id
from laminar.envs.sim import SimToolEnv, _unit


def episode_uid(response_id: str) -> str:
    """The sample uid in a completion id ("chatcmpl-<uid>-<attempt>-<turn>")."""
    return response_id.split("-", 1)[1].rsplit("-", 2)[0]


async def sim_tool_agent(
    row: dict[str, Any], client: Any, client_call: str = "create", **kwargs: Any
) -> float:
    if client_call not in ("create", "post"):
        raise ValueError(f"client_call must be 'create' or 'post', not {client_call!r}")
    env = SimToolEnv(**kwargs)

    async def chat(messages: list[Any]) -> Any:
        if client_call == "create":
            return await client.chat.completions.create(model="sim", messages=messages)
        from openai.types.chat import ChatCompletion

        body = {"model": "sim", "messages": messages}
        return await client.post("/chat/completions", body=body, cast_to=ChatCompletion)

    messages: list[Any] = [{"role": "user", "content": str(row.get("prompt", ""))}]
    resp = await chat(messages)
    uid = episode_uid(resp.id)
    for turn in range(env.tool_calls(uid)):
        cid = call_id(uid, turn, 0)
        seconds = env.latency(cid)
        if env.latency_max_s is not None:
            seconds = min(seconds, env.latency_max_s)
        await asyncio.sleep(seconds)  # the emulated tool run
        n = len(env.observation_ids(cid))
        said = {"role": "assistant", "content": resp.choices[0].message.content}
        messages += [said, {"role": "user", "content": "x" * max(1, n - 2)}]
        resp = await chat(messages)
    return _unit("reward", env.seed, uid)
