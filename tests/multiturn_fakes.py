"""Fakes for the multi-turn rollout tests: a scripted environment and tools (the engine is
tests/fake_engine.py's FakeEngine(turns=True)).

ScriptedEnv: every step calls the tool `tool` `calls` times with the deterministic call
ids (ctx.call_id(k)), answers with observation ids [100 + turn, 200 + calls made,
300 + calls ok] and is done after `turns` model turns; score = 1.0 plus what it saw.

FakeTools (a ToolClient, in process): runs each call id at most once (a repeat gets the
cached result, or waits for the first run), counts runs; calls whose arguments' turn is
`gate_turn` wait for `gate` (a tool mid-call, to export an episode while it waits); the
tool "hang" never answers.

append_call (for the tools node of tests/test_multiturn_faults.py): sleeps, then appends
its tag (the call id) to a file: a side effect that must never happen twice.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from fake_engine import fake_token, turn_len

from laminar.envs.base import Environment, StepContext, StepResult, ToolResult
from laminar.supervise import detached_spawn


def obs_ids(turn: int, results: list[ToolResult]) -> list[int]:
    return [100 + turn, 200 + len(results), 300 + sum(r.ok for r in results)]


class ScriptedEnv(Environment):
    stop = ("</call>",)

    def __init__(self, turns: int = 3, tool: str = "effect", calls: int = 1, path: str = ""):
        self.turns, self.tool, self.calls, self.path = turns, tool, calls, path
        self.steps: Counter[tuple[str, int, bool]] = Counter()
        """(uid, turn, replay) -> steps run (this process)."""

    def reset(self, row: dict[str, Any], prompt: str) -> dict[str, Any]:
        return {"turns": int(row.get("turns", self.turns)), "seen": [], "calls": 0}

    async def step(self, state: dict[str, Any], ctx: StepContext, model_text: str) -> StepResult:
        self.steps[(ctx.uid, ctx.turn, ctx.replay)] += 1
        state["seen"].append(ctx.turn)
        results: list[ToolResult] = []
        for k in range(min(self.calls, ctx.calls_left())):
            if ctx.tools is None:
                break
            args: dict[str, Any] = {"turn": ctx.turn, "k": k}
            if self.path:
                args = {"tag": ctx.call_id(k), "path": self.path}
            results.append(await ctx.tools.call(ctx.call_id(k), self.tool, args, ctx.timeout_s))
        state["calls"] += len(results)
        done = ctx.turn + 1 >= state["turns"]
        return StepResult(
            observation_ids=None if done else obs_ids(ctx.turn, results),
            done=done,
            tool_results=results,
        )

    async def score(self, state: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
        return {"reward": 1.0, "seen": len(state["seen"]), "calls": state["calls"]}


def expected_episode(uid: str, turns: int, calls: int = 1) -> tuple[list[int], list[int]]:
    """(response ids, loss mask) of an uninterrupted episode of ScriptedEnv with tools that all
    succeed."""
    ids: list[int] = []
    mask: list[int] = []
    for t in range(turns):
        start = len(ids)
        ids += [fake_token(uid, i) for i in range(start, start + turn_len(uid, t))]
        mask += [1] * (len(ids) - start)
        if t + 1 < turns:
            obs = [100 + t, 200 + calls, 300 + calls]
            ids += obs
            mask += [0] * len(obs)
    return ids, mask


class FakeTools:
    def __init__(self, gate_turn: int | None = None):
        self.gate_turn = gate_turn
        self.gate = asyncio.Event()
        self.runs: Counter[str] = Counter()
        self.started: set[str] = set()
        self._done: dict[str, ToolResult] = {}
        self._inflight: dict[str, asyncio.Task[ToolResult]] = {}

    async def call(
        self, call_id: str, name: str, arguments: dict[str, Any], timeout_s: float = 0.0
    ) -> ToolResult:
        if call_id in self._done:
            return replace(self._done[call_id], cached=True)
        task = self._inflight.get(call_id)
        first = task is None
        if task is None:
            task = self._inflight[call_id] = detached_spawn(
                self._run(call_id, name, arguments), "fake-tool"
            )
        res = await asyncio.shield(
            task
        )  # a cancelled caller leaves the run going (a tools node would)
        return res if first else replace(res, cached=True)

    async def _run(self, call_id: str, name: str, arguments: dict[str, Any]) -> ToolResult:
        self.runs[call_id] += 1
        self.started.add(call_id)
        t0 = time.monotonic()
        if name == "hang":
            await asyncio.Event().wait()
        if arguments.get("turn") == self.gate_turn:
            await self.gate.wait()
        res = ToolResult(
            call_id, name, ok=True, output=f"ran {call_id}", seconds=time.monotonic() - t0
        )
        self._done[call_id] = res
        self._inflight.pop(call_id, None)
        return res


def append_call(tag: str, path: str) -> str:
    """A side-effecting tool: takes ~1 s, then appends its tag to `path`."""
    time.sleep(1.0)  # the tool's own run time (a slow side effect), not a synchronisation
    with open(path, "a") as f:
        f.write(tag + "\n")
    return f"appended {tag}"
