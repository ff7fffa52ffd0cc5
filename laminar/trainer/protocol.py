"""The `Trainer` protocol (what the node needs of a trainer) and the one place that picks it.

    opened = open_trainer(settings, run_dir)  # worker thread: torch imports, process group, resume
    batch = opened.trainer.prepare(trajectories)
    metrics = opened.trainer.step(batch)            # one optimizer step (or its emulation)
    weights = opened.trainer.export()               # what the handoff publishes
    opened.trainer.export_into(sink)                # or streamed into it (laminar/weights/sink.py)
    opened.trainer.save(run_dir, step, meta, keep).wait()  # a checkpoint holding `meta`

Two implementations, chosen once from `trainer.engine`: the torch `Policy`
(laminar/trainer/policy.py; FSDP2 when launched on several ranks) and `SimTrainer`
(laminar/trainer/sim.py; no model, emulated step time). Every method but `prepare` is
blocking compute: the node runs it on its worker thread. Under torch.distributed the
methods are collectives: rank 0 calls them from the node and they first tell the other
ranks what to do (a RankCommand), which run the same method from laminar/trainer/follower.py.

Resume: rank 0 resolves `trainer.resume` (auto = newest checkpoint in run_dir) and the
other ranks receive its answer, so every rank loads the same checkpoint. From a sharded
checkpoint under FSDP each rank builds the model on the meta device and reads only its shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from laminar.config import AlgoConfig, ModelConfig, TrainerConfig

if TYPE_CHECKING:
    import torch

    from laminar.protocol.data import Trajectory
    from laminar.protocol.relay import WeightLayout
    from laminar.trainer.batch import TrainBatch
    from laminar.trainer.checkpoint import PendingSave
    from laminar.trainer.dist import DistContext
    from laminar.weights.sink import VersionSink


class Trainer(Protocol):
    def prepare(self, trajectories: list[Trajectory]) -> TrainBatch:
        """Validate against this model's limits (vocabulary, context): drops are counted, not
        raised."""
        ...

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on a batch with at least one usable sequence; returns its metrics."""
        ...

    def export(self) -> dict[str, torch.Tensor]:
        """The weights the rollouts load (rank 0; {} on the other ranks)."""
        ...

    def stream_layout(self) -> WeightLayout | None:
        """The layout of the version `export_into` gives (rank 0), or None where the version
        cannot be streamed (its shapes are known only once exported: LoRA, sim)."""
        ...

    def export_into(self, sink: VersionSink) -> None:
        """`export`, tensor by tensor into `sink` as each is gathered (rank 0; every rank runs
        the gathers). A failing sink does not stop the gathers (the other ranks are in them):
        the first error is raised once they are done."""
        ...

    def save(self, run_dir: Path, step: int, meta: dict[str, Any], keep: int) -> PendingSave:
        """Write checkpoint step_N holding `meta`. The PendingSave's wait() gives its path on
        rank 0 (None elsewhere) once it is on disk; it may still be in flight on return
        (trainer.checkpoint_async)."""
        ...

    def restore(self, checkpoint: Path) -> dict[str, Any]:
        """Load optimizer/scheduler/RNG state (the weights came with construction); returns meta."""
        ...

    def close(self) -> None:
        """Release the process group (rank 0 first tells the other ranks to stop)."""
        ...


@dataclass(frozen=True)
class TrainerSettings:
    """What a trainer reads of the config; the trainer node builds it from its sections."""

    trainer: TrainerConfig
    algo: AlgoConfig
    model: ModelConfig
    max_model_len: int | None
    """rollout.max_model_len: the context both sides cut at."""
    temperature: float
    """rollout.sampling.temperature: logprobs describe the distribution the sampler drew from."""
    max_tokens: int
    """rollout.sampling.max_tokens: the fixed horizon of the seq-mean-token-sum-norm loss."""


@dataclass
class Opened:
    trainer: Trainer
    dist: DistContext
    checkpoint: Path | None
    """The checkpoint the trainer resumed from (None: fresh start)."""
    meta: dict[str, Any] | None
    """That checkpoint's meta.json: step, version, consumption frontier."""


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
        from laminar.trainer.policy import Policy

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
        trainer = Policy(settings, model_path, dist, adapter, empty=empty)
    meta = trainer.restore(ckpt) if ckpt is not None else None
    return Opened(trainer, dist, ckpt, meta)
