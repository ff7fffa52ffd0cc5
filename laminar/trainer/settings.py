"""What a trainer node receives (laminar/wiring/trainer.py builds it from the config).

node = TrainerNode(trainer_node_settings(cfg))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laminar.config import ColocateConfig, LoggingConfig, TransportConfig
from laminar.node_settings import NodeSettings
from laminar.trainer.protocol import TrainerSettings
from laminar.vision.images import ImageLimits
from laminar.weights.channel import ChannelSettings

if TYPE_CHECKING:
    from laminar.trainer.evaluation import EvalSettings


@dataclass(frozen=True)
class TrainerNodeSettings:
    node: NodeSettings
    rank: int
    """This process's rank (only rank 0 is on the cluster network)."""
    train: TrainerSettings
    """What the trainer (TorchTrainer or SimTrainer) reads: trainer, algo, model sections."""
    eval: EvalSettings
    """What validation reads."""
    transport: TransportConfig
    buffer: str
    """The buffer's endpoint (batches, commits)."""
    channel: ChannelSettings
    """How weights go to the rollouts."""
    run_dir: Path
    logging: LoggingConfig
    run_name: str
    run_config: dict[str, Any]
    """The resolved config (JSON), which wandb records with the run."""
    attest: bool
    """Rollouts serve tensors (not sim engines): each version's digest is computed for them."""
    image_limits: ImageLimits = ImageLimits()
    """data.max_image_bytes / max_image_pixels: what a batch's fetched images may be."""
    colocate: ColocateConfig | None = None
    """cluster.placement=colocated: the trainer takes the device from its rollout for each step
    and offloads after it (TrainerNode._take_device / _give_device); None: separate."""
