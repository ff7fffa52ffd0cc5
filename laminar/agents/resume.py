"""A moved episode's repeated call, matched against the tokens recorded before the move.

    got = match_record(render, uid, prompt_ids, ids, mask, messages, tools, tools_on)
    # Resumed(calls, new, keep, turn, after_eot), or None: the call does not match the record

The rollout that imports an agent episode (a repack move, or its rollout died) holds the
episode's recorded tokens but not the messages they came from. The agent's next call repeats
the call in flight at the move (its model turn recorded in part, or whole) or is the next one;
its messages must account for exactly the recorded tokens:

    prompt       first_ids(the messages before the run's first assistant answer, tools)
    model run j  decodes to the assistant message the agent echoes as answer j (`canonical`)
    non-model    delta_ids(the messages between answer j and answer j+1), image placeholders
                 expanded as the processor does (`expand`, vision-language models)
    the rest     the call's own new messages (recorded, or still to append), then the call's
                 model turn (recorded in part or whole, or not started)

The model's tokens are never re-tokenized (token in, token out): they are decoded and compared
as messages; only the agent's messages are rendered. Which recorded model runs are answers the
agent holds is not written anywhere, so both readings are tried: every run answered, or the last
run is the call's own turn. Used by laminar/rollout/agent_calls.py `_resume`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laminar.agents.render import BadMessages, ChatRenderer, canonical, image_urls
from laminar.envs.replay import Segment, split_segments


@dataclass(frozen=True)
class Resumed:
    calls: int
    """Calls answered before the move (their tokens are kept as recorded)."""
    new: list[int]
    """Tokens of the call's new messages still to append (empty: recorded already)."""
    keep: int | None
    """Response index where the call's model turn began, when the record holds it (in part, or
    whole); None: it starts after `new`."""
    turn: int
    """The episode's turn counter before the call's tokens go in (as if its calls ran here)."""
    after_eot: bool
    """The last answered model run ended on the end-of-turn token."""
    new_images: list[str] = field(default_factory=list)
    """The image URLs `new` shows (vision-language models): still to be sent to their owner."""


Expand = Callable[[list[int], list[dict[str, Any]]], list[int]]
"""Messages' rendered tokens -> their image placeholders expanded as the processor does (what the
record holds); raises ValueError on a bad image."""


def match_record(
    render: ChatRenderer,
    uid: str,
    prompt_ids: np.ndarray,
    ids: np.ndarray,
    mask: np.ndarray,
    messages: list[dict[str, Any]],
    tools: list[Any] | None,
    tools_on: bool,
    expand: Expand | None = None,
) -> Resumed | None:
    """`expand`: a vision-language model's placeholder expansion (None: text only)."""
    segs = split_segments(ids, mask)
    if not segs or segs[0].kind != "model":
        return None
    n_model = sum(1 for g in segs if g.kind == "model")
    answers = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    for done in (n_model, n_model - 1):  # every run answered, or the last is the call's own
        if done < 0 or done > len(answers) or (done < n_model and segs[-1].kind != "model"):
            continue
        try:
            got = _match(
                render, uid, prompt_ids, ids, segs, messages, tools, tools_on, done, expand
            )
        except (BadMessages, ValueError):
            got = None
        if got is not None:
            return got
    return None


def _match(
    render: ChatRenderer,
    uid: str,
    prompt_ids: np.ndarray,
    ids: np.ndarray,
    segs: list[Segment],
    messages: list[dict[str, Any]],
    tools: list[Any] | None,
    tools_on: bool,
    done: int,
    expand: Expand | None,
) -> Resumed | None:
    answers = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    mine = answers[len(answers) - done :]  # this run's answers, in call order
    first = messages[: mine[0]] if mine else messages
    if render.first_ids(first, tools) != prompt_ids.tolist():
        return None
    after_eot, turn, k = False, 0, 0  # k: the next recorded segment (they alternate)
    for j, at in enumerate(mine):
        run = ids[segs[k].start : segs[k].end].tolist()
        msg, _ = render.assistant_message(render.decode(run), tools_on, uid, turn)
        if canonical(msg) != canonical(messages[at]):
            return None
        after_eot = render.turns.ended_with_eot(run)
        k += 1
        upto = mine[j + 1] if j + 1 < len(mine) else len(messages)
        between = messages[at + 1 : upto]
        delta = render.delta_ids(between, after_eot)
        if expand is not None:
            delta = expand(delta, between)
        if k == len(segs):  # the record ends with the last answer: the call's messages go next
            return Resumed(done, delta, None, turn, after_eot, image_urls(between))
        g = segs[k]
        if g.kind != "env" or ids[g.start : g.end].tolist() != delta:
            return None
        k += 1
        turn += 1
    if k == len(segs):  # the call's messages recorded, no model token yet
        return Resumed(done, [], len(ids), turn, after_eot)
    if k + 1 != len(segs):
        return None
    return Resumed(done, [], segs[k].start, turn, after_eot)  # its turn recorded, in part or whole
