"""The weights channel's interfaces: how a new policy version gets from the trainer to the rollouts.

No implementation lives here: the settings and result types, the two ends' interfaces and the
error a subscriber raises. One choice, made once from the config by `weights_channel(cfg)`
(laminar/wiring/common.py: the wiring layer), opens both ends (laminar/weights/factory.py):

    trainer:  pub = open_publisher(weights_channel(cfg), node.wiring())
              await pub.start()
              # res: Published(handoff, uri, bytes, stall_s)
              res = await pub.publish(version, step, named_tensors)
              # or exported into the channel tensor by tensor (the relay streams it into its slot)
              res, digest = await publish_streamed(pub, version, step, layout, produce, digest=True)
    rollout:  sub = open_subscriber(weights_channel(cfg), node.wiring())
              await sub.start()
              sub.latest_version()            # newest version available (-1: none yet)
              v = await sub.wait_newer(than=3, timeout=1.0)  # wakes an idle rollout on a new one
              v = await sub.load_into(engine)  # newest version -> engine.load_weights
              sub.announce(v)                 # manager / buffer named a version (announce mode)
              await sub.close()

  mode      publisher (trainer)                         subscriber (rollout)
  relay     WeightPusher → master relay (/dev/shm),     WeightPuller: WeightsReady from the host's
            chain broadcast between relays              relay, zero-copy reads of its segment
            (relay.py over pusher.py / puller.py)
  dir       run_dir/weights/v{version}.safetensors,     newest complete file of that directory
            temp name + rename (never half a file)      (polled: a directory has no notification)
            (dir.py)
  announce  nothing moves (sim: no tensors)             versions named by manager / buffer; loading
            (announce.py)                               only sets the engine's version
  nccl      a broadcast group (nccl.py over group.py; gloo on CPU), the relays as its fallback
  cuda_ipc  one host: the trainer's device buffer mapped by its rollouts (cuda_ipc.py), the
            relays as its fallback

`weights_mode`: `rollout.weights` when set; `auto` is relay when the config runs relays
(cluster.roles.relay > 0), else announce when either end is a sim engine (one end has no
tensors), else dir.

`Published.handoff` keeps the names VersionPublished has always carried: relay, direct, sim.
Version 0 is the model on disk (cfg.model.path); a subscriber only ever offers newer ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from laminar.weights.group import GroupSettings

WeightsMode = Literal["relay", "dir", "announce", "nccl", "cuda_ipc"]


class WeightsUnavailable(RuntimeError):
    """No weights to move right now (no live relay, no such version, a file vanished): retry
    later."""


@dataclass(frozen=True)
class RelayLinks:
    """What the trainer's and a rollout's ends need to reach the relays (built from the
    config by laminar/wiring/common.py `relay_links`)."""

    control: tuple[str, ...]
    """Relay i's control endpoint (Stage/Commit/Pull/ChainInfo), for every relay index."""
    pub: tuple[str, ...]
    """Relay i's WeightsReady publisher."""
    startup_timeout_s: float
    request_timeout_s: float
    probe_timeout_s: float
    """A relay that does not answer a probe within this is taken for dead (failover)."""
    chunk_bytes: int
    """Chunk size of a streamed push when the relay did not name one."""
    window: int
    """Chunks of a streamed push in flight."""

    def relay(self, index: int) -> str:
        if not 0 <= index < len(self.control):
            raise WeightsUnavailable(f"relay {index} is not one of the {len(self.control)}")
        return self.control[index]


@dataclass(frozen=True)
class ChannelSettings:
    """How weights move in this run, the same at both ends (laminar/wiring/common.py
    `weights_channel(cfg)` builds it from the config)."""

    mode: WeightsMode
    dir: Path
    """dir mode: where versions are written (run_dir/weights)."""
    relay: RelayLinks | None
    """relay mode: the relays' endpoints and deadlines."""
    relay_index: int
    """relay mode, a rollout's end: the relay of its host."""
    group: GroupSettings | None
    """nccl / cuda_ipc: the trainer's weights store and broadcast group (nccl.py, cuda_ipc.py)."""
    device: str
    """nccl / cuda_ipc: where this end keeps a version (the model's device)."""
    lease_ttl_s: float
    """cuda_ipc: a reader's lease on a version."""


# ---- publisher end (trainer) ------------------------------------------------------------


@dataclass
class Published:
    handoff: str
    """Which way the version left: relay | direct | sim (VersionPublished.handoff)."""
    uri: str = ""
    num_bytes: int = 0
    stall_s: float = 0.0


class WeightPublisher(Protocol):
    kind: str

    async def start(self) -> None: ...

    async def publish(self, version: int, step: int, tensors: dict[str, Any] | None) -> Published:
        """Hand `version` off; returns once the trainer may resume."""
        ...

    async def close(self) -> None: ...


# ---- subscriber end (rollout) -----------------------------------------------------------


class WeightSink(Protocol):
    """What a subscriber loads into (every rollout engine is one)."""

    async def load_weights(
        self, named_tensors: Iterable[tuple[str, Any]], version: int
    ) -> None: ...


class WeightSubscriber(ABC):
    name = "subscriber"
    last_source = ""
    """The path the last load came by, where a mode has several (nccl: group | relay)."""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Connect / prepare; called once before any other method."""

    @abstractmethod
    def latest_version(self) -> int:
        """Newest version that load_into would load now (-1: none)."""

    @abstractmethod
    async def wait_newer(self, than: int, timeout: float) -> int:
        """Return as soon as latest_version() > than, or after `timeout`; returns
        latest_version()."""

    @abstractmethod
    async def load_into(self, engine: WeightSink) -> int:
        """Load the newest version into the engine (between its decode steps); returns the version.
        Raises WeightsUnavailable when it cannot now (the caller retries later)."""

    def announce(self, version: int) -> None:  # noqa: B027 - optional hook
        """Someone (manager, buffer) said `version` exists; subscribers that carry tensors ignore
        it."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what start() took."""
