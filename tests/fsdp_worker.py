"""Worker for tests/test_trainer_fsdp.py (not a test itself): FSDP2 policy steps on CPU/gloo.

    torchrun --standalone --nproc_per_node 2 tests/fsdp_worker.py MODEL_DIR OUT_DIR

Rank 0 builds the batch and sends it to the other ranks with broadcast_message (the
trainer node's path); every rank takes its share of the micro-batches; after the
steps rank 0 writes the losses and the gathered full weights, then a checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from laminar.protocol.trainer import RankCommand  # noqa: E402
from laminar.trainer import checkpoint as ck  # noqa: E402
from laminar.trainer.batch import TrainBatch  # noqa: E402
from laminar.trainer.dist import broadcast_message, destroy, init_distributed  # noqa: E402
from laminar.trainer.policy import Policy  # noqa: E402
from tests.test_trainer import make_cfg, make_trajs  # noqa: E402


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    ctx = init_distributed("cpu")
    cfg = make_cfg(model, out / "run", micro_batch_tokens=48)
    policy = Policy(cfg, model, ctx)
    losses, norms = [], []
    for seed in (1, 2, 1):
        cmd = broadcast_message(
            ctx,
            RankCommand(kind="step", trajectories=make_trajs(seed=seed)) if ctx.is_main else None,
        )
        m = policy.train_step(TrainBatch.build(cmd.trajectories))
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    weights = policy.full_state_dict()
    path = ck.save_policy(policy, out / "run", 3, {"version": 3}, model)
    if ctx.is_main:
        torch.save(weights, out / "weights.pt")
        (out / "result.json").write_text(json.dumps({"losses": losses, "grad_norms": norms, "world": ctx.world,
                                                     "micro_batches": m["micro_batches"], "checkpoint": str(path)}))  # fmt: skip
    destroy(ctx)


if __name__ == "__main__":
    main()
