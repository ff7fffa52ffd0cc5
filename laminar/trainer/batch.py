"""From buffer trajectories to the trainer's batch of validated samples.

    list[Trajectory] ──TrainBatch.build (validate, count drops)──► samples + rewards + groups
        ──trainer/packing.py──► index lists of micro-batches
        ──trainer/micro_batch.py collate──► MicroBatch tensors (the next-token frame)

A trajectory that cannot be trained on (no reward, logprobs not matching the
response, empty, too long, token ids outside the vocabulary) is dropped and
counted by reason, never raised: bad data must not stop the trainer.

Groups after drops: a group keeps its surviving members and their baseline is the
survivors' mean (a dropped member's reward is unknown, so it cannot be part of the
baseline; the buffer's lost_member_policy decides earlier whether partial groups are
released at all). A group that drops leave with ONE member is dropped whole (counted as
`singleton_group`): it has no baseline, its advantage is 0 under every estimator
(algo/advantages.py), so it would add no gradient, only its tokens to the token_mean
denominator, diluting every other sample's weight. A group that arrives with one member
(group_size 1, or a partial group the buffer released) is kept as it is.

Multi-turn: a sample's prompt_ids + response_ids are exactly the ids the rollout delivered
(the sampled ids and the environment's ids, in order; nothing is re-encoded here) and its loss
mask marks the environment's: collate (trainer/micro_batch.py) makes them no target of the loss,
and every count the loss divides by (TrainBatch.n_tokens, the per-sequence |y_i|,
Sample.n_model) counts model tokens only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from laminar.algo.advantages import group_index
from laminar.protocol.data import ToolRecord, Trajectory


@dataclass
class Sample:
    uid: str
    group_id: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behav_logp: np.ndarray
    reward: float
    version: int
    loss_mask: np.ndarray | None = None
    """bool per response token (False = environment token); None = all model tokens."""
    turns: int = 1
    tool_calls: list[ToolRecord] = field(default_factory=list)
    token_versions: np.ndarray | None = None
    """Mode partial: the version that sampled each response token (None: all at `version`)."""
    images: tuple[bytes, ...] = ()
    """Vision-language models: the prompt's encoded images (fetched by digest, checked)."""
    routes: np.ndarray | None = None
    """MoE: the rollout's expert ids per position of prompt + response (Trajectory.routes), which
    the trainer's forward replays (model.moe.routing_replay); None: route live."""

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def n_model(self) -> int:
        """Response tokens the policy sampled (the trained ones)."""
        return len(self.response_ids) if self.loss_mask is None else int(self.loss_mask.sum())


@dataclass
class TrainBatch:
    samples: list[Sample]
    rewards: torch.Tensor
    """[B] float32."""
    groups: torch.Tensor
    """[B] dense group ids."""
    dropped: Counter = field(default_factory=Counter)
    source: list[Trajectory] = field(default_factory=list)
    """The trajectories it was built from (what rank 0 sends the other ranks to rebuild it)."""
    images: dict[str, bytes] = field(default_factory=dict)
    """Vision-language models: the images of `source` by digest (sent along with it)."""

    @property
    def n_seqs(self) -> int:
        return len(self.samples)

    @property
    def n_tokens(self) -> int:
        """Trained tokens: model-written response tokens (environment tokens excluded)."""
        return sum(s.n_model for s in self.samples)

    @property
    def n_response_tokens(self) -> int:
        """Every response token, the environment's included."""
        return sum(len(s.response_ids) for s in self.samples)

    @property
    def total_tokens(self) -> int:
        """Prompt + response tokens (what the forward pass processes)."""
        return sum(s.length for s in self.samples)

    @classmethod
    def build(
        cls,
        trajs: list[Trajectory],
        vocab_size: int | None = None,
        max_len: int | None = None,
        images: Mapping[str, bytes] | None = None,
        placeholder_id: int | None = None,
        image_tokens: Mapping[str, int] | None = None,
    ) -> TrainBatch:
        """`images`: the batch's images by digest (vision-language models); a trajectory whose
        image is not among them is dropped ("image_missing"). `placeholder_id`: the image
        placeholder token, which the model's own tokens must not hold: HF's forward would read
        it as an image slot ("placeholder_in_response"). An environment's tokens (loss mask 0)
        hold the placeholders of the images later turns showed, one per image token, with the
        images' digests after the prompt's (laminar/vision/turns.py). `image_tokens`: each image's
        placeholder run as the processor expands it, by digest; a trajectory whose placeholder
        tokens do not add up to its images' runs is dropped ("image_tokens_mismatch"): HF's
        forward would raise on it and stop the step for every other row."""
        samples: list[Sample] = []
        dropped: Counter = Counter()
        have = images or {}
        for t in trajs:
            reason = _reject_reason(t, vocab_size, max_len)
            if not reason and any(d not in have for d in t.image_digests):
                reason = "image_missing"
            if (
                not reason
                and placeholder_id is not None
                and _sampled_placeholder(t, placeholder_id)
            ):
                reason = "placeholder_in_response"
            if (
                not reason
                and placeholder_id is not None
                and image_tokens is not None
                and _placeholder_count(t, placeholder_id)
                != sum(image_tokens.get(d, -1) for d in t.image_digests)
            ):
                reason = "image_tokens_mismatch"
            if reason or t.reward is None:
                dropped[reason] += 1
                continue
            samples.append(
                Sample(
                    uid=t.uid,
                    group_id=t.group_id,
                    version=int(t.version),
                    reward=float(t.reward),
                    prompt_ids=np.array(t.prompt_ids, dtype=np.int64),
                    response_ids=np.array(t.response_ids, dtype=np.int64),
                    behav_logp=np.array(t.logprobs, dtype=np.float32),
                    loss_mask=None if t.loss_mask is None else np.asarray(t.loss_mask) == 1,
                    turns=int(t.turns),
                    tool_calls=list(t.tool_calls),
                    token_versions=None
                    if t.token_versions is None
                    else np.asarray(t.token_versions, np.int64),
                    images=tuple(have[d] for d in t.image_digests),
                    routes=t.routes,
                )
            )
        arrived = Counter(t.group_id for t in trajs)
        kept = Counter(s.group_id for s in samples)
        lone = {g for g, n in kept.items() if n == 1 and arrived[g] > 1}
        if lone:
            samples = [s for s in samples if s.group_id not in lone]
            dropped["singleton_group"] += len(lone)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        groups = group_index([s.group_id for s in samples])
        used = {d: have[d] for t in trajs for d in t.image_digests if d in have}
        return cls(samples, rewards, groups, dropped, list(trajs), used)


def _placeholder_count(t: Trajectory, placeholder_id: int) -> int:
    """Image slots in the trajectory's prompt and response (one per image token)."""
    return int((np.asarray(t.prompt_ids) == placeholder_id).sum()) + int(
        (np.asarray(t.response_ids) == placeholder_id).sum()
    )


def _sampled_placeholder(t: Trajectory, placeholder_id: int) -> bool:
    """The model sampled the image placeholder token (an environment's are images' slots)."""
    hit = np.asarray(t.response_ids) == placeholder_id
    if t.loss_mask is not None and len(t.loss_mask) == len(hit):
        hit &= np.asarray(t.loss_mask) == 1
    return bool(hit.any())


def _reject_reason(t: Trajectory, vocab_size: int | None, max_len: int | None) -> str:
    if t.reward is None:
        return "no_reward"
    if not np.isfinite(t.reward):
        return "bad_reward"
    n = len(t.response_ids)
    if n == 0:
        return "empty_response"
    if len(t.prompt_ids) == 0:
        return "empty_prompt"
    if len(t.logprobs) != n:
        return "logprob_length"
    if t.loss_mask is not None:
        if len(t.loss_mask) != n:
            return "loss_mask_length"
        if int(t.loss_mask.max()) > 1:
            return "bad_loss_mask"
        if not t.loss_mask.any():
            return "no_model_tokens"
    if max_len is not None and len(t.prompt_ids) + n > max_len:
        return "too_long"
    if t.routes is not None and (t.routes.ndim != 3 or len(t.routes) > len(t.prompt_ids) + n):
        return "bad_routes"
    if vocab_size is not None:
        lo = min(int(t.prompt_ids.min()), int(t.response_ids.min()))
        hi = max(int(t.prompt_ids.max()), int(t.response_ids.max()))
        if lo < 0 or hi >= vocab_size:
            return "bad_token_id"
    return ""


def token_staleness(version: int, samples: list[Sample]) -> dict[str, float]:
    """Mode partial (some sample spans versions): staleness per model token (the trainer's
    version before the step minus the version that sampled the token), and how many samples
    span more than one version. Nothing otherwise (one version per sample: `staleness` says it)."""
    if not any(s.token_versions is not None for s in samples):
        return {}
    total, n, spanning = 0, 0, 0
    for s in samples:
        tv = (
            np.full(len(s.response_ids), s.version)
            if s.token_versions is None
            else s.token_versions
        )
        if s.loss_mask is not None:
            tv = tv[s.loss_mask]
        total += int((version - tv).sum())
        n += len(tv)
        spanning += int(len(tv) > 0 and tv.min() != tv.max())
    return {"staleness_token": total / max(1, n), "spanning_versions": float(spanning)}
