"""SimToolEnv: an emulated multi-turn tool-calling workload, no text (the sim engine's counterpart).

    env:
      fn: laminar.envs.sim:SimToolEnv
      kwargs: {seed: 0, max_calls: 8, p_call: 0.8, latency_p50_s: 0.1, latency_p99_s: 2.0,
               latency_max_s: 6.0,
               obs_min: 20, obs_max: 200}
    rollout: {engine: sim}        # the sim engine ends each model turn at a drawn length ("stop")

The paper's second workload (ReTool-style math with a code sandbox, at most 8 tool calls per
trajectory) reduced to what the system sees: per episode a number of tool-using model turns,
after each one a sandbox call with a long-tailed latency, then tool output tokens; the turn
after the last call is the final answer (done). Everything is drawn from hashes, so an episode
is the same wherever it runs and a replay (laminar/envs/replay.py) rebuilds it exactly:

  tool calls      n = how many of k = 0, 1, ... < max_calls pass a coin of probability p_call
                  in a row, from (seed, uid): a truncated geometric (mean ~3.3 at p = 0.8, 8).
  latency         lognormal with median latency_p50_s and p99 latency_p99_s, from (seed, call
                  id): the emulated sandbox; the step awaits it (the GPU slot is free meanwhile).
                  A draw past latency_max_s (the sandbox's wall-clock limit, tools.wall_s) is
                  killed there: an error result (error_kind "timeout") after latency_max_s.
  observation     uniform in [obs_min, obs_max] tokens from (seed, call id), ids < vocab_size.

A replayed step (ctx.replay) is answered at once, as the tools node answers a call id it ran
before from its cache (cached=True, the recorded latency). No tools node is needed.
The model's text is not read: the sim engine's tokens are hashes, not language.
Reward: a hash of (seed, uid) in [0, 1], so the reward-by-tool-calls metrics have data.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from laminar.envs.base import Environment, StepContext, StepResult, ToolResult

_Z99 = NormalDist().inv_cdf(0.99)


def _unit(*parts: Any) -> float:
    """A uniform draw in (0, 1) from a hash of `parts`."""
    h = hashlib.blake2b("\x00".join(map(str, parts)).encode(), digest_size=8).digest()
    return (int.from_bytes(h, "little") + 0.5) / 2.0**64


def lognormal_quantile(u: float, p50: float, p99: float) -> float:
    """The u-quantile of a lognormal with median p50 and 99th percentile p99 (p99 >= p50 > 0)."""
    sigma = math.log(p99 / p50) / _Z99
    return p50 * math.exp(sigma * NormalDist().inv_cdf(u))


@dataclass
class SimEpisode:
    """An episode's state: its draws, fixed at the first step from (seed, uid)."""

    uid: str = ""
    tool_calls: int = -1
    """Tool-using model turns in the episode (-1: not drawn yet)."""


class SimToolEnv(Environment):
    """Emulated tool-calling episodes (see the module docstring)."""

    stop = ("</tool_call>",)  # what a real tool env stops on; the sim engine ends turns by length

    def __init__(
        self,
        *,
        seed: int = 0,
        max_calls: int = 8,
        p_call: float = 0.8,
        latency_p50_s: float = 0.1,
        latency_p99_s: float = 2.0,
        obs_min: int = 20,
        obs_max: int = 200,
        vocab_size: int = 32000,
        tool: str = "python",
        latency_max_s: float | None = None,
    ) -> None:
        if not 0.0 <= p_call <= 1.0:
            raise ValueError(f"p_call must be in [0, 1], got {p_call}")
        if max_calls < 0:
            raise ValueError(f"max_calls must be >= 0, got {max_calls}")
        if not 0 < latency_p50_s <= latency_p99_s:
            raise ValueError(
                f"need 0 < latency_p50_s <= latency_p99_s, got {latency_p50_s}, {latency_p99_s}"
            )
        if latency_max_s is not None and latency_max_s <= 0:
            raise ValueError(f"latency_max_s must be > 0 (or null: no limit), got {latency_max_s}")
        if not 1 <= obs_min <= obs_max:
            raise ValueError(f"need 1 <= obs_min <= obs_max, got {obs_min}, {obs_max}")
        self.seed, self.max_calls, self.p_call = seed, max_calls, p_call
        self.latency_p50_s, self.latency_p99_s = latency_p50_s, latency_p99_s
        self.obs_min, self.obs_max, self.vocab_size, self.tool = obs_min, obs_max, vocab_size, tool
        self.latency_max_s = latency_max_s

    # ---- the draws (pure functions of the seed and the ids) ---------------------------------
    def tool_calls(self, uid: str) -> int:
        """Tool-using turns of episode `uid`: a run of successes of a p_call coin, at most
        max_calls."""
        n = 0
        while n < self.max_calls and _unit("call", self.seed, uid, n) < self.p_call:
            n += 1
        return n

    def latency(self, call_id: str) -> float:
        """The drawn run time of a call (before the latency_max_s kill)."""
        if self.latency_p99_s == self.latency_p50_s:
            return self.latency_p50_s
        u = _unit("lat", self.seed, call_id)
        return lognormal_quantile(u, self.latency_p50_s, self.latency_p99_s)

    def observation_ids(self, call_id: str) -> list[int]:
        n = self.obs_min + int(_unit("obs", self.seed, call_id) * (self.obs_max - self.obs_min + 1))
        n = min(n, self.obs_max)
        return [int(_unit("tok", self.seed, call_id, i) * self.vocab_size) for i in range(n)]

    # ---- Environment ----------------------------------------------------------------------
    def reset(self, row: dict[str, Any], prompt: str) -> SimEpisode:
        return SimEpisode()

    async def step(self, state: SimEpisode, ctx: StepContext, model_text: str) -> StepResult:
        if state.tool_calls < 0:
            state.uid, state.tool_calls = ctx.uid, self.tool_calls(ctx.uid)
        if ctx.turn >= state.tool_calls:
            return StepResult(done=True)  # the final answer
        cid = ctx.call_id(0)
        drawn = self.latency(cid)
        killed = self.latency_max_s is not None and drawn > self.latency_max_s
        seconds = min(drawn, self.latency_max_s) if self.latency_max_s is not None else drawn
        if ctx.calls_left() <= 0:  # over the episode's budget: an error observation, no run
            return StepResult(
                observation_ids=self.observation_ids(cid)[: self.obs_min],
                tool_results=[
                    ToolResult(
                        cid, self.tool, ok=False, error="too many tool calls", error_kind="limit"
                    )
                ],
            )
        if not ctx.replay:
            await asyncio.sleep(seconds)  # the emulated sandbox run
        result = ToolResult(
            cid,
            self.tool,
            ok=not killed,
            error="wall-clock limit" if killed else "",
            error_kind="timeout" if killed else "",
            seconds=seconds,
            cached=ctx.replay,
        )
        return StepResult(observation_ids=self.observation_ids(cid), tool_results=[result])

    async def score(self, state: SimEpisode, ctx: StepContext) -> float:
        return _unit("reward", self.seed, ctx.uid)
