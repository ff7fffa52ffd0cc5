"""What a buffer node receives: its config sections and the values the wiring derives from the
whole config (laminar/wiring/buffer.py builds both).

    settings = buffer_node_settings(cfg, 0)    # laminar/wiring/buffer.py
    node = BufferNode(settings)                # laminar/buffer/node.py
    state = settings.state.new_state()         # the ExperienceState it keeps (also offline)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from laminar.buffer.audit import AuditSettings
from laminar.buffer.experience import ExperienceState
from laminar.buffer.owners import SampleLimits
from laminar.config import BufferConfig, DataConfig, TrainerConfig
from laminar.modes import Admission
from laminar.node_settings import NodeSettings


@dataclass(frozen=True)
class StateSettings:
    """What an ExperienceState is built from (the buffer node; offline replays of its
    journal)."""

    group_size: int
    lost_member_policy: str
    admission: Admission
    sampling: str
    seed: int

    def new_state(self) -> ExperienceState:
        return ExperienceState(
            group_size=self.group_size,
            lost_member_policy=self.lost_member_policy,
            admission=self.admission,
            sampling=self.sampling,
            seed=self.seed,
        )


@dataclass(frozen=True)
class BufferNodeSettings:
    node: NodeSettings
    buffer: BufferConfig
    data: DataConfig
    trainer: TrainerConfig
    """What the trainer asks for (buffer.capacity is checked against it)."""
    mode: str
    state: StateSettings
    audit: AuditSettings
    limits: SampleLimits
    """What a rollout's sample must satisfy (the model's vocab_size read from its config.json)."""
    model_path: str | None
    agent_prompts: bool
    """The run's samples are black-box agent episodes (agent.fn or agent.remote): a sample's
    prompt is what its agent rendered, bound to its group by the row's uid (owners.py)."""
    reward_fn: str
    group_size: int
    groups_per_rollout: int
    """Open groups one rollout may hold (laminar/config.py groups_per_rollout())."""
    groups_in_hand: int
    """Open groups a rollout's own flow control asks for at most (laminar/config.py
    groups_in_hand()): a serving rollout may hold this many whatever its engine runs."""
    inflight_per_rollout: int
    """Most samples one rollout holds in flight (laminar/config.py inflight_per_rollout())."""
    run_dir: Path
    endpoint: str
    """Where the buffer binds."""
    max_message_bytes: int
    """Its socket's inbound limit (a whole group of trajectories)."""
