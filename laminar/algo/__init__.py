"""RL algorithms as pure torch functions: advantages, policy losses, loss statistics.

    adv = compute_advantages(rewards, groups, "grpo")          # advantages.py
    s = LossSettings.from_algo(algo)                              # losses.py
    loss = policy_loss(logp, prox, behav, adv_tok, mask, s, n_tokens=n_tok, n_seqs=n_seq)
    stats.finalize()                                      # metrics.py (IS weight, ESS, clip ...)
    episode_stats(batch.samples)                          # episodes.py (turns, tool calls, latency)

No config tree, sockets or models here: the trainer (laminar/trainer/torch_trainer.py) wires them.
"""
