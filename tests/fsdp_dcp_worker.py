"""Worker for tests/test_trainer_dcp.py (not a test itself): sharded checkpoints on 2 ranks.

    torchrun --standalone --nproc_per_node 2 tests/fsdp_dcp_worker.py MODEL_DIR OUT_DIR run
    torchrun --standalone --nproc_per_node 2 tests/fsdp_dcp_worker.py MODEL_DIR OUT_DIR resume

run: steps on batches 1, 2, a sharded checkpoint (every rank writes its shards), step 3; rank 0
writes the losses and the gathered weights after step 2. resume: a fresh policy per rank, the
checkpoint read back (each rank its shards), step 3; rank 0 writes its loss and the meta.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from laminar.trainer import checkpoint as ck  # noqa: E402
from laminar.trainer.batch import TrainBatch  # noqa: E402
from laminar.trainer.dist import destroy, init_distributed  # noqa: E402
from laminar.trainer.node import trainer_settings  # noqa: E402
from laminar.trainer.policy import Policy  # noqa: E402
from tests.test_trainer import make_cfg, make_trajs  # noqa: E402

META = {"version": 2, "frontier": {"committed": [0, 1], "uncommitted": []}}


def main() -> None:
    model, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    ctx = init_distributed("cpu")
    cfg = make_cfg(model, out / "run", micro_batch_tokens=48, warmup_steps=2)
    policy = Policy(trainer_settings(cfg), model, ctx)
    result: dict = {"world": ctx.world}
    if mode == "run":
        losses = [policy.train_step(TrainBatch.build(make_trajs(seed=s)))["loss"] for s in (1, 2)]
        weights = policy.full_state_dict()
        path = ck.save_policy(policy, out / "run", 2, META, model, keep=2)
        losses.append(policy.train_step(TrainBatch.build(make_trajs(seed=3)))["loss"])
        result.update(losses=losses, checkpoint=str(path))
        if ctx.is_main:
            torch.save(weights, out / "weights2.pt")
    else:
        path = ck.latest_checkpoint(out / "run")
        assert path is not None
        meta = ck.load_policy_state(policy, path)
        result.update(
            meta=meta,
            last_epoch=policy.scheduler.state_dict()["last_epoch"],
            loss=policy.train_step(TrainBatch.build(make_trajs(seed=3)))["loss"],
        )
    destroy(ctx)
    if ctx.is_main:
        (out / f"{mode}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
