"""The one place that picks the trainer: torch or sim, from `trainer.engine`, resumed.

    opened = open_trainer(settings, run_dir)  # worker thread: torch imports, process group, resume
    opened.trainer, opened.dist, opened.checkpoint, opened.meta

The trainer node calls it once (laminar/trainer/node.py); nothing in trainer/ imports it. The
implementations are imported here, lazily (the sim trainer needs no model and no process group).

Resume: rank 0 resolves `trainer.resume` (auto = newest checkpoint in run_dir) and the
other ranks receive its answer, so every rank loads the same checkpoint. From a sharded
checkpoint under FSDP each rank builds the model on the meta device and reads only its shards.
"""

from __future__ import annotations

from pathlib import Path

from laminar.trainer.protocol import Opened, Trainer, TrainerSettings


def open_trainer(settings: TrainerSettings, run_dir: Path) -> Opened:
    """Build the configured trainer, resumed from its checkpoint in run_dir if there is one.
    Blocking."""
    from laminar.trainer import checkpoint as ck
    from laminar.trainer.dist import DistContext, agree_on_path, init_distributed

    tc = settings.trainer
    dist = DistContext() if tc.engine == "sim" else init_distributed(settings.model.device)
    ckpt = None
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ck.remove_partial(run_dir)
        ckpt = ck.resolve_resume(tc.resume, run_dir)
    trainer: Trainer
    if tc.engine == "sim":
        from laminar.trainer.sim import SimTrainer

        trainer = SimTrainer(tc, settings.algo)
    else:
        from laminar.trainer.torch_trainer import TorchTrainer

        ckpt = agree_on_path(dist, ckpt)
        adapter = ck.adapter_of(ckpt, settings.model.lora is not None)
        # a LoRA checkpoint holds the adapters only: the base is model.path, as for the rollouts;
        # a full checkpoint holds an HF directory; a sharded one is loaded over model.path's
        # weights by restore (each rank its own shards)
        full = ckpt / "model" if ckpt is not None and adapter is None else None
        model_path = str(full) if full is not None and full.is_dir() else settings.model.path
        if not model_path:
            raise ValueError("the torch trainer needs model.path (a local HF model directory)")
        # resuming FSDP from a sharded checkpoint: each rank builds the model without weights and
        # reads only its own shards (host memory: its share, not the whole model)
        empty = ckpt is not None and (ckpt / "dcp").is_dir()
        trainer = TorchTrainer(settings, model_path, dist, adapter, empty=empty)
    meta = trainer.restore(ckpt) if ckpt is not None else None
    return Opened(trainer, dist, ckpt, meta)
