"""Flat weight layout and checksums: how every weights variant lays out and checks a version.

Numpy only (a relay process never imports torch). Used by both ends of the weights
channel (laminar/weights/pusher.py, puller.py, gpu.py) and by the relays (laminar/relay/).

    layout = build_layout([("w", "bfloat16", (4, 8)), ("b", "float32", (8,))])
    layout = layout_of(named_list(model.state_dict()))   # the same from tensors
    validate_layout(layout)                    # bad layouts from the network raise ProtocolError
    chunk_range(i, chunk_bytes, total)          # byte range of chunk i
    d = chunk_digest(view)                      # crc32 (optionally + adler32 << 32)
    version_checksum(layout, chunk_bytes, crcs) # what WeightsReady / PulledWeights.checksum carry

A version is one flat byte buffer: each tensor at an aligned offset (ALIGN bytes, so
`torch.frombuffer(...).view(dtype)` and CUDA copies are aligned), padding zeroed by the
writer. Chunks are fixed `chunk_bytes` slices of that buffer (the last is shorter).
The version checksum hashes the layout and the per-chunk crc32s, so every hop can
check a whole version from the chunk checksums it verified, without a second pass.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from laminar.message import ProtocolError
from laminar.protocol.relay import WeightLayout

ALIGN = 256
MAX_TENSORS = 1 << 20
MAX_TOTAL_BYTES = 1 << 42  # 4 TiB: a sanity bound on sizes from the network

# dtype name -> element size; torch names without the "torch." prefix
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= int(d)
    return n


def build_layout(specs: Iterable[tuple[str, str, Sequence[int]]]) -> WeightLayout:
    """(name, dtype, shape) in order -> a layout with aligned offsets."""
    names, dtypes, shapes, offsets = [], [], [], []
    pos = 0
    for name, dtype, shape in specs:
        if dtype not in ITEMSIZE:
            raise ValueError(
                f"tensor {name!r}: dtype {dtype!r} cannot be stored; use one of {sorted(ITEMSIZE)}"
            )
        pos = align_up(pos)
        names.append(name)
        dtypes.append(dtype)
        shapes.append([int(d) for d in shape])
        offsets.append(pos)
        pos += tensor_nbytes(dtype, shape)
    return WeightLayout(
        names=names, dtypes=dtypes, shapes=shapes, offsets=offsets, total_bytes=align_up(pos)
    )


def dtype_name(t: Any) -> str:
    """A tensor's dtype as the layout names it (torch names without the prefix)."""
    return str(t.dtype).removeprefix("torch.")


NamedTensors = Mapping[str, Any] | Iterable[tuple[str, Any]]
"""A state dict or (name, tensor) pairs, in layout order."""


def named_list(named_tensors: NamedTensors) -> list[tuple[str, Any]]:
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return [(str(n), t) for n, t in items]


def layout_of(items: list[tuple[str, Any]]) -> WeightLayout:
    return build_layout((n, dtype_name(t), tuple(t.shape)) for n, t in items)


def tensors_nbytes(tensors: dict[str, Any]) -> int:
    """The bytes of a version's tensors, without padding (Published.num_bytes)."""
    return sum(v.numel() * v.element_size() for v in tensors.values())


def validate_layout(layout: WeightLayout) -> None:
    """Reject a layout that would map outside the buffer, overlap, or misalign (ProtocolError)."""
    n = len(layout.names)
    if n > MAX_TENSORS:
        raise ProtocolError(f"layout has {n} tensors, limit {MAX_TENSORS}")
    if not (len(layout.dtypes) == len(layout.shapes) == len(layout.offsets) == n):
        raise ProtocolError("layout lists (names, dtypes, shapes, offsets) differ in length")
    if not 0 <= layout.total_bytes <= MAX_TOTAL_BYTES:
        raise ProtocolError(f"layout total_bytes {layout.total_bytes} out of range")
    if len(set(layout.names)) != n:
        raise ProtocolError("layout has duplicate tensor names")
    end = 0
    for name, dtype, shape, off in zip(
        layout.names, layout.dtypes, layout.shapes, layout.offsets, strict=True
    ):
        if dtype not in ITEMSIZE:
            raise ProtocolError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if any(d < 0 for d in shape):
            raise ProtocolError(f"tensor {name!r}: negative dimension in {shape}")
        if off < end or off % ITEMSIZE[dtype]:
            raise ProtocolError(
                f"tensor {name!r}: offset {off} overlaps the previous tensor or is misaligned"
            )
        end = off + tensor_nbytes(dtype, shape)
        if end > layout.total_bytes:
            raise ProtocolError(
                f"tensor {name!r} ends at {end}, past total_bytes {layout.total_bytes}"
            )


def tensor_spans(layout: WeightLayout) -> Iterator[tuple[str, str, list[int], int, int]]:
    """(name, dtype, shape, offset, nbytes) of every tensor: where a reader views each one."""
    for name, dtype, shape, off in zip(
        layout.names, layout.dtypes, layout.shapes, layout.offsets, strict=True
    ):
        yield name, dtype, shape, off, tensor_nbytes(dtype, shape)


def n_chunks(total: int, chunk_bytes: int) -> int:
    return max(1, -(-total // chunk_bytes))


def chunk_range(index: int, chunk_bytes: int, total: int) -> tuple[int, int]:
    start = index * chunk_bytes
    return start, min(total, start + chunk_bytes)


def chunk_digest(buf: np.ndarray | memoryview, with_adler: bool = False) -> int:
    """crc32 of a chunk (fast, releases the GIL); `with_adler` adds adler32 in the high bits
    (a 64-bit fingerprint; the relays' delta mode now checks rebuilt chunks on the crc32)."""
    view = buf.data if isinstance(buf, np.ndarray) else buf
    crc = zlib.crc32(view)
    return crc | (zlib.adler32(view) << 32) if with_adler else crc


def crc_of(digest: int) -> int:
    return digest & 0xFFFFFFFF


def layout_bytes(layout: WeightLayout) -> bytes:
    return msgpack.packb(
        [layout.names, layout.dtypes, layout.shapes, layout.offsets, layout.total_bytes]
    )


def version_checksum(
    layout: WeightLayout, chunk_bytes: int, crcs: Sequence[int] | np.ndarray
) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(layout_bytes(layout))
    h.update(int(chunk_bytes).to_bytes(8, "little"))
    h.update(np.asarray(crcs, dtype="<u4").tobytes())
    return h.hexdigest()


def checksum_buffer(layout: WeightLayout, chunk_bytes: int, buf: np.ndarray) -> str:
    """Recompute a version checksum from the bytes themselves (readers verifying what they read)."""
    total = layout.total_bytes
    crcs = [
        zlib.crc32(buf[s:e].data)
        for s, e in (
            chunk_range(i, chunk_bytes, total) for i in range(n_chunks(total, chunk_bytes))
        )
    ]
    return version_checksum(layout, chunk_bytes, crcs)
