"""Shared data messages: prompts and trajectories (rollout <-> buffer <-> trainer)."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from msgspec import field

from laminar.message import Arr, Message, message

__all__ = [
    "PromptItem",
    "Trajectory",
    "PartialTrajectory",
    "PartialChunk",
    "PartialBatch",
    "ToolRecord",
    "TokenIds",
    "Logprobs",
    "LossMask",
    "Ints",
    "Flags",
    "Routes",
    "newest_version",
]

TokenIds = Annotated[np.ndarray, Arr(("int32", "int64"), ndim=1)]
Logprobs = Annotated[np.ndarray, Arr(("float32",), ndim=1)]
LossMask = Annotated[np.ndarray, Arr(("uint8",), ndim=1)]
"""Per response token: 1 = sampled by the policy (trained), 0 = written by the environment
(tool results, user turns: masked out of the loss, logprob 0.0). None on a message = all 1."""
Ints = Annotated[np.ndarray, Arr(("int32", "int64"), ndim=1)]
"""A column of integers, one per entry (PartialBatch)."""
Flags = Annotated[np.ndarray, Arr(("uint8",), ndim=1)]
"""A column of 0/1 flags, one per entry (PartialBatch)."""
Routes = Annotated[np.ndarray, Arr(("uint8", "int16"), ndim=3)]
"""MoE policies: the top-k expert ids of each position of prompt + response the rollout's engine
ran through the model, (positions, moe_layers, k), the smallest integer type holding the expert
count (models/moe.py). Covers positions 0 .. len-1; the ones after (the last sampled token) have
none."""


class ToolRecord(Message):
    """One tool call of a multi-turn episode (metrics, and what a replay must reproduce)."""

    call_id: str
    """Deterministic: f"{uid}#t{turn}#c{k}#<digest of name+arguments>", so a replay or a retry finds
    the cached result."""
    name: str
    turn: int
    ok: bool = True
    error_kind: str = ""
    """"" | timeout | crash | memory | output_limit | network | bad_call | unknown_tool | ..."""
    seconds: float = 0.0
    cached: bool = False
    """Answered from the tool server's cache (a replay or a retried call), not executed again."""


@message(0x20, senders=("buffer",))
class PromptItem(Message):  # buffer -> rollout: one prompt = one GRPO group of n samples
    uid: str
    """Stable prompt uid (from the dataset row or derived)."""
    group_id: str
    """Unique per serving of the prompt (uid + epoch + serial): the GRPO group key."""
    prompt_ids: TokenIds
    n: int
    prompt: str = ""
    """Prompt text as given to the reward function."""
    row: dict[str, Any] = field(default_factory=dict)
    """Reference answer and extra dataset columns, passed to the reward."""
    image_digests: list[str] = field(default_factory=list)
    """Vision-language prompts: the content digest ("sha256:...") of each image, in the order of
    its placeholders in prompt_ids (empty: a text prompt)."""
    images: list[bytes] = field(default_factory=list)
    """The encoded images themselves (PNG/JPEG bytes, parallel to image_digests): sent once per
    group here, never with a sample; the receiver checks each against its digest."""


@message(0x21, senders=("rollout",), id_fields=("rollout_id",))
class Trajectory(Message):  # rollout -> buffer (finished), buffer -> trainer (in batches)
    uid: str
    """Unique per sample: f"{group_id}/{sample_index}"."""
    group_id: str
    prompt_uid: str
    sample_index: int
    prompt_ids: TokenIds
    response_ids: TokenIds
    logprobs: Logprobs
    """Behaviour logprob of each response token under the sampling distribution."""
    version: int
    """Weight version that generated every token (mode partial: its oldest token's, see
    token_versions)."""
    finish_reason: str = "length"
    """stop | length | abort | error."""
    reward: float | None = None
    """None = excluded from training (reward returned None or failed)."""
    reward_info: dict[str, Any] = field(default_factory=dict)
    """The reward's named components (a dict reward's other keys): logged, never decided on."""
    reward_error: str = ""
    """Why there is no reward: the reward's exception, its timeout, the engine's or the
    environment's error (empty: the reward returned, None included)."""
    reward_error_kind: str = ""
    """exception | format | timeout | worker_died (the reward runner) | env (an episode's
    environment) | agent (an agent episode that failed) | engine (finish_reason error); empty:
    no error. The buffer's warnings
    (laminar/buffer/health.py) branch on it."""
    rollout_id: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    """t_start, t_first_token, t_finish (unix seconds), reward_s, ..."""
    prompt: str = ""
    completion: str = ""
    row: dict[str, Any] = field(default_factory=dict)
    resumed: int = 0
    """How many times this trajectory moved between rollouts (repack / recovery)."""
    staleness_at_finish: int = 0
    loss_mask: LossMask | None = None
    """Multi-turn: 1 per model token, 0 per environment token (None: every token is the model's)."""
    turns: int = 1
    """Model turns in the episode (1 for single-turn)."""
    tool_calls: list[ToolRecord] = field(default_factory=list)
    token_versions: Ints | None = None
    """Mode partial: the weight version that sampled each response token (non-decreasing, first =
    `version`); None: every token at `version`."""
    weights_digest: str = ""
    """Digest of the weights the rollout's engine served at `version`, read back after the load
    (laminar/weights/digest.py); the trainer never trains a trajectory whose digest differs from
    the one it published for that version. Empty: not attested (version 0, sim engines)."""
    image_digests: list[str] = field(default_factory=list)
    """The prompt's images by content digest (PromptItem.image_digests): the trainer gets their
    bytes from the buffer (ImageFetch), never with the trajectory."""
    routes: Routes | None = None
    """MoE policies with model.moe.routing_replay: the expert ids the rollout routed each position
    to (Routes); the trainer replays them. None: dense, replay off, or not recorded."""


@message(0x22, senders=("rollout", "manager", "buffer"))
class PartialTrajectory(
    Message
):  # rollout -> buffer (partial pool), manager <-> rollout (export/import)
    uid: str
    group_id: str
    prompt_uid: str
    sample_index: int
    prompt_ids: TokenIds
    response_ids: TokenIds
    logprobs: Logprobs
    version: int
    n: int = 1
    """Group size of the trajectory's group (so a resumed sample knows its group)."""
    prompt: str = ""
    row: dict[str, Any] = field(default_factory=dict)
    rollout_id: str = ""
    resumed: int = 0
    t_start: float = 0.0
    loss_mask: LossMask | None = None
    """Multi-turn: same length as response_ids (None: all model tokens)."""
    awaiting_env: bool = False
    """Multi-turn: the response ends with a complete model turn whose environment answer is not in
    yet (whoever resumes it runs that step first instead of generating)."""
    token_versions: Ints | None = None
    """Mode partial: version of each response token, as Trajectory.token_versions (None: all at
    `version`)."""
    agent_token: str = ""
    """Black-box agents: the episode's secret token, so the rollout that resumes it (a repack
    move, its rollout died) answers its agent's calls there (laminar/rollout/agents.py)."""
    image_digests: list[str] = field(default_factory=list)
    """The prompt's images by digest: a destination that lacks one fetches it from the buffer
    (ImageFetch) and checks it before resuming."""
    routes: Routes | None = None
    """MoE: the routes recorded so far (as Trajectory.routes), kept by whoever resumes it. On the
    partial pool's headers: None (the routes travel in the entries, like the tokens); a record
    the pool hands back (recovery) carries the routes its entries brought."""


def newest_version(p: PartialTrajectory) -> int:
    """The version of a partial's newest token (mode partial: it may span several)."""
    tv = p.token_versions
    return max(p.version, int(tv.max())) if tv is not None and len(tv) else p.version


@message(0x23, senders=("rollout",), id_fields=("rollout_id",))
class PartialChunk(
    Message
):  # rollout -> buffer: new tokens of an in-flight trajectory (partial pool)
    uid: str
    version: int
    offset: int
    """Index of the first token of this chunk in the response."""
    token_ids: TokenIds
    logprobs: Logprobs
    rollout_id: str = ""
    header: PartialTrajectory | None = None
    """Sent with the first chunk (offset 0): everything needed to resume the trajectory."""
    loss_mask: LossMask | None = None
    """Multi-turn: the chunk's slice of the loss mask (None: all model tokens)."""
    awaiting_env: bool = False
    """Multi-turn: the response up to this chunk's end ends a complete model turn whose environment
    answer is not in yet (the latest chunk reaching the end decides; see PartialTrajectory)."""
    routes: Routes | None = None
    """MoE: routes of positions route_start .. (prompt + response positions, Trajectory.routes)
    the engine recorded since the last chunk (None: none new, or none recorded)."""
    route_start: int = 0


@message(0x24, senders=("rollout",), id_fields=("rollout_id",))
class PartialBatch(
    Message
):  # rollout -> buffer: one flush window of a rollout's partial stream (partial pool)
    """Entry i says what a PartialChunk for uids[i] would: its tokens are
    token_ids[start_i : start_i + lengths[i]] with start_i = sum(lengths[:i]) (likewise logprobs
    and loss_mask), at response offset offsets[i], generated at versions[i]. One message per
    rollout per rollout.partial_flush_s instead of one per sequence per chunk: the buffer's cost
    is per message, and 1024 GPUs stream ~10^6 tokens/s (bench/control_plane.py)."""

    rollout_id: str
    uids: list[str]
    versions: Ints
    offsets: Ints
    """Index of each entry's first token in its response."""
    lengths: Ints
    token_ids: TokenIds
    """Every entry's tokens, concatenated in entry order."""
    logprobs: Logprobs
    awaiting_env: Flags
    """Per entry, as PartialChunk.awaiting_env."""
    loss_mask: LossMask | None = None
    """Multi-turn: concatenated like token_ids (None: every entry is all model tokens)."""
    headers: list[PartialTrajectory] = field(default_factory=list)
    """Headers of the entries that (re)start their record (offset 0), in entry order."""
    token_versions: Ints | None = None
    """Mode partial: the version that sampled each token, concatenated like token_ids (None: every
    entry's tokens at its `versions[i]`, the trajectory's version)."""
    header_at: Ints | None = None
    """Entry index of each header (same length as headers; None when there are none)."""
    routes: Routes | None = None
    """MoE: every entry's new routes, concatenated in entry order (None: no entry has any): entry
    i's are routes[r_i : r_i + route_lengths[i]] with r_i = sum(route_lengths[:i]), of positions
    route_starts[i] .. of its prompt + response (Trajectory.routes; an entry with a header starts
    at 0). Routes lag the tokens by one position (the newest token is not fed yet) and are
    folded by position, apart from the tokens."""
    route_starts: Ints | None = None
    """Per entry, the position of its first route (with `routes`)."""
    route_lengths: Ints | None = None
    """Per entry, how many routes it brings (with `routes`)."""
