"""Outcome advantages from per-trajectory rewards and GRPO group ids.

    rewards [B] float, group ids [B] int  ──estimator──►  advantages [B]  ──broadcast──► tokens

Estimators (algorithms.md §2.2-2.6, §5):
  grpo                    (R - mean_g) / (std_g + eps)      (std only when norm_std; unbiased std)
  dr_grpo                 R - mean_g                        (no std; length norm is the loss's job)
  rloo                    R - mean of the other members = G/(G-1) (R - mean_g)
  reinforce_pp_baseline   (R - mean_g) / (std over the whole batch + eps)

The baseline uses the raw rewards of all members whatever versions generated them;
version correction belongs to the per-token loss weights (§5.3). A group with a
single usable member has no baseline: its advantage is 0 (no signal, no noise).

    adv = compute_advantages(torch.tensor([1., 0., 1., 1.]), torch.tensor([0, 0, 1, 1]), "grpo")
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

EPS = 1e-6


def group_index(group_ids: Sequence[str]) -> torch.Tensor:
    """Map string group ids to dense ints 0..G-1 in order of first appearance."""
    seen: dict[str, int] = {}
    return torch.tensor([seen.setdefault(g, len(seen)) for g in group_ids], dtype=torch.long)


def _group_stats(
    rewards: torch.Tensor, groups: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group mean and unbiased group std (0 for singletons), in float64."""
    r = rewards.to(torch.float64)
    n_groups = int(groups.max().item()) + 1 if groups.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups, r)
    mean = total / count.clamp(min=1)
    dev2 = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups, (r - mean[groups]) ** 2)
    std = (dev2 / (count - 1).clamp(min=1)).sqrt()
    return count[groups], mean[groups], std[groups]


def compute_advantages(
    rewards: torch.Tensor,
    groups: torch.Tensor,
    estimator: str = "grpo",
    norm_std: bool = True,
    eps: float = EPS,
) -> torch.Tensor:
    """Per-trajectory advantages [B] (float32) for rewards [B] and dense group ids [B]."""
    if rewards.shape != groups.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and groups {tuple(groups.shape)} must be equal 1-d "
            "shapes"
        )
    if rewards.numel() == 0:
        return torch.zeros(0)
    if not torch.isfinite(rewards).all():
        raise ValueError(
            "rewards must be finite (drop samples whose reward failed before this point)"
        )
    r = rewards.to(torch.float64)
    count, mean, std = _group_stats(rewards, groups)
    centred = r - mean
    if estimator == "grpo":
        adv = centred / (std + eps) if norm_std else centred
    elif estimator == "dr_grpo":
        adv = centred
    elif estimator == "rloo":
        adv = centred * count / (count - 1).clamp(min=1)
    elif estimator == "reinforce_pp_baseline":
        # group-centred values already have batch mean 0 when groups are whole;
        # re-centre anyway so partial groups cannot shift the batch
        usable = count > 1
        if usable.sum() > 1:
            c = centred[usable]
            adv = (centred - c.mean()) / (c.std() + eps)
        else:
            adv = torch.zeros_like(centred)
    else:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; use grpo, dr_grpo, rloo or "
            "reinforce_pp_baseline"
        )
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    return adv.to(torch.float32)


def kl_penalized_rewards(
    rewards: torch.Tensor, seq_kl: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """k1-in-reward: R_i - beta * sum_t (log pi_old - log pi_ref), before the baseline (REINFORCE++
    style)."""
    return rewards - kl_coef * seq_kl.to(rewards.dtype)


def broadcast_to_tokens(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] advantages -> [B, T] on the response tokens of `mask` (0 elsewhere)."""
    return adv[:, None].to(torch.float32) * mask.to(torch.float32)
