"""Where a rollout's new weights come from: the host's relay, or the trainer's handoff directory.

    source = make_weight_source(node)          # RelaySource or DirSource (cfg.rollout.weights)
    await source.start()
    source.latest_version()                    # newest version available (-1: none yet)
    v = await source.wait_newer(than=3, timeout=1.0)   # wakes the rollout's loop when one appears
    v = await source.load_into(engine)         # newest version -> engine.load_weights; returns it
    await source.close()

RelaySource reads the local relay's shared memory through laminar.transport.weights.
WeightPuller (the relay tier). DirSource is the trainer's "direct handoff" fallback
for runs without relays: the trainer writes run_dir/weights/v{version}.safetensors
with an atomic rename, so any file matching that name is complete; the newest one
wins. A directory has no change notification, so DirSource polls it (cheap scandir,
every `poll_s`).

AnnouncedSource is for sim rollouts without relays (the sim trainer then moves no
tensors): a version exists once the manager (RefreshRequest.min_version) or the
buffer (PromptReply.min_version) names it, and "loading" it only sets the engine's
version. Every source takes those announcements (`announce(v)`); only this one
acts on them.

`cfg.rollout.weights`: auto | relay | dir | announce. auto picks the relay when this
config starts relays (cluster.roles.relay > 0) and the relay transport is installed,
otherwise the directory for torch/vllm rollouts and announcements for sim ones.

Version 0 is the model on disk (cfg.model.path); sources only ever offer newer ones.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

__all__ = [
    "WeightSource",
    "RelaySource",
    "DirSource",
    "AnnouncedSource",
    "WeightSourceError",
    "make_weight_source",
]

_FILE = re.compile(r"^v(\d+)\.safetensors$")


class WeightSourceError(RuntimeError):
    """New weights could not be fetched (relay gone, file vanished or corrupt); retry later."""


class WeightSource(ABC):
    name = "source"

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Connect / prepare; called once before any other method."""

    @abstractmethod
    def latest_version(self) -> int:
        """Newest version that load_into would load now (-1: none)."""

    @abstractmethod
    async def wait_newer(self, than: int, timeout: float) -> int:
        """Return as soon as latest_version() > than, or after `timeout`; returns latest_version()."""

    @abstractmethod
    async def load_into(self, engine: Any) -> int:
        """Load the newest version into the engine (between its decode steps); returns the version."""

    def announce(self, version: int) -> None:  # noqa: B027 - optional hook
        """Someone (manager, buffer) said `version` exists; sources that carry tensors ignore it."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what start() took."""


class AnnouncedSource(WeightSource):
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

    async def load_into(self, engine: Any) -> int:
        version = self._latest
        await engine.load_weights([], version)
        return version


class DirSource(WeightSource):
    name = "dir"

    def __init__(self, directory: str | os.PathLike, poll_s: float = 0.25):
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

    async def load_into(self, engine: Any) -> int:
        version, path = self._scan()
        if path is None:
            raise WeightSourceError(f"no weights in {self.dir}")
        try:
            tensors = await asyncio.to_thread(_read_safetensors, path)
        except Exception as exc:  # vanished (pruned by the trainer) or unreadable: try again later
            raise WeightSourceError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
        await engine.load_weights(tensors.items(), version)
        self._latest = max(self._latest, version)
        return version


def _read_safetensors(path: Path) -> dict[str, Any]:
    # torch tensors when torch is loaded anyway (torch/vllm engines; keeps bf16); numpy otherwise,
    # so a sim rollout never pays for importing torch
    if "torch" in sys.modules:
        from safetensors.torch import load_file
    else:
        from safetensors.numpy import load_file
    return load_file(str(path))


class RelaySource(WeightSource):
    """The host's relay (shared memory); the puller owns the subscription and the segment."""

    name = "relay"

    def __init__(self, node: Any, relay_index: int):
        from laminar.transport.weights import WeightPuller

        self.puller = WeightPuller(node, relay_index=relay_index)

    async def start(self) -> None:
        await self.puller.start()

    def latest_version(self) -> int:
        v = self.puller.latest_version
        return -1 if v is None else int(v)

    async def wait_newer(self, than: int, timeout: float) -> int:
        try:
            await self.puller.wait_version(than + 1, timeout)
        except TimeoutError:
            pass
        return self.latest_version()

    async def load_into(self, engine: Any) -> int:
        try:
            w = await self.puller.pull()
        except (
            Exception
        ) as exc:  # relay restarting / version superseded mid-read: the caller retries
            raise WeightSourceError(f"relay pull failed: {type(exc).__name__}: {exc}") from exc
        try:
            await engine.load_weights(w.named_tensors(), w.version)
            return int(w.version)
        finally:
            await w.release()

    async def close(self) -> None:
        close = getattr(self.puller, "close", None)
        if close is not None:
            res = close()
            if asyncio.iscoroutine(res):
                await res


def _relay_transport_available() -> bool:
    try:
        from laminar.transport.weights import WeightPuller  # noqa: F401
    except ImportError:
        return False
    return True


def make_weight_source(node: Any) -> WeightSource:
    cfg = node.cfg
    kind = cfg.rollout.weights
    if kind == "auto":
        if cfg.cluster.roles.get("relay", 0) > 0 and _relay_transport_available():
            kind = "relay"
        else:
            kind = "announce" if cfg.rollout.engine == "sim" else "dir"
    if kind == "relay":
        return RelaySource(node, cfg.rollout.relay_index)
    if kind == "announce":
        return AnnouncedSource()
    return DirSource(cfg.resolved_run_dir() / "weights")
