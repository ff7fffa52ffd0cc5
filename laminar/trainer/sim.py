"""The sim trainer: no model, step time = sim_time_per_token_s x tokens consumed.
The emulated implementation of the `Trainer` protocol (laminar/trainer/protocol.py).

    TrainerConfig.engine == "sim"   (emulated-scale benchmarks: 128 sim rollouts on one host)

Consumed tokens are prompt + response tokens of the usable trajectories (what a real
forward/backward would process). The emulated compute is a sleep on the node's worker
thread, like real compute would be: it models compute time, it does not synchronise
anything. Advantages are still computed so the logged reward/advantage figures mean the
same as with the torch trainer. Its checkpoint is the counters and the frontier (no
model); its export is a small blob (`trainer.sim_weight_bytes`, default 4096) so a relay
tier has bytes to move; a handoff without one only announces the version.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from laminar.algo.advantages import compute_advantages
from laminar.algo.episodes import episode_stats
from laminar.algo.metrics import length_stats
from laminar.config import AlgoConfig, TrainerConfig
from laminar.models.offload import Moved
from laminar.protocol.data import Trajectory
from laminar.protocol.relay import WeightLayout
from laminar.trainer import checkpoint as ck
from laminar.trainer.batch import TrainBatch
from laminar.trainer.protocol import PendingSave
from laminar.weights.sink import VersionSink


class SimTrainer:
    def __init__(self, tc: TrainerConfig, algo: AlgoConfig):
        self.algo = algo
        self.time_per_token = tc.sim_time_per_token_s
        self.weight_bytes = tc.sim_weight_bytes
        self.steps = 0

    def offload(self, params: bool = True, optimizer: bool = True) -> Moved:
        return Moved(0, 0.0, 0)  # an emulated step holds no device memory

    def onload(self) -> Moved:
        return Moved(0, 0.0, 0)

    def prepare(
        self, trajectories: list[Trajectory], images: Mapping[str, bytes] | None = None
    ) -> TrainBatch:
        return TrainBatch.build(trajectories, images=images)

    def step(self, batch: TrainBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        adv = compute_advantages(
            batch.rewards, batch.groups, self.algo.advantage, self.algo.norm_std
        )
        time.sleep(self.time_per_token * batch.total_tokens)  # the emulated compute
        self.steps += 1
        out = {
            "reward": float(batch.rewards.mean()),
            "adv/mean": float(adv.mean()),
            "adv/max": float(adv.max()),
            "adv/min": float(adv.min()),
            "tokens": float(batch.n_tokens),
            "tokens_total": float(batch.total_tokens),
            "seqs": float(batch.n_seqs),
            "compute_s": time.perf_counter() - t0,
        }
        out.update(length_stats([len(s.response_ids) for s in batch.samples]))
        out.update(episode_stats(batch.samples))
        return out

    def export(self) -> dict[str, torch.Tensor]:
        n = max(1, self.weight_bytes // 4)
        return {"sim.weight": torch.full((n,), float(self.steps), dtype=torch.float32)}

    def stream_layout(self) -> WeightLayout | None:
        return None

    def export_into(self, sink: VersionSink) -> None:
        for name, tensor in self.export().items():
            sink.put(name, tensor)

    def save(self, run_dir: Path, step: int, meta: dict[str, Any], keep: int) -> PendingSave:
        path = ck.write_checkpoint(
            run_dir, step, None, None, {"rng": ck.rng_state()}, meta, keep=keep
        )
        return PendingSave.completed(step, path)

    def restore(self, checkpoint: Path) -> dict[str, Any]:
        meta, _ = ck.read_checkpoint(checkpoint)
        self.steps = int(meta["step"])
        return meta

    def close(self) -> None:
        pass
