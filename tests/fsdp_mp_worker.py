"""Worker for tests/test_trainer_fsdp_mp.py (not a test itself): one FSDP2 train step with the
mixed-precision policy and per-layer activation checkpointing, gradients gathered.

    torchrun --standalone --nproc_per_node 2 tests/fsdp_mp_worker.py MODEL_DIR OUT_DIR [k=v ...]

Every rank runs the same `train_step` (the collective itself, without the rank-command loop),
then gathers the full gradients; rank 0 writes the loss and the gradients.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from laminar.trainer.batch import TrainBatch  # noqa: E402
from laminar.trainer.dist import destroy, init_distributed  # noqa: E402
from laminar.trainer.torch_trainer import TorchTrainer  # noqa: E402
from laminar.wiring.trainer import trainer_settings  # noqa: E402
from tests.test_trainer import make_cfg, make_trajs  # noqa: E402


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    extra = dict(a.split("=", 1) for a in sys.argv[3:])
    ctx = init_distributed("cpu")
    cfg = make_cfg(model, out / "run", micro_batch_tokens=48, **extra)
    policy = TorchTrainer(trainer_settings(cfg), model, ctx)
    m = policy.train_step(TrainBatch.build(make_trajs(seed=1)))
    grads = {}
    for name, p in policy.model.module.named_parameters():
        g = p.grad.full_tensor()  # a DTensor under FSDP2
        grads[name] = g.float()
    info = {
        "loss": m["loss"],
        "grad_norm": m["grad_norm"],
        "checkpointing": policy.model.checkpointing,
    }
    destroy(ctx)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(grads, out / "grads.pt")
        (out / "result.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main()
