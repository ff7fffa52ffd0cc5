"""Who may send what: a rollout's samples come back only from it, and only in range.

    owners = Owners(state)                       # the ExperienceState the ledger keeps
    ledger.record(SamplesMoved("rollout-2", ["g/3"]))   # SamplesPlaced from the manager
    owners.refusal("g", 3, "rollout-1")          # None: rollout-1 may send sample 3 of group g
    owners.prompt_refusal("g", uid, prompt_ids)  # None: the prompt its group was served with
                                                 # (agent runs: the group's row, any rendering)
    limits = SampleLimits(reward_min=-10, reward_max=10, vocab=32000, max_response_tokens=256)
    limits.refusal(t)                            # None, or why the trajectory can never be taken
    refusals = Refusals(metrics, log); refusals.count("rollout-1", "not_owner")

A sample (group_id, sample_index) comes back with the prompt its group was served with (the
same prompt uid and token ids; prompt_refusal), and may be sent by the rollout its group was
served to (or served to before: a lease that ran out serves it again, and either copy may
finish first), or, once the manager moved it (a repack move, a dead rollout's recovery:
SamplesPlaced, sent before the ImportRequest), by the rollout it was placed on alone: the source
exported it or died. The sender is the authenticated peer the transport names, never a field of
the body.

Black-box agent runs (`Owners(state, agent_prompts=True)`, agent.fn or agent.remote set): a
sample's prompt is what its agent's first call rendered (a system message, the task in the
agent's own words: laminar/rollout/agent_calls.py), recorded by the rollout that served the call, so
its tokens are not compared with the dataset's rendering; the sample is bound to its group by
identity instead: the group's prompt uid (the row), its group id and sample index, and the
sender's ownership above, exactly as strict. Its length is bounded by SampleLimits
(data.max_prompt_tokens) and its ids by the vocabulary. The samples of one group may then hold
different prompts; the advantage baseline still compares the rewards of the row's episodes.

Placements are journaled (a SamplesMoved record, written to the OS before the manager is
acked, so they survive a kill -9 of the buffer) and kept in ExperienceState.placed for
unfinished samples of open groups only: an entry goes when its sample finishes or is
abandoned, its group leaves the open state, or a lease that ran out serves the group to a new
holder (who then runs every sample).

Limits (SampleLimits, from the config by the node): a reward must be finite and within
reward.min_value..max_value (the reward function's documented range; None, "no reward", stays
allowed and makes the sample unusable), every token id (prompt and response) in [0, vocab),
and a response no longer than max_response_tokens. A refused trajectory is acked with the
reason (TrajectoryAck.refused) so its sender stops resending it, counted per peer and
reason, and never stored: it is not journaled, not trained.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import structlog

from laminar.buffer.experience import ExperienceState
from laminar.logs import RateLimitedLog
from laminar.metrics import Metrics
from laminar.models.moe import MoeShape
from laminar.protocol.buffer import Refusal
from laminar.protocol.data import Trajectory

__all__ = ["Owners", "Refusals", "SampleLimits", "ids_out_of_range"]


class Owners:
    """Who may send a sample, read off the experience state (holders, former holders,
    placements); changes only through the ledger's records."""

    def __init__(self, state: ExperienceState, *, agent_prompts: bool = False):
        self.state = state
        self.agent_prompts = agent_prompts
        """The run's samples are agent episodes: a prompt is bound by its uid, not its tokens."""

    def refusal(self, group_id: str, index: int, sender: str) -> Refusal | None:
        """Why `sender` may not send sample `index` of `group_id` (None: it may)."""
        dest = self.state.placed.get(f"{group_id}/{index}")
        if dest is not None:
            return None if dest == sender else "not_owner"
        g = self.state.groups.get(group_id)
        if g is None:
            # a closed group's late member changes nothing (the state says "late"); one never
            # served to anyone is a forgery
            return None if group_id in self.state.closed else "not_served"
        if g.rollout_id == sender or sender in g.former:
            return None
        return "not_owner"

    def prompt_refusal(
        self, group_id: str, prompt_uid: str, prompt_ids: np.ndarray
    ) -> Refusal | None:
        """Is the sample's prompt the one its group was served with? (None: it is, or the group
        is not open here: refusal() and the state's late/duplicate rules decide those.) In an
        agent run only its row (prompt uid) must be the group's: its tokens are what its agent
        rendered."""
        g = self.state.groups.get(group_id)
        if g is None or g.item is None:
            return None
        if prompt_uid != g.prompt_uid:
            return "prompt_mismatch"
        if self.agent_prompts:
            return None
        served = g.item.prompt_ids
        if len(prompt_ids) != len(served):
            return "prompt_mismatch"
        # per sample: the bytes compared when the types agree (np.array_equal costs ~10x more)
        same = (
            prompt_ids.tobytes() == served.tobytes()
            if prompt_ids.dtype == served.dtype
            else np.array_equal(prompt_ids, served)
        )
        return None if same else "prompt_mismatch"


def ids_out_of_range(ids: np.ndarray, vocab: int | None) -> bool:
    """Does a token id lie outside [0, vocab)? One pass: read as unsigned, a negative id is huge."""
    if vocab is None or not len(ids):
        return False
    if ids.dtype.kind == "i":
        ids = ids.view(f"u{ids.dtype.itemsize}")
    return int(ids.max()) >= vocab


@dataclass(frozen=True)
class SampleLimits:
    reward_min: float = -math.inf
    reward_max: float = math.inf
    vocab: int | None = None
    """Token ids lie in [0, vocab); None: the vocabulary is unknown and ids are not checked."""
    max_response_tokens: int | None = None
    """Longest response a rollout can make (None: not checked)."""
    max_prompt_tokens: int | None = None
    """Longest prompt a sample may carry: agent runs, whose prompts their agents render
    (data.max_prompt_tokens); None: not checked (a served prompt is compared token by token)."""

    def prompt_too_long(self, prompt_ids: np.ndarray) -> bool:
        return self.max_prompt_tokens is not None and len(prompt_ids) > self.max_prompt_tokens

    moe: MoeShape | None = None
    """The policy's MoE shape: a trajectory's routes must fit it (None: dense or unknown; routes
    are then only checked for length)."""

    def refusal(self, t: Trajectory) -> Refusal | None:
        r = t.reward
        if r is not None and not (math.isfinite(r) and self.reward_min <= r <= self.reward_max):
            return "reward_range"
        if ids_out_of_range(t.prompt_ids, self.vocab) or ids_out_of_range(
            t.response_ids, self.vocab
        ):
            return "token_range"
        if self.max_response_tokens is not None and len(t.response_ids) > self.max_response_tokens:
            return "too_long"
        if self.prompt_too_long(t.prompt_ids):
            return "too_long"
        if t.routes is not None and self.moe is not None:
            if self.moe.check(t.routes, len(t.prompt_ids) + len(t.response_ids)) is not None:
                return "bad_routes"
        return None


class Refusals:
    """Refused samples and partial entries per peer and reason (BufferStats.refused)."""

    def __init__(self, metrics: Metrics, log: structlog.typing.FilteringBoundLogger):
        self.metrics = metrics
        self.by_peer: defaultdict[str, Counter[str]] = defaultdict(Counter)
        # a hostile peer sends thousands: the first few in full, then a counted summary
        self._log = RateLimitedLog(log, "sample_refused")

    def count(self, peer: str, reason: str, k: int = 1, **detail: object) -> None:
        if k <= 0:
            return
        self.by_peer[peer][reason] += k
        self.metrics.count(f"refused_{reason}", k)
        self._log.warning(peer=peer, reason=reason, count=k, **detail)

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.by_peer.values())

    def figures(self) -> dict[str, dict[str, int]]:
        return {peer: dict(c) for peer, c in self.by_peer.items()}
