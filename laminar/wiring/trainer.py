"""The trainer's settings from the config: the node's TrainerNodeSettings, what the trainer
engine reads (TrainerSettings: `laminar plan`, tests and benches build a TorchTrainer from it) and
what validation reads (EvalSettings).

    node = TrainerNode(trainer_node_settings(cfg))
    trainer = TorchTrainer(trainer_settings(cfg), model_path)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from laminar.config import LaminarConfig
from laminar.trainer.protocol import TrainerSettings
from laminar.trainer.settings import TrainerNodeSettings
from laminar.vision.images import image_limits
from laminar.wiring.common import node_settings, weights_channel

if TYPE_CHECKING:
    from laminar.trainer.evaluation import EvalSettings


def trainer_settings(cfg: LaminarConfig) -> TrainerSettings:
    """What the trainer (TorchTrainer or SimTrainer) reads of the config."""
    sampling = cfg.rollout.sampling
    return TrainerSettings(
        trainer=cfg.trainer,
        algo=cfg.algo,
        model=cfg.model,
        max_model_len=cfg.rollout.max_model_len,
        temperature=sampling.temperature,
        max_tokens=sampling.max_tokens,
    )


def eval_settings(cfg: LaminarConfig) -> EvalSettings:
    """What validation reads of the config."""
    from laminar.trainer.evaluation import EvalSettings

    return EvalSettings(
        data=cfg.data,
        trainer=cfg.trainer,
        model=cfg.model,
        rollout=cfg.rollout,
        reward=cfg.reward,
        env_fn=cfg.env.fn,
    )


def trainer_node_settings(
    cfg: LaminarConfig, index: int = 0, node_id: str | None = None
) -> TrainerNodeSettings:
    """What trainer-`index` receives; a torch trainer's rank comes from the launcher's env (a
    rank above 0 is `trainer-{index}-rank{rank}`)."""
    rank = 0
    # dist imports torch: seconds the sim trainer need not spend
    if cfg.trainer.engine == "torch":
        from laminar.trainer.dist import env_rank

        rank = env_rank()[0]
    node_id = node_id or (f"trainer-{index}" if rank == 0 else f"trainer-{index}-rank{rank}")
    return TrainerNodeSettings(
        node=node_settings(cfg, "trainer", index, node_id),
        rank=rank,
        train=trainer_settings(cfg),
        eval=eval_settings(cfg),
        transport=cfg.transport,
        buffer=cfg.endpoint("buffer"),
        channel=weights_channel(cfg),
        run_dir=cfg.resolved_run_dir(),
        logging=cfg.logging,
        run_name=cfg.name,
        run_config=cfg.model_dump(mode="json"),
        attest=cfg.rollout.engine != "sim",
        image_limits=image_limits(cfg.data),
        colocate=cfg.cluster.colocate if cfg.cluster.placement == "colocated" else None,
    )
