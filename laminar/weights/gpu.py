"""Flat weight buffers on any device and pinned host memory: what the GPU paths of the weights
channel share. A receiving end returns FlatWeights, which has the surface of the relay mode's
PulledWeights (named_tensors, verify, release), so a rollout loads either alike. The paths that
use them: the broadcast group (group.py) and its channel mode (nccl.py), CUDA IPC on one host
(cuda_ipc.py); the relay mode's pusher pins the mapped slot it copies into (pusher.py).

    layout, flat = pack_flat(model.state_dict(), device="cuda:0")  # one flat uint8 buffer
    w = FlatWeights(version, checksum, layout, flat)
    for name, t in w.named_tensors(): param[name].copy_(t)
    pin_host_tensor(slot_tensor)            # page-locked: full-speed device-to-host copies

Checksums are weights digests computed on the device (digest.py), never a host copy. torch is
imported lazily: this module imports without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from laminar.protocol.relay import WeightLayout
from laminar.weights.digest import weights_digest
from laminar.weights.layout import NamedTensors, layout_of, named_list, tensor_spans


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
