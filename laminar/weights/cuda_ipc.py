"""The cuda_ipc mode of the weights channel: rollouts on the trainer's host map its device
buffer (CUDA IPC); other hosts, and a rollout that cannot see that GPU, read the relay tier.

  publisher (trainer)                             subscriber (rollout)
  export a device buffer + IPC handle, put the    a rollout on the trainer's host (same boot
  handle and expected lease keys in the store,    id) maps it, leases it, copies device to
  push to the relay tier too                      device; other hosts: relay

    pub = CudaIpcPublisher(relay_pusher, settings, device="cuda:0")
    sub = CudaIpcSubscriber(RelaySubscriber(puller), settings, node_id, log, ttl_s=60.0)

Underneath, per version:

    # trainer (GPU), same host as its rollouts
    exp = CudaIpcExporter(board, device="cuda:0")       # board: a LeaseBoard (leases.py)
    handle = exp.export(version, model.state_dict())    # CudaIpcHandle message (no pickle)
    # rollout process on that host
    w = open_cuda_ipc(handle, board, reader="rollout-1")  # None: withdrawn, read a newer one
    for name, t in w.named_tensors(): param[name].copy_(t)   # device-to-device
    await w.release()                                   # the lease goes; the trainer frees later

The handle, the trainer's boot id and the version go through the run's weights store (a c10d
TCPStore the trainer hosts, at GroupSettings' host and port). Lifetimes: a version's buffer is
freed by the exporter only when no reader holds a live lease (leases.py), never by torch's
per-share reference count: the exporter keeps its own reference to every buffer until then, so
a reader's close cannot free memory another reader still uses. Devices: the handle names the
trainer's GPU by UUID; a reader maps it onto the index that GPU has in its own process
(CUDA_VISIBLE_DEVICES renumbers), and initialises CUDA lazily first, as torch's own
rebuild_cuda_tensor does. Which rollouts map the buffer is decided per process: the trainer's
boot id (in the store) against the rollout's own, and the GPU's UUID among the visible ones.
torch.cuda is imported lazily: this module imports without CUDA.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from laminar.protocol.relay import CudaIpcHandle
from laminar.transport.codec import decode, encode
from laminar.weights.channel import Published, WeightSink, WeightSubscriber, WeightsUnavailable
from laminar.weights.gpu import FlatWeights, flat_checksum, pack_flat
from laminar.weights.group import GroupSettings, Log
from laminar.weights.layout import NamedTensors
from laminar.weights.leases import LeaseBoard, StoreKV, VersionBuffers
from laminar.weights.pusher import WeightPusher
from laminar.weights.relay import RelaySubscriber


def boot_id() -> str:
    """This host's boot id (one per host and boot: CUDA IPC needs the very same machine)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()


def device_uuid(index: int) -> str:
    """The UUID of the GPU this process calls `index` ("" when torch does not say)."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def resolve_device(uuid: str, visible: list[str]) -> int:
    """The index, among this process's visible GPUs (their UUIDs in order), of the GPU `uuid`.
    Raises LookupError when this process does not see it (another host, or CUDA_VISIBLE_DEVICES
    hides it): the caller falls back to the relay path."""
    if uuid and uuid in visible:
        return visible.index(uuid)
    raise LookupError(f"GPU {uuid or '?'} is not visible to this process ({len(visible)} visible)")


def visible_uuids() -> list[str]:
    """UUIDs of the GPUs this process sees, in its own index order (CUDA initialised lazily)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


# ---- CUDA IPC -----------------------------------------------------------------------------


class CudaIpcExporter:
    """Trainer side: one flat device buffer per version, an IPC handle for it, reader leases.

    GPU memory: the newest version (`keep`, default 1) plus any older one a reader still holds a
    live lease on; nothing else. The trainer's own weights are not counted: they are the model."""

    def __init__(self, board: LeaseBoard, device: Any = "cuda", keep: int = 1):
        self.device = device
        self.buffers = VersionBuffers(board, keep)
        self.handles: dict[int, CudaIpcHandle] = {}

    def export(self, version: int, named_tensors: NamedTensors) -> CudaIpcHandle:
        """Pack `version` into a device buffer and return its handle (the checksum is computed
        separately: checksum(), off the publish path)."""
        import torch

        layout, flat = pack_flat(named_tensors, self.device)
        storage = flat.untyped_storage()
        (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
            storage._share_cuda_()
        )
        index = flat.device.index if flat.device.index is not None else torch.cuda.current_device()
        msg = CudaIpcHandle(
            version=version,
            checksum="",
            layout=layout,
            device=int(device),
            device_uuid=device_uuid(index),
            handle=bytes(handle),
            storage_size=int(size),
            storage_offset=int(offset),
            ref_counter_handle=bytes(ref_handle),
            ref_counter_offset=int(ref_offset),
            event_handle=bytes(event_handle or b""),
            event_sync_required=bool(event_sync),
        )
        self.handles[version] = msg
        for v in self.buffers.add(version, flat):
            self.handles.pop(v, None)
        return msg

    def checksum(self, version: int) -> str:
        """The version's checksum, on its device (a digest: ~ms per GB on a GPU)."""
        return flat_checksum(self.buffers.buffers[version])

    def collect(self) -> list[int]:
        """Free what no reader holds any more (called on every export, and when idle)."""
        freed = self.buffers.collect()
        for v in freed:
            self.handles.pop(v, None)
        return freed

    def close(self) -> None:
        self.buffers.clear()
        self.handles.clear()


def open_cuda_ipc(
    msg: CudaIpcHandle,
    board: LeaseBoard,
    reader: str,
    ttl_s: float = 60.0,
    visible: list[str] | None = None,
) -> FlatWeights | None:
    """Rollout side (another process on the trainer's host): lease the version, then map the
    trainer's device buffer onto this process's index of that GPU. None: the version was
    withdrawn (a newer one exists). Releasing the FlatWeights drops the lease."""
    import torch

    torch.cuda.init()  # lazily, like torch's rebuild_cuda_tensor: a fresh process has no context
    index = resolve_device(msg.device_uuid, visible if visible is not None else visible_uuids())
    if not board.acquire(msg.version, reader, ttl_s):
        return None
    try:
        with torch.cuda.device(index):
            storage = torch.UntypedStorage._new_shared_cuda(
                index,
                msg.handle,
                msg.storage_size,
                msg.storage_offset,
                msg.ref_counter_handle,
                msg.ref_counter_offset,
                msg.event_handle or None,
                msg.event_sync_required,
            )
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
        flat.set_(storage, 0, (msg.layout.total_bytes,), (1,))
    except Exception:
        board.release(msg.version, reader)
        raise
    return FlatWeights(
        msg.version,
        msg.checksum,
        msg.layout,
        flat,
        on_release=lambda v: board.release(v, reader),
    )


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
        self.store = await asyncio.to_thread(open_store, self.settings, True)
        self.store.set("ipc/boot", boot_id())
        self.exporter = CudaIpcExporter(LeaseBoard(StoreKV(self.store)), self.device)
        if self.pusher is not None:
            await self.pusher.start()

    async def publish(self, version: int, step: int, tensors: dict[str, Any] | None) -> Published:
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
