"""Fakes for the multi-turn rollout tests: a turn-aware engine, a scripted environment, tools.

TurnEngine: one token per sequence per step; token i of uid is fake_token(uid, i) with
logprob -0.01 * (i + 1) (position-based, so an episode moved mid-turn or between turns
comes out identical to one that never moved); model turn t of uid is turn_len(uid, t)
tokens and ends with "stop" ("length" at max_tokens). `hold_turn` parks sequences one
token into that turn (a draining tail to export mid-turn).

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
import zlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np

from laminar.engines.base import Engine, EngineStats, GenRequest, PartialState, TokenEvent
from laminar.envs.base import Environment, StepContext, StepResult, ToolResult
from laminar.supervise import Spawn, detached_spawn


def fake_token(uid: str, i: int, vocab: int = 50) -> int:
    """Token i of uid (the same formula as tests/rollout_fakes.py, without importing the node stack:
    this module is also imported by tools-node sandbox workers and rollout processes)."""
    return 4 + zlib.crc32(f"{uid}:{i}".encode()) % (vocab - 4)


def turn_len(uid: str, turn: int, base: int = 3, span: int = 6) -> int:
    return base + zlib.crc32(f"{uid}#turn{turn}".encode()) % span


class TurnEngine(Engine):
    name = "turns"

    def __init__(self, step_s: float = 0.002, hold_turn: int | None = None):
        super().__init__()
        self.step_s, self.hold_turn = step_s, hold_turn
        self.running: dict[str, dict[str, Any]] = {}
        self.submitted: list[GenRequest] = []
        self.peak_running = 0
        self.tokens_generated = 0
        self._task: asyncio.Task[Any] | None = None

    async def start(self, spawn: Spawn = detached_spawn) -> None:
        self._task = spawn(self._loop(), "turn-engine")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def submit(self, req: GenRequest) -> None:
        assert req.version == self.version, (
            f"request at v{req.version} on an engine at v{self.version}"
        )
        self.submitted.append(req)
        for sid in req.seq_ids():
            ids = [int(i) for i in req.resume_ids]
            self.running[sid] = dict(
                prompt=np.asarray(req.prompt_ids, np.int32),
                ids=ids,
                lps=[float(x) for x in req.resume_logprobs],
                turn=req.turn,
                end=req.turn_start + turn_len(sid, req.turn),
                cap=req.params.max_tokens,
                start=req.turn_start,
                version=req.version,
            )

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)  # the emulated decode step
            self.peak_running = max(self.peak_running, len(self.running))
            for sid, s in list(self.running.items()):
                i = len(s["ids"])
                if s["turn"] == self.hold_turn and i >= s["start"] + 1:
                    continue
                tok, lp = fake_token(sid, i), -0.01 * (i + 1)
                s["ids"].append(tok)
                s["lps"].append(lp)
                self.tokens_generated += 1
                reason = "stop" if i + 1 >= s["end"] else "length" if i + 1 >= s["cap"] else None
                if reason:
                    del self.running[sid]
                self._emit(
                    TokenEvent(
                        sid,
                        np.array([tok], np.int32),
                        np.array([lp], np.float32),
                        reason,
                        s["version"],
                    )
                )

    async def abort(self, seq_ids: Iterable[str]) -> list[PartialState]:
        out = []
        for sid in seq_ids:
            s = self.running.pop(sid, None)
            if s is None:
                continue
            out.append(
                PartialState(
                    sid,
                    s["prompt"],
                    np.asarray(s["ids"], np.int32),
                    np.asarray(s["lps"], np.float32),
                    s["version"],
                )
            )
            self._emit(
                TokenEvent(
                    sid, np.zeros(0, np.int32), np.zeros(0, np.float32), "abort", s["version"]
                )
            )
        return out

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        assert not self.running, "weights loaded while sequences were in flight"
        for _ in named_tensors:
            pass
        self.version = version

    def stats(self) -> EngineStats:
        return EngineStats(
            min(1.0, len(self.running) / 64),
            len(self.running),
            0,
            self.version,
            self.tokens_generated,
        )


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
