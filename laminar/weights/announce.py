"""The announce mode of the weights channel: no tensors move (a sim engine at either end).

pub = AnnouncePublisher()   # trainer: publishing only names the version
sub = AnnounceSubscriber()  # rollout: sub.announce(v) from the manager / buffer; loading
                            # sets the engine's version
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from laminar.weights.channel import Published, WeightSink, WeightSubscriber


class AnnouncePublisher:
    """Nothing to move: the version reaches rollouts through the manager and the buffer."""

    kind = "sim"

    async def start(self) -> None:
        pass

    async def publish(self, version: int, step: int, tensors: dict[str, Any] | None) -> Published:
        return Published(self.kind)

    async def close(self) -> None:
        pass


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
