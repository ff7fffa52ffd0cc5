"""Ranks > 0 of a torch.distributed trainer: run the collective rank 0 announces, until stop.

    torchrun --nproc_per_node N -m laminar node --role trainer ...

    rank 0 ──RankCommand──► follow(): step ─► trainer.step(batch)     (its share of micro-batches)
                                      export ─► trainer.export()       (gather; rank 0 keeps it)
                                      checkpoint ─► trainer.save(...)  (gather; rank 0 writes)
                                      stop ─► return

Only rank 0 is on the cluster network; the other ranks only follow, on the node's worker
thread (blocking). Rank 0 announces each collective from the same `Trainer` methods
(dist.lead), so both sides run the same code in the same order.
"""

from __future__ import annotations

from pathlib import Path

from laminar.protocol.trainer import RankCommand
from laminar.trainer.dist import DistContext, broadcast_message
from laminar.trainer.protocol import Trainer


def follow(trainer: Trainer, dist: DistContext, run_dir: Path, keep: int) -> None:
    """Mirror rank 0's collectives until it says stop. Blocking."""
    while True:
        cmd = broadcast_message(dist, None)
        if not isinstance(cmd, RankCommand):
            raise TypeError(f"rank {dist.rank}: expected a RankCommand, got {type(cmd).__name__}")
        if cmd.kind == "step":
            trainer.step(trainer.prepare(cmd.trajectories, cmd.images))
        elif cmd.kind == "export":
            trainer.export()
        elif cmd.kind == "checkpoint":
            trainer.save(run_dir, cmd.step, {}, keep)
        elif cmd.kind == "stop":
            return
        else:
            raise ValueError(f"rank {dist.rank}: unknown rank command {cmd.kind!r}")
