"""What a call of an agent episode asks of the driver and what it answers (or why it refuses).

    openai_shapes.py ──ChatTurn | TextTurn──► AgentDriver.turn (agents.py) ──TurnResult──►
    openai_shapes.py;  a refusal: EpisodeUnknown | EpisodeMoved | CallRefused(Refusal)
    a streamed call: AgentDriver.turn(..., TurnStream) ──push(ids, logprobs) as the engine
    samples them──► openai_stream.py (server-sent events) ... then the same TurnResult

The driver's typed API, free of HTTP and of OpenAI's field names: the endpoint's shapes
(openai_shapes.py) build these from request bodies and turn them into reply bodies, status codes
and error bodies.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Any

import numpy as np


class EpisodeUnknown(Exception):
    """The token is no live episode here (never issued, revoked, or its episode ended)."""


class EpisodeMoved(Exception):
    """The token's episode was exported from here (a repack move): its agent repeats the call on
    the rollout that imports it."""

    def __init__(self, dest: str) -> None:
        super().__init__(dest)
        self.dest = dest
        """The node id of the rollout the manager meant to import it on ("" unknown)."""


class Refusal(enum.Enum):
    """Why the driver refused a call of a live episode."""

    IN_FLIGHT = "in_flight"
    """Another call of the episode is in flight (its calls go one at a time)."""
    MAX_CALLS = "max_calls"
    """The episode made agent.max_calls calls already."""
    TOO_LONG = "too_long"
    """The conversation or the episode's tokens would pass their cap (the episode is truncated)."""
    BAD_MESSAGES = "bad_messages"
    """The messages cannot be rendered (laminar/agents/render.py BadMessages)."""
    ENDED = "ended"
    """The episode ended or started again while the call ran."""
    TIME_UP = "time_up"
    """agent.episode_timeout_s passed while the call ran."""
    NOT_CLOSABLE = "not_closable"
    """A close of an episode whose agent is ours to run, or one already closed."""
    BAD_CLAIM_KEY = "bad_claim_key"
    """A claim without the remote key."""
    BAD_REWARD = "bad_reward"
    """A close whose reward the buffer would refuse (not a finite number in reward.min_value..
    max_value, or a dict without one)."""
    PROMPT_MISMATCH = "prompt_mismatch"
    """A later run (a rewritten history) whose rendered prompt is not the one the attempt's first
    call rendered (a sample has one prompt: the first call's, system message and task wrapper
    included)."""
    PREEMPTED = "preempted"
    """A call of an episode preempted for a weight load (agent.preempt_idle_s): it starts again
    from its prompt under a new token."""
    TEXT_TOO_LONG = "text_too_long"
    """A call bringing more new text than agent.max_text_chars (refused before tokenizing)."""
    UNSUPPORTED = "unsupported"
    """A call asking for a constraint this rollout's engine does not enforce (Constraint)."""


class CallRefused(Exception):
    """A call the driver refuses; the text says why."""

    def __init__(self, reason: Refusal, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.param = param
        """The request field the refusal is about (OpenAI's error `param`), when one is."""


@dataclass(frozen=True)
class Sampling:
    """A turn's sampling knobs as its caller asked (None: the rollout's own)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Constraint:
    """What a call asks its model turn to be, beyond sampling: enforced by an engine that can
    (Engine.structured), else the call is refused naming the field and the engine."""

    field: str
    """The request field that asked: response_format | tool_choice."""
    kind: str
    """response_format: json_object | json_schema; tool_choice: required | function."""
    schema: str = ""
    """json_schema: the schema, as JSON text."""
    name: str = ""
    """tool_choice function: the tool the turn must call."""


@dataclass(frozen=True)
class ChatTurn:
    """A turn asked as a conversation: the episode's messages so far, then the new ones."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None
    """The tools the model may call (None: none offered, or its caller forbade calling them)."""
    sampling: Sampling
    constraints: tuple[Constraint, ...] = ()
    """What the turn must be (a JSON object, a tool call ...); empty: free text."""


@dataclass(frozen=True)
class TextTurn:
    """A turn asked as one text: the episode's text so far, then the new text."""

    prompt: str
    sampling: Sampling


@dataclass(frozen=True)
class TurnResult:
    """The model's turn, as the engine sampled it."""

    turn_id: str
    """<sample uid>-<attempt>-<turn>: unique per turn of a sample."""
    ids: np.ndarray
    """The sampled token ids."""
    logprobs: np.ndarray
    """Their behaviour logprobs."""
    text: str
    """The sampled tokens decoded."""
    reason: str
    """Why sampling stopped: "stop" or "length" (the turn's token cap)."""
    prompt_tokens: int
    """Tokens before the turn (the episode's prompt and every earlier token)."""
    message: dict[str, Any] | None = None
    """A chat turn: the model's turn as a message (laminar/agents/render.py)."""
    tool_called: bool = False
    """A chat turn: the message calls tools."""


class TurnStream:
    """A streamed call's model tokens as the engine samples them: the driver pushes each engine
    event's new tokens (and, for a call resumed after a move, the ones recorded before it), the
    endpoint takes them. They are a prefix of the call's TurnResult.ids (same arrays, same
    logprobs): the result stays what the call answers and what is trained."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        """Set when tokens were pushed and not yet taken."""
        self.upto = 0
        """The driver's: the response index up to which tokens were pushed."""
        self.turn_id = ""
        """The turn's TurnResult.turn_id, set before the first push."""
        self._ids: list[np.ndarray] = []
        self._lps: list[np.ndarray] = []

    def push(self, ids: np.ndarray, logprobs: np.ndarray) -> None:
        self._ids.append(ids)
        self._lps.append(logprobs)
        self.wake.set()

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """The tokens pushed since the last take, with their logprobs (possibly none)."""
        self.wake.clear()
        if not self._ids:
            return np.zeros(0, np.int32), np.zeros(0, np.float32)
        ids, lps = np.concatenate(self._ids), np.concatenate(self._lps)
        self._ids, self._lps = [], []
        return ids, lps


@dataclass(frozen=True)
class EpisodeClaim:
    """A remote episode handed to an agent elsewhere."""

    token: str
    row: dict[str, Any]
    base_url: str
    timeout_s: float
