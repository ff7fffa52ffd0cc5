"""The GPU weight paths a run can choose (`rollout.weights`): nccl and cuda_ipc. Both keep the
relay tier as their fallback, so every rollout always has a way to the newest version.

  mode      publisher (trainer)                           subscriber (rollout)
  nccl      pack one flat buffer, hand it to the group's  group versions (GroupMember); a version
            thread (group.py); push to the relay tier     the group did not bring within bound_s
            too; wait for the broadcast at most bound_s   of the relay having it: the relay's
  cuda_ipc  export a device buffer + IPC handle (gpu.py), a rollout on the trainer's host (same
            handle and expected lease keys in the store,  boot id) maps it, leases it, copies
            push to the relay tier too                    device to device; other hosts: relay

Which rollouts take the GPU path is decided per process without the user listing hosts: the
group takes whoever beats; cuda_ipc compares the trainer's boot id (in the store) with the
rollout's own and maps the handle's GPU by UUID (gpu.resolve_device), else it reads the relay.

    pub = GroupPublisher(relay_pusher, GroupBroadcaster(settings, log), device="cpu")
    sub = GroupSubscriber(RelaySubscriber(puller), settings, node_id, device="cpu", log=log)
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import structlog

from laminar.protocol.relay import CudaIpcHandle
from laminar.weights.channel import Published, RelaySubscriber, WeightSink, WeightSubscriber
from laminar.weights.gpu import FlatWeights, pack_flat
from laminar.weights.group import Delivery, GroupBroadcaster, GroupMember, GroupSettings
from laminar.weights.relay_client import WeightPusher, WeightsUnavailable

Log = structlog.typing.FilteringBoundLogger


def boot_id() -> str:
    """This host's boot id (one per host and boot: CUDA IPC needs the very same machine)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()


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


# ---- cuda_ipc -----------------------------------------------------------------------------


def open_store(settings: GroupSettings, master: bool) -> Any:
    """The run's weights store (the trainer hosts it; the group and CUDA IPC share it)."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(
        settings.host,
        settings.port,
        is_master=master,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=settings.connect_timeout_s if not master else 30),
    )


class CudaIpcPublisher:
    """cuda_ipc: the trainer's end. Stall = pack into the device buffer + relay push."""

    kind = "cuda_ipc"

    def __init__(self, pusher: WeightPusher | None, settings: GroupSettings, device: Any):
        self.pusher, self.settings, self.device = pusher, settings, device
        self.store: Any = None
        self.exporter: Any = None

    async def start(self) -> None:
        from laminar.weights.gpu import CudaIpcExporter
        from laminar.weights.leases import LeaseBoard, StoreKV

        self.store = await asyncio.to_thread(open_store, self.settings, True)
        self.store.set("ipc/boot", boot_id())
        self.exporter = CudaIpcExporter(LeaseBoard(StoreKV(self.store)), self.device)
        if self.pusher is not None:
            await self.pusher.start()

    async def publish(self, version: int, step: int, tensors: dict[str, Any] | None) -> Published:
        from laminar.transport.codec import encode

        t0 = time.perf_counter()
        handle = self.exporter.export(version, tensors or {})
        self.store.set("ipc/handle", b"".join(bytes(f) for f in encode(handle)))
        self.store.set("ipc/version", str(version))
        if self.pusher is not None:
            await self.pusher.push(version, tensors or {})
        return Published(self.kind, "", handle.layout.total_bytes, time.perf_counter() - t0)

    async def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
        if self.pusher is not None:
            await self.pusher.close()


class CudaIpcSubscriber(WeightSubscriber):
    """cuda_ipc: a rollout's end. Same host and the GPU visible: map, lease, copy; else relay."""

    name = "cuda_ipc"

    def __init__(
        self,
        relay: RelaySubscriber | None,
        settings: GroupSettings,
        node_id: str,
        log: Log,
        ttl_s: float = 60.0,
    ):
        self.relay, self.settings, self.node_id, self.log = relay, settings, node_id, log
        self.ttl_s = ttl_s
        self.store: Any = None
        self.local = False
        """This rollout maps the trainer's buffers (same host, its GPU visible here)."""
        self.loads = {"cuda_ipc": 0, "relay": 0}
        self.last_source = ""

    async def start(self) -> None:
        if self.relay is not None:
            await self.relay.start()
        self.store = await asyncio.to_thread(open_store, self.settings, False)
        self.local = await asyncio.to_thread(self._is_local)
        self.log.info("cuda_ipc_path", local=self.local)

    def _is_local(self) -> bool:
        import torch

        self.store.wait(["ipc/boot"])
        if bytes(self.store.get("ipc/boot")).decode() != boot_id():
            return False
        return bool(torch.cuda.is_available())

    def _ipc_version(self) -> int:
        if not self.store.check(["ipc/version"]):
            return -1
        return int(self.store.get("ipc/version"))

    def latest_version(self) -> int:
        if self.local:
            return self._ipc_version()
        return self.relay.latest_version() if self.relay is not None else -1

    async def wait_newer(self, than: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.latest_version() <= than and time.monotonic() < deadline:
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))  # store: poll
        return self.latest_version()

    async def load_into(self, engine: WeightSink) -> int:
        if not self.local:
            if self.relay is None:
                raise WeightsUnavailable("cuda_ipc: not on the trainer's host and no relay")
            version = await self.relay.load_into(engine)
            self.loads["relay"] += 1
            self.last_source = "relay"
            return version
        from laminar.transport.codec import decode
        from laminar.weights.gpu import open_cuda_ipc
        from laminar.weights.leases import LeaseBoard, StoreKV

        raw = bytes(self.store.get("ipc/handle"))
        handle = decode([raw[:1], raw[1:]])
        if not isinstance(handle, CudaIpcHandle):
            raise WeightsUnavailable(f"ipc/handle holds a {type(handle).__name__}")
        try:
            w = open_cuda_ipc(handle, LeaseBoard(StoreKV(self.store)), self.node_id, self.ttl_s)
        except LookupError as exc:  # the GPU is not visible here after all: the relay from now on
            self.local = False
            self.log.warning("cuda_ipc_unmappable", error=str(exc))
            raise WeightsUnavailable(str(exc)) from exc
        if w is None:
            raise WeightsUnavailable(f"version {handle.version} withdrawn; a newer one exists")
        try:
            await engine.load_weights(w.named_tensors(), w.version)
        finally:
            await w.release()
        self.loads["cuda_ipc"] += 1
        self.last_source = "cuda_ipc"
        return w.version

    async def close(self) -> None:
        if self.relay is not None:
            await self.relay.close()
