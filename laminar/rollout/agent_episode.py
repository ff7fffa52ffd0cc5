"""An agent episode's state: what its lifecycle and its calls share.

    agents.py (AgentDriver: start, adopt, retry, preempt, release, finish) ──writes──►
        AgentEpisode (one per sample: its SeqState, token, attempt, run) in an EpisodeIndex
        (by uid, by token; the tokens of episodes exported from here)
    agent_calls.py (AgentCalls: one call of an episode) ──reads the index (is its episode still
        current after its model turn? where did an exported one go?), reads and writes the
        episode's run (consumed messages, calls, truncated)

`clear_episode` takes an episode back to its prompt with no tokens: a new attempt (agents.py)
or a new run whose history does not extend the old one (agent_calls.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laminar.rollout.sequences import SequenceTable
from laminar.rollout.tracking import Growable, SeqState


@dataclass
class AgentEpisode:
    """One sample's episode: its sequence, the attempt's token and the run its calls built."""

    seq: SeqState
    token: str
    first_prompt: np.ndarray
    """The prompt ids the sample reverts to when it starts again (served: the row's rendering;
    moved here: the prompt its record holds)."""
    attempt: int = 0
    prompt_fixed: bool = False
    """The attempt's first call rendered `seq.prompt_ids`: a later run (a rewritten history, a
    resume that does not match) must render to exactly it (False: the next call's rendering,
    whatever it holds, becomes the sample's prompt)."""
    consumed: list[str] | None = None
    """Canonical messages the episode's tokens hold (None: no call yet in this run)."""
    text: str | None = None
    """Text turns: the text the episode's tokens hold (prompt + completions)."""
    tools_key: str = ""
    after_eot: bool = False
    calls: int = 0
    busy: bool = False
    truncated: bool = False
    pending: asyncio.Future[str] | None = None
    outcome: asyncio.Future[tuple[bool, Any]] | None = None
    """Remote agents and moved episodes: (ok, reward or error text), set by the close call."""
    t_attempt: float = field(default_factory=time.monotonic)
    recorded: bool = False
    """Moved here with tokens its agent's next call must be matched against (`_resume`)."""
    touched: bool = False
    """Its agent called or closed it on this rollout since it moved here."""
    t_seen: float | None = None
    """When its agent last claimed, called or closed it (None: not yet): past
    agent.idle_timeout_s of silence the attempt fails (`_await_agent`)."""


def clear_episode(ep: AgentEpisode, table: SequenceTable) -> None:
    """Back to `first_prompt` with no tokens; the partial record restarts at offset 0."""
    seq = ep.seq
    seq.ids, seq.logprobs = Growable(np.int32), Growable(np.float32)
    seq.mask = Growable(np.uint8)
    seq.routes = None  # a new attempt: its prefill records them again
    seq.prompt_ids = ep.first_prompt.copy()
    seq.image_digests = []  # the agent's images came with its calls: gone with their tokens
    seq.sent_upto, seq.turn, seq.turn_start, seq.awaiting_env = 0, 0, 0, False
    seq.tool_calls = []
    ep.consumed, ep.text, ep.tools_key = None, None, ""
    ep.after_eot, ep.calls, ep.truncated, ep.recorded = False, 0, False, False
    table.mark_dirty(seq.uid)


@dataclass
class EpisodeIndex:
    """The rollout's live agent episodes and the tokens of those exported from here. The
    lifecycle (agents.py) writes it; a call reads it: whether its episode is still the one its
    token named after its model turn (`current`), and where an exported one went."""

    by_uid: dict[str, AgentEpisode] = field(default_factory=dict)
    by_token: dict[str, AgentEpisode] = field(default_factory=dict)
    moved: dict[str, tuple[float, str]] = field(default_factory=dict)
    """Tokens of episodes exported from here (their calls answer 421 episode_moved), with
    when and the rollout the manager meant to import them on ("" unknown); forgotten after
    agent.reconnect_timeout_s."""

    def current(self, ep: AgentEpisode, token: str) -> bool:
        return self.by_token.get(token) is ep and self.by_uid.get(ep.seq.uid) is ep
