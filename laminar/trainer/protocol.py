"""The `Trainer` protocol (what the node needs of a trainer) and the small types around it.

    opened = open_trainer(settings, run_dir)        # laminar/trainer/factory.py: picks, resumes
    batch = opened.trainer.prepare(trajectories)
    metrics = opened.trainer.step(batch)            # one optimizer step (or its emulation)
    weights = opened.trainer.export()               # what the handoff publishes
    opened.trainer.export_into(sink)                # or streamed into it (laminar/weights/sink.py)
    opened.trainer.save(run_dir, step, meta, keep).wait()  # a checkpoint holding `meta`

Two implementations, chosen once from `trainer.engine` by open_trainer: `TorchTrainer`
(laminar/trainer/torch_trainer.py; FSDP2 when launched on several ranks) and `SimTrainer`
(laminar/trainer/sim.py; no model, emulated step time). This module imports neither. Every
method but `prepare` is
blocking compute: the node runs it on its worker thread. Under torch.distributed the
methods are collectives: rank 0 calls them from the node and they first tell the other
ranks what to do (a RankCommand), which run the same method from laminar/trainer/follower.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from laminar.config import AlgoConfig, ModelConfig, TrainerConfig

if TYPE_CHECKING:
    import torch

    from laminar.models.offload import Moved
    from laminar.protocol.data import Trajectory
    from laminar.protocol.relay import WeightLayout
    from laminar.trainer.batch import TrainBatch
    from laminar.trainer.dist import DistContext
    from laminar.weights.sink import VersionSink


class Trainer(Protocol):
    def prepare(
        self, trajectories: list[Trajectory], images: Mapping[str, bytes] | None = None
    ) -> TrainBatch:
        """Validate against this model's limits (vocabulary, context): drops are counted, not
        raised. `images`: the batch's images by digest (vision-language models)."""
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

    def offload(self, params: bool = True, optimizer: bool = True) -> Moved:
        """Colocated placement: parameters + gradients (`params`) and optimizer state
        (`optimizer`) to host memory until the next call that needs them (step, export, save)
        or onload(); returns what moved."""
        ...

    def onload(self) -> Moved:
        """Everything offload() moved back on the device."""
        ...

    def close(self) -> None:
        """Release the process group (rank 0 first tells the other ranks to stop)."""
        ...


class PendingSave:
    """A checkpoint on its way to disk. `wait()` (any thread; idempotent) blocks until every
    rank's shards are durable, then, on rank 0, writes the small files and meta.json and renames
    the directory into place: only then is it a checkpoint `latest_checkpoint` finds, so a crash
    before that resumes from the previous one. Returns the path on rank 0, None elsewhere."""

    def __init__(
        self,
        step: int,
        upload: Future[Any] | None = None,
        finish: Callable[[], Path | None] | None = None,
        path: Path | None = None,
    ):
        self.step = step
        self.waited_s = 0.0
        """Seconds the save that made this one waited for the one before it (trainer time)."""
        self._upload, self._finish, self._path = upload, finish, path
        self._lock = threading.Lock()
        self._done = upload is None and finish is None

    @classmethod
    def completed(cls, step: int, path: Path | None) -> PendingSave:
        return cls(step, path=path)

    def done(self) -> bool:
        """Landed (wait() returns at once), or its shards are written and only rank 0's small
        files remain."""
        return self._done or (self._upload is not None and self._upload.done())

    def wait(self) -> Path | None:
        with self._lock:
            if not self._done:
                if self._upload is not None:
                    self._upload.result()  # raises what the writer raised: no meta.json then
                if self._finish is not None:
                    self._path = self._finish()
                self._done = True
            return self._path


@dataclass(frozen=True)
class TrainerSettings:
    """What a trainer reads of the config (laminar/wiring/trainer.py `trainer_settings`)."""

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
