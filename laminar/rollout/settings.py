"""What a rollout node receives (laminar/wiring/rollout.py builds it from the config).

node = RolloutNode(rollout_node_settings(cfg, 0), engine=...)   # test doubles: engine, env...
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from laminar.config import (
    AgentConfig,
    ColocateConfig,
    EnvConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TransportConfig,
)
from laminar.node_settings import NodeSettings
from laminar.vision.images import ImageLimits
from laminar.weights.channel import ChannelSettings


@dataclass(frozen=True)
class RolloutNodeSettings:
    node: NodeSettings
    rollout: RolloutConfig
    model: ModelConfig
    reward: RewardConfig
    env: EnvConfig
    agent: AgentConfig
    transport: TransportConfig
    mode: str
    buffer: str
    """The buffer's endpoint (prompts, trajectories, partials)."""
    buffer_max_message_bytes: int
    """The buffer socket's inbound limit (a partial batch is at most half of it)."""
    tools: str | None
    """The tools node's endpoint (None: the cluster runs none)."""
    tool_call_timeout_s: float
    channel: ChannelSettings
    """How weights come from the trainer (the device is this rollout's, set in setup)."""
    rollouts: int
    """Rollouts of the cluster (GPU and core placement by index)."""
    reserved_gpus: int
    """GPUs of each host kept for the trainer (rollout.trainer_gpus, else 1 with a trainer)."""
    repack: bool
    """manager.repack.enabled: the manager plans moves from the rollouts' status pushes."""
    max_prompt_tokens: int
    model_name: str
    """What the agents' OpenAI endpoint calls the model (agent.model_name, else the run's name:
    never a local path)."""
    agent_endpoints: Path
    """Where each rollout writes its agent endpoint's URL (run_dir/agents/endpoints)."""
    image_limits: ImageLimits = ImageLimits()
    """data.max_image_bytes / max_image_pixels: what a prompt's images may be (docs/vision.md)."""
    colocate: ColocateConfig | None = None
    """cluster.placement=colocated: this rollout shares its device with the trainer's rank and
    sleeps while it steps (laminar/rollout/colocate.py); None: separate placement."""
