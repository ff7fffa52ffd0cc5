"""Deterministic replay: rebuild an episode's environment state from its recorded tokens.

    # segs: [Segment("model", 0, 12), Segment("env", 12, 30), ...]
    segs = split_segments(response_ids, loss_mask)
    rep = await replay(env, row, prompt, response_ids, loss_mask, template, ctx_for_turn)
    rep.state, rep.turns_done, rep.tool_calls, rep.tool_records, rep.mismatches,
    rep.last_turn_complete

Why replay (and not environment workers): a trajectory in the partial pool already holds
every token and its loss mask, so any rollout can rebuild the episode with no extra
stateful service to keep alive. Model runs (mask 1) are the model's turns; each env run
(mask 0) is the observation that answered the model run before it.

`replay` calls `env.reset(row, prompt)`, then `env.step(state, ctx, text)` for every model
run that an env run follows, where `text` is the run's decoded text and
`ctx = ctx_for_turn(turn, tool_calls_so_far)` (forced to replay=True; its tools should be
the tools node's client, whose cache answers each call id that already ran instead of
running it again). The observation each replayed step gives is rendered by the turn
template and compared with the recorded env tokens: a difference (or a step that says
done) counts one mismatch (the rollout reports `replay_mismatch`); the recorded tokens
always win, the trajectory is never rewritten.

The last run decides what the importer does next:
  * an env run: the model's next turn has not started; generate.
  * a model run with `last_turn_complete` (it ended on EOS / the end-of-turn token or one
    of env.stop): its step has not run (or its result was lost); run it now. Its tool
    calls carry the same deterministic ids, so a call that already ran is answered from
    the cache, never run twice.
  * a model run without it: the turn was cut mid-generation; resume generating it.

Limits: a step that answered nothing and did not end the episode leaves no env run, so
the model runs on both sides of it read as one turn; a step that timed out on the
original rollout answered with the rollout's timeout text, which replay cannot
reproduce (one mismatch, the recorded tokens stand). Errors raised by env.step
propagate, and a step past ctx.timeout_s raises TimeoutError: the caller decides.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from laminar.envs.base import Environment, StepContext, StepResult
from laminar.envs.template import TurnTemplate
from laminar.protocol.data import ToolRecord


@dataclass(frozen=True)
class Segment:
    kind: Literal["model", "env"]
    start: int
    end: int
    """Half-open range of response token positions."""


def split_segments(
    response_ids: Sequence[int] | np.ndarray, loss_mask: Sequence[int] | np.ndarray | None
) -> list[Segment]:
    """The response split into runs by loss mask (1 = model, 0 = env); None mask = all model."""
    n = len(response_ids)
    if n == 0:
        return []
    if loss_mask is None:
        return [Segment("model", 0, n)]
    mask = np.asarray(loss_mask)
    if len(mask) != n:
        raise ValueError(f"loss mask has {len(mask)} entries for {n} response tokens")
    model = mask != 0
    cuts = np.flatnonzero(model[1:] != model[:-1]) + 1
    bounds = [0, *cuts.tolist(), n]
    return [
        Segment("model" if model[a] else "env", a, b)
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


@dataclass
class Replayed:
    state: Any
    turns_done: int = 0
    """Steps replayed (= model turns whose observation is in the record)."""
    tool_calls: int = 0
    """Tool calls the replayed steps made (ctx.tool_calls_so_far for the next step)."""
    tool_records: list[ToolRecord] = field(default_factory=list)
    mismatches: int = 0
    """Replayed observations that differ from the recorded env tokens (the record wins)."""
    last_turn_complete: bool = False
    """The record ends with a model run that ended its turn: its step still has to run."""


async def replay(
    env: Environment,
    row: dict[str, Any],
    prompt: str,
    response_ids: Sequence[int] | np.ndarray,
    loss_mask: Sequence[int] | np.ndarray | None,
    template: TurnTemplate,
    ctx_for_turn: Callable[[int, int], StepContext],
    observe: Callable[[StepResult, list[int]], list[int]] | None = None,
) -> Replayed:
    """Rebuild the episode's state from its recorded response (see the module docstring).
    `observe(result, model_ids)`: a step's observation tokens as the rollout renders them (images
    expanded); None: the template's rendering of its text."""
    ids = [int(i) for i in response_ids]
    segs = split_segments(ids, loss_mask)
    out = Replayed(state=env.reset(row, prompt))
    turn = 0
    for i, seg in enumerate(segs):
        if seg.kind == "env":
            if i == 0:  # an observation before any model turn: nothing this API could have made
                out.mismatches += 1
            continue
        model_ids = ids[seg.start : seg.end]
        if i + 1 == len(segs):
            out.last_turn_complete = template.ends_turn(model_ids, env.stop)
            break
        recorded = ids[segs[i + 1].start : segs[i + 1].end]
        ctx = ctx_for_turn(turn, out.tool_calls)
        ctx.replay = True
        res = await asyncio.wait_for(
            env.step(out.state, ctx, template.decode(model_ids)), timeout=ctx.timeout_s
        )
        if observe is not None:
            got = observe(res, model_ids)
        elif res.observation_ids is not None:
            got = [int(x) for x in res.observation_ids]
        elif res.observation is not None:
            got = template.observation_ids(
                res.observation, res.role, after_eot=template.ended_with_eot(model_ids)
            )
        else:
            got = []
        if res.done or got != recorded:
            out.mismatches += 1
        out.tool_calls += len(res.tool_results)
        out.tool_records += [r.record(turn) for r in res.tool_results]
        out.turns_done += 1
        turn += 1
    return out
