"""Sparse element deltas (relay.delta): the encoding, and relays that forward deltas down a chain.

    .venv/bin/python -m pytest tests/test_weights_delta.py -q

The codec tests check bitwise reconstruction and the encoding choice at its size
crossover; the chain tests run three relays inside the test process (as tests/test_weights.py
does) and look at what each one received and rebuilt.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch
from inproc_relays import InprocRelays

from laminar.config import config_from_dict
from laminar.logs import get_logger
from laminar.message import ProtocolError
from laminar.protocol.relay import ChainUpdate, FetchChunk, WeightChunk
from laminar.supervise import detached_spawn
from laminar.transport.client import RpcClient
from laminar.transport.sockets import Wiring
from laminar.weights.delta import (
    BITMASK,
    INDICES,
    apply_delta,
    choose_encoding,
    chunk_words,
    delta_header,
    encode_delta,
    encoded_sizes,
)
from laminar.weights.layout import build_layout, checksum_buffer, chunk_digest
from laminar.weights.puller import WeightPuller
from laminar.weights.pusher import WeightPusher
from laminar.wiring.common import relay_links, socket_options
from tests.relay_faults import corrupt_chunks

CHUNK = 1 << 16


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def _sparse_change(t: torch.Tensor, frac: float, gen: torch.Generator) -> torch.Tensor:
    """A copy of t with about `frac` of its elements moved by one ulp-scale step."""
    out = t.clone()
    flat = out.view(-1)
    idx = torch.randperm(flat.numel(), generator=gen)[: max(1, int(frac * flat.numel()))]
    flat[idx] = (flat[idx].float() * (1 + 2**-6) + 1e-3).to(t.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("frac", [0.0, 0.001, 0.02, 0.2, 0.9])
def test_delta_rebuilds_the_chunk_bitwise(dtype, frac):
    gen = torch.Generator().manual_seed(int(frac * 1000) + dtype.itemsize)
    base = torch.randn(200_000, generator=gen).to(dtype)  # 4 blocks of 65536 words
    base[:4] = torch.tensor([0.0, -0.0, float("nan"), float("inf")]).to(dtype)
    new = _sparse_change(base, frac, gen)
    new[0] = -0.0  # equal as a number, different bits: must travel
    new[65535:65537] += 1  # both sides of a block boundary
    b, n = _bits(base), _bits(new)
    word = dtype.itemsize
    blob = encode_delta(n, b, word)
    changed = int(np.count_nonzero(b.view(f"<u{word}") != n.view(f"<u{word}")))
    assert changed >= 1
    if blob is None:  # full chunk smaller: only when nearly everything changed
        assert choose_encoding(len(n) // word, changed, word) == 0 and frac >= 0.9
        return
    enc, w, nw, k = delta_header(blob)
    assert (w, nw, k) == (word, len(n) // word, changed)
    assert len(blob) == encoded_sizes(nw, k, w)[enc] < len(n)
    out = np.empty_like(n)
    assert apply_delta(out, b, blob) == changed
    assert out.tobytes() == n.tobytes()


def test_the_smaller_encoding_is_chosen_at_the_crossover():
    n, w = 1 << 20, 2  # 2 MiB of bf16 words: 16 blocks of 65536
    sizes = lambda k: encoded_sizes(n, k, w)  # noqa: E731
    # indices: 12 + 4·16 + 4k, bitmask: 12 + n/8 + 2k -> equal at k = (n/8 - 64) / 2
    cross = (n // 8 - 64) // 2
    assert sizes(cross)[INDICES] == sizes(cross)[BITMASK]
    assert choose_encoding(n, cross - 1, w) == INDICES
    assert choose_encoding(n, cross + 1, w) == BITMASK
    # bitmask vs full: 12 + n/8 + 2k >= 2n from k = (15n/8 - 12) / 2 on
    full_from = -(-(2 * n - n // 8 - 12) // 2)
    assert choose_encoding(n, full_from - 1, w) == BITMASK
    assert choose_encoding(n, full_from, w) == 0
    # and the encoder produces what the chooser says, for real arrays on both sides of it
    base = np.zeros(n * w, dtype=np.uint8)
    for k, want in ((cross - 1, INDICES), (cross + 1, BITMASK), (full_from, 0)):
        new = base.copy()
        new.view("<u2")[np.linspace(0, n - 1, k).astype(np.int64)] = 7
        blob = encode_delta(new, base, w)
        if want == 0:
            assert blob is None
            continue
        assert blob is not None and delta_header(blob)[0] == want
        assert len(blob) == sizes(k)[want]
    # fp32 words in a small chunk (one block): 12 + 4 + 6k vs 12 + 512 + 4k -> k = 254
    assert encoded_sizes(4096, 254, 4)[INDICES] == encoded_sizes(4096, 254, 4)[BITMASK]
    assert choose_encoding(4096, 253, 4) == INDICES
    assert choose_encoding(4096, 255, 4) == BITMASK


def test_word_size_follows_the_smallest_dtype_of_each_chunk():
    layout = build_layout(
        [
            ("w", "bfloat16", (CHUNK,)),
            ("b", "float32", (CHUNK // 2,)),
            ("i8", "int8", (16,)),
            ("c", "complex128", (CHUNK // 16,)),
        ]
    )
    words = chunk_words(layout, CHUNK)
    # chunks 0-1: bf16; 2-3: fp32; 4: int8 + the head of the complex -> 1 byte;
    # 5: the rest of the complex128 -> capped at 8
    assert list(words) == [2, 2, 4, 4, 1, 8]
    assert list(chunk_words(layout, 4098)[:2]) == [2, 2]  # 4098 is not a multiple of 4 or 8


def test_malformed_deltas_are_protocol_errors():
    base = np.zeros(4096, dtype=np.uint8)
    new = base.copy()
    new[10] = 1
    blob = encode_delta(new, base, 2)
    assert blob is not None
    out = np.empty_like(base)
    with pytest.raises(ProtocolError, match="shorter than its header"):
        apply_delta(out, base, blob[:5])
    with pytest.raises(ProtocolError, match="header says"):
        apply_delta(out, base, blob[:-1])
    with pytest.raises(ProtocolError, match="chunk has"):
        apply_delta(out[:2048], base[:2048], blob)
    bad = blob.copy()
    bad[16:18] = 0xFF  # position 65535 in a 2048-word chunk (after the header and 1 count)
    with pytest.raises(ProtocolError, match="outside a chunk"):
        apply_delta(out, base, bad)
    bad = blob.copy()
    bad[12] = 2  # the block count says 2 changed words, the header 1
    with pytest.raises(ProtocolError, match="add up to"):
        apply_delta(out, base, bad)
    # a well-formed delta rebuilt on the wrong base: only the crc32 of the full chunk catches it
    wrong = base.copy()
    wrong[100] = 5
    apply_delta(out, wrong, blob)
    assert chunk_digest(out) != chunk_digest(new)


# ---- relays ---------------------------------------------------------------------------------
@pytest.fixture
async def relays(short_dir, zctx):
    """start(n, **relay_overrides) -> (cfg, relays) in this process over ipc, delta mode on."""
    relays = InprocRelays(zctx)

    async def start(n: int, **relay: object):
        cfg = config_from_dict(
            {
                "name": "wd",
                "cluster": {"transport": "ipc", "ipc_dir": str(short_dir), "roles": {"relay": n}},
                "transport": {
                    "heartbeat_interval_s": 0.1,
                    "heartbeat_liveness": 10,
                    "handshake_timeout_s": 2.0,
                    "request_timeout_s": 5.0,
                },
                "relay": {
                    "shm_prefix": f"lamd{os.getpid()}{short_dir.name}",
                    "chunk_bytes": CHUNK,
                    "probe_timeout_s": 0.3,
                    "upstream_grace_s": 5.0,
                    "delta": True,
                    **relay,
                },
            }
        )
        return cfg, await relays.start(cfg)

    yield start
    await relays.stop()


def _wiring(cfg, zctx, node_id: str, role: str) -> Wiring:
    opts = socket_options(cfg)
    return Wiring(zctx, opts, node_id, role, get_logger(role=role, node_id=node_id), detached_spawn)


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(96, 1024, generator=g).to(torch.bfloat16),  # 192 KiB: 3 chunks
        "mlp": torch.randn(256, 256, generator=g).to(torch.bfloat16),  # 128 KiB: 2 chunks
        "norm": torch.randn(40_000, generator=g),  # fp32, 160 KiB
        "step": torch.arange(3),
    }


def _step(state: dict[str, torch.Tensor], frac: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for k in ("emb", "mlp", "norm"):
        state[k] = _sparse_change(state[k], frac, g)
    state["step"] += 1


async def _at(relays, version: int, wait_until) -> None:
    await wait_until(
        lambda: all(r.store.current and r.store.current.version == version for r in relays),
        15,
        f"v{version} on every relay",
    )


def _full_bytes(relay) -> int:
    return relay.store.current.layout.total_bytes


async def _assert_exact(cfg, zctx, relays, state) -> None:
    """Every relay holds the master's checksum, the checksum of its own bytes, and a rollout of
    the last relay reads back the pushed tensors bit for bit."""
    want = relays[0].store.current.checksum
    for r in relays:
        cur = r.store.current
        assert cur.checksum == want
        assert checksum_buffer(cur.layout, cur.chunk_bytes, cur.buf) == want
    puller = WeightPuller(
        relay_links(cfg), _wiring(cfg, zctx, "rollout-9", "rollout"), relay_index=len(relays) - 1
    )
    await puller.start()
    try:
        async with await puller.pull() as w:
            got = dict(w.named_tensors())
            for k, t in state.items():
                assert np.array_equal(_bits(got[k]), _bits(t)), k
    finally:
        await puller.close()


async def test_chain_forwards_sparse_deltas_and_rebuilds_bitwise(relays, zctx, wait_until):
    cfg, rs = await relays(3)
    pusher = WeightPusher(relay_links(cfg), _wiring(cfg, zctx, "trainer-0", "trainer"))
    await pusher.start()
    state = _model(0)
    await pusher.push(1, state)
    await _at(rs, 1, wait_until)
    full = _full_bytes(rs[0])
    before = [r.metrics.counters.get("bytes_received", 0) for r in rs]
    assert before[1] >= full and before[2] >= full  # no base yet: full chunks
    _step(state, 0.01, seed=1)
    await pusher.push(2, state)
    await _at(rs, 2, wait_until)
    await _assert_exact(cfg, zctx, rs, state)
    for r, b in zip(rs[1:], before[1:], strict=True):
        got = r.metrics.counters.get("bytes_received", 0) - b
        assert 0 < got < 0.1 * full, got  # 1% of the elements changed: a few % of the bytes
        assert r.metrics.counters.get("chunks_delta", 0) == r.store.current.n
        assert r.metrics.counters.get("chunks_corrupt", 0) == 0
    # relay 1 forwarded the master's deltas as they came: both hops carried the same bytes
    hop = [r.metrics.counters.get("bytes_received", 0) - b for r, b in zip(rs, before, strict=True)]
    assert hop[1] == hop[2]
    await pusher.close()


async def test_a_relay_that_missed_the_base_gets_full_weights(relays, zctx, wait_until):
    cfg, rs = await relays(3)

    async def order(epoch: int, chain: list[int]) -> None:  # as the manager would
        for i in range(3):
            cli = RpcClient(zctx, cfg.endpoint("relay", i), "manager-0", "manager")
            await cli.connect(timeout=2)
            await cli.request(ChainUpdate(epoch=epoch, order=chain))
            await cli.close()

    pusher = WeightPusher(relay_links(cfg), _wiring(cfg, zctx, "trainer-0", "trainer"))
    await pusher.start()
    state = _model(1)
    await pusher.push(1, state)
    await _at(rs, 1, wait_until)
    full = _full_bytes(rs[0])
    await order(1, [0, 1])  # relay 2 leaves the chain holding v1 and misses v2
    for v in (2, 3):
        _step(state, 0.005, seed=v)
        await pusher.push(v, state)
        await _at(rs[:2], v, wait_until)
    assert rs[2].store.current.version == 1
    before = [r.metrics.counters.get("bytes_received", 0) for r in rs]
    await order(2, [0, 1, 2])  # back: relay 1's v3 deltas are against v2, which relay 2 lacks
    await _at(rs, 3, wait_until)
    await _assert_exact(cfg, zctx, rs, state)
    assert rs[1].metrics.counters["bytes_received"] == before[1]
    assert rs[2].metrics.counters["bytes_received"] - before[2] == full
    assert rs[2].metrics.counters.get("chunks_delta", 0) == 0
    # a requester whose base is not the one the deltas are against (it missed v2) gets the
    # chunk whole, never a delta it would rebuild on the wrong version
    data = RpcClient(zctx, cfg.endpoint("relay_data", 0), "relay-7", "relay")
    await data.connect(timeout=2)
    for base, delta in ((2, True), (1, False), (-1, False)):
        reply = await data.request(FetchChunk(version=3, index=0, base_version=base))
        assert isinstance(reply, WeightChunk)
        assert (reply.base_version == 2) == delta and (len(reply.data) == CHUNK) != delta
    await data.close()
    await pusher.close()


async def test_a_corrupt_delta_is_detected_and_the_chunk_refetched(relays, zctx, wait_until):
    cfg, rs = await relays(2)
    for r in rs:  # each sends chunks 0 and 3 of each version corrupted once
        corrupt_chunks(r, [0, 3])
    pusher = WeightPusher(relay_links(cfg), _wiring(cfg, zctx, "trainer-0", "trainer"))
    await pusher.start()
    state = _model(2)
    await pusher.push(1, state)
    await _at(rs, 1, wait_until)
    corrupt1 = rs[1].metrics.counters.get("chunks_corrupt", 0)
    assert corrupt1 == 2  # full chunks 0 and 3, flipped once each
    _step(state, 0.02, seed=3)
    await pusher.push(2, state)
    await _at(rs, 2, wait_until)
    # the flipped deltas rebuilt chunks whose crc32 did not match (or did not parse): refetched
    assert rs[1].metrics.counters["chunks_corrupt"] - corrupt1 == 2
    assert rs[0].metrics.counters["chunks_corrupted_on_purpose"] == 4
    await _assert_exact(cfg, zctx, rs, state)
    await pusher.close()


async def test_delta_off_sends_full_chunks(relays, zctx, wait_until):
    cfg, rs = await relays(2, delta=False)
    pusher = WeightPusher(relay_links(cfg), _wiring(cfg, zctx, "trainer-0", "trainer"))
    await pusher.start()
    state = _model(3)
    await pusher.push(1, state)
    await _at(rs, 1, wait_until)
    _step(state, 0.001, seed=4)
    await pusher.push(2, state)
    await _at(rs, 2, wait_until)
    assert rs[1].metrics.counters["bytes_received"] == 2 * _full_bytes(rs[0])
    assert not rs[0].store.current.deltas
    await _assert_exact(cfg, zctx, rs, state)
    await pusher.close()


def test_layout_mismatch_means_no_delta():
    from laminar.weights.delta import delta_base
    from laminar.weights.segment import WeightStore, default_shm_dir

    store = WeightStore(default_shm_dir(), f"lamdl{os.getpid()}")
    try:
        a = build_layout([("w", "bfloat16", (4096,))])
        b = build_layout([("w", "float32", (2048,))])

        async def run():
            v1 = await store.begin(1, a, 4096, source="trainer")
            store.complete(v1, "x")
            v2 = await store.begin(2, a, 4096, source="upstream")
            v3 = await store.begin(3, b, 4096, source="upstream")
            v4 = await store.begin(4, a, 8192, source="upstream")
            return v1, v2, v3, v4

        v1, v2, v3, v4 = asyncio.run(run())
        assert delta_base(True, v1, v2) == 1
        assert delta_base(False, v1, v2) == -1
        assert delta_base(True, v1, v3) == -1  # another layout
        assert delta_base(True, v1, v4) == -1  # another chunking
        assert delta_base(True, None, v2) == -1
    finally:
        store.close()


async def test_dense_updates_travel_whole(relays, zctx, wait_until):
    from laminar.weights.delta import MAX_DELTA_FRAC

    cfg, rs = await relays(2)
    pusher = WeightPusher(relay_links(cfg), _wiring(cfg, zctx, "trainer-0", "trainer"))
    await pusher.start()
    state = _model(5)
    await pusher.push(1, state)
    await _at(rs, 1, wait_until)
    before = rs[1].metrics.counters["bytes_received"]
    _step(state, 0.7, seed=6)  # 70% of the elements: every delta is over MAX_DELTA_FRAC
    await pusher.push(2, state)
    await _at(rs, 2, wait_until)
    assert MAX_DELTA_FRAC < 0.7 and not rs[0].store.current.deltas
    assert rs[1].metrics.counters["bytes_received"] - before == _full_bytes(rs[0])
    await _assert_exact(cfg, zctx, rs, state)
    await pusher.close()
