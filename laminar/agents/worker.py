"""An agent worker process: runs the user's `agent.fn` for one episode at a time.

    python -m laminar.agents.worker my.module:run      (started by the rollout's AgentDriver)

    rollout ──frame({base_url, api_key, row, timeout_s})──► worker: await run(row, client)
            ◄──frame({ok: true, reward} | {ok: false, error})──

`client` is an `openai.AsyncOpenAI(base_url=<the rollout's endpoint>/v1, api_key=<the episode's
token>)`, with no retries (a call that fails fails the attempt; the rollout starts the episode
again from its prompt) and the episode's time limit as its timeout. The first frame is the
hello: {pid} or {pid, error} when `fn` cannot be loaded. Framing: laminar/subprocess_pool.py.
The user's code may print: stdout goes to stderr, the protocol pipes are moved off fds 0/1.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import traceback
from typing import Any

import msgspec

from laminar.rewards.runner import resolve_spec
from laminar.subprocess_pool import protocol_fds, read_frame, write_frame


class AgentLoadError(ValueError):
    pass


def load_agent(spec: str) -> Any:
    fn = resolve_spec(spec, "agent.fn", "async def run(row, client)", AgentLoadError)
    if not inspect.iscoroutinefunction(fn):
        raise AgentLoadError(f"agent.fn {spec!r} must be `async def run(row, client)`")
    return fn


async def _run_one(fn: Any, req: dict[str, Any]) -> Any:
    import openai

    client = openai.AsyncOpenAI(
        base_url=req["base_url"],
        api_key=req["api_key"],
        max_retries=0,
        timeout=float(req.get("timeout_s", 300.0)),
    )
    try:
        return await fn(req["row"], client)
    finally:
        await client.close()


def _plain_reward(out: Any) -> Any:
    """What crosses the pipe: numbers, None, or a dict of plain values."""
    if out is None or isinstance(out, bool | int | float):
        return out
    if isinstance(out, dict):
        return {
            str(k): v if isinstance(v, bool | int | float | str) else str(v) for k, v in out.items()
        }
    if hasattr(out, "__float__"):
        return float(out)
    raise TypeError(f"the agent returned {type(out).__name__}; return a float, a dict or None")


def main() -> None:
    proto_in, proto_out = protocol_fds(stdout_to=2)
    try:
        fn = load_agent(sys.argv[1])
    except Exception as exc:
        write_frame(proto_out, {"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"})
        return
    write_frame(proto_out, {"pid": os.getpid()})
    while True:
        payload = read_frame(proto_in)
        if payload is None:
            return  # the rollout closed the pipe (or died): nothing left to do here
        req = msgspec.msgpack.decode(payload, type=dict[str, Any])
        try:
            reward = _plain_reward(asyncio.run(_run_one(fn, req)))
            reply: dict[str, Any] = {"ok": True, "reward": reward}
        except Exception as exc:  # the user's agent: its failure is the episode's, not ours
            tb = traceback.format_exc(limit=4)
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{tb}"[-2000:]}
        write_frame(proto_out, reply)


if __name__ == "__main__":
    main()
