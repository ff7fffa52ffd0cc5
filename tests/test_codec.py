"""Codec: every registered message type round-trips; no input makes decode raise anything but
ProtocolError.

    .venv/bin/python -m pytest tests/test_codec.py -q

The round trip is generic: `sample_message(cls)` builds an instance of any registered
message (a msgspec Struct) from its type hints (scalars, bytes, Optional, list, dict, Any, nested
messages, `Arr` arrays of every allowed dtype), so a message type added to
laminar/protocol/ later is covered without touching this file. If a new field uses an
annotation the builder does not know, the test fails and names the annotation.
"""

from __future__ import annotations

import itertools
import random
import types
import typing
from typing import Annotated, Any, get_args, get_origin, get_type_hints

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from msgspec import field

import laminar.protocol  # noqa: F401  (registers every message type)
from laminar.message import ANY_ROLE, REGISTRY, Arr, Limits, Message, ProtocolError, message
from laminar.protocol.buffer import BatchReply
from laminar.protocol.core import NodeStatus
from laminar.protocol.data import Trajectory
from laminar.protocol.tools import ToolCallRequest
from laminar.transport.codec import decode, encode
from laminar.transport.session import Ping, StatusCodec

Bytes1d = Annotated[np.ndarray, Arr(("uint8",), ndim=1)]


@message(0xF1, senders=ANY_ROLE)
class CodecProbeInner(Message):  # tests only: a nested message that carries arrays
    values: Annotated[np.ndarray, Arr(("float32", "float64"), ndim=2)]
    label: str = ""


@message(0xF0, senders=ANY_ROLE)
class CodecProbe(Message):  # tests only: every annotation shape the codec supports, in one message
    ids: Annotated[np.ndarray, Arr(("int32",), ndim=1, max_elems=64)]
    anydim: Annotated[np.ndarray, Arr(("float16", "bool", "uint64", "int8"), ndim=None)]
    maybe_arr: Annotated[np.ndarray, Arr(("float32",))] | None = None
    chunks: list[Bytes1d] = field(default_factory=list)
    by_name: dict[str, Bytes1d] = field(default_factory=dict)
    inner: CodecProbeInner | None = None
    inners: list[CodecProbeInner] = field(default_factory=list)
    status: NodeStatus | None = None
    blob: bytes = b""
    flag: bool = False
    score: float = 0.0
    maybe_int: int | None = None
    free: Any = None
    table: dict[str, list[int]] = field(default_factory=dict)


MESSAGE_TYPES = sorted(REGISTRY.items())
TYPE_IDS = [f"{tid:#04x}-{cls.__name__}" for tid, cls in MESSAGE_TYPES]

# ---- a sample instance of any message, from its type hints ---------------------------------

_ANY_SAMPLE = {"int": -3, "list": [1, "two", 3.5, None, True], "nested": {"k": [b"\x00\xff"]}}


def _arr_spec(tp: Any) -> Arr | None:
    if isinstance(tp, Arr):
        return tp
    if get_origin(tp) is typing.Annotated:
        return next((m for m in get_args(tp)[1:] if isinstance(m, Arr)), None)
    return None


def sample_array(spec: Arr, rng: random.Random, variant: int) -> np.ndarray:
    dtype = np.dtype(spec.dtypes[variant % len(spec.dtypes)])
    ndim = spec.ndim if spec.ndim is not None else 1 + variant % 3
    shape = (0,) * ndim if variant == 2 else tuple(rng.randint(1, 5) for _ in range(ndim))
    while spec.max_elems is not None and int(np.prod(shape)) > spec.max_elems:
        shape = tuple(max(0, d // 2) for d in shape)
    n = int(np.prod(shape))
    if dtype == np.bool_:
        flat = np.array([rng.random() < 0.5 for _ in range(n)], dtype=bool)
    elif dtype.kind == "f":
        flat = np.array([rng.uniform(-100, 100) for _ in range(n)]).astype(dtype)
    else:
        info = np.iinfo(dtype)
        flat = np.array([rng.randint(int(info.min), int(info.max)) for _ in range(n)], dtype=dtype)
    return flat.reshape(shape)


def sample_value(tp: Any, rng: random.Random, variant: int, depth: int = 0) -> Any:  # noqa: C901
    """A value of annotation `tp`. variant 0 = typical, 1 = other branch/extremes, 2 =
    empty/None."""
    spec = _arr_spec(tp)
    if spec is not None:
        return sample_array(spec, rng, variant)
    if tp is Any:
        return {} if variant == 2 else dict(_ANY_SAMPLE)
    if isinstance(tp, type) and issubclass(tp, Message):
        return sample_message(tp, rng, variant, depth + 1)
    origin, args = get_origin(tp), get_args(tp)
    if get_origin(tp) is typing.Annotated:
        return sample_value(args[0], rng, variant, depth)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) < len(args) and (variant == 2 or depth > 2):
            return None
        return sample_value(inner[variant % len(inner)], rng, variant, depth)
    if origin is typing.Literal:
        return args[variant % len(args)]
    if origin in (list, tuple):
        n = 0 if variant == 2 or depth > 2 else 2
        item = args[0] if args else Any
        return [sample_value(item, rng, variant, depth + 1) for _ in range(n)]
    if origin is dict:
        n = 0 if variant == 2 or depth > 2 else 2
        key, val = args if args else (str, Any)
        keys = range(n) if key is int else [f"key{i}" for i in range(n)]
        return {k: sample_value(val, rng, variant, depth + 1) for k in keys}
    if tp is bool:
        return variant != 1
    if tp is int:
        return [rng.randint(-1000, 1000), 2**63 - 1, 0][variant]
    if tp is float:
        return [rng.uniform(-1e3, 1e3), float("inf"), -0.0][variant]
    if tp is str:
        return ["héllo ✓ " + str(rng.random()), "", ""][variant] if variant else "héllo ✓"
    if tp is bytes:
        return [b"\x00\xffbytes", bytes(range(256)), b""][variant]
    if tp is msgspec.Raw:  # a heartbeat's status: an encoded NodeStatus, or none
        status = NodeStatus(node_id="n", role="r", version=variant)
        return StatusCodec.pack(None if variant == 2 else status)
    raise TypeError(
        f"tests/test_codec.py cannot build a sample of annotation {tp!r}; extend sample_value"
    )


def sample_message(
    cls: type[Message], rng: random.Random, variant: int = 0, depth: int = 0
) -> Message:
    hints = get_type_hints(cls, include_extras=True)
    kwargs = {}
    for f in msgspec.structs.fields(cls):
        if variant == 2 and not f.required:
            continue  # the minimal message: defaults only
        kwargs[f.name] = sample_value(hints[f.name], rng, variant, depth)
    return cls(**kwargs)


def assert_same(a: Any, b: Any, path: str) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: decoded {type(b).__name__}, not an array"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {b.dtype}{b.shape} != {a.dtype}{a.shape}"
        )
        assert np.array_equal(a, b), f"{path}: array values differ"
    elif isinstance(a, Message):
        assert type(a) is type(b), f"{path}: {type(b).__name__} != {type(a).__name__}"
        for f in msgspec.structs.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list) and len(a) == len(b), f"{path}: {b!r} != {a!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (
            f"{path}: keys {b.keys()} != {a.keys()}"
        )
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    else:
        assert type(a) is type(b) and a == b, (
            f"{path}: {b!r} ({type(b).__name__}) != {a!r} ({type(a).__name__})"
        )


def frames_of(msg: Message) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


# ---- round trips ----------------------------------------------------------------------------


def test_registry_is_populated() -> None:
    assert len(REGISTRY) >= 10
    for tid, cls in REGISTRY.items():
        assert cls.TYPE == tid and issubclass(cls, msgspec.Struct)


@pytest.mark.parametrize("variant", [0, 1, 2], ids=["typical", "extremes", "minimal"])
@pytest.mark.parametrize(("type_id", "cls"), MESSAGE_TYPES, ids=TYPE_IDS)
def test_roundtrip_every_message_type(type_id: int, cls: type[Message], variant: int) -> None:
    msg = sample_message(cls, random.Random(type_id * 3 + variant), variant)
    frames = encode(msg)
    assert bytes(frames[0]) == bytes((type_id,))
    back = decode([bytes(f) for f in frames])  # copied, as if off the wire
    assert_same(msg, back, cls.__name__)


@pytest.mark.parametrize("variant", [0, 1, 2], ids=["typical", "extremes", "minimal"])
@pytest.mark.parametrize(("type_id", "cls"), MESSAGE_TYPES, ids=TYPE_IDS)
def test_generated_encode_writes_the_hook_paths_bytes(
    type_id: int, cls: type[Message], variant: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-type encode path (top-level arrays put in by generated code) and the generic
    one (msgspec's enc_hook per array) write the same frames, and neither touches the message."""
    from laminar.transport import codec

    msg = sample_message(cls, random.Random(type_id * 5 + variant), variant)
    before = {name: getattr(msg, name) for name in cls.__struct_fields__}
    fast = [bytes(f) for f in encode(msg)]
    assert {name: getattr(msg, name) for name in cls.__struct_fields__}.keys() == before.keys()
    for name, value in before.items():
        assert getattr(msg, name) is value, f"encode replaced {cls.__name__}.{name}"
    monkeypatch.setattr(
        codec, "_ENC_FAST", dict.fromkeys(REGISTRY.values())
    )  # every type: the hook
    assert [bytes(f) for f in encode(msg)] == fast


def test_generated_encode_numbers_optional_arrays_in_field_order() -> None:
    """Trajectory.loss_mask is optional: with and without it the references name the right
    frames."""
    from laminar.transport import codec

    ids = np.arange(5, dtype=np.int32)
    encode(
        Trajectory(
            uid="u",
            group_id="g",
            prompt_uid="p",
            sample_index=0,
            prompt_ids=ids,
            response_ids=ids,
            logprobs=np.zeros(5, np.float32),
            version=1,
        )
    )
    assert codec._ENC_FAST[Trajectory] is not None, "Trajectory should take the generated path"
    for mask in (None, np.ones(5, np.uint8)):
        msg = Trajectory(
            uid="u",
            group_id="g",
            prompt_uid="p",
            sample_index=0,
            prompt_ids=ids[:2],
            response_ids=ids,
            logprobs=np.zeros(5, np.float32),
            version=1,
            loss_mask=mask,
        )
        frames = encode(msg)
        assert len(frames) == 5 + (mask is not None)
        back = decode([bytes(f) for f in frames])
        assert np.array_equal(back.prompt_ids, ids[:2]) and np.array_equal(back.response_ids, ids)
        assert (back.loss_mask is None) == (mask is None)
        if mask is not None:
            assert np.array_equal(back.loss_mask, mask)


def test_encode_is_thread_safe() -> None:
    """Nodes encode on worker threads too: the per-thread packer must not mix frames up."""
    from concurrent.futures import ThreadPoolExecutor

    msgs = [sample_message(CodecProbe, random.Random(i), i % 2) for i in range(8)]

    def work(msg: Message) -> None:
        for _ in range(200):
            assert_same(msg, decode(frames_of(msg)), "CodecProbe")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, msgs))


def test_arrays_decode_as_zero_copy_views() -> None:
    msg = sample_message(Trajectory, random.Random(0))
    frames = frames_of(msg)
    back = decode(frames)
    for name in ("prompt_ids", "response_ids", "logprobs"):
        arr = getattr(back, name)
        assert not arr.flags.owndata and not arr.flags.writeable, f"{name} was copied"
    assert np.shares_memory(back.response_ids, np.frombuffer(frames[3], np.uint8))


def test_noncontiguous_and_nan_arrays_roundtrip() -> None:
    ids = np.arange(40, dtype=np.int64)[::3]
    lp = np.array([np.nan, -np.inf, 0.5], dtype=np.float32)
    msg = Trajectory(
        uid="u",
        group_id="g",
        prompt_uid="p",
        sample_index=0,
        prompt_ids=ids,
        response_ids=ids[:3],
        logprobs=lp,
        version=3,
    )
    back = decode(frames_of(msg))
    assert np.array_equal(back.prompt_ids, ids) and back.prompt_ids.dtype == np.int64
    assert np.array_equal(back.logprobs, lp, equal_nan=True)


def test_encode_refuses_what_cannot_travel() -> None:
    bad = Trajectory(
        uid="u",
        group_id="g",
        prompt_uid="p",
        sample_index=0,
        version=0,
        prompt_ids=np.array([object()], dtype=object),
        response_ids=np.zeros(1, np.int32),
        logprobs=np.zeros(1, np.float32),
    )
    with pytest.raises(TypeError, match="Trajectory"):
        encode(bad)
    with pytest.raises(TypeError, match="cannot encode"):
        encode(Ping(payload=object()))  # type: ignore[arg-type]
    assert decode(frames_of(Ping(payload="ok"))) == Ping(payload="ok")  # the packer recovered


def test_an_added_optional_field_decodes_from_a_message_without_it() -> None:
    """ExportRequest.dest came later: an empty one is not sent, and a message without it (an
    older manager's) decodes with it empty; a set one round-trips."""
    from laminar.protocol.rollout import ExportRequest

    old = frames_of(ExportRequest(uids=["g/0"]))
    assert "dest" not in _header(old)
    assert decode(old) == ExportRequest(uids=["g/0"], dest="")
    new = ExportRequest(uids=["g/0"], dest="rollout-3")
    assert _header(frames_of(new))["dest"] == "rollout-3" and decode(frames_of(new)) == new


# ---- clear rejections -------------------------------------------------------------------------


def _header(frames: list[bytes]) -> dict:
    return msgpack.unpackb(frames[1], raw=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))


def _with_header(frames: list[bytes], header: dict) -> list[bytes]:
    return [frames[0], msgpack.packb(header, use_bin_type=True), *frames[2:]]


def _traj_frames() -> list[bytes]:
    return frames_of(sample_message(Trajectory, random.Random(1)))


def _ref(index: int, dtype_code: int, shape: tuple[int, ...]) -> msgpack.ExtType:
    import struct

    return msgpack.ExtType(
        1, struct.pack(f"<HBB{len(shape)}Q", index, dtype_code, len(shape), *shape)
    )


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda f: [b"\xfe", *f[1:]], "unknown message type 0xfe"),
        (lambda f: [b"\x21\x21", *f[1:]], "type frame must be 1 byte"),
        (lambda f: f[:1], "at least 2 frames"),
        (lambda f: [f[0], b"\xc1", *f[2:]], "not valid msgpack"),
        (
            lambda f: [f[0], msgpack.packb([1, 2]), *f[2:]],
            "Trajectory: Expected `object`, got `array`",
        ),
        (
            lambda f: _with_header(f, {k: v for k, v in _header(f).items() if k != "version"}),
            "Trajectory: Object missing required field `version`",
        ),
        (lambda f: _with_header(f, {**_header(f), "bogus": 1}), "unknown field `bogus`"),
        (
            lambda f: _with_header(f, {**_header(f), "version": "3"}),
            "Trajectory.version: Expected `int`, got `str`",
        ),
        (
            lambda f: _with_header(f, {**_header(f), "sample_index": True}),
            "Trajectory.sample_index: Expected `int`, got `bool`",
        ),
        (
            lambda f: _with_header(f, {**_header(f), "prompt_ids": [1, 2]}),
            "Trajectory.prompt_ids: Expected `ext`, got `array`",
        ),
        (
            lambda f: _with_header(f, {**_header(f), "timings": {"t": "x"}}),
            r"Trajectory.timings\[...\]: Expected `float`, got `str`",
        ),
        (
            lambda f: _with_header(f, {**_header(f), "logprobs": _ref(2, 11, (4,))}),
            "dtype 'float64' not allowed",
        ),
        (
            lambda f: _with_header(f, {**_header(f), "logprobs": _ref(2, 10, (2, 2))}),
            "expected 1-d array",
        ),
        (lambda f: _with_header(f, {**_header(f), "logprobs": _ref(2, 10, (2**62,))}), "needs"),
        (
            lambda f: _with_header(f, {**_header(f), "logprobs": _ref(9, 10, (1,))}),
            "missing frame 9",
        ),
        (
            lambda f: _with_header(f, {**_header(f), "logprobs": _ref(0, 10, (len(f[2]) // 4,))}),
            "referenced twice",
        ),
        (
            lambda f: _with_header(
                f, {**_header(f), "reward_info": {"a": msgpack.ExtType(7, b"")}}
            ),
            "unknown msgpack ext type 7",
        ),
        (
            lambda f: _with_header(f, {**_header(f), "reward": msgpack.ExtType(1, b"")}),
            r"Trajectory.reward: Expected `float \| null`, got `ext`",
        ),
        (lambda f: [*f, b"spare"], "not referenced"),
        (lambda f: [f[0], f[1], f[3], f[2], f[4]], "frame has"),
        (lambda f: [*f[:4], f[4][:-1]], "frame has"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_decode_rejects_with_a_clear_error(mutate, error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        decode(mutate(_traj_frames()))


def test_array_errors_name_the_path_through_nested_messages() -> None:
    trajs = [sample_message(Trajectory, random.Random(i)) for i in range(3)]
    frames = frames_of(BatchReply(batch_id="b", trajectories=trajs))
    header = _header(frames)
    header["trajectories"][1]["logprobs"] = _ref(2 + 3 * 1, 11, (4,))
    with pytest.raises(
        ProtocolError, match=r"BatchReply.trajectories\[1\].logprobs: dtype 'float64'"
    ):
        decode(_with_header(frames, header))
    assert_same(BatchReply(batch_id="b", trajectories=trajs), decode(frames), "BatchReply")


def test_limits_are_enforced() -> None:
    frames = _traj_frames()
    with pytest.raises(ProtocolError, match="header of"):
        decode(frames, Limits(max_header_bytes=16))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode(frames, Limits(max_frames=3))
    with pytest.raises(ProtocolError, match="message of"):
        decode(frames, Limits(max_message_bytes=64))
    with pytest.raises(ProtocolError, match="Ping.payload: string of 100 characters exceeds"):
        decode(frames_of(Ping(payload="x" * 100)), Limits(max_str_len=10))
    with pytest.raises(
        ProtocolError, match=r"ToolCallRequest.arguments.k: 40 items exceed max_list_len 8"
    ):
        call = ToolCallRequest(call_id="c", name="n", arguments={"k": list(range(40))})
        decode(frames_of(call), Limits(max_list_len=8))
    decode(frames, Limits(max_str_len=64, max_list_len=64))  # tight limits a valid message meets


@pytest.mark.parametrize(
    ("make_info", "path"),
    [
        (lambda ref: {"a": ref}, "ToolCallRequest.arguments.a"),
        (lambda ref: {"a": [1, {"b": [ref]}]}, r"ToolCallRequest.arguments.a\[1\].b\[0\]"),
    ],
    ids=["direct", "nested"],
)
def test_free_form_fields_refuse_arrays_and_name_the_path(make_info, path: str) -> None:
    frames = frames_of(ToolCallRequest(call_id="c", name="n"))
    bad = _with_header(frames, {**_header(frames), "arguments": make_info(_ref(0, 5, (1,)))})
    with pytest.raises(ProtocolError, match=path + ": arrays are not allowed"):
        decode([*bad, b"\x00" * 4])


@pytest.mark.parametrize(
    "frames", [None, "frames", [b"\x08"], [b"\x08", 5], [None, b"\x80"], [b"\x08", "str"]]
)
def test_decode_rejects_what_is_not_a_list_of_byte_frames(frames: Any) -> None:
    with pytest.raises(ProtocolError):
        decode(frames)


def test_decode_accepts_any_byte_buffer() -> None:
    msg = sample_message(Trajectory, random.Random(2))
    frames = encode(msg)
    views = [
        bytearray(frames[0]),
        memoryview(frames[1]),
        *(np.frombuffer(f, np.int32) if i == 0 else f for i, f in enumerate(frames[2:])),
    ]
    views[2] = memoryview(views[2])  # a 4-byte-item view: its len() is not its byte count
    assert_same(msg, decode(views), "Trajectory")


# ---- fuzzing: decode raises ProtocolError or returns a message, nothing else ---------------


def _decode_or_protocol_error(frames: list[bytes]) -> None:
    try:
        msg = decode(frames)
    except ProtocolError:
        return
    assert isinstance(msg, Message)


@given(st.lists(st.binary(max_size=80), max_size=6))
def test_fuzz_random_frames(frames: list[bytes]) -> None:
    _decode_or_protocol_error(frames)


_any_frame = st.one_of(
    st.binary(max_size=24),
    st.builds(bytearray, st.binary(max_size=8)),
    st.builds(memoryview, st.binary(max_size=8)),
    st.none(),
    st.integers(),
    st.text(max_size=4),
)


@given(st.one_of(st.lists(_any_frame, max_size=5), st.tuples(_any_frame, _any_frame), _any_frame))
def test_fuzz_frames_of_any_type(frames: Any) -> None:
    _decode_or_protocol_error(frames)


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(st.data())
def test_fuzz_typed_headers(data: st.DataObject) -> None:
    """A real type byte and a header with the right field names but random values."""
    tid, cls = data.draw(st.sampled_from(MESSAGE_TYPES))
    names = [f.name for f in msgspec.structs.fields(cls)] + ["bogus"]
    header = data.draw(
        st.dictionaries(st.sampled_from(names), _msgpack_values, max_size=len(names))
    )
    extra = data.draw(st.lists(st.binary(max_size=16), max_size=3))
    _decode_or_protocol_error([bytes((tid,)), msgpack.packb(header, use_bin_type=True), *extra])


def _huge_shapes(frames: list[bytes], dims: tuple[int, ...]) -> list[bytes]:
    def walk(x: Any) -> Any:
        if isinstance(x, msgpack.ExtType) and x.code == 1 and len(x.data) >= 4:
            return msgpack.ExtType(
                1, x.data[:2] + x.data[2:3] + bytes((len(dims),)) + np.array(dims, "<u8").tobytes()
            )
        if isinstance(x, list):
            return [walk(i) for i in x]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    return _with_header(frames, walk(_header(frames)))


_SAMPLES = [
    frames_of(sample_message(cls, random.Random(v), v))
    for (_, cls), v in itertools.product(MESSAGE_TYPES, range(3))
]


@given(st.data())
def test_fuzz_mutated_valid_frames(data: st.DataObject) -> None:
    frames = list(data.draw(st.sampled_from(_SAMPLES)))
    for _ in range(data.draw(st.integers(1, 3))):
        kind = data.draw(
            st.sampled_from(["flip", "truncate", "swap", "extra", "drop", "type", "shape"])
        )
        i = data.draw(st.integers(0, len(frames) - 1)) if frames else 0
        if kind == "flip" and frames and frames[i]:
            pos = data.draw(st.integers(0, len(frames[i]) - 1))
            b = bytearray(frames[i])
            b[pos] ^= 1 << data.draw(st.integers(0, 7))
            frames[i] = bytes(b)
        elif kind == "truncate" and frames:
            frames[i] = frames[i][: data.draw(st.integers(0, max(0, len(frames[i]) - 1)))]
        elif kind == "swap" and len(frames) > 1:
            j = data.draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
        elif kind == "extra":
            frames.insert(data.draw(st.integers(0, len(frames))), data.draw(st.binary(max_size=32)))
        elif kind == "drop" and frames:
            frames.pop(i)
        elif kind == "type" and frames:
            frames[0] = bytes((data.draw(st.integers(0, 255)),))
        elif kind == "shape" and len(frames) > 1:
            dims = tuple(
                data.draw(
                    st.lists(
                        st.sampled_from([0, 1, 7, 2**31, 2**62, 2**64 - 1]), min_size=1, max_size=4
                    )
                )
            )
            try:
                frames = _huge_shapes(frames, dims)
            except Exception:  # the header was already mangled by an earlier mutation
                pass
    _decode_or_protocol_error(frames)
