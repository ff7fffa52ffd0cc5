"""Worker for tests/test_trainer_fsdp.py (not a test itself): FSDP2 policy steps on CPU/gloo.

    torchrun --standalone --nproc_per_node 2 tests/fsdp_worker.py MODEL_DIR OUT_DIR [routes]

`routes` (an MoE model, tests/test_moe_fsdp.py): each trajectory carries recorded routes
(tests/test_moe_fsdp.py routed_trajs), which the trainer replays, with activation checkpointing.

The trainer node's path without the network: rank 0 drives the `Trainer` protocol
(step, export, save, close: each first announces itself to the other ranks), rank 1
runs laminar.trainer.follower.follow; every rank takes its share of the micro-batches.
After the steps rank 0 writes the losses and the gathered full weights, then a checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from laminar.trainer.dist import init_distributed  # noqa: E402
from laminar.trainer.follower import follow  # noqa: E402
from laminar.trainer.torch_trainer import TorchTrainer  # noqa: E402
from laminar.wiring.trainer import trainer_settings  # noqa: E402
from tests.test_trainer import make_cfg, make_trajs  # noqa: E402


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    trajs, extra = make_trajs, {}
    if sys.argv[3:] == ["routes"]:
        from tests.test_moe_fsdp import routed_trajs

        # each layer recomputed in backward: with the routes its forward was given
        trajs, extra = routed_trajs(model), {"activation_checkpointing": True}
    ctx = init_distributed("cpu")
    # the gathered checkpoint (an HF directory), which this test resumes in one process
    cfg = make_cfg(model, out / "run", micro_batch_tokens=48, checkpoint_format="full", **extra)
    policy = TorchTrainer(trainer_settings(cfg), model, ctx)
    if not ctx.is_main:
        follow(policy, ctx, out / "run", keep=2)
        policy.close()
        return
    losses, norms = [], []
    for seed in (1, 2, 1):
        m = policy.step(policy.prepare(trajs(seed=seed)))
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    weights = policy.export()  # float32 (the config's rollout dtype): the full state dict
    path = policy.save(out / "run", 3, {"version": 3}, keep=2).wait()
    policy.close()
    torch.save(weights, out / "weights.pt")
    (out / "result.json").write_text(
        json.dumps(
            {
                "losses": losses,
                "grad_norms": norms,
                "world": ctx.world,
                "micro_batches": m["micro_batches"],
                "checkpoint": str(path),
            }
        )
    )


if __name__ == "__main__":
    main()
