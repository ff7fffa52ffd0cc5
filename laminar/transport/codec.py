"""Wire codec: one-byte type frame + msgpack header + out-of-band array frames.

    frames = encode(Trajectory(...))   # [b"\x21", header, prompt_ids, response_ids, logprobs]
    msg = decode(frames)               # validated Trajectory; arrays are zero-copy views

Every message is a `msgspec.Struct` subclass of `Message` (`laminar/message.py`),
registered with a unique one-byte type id by `@message(0x21)`; the codec encodes whatever
is registered and imports no message catalogue. The header is the struct as a msgpack map,
written and read by msgspec. A numpy array (anywhere: nested messages, lists, dicts)
travels as its own frame without copying; the header holds an ext reference
`(frame index, dtype code, shape)` in its place.

Decoding is msgspec's typed decoder, one per message type, which checks field names
(unknown ones are refused), types and nesting. An array field is annotated
`Annotated[np.ndarray, Arr(dtypes, ndim, max_elems)]`; before a type's first decoder is
built, its runtime annotation becomes `msgspec.msgpack.Ext`, so msgspec itself checks
that an array reference sits there, and the type gets an array plan: the fields (and
the paths through lists, maps and nested messages) that hold arrays. After msgspec,
the plan turns each reference into its array, checking it against its `Arr` (dtype,
ndim, size) and the frames (exists, used once, byte count). An array reference in a
free-form `Any` field is refused. Anything wrong raises `ProtocolError` naming the
class and the field path. Never pickle.

Speed: a type whose arrays are all top-level fields (Trajectory, the hot one) gets two
functions generated once: an encode path that puts the arrays in their frames and Ext
references in a copy of the message, so msgspec runs no Python hook per array, and a decode
path for the common frame layout; anything else takes the general path, which gives the same
bytes and the same errors. Messages are not tracked by the cyclic GC (`gc=False`): they are
trees of data, and a trajectory stream should not trigger collections.
"""

from __future__ import annotations

import functools
import math
import re
import struct
import threading
import types
import typing
from collections.abc import Callable
from typing import Any, get_args, get_origin, get_type_hints

import msgspec
import numpy as np
import zmq

from laminar.message import (
    DEFAULT_LIMITS,
    ON_REGISTER,
    REGISTRY,
    Arr,
    Limits,
    Message,
    ProtocolError,
)

_EXT_ARRAY = 1
_DTYPE_NAMES = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
)
_DTYPE_CODE = {np.dtype(n): i for i, n in enumerate(_DTYPE_NAMES)}
_CODE_DTYPE = [np.dtype(n) for n in _DTYPE_NAMES]
_NCODES = len(_CODE_DTYPE)
# array reference inside the header: frame index (u16), dtype code (u8), ndim (u8), dims (u64 each)
_REF_1D = struct.Struct("<HBBQ")  # the common case, unpacked in one call
_REF_STRUCTS: dict[int, struct.Struct] = {}


def _ref_struct(ndim: int) -> struct.Struct:
    st = _REF_STRUCTS.get(ndim)
    if st is None:
        st = _REF_STRUCTS[ndim] = struct.Struct(f"<HBB{ndim}Q")
    return st


# ---- array fields: msgspec sees an Ext; a per-type plan turns it into the array --------


class _ArrSpec:
    """An Arr annotation, unpacked for the decoder."""

    __slots__ = ("spec", "codes", "fast", "max_n")

    def __init__(self, spec: Arr) -> None:
        bad = [d for d in spec.dtypes if d not in _DTYPE_NAMES]
        if bad:
            raise TypeError(f"Arr dtypes {bad} cannot travel; use {_DTYPE_NAMES}")
        self.spec = spec
        self.codes = frozenset(_DTYPE_NAMES.index(d) for d in spec.dtypes)
        # dtype per code that the fast path takes: a 1-d array with no size limit (else none)
        fast = spec.ndim in (None, 1) and spec.max_elems is None
        self.fast = {c: _CODE_DTYPE[c] for c in self.codes} if fast else {}
        self.max_n = math.inf if spec.max_elems is None else spec.max_elems


class _Frames(set[int]):
    """The frames of one message being decoded; as a set, the indices arrays took so far.

    A set subclass rather than an object holding one: it is built once per message.
    """

    __slots__ = ("frames", "nbytes")
    frames: list[Any] | tuple[Any, ...]
    nbytes: int
    """The type byte, the header, and the bytes of every array so far."""


# converts a decoded value at `path` (an Ext where an array belongs), returns the new value
_Convert = Callable[[Any, _Frames, str], Any]
_Plan = tuple[tuple[str, _Convert, str], ...]  # (field, converter, "Class.field") per array field
_PLANS: dict[type[Message], _Plan] = {}
_PREPARE_LOCK = threading.Lock()


def _arr_spec(tp: Any) -> Arr | None:
    if get_origin(tp) is typing.Annotated:
        return next((m for m in get_args(tp)[1:] if isinstance(m, Arr)), None)
    return None


def _runtime_type(tp: Any) -> Any:
    """`tp` as msgspec should see it: each Annotated[..., Arr] becomes an Ext."""
    spec = _arr_spec(tp)
    if spec is not None:
        return typing.Annotated[msgspec.msgpack.Ext, spec]
    origin, args = get_origin(tp), get_args(tp)
    if not args or origin is typing.Annotated:
        return tp
    new = tuple(_runtime_type(a) for a in args)
    if new == args:
        return tp
    if origin in (typing.Union, types.UnionType):
        return typing.Union[new]  # noqa: UP007 - rebuilt from a tuple of members
    return origin[new]


def _converter(tp: Any) -> _Convert | None:
    """How to turn the decoded value of annotation `tp` into arrays; None: it holds none."""
    spec = _arr_spec(tp)
    if spec is not None:
        return functools.partial(_array, _ArrSpec(spec))
    if isinstance(tp, type) and issubclass(tp, Message):
        plan = _prepare(tp)
        return functools.partial(_convert_message, plan) if plan else None
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        convs = [_converter(a) for a in inner]
        if not any(convs):
            return None
        if len(inner) != 1:
            raise TypeError(
                f"codec: arrays inside a union of several types ({tp!r}) are not supported"
            )
        return functools.partial(_convert_optional, convs[0]) if convs[0] else None
    if origin in (list, tuple) and args:
        conv = _converter(args[0])
        return functools.partial(_convert_list, conv) if conv else None
    if origin is dict and args:
        conv = _converter(args[1])
        return functools.partial(_convert_dict, conv) if conv else None
    return None


def _convert_message(plan: _Plan, x: Message, fr: _Frames, path: str) -> Message:
    for name, conv, _ in plan:
        setattr(x, name, conv(getattr(x, name), fr, f"{path}.{name}"))
    return x


def _convert_optional(conv: _Convert, x: Any, fr: _Frames, path: str) -> Any:
    return None if x is None else conv(x, fr, path)


def _convert_list(conv: _Convert, x: list[Any], fr: _Frames, path: str) -> list[Any]:
    for i, item in enumerate(x):
        x[i] = conv(item, fr, f"{path}[{i}]")
    return x


def _convert_dict(conv: _Convert, x: dict[str, Any], fr: _Frames, path: str) -> dict[str, Any]:
    for k, item in x.items():
        x[k] = conv(item, fr, f"{path}.{k}")
    return x


def _prepare(cls: type[Message]) -> _Plan:
    """The class's array plan; first time, also its array annotations rewritten to Ext.

    msgspec reads (and caches) a Struct's annotations when the first decoder that
    involves it is built, so nested message types are prepared first (all under
    _PREPARE_LOCK). Static type checkers still read the source annotation, `np.ndarray`.
    """
    plan = _PLANS.get(cls)
    if plan is not None:
        return plan
    _PLANS[cls] = ()  # a type that contains itself sees no arrays in its own recursion
    try:
        hints = get_type_hints(cls, include_extras=True)
        steps = []
        for name in cls.__struct_fields__:
            conv = _converter(hints[name])
            if conv is not None:
                steps.append((name, conv, f"{cls.__name__}.{name}"))
    except BaseException:
        del _PLANS[cls]
        raise
    for klass in cls.__mro__:
        own = klass.__dict__.get("__annotations__", {})
        for name in own:
            if name in cls.__struct_fields__:
                own[name] = _runtime_type(hints[name])
    plan = _PLANS[cls] = tuple(steps)
    return plan


def _array(arr: _ArrSpec, x: msgspec.msgpack.Ext, fr: _Frames, path: str) -> np.ndarray:
    """The array an Ext reference stands for, after every check (ProtocolError naming `path`)."""
    a = _array_fast(arr.fast, x, fr)
    if a is not None:
        return a
    try:
        return _array_checked(arr, x, fr)
    except ProtocolError as exc:
        raise ProtocolError(f"{path}: {exc}") from None


def _array_fast(fast: dict[int, np.dtype], x: msgspec.msgpack.Ext, fr: _Frames) -> Any:
    """The common case, or None: a 1-d reference of a fast dtype to an unused frame of its size."""
    data: Any = x.data
    if len(data) != 12 or x.code != _EXT_ARRAY:
        return None
    index, code, ndim, n = _REF_1D.unpack(data)
    dtype = fast.get(code)
    fi = index + 2
    frames = fr.frames
    if dtype is None or ndim != 1 or fi >= len(frames) or fi in fr:
        return None
    buf = frames[fi]
    nbytes = n * dtype.itemsize
    tb = type(buf)
    if not nbytes or len(buf) != nbytes or tb not in _BYTE_FRAMES:
        return None
    fr.add(fi)
    fr.nbytes += nbytes
    a = np.frombuffer(buf, dtype)
    if tb is zmq.Frame and nbytes >= zmq.COPY_THRESHOLD:
        a.setflags(write=False)  # may be the sender's own memory (inproc zero-copy)
    return a


def _array_checked(arr: _ArrSpec, x: msgspec.msgpack.Ext, fr: _Frames) -> np.ndarray:
    """Every case of _array, each check spelled out."""
    data = bytes(x.data)
    if x.code != _EXT_ARRAY:
        raise ProtocolError(f"unknown msgpack ext type {x.code}")
    if len(data) < 4 or len(data) != 4 + 8 * data[3]:
        raise ProtocolError(f"array reference of {len(data)} bytes is malformed")
    index, code, ndim, *dims = _ref_struct(data[3]).unpack(data)
    shape = tuple(dims)
    if code not in arr.codes:
        name = _CODE_DTYPE[code].name if code < _NCODES else f"code {code}"
        raise ProtocolError(f"dtype {name!r} not allowed (want one of {list(arr.spec.dtypes)})")
    if arr.spec.ndim is not None and ndim != arr.spec.ndim:
        raise ProtocolError(f"expected {arr.spec.ndim}-d array, got shape {shape}")
    n = math.prod(shape)
    if n > arr.max_n:
        raise ProtocolError(f"array has {n} elements, limit {arr.spec.max_elems}")
    fi = index + 2
    if fi >= len(fr.frames):
        raise ProtocolError(f"array refers to missing frame {index}")
    if fi in fr:
        raise ProtocolError(f"frame {index} referenced twice")
    fr.add(fi)
    buf = fr.frames[fi]
    if type(buf) not in _BYTE_FRAMES:
        buf = _as_buffer(buf)
    dtype = _CODE_DTYPE[code]
    nbytes = n * dtype.itemsize
    if len(buf) != nbytes:
        raise ProtocolError(
            f"frame has {len(buf)} bytes, shape {shape} of {dtype.name} needs {nbytes}"
        )
    fr.nbytes += nbytes
    if not n:
        try:
            return np.zeros(shape, dtype)
        except ValueError:  # numpy refuses dims that large even when empty
            raise ProtocolError(f"shape {shape} is not a valid array shape") from None
    a = np.frombuffer(buf, dtype)
    if type(buf) is zmq.Frame and nbytes >= zmq.COPY_THRESHOLD:
        a.setflags(write=False)  # may be the sender's own memory (inproc zero-copy)
    return a.reshape(shape)


# ---- encoding -------------------------------------------------------------------------


def _other_value(obj: Any) -> Any:
    """What msgspec cannot encode itself: a CPU torch tensor (as an array) or a numpy scalar."""
    if type(obj).__module__ == "torch" and type(obj).__name__ == "Tensor":
        # CPU tensors only; a CUDA tensor must move through a weight transport, not here.
        return obj.detach().numpy()
    if isinstance(obj, np.ndarray | np.generic):
        return obj
    raise TypeError(f"cannot encode {type(obj).__name__}")


class _EncodeState:
    """One per thread: msgspec's encoder and the frame list its enc_hook appends arrays to."""

    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.encoder = msgspec.msgpack.Encoder(enc_hook=self.enc_hook)

    def enc_hook(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and obj.ndim == 1 and obj.flags.c_contiguous and obj.size:
            code = _DTYPE_CODE.get(obj.dtype)  # the common case, in as few steps as it takes
            if code is not None:
                frames = self.frames
                frames.append(obj.data.cast("B"))  # flat bytes: len() is the byte count
                return _Ext(_EXT_ARRAY, _pack_ref_1d(len(frames) - 3, code, 1, len(obj)))
        return self.any_value(obj)

    def any_value(self, obj: Any) -> Any:
        if type(obj) is not np.ndarray:
            obj = _other_value(obj)
            if isinstance(obj, np.generic):
                return obj.item()
        code = _DTYPE_CODE.get(obj.dtype)
        if code is None:
            raise TypeError(f"array dtype {obj.dtype} cannot travel; use one of {_DTYPE_NAMES}")
        view = obj.data
        if not view.c_contiguous:
            view = np.ascontiguousarray(obj).data
        frames = self.frames
        frames.append(view.cast("B") if view.nbytes else b"")  # flat bytes: len() is the byte count
        index, ndim = len(frames) - 3, view.ndim
        if ndim == 1:
            return msgspec.msgpack.Ext(_EXT_ARRAY, _REF_1D.pack(index, code, 1, len(obj)))
        return msgspec.msgpack.Ext(
            _EXT_ARRAY, _ref_struct(ndim).pack(index, code, ndim, *obj.shape)
        )


_Ext = msgspec.msgpack.Ext
_pack_ref_1d = _REF_1D.pack
_TYPE_BYTES = [bytes((i,)) for i in range(256)]
_ENC = threading.local()


def encode(msg: Message) -> list[Any]:
    """Frames for a message: [type byte, header, *array buffers] (arrays zero-copy)."""
    try:
        st = _ENC.state
    except AttributeError:
        st = _ENC.state = _EncodeState()
    fast = _ENC_FAST.get(type(msg), _UNPLANNED)
    if fast is _UNPLANNED:
        fast = _encode_plan(type(msg))
    if fast is not None:
        out = fast(msg, st)
        if out is not None:
            return out
    frames: list[Any] = [_TYPE_BYTES[msg.TYPE], b""]
    st.frames = frames
    try:
        frames[1] = st.encoder.encode(msg)
    except TypeError as exc:
        raise TypeError(f"{type(msg).__name__}: {exc}") from None
    finally:
        st.frames = []
    return frames


_UNPLANNED: Any = object()
_ENC_FAST: dict[type[Message], Any] = {}


def _encode_plan(cls: type[Message]) -> Any:
    """The class's generated encode path (None: its arrays are not all top-level fields)."""
    if cls not in _FAST:
        _decoder(cls)  # the plan, under the lock, and the class's annotations fixed for msgspec
    _, _, top, rest = _FAST[cls]
    names = [name for name, _, _ in top]
    fast = None if rest or not top else _encode_fast(cls, names, _OPTIONAL[cls])
    _ENC_FAST[cls] = fast
    return fast


def _encode_fast(cls: type[Message], names: list[str], optional: tuple[bool, ...]) -> Any:
    """A function, generated once per type, that encodes a message whose arrays are all top-level.

    `fast(msg, st)` takes the common case: every array field None (where allowed) or a
    non-empty 1-d C-contiguous numpy array of a dtype that travels. It puts each array in
    its frame and an Ext reference in a copy of the message (`structs.replace`: the caller's
    message is not touched), so msgspec encodes the header without calling the hook per
    array. It returns None for anything else, and the generic path (the hook) handles it.
    The references are those the hook writes: same frame order, same bytes.
    """
    env: dict[str, Any] = {
        "_nd": np.ndarray,
        "_codes": _DTYPE_CODE,
        "_pack": _REF_1D.pack,
        "_Ext": _Ext,
        "_replace": msgspec.structs.replace,
        "_type_byte": _TYPE_BYTES[cls.TYPE],
        "_EXT": _EXT_ARRAY,
    }
    body = ["def fast(msg, st):", "    frames = [_type_byte, b'']"]
    counted = any(optional)
    if counted:
        body.append("    k = 0")
    for i, (name, opt) in enumerate(zip(names, optional, strict=True)):
        if not name.isidentifier():
            return None
        body.append(f"    x = msg.{name}")
        pad = "    "
        if opt:
            body += [f"    e{i} = None", "    if x is not None:"]
            pad = "        "
        index = "k" if counted else str(i)
        body += [
            pad + line
            for line in (
                "if type(x) is not _nd or x.ndim != 1 or not x.flags.c_contiguous:",
                "    return None",
                "code = _codes.get(x.dtype)",
                "n = len(x)",
                "if code is None or not n:",
                "    return None",
                "frames.append(x)",
                f"e{i} = _Ext(_EXT, _pack({index}, code, 1, n))",
            )
        ]
        if counted:
            body.append(pad + "k += 1")
    args = ", ".join(f"{name}=e{i}" for i, name in enumerate(names))
    body += [
        f"    m = _replace(msg, {args})",
        "    st.frames = frames",
        "    try:",
        "        frames[1] = st.encoder.encode(m)",
        "    except TypeError:",
        "        return None  # the generic path raises it again, naming the class",
        "    finally:",
        "        st.frames = []",
        "    return frames",
    ]
    exec(compile("\n".join(body), f"<codec encode path for {cls.__name__}>", "exec"), env)  # noqa: S102
    return env["fast"]


# ---- decoding -------------------------------------------------------------------------


class _StrayArray(Exception):
    """An array reference where msgspec expected free-form data (raised by _ext_stray)."""


def _ext_stray(code: int, data: memoryview) -> Any:
    # msgspec calls ext_hook only for an ext in an `Any` position: Arr fields are typed Ext
    if code != _EXT_ARRAY:
        raise ProtocolError(f"unknown msgpack ext type {code}")
    raise _StrayArray


def _ext_mark(code: int, data: memoryview) -> Any:
    return _STRAY  # the second, rare decode that finds where the stray reference was


_STRAY = object()
_DECODERS: dict[type[Message], msgspec.msgpack.Decoder[Any]] = {}


# per class: its decoder, its generated fast path (None: it has arrays below the top level),
# its top-level array fields (name, spec, path) and its other steps
_Top = tuple[str, "_ArrSpec", str]
_Fast = tuple[
    msgspec.msgpack.Decoder[Any], "Callable[[Any, Any, int], int] | None", tuple[_Top, ...], _Plan
]
_FAST: dict[type[Message], _Fast] = {}
_OPTIONAL: dict[type[Message], tuple[bool, ...]] = {}
"""Per class: whether each of its top-level array fields (in _FAST's order) may be None."""


def _decoder(cls: type[Message]) -> msgspec.msgpack.Decoder[Any]:
    with _PREPARE_LOCK:
        plan = _prepare(cls)
        dec = _DECODERS[cls] = msgspec.msgpack.Decoder(cls, ext_hook=_ext_stray)
        top: list[_Top] = []
        optional: list[bool] = []
        rest = []
        for name, conv, path in plan:
            inner = conv
            if isinstance(conv, functools.partial) and conv.func is _convert_optional:
                inner = conv.args[0]
            if isinstance(inner, functools.partial) and inner.func is _array:
                top.append((name, inner.args[0], path))
                optional.append(inner is not conv)
            else:
                rest.append((name, conv, path))
        fast = None if rest else _fast_arrays(cls, top, optional)
        _FAST[cls] = (dec, fast, tuple(top), tuple(rest))
        _OPTIONAL[cls] = tuple(optional)
    return dec


def _fast_arrays(cls: type[Message], top: list[_Top], optional: list[bool]) -> Any:
    """A function, generated once per type, that turns its top-level array references into arrays.

    `fast(msg, frames, nframes)` takes only the common case, the frames `encode` writes: the
    present arrays' references numbered 0, 1, ... in field order, each 1-d, of an allowed
    dtype (no size limit), to a frame of the right byte count, and no other frame. It returns
    the arrays' bytes, or -1, having changed nothing, for anything else, which the checked
    path then handles. Written out per field rather than looped, it costs about half of the
    loop: a trajectory's decode is dominated by it.
    """
    env: dict[str, Any] = {
        "_unpack": _REF_1D.unpack,
        "_frombuffer": np.frombuffer,
        "_Frame": zmq.Frame,
        "_BYTES": _BYTE_FRAMES,
        "_zmq": zmq,
    }
    counted = any(optional)
    body = ["def fast(msg, frames, nframes):", "    total = 0"]
    if counted:
        body.append("    k = 0")
    else:  # every field present: the frame count is known before anything is read
        body += [f"    if nframes != {len(top) + 2}:", "        return -1"]
    for i, ((name, spec, _), opt) in enumerate(zip(top, optional, strict=True)):
        if not name.isidentifier() or not spec.fast:
            return None
        env[f"_dtypes{i}"] = spec.fast
        pad = "    "
        body.append(f"    x = msg.{name}")
        if opt:
            body += [f"    a{i} = None", "    if x is not None:"]
            pad = "        "
        want, fi = ("k", "k + 2") if counted else (str(i), str(i + 2))
        body += [
            pad + line
            for line in (
                "data = x.data",
                f"if len(data) != 12 or x.code != {_EXT_ARRAY}:",
                "    return -1",
                "index, code, ndim, n = _unpack(data)",
                f"dtype = _dtypes{i}.get(code)",
                f"if index != {want} or dtype is None or ndim != 1"
                + (" or k + 2 >= nframes:" if counted else ":"),
                "    return -1",
                f"buf = frames[{fi}]",
                "nbytes = n * dtype.itemsize",
                "kind = type(buf)",
                "if not nbytes or len(buf) != nbytes or kind not in _BYTES:",
                "    return -1",
                "total += nbytes",
                f"a{i} = _frombuffer(buf, dtype)",
                "if kind is _Frame and nbytes >= _zmq.COPY_THRESHOLD:",
                f"    a{i}.setflags(write=False)  # may be the sender's own memory (inproc "
                "zero-copy)",
            )
        ]
        if counted:
            body.append(pad + "k += 1")
    if counted:
        body += ["    if nframes != k + 2:", "        return -1"]
    for i, ((name, _, _), opt) in enumerate(zip(top, optional, strict=True)):
        body.append(f"    if a{i} is not None:" if opt else "    if True:")
        body.append(f"        msg.{name} = a{i}")
    body.append("    return total")
    exec(compile("\n".join(body), f"<codec fast path for {cls.__name__}>", "exec"), env)  # noqa: S102
    return env["fast"]


# msgspec's error suffix: " - at `$.a[0].b`" or " - at `key` in `$.a`"
_AT = re.compile(r" - at `(?:(key)` in `)?\$([^`]*)`$")


def _where(cls: type[Message], exc: Exception) -> str:
    """msgspec's message with its JSON-path suffix turned into `Class.a[0].b: ...`."""
    text = str(exc)
    m = _AT.search(text)
    if m is None:
        return f"{cls.__name__}: {text}"
    key = " (a map key)" if m.group(1) else ""
    return f"{cls.__name__}{m.group(2)}{key}: {text[: m.start()]}"


# frame types whose len() is their byte count, used as they are (no memoryview per frame)
_BYTE_FRAMES = frozenset((bytes, bytearray, zmq.Frame))


def _as_buffer(frame: Any) -> Any:
    """A frame's bytes as something with len() in bytes: bytes, zmq.Frame, flat memoryview."""
    buf = frame.buffer if isinstance(frame, zmq.Frame) else frame
    if type(buf) is np.ndarray:  # encode's own array frames
        buf = buf.data
    if type(buf) is memoryview:
        if buf.itemsize == 1 and buf.ndim == 1:
            return buf
        if buf.c_contiguous:
            return buf.cast("B")
    elif isinstance(buf, bytes | bytearray):
        return buf
    raise ProtocolError(f"a frame must be bytes, got {type(frame).__name__}")


def _stray_array(x: Any, path: str) -> str | None:
    """Path of the first array reference outside an Arr field (i.e. in a free-form field)."""
    if x is _STRAY:
        return path
    if isinstance(x, Message):
        for name in x.__struct_fields__:
            found = _stray_array(getattr(x, name), f"{path}.{name}")
            if found:
                return found
    elif isinstance(x, list):
        for i, item in enumerate(x):
            found = _stray_array(item, f"{path}[{i}]")
            if found:
                return found
    elif isinstance(x, dict):
        for k, item in x.items():
            found = _stray_array(item, f"{path}.{k}")
            if found:
                return found
    return None


def _check_sizes(x: Any, limits: Limits, path: str) -> None:
    """Limits on strings and list/map lengths (only needed when they are below the header size)."""
    try:
        _walk_sizes(x, limits, path)
    except RecursionError:
        raise ProtocolError(f"{path}: the header nests too deeply") from None


def _walk_sizes(x: Any, limits: Limits, path: str) -> None:
    if isinstance(x, str):
        if len(x) > limits.max_str_len:
            raise ProtocolError(
                f"{path}: string of {len(x)} characters exceeds max_str_len {limits.max_str_len}"
            )
    elif isinstance(x, Message):
        for name in x.__struct_fields__:
            _walk_sizes(getattr(x, name), limits, f"{path}.{name}")
    elif isinstance(x, list | dict):
        if len(x) > limits.max_list_len:
            raise ProtocolError(f"{path}: {len(x)} items exceed max_list_len {limits.max_list_len}")
        if isinstance(x, dict):
            for k, item in x.items():
                _walk_sizes(k, limits, f"{path} (a map key)")
                _walk_sizes(item, limits, f"{path}.{k}")
        else:
            for i, item in enumerate(x):
                _walk_sizes(item, limits, f"{path}[{i}]")


_ZFrame = zmq.Frame
_BY_TYPE_FRAME: dict[bytes, tuple[type[Message], Any, Any, tuple[_Top, ...], _Plan]] = {}
"""Type frame -> (class, its decoder, fast path, top-level arrays, other steps): one lookup."""


def _type_entry(tframe: bytes) -> tuple[type[Message], Any, Any, tuple[_Top, ...], _Plan]:
    cls = REGISTRY.get(tframe[0])
    if cls is None:
        raise ProtocolError(f"unknown message type {tframe[0]:#04x}")
    if cls not in _FAST:
        _decoder(cls)
    entry = _BY_TYPE_FRAME[tframe] = (cls, *_FAST[cls])
    return entry


def decode(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and decode frames (bytes or zmq.Frame) into a message, or raise ProtocolError."""
    if type(frames) is not list and not isinstance(frames, list | tuple):
        raise ProtocolError(f"a message is a list of frames, got {type(frames).__name__}")
    nframes = len(frames)
    if nframes < 2:
        raise ProtocolError(f"a message needs at least 2 frames (type, header), got {nframes}")
    if nframes > limits.max_frames:
        raise ProtocolError(f"{nframes} frames exceeds the limit {limits.max_frames}")
    tframe = frames[0]
    if type(tframe) is not bytes:
        tframe = tframe.bytes if type(tframe) is _ZFrame else bytes(_as_buffer(tframe))
    if len(tframe) != 1:
        raise ProtocolError(f"type frame must be 1 byte, got {len(tframe)}")
    entry = _BY_TYPE_FRAME.get(tframe)
    if entry is None:
        entry = _type_entry(tframe)
    cls, dec, arrays, top, rest = entry
    header = frames[1]
    if type(header) not in _BYTE_FRAMES:
        header = _as_buffer(header)
    hlen = len(header)
    if hlen > limits.max_header_bytes:
        raise ProtocolError(
            f"{cls.__name__}: header of {hlen} bytes exceeds {limits.max_header_bytes}"
        )
    try:
        msg = dec.decode(header)
    except msgspec.ValidationError as exc:
        raise ProtocolError(_where(cls, exc)) from None
    except ProtocolError as exc:  # from the ext hook
        raise ProtocolError(f"{cls.__name__}: {exc}") from None
    except _StrayArray:
        raise ProtocolError(
            f"{_stray_path(cls, header)}: arrays are not allowed in a free-form field"
        ) from None
    except (msgspec.DecodeError, RecursionError, ValueError) as exc:  # bad msgpack or UTF-8
        raise ProtocolError(
            f"{cls.__name__}: header is not valid msgpack ({type(exc).__name__}: {exc})"
        ) from None
    nbytes = arrays(msg, frames, nframes) if arrays is not None else -1
    if nbytes >= 0:
        nbytes += 1 + hlen
    else:  # the checked path: every case, each error naming its field
        fr = _Frames()
        fr.frames, fr.nbytes = frames, 1 + hlen
        for name, spec, path in top:
            x = getattr(msg, name)
            if x is not None:  # msgspec let None through only where the field allows it
                setattr(msg, name, _array(spec, x, fr, path))
        for name, conv, path in rest:
            setattr(msg, name, conv(getattr(msg, name), fr, path))
        if len(fr) != nframes - 2:
            raise ProtocolError(
                f"{cls.__name__}: {nframes - 2 - len(fr)} array frame(s) not referenced by the "
                "header"
            )
        nbytes = fr.nbytes
    # every frame is accounted for now: the type byte, the header and the arrays' checked sizes
    if nbytes > limits.max_message_bytes:
        raise ProtocolError(
            f"{cls.__name__}: message of {nbytes} bytes exceeds {limits.max_message_bytes}"
        )
    # a string or list longer than the header is impossible: only tighter limits need a walk
    if hlen > limits.max_str_len or hlen > limits.max_list_len:
        _check_sizes(msg, limits, cls.__name__)
    return msg


def _stray_path(cls: type[Message], header: Any) -> str:
    """Where the array reference in a free-form field is: decode again, marking it, and look."""
    try:
        msg = msgspec.msgpack.Decoder(cls, ext_hook=_ext_mark).decode(header)
        return _stray_array(msg, cls.__name__) or cls.__name__
    except (ValueError, RecursionError):
        return cls.__name__


def _forget_type(type_id: int) -> None:
    _BY_TYPE_FRAME.pop(bytes((type_id,)), None)  # a re-registered type is looked up afresh


ON_REGISTER.append(_forget_type)


def roundtrip(msg: Message) -> Message:
    """encode + decode with copied bytes (tests and debugging)."""
    return decode([bytes(f) for f in encode(msg)])
