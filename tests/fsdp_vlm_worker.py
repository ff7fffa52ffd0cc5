"""Worker for tests/test_vlm_fsdp.py (not a test itself): FSDP2 steps of a tiny Qwen2-VL on
CPU/gloo.

    torchrun --standalone --nproc_per_node 2 tests/fsdp_vlm_worker.py MODEL_DIR DATA OUT_DIR

DATA is a pickle of (trajectories, images by digest) sampled by the VLM engine. Rank 0 drives the
`Trainer` protocol (step, export, save), rank 1 follows (laminar.trainer.follower); every rank
takes its share of the micro-batches and remakes their pixel inputs from the image bytes. Rank 0
writes the losses, gradient norms and the gathered full weights, then a checkpoint.
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
    model, data, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    ctx = init_distributed("cpu")
    cfg = vlm_cfg(model, out / "run", checkpoint_format="full")
    policy = TorchTrainer(trainer_settings(cfg), model, ctx)
    if not ctx.is_main:
        follow(policy, ctx, out / "run", keep=2)
        policy.close()
        return
    batches = pickle.loads(data.read_bytes())
    losses, norms = [], []
    for trajs, images in batches:
        m = policy.step(policy.prepare(trajs, images))
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    weights = policy.export()
    path = policy.save(out / "run", len(batches), {"version": len(batches)}, keep=2).wait()
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
