"""A weight version written tensor by tensor as the trainer gathers it (a streamed export).

    sink = FlatSink(segment_tensor, layout, digest=True)  # a relay slot, mapped (pusher.py)
    trainer.export_into(sink)       # compute thread: gather layer i+1 while layer i is written
    digest = sink.finish(timeout)   # every tensor written (raises otherwise): commit, then announce

    sink = DictSink()               # publishers that need the whole version at once
    trainer.export_into(sink); sink.tensors

    trainer (compute thread)          writer thread (FlatSink)
    gather t0 ─► cast ─► put(t0) ──► queue (depth 2) ──► copy t0's bytes to its layout offset
    gather t1 ─► cast ─► put(t1) ──►                     (device-to-host for a CUDA tensor),
    ...                                                   fold t0 for the digest, copy t1, ...

`put` takes tensors in layout order and checks each against the layout (name, dtype, shape);
a tensor the layout does not expect, a writer that failed, or a version with tensors missing
makes `finish` raise: the caller then does not commit, so no reader ever sees a partial
version. The bytes written are those `write_flat` writes for the same tensors (padding
zeroed), and the digest is `weights_digest` of them.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Protocol

from laminar.protocol.relay import WeightLayout
from laminar.weights.digest import FoldRecord, fold_record, records_digest
from laminar.weights.layout import dtype_name, tensor_spans


class IncompleteVersion(RuntimeError):
    """A streamed version did not receive every tensor its layout names, in order: never
    committed."""


class VersionSink(Protocol):
    def put(self, name: str, tensor: Any) -> None:
        """The next tensor of the version (layout order); may return before it is written."""
        ...


class DictSink:
    """Collects the version (the unstreamed path: the whole version, then the handoff)."""

    def __init__(self) -> None:
        self.tensors: dict[str, Any] = {}

    def put(self, name: str, tensor: Any) -> None:
        self.tensors[name] = tensor


_END = None


def bytes_of(t: Any) -> Any:
    """A tensor as a flat uint8 tensor (same device); one copy only if it is not contiguous."""
    import torch

    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class FlatSink:
    """Writes a version into a flat uint8 torch buffer at its layout's offsets, on a writer
    thread of its own, so the caller gathers the next tensor meanwhile."""

    def __init__(self, dst: Any, layout: WeightLayout, *, digest: bool, depth: int = 2):
        self.dst, self.layout, self.digest = dst, layout, digest
        self.spans = list(tensor_spans(layout))
        self._q: queue.Queue[tuple[int, Any] | None] = queue.Queue(maxsize=depth)
        self._next = 0
        self._error: BaseException | None = None
        self._closed = False
        self._folds: list[FoldRecord] = []
        self._written_to = 0  # end of the last tensor written (the padding after it is zeroed)
        self._thread = threading.Thread(target=self._run, name="weights-sink", daemon=True)
        self._thread.start()

    def put(self, name: str, tensor: Any) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise IncompleteVersion("the version was aborted")
        if self._next >= len(self.spans):
            raise IncompleteVersion(f"tensor {name!r} is past the end of the layout")
        want, dtype, shape, _, _ = self.spans[self._next]
        got = (name, dtype_name(tensor), [int(d) for d in tensor.shape])
        if got != (want, dtype, shape):
            raise IncompleteVersion(f"tensor {got} where the layout expects {(want, dtype, shape)}")
        while True:  # a bounded wait: abort() may end the writer while the queue is full
            try:
                self._q.put((self._next, tensor), timeout=0.5)
                break
            except queue.Full:
                if self._closed:
                    raise IncompleteVersion("the version was aborted") from None
        self._next += 1

    def _run(self) -> None:
        flat = self.dst.numpy()
        while True:
            item = self._q.get()
            if item is _END:
                return
            if self._error is not None:  # drain: the caller learns of it at its next put
                continue
            try:
                self._write(flat, *item)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                self._error = exc

    def _write(self, flat: Any, index: int, tensor: Any) -> None:
        import numpy as np

        name, _, shape, off, nbytes = self.spans[index]
        if off > self._written_to:
            flat[self._written_to : off] = 0
        src = bytes_of(tensor)
        if nbytes:
            if src.device.type == "cpu":
                np.copyto(flat[off : off + nbytes], src.numpy())
            else:  # device to host, straight into the buffer
                self.dst[off : off + nbytes].copy_(src)
        self._written_to = off + nbytes
        if self.digest:  # the bytes just written, as the tensor they are
            view = self.dst[off : off + nbytes].view(tensor.dtype).reshape(shape)
            self._folds.append(fold_record(name, view))

    def finish(self, timeout: float) -> str:
        """Wait for every write; the version's digest ("" unless asked). Raises the writer's error,
        IncompleteVersion if tensors are missing, TimeoutError past `timeout`."""
        self._stop(timeout)
        if self._error is not None:
            raise self._error
        if self._next != len(self.spans):
            raise IncompleteVersion(f"{self._next} of {len(self.spans)} tensors were exported")
        total = self.layout.total_bytes
        if total > self._written_to:
            self.dst.numpy()[self._written_to : total] = 0
        return records_digest(self._folds) if self.digest else ""

    def close(self) -> None:
        """Stop writing without waiting (a failed or abandoned version); later puts raise and the
        writer thread ends after the write in hand."""
        if not self._closed:
            self._closed = True
            try:
                self._q.put_nowait(_END)
            except queue.Full:  # the writer ends at its next look at the queue: drain it for it
                self._drain_for_end()

    def _drain_for_end(self) -> None:
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._q.put_nowait(_END)

    def _stop(self, timeout: float) -> None:
        if not self._closed:
            self._closed = True
            self._q.put(_END, timeout=timeout)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the weights writer did not finish within {timeout}s")
