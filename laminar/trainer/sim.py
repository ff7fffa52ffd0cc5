"""The sim trainer: no model, step time = sim_time_per_token_s x tokens consumed.

    TrainerConfig.engine == "sim"   (emulated-scale benchmarks: 128 sim rollouts on one host)

Consumed tokens are prompt + response tokens of the usable trajectories (what a real
forward/backward would process). The emulated compute is an asyncio.sleep: it models
compute time, it does not synchronise anything. Advantages are still computed so the
logged reward/advantage figures mean the same as with the torch trainer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from laminar.algo.advantages import compute_advantages
from laminar.algo.metrics import length_stats
from laminar.trainer.batch import TrainBatch


class SimTrainer:
    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.time_per_token = cfg.trainer.sim_time_per_token_s

    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        adv = compute_advantages(
            batch.rewards, batch.groups, self.cfg.algo.advantage, self.cfg.algo.norm_std
        )
        await asyncio.sleep(self.time_per_token * batch.total_tokens)  # the emulated compute
        out = {
            "reward": float(batch.rewards.mean()), "adv/mean": float(adv.mean()),
            "adv/max": float(adv.max()), "adv/min": float(adv.min()),
            "tokens": float(batch.n_tokens), "tokens_total": float(batch.total_tokens),
            "seqs": float(batch.n_seqs), "compute_s": time.perf_counter() - t0,
        }  # fmt: skip
        out.update(length_stats([len(s.response_ids) for s in batch.samples]))
        return out
