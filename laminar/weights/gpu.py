"""GPU variants of the weights channel: CUDA IPC (same host) and NCCL / torch.distributed
broadcast (across hosts). Their receiving ends return FlatWeights, which has the surface of the
relay variant's PulledWeights (named_tensors, verify, release), so a rollout loads either alike.

    # trainer (GPU), same host as its rollouts
    exp = CudaIpcExporter(device="cuda:0", keep=2)
    handle = exp.export(version, model.state_dict())    # CudaIpcHandle message (no pickle)
    # rollout process on that host
    w = open_cuda_ipc(handle)                           # same surface as PulledWeights
    for name, t in w.named_tensors(): param[name].copy_(t)   # device-to-device
    await w.release(); exp.release(version)             # (the trainer frees after every reader did)

    # NCCL (backend "nccl" on GPUs, "gloo" on CPU: the tests run the same code on CPU)
    group = WeightBroadcastGroup(rank, world_size, init_method="tcp://10.0.0.1:29555")
    group.send(version, named_tensors)               # rank 0 (trainer)
    w = group.recv()                                 # every other rank: a PulledWeights-like object

Both pack a version into one flat uint8 buffer with the channel's layout
(laminar/weights/layout.py), so offsets, dtypes (bf16 included) and the checksum are the ones the
CPU path uses. Control data travels as our codec's messages (CudaIpcHandle, NcclAnnounce encoded to
bytes), never pickle. torch.cuda / torch.distributed are imported lazily: this module
imports without CUDA. Status: written against torch's documented IPC and c10d APIs;
the CUDA paths are covered by `gpu`-marked tests that were not run on this CPU machine.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from typing import Any

from laminar.protocol.relay import CudaIpcHandle, NcclAnnounce, WeightLayout
from laminar.transport.codec import decode, encode
from laminar.weights.layout import (
    NamedTensors,
    chunk_range,
    layout_of,
    n_chunks,
    named_list,
    tensor_spans,
    version_checksum,
)

IPC_CHUNK = 64 << 20  # checksum granularity of GPU versions (computed on the host copy)


def pin_host_tensor(t: Any) -> bool:
    """Page-lock a host tensor's memory (e.g. a mapped relay slot) so device-to-host copies run at
    full PCIe speed. Returns False when CUDA is absent or registration fails (copies still work)."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        return int(err) == 0
    except (RuntimeError, AttributeError):
        return False


def _flat_checksum(layout: WeightLayout, flat: Any) -> str:
    """Version checksum of a flat device buffer: crc32 per IPC_CHUNK of its host copy."""
    host = flat.cpu().numpy()
    crcs = [
        zlib.crc32(host[slice(*chunk_range(i, IPC_CHUNK, layout.total_bytes))])
        for i in range(n_chunks(layout.total_bytes, IPC_CHUNK))
    ]
    return version_checksum(layout, IPC_CHUNK, crcs)


def pack_flat(named_tensors: NamedTensors, device: Any) -> tuple[WeightLayout, Any]:
    """Named tensors -> (layout, flat uint8 tensor on `device`), padding zeroed."""
    import torch

    items = named_list(named_tensors)
    layout = layout_of(items)
    flat = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
    for (_n, t), off in zip(items, layout.offsets, strict=True):
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[off : off + src.numel()].copy_(src, non_blocking=True)
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
        return _flat_checksum(self.layout, self.flat) == self.checksum

    async def release(self) -> None:
        if not self.released:
            self.released = True
            self.flat = None
            if self._on_release is not None:
                self._on_release(self.version)

    async def __aenter__(self) -> FlatWeights:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()


class CudaIpcExporter:
    """Trainer side: keep the last `keep` versions in device buffers and hand out IPC handles.

    A buffer must outlive every reader's use of it: the trainer releases version v (from
    the readers' acks, or when `keep` newer versions exist) and pays `keep` model copies
    of GPU memory for it, the cost the paper names for GPU-direct sync."""

    def __init__(self, device: Any = "cuda", keep: int = 2):
        self.device, self.keep = device, keep
        self.buffers: dict[int, tuple[Any, CudaIpcHandle]] = {}

    def export(self, version: int, named_tensors: NamedTensors) -> CudaIpcHandle:
        layout, flat = pack_flat(named_tensors, self.device)
        storage = flat.untyped_storage()
        (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
            storage._share_cuda_()
        )
        msg = CudaIpcHandle(
            version=version,
            checksum=_flat_checksum(layout, flat),
            layout=layout,
            device=int(device),
            handle=bytes(handle),
            storage_size=int(size),
            storage_offset=int(offset),
            ref_counter_handle=bytes(ref_handle),
            ref_counter_offset=int(ref_offset),
            event_handle=bytes(event_handle or b""),
            event_sync_required=bool(event_sync),
        )
        self.buffers[version] = (flat, msg)
        for old in sorted(self.buffers)[: -self.keep]:
            self.buffers.pop(old)
        return msg

    def release(self, version: int) -> None:
        self.buffers.pop(version, None)


def open_cuda_ipc(
    msg: CudaIpcHandle, on_release: Callable[[int], None] | None = None
) -> FlatWeights:
    """Rollout side (another process on the trainer's host): map the trainer's device buffer."""
    import torch

    storage = torch.UntypedStorage._new_shared_cuda(
        msg.device,
        msg.handle,
        msg.storage_size,
        msg.storage_offset,
        msg.ref_counter_handle,
        msg.ref_counter_offset,
        msg.event_handle or None,
        msg.event_sync_required,
    )
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{msg.device}")
    flat.set_(storage, 0, (msg.layout.total_bytes,), (1,))
    return FlatWeights(msg.version, msg.checksum, msg.layout, flat, on_release)


class WeightBroadcastGroup:
    """torch.distributed broadcast of versions from rank 0 (trainer) to every other rank.

    Each version is two broadcasts: the NcclAnnounce message (our codec, as a uint8 tensor,
    preceded by its length) and the flat buffer. Receivers allocate from the layout, so
    nothing about the model needs to be known in advance."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        init_method: str,
        backend: str = "nccl",
        device: Any = None,
    ):
        import torch
        import torch.distributed as dist

        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(
            device or (f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu")
        )
        self.group = dist.new_group(backend=backend) if dist.is_initialized() else None
        if self.group is None:
            dist.init_process_group(
                backend=backend, init_method=init_method, rank=rank, world_size=world_size
            )

    def _bcast(self, t: Any) -> None:
        import torch.distributed as dist

        dist.broadcast(t, src=0, group=self.group)

    def send(self, version: int, named_tensors: NamedTensors) -> str:
        import numpy as np
        import torch

        layout, flat = pack_flat(named_tensors, self.device)
        checksum = _flat_checksum(layout, flat)
        header = b"".join(
            bytes(f)
            for f in encode(NcclAnnounce(version=version, checksum=checksum, layout=layout))
        )
        head = torch.from_numpy(np.frombuffer(header, dtype=np.uint8).copy()).to(self.device)
        self._bcast(torch.tensor([len(header)], dtype=torch.int64, device=self.device))
        self._bcast(head)
        self._bcast(flat)
        return checksum

    def recv(self) -> FlatWeights:
        import torch

        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._bcast(n)
        head = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        self._bcast(head)
        raw = head.cpu().numpy().tobytes()
        msg = decode([raw[:1], raw[1:]])  # type byte + msgpack header (NcclAnnounce has no arrays)
        if not isinstance(msg, NcclAnnounce):
            raise TypeError(f"expected NcclAnnounce, got {type(msg).__name__}")
        flat = torch.empty(msg.layout.total_bytes, dtype=torch.uint8, device=self.device)
        self._bcast(flat)
        return FlatWeights(msg.version, msg.checksum, msg.layout, flat)

    def close(self) -> None:
        import torch.distributed as dist

        if self.group is None and dist.is_initialized():
            dist.destroy_process_group()
