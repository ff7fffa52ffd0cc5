"""The environment protocol of multi-turn episodes: the model writes, the environment answers.

    env = load_env(cfg.env)                       # module:Class or module:function (loader.py)
    state = env.reset(row, prompt)                # per-episode state, deterministic (not on env)
    res = await env.step(state, ctx, model_text)  # after each model turn: a StepResult
    reward = await env.score(state, ctx)          # optional; None -> reward.fn on the completion

Token in, token out. The rollout owns the token sequence: the model's tokens are exactly
what the engine sampled (with their behaviour logprobs); the environment's answer is
turned into tokens once, by the turn template (laminar/envs/template.py), appended with
loss mask 0 and logprob 0.0, and nothing is ever re-tokenized. `model_text` is only the
decoded text of the model's last turn, for the environment to read.

State lives in `state`, never on the environment object, so an episode can be rebuilt
anywhere by deterministic replay (laminar/envs/replay.py): reset, then step through the
recorded model turns with tool calls answered from the tools node's cache (each call id
runs at most once). An environment whose step is a pure function of (state, model text,
tool results) replays exactly; the rollout checks the replayed observation tokens against
the recorded ones and counts any difference (`replay_mismatch`).
"""

from __future__ import annotations

import json
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

from laminar.protocol.data import ToolRecord


@dataclass
class ToolResult:
    """What one tool call gave back (the tools node's reply, or a local tool's)."""

    call_id: str
    name: str
    ok: bool
    output: str = ""
    error: str = ""
    error_kind: str = ""
    seconds: float = 0.0
    cached: bool = False
    truncated: bool = False

    def record(self, turn: int) -> ToolRecord:
        return ToolRecord(
            call_id=self.call_id,
            name=self.name,
            turn=turn,
            ok=self.ok,
            error_kind=self.error_kind,
            seconds=self.seconds,
            cached=self.cached,
        )


class ToolClient(Protocol):
    """Runs tool calls; a call id runs at most once (a repeat is answered from a cache)."""

    async def call(
        self, call_id: str, name: str, arguments: dict[str, Any], timeout_s: float = 0.0
    ) -> ToolResult: ...


def call_id(
    uid: str, turn: int, k: int, name: str = "", arguments: dict[str, Any] | None = None
) -> str:
    """The deterministic id of the k-th tool call of turn `turn` of episode `uid`.

    With the call's name and arguments, their digest is part of the id: a replay (same text,
    same call) finds the cached result, while an episode restarted from its prompt that writes
    a different call at the same place runs it instead of being answered for the old one.
    """
    base = f"{uid}#t{turn}#c{k}"
    if not name:
        return base
    text = json.dumps([name, arguments or {}], sort_keys=True, separators=(",", ":"), default=str)
    return f"{base}#{zlib.crc32(text.encode()):08x}"


@dataclass
class StepContext:
    """What an environment step may use besides its state."""

    uid: str
    """The episode (trajectory) uid."""
    turn: int
    """0-based index of the model turn that just ended."""
    tools: ToolClient | None
    """None when no tools node is configured."""
    tool_calls_so_far: int = 0
    """Tool calls earlier in the episode (the step must stay within max_tool_calls in all)."""
    max_tool_calls: int = 8
    timeout_s: float = 60.0
    """What is left of this step's time budget."""
    replay: bool = False
    """True while the episode is being rebuilt on another rollout (tool calls hit the cache)."""

    def call_id(self, k: int, name: str = "", arguments: dict[str, Any] | None = None) -> str:
        return call_id(self.uid, self.turn, k, name, arguments)

    def calls_left(self) -> int:
        return max(0, self.max_tool_calls - self.tool_calls_so_far)


@dataclass
class StepResult:
    observation: str | list[str] | None = None
    """Text the environment answers with, rendered in `role` by the turn template; a list = one
    message of `role` per item (one tool message per call); None = nothing."""
    observation_ids: list[int] | None = None
    """Or the exact tokens to append (token-level environments, the sim); wins over observation."""
    role: str = "tool"
    """tool | user: the chat role the observation is written in."""
    images: list[Any] = field(default_factory=list)
    """Vision-language models: images the observation shows (a screenshot after a tool call):
    each a local path, bytes, a `data:image/...;base64,` URI, {"bytes", "path"} or a PIL image.
    Rendered before the text of the observation's last message (with `observation_ids`: one
    image placeholder token per image in them); sent to the buffer once, carried by digest
    (laminar/vision/turns.py, docs/vision.md)."""
    done: bool = False
    """The episode is over (the model answered, or the environment ends it)."""
    tool_results: list[ToolResult] = field(default_factory=list)
    """Tool calls this step made, in order (they become the trajectory's ToolRecords)."""
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """Base of multi-turn environments. One instance serves every episode of a rollout."""

    stop: tuple[str, ...] = ()
    """Strings that end a model turn besides EOS (ToolEnv: "</tool_call>")."""

    @abstractmethod
    def reset(self, row: dict[str, Any], prompt: str) -> Any:
        """A fresh episode's state, from the dataset row (deterministic: replay calls it again)."""

    @abstractmethod
    async def step(self, state: Any, ctx: StepContext, model_text: str) -> StepResult:
        """The model's turn `model_text` ended: answer it (tools, a user message) or end the
        episode."""

    async def score(self, state: Any, ctx: StepContext) -> float | dict[str, Any] | None:
        """The episode's reward, or None to score the whole completion with reward.fn."""
        return None
