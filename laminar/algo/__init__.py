"""RL algorithms as pure torch functions: advantages, policy losses, loss statistics.

    adv = compute_advantages(rewards, groups, "grpo")          # advantages.py
    s = LossSettings.from_algo(algo)                              # losses.py
    loss = policy_loss(logp, prox, behav, adv_tok, mask, s, n_tokens=n_tok, n_seqs=n_seq)
    stats.finalize()                                      # metrics.py (IS weight, ESS, clip ...)
    episode_stats(batch.samples)                          # episodes.py (turns, tool calls, latency)

No config tree, sockets or models here: the trainer (laminar/trainer/torch_trainer.py) wires them.
"""

from laminar.algo.advantages import (
    broadcast_to_tokens,
    compute_advantages,
    group_index,
    kl_penalized_rewards,
)
from laminar.algo.losses import (
    LossSettings,
    aggregate,
    behaviour_weights,
    policy_loss,
    ppo_token_loss,
)
from laminar.algo.metrics import StatAccumulator, normalized_ess, staleness_histogram

__all__ = [
    "compute_advantages",
    "group_index",
    "kl_penalized_rewards",
    "broadcast_to_tokens",
    "LossSettings",
    "policy_loss",
    "ppo_token_loss",
    "behaviour_weights",
    "aggregate",
    "StatAccumulator",
    "normalized_ess",
    "staleness_histogram",
]
