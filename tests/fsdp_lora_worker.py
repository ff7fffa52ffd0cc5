"""Worker for tests/test_lora.py's FSDP2 check (not a test itself): LoRA steps on 2 CPU ranks.

    torchrun --standalone --nproc_per_node 2 tests/fsdp_lora_worker.py MODEL_DIR OUT_DIR

Every rank runs the same steps on the same batches (what follower.py does on a rank command),
taking its share of the micro-batches; after each step every rank gathers the adapter gradients
(a collective), and rank 0 writes the losses, those gradients and the exported adapter; then a
checkpoint (adapter + AdamW state, gathered on rank 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from laminar.config import LoraConfig  # noqa: E402
from laminar.models.lora import is_adapter_name  # noqa: E402
from laminar.trainer import checkpoint as ck  # noqa: E402
from laminar.trainer.batch import TrainBatch  # noqa: E402
from laminar.trainer.dist import destroy, init_distributed  # noqa: E402
from laminar.trainer.torch_trainer import TorchTrainer  # noqa: E402
from laminar.wiring.trainer import trainer_settings  # noqa: E402
from tests.test_trainer import make_cfg, make_trajs  # noqa: E402

SEEDS = (1, 2, 1)


def lora_fsdp_cfg(model: str, run_dir: Path):
    cfg = make_cfg(model, run_dir, micro_batch_tokens=48, lr=1e-2)
    cfg.model.lora = LoraConfig(rank=4, alpha=8)
    return cfg


def adapter_grads(policy: TorchTrainer) -> dict[str, torch.Tensor]:
    """Full adapter gradients (collective under FSDP2: every rank calls it)."""
    out = {}
    for name, p in policy.model.module.named_parameters():
        if is_adapter_name(name) and p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    ctx = init_distributed("cpu")
    policy = TorchTrainer(trainer_settings(lora_fsdp_cfg(model, out / "run")), model, ctx)
    losses, norms, grads = [], [], []
    for seed in SEEDS:
        m = policy.train_step(TrainBatch.build(make_trajs(seed=seed)))
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
        grads.append(adapter_grads(policy))
    weights = policy.model.export_weights()
    path = ck.save_trainer(policy, out / "run", 3, {"version": 3}, keep=2).wait()  # collective
    destroy(ctx)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"grads": grads, "weights": weights}, out / "tensors.pt")
        (out / "result.json").write_text(
            json.dumps(
                {"losses": losses, "grad_norms": norms, "world": ctx.world, "checkpoint": str(path)}
            )
        )


if __name__ == "__main__":
    main()
