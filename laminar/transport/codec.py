"""Wire codec: one-byte type frame + msgpack header + out-of-band array frames.

    frames = encode(TrajectoryDone(...))   # [b"\x21", header, ids_buffer, logprobs_buffer]
    msg = decode(frames)                   # validated TrajectoryDone; arrays are zero-copy views

Every message is a dataclass registered with a unique one-byte type id. The
header is a msgpack map of the fields; numpy arrays (anywhere, including inside
nested messages and lists) are replaced by an ext reference `(frame, dtype,
shape)` and travel as their own frame without copying. Decoding validates the
type id, the field names and types, dtypes, shapes and size limits, and raises
`ProtocolError` for anything wrong. Never pickle.

Field annotations the validator understands: bool, int, float, str, bytes,
`X | None`, `list[X]`, `dict[str, X]`, `Any` (plain msgpack data, no arrays),
another Message subclass, and `Arr(dtypes, ndim)` for numpy arrays.
"""

from __future__ import annotations

import dataclasses
import struct
import threading
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, get_args, get_origin, get_type_hints

import msgpack
import numpy as np

PROTOCOL_VERSION = 1

_EXT_ARRAY = 1
_DTYPE_NAMES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                "float16", "float32", "float64")  # fmt: skip
_ALLOWED_DTYPES = frozenset(_DTYPE_NAMES)
_DTYPE_CODE = {np.dtype(n): i for i, n in enumerate(_DTYPE_NAMES)}
_CODE_DTYPE = [np.dtype(n) for n in _DTYPE_NAMES]
# array reference inside the header: frame index (u16), dtype code (u8), ndim (u8), dims (u64 each)
_REF_HEAD = struct.Struct("<HBB")


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
        return dc

    return wrap


def message_types() -> dict[int, type[Message]]:
    return dict(REGISTRY)


# ---- encoding -------------------------------------------------------------------------


def _to_array(obj: Any) -> np.ndarray | None:
    if isinstance(obj, np.ndarray):
        return obj
    if type(obj).__module__ == "torch" and type(obj).__name__ == "Tensor":
        # CPU tensors only; a CUDA tensor must move through a weight transport, not here.
        return obj.detach().numpy()
    return None


class _EncodeState(threading.local):
    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.packer = msgpack.Packer(default=self._default, use_bin_type=True, autoreset=True)

    def _default(self, obj: Any) -> Any:
        arr = _to_array(obj)
        if arr is not None:
            code = _DTYPE_CODE.get(arr.dtype)
            if code is None:
                raise TypeError(f"array dtype {arr.dtype} cannot travel; use one of {_DTYPE_NAMES}")
            if not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr)
            frames = self.frames
            frames.append(memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else b"")
            ref = _REF_HEAD.pack(len(frames) - 3, code, arr.ndim) + struct.pack(f"<{arr.ndim}Q", *arr.shape)
            return msgpack.ExtType(_EXT_ARRAY, ref)
        if isinstance(obj, Message):
            return obj.to_dict()
        if isinstance(obj, tuple):
            return list(obj)
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"cannot encode {type(obj).__name__}")


_ENC = _EncodeState()


def encode(msg: Message) -> list[Any]:
    """Frames for a message: [type byte, header, *array buffers] (arrays zero-copy)."""
    st = _ENC
    frames: list[Any] = [bytes((msg.TYPE,)), b""]
    st.frames = frames
    try:
        frames[1] = st.packer.pack(msg.to_dict())
    except TypeError as exc:
        st.packer.reset()
        raise TypeError(f"{type(msg).__name__}: {exc}") from None
    finally:
        st.frames = []
    return frames


# ---- decoding -------------------------------------------------------------------------


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_ARRAY:
        raise ProtocolError(f"unknown msgpack ext type {code}")
    if len(data) < 4:
        raise ProtocolError("truncated array reference")
    index, dcode, ndim = _REF_HEAD.unpack_from(data)
    if len(data) != 4 + 8 * ndim:
        raise ProtocolError(f"array reference of {len(data)} bytes does not fit ndim={ndim}")
    if dcode >= len(_CODE_DTYPE):
        raise ProtocolError(f"unknown array dtype code {dcode}")
    return _ArrayRef(index, dcode, struct.unpack_from(f"<{ndim}Q", data, 4))


class _Ctx:
    __slots__ = ("frames", "used", "limits", "where")

    def __init__(self, frames: list[Any], limits: Limits):
        self.frames, self.used, self.limits = frames, set(), limits


def _fail(path: str, what: str) -> typing.NoReturn:
    raise ProtocolError(f"{path}: {what}")


def _build_validator(tp: Any):  # noqa: C901 - a small type interpreter
    """Compile an annotation into fn(value, ctx, path) -> converted value."""
    if tp is Any:

        def v_any(x, ctx, path):
            if isinstance(x, _ArrayRef):
                _fail(path, "arrays are not allowed in a free-form field")
            if isinstance(x, list):
                for i, item in enumerate(x):
                    v_any(item, ctx, f"{path}[{i}]")
            elif isinstance(x, dict):
                for k, item in x.items():
                    v_any(item, ctx, f"{path}.{k}")
            return x

        return v_any
    if isinstance(tp, Arr):
        spec = tp
        bad = [d for d in spec.dtypes if d not in _ALLOWED_DTYPES]
        if bad:
            raise TypeError(f"Arr dtypes {bad} cannot travel; use {_DTYPE_NAMES}")
        codes = frozenset(_DTYPE_NAMES.index(d) for d in spec.dtypes)

        def v_arr(x, ctx, path):
            if not isinstance(x, _ArrayRef):
                _fail(path, f"expected an array, got {type(x).__name__}")
            dt = _CODE_DTYPE[x.dtype]
            if x.dtype not in codes:
                _fail(path, f"dtype {dt.name!r} not allowed (want one of {list(spec.dtypes)})")
            if spec.ndim is not None and len(x.shape) != spec.ndim:
                _fail(path, f"expected {spec.ndim}-d array, got shape {x.shape}")
            n = 1
            for d in x.shape:
                n *= d
            if spec.max_elems is not None and n > spec.max_elems:
                _fail(path, f"array has {n} elements, limit {spec.max_elems}")
            fi = x.index + 2
            if not 2 <= fi < len(ctx.frames):
                _fail(path, f"array refers to missing frame {x.index}")
            if fi in ctx.used:
                _fail(path, f"frame {x.index} referenced twice")
            ctx.used.add(fi)
            buf = ctx.frames[fi]
            buf = buf.buffer if hasattr(buf, "buffer") else buf
            if len(buf) != n * dt.itemsize:
                _fail(path, f"frame has {len(buf)} bytes, shape {x.shape} of {x.dtype} needs {n * dt.itemsize}")
            if not n:
                return np.zeros(x.shape, dt)
            a = np.frombuffer(buf, dtype=dt)
            return a if len(x.shape) == 1 else a.reshape(x.shape)

        return v_arr
    if isinstance(tp, type) and issubclass(tp, Message):
        cls = tp

        def v_msg(x, ctx, path):
            if not isinstance(x, dict):
                _fail(path, f"expected a {cls.__name__} map, got {type(x).__name__}")
            return _build_message(cls, x, ctx, path)

        return v_msg
    origin = get_origin(tp)
    if origin is typing.Annotated:
        base, *meta = get_args(tp)
        for m in meta:
            if isinstance(m, Arr):
                return _build_validator(m)
        return _build_validator(base)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        inner = [a for a in args if a is not type(None)]
        subs = [_build_validator(a) for a in inner]
        nullable = len(inner) != len(args)

        def v_union(x, ctx, path):
            if x is None:
                if nullable:
                    return None
                _fail(path, "must not be null")
            errors = []
            for sub in subs:
                try:
                    return sub(x, ctx, path)
                except ProtocolError as exc:
                    errors.append(str(exc))
            _fail(path, "; ".join(errors) if len(errors) == 1 else f"matches no allowed type ({errors})")

        return v_union
    if origin in (list, tuple):
        args = get_args(tp)
        item = _build_validator(args[0] if args else Any)

        def v_list(x, ctx, path):
            if not isinstance(x, list):
                _fail(path, f"expected a list, got {type(x).__name__}")
            if len(x) > ctx.limits.max_list_len:
                _fail(path, f"list of {len(x)} items exceeds {ctx.limits.max_list_len}")
            return [item(e, ctx, f"{path}[{i}]") for i, e in enumerate(x)]

        return v_list
    if origin is dict:
        args = get_args(tp)
        val = _build_validator(args[1] if args else Any)

        def v_dict(x, ctx, path):
            if not isinstance(x, dict):
                _fail(path, f"expected a map, got {type(x).__name__}")
            out = {}
            for k, e in x.items():
                if not isinstance(k, str):
                    _fail(path, f"map keys must be strings, got {type(k).__name__}")
                out[k] = val(e, ctx, f"{path}.{k}")
            return out

        return v_dict
    if tp is bool:

        def v_bool(x, ctx, path):
            if not isinstance(x, bool):
                _fail(path, f"expected bool, got {type(x).__name__}")
            return x

        return v_bool
    if tp is int:

        def v_int(x, ctx, path):
            if not isinstance(x, int) or isinstance(x, bool):
                _fail(path, f"expected int, got {type(x).__name__}")
            return x

        return v_int
    if tp is float:

        def v_float(x, ctx, path):
            if isinstance(x, bool) or not isinstance(x, int | float):
                _fail(path, f"expected float, got {type(x).__name__}")
            return float(x)

        return v_float
    if tp is str:

        def v_str(x, ctx, path):
            if not isinstance(x, str):
                _fail(path, f"expected str, got {type(x).__name__}")
            return x

        return v_str
    if tp is bytes:

        def v_bytes(x, ctx, path):
            if not isinstance(x, bytes):
                _fail(path, f"expected bytes, got {type(x).__name__}")
            return x

        return v_bytes
    raise TypeError(f"codec cannot validate annotation {tp!r}")


def _validators(cls: type[Message]) -> list[tuple[str, Any, bool]]:
    vals = cls._validators
    if vals is None:
        hints = get_type_hints(cls, include_extras=True)
        vals = []
        for f in dataclasses.fields(cls):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            vals.append((f.name, _build_validator(hints[f.name]), required))
        cls._validators = vals
    return vals


def _build_message(cls: type[Message], data: dict, ctx: _Ctx, path: str) -> Message:
    kwargs = {}
    vals = _validators(cls)
    for name, validate, required in vals:
        if name in data:
            kwargs[name] = validate(data[name], ctx, f"{path}.{name}")
        elif required:
            _fail(path, f"missing field {name!r}")
    if len(data) > len(kwargs):
        known = {n for n, _, _ in vals}
        extra = sorted(str(k) for k in data if k not in known)
        _fail(path, f"unknown field(s) {extra}")
    return cls(**kwargs)


def decode(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and decode frames (bytes or zmq.Frame) into a message, or raise ProtocolError."""
    if not isinstance(frames, list | tuple) or len(frames) < 2:
        raise ProtocolError(f"a message needs at least 2 frames (type, header), got {len(frames) if isinstance(frames, list | tuple) else type(frames).__name__}")
    if len(frames) > limits.max_frames:
        raise ProtocolError(f"{len(frames)} frames exceeds the limit {limits.max_frames}")
    bufs = [f.buffer if hasattr(f, "buffer") else f for f in frames]
    tframe = bufs[0]
    if len(tframe) != 1:
        raise ProtocolError(f"type frame must be 1 byte, got {len(tframe)}")
    type_id = bytes(tframe)[0]
    cls = REGISTRY.get(type_id)
    if cls is None:
        raise ProtocolError(f"unknown message type {type_id:#04x}")
    header = bufs[1]
    if len(header) > limits.max_header_bytes:
        raise ProtocolError(f"{cls.__name__}: header of {len(header)} bytes exceeds {limits.max_header_bytes}")
    total = sum(len(b) for b in bufs)
    if total > limits.max_message_bytes:
        raise ProtocolError(f"{cls.__name__}: message of {total} bytes exceeds {limits.max_message_bytes}")
    try:
        data = msgpack.unpackb(
            header,
            raw=False,
            ext_hook=_ext_hook,
            strict_map_key=True,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_header_bytes,
            max_array_len=limits.max_list_len,
            max_map_len=limits.max_list_len,
        )
    except ProtocolError as exc:
        raise ProtocolError(f"{cls.__name__}: {exc}") from None
    except Exception as exc:  # msgpack raises many types on garbage
        raise ProtocolError(f"{cls.__name__}: header is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"{cls.__name__}: header must be a map, got {type(data).__name__}")
    ctx = _Ctx(bufs, limits)
    try:
        msg = _build_message(cls, data, ctx, cls.__name__)
    except ProtocolError:
        raise
    except (TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"{cls.__name__}: {type(exc).__name__}: {exc}") from None
    if len(ctx.used) != len(bufs) - 2:
        raise ProtocolError(f"{cls.__name__}: {len(bufs) - 2 - len(ctx.used)} array frame(s) not referenced by the header")
    return msg


def roundtrip(msg: Message) -> Message:
    """encode + decode with copied bytes (tests and debugging)."""
    return decode([bytes(f) for f in encode(msg)])
