"""Worker for tests/test_trainer_fsdp.py (not a test itself): FSDP2 policy steps on CPU/gloo.

    torchrun --standalone --nproc_per_node 2 tests/fsdp_worker.py MODEL_DIR OUT_DIR [routes]
    torchrun --standalone --nproc_per_node 2 tests/fsdp_worker.py MODEL_DIR OUT_DIR vlm DATA

`routes` (an MoE model, tests/test_moe_fsdp.py): each trajectory carries recorded routes
(tests/test_moe_fsdp.py routed_trajs), which the trainer replays, with activation checkpointing.
`vlm DATA` (a tiny Qwen2-VL, tests/test_vlm_fsdp.py): DATA is a pickle of batches, each
(trajectories, images by digest) sampled by the VLM engine; every rank remakes its micro-batches'
pixel inputs from the image bytes.

The trainer node's path without the network: rank 0 drives the `Trainer` protocol
(step, export, save, close: each first announces itself to the other ranks), rank 1
runs laminar.trainer.follower.follow; every rank takes its share of the micro-batches.
After the steps rank 0 writes the losses and the gathered full weights, then a checkpoint.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from laminar.config import LaminarConfig, config_from_dict  # noqa: E402
from laminar.trainer.dist import init_distributed  # noqa: E402
from laminar.trainer.follower import follow  # noqa: E402
from laminar.trainer.torch_trainer import TorchTrainer  # noqa: E402
from laminar.wiring.trainer import trainer_settings  # noqa: E402
from tests.test_trainer import make_cfg, make_trajs  # noqa: E402


def vlm_cfg(path: str, run_dir: Path, **trainer: Any) -> LaminarConfig:
    return config_from_dict(
        {
            "run_dir": str(run_dir),
            "model": {"path": path},
            "trainer": {"lr": 3e-3, "total_steps": 10, "micro_batch_tokens": 64, **trainer},
            "algo": {"advantage": "grpo", "is_mode": "truncate"},
            "rollout": {"sampling": {"temperature": 1.0, "max_tokens": 6}},
        }
    )


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    mode = sys.argv[3:]
    if mode[:1] == ["vlm"]:
        batches = pickle.loads(Path(mode[1]).read_bytes())
        cfg = vlm_cfg(model, out / "run", checkpoint_format="full")
    else:
        trajs, extra = make_trajs, {}
        if mode == ["routes"]:
            from tests.test_moe_fsdp import routed_trajs

            # each layer recomputed in backward: with the routes its forward was given
            trajs, extra = routed_trajs(model), {"activation_checkpointing": True}
        batches = [(trajs(seed=seed), None) for seed in (1, 2, 1)]
        # the gathered checkpoint (an HF directory), which this test resumes in one process
        cfg = make_cfg(model, out / "run", micro_batch_tokens=48, checkpoint_format="full", **extra)
    ctx = init_distributed("cpu")
    policy = TorchTrainer(trainer_settings(cfg), model, ctx)
    if not ctx.is_main:
        follow(policy, ctx, out / "run", keep=2)
        policy.close()
        return
    losses, norms = [], []
    for trajs_, images in batches:
        m = policy.step(policy.prepare(trajs_, images))
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    weights = policy.export()  # float32 (the config's rollout dtype): the full state dict
    n = len(batches)
    path = policy.save(out / "run", n, {"version": n}, keep=2).wait()
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
