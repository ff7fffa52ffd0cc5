"""Multi-turn episode metrics of one training batch: turns, tool calls, tool errors and
latency, environment-token fraction, and reward by number of tool calls.

    out.update(episode_stats(batch.samples))  # the trainer's step (torch or sim) -> metrics.jsonl

Computed over the batch's usable episodes (what the step trains on), next to `reward` and
`response_len/*`. A single-turn batch (no loss mask, one turn, no tool call anywhere)
gives {}: single-turn runs log exactly what they logged before. In a multi-turn batch
every key is present; a figure with no samples (latency when no tool was called, a
reward bucket nobody fell in) is NaN, which the metrics logger writes as null.

    episode/turns             mean model turns per episode
    episode/tool_calls        mean tool calls per episode
    episode/env_token_frac    environment tokens / response tokens, over the batch
    tool/error_rate           failed calls / calls (timeouts, crashes, bad calls ...)
    tool/cached_frac          calls answered from the tools node's cache (replays, retries)
    tool/latency_p50, _p99    seconds per call (ToolCall.seconds), nearest rank
    reward_by_tool_calls/0, /1, /2+   mean reward of the episodes with that many calls
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

__all__ = ["Episode", "ToolCall", "episode_stats", "percentile"]

BUCKETS = ("0", "1", "2+")


class ToolCall(Protocol):
    """What the metrics read of one tool call (the wire's ToolRecord has it; algo imports no
    wire type)."""

    @property
    def ok(self) -> bool: ...
    @property
    def cached(self) -> bool: ...
    @property
    def seconds(self) -> float: ...


class Episode(Protocol):
    """What the metrics read of a trained sample (laminar.trainer.batch.Sample has it)."""

    @property
    def reward(self) -> float: ...
    @property
    def response_ids(self) -> np.ndarray: ...
    @property
    def loss_mask(self) -> np.ndarray | None: ...
    @property
    def turns(self) -> int: ...
    @property
    def tool_calls(self) -> Sequence[ToolCall]: ...


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of finite values; NaN without any."""
    vals = sorted(x for x in xs if math.isfinite(x))
    if not vals:
        return math.nan
    return float(vals[min(len(vals) - 1, max(0, math.ceil(q * len(vals)) - 1))])


def _mean(xs: Sequence[float]) -> float:
    vals = [x for x in xs if math.isfinite(x)]
    return sum(vals) / len(vals) if vals else math.nan


def _multi_turn(e: Episode) -> bool:
    return e.loss_mask is not None or e.turns > 1 or bool(e.tool_calls)


def episode_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """The batch's episode metrics (module doc); {} when no episode is multi-turn."""
    if not any(_multi_turn(e) for e in episodes):
        return {}
    calls = [c for e in episodes for c in e.tool_calls]
    n_resp = sum(len(e.response_ids) for e in episodes)
    n_env = sum(
        0 if e.loss_mask is None else len(e.loss_mask) - int(np.count_nonzero(e.loss_mask))
        for e in episodes
    )
    by_calls: dict[str, list[float]] = {b: [] for b in BUCKETS}
    for e in episodes:
        by_calls[BUCKETS[min(len(e.tool_calls), 2)]].append(float(e.reward))
    seconds = [c.seconds for c in calls]
    out = {
        "episode/turns": _mean([float(e.turns) for e in episodes]),
        "episode/tool_calls": _mean([float(len(e.tool_calls)) for e in episodes]),
        "episode/env_token_frac": n_env / n_resp if n_resp else math.nan,
        "tool/error_rate": _mean([0.0 if c.ok else 1.0 for c in calls]),
        "tool/cached_frac": _mean([1.0 if c.cached else 0.0 for c in calls]),
        "tool/latency_p50": percentile(seconds, 0.5),
        "tool/latency_p99": percentile(seconds, 0.99),
    }
    out.update({f"reward_by_tool_calls/{b}": _mean(by_calls[b]) for b in BUCKETS})
    return out
