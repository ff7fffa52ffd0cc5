"""Wire codec: one-byte type frame + msgpack header + out-of-band array frames.

    frames = encode(TrajectoryDone(...))   # [b"\x21", header, ids_buffer, logprobs_buffer]
    msg = decode(frames)                   # validated TrajectoryDone; arrays are zero-copy views

Every message is a dataclass registered with a unique one-byte type id. The
header is a msgpack map of the fields; numpy arrays (anywhere, including inside
nested messages and lists) are replaced by an ext reference `(frame, dtype,
shape)` and travel as their own frame without copying. Decoding validates the
type id, the field names and types, dtypes, shapes and size limits, and raises
`ProtocolError` for anything wrong. Never pickle. The message base class, registry, `Arr`,
`Limits` and `ProtocolError` live in wiretypes.py and are re-exported here.

Field annotations the validator understands: bool, int, float, str, bytes,
`X | None`, `list[X]`, `dict[str, X]`, `Any` (plain msgpack data, no arrays),
another Message subclass, and `Arr(dtypes, ndim)` for numpy arrays.

Speed (bench/transport.py): each class compiles a field plan once. Encoding fills the
header map straight from the plan and turns top-level arrays into references without
a msgpack callback. Decoding accepts a scalar field whose exact type already matches
without calling its validator (msgpack only yields exact builtin types), and checks
free-form `Any` fields by counting array references instead of walking them: every
reference the unpacker created must be consumed by an `Arr` field, otherwise the
message is decoded again in strict mode, which names the offending path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import types
import typing
from collections.abc import Callable
from typing import Any, get_args, get_origin, get_type_hints

import msgpack
import numpy as np

from laminar.transport.wiretypes import (  # noqa: F401 - public names re-exported
    _ALLOWED_DTYPES,
    _BY_NAME,
    _CODE_DTYPE,
    _DTYPE_CODE,
    _DTYPE_NAMES,
    _EXT_ARRAY,
    _ITEMSIZE,
    _NCODES,
    _REF_1D,
    _REF_HEAD,
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    REGISTRY,
    Arr,
    Limits,
    Message,
    ProtocolError,
    _ArrayRef,
    _ref_struct,
    message,
    message_types,
)

_TYPE_BYTES = [bytes((i,)) for i in range(256)]
# msgpack.ExtType.__new__ re-validates its arguments in Python (~0.5 us); ours are valid by construction
_new_ext = functools.partial(tuple.__new__, msgpack.ExtType)
_MISSING = object()


# ---- encoding -------------------------------------------------------------------------


def _to_array(obj: Any) -> np.ndarray | None:
    if isinstance(obj, np.ndarray):
        return obj
    if type(obj).__module__ == "torch" and type(obj).__name__ == "Tensor":
        # CPU tensors only; a CUDA tensor must move through a weight transport, not here.
        return obj.detach().numpy()
    return None


def _array_ref(arr: np.ndarray, frames: list[Any]) -> msgpack.ExtType:
    """Append the array's bytes as a frame (zero-copy when contiguous); return its header reference."""
    code = _DTYPE_CODE.get(arr.dtype)
    if code is None:
        raise TypeError(f"array dtype {arr.dtype} cannot travel; use one of {_DTYPE_NAMES}")
    if arr.size:
        view = memoryview(arr)
        if not view.c_contiguous:
            view = memoryview(np.ascontiguousarray(arr))
        frames.append(view.cast("B"))  # flat bytes: len() of the frame is its byte count
    else:
        frames.append(b"")
    ndim = arr.ndim
    return _new_ext((_EXT_ARRAY, _ref_struct(ndim).pack(len(frames) - 3, code, ndim, *arr.shape)))


def _enc_plan(cls: type[Message]) -> tuple[tuple[str, bool], ...]:
    """(field name, is an Arr field) per field, in order."""
    plan = cls.__dict__.get("_enc_plan")
    if plan is None:
        hints = get_type_hints(cls, include_extras=True)
        plan = tuple((f.name, _is_arr(hints[f.name])) for f in dataclasses.fields(cls))
        cls._enc_plan = plan
    return plan


def _is_arr(tp: Any) -> bool:
    if isinstance(tp, Arr):
        return True
    return get_origin(tp) is typing.Annotated and any(isinstance(m, Arr) for m in get_args(tp)[1:])


class _EncodeState(threading.local):
    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.packer = msgpack.Packer(default=self._default, use_bin_type=True, autoreset=True)

    def _default(self, obj: Any) -> Any:
        arr = _to_array(obj)
        if arr is not None:
            return _array_ref(arr, self.frames)
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
    cls = type(msg)
    plan = cls.__dict__.get("_enc_plan") or _enc_plan(cls)
    st = _ENC
    frames: list[Any] = [_TYPE_BYTES[cls.TYPE], b""]
    st.frames = frames  # nested arrays (inside lists, nested messages) land here via _default
    try:
        header = {}
        for name, is_arr in plan:
            value = getattr(msg, name)
            header[name] = _array_ref(value, frames) if is_arr and type(value) is np.ndarray else value
        frames[1] = st.packer.pack(header)
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
    shape = _ref_struct(ndim).unpack(data)[3:]
    if dcode >= _NCODES:
        raise ProtocolError(f"unknown array dtype code {dcode}")
    return _ArrayRef(index, dcode, shape)


class _Ctx:
    __slots__ = ("frames", "used", "limits", "nrefs", "strict")

    def __init__(self, frames: list[Any], limits: Limits, strict: bool = False):
        self.frames, self.used, self.limits, self.nrefs, self.strict = frames, set(), limits, 0, strict

    def ext_hook(self, code: int, data: bytes) -> Any:
        # the common 1-d reference inline (once per array per message); anything else via _ext_hook
        if code == _EXT_ARRAY and len(data) == 12:
            index, dcode, ndim, dim0 = _REF_1D.unpack(data)
            if ndim == 1 and dcode < _NCODES:
                self.nrefs += 1
                return _ArrayRef(index, dcode, (dim0,))
        ref = _ext_hook(code, data)
        self.nrefs += 1
        return ref


def _fail(path: str, what: str) -> typing.NoReturn:
    raise ProtocolError(f"{path}: {what}")


def _build_validator(tp: Any):  # noqa: C901 - a small type interpreter
    """Compile an annotation into fn(value, ctx, path) -> converted value."""
    if tp is Any:

        def v_any(x, ctx, path):
            if isinstance(x, _ArrayRef):
                _fail(path, "arrays are not allowed in a free-form field")
            if not ctx.strict:  # stray references are caught by counting (see decode)
                return x
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
        want_ndim, max_elems = spec.ndim, spec.max_elems

        def v_arr(x, ctx, path):
            if type(x) is not _ArrayRef:
                _fail(path, f"expected an array, got {type(x).__name__}")
            code, shape = x.dtype, x.shape
            if code not in codes:
                _fail(path, f"dtype {_CODE_DTYPE[code].name!r} not allowed (want one of {list(spec.dtypes)})")
            if want_ndim is not None and len(shape) != want_ndim:
                _fail(path, f"expected {want_ndim}-d array, got shape {shape}")
            n = shape[0] if len(shape) == 1 else math.prod(shape)
            if max_elems is not None and n > max_elems:
                _fail(path, f"array has {n} elements, limit {max_elems}")
            fi = x.index + 2
            frames, used = ctx.frames, ctx.used
            if fi >= len(frames):
                _fail(path, f"array refers to missing frame {x.index}")
            if fi in used:
                _fail(path, f"frame {x.index} referenced twice")
            used.add(fi)
            buf = frames[fi]
            nbytes = n * _ITEMSIZE[code]
            if len(buf) != nbytes:
                _fail(path, f"frame has {len(buf)} bytes, shape {shape} of {_CODE_DTYPE[code].name} needs {nbytes}")
            if not n:
                return np.zeros(shape, _CODE_DTYPE[code])
            a = np.frombuffer(buf, dtype=_CODE_DTYPE[code])
            return a if len(shape) == 1 else a.reshape(shape)

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
        val_tp = args[1] if args else Any
        val = _build_validator(val_tp)
        fast_vals = _fast_types(val_tp)

        def v_dict(x, ctx, path):
            if type(x) is dict and not ctx.strict:
                # common case: str keys, values whose exact type needs no conversion or check
                for k, e in x.items():
                    if type(k) is not str or type(e) not in fast_vals:
                        break
                else:
                    return x
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


_SCALARS = {bool: bool, int: int, float: float, str: str, bytes: bytes}
_PLAIN = frozenset((type(None), bool, int, float, str, bytes, list, dict))


def _fast_types(tp: Any) -> frozenset:
    """Exact types a value of annotation `tp` may have to be accepted as decoded, unconverted."""
    if tp is Any:
        return _PLAIN  # arrays in free-form fields are caught by reference counting
    if tp in _SCALARS:
        return frozenset((tp,))
    origin = get_origin(tp)
    if origin is typing.Annotated:
        return frozenset() if _is_arr(tp) else _fast_types(get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        if len(inner) == 1 and inner[0] in _SCALARS:  # X | None; wider unions keep their validator's order
            return frozenset((inner[0], type(None)) if len(inner) < len(get_args(tp)) else (inner[0],))
    return frozenset()


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


def _plans(cls: type[Message]) -> tuple[tuple, tuple]:
    """(fast plan, strict plan): per field (name, exact types accepted as is, validator, required, path)."""
    plans = cls.__dict__.get("_plans")
    if plans is None:
        hints = get_type_hints(cls, include_extras=True)
        fast, strict = [], []
        for name, validate, required in _validators(cls):
            types_ = _fast_types(hints[name])
            path = f"{cls.__name__}.{name}"
            fast.append((name, types_, validate, required, path))
            strict.append((name, frozenset() if hints[name] is Any else types_, validate, required, path))
        plans = cls._plans = (tuple(fast), tuple(strict))
    return plans


def _build_message(cls: type[Message], data: dict, ctx: _Ctx, path: str) -> Message:
    plan = (cls.__dict__.get("_plans") or _plans(cls))[ctx.strict]
    top = path == cls.__name__  # top-level fields use precomputed paths
    kwargs = {}
    for name, fast, validate, required, fpath in plan:
        x = data.get(name, _MISSING)
        if x is _MISSING:
            if required:
                _fail(path, f"missing field {name!r}")
            continue
        kwargs[name] = x if type(x) in fast else validate(x, ctx, fpath if top else f"{path}.{name}")
    if len(data) != len(kwargs):  # kwargs keys are a subset of data keys: equal sizes, equal sets
        known = {p[0] for p in plan}
        extra = sorted(str(k) for k in data if k not in known)
        _fail(path, f"unknown field(s) {extra}")
    return cls(**kwargs)


def _as_buffer(frame: Any) -> Any:
    """A frame's bytes as something with len() in bytes: bytes, zmq.Frame.buffer, flat memoryview."""
    buf = getattr(frame, "buffer", frame)  # zmq.Frame -> its memoryview (1-d, unsigned bytes)
    if type(buf) is memoryview:
        if buf.itemsize == 1 and buf.ndim == 1:
            return buf
        if buf.c_contiguous:
            return buf.cast("B")
    elif isinstance(buf, bytes | bytearray):
        return buf
    raise ProtocolError(f"a frame must be bytes, got {type(frame).__name__}")


def _unknown_fields(cls: type[Message], data: dict) -> typing.NoReturn:
    known = {f.name for f in dataclasses.fields(cls)}
    _fail(cls.__name__, f"unknown field(s) {sorted(str(k) for k in data if k not in known)}")


def _compile_builder(cls: type[Message]) -> Callable[[dict, _Ctx], Message]:
    """Straight-line `build(data, ctx)` for a top-level message: the fast plan unrolled.

    Same checks as _build_message (it stays the reference, and handles nested and strict
    decoding); unrolling removes the per-field loop overhead, which is most of the
    decode time of a flat message like Trajectory.
    """
    fields = dataclasses.fields(cls)
    if any(not f.init for f in fields):
        return lambda data, ctx: _build_message(cls, data, ctx, cls.__name__)
    env: dict[str, Any] = {"_MISSING": _MISSING, "_fail": _fail, "_cls": cls, "_unknown": _unknown_fields}
    lines = ["def build(data, ctx):", "    get = data.get", "    miss = 0"]
    for i, ((name, fast, validate, required, path), f) in enumerate(zip(_plans(cls)[0], fields, strict=True)):
        env[f"V{i}"], env[f"P{i}"], env[f"F{i}"] = validate, path, fast
        if len(fast) == 1:
            env[f"T{i}"] = next(iter(fast))
            cond = f"type(x{i}) is not T{i}"
        else:
            cond = f"type(x{i}) not in F{i}" if fast else "True"
        lines += [f"    x{i} = get({name!r}, _MISSING)", f"    if {cond}:"]
        if required:
            lines.append(f"        if x{i} is _MISSING: _fail({cls.__name__!r}, {f'missing field {name!r}'!r})")
            lines.append(f"        x{i} = V{i}(x{i}, ctx, P{i})")
        else:
            if f.default is not dataclasses.MISSING:
                env[f"D{i}"], default = f.default, f"D{i}"
            else:
                env[f"D{i}"], default = f.default_factory, f"D{i}()"
            lines.append(f"        if x{i} is _MISSING: x{i} = {default}; miss += 1")
            lines.append(f"        else: x{i} = V{i}(x{i}, ctx, P{i})")
    lines.append(f"    if len(data) + miss != {len(fields)}: _unknown(_cls, data)")
    lines.append(f"    return _cls({', '.join(f'{f.name}=x{i}' for i, f in enumerate(fields))})")
    exec("\n".join(lines), env)  # noqa: S102 - generated from the class's own field list
    return env["build"]


def decode(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and decode frames (bytes or zmq.Frame) into a message, or raise ProtocolError."""
    if type(frames) is not list and not isinstance(frames, list | tuple):
        raise ProtocolError(f"a message is a list of frames, got {type(frames).__name__}")
    if len(frames) < 2:
        raise ProtocolError(f"a message needs at least 2 frames (type, header), got {len(frames)}")
    if len(frames) > limits.max_frames:
        raise ProtocolError(f"{len(frames)} frames exceeds the limit {limits.max_frames}")
    bufs = [f if type(f) is bytes else _as_buffer(f) for f in frames]
    tframe = bufs[0]
    if len(tframe) != 1:
        raise ProtocolError(f"type frame must be 1 byte, got {len(tframe)}")
    type_id = tframe[0]
    cls = REGISTRY.get(type_id)
    if cls is None:
        raise ProtocolError(f"unknown message type {type_id:#04x}")
    header = bufs[1]
    if len(header) > limits.max_header_bytes:
        raise ProtocolError(f"{cls.__name__}: header of {len(header)} bytes exceeds {limits.max_header_bytes}")
    total = sum(map(len, bufs))
    if total > limits.max_message_bytes:
        raise ProtocolError(f"{cls.__name__}: message of {total} bytes exceeds {limits.max_message_bytes}")
    ctx = _Ctx(bufs, limits)
    try:
        data = msgpack.unpackb(
            header,
            raw=False,
            ext_hook=ctx.ext_hook,
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
    if type(data) is not dict:
        raise ProtocolError(f"{cls.__name__}: header must be a map, got {type(data).__name__}")
    try:
        build = cls.__dict__.get("_builder")
        if build is None:
            build = cls._builder = _compile_builder(cls)
        msg = build(data, ctx)
        if ctx.nrefs != len(ctx.used):  # an array reference sits where no Arr field consumed it
            strict = _Ctx(bufs, limits, strict=True)
            _build_message(cls, data, strict, cls.__name__)  # raises, naming the path
            raise ProtocolError(f"{cls.__name__}: {ctx.nrefs - len(ctx.used)} array reference(s) outside Arr fields")
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
