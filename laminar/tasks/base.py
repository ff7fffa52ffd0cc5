"""What a task hands the held-out evaluator (laminar/tasks/evaluate.py): its prompts, how a
completion scores, and, for a multi-turn task, the environment its episodes run in.

    task.prompts   ─► the evaluator: a greedy completion of each (an episode where
    task.episodes      task.episodes is set: env + tools + limits, as the rollouts run it)
                   ─► await task.score(prompt, completion) ─► reward (None: not scored)

Two kinds of task implement it:

    VerifiedTask.of_rows(rows, tokenizer, countup.verify)             # the demos: rows
    VerifiedTask.of_rows(rows, tokenizer, tooluse.verify, episodes)   # {"prompt", "answer"}
    ValidationTask(prompts, rewards)   # the trainer's: data.eval, reward.fn (trainer/evaluation.py)

An episode the environment scored (env.score gave a reward) keeps that score, as in the
rollouts; `score` judges the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from laminar.config import EnvLimits
from laminar.envs.base import Environment, ToolClient


@dataclass(frozen=True)
class HeldOut:
    """One held-out prompt."""

    ids: np.ndarray
    """Prompt token ids, as the policy reads them."""
    prompt: str
    """Prompt text, as the scorer (and the environment) sees it."""
    row: dict[str, Any]
    """The data row: answer, kind, ..."""


@dataclass(frozen=True)
class Episodes:
    """A multi-turn task's episodes: the environment, the tools it calls, the limits."""

    env: Environment
    tools: ToolClient | None
    limits: EnvLimits


class Task(Protocol):
    """Held-out prompts and how their completions score."""

    @property
    def prompts(self) -> Sequence[HeldOut]: ...

    @property
    def episodes(self) -> Episodes | None:
        """None: one completion per prompt (single-turn)."""
        ...

    async def score(self, prompt: HeldOut, completion: str) -> float | None:
        """The completion's reward; None when it cannot be scored (excluded)."""
        ...


def prompt_ids(tok: Any, prompt: str) -> np.ndarray:
    """BOS + prompt characters: the same encoding as the buffer's prompt pool and the warm-up."""
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    if tok.bos_token_id is not None:
        ids = [tok.bos_token_id, *ids]
    return np.asarray(ids, dtype=np.int32)


@dataclass(frozen=True)
class VerifiedTask:
    """Rows {"prompt", "answer", ...} scored by a verifier `verify(completion, answer)`: the
    demos' tasks (laminar/tasks/countup.py, tooluse.py)."""

    prompts: Sequence[HeldOut]
    verify: Callable[[str, Any], float]
    episodes: Episodes | None = None

    @classmethod
    def of_rows(
        cls,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        verify: Callable[[str, Any], float],
        episodes: Episodes | None = None,
    ) -> VerifiedTask:
        prompts = [
            HeldOut(prompt_ids(tokenizer, str(r["prompt"])), str(r["prompt"]), r) for r in rows
        ]
        return cls(prompts, verify, episodes)

    async def score(self, prompt: HeldOut, completion: str) -> float:
        return float(self.verify(completion, prompt.row["answer"]))
