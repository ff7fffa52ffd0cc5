"""The nccl mode of the weights channel: the trainer broadcasts each version to the rollouts in
one collective (the group: group.py; NCCL on GPUs, gloo on CPU), the relay tier its fallback,
so every rollout always has a way to the newest version.

  publisher (trainer)                             subscriber (rollout)
  pack one flat buffer (gpu.py), hand it to the   group versions (GroupMember); a version the
  group's thread; push to the relay tier too;     group did not bring within bound_s of the
  wait for the broadcast at most bound_s          relay having it: the relay's

Which rollouts take the group path is decided per process without the user listing hosts: the
group takes whoever beats.

    pub = GroupPublisher(relay_pusher, GroupBroadcaster(settings, log), device="cpu")
    sub = GroupSubscriber(RelaySubscriber(puller), settings, node_id, device="cpu", log=log)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from laminar.weights.channel import Published, WeightSink, WeightSubscriber, WeightsUnavailable
from laminar.weights.gpu import FlatWeights, pack_flat
from laminar.weights.group import Delivery, GroupBroadcaster, GroupMember, GroupSettings, Log
from laminar.weights.pusher import WeightPusher
from laminar.weights.relay import RelaySubscriber


def _import_dist() -> None:
    """torch first, then torch.distributed. Importing torch.distributed first takes its module
    lock before torch's; a thread still importing torch (the rollout's import prefetch,
    laminar/launch/tuning.py) needs torch.distributed too, importlib breaks that deadlock by
    handing one side a half-initialised module, and the second c10d init aborts the process."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401


class GroupPublisher:
    """nccl: the trainer's end. Stall = pack + relay push + the broadcast (at most bound_s)."""

    kind = "nccl"

    def __init__(self, pusher: WeightPusher | None, caster: GroupBroadcaster, device: Any):
        self.pusher, self.caster, self.device = pusher, caster, device
        self.last: Delivery | None = None
        self.timeouts = 0

    async def start(self) -> None:
        await asyncio.to_thread(self.caster.start)
        if self.pusher is not None:
            await self.pusher.start()

    async def publish(self, version: int, step: int, tensors: dict[str, Any] | None) -> Published:
        t0 = time.perf_counter()
        items = tensors or {}
        layout, flat = await asyncio.to_thread(pack_flat, items, self.device)
        done = asyncio.wrap_future(self.caster.submit(version, layout, flat))
        if self.pusher is not None:
            try:
                await self.pusher.push(version, items)
            except WeightsUnavailable:
                if done.done() or not self.caster.members:
                    raise
        left = self.caster.s.bound_s - (time.perf_counter() - t0)
        try:
            self.last = await asyncio.wait_for(asyncio.shield(done), max(0.0, left))
        except TimeoutError:  # a member is slow or dead: the group's thread deals with it
            self.timeouts += 1
        return Published(self.kind, "", layout.total_bytes, time.perf_counter() - t0)

    async def close(self) -> None:
        await asyncio.to_thread(self.caster.close)
        if self.pusher is not None:
            await self.pusher.close()


class GroupSubscriber(WeightSubscriber):
    """nccl: a rollout's end. The group goes first: a version the relay has and the group did not
    bring is offered only bound_s after the relay had it (the trainer's own bound on a
    broadcast), so a member in a working group loads every version through it, and a dropped one
    falls back to the relay after that bound."""

    name = "nccl"

    def __init__(
        self,
        relay: RelaySubscriber | None,
        settings: GroupSettings,
        node_id: str,
        device: Any,
        log: Log,
    ):
        self.relay, self.settings, self.log = relay, settings, log
        self.member = GroupMember(settings, node_id, device, self._arrived, log)
        self._flat: FlatWeights | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        self.loads = {"group": 0, "relay": 0}
        """Versions loaded by path (status, tests)."""
        self._relay_seen: dict[int, float] = {}
        """When the relay first offered a version the group had not brought."""
        self.last_source = ""

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.relay is not None:
            await self.relay.start()
        await asyncio.to_thread(_import_dist)
        self.member.start()

    def _arrived(self, w: FlatWeights) -> None:  # the member's thread
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._take, w)

    def _take(self, w: FlatWeights) -> None:
        if self._flat is None or w.version > self._flat.version:
            self._flat = w
            self._changed.set()

    def _group_version(self) -> int:
        return self._flat.version if self._flat is not None else -1

    def _relay_version(self) -> int:
        """The relay's newest version once the group had bound_s to bring it and did not (a
        dropped member, or one not yet in the group), else -1: the group always goes first."""
        if self.relay is None:
            return -1
        rv = self.relay.latest_version()
        if rv <= self._group_version():
            return -1
        now = time.monotonic()
        first = self._relay_seen.setdefault(rv, now)
        for old in [v for v in self._relay_seen if v < rv]:
            del self._relay_seen[old]
        return rv if now - first >= self.settings.bound_s else -1

    def latest_version(self) -> int:
        return max(self._group_version(), self._relay_version())

    async def wait_newer(self, than: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.latest_version() <= than:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._changed.clear()
            # the relay and the membership have no event here: look again every 0.25 s
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 0.25))
            except TimeoutError:
                pass
        return self.latest_version()

    async def load_into(self, engine: WeightSink) -> int:
        w = self._flat
        if w is not None and w.version >= self.latest_version():
            await engine.load_weights(w.named_tensors(), w.version)
            self.loads["group"] += 1
            self.last_source = "group"
            return w.version
        if self.relay is None or self._relay_version() < 0:
            raise WeightsUnavailable("no version from the group yet")
        version = await self.relay.load_into(engine)
        self.loads["relay"] += 1
        self.last_source = "relay"
        return version

    async def close(self) -> None:
        await asyncio.to_thread(self.member.close)
        if self.relay is not None:
            await self.relay.close()
