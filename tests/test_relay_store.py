"""Layout validation, checksums and the shared-memory store (no sockets, no processes).

.venv/bin/python -m pytest tests/test_relay_store.py -q
"""

from __future__ import annotations

import os
import zlib

import msgspec
import numpy as np
import pytest

from laminar.message import ProtocolError
from laminar.transport.codec import roundtrip
from laminar.weights.layout import (
    ALIGN,
    build_layout,
    checksum_buffer,
    chunk_digest,
    chunk_range,
    crc_of,
    n_chunks,
    validate_layout,
    version_checksum,
)
from laminar.weights.segment import OutOfSlots, WeightStore


def test_layout_aligns_every_tensor_and_roundtrips_the_codec():
    lay = build_layout(
        [
            ("w", "bfloat16", (3, 5)),
            ("b", "float32", (7,)),
            ("s", "int64", ()),
            ("e", "float16", (0, 4)),
        ]
    )
    assert all(off % ALIGN == 0 for off in lay.offsets)
    assert lay.offsets[1] >= 3 * 5 * 2 and lay.total_bytes % ALIGN == 0
    validate_layout(lay)
    assert roundtrip(lay) == lay


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(offsets=[0, 8]), "overlaps"),
        (dict(offsets=[0, 301]), "misaligned"),
        (dict(total_bytes=100), "past total_bytes"),
        (dict(dtypes=["float32", "complex1024"]), "unknown dtype"),
        (dict(names=["a", "a"]), "duplicate"),
        (dict(shapes=[[4, 4], [-1]]), "negative"),
        (dict(offsets=[0]), "differ in length"),
    ],
)
def test_bad_layouts_from_the_network_are_rejected(change, error):
    good = build_layout([("a", "float32", (4, 4)), ("b", "float32", (8,))])
    bad = msgspec.structs.replace(good, **change)
    with pytest.raises(ProtocolError, match=error):
        validate_layout(bad)


def test_version_checksum_follows_every_byte_and_the_layout():
    lay = build_layout([("a", "uint8", (10_000,))])
    buf = np.random.default_rng(0).integers(0, 255, lay.total_bytes, dtype=np.uint8)
    cb = 4096
    crcs = [
        zlib.crc32(buf[slice(*chunk_range(i, cb, lay.total_bytes))])
        for i in range(n_chunks(lay.total_bytes, cb))
    ]
    ref = version_checksum(lay, cb, crcs)
    assert checksum_buffer(lay, cb, buf) == ref
    buf[5000] ^= 1
    assert checksum_buffer(lay, cb, buf) != ref
    other = build_layout([("b", "uint8", (10_000,))])
    assert version_checksum(other, cb, crcs) != ref
    d = chunk_digest(buf[:cb], with_adler=True)
    assert crc_of(d) == zlib.crc32(buf[:cb]) and d >> 32 == zlib.adler32(buf[:cb])


@pytest.fixture
def store(short_dir):
    st = WeightStore(str(short_dir), "lamtest-relay0", spare_slots=1, max_slots=3)
    yield st
    st.close()
    assert os.listdir(short_dir) == []  # close() unlinks every segment


async def test_store_double_buffers_and_frees_unpinned_versions(store, short_dir):
    lay = build_layout([("a", "float32", (4096,))])
    v1 = await store.begin(1, lay, 4096, "upstream")
    v1.buf[: lay.total_bytes] = 1
    for i in range(v1.n):
        store.mark(v1, i, 0)
    store.complete(v1, "c1")
    store.pin("r0", 1)
    v2 = await store.begin(2, lay, 4096, "upstream")
    assert v2.slot is not v1.slot  # never written over a complete version
    v2.buf[: lay.total_bytes] = 2
    store.complete(v2, "c2")
    assert store.current is v2 and 1 in store.versions  # pinned: kept
    assert bool((v1.buf[: lay.total_bytes] == 1).all())
    assert store.unpin("r0", 1) and 1 not in store.versions  # released: freed to the spare list
    v3 = await store.begin(3, lay, 4096, "upstream")
    assert v3.slot is v1.slot  # the spare is reused: no new segment
    assert store.slots_created == 2


async def test_store_refuses_a_version_when_every_slot_is_pinned(store):
    lay = build_layout([("a", "uint8", (100,))])
    for v in (1, 2, 3):
        vs = await store.begin(v, lay, 4096, "upstream")
        store.complete(vs, f"c{v}")
        store.pin("reader", v)
    with pytest.raises(OutOfSlots, match="pinned"):
        await store.begin(4, lay, 4096, "upstream")
    assert store.unpin_peer("reader") == 3  # a dead reader releases everything it held
    await store.begin(4, lay, 4096, "upstream")


async def test_wait_chunk_wakes_on_arrival_and_on_abandon(store):
    import asyncio

    lay = build_layout([("a", "uint8", (10_000,))])
    vs = await store.begin(1, lay, 4096, "upstream")
    waiter = asyncio.create_task(store.wait_chunk(vs, 2, timeout=5))
    await asyncio.sleep(0)
    store.mark(vs, 2, 123)
    assert await waiter is True
    waiter = asyncio.create_task(store.wait_chunk(vs, 1, timeout=5))
    await asyncio.sleep(0)
    store.abandon(vs)
    assert await waiter is False
    assert await store.wait_chunk(vs, 0, timeout=0.01) is False
