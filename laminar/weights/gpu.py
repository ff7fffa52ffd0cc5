"""CUDA pieces of the weights channel: flat device buffers, CUDA IPC on one host, pinned host
memory. Their receiving ends return FlatWeights, which has the surface of the relay variant's
PulledWeights (named_tensors, verify, release), so a rollout loads either alike. The broadcast
group (NCCL on GPUs, gloo on CPU) is laminar/weights/group.py; the channel modes that use both are
laminar/weights/gpu_channel.py.

    # trainer (GPU), same host as its rollouts
    exp = CudaIpcExporter(board, device="cuda:0")       # board: a LeaseBoard (leases.py)
    handle = exp.export(version, model.state_dict())    # CudaIpcHandle message (no pickle)
    # rollout process on that host
    w = open_cuda_ipc(handle, board, reader="rollout-1")  # None: withdrawn, read a newer one
    for name, t in w.named_tensors(): param[name].copy_(t)   # device-to-device
    await w.release()                                   # the lease goes; the trainer frees later

Lifetimes: a version's buffer is freed by the exporter only when no reader holds a live lease
(leases.py), never by torch's per-share reference count: the exporter keeps its own reference
to every buffer until then, so a reader's close cannot free memory another reader still uses.
Devices: the handle names the trainer's GPU by UUID; a reader maps it onto the index that GPU
has in its own process (CUDA_VISIBLE_DEVICES renumbers), and initialises CUDA lazily first, as
torch's own rebuild_cuda_tensor does. Checksums are weights digests computed on the device
(digest.py), never a host copy. torch.cuda is imported lazily: this module imports without CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from laminar.protocol.relay import CudaIpcHandle, WeightLayout
from laminar.weights.digest import weights_digest
from laminar.weights.layout import NamedTensors, layout_of, named_list, tensor_spans
from laminar.weights.leases import LeaseBoard, VersionBuffers


def pin_host_tensor(t: Any) -> bool:
    """Page-lock a host tensor's memory (e.g. a mapped relay slot) so device-to-host copies run at
    full PCIe speed. Returns False when CUDA is absent or registration fails (copies still work).
    Undo with unpin_host_tensor before the memory is unmapped."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        return int(err) == 0
    except (RuntimeError, AttributeError):
        return False


def unpin_host_tensor(t: Any) -> bool:
    """Undo pin_host_tensor (cudaHostUnregister); False when it was not registered."""
    import torch

    if t is None or not torch.cuda.is_available():
        return False
    try:
        return int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr())) == 0
    except (RuntimeError, AttributeError):
        return False


def flat_checksum(flat: Any) -> str:
    """Checksum of a flat buffer, computed where it lives (a weights digest: digest.py)."""
    return weights_digest([("flat", flat)])


def pack_flat(named_tensors: NamedTensors, device: Any) -> tuple[WeightLayout, Any]:
    """Named tensors -> (layout, flat uint8 tensor on `device`), padding zeroed. One copy of the
    model: tensors on the host go straight into the device buffer (no intermediate)."""
    import torch

    items = named_list(named_tensors)
    layout = layout_of(items)
    flat = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    end = 0
    for (_n, t), off in zip(items, layout.offsets, strict=True):
        if off > end:
            flat[end:off].zero_()
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[off : off + src.numel()].copy_(src, non_blocking=True)
        end = off + src.numel()
    if layout.total_bytes > end:
        flat[end:].zero_()
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()
    return layout, flat


class FlatWeights:
    """A version held in one flat uint8 tensor (any device): the PulledWeights surface."""

    def __init__(
        self,
        version: int,
        checksum: str,
        layout: WeightLayout,
        flat: Any,
        on_release: Callable[[int], None] | None = None,
    ):
        self.version, self.checksum, self.layout, self.flat = version, checksum, layout, flat
        self.nbytes = layout.total_bytes
        self._on_release = on_release
        self.released = False

    def named_tensors(self) -> Iterator[tuple[str, Any]]:
        import torch

        for name, dtype, shape, off, n in tensor_spans(self.layout):
            yield name, self.flat[off : off + n].view(getattr(torch, dtype)).reshape(shape)

    def verify(self) -> bool:
        return flat_checksum(self.flat) == self.checksum

    async def release(self) -> None:
        self.release_now()

    def release_now(self) -> None:
        if not self.released:
            self.released = True
            self.flat = None
            if self._on_release is not None:
                self._on_release(self.version)

    async def __aenter__(self) -> FlatWeights:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()


# ---- devices ------------------------------------------------------------------------------


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
