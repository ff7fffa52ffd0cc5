"""The demo's RL reward: count-up's verifier, credited only for a well-formed completion.

    reward.fn: laminar.demo.reward:strict          # configs/demo.yaml
    strict(prompt, completion, answer=...) -> {"reward": 1.0 | 0.0, "correct": ..., "format": ...}

Why not `countup:reward` as is: its verifier reads the answer after the first '#'
and ignores the rest, so "…;#61+8=69<…" (the right answer, then more steps until
max_tokens) scores 1. In the first demo runs the policy drifted into such
run-ons during RL: responses grew several-fold, generation and training slowed,
and the long tail they made was an artefact, not the task's. Requiring the
completion to be exactly the chain then '#N' (countup.well_formed) keeps the
reward verifiable and closes that gap. Held-out accuracy is still scored by the
plain verifier (countup.verify), so the demo's before/after figures are not
flattered by this choice.
"""

from __future__ import annotations

from typing import Any

from laminar.tasks import countup as cu


def strict(prompt: str, completion: str, **row: Any) -> dict[str, float] | None:
    """1.0 for the right answer in a well-formed completion; components logged beside it."""
    parts = cu.reward(prompt, completion, **row)
    if parts is None:  # no reference answer: the row is excluded, as with countup:reward
        return None
    correct, fmt = parts["reward"], parts["format"]
    return {"reward": float(correct > 0 and fmt > 0), "correct": correct, "format": fmt}
