"""The relay mode of the weights channel: both ends over the host's relay (shared memory).

    pub = RelayPublisher(WeightPusher(links, wiring))      # trainer: push to the master relay
    sub = RelaySubscriber(WeightPuller(links, wiring, relay_index=i))  # rollout: its host's relay

The pusher (pusher.py) copies a version into the master relay's /dev/shm slot and returns once
it is committed; the relays broadcast it along their chain (laminar/relay/). The puller
(puller.py) follows WeightsReady of the host's relay and pins a version while the engine copies
it from zero-copy views. The GPU modes (nccl.py, cuda_ipc.py) keep a RelaySubscriber as their
fallback.
"""

from __future__ import annotations

from typing import Any

from laminar.weights.channel import Published, WeightSink, WeightSubscriber, WeightsUnavailable
from laminar.weights.layout import tensors_nbytes
from laminar.weights.puller import WeightPuller
from laminar.weights.pusher import WeightPusher


class RelayPublisher:
    kind = "relay"

    def __init__(self, pusher: WeightPusher):
        self.pusher = pusher

    async def start(self) -> None:
        await self.pusher.start()

    async def publish(self, version: int, step: int, tensors: dict[str, Any] | None) -> Published:
        stall = await self.pusher.push(version, tensors or {})
        return Published(self.kind, "", tensors_nbytes(tensors or {}), stall)

    async def close(self) -> None:
        await self.pusher.close()


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
