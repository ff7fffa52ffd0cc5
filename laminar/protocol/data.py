"""Shared data messages: prompts and trajectories (rollout <-> buffer <-> trainer)."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from msgspec import field

from laminar.transport.codec import Arr, Message, message

__all__ = ["PromptItem", "Trajectory", "PartialTrajectory", "PartialChunk", "TokenIds", "Logprobs"]

TokenIds = Annotated[np.ndarray, Arr(("int32", "int64"), ndim=1)]
Logprobs = Annotated[np.ndarray, Arr(("float32",), ndim=1)]


@message(0x20)
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


@message(0x21)
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
    """Weight version that generated every token."""
    finish_reason: str = "length"
    """stop | length | abort | error."""
    reward: float | None = None
    """None = excluded from training (reward returned None or failed)."""
    reward_info: dict[str, Any] = field(default_factory=dict)
    rollout_id: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    """t_start, t_first_token, t_finish (unix seconds), reward_s, ..."""
    prompt: str = ""
    completion: str = ""
    row: dict[str, Any] = field(default_factory=dict)
    resumed: int = 0
    """How many times this trajectory moved between rollouts (repack / recovery)."""
    staleness_at_finish: int = 0


@message(0x22)
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


@message(0x23)
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
