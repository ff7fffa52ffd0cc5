"""Move a set of tensors' storage to host memory and back (colocated placement: trainer and
rollouts time-sharing one device).

    stash = HostStash()
    moved = stash.offload(tensors)   # each one's values copied to host (pinned on CUDA), its own
                                     # storage replaced by an empty one: the device memory is freed
    ...                              # (the other phase runs on the device)
    back = stash.restore()           # the values back on their device, into the same objects

The tensor objects stay the same ones (`t.data` is swapped, not the object), so whatever holds a
reference keeps working after restore: the optimizer's param groups and state, the torch engine's
LeanDecoder, an FSDP-free module's parameters. While offloaded each tensor has no elements, so a
forward, a step or an export through it fails loudly instead of computing on garbage.

On a CPU device the "host" copy is a second CPU buffer and the tensor's own storage is still
freed, so the bytes and seconds measured on CPU are those of a real copy (bench/colocate.py).
The trainer (trainer/torch_trainer.py) and the torch engine (engines/torch_engine.py) use it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Moved:
    """One offload or restore: how many bytes moved and how long it took."""

    nbytes: int
    seconds: float
    tensors: int


class HostStash:
    def __init__(self) -> None:
        self._held: list[tuple[torch.Tensor, torch.Tensor, torch.device]] = []
        """(the tensor, its host copy, the device it came from), in offload order."""

    @property
    def offloaded(self) -> bool:
        return bool(self._held)

    @property
    def nbytes(self) -> int:
        """Bytes held in host memory now."""
        return sum(host.numel() * host.element_size() for _, host, _ in self._held)

    def offload(self, tensors: Iterable[torch.Tensor]) -> Moved:
        """Copy each tensor to host memory and free its own storage. A tensor seen twice (tied
        weights) moves once; an empty one is left alone."""
        if self._held:
            raise RuntimeError("HostStash.offload: already offloaded (restore first)")
        t0 = time.perf_counter()
        seen: set[int] = set()
        cuda = False
        for t in tensors:
            if id(t) in seen or t.numel() == 0:
                continue
            seen.add(id(t))
            device = t.device
            with torch.no_grad():
                if device.type == "cuda":
                    cuda = True
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    host.copy_(t.data, non_blocking=True)
                else:
                    host = t.data.to("cpu", copy=True)
            self._held.append((t, host, device))
        if cuda:
            torch.cuda.synchronize()  # the host copies must be complete before the storage goes
        for t, _, device in self._held:
            t.data = torch.empty(0, dtype=t.dtype, device=device)
        if cuda:
            torch.cuda.empty_cache()  # hand the freed blocks back, for the other process
        return Moved(self.nbytes, time.perf_counter() - t0, len(self._held))

    def restore(self) -> Moved:
        """Every offloaded tensor back on its device with its values (no-op when none is)."""
        t0 = time.perf_counter()
        nbytes, count = self.nbytes, len(self._held)
        cuda = False
        for t, host, device in self._held:
            cuda = cuda or device.type == "cuda"
            t.data = host.to(device, non_blocking=True) if device.type != "cpu" else host
        if cuda:
            torch.cuda.synchronize()
        self._held = []
        return Moved(nbytes, time.perf_counter() - t0, count)


def device_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the given tensors hold in their own storage (0 for an offloaded one)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
