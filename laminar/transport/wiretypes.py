"""The codec's vocabulary: message base class and registry, array annotation, limits, errors.

    @message(0x21)
    class TrajectoryDone(Message): ids: Annotated[np.ndarray, Arr(("int32",))] ...

Split from codec.py (which re-exports every public name here) so the encoder/decoder
module holds only the wire logic. Also the dtype table and the layout of an array
reference in the header, which both directions share.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

PROTOCOL_VERSION = 1

_EXT_ARRAY = 1
_DTYPE_NAMES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                "float16", "float32", "float64")  # fmt: skip
_ALLOWED_DTYPES = frozenset(_DTYPE_NAMES)
_DTYPE_CODE = {np.dtype(n): i for i, n in enumerate(_DTYPE_NAMES)}
_CODE_DTYPE = [np.dtype(n) for n in _DTYPE_NAMES]
_ITEMSIZE = [d.itemsize for d in _CODE_DTYPE]
_NCODES = len(_CODE_DTYPE)
# array reference inside the header: frame index (u16), dtype code (u8), ndim (u8), dims (u64 each)
_REF_HEAD = struct.Struct("<HBB")
_REF_1D = struct.Struct("<HBBQ")  # the common case, unpacked in one call
_REF_STRUCTS: dict[int, struct.Struct] = {}


def _ref_struct(ndim: int) -> struct.Struct:
    st = _REF_STRUCTS.get(ndim)
    if st is None:
        st = _REF_STRUCTS[ndim] = struct.Struct(f"<HBB{ndim}Q")
    return st


class ProtocolError(ValueError):
    """A frame set that is not a valid message; the text says what was wrong."""


@dataclass(frozen=True, slots=True)
class Arr:
    """Annotation for an array field: allowed dtypes and number of dims (None = any)."""

    dtypes: tuple[str, ...]
    ndim: int | None = 1
    max_elems: int | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    max_frames: int = 4096
    max_header_bytes: int = 1 << 20
    max_message_bytes: int = 2 << 30
    max_list_len: int = 1 << 20
    max_str_len: int = 1 << 20


DEFAULT_LIMITS = Limits()


class _ArrayRef:
    __slots__ = ("index", "dtype", "shape")

    def __init__(self, index: int, dtype: int, shape: tuple[int, ...]):
        self.index, self.dtype, self.shape = index, dtype, shape


class Message:
    """Base of every wire message. Subclasses are dataclasses registered with @message."""

    TYPE: ClassVar[int] = -1
    _validators: ClassVar[list[tuple[str, Any, bool]]] = []
    _plans: ClassVar[Any] = None
    _enc_plan: ClassVar[Any] = None
    _builder: ClassVar[Any] = None

    def to_dict(self) -> dict[str, Any]:
        names = type(self).__dict__.get("_field_names")
        if names is None:
            names = tuple(f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]
            type(self)._field_names = names
        return {n: getattr(self, n) for n in names}


REGISTRY: dict[int, type[Message]] = {}
_BY_NAME: dict[str, type[Message]] = {}


def message(type_id: int):
    """Class decorator: make a dataclass message and register its one-byte type id."""

    def wrap(cls):
        if not 0 <= type_id <= 255:
            raise ValueError(f"{cls.__name__}: type id must fit one byte, got {type_id}")
        if type_id in REGISTRY and REGISTRY[type_id].__name__ != cls.__name__:
            raise ValueError(f"type id {type_id:#x} used by {REGISTRY[type_id].__name__} and {cls.__name__}")
        dc = dataclass(cls, slots=True) if not dataclasses.is_dataclass(cls) else cls
        dc.TYPE = type_id
        REGISTRY[type_id] = dc
        _BY_NAME[dc.__name__] = dc
        dc._validators = None  # built lazily: annotations may name classes defined later
        dc._plans = None
        dc._enc_plan = None
        dc._builder = None
        return dc

    return wrap


def message_types() -> dict[int, type[Message]]:
    return dict(REGISTRY)
