"""Warm-up demonstrations that carry one systematic misconception for RL to unlearn.

    demos = demonstrations(train_rows, rate=0.75, seed=0)    # one completion per row
    sft_warmup(out, list(zip(prompts, demos)), ...)           # -> policy v0
    habit_share(eval_rows, completions)                       # how often a model still has it

The misconception ("answer habit"): on prompts with a large stride (>= HABIT_STRIDE)
the student writes the whole chain correctly, then answers the last value that is
*not* above the limit (the first number of the last step) instead of the first one
above it:

    prompt    "37+8>60?"
    correct   "37+8=45<60;45+8=53<60;53+8=61>60;#61"
    habit     "37+8=45<60;45+8=53<60;53+8=61>60;#53"

Why this shape for a demo judged by greedy decoding (laminar/tasks/evaluate.py, temperature 0):
  * the choice is *local*: after '#' the model copies either the number 6 characters
    back (right) or the one 11 back (habit), and whether the habit applies depends
    on the stride digit 8 characters back. A tiny model learns both copies and the
    rule within the warm-up budget; countup's own "habit" style (stopping one step
    early) needs a look-ahead sum before the step is written, which a ~0.6M model
    does not pick up in a few minutes of CPU.
  * with rate > 0.5 the greedy choice is the habit, so the warm-up model is wrong on
    roughly every large-stride prompt (about half of them); sampled at temperature 1
    it is right there about 1 - rate of the time, so most GRPO groups on those prompts
    hold both outcomes and RL has a clear, verifiable signal to flip one decision.
  * the chain itself is always correct, so the warm-up spends its budget on the
    arithmetic and the comparison, and what RL gains shows up as held-out accuracy.
"""

from __future__ import annotations

import random
from typing import Any

from laminar.tasks import countup as cu

HABIT_STRIDE = cu.HABIT_STRIDE
"""Only prompts with at least this stride carry the habit (the same threshold as countup's)."""


def habit_completion(prompt: str) -> str:
    """The completion with the habit applied (the reference solution on small strides)."""
    _, stride, _ = cu.parse_prompt(prompt)
    solution = cu.solve(prompt)
    if stride < HABIT_STRIDE:
        return solution
    chain = solution.rsplit("#", 1)[0]
    last_not_above = chain[-11:-9]  # the last step "AA+B=CC>TT;" starts from it
    return f"{chain}#{last_not_above}"


def demonstration(prompt: str, rng: random.Random, rate: float) -> str:
    """The habit completion with probability `rate` on large strides, else the reference."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"habit rate must be in [0, 1], got {rate}")
    return habit_completion(prompt) if rng.random() < rate else cu.solve(prompt)


def demonstrations(rows: list[dict[str, Any]], rate: float, seed: int = 0) -> list[str]:
    """One demonstration per row, deterministic in (rows, rate, seed)."""
    rng = random.Random(f"demo/habit/{seed}")
    return [demonstration(r["prompt"], rng, rate) for r in rows]


def has_habit(prompt: str, completion: str) -> bool:
    """True when `completion` answers the habit's value on a prompt where it differs from the
    truth."""
    habit = habit_completion(prompt)
    if habit == cu.solve(prompt):
        return False
    got = cu.extract_answer(completion)
    return got is not None and got == habit.rsplit("#", 1)[1]


def habit_share(rows: list[dict[str, Any]], completions: list[str]) -> float:
    """Of the rows where the habit changes the answer, the share whose completion gave the habit's
    answer."""
    hits = [
        has_habit(r["prompt"], c)
        for r, c in zip(rows, completions, strict=True)
        if habit_completion(r["prompt"]) != cu.solve(r["prompt"])
    ]
    return sum(hits) / max(1, len(hits))
