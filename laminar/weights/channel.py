"""The weights channel: how a new policy version gets from the trainer to the rollouts.

One choice, made once from the config by `weights_channel(cfg)` (laminar/wiring/common.py: the
wiring layer), opens both ends:

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
  dir       run_dir/weights/v{version}.safetensors,     newest complete file of that directory
            temp name + rename (never half a file)      (polled: a directory has no notification)
  announce  nothing moves (sim: no tensors)             versions named by manager / buffer; loading
                                                        only sets the engine's version

`weights_mode`: `rollout.weights` when set; `auto` is relay when the config runs relays
(cluster.roles.relay > 0), else announce when either end is a sim engine (one end has no
tensors), else dir. The GPU paths, nccl (a broadcast group; gloo on CPU) and cuda_ipc (one
host), are laminar/weights/gpu_channel.py; both keep the relays as their fallback.

`Published.handoff` keeps the names VersionPublished has always carried: relay, direct, sim.
Version 0 is the model on disk (cfg.model.path); a subscriber only ever offers newer ones.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from laminar.protocol.relay import WeightLayout
from laminar.transport.sockets import Wiring
from laminar.weights.digest import weights_digest
from laminar.weights.group import GroupSettings
from laminar.weights.layout import tensor_spans
from laminar.weights.relay_client import (
    RelayLinks,
    WeightPuller,
    WeightPusher,
    WeightsUnavailable,
)
from laminar.weights.sink import DictSink, VersionSink

WeightsMode = Literal["relay", "dir", "announce", "nccl", "cuda_ipc"]

_FILE = re.compile(r"^v(\d+)\.safetensors$")


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
    """nccl / cuda_ipc: the trainer's weights store and broadcast group (gpu_channel.py)."""
    device: str
    """nccl / cuda_ipc: where this end keeps a version (the model's device)."""
    lease_ttl_s: float
    """cuda_ipc: a reader's lease on a version."""


def _links(settings: ChannelSettings) -> RelayLinks:
    if settings.relay is None:
        raise ValueError("weights mode relay needs ChannelSettings.relay (the relays' endpoints)")
    return settings.relay


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


def _nbytes(tensors: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in tensors.values())


class RelayPublisher:
    kind = "relay"

    def __init__(self, pusher: WeightPusher):
        self.pusher = pusher

    async def start(self) -> None:
        await self.pusher.start()

    async def publish(self, version: int, step: int, tensors: dict[str, Any] | None) -> Published:
        stall = await self.pusher.push(version, tensors or {})
        return Published(self.kind, "", _nbytes(tensors or {}), stall)

    async def close(self) -> None:
        await self.pusher.close()


class DirPublisher:
    kind = "direct"

    def __init__(self, directory: str | os.PathLike[str], keep: int = 4):
        self.dir = Path(directory)
        self.keep = keep

    async def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def _write(self, version: int, tensors: dict[str, Any]) -> tuple[str, int]:
        from safetensors.torch import save_file

        final = self.dir / f"v{version}.safetensors"
        tmp = self.dir / f".v{version}.safetensors.tmp"
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        save_file(cpu, str(tmp), metadata={"version": str(version)})
        os.replace(tmp, final)
        versions = sorted(self.dir.glob("v*.safetensors"), key=lambda p: int(p.stem[1:]))
        for old in versions[: -self.keep]:
            old.unlink(missing_ok=True)
        return str(final), _nbytes(cpu)

    async def publish(self, version: int, step: int, tensors: dict[str, Any] | None) -> Published:
        t0 = time.perf_counter()
        uri, n = await asyncio.to_thread(self._write, version, tensors or {})
        return Published(self.kind, uri, n, time.perf_counter() - t0)

    async def close(self) -> None:
        pass


class AnnouncePublisher:
    """Nothing to move: the version reaches rollouts through the manager and the buffer."""

    kind = "sim"

    async def start(self) -> None:
        pass

    async def publish(self, version: int, step: int, tensors: dict[str, Any] | None) -> Published:
        return Published(self.kind)

    async def close(self) -> None:
        pass


async def publish_streamed(
    pub: WeightPublisher,
    version: int,
    step: int,
    layout: WeightLayout,
    produce: Callable[[VersionSink], Awaitable[None]],
    *,
    digest: bool,
) -> tuple[Published, str]:
    """Hand `version` off as `produce(sink)` exports it tensor by tensor; (Published, the version's
    weights_digest, "" unless `digest`). The relay channel streams it into the staged slot while
    the next tensor gathers, and commits only a complete version (WeightPusher.push_stream); the
    other channels take the whole version, then publish it as `publish` does."""
    if isinstance(pub, RelayPublisher):
        stall, digest_hex = await pub.pusher.push_stream(version, layout, produce, digest=digest)
        nbytes = sum(span[4] for span in tensor_spans(layout))
        return Published(pub.kind, "", nbytes, stall), digest_hex
    sink = DictSink()
    await produce(sink)
    items = list(sink.tensors.items())
    hashing = asyncio.ensure_future(asyncio.to_thread(weights_digest, items)) if digest else None
    published = await pub.publish(version, step, sink.tensors)
    return published, (await hashing if hashing is not None else "")


def _group(settings: ChannelSettings) -> GroupSettings:
    if settings.group is None:
        raise ValueError(f"weights mode {settings.mode} needs ChannelSettings.group")
    return settings.group


def open_publisher(settings: ChannelSettings, wiring: Wiring) -> WeightPublisher:
    """The trainer's end of the channel that `settings.mode` names."""
    if settings.mode in ("nccl", "cuda_ipc"):
        from laminar.weights.gpu_channel import CudaIpcPublisher, GroupPublisher
        from laminar.weights.group import GroupBroadcaster

        pusher = WeightPusher(settings.relay, wiring) if settings.relay is not None else None
        if settings.mode == "cuda_ipc":
            return CudaIpcPublisher(pusher, _group(settings), settings.device)
        caster = GroupBroadcaster(_group(settings), wiring.log)
        return GroupPublisher(pusher, caster, settings.device)
    if settings.mode == "relay":
        return RelayPublisher(WeightPusher(_links(settings), wiring))
    if settings.mode == "dir":
        return DirPublisher(settings.dir)
    return AnnouncePublisher()


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


class AnnounceSubscriber(WeightSubscriber):
    name = "announce"

    def __init__(self) -> None:
        self._latest = -1
        self._changed = asyncio.Event()

    def announce(self, version: int) -> None:
        if version > self._latest:
            self._latest = version
            self._changed.set()

    def latest_version(self) -> int:
        return self._latest

    async def wait_newer(self, than: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self._latest <= than and time.monotonic() < deadline:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                break
        return self._latest

    async def load_into(self, engine: WeightSink) -> int:
        version = self._latest
        await engine.load_weights([], version)
        return version


class DirSubscriber(WeightSubscriber):
    name = "dir"

    def __init__(self, directory: str | os.PathLike[str], poll_s: float = 0.25):
        self.dir = Path(directory)
        self.poll_s = poll_s
        self._latest = -1
        self._scanned_at = 0.0

    def _scan(self) -> tuple[int, Path | None]:
        best, path = -1, None
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            return -1, None
        for e in entries:
            m = _FILE.match(e.name)
            if m and int(m.group(1)) > best:
                best, path = int(m.group(1)), Path(e.path)
        return best, path

    def latest_version(self) -> int:
        now = time.monotonic()
        # heartbeats ask often; the disk is asked at most every poll_s
        if now - self._scanned_at >= self.poll_s:
            self._latest = self._scan()[0]
            self._scanned_at = now
        return self._latest

    async def wait_newer(self, than: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            v = self.latest_version()
            if v > than or time.monotonic() >= deadline:
                return v
            # a directory has no change notification: poll it
            await asyncio.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))

    async def load_into(self, engine: WeightSink) -> int:
        version, path = self._scan()
        if path is None:
            raise WeightsUnavailable(f"no weights in {self.dir}")
        try:
            tensors = await asyncio.to_thread(_read_safetensors, path)
        except Exception as exc:  # vanished (pruned by the trainer) or unreadable: try again later
            raise WeightsUnavailable(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
        await engine.load_weights(tensors.items(), version)
        self._latest = max(self._latest, version)
        return version


def _read_safetensors(path: Path) -> dict[str, Any]:
    # torch tensors when torch is loaded anyway (torch/vllm engines; keeps bf16); numpy otherwise,
    # so a sim rollout never pays for importing torch
    if "torch" in sys.modules:
        from safetensors.torch import load_file as load_torch

        return load_torch(str(path))
    from safetensors.numpy import load_file as load_numpy

    return dict(load_numpy(str(path)))


class RelaySubscriber(WeightSubscriber):
    """The host's relay (shared memory); the puller owns the subscription and the segment."""

    name = "relay"

    def __init__(self, puller: WeightPuller):
        self.puller = puller

    async def start(self) -> None:
        await self.puller.start()

    def latest_version(self) -> int:
        return self.puller.latest_version

    async def wait_newer(self, than: int, timeout: float) -> int:
        try:
            await self.puller.wait_version(than + 1, timeout)
        except TimeoutError:
            pass
        return self.latest_version()

    async def load_into(self, engine: WeightSink) -> int:
        try:
            w = await self.puller.pull()
        except (
            Exception
        ) as exc:  # relay restarting / version superseded mid-read: the caller retries
            raise WeightsUnavailable(f"relay pull failed: {type(exc).__name__}: {exc}") from exc
        try:
            await engine.load_weights(w.named_tensors(), w.version)
            return w.version
        finally:
            await w.release()

    async def close(self) -> None:
        await self.puller.close()


def open_subscriber(settings: ChannelSettings, wiring: Wiring) -> WeightSubscriber:
    """A rollout's end of the channel that `settings.mode` names (its host's relay:
    `settings.relay_index`)."""
    if settings.mode in ("nccl", "cuda_ipc"):
        from laminar.weights.gpu_channel import CudaIpcSubscriber, GroupSubscriber

        relay = None
        if settings.relay is not None:
            puller = WeightPuller(settings.relay, wiring, relay_index=settings.relay_index)
            relay = RelaySubscriber(puller)
        if settings.mode == "cuda_ipc":
            return CudaIpcSubscriber(
                relay, _group(settings), wiring.node_id, wiring.log, settings.lease_ttl_s
            )
        return GroupSubscriber(relay, _group(settings), wiring.node_id, settings.device, wiring.log)
    if settings.mode == "relay":
        puller = WeightPuller(_links(settings), wiring, relay_index=settings.relay_index)
        return RelaySubscriber(puller)
    if settings.mode == "dir":
        return DirSubscriber(settings.dir)
    return AnnounceSubscriber()
