"""Which samples go in which micro-batch, on which rank: index lists only, no tensors built.

    parts = minibatches(batch, trainer.minibatches)          # whole groups, M near-equal parts
    live = carries_gradient(adv, loss_settings, trainer.skip_zero_advantage)
    plan = plan_micro_batches(batch, [i for i in part if live[i]], budget, by_prompt, ctx)
    # this rank's micro-batches: [(batch indices, weight)], weight 0 for FSDP's dummies

Two packings under trainer.micro_batch_tokens: `pack_by_prompt` for the packed forward (a
prompt's samples together, the prompt counted once: trainer/packed.py) and `pack_micro_batches`
for HF's padded forward (longest first, rows x longest <= budget; the packed forward's attention
chunks use it too). Under FSDP every rank takes micro-batches rank::world, padded with zero-weight
dummies so every rank runs as many forwards and backwards and the collectives line up.
"""

from __future__ import annotations

import torch

from laminar.algo.losses import LossSettings
from laminar.trainer.batch import Sample, TrainBatch
from laminar.trainer.dist import DistContext

MicroPlan = list[tuple[list[int], float]]
"""This rank's micro-batches: (batch indices, weight); weight 0: a dummy that keeps FSDP's
collectives aligned (its loss is multiplied by 0)."""


def minibatches(batch: TrainBatch, count: int) -> list[list[int]]:
    """Sample indices of each mini-batch: whole groups, in batch order, `count` near-equal parts
    (at most one per group)."""
    n_groups = int(batch.groups.max()) + 1 if batch.n_seqs else 0
    m = max(1, min(count, n_groups))
    if m == 1:
        return [list(range(batch.n_seqs))]
    part_of = [g * m // n_groups for g in range(n_groups)]
    parts: list[list[int]] = [[] for _ in range(m)]
    for i, g in enumerate(batch.groups.tolist()):
        parts[part_of[g]].append(i)
    return parts


def carries_gradient(
    adv: torch.Tensor, loss: LossSettings, skip_zero_advantage: bool
) -> list[bool]:
    """Per sample: may its loss have a gradient (trainer.skip_zero_advantage)? A sample with
    advantage exactly 0 has none when every loss term is proportional to the advantage."""
    has_other_terms = loss.entropy_coef > 0 or (loss.kl_coef > 0 and loss.kl_type == "k3_loss")
    if not skip_zero_advantage or has_other_terms:
        return [True] * len(adv)
    return (adv != 0).tolist()


def plan_micro_batches(
    batch: TrainBatch, idx: list[int], token_budget: int, by_prompt: bool, ctx: DistContext
) -> MicroPlan:
    """This rank's micro-batches of the samples `idx`: packed by prompt (the packed forward) or by
    length (HF's padded forward)."""
    if by_prompt:
        return rank_share(pack_by_prompt(batch.samples, idx, token_budget), ctx)
    packed = pack_micro_batches([batch.samples[i].length for i in idx], token_budget)
    return rank_share([[idx[j] for j in mb] for mb in packed], ctx)


def rank_share(mbs: list[list[int]], ctx: DistContext) -> MicroPlan:
    """Micro-batches rank::world, as many on every rank (zero-weight dummies fill up)."""
    if not ctx.enabled or not mbs:  # none: a mini-batch of zero advantages only
        return [(m, 1.0) for m in mbs]
    mine = [(m, 1.0) for m in mbs[ctx.rank :: ctx.world]]
    per_rank = -(-len(mbs) // ctx.world)
    mine += [(mbs[0], 0.0)] * (
        per_rank - len(mine)
    )  # zero-weight dummies keep FSDP collectives aligned
    return mine


def pack_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sample indices so that (longest length in group) x (group size) <= token_budget.

    Longest first, greedy: padding waste stays small because neighbours have similar
    lengths. A sample longer than the budget gets a micro-batch of its own. Deterministic.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and lengths[cur[0]] * (len(cur) + 1) > token_budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def pack_by_prompt(samples: list[Sample], idx: list[int], token_budget: int) -> list[list[int]]:
    """Micro-batches of `idx` whose packed tokens (each distinct prompt once, plus every
    response) stay within `token_budget`: samples of one prompt are kept together, longest
    first within a prompt, so a group is split only when it alone exceeds the budget.
    A sample longer than the budget gets a micro-batch of its own. Deterministic."""
    by_prompt: dict[bytes, list[int]] = {}
    for i in idx:
        by_prompt.setdefault(samples[i].prompt_ids.tobytes(), []).append(i)
    out: list[list[int]] = []
    cur: list[int] = []
    cost, seen = 0, set[bytes]()
    for key, members in by_prompt.items():
        for i in sorted(members, key=lambda i: (-len(samples[i].response_ids), i)):
            add = len(samples[i].response_ids) + (0 if key in seen else len(samples[i].prompt_ids))
            if cur and cost + add > token_budget:
                out.append(cur)
                cur, cost, seen = [], 0, set()
                add = samples[i].length
            cur.append(i)
            cost += add
            seen.add(key)
    if cur:
        out.append(cur)
    return out
