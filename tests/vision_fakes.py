"""An environment that shows the model a screenshot in a later turn, importable by name in node
processes (tests/test_vision_faults.py).

ShotEnv: turn 0's step answers with a screenshot (a disc of the row's colour, drawn
deterministically: every sample of a group shows the same image) and a line of text; turn 1's step
takes `step_s` (a slow tool, so an episode spends most of its life waiting there) and ends the
episode; score 1.0.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from laminar.envs.base import Environment, StepContext, StepResult
from laminar.tasks import colours


def screenshot(colour: str) -> bytes:
    return colours.draw(random.Random(7), colour)


class ShotEnv(Environment):
    def __init__(self, step_s: float = 1.0):
        self.step_s = step_s

    def reset(self, row: dict[str, Any], prompt: str) -> dict[str, Any]:
        return {"colour": str(row["answer"])}

    async def step(self, state: dict[str, Any], ctx: StepContext, model_text: str) -> StepResult:
        if ctx.turn == 0:
            return StepResult(
                observation="screen", role="user", images=[screenshot(state["colour"])]
            )
        if not ctx.replay:
            await asyncio.sleep(self.step_s)  # the slow tool this step stands for
        return StepResult(done=True)

    async def score(self, state: dict[str, Any], ctx: StepContext) -> float:
        return 1.0
