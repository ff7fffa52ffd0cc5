"""Relay chain acceptance tests with real processes (manager + relays, `python -m laminar node`).

    .venv/bin/python -m pytest tests/test_relay_chain.py -q

Each test starts its own manager and relays (RelayProcs: private ipc dir, private shm
prefix, stopped by pid, segments removed), pushes from this process with WeightPusher,
and checks what every relay holds through ChainInfo (version + checksum). The chain
order comes from the manager (or the relays' defaults); tests read it, never assume it.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from laminar.weights.pusher import WeightPusher
from tests.relay_procs import RelayProcs


def _state(mb: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = int(mb * (1 << 20)) // 4
    return {
        "embed.weight": torch.randn(n // 2, generator=g).to(torch.bfloat16).reshape(-1, 64),
        "layer.0.w": torch.randn(n // 4, generator=g),
        "layer.0.b": torch.randn(77, generator=g),
        "layer.1.w": torch.randn(n // 4, generator=g).to(torch.bfloat16),
        "step": torch.tensor(seed),
    }


@pytest.fixture
def relays(short_dir):
    started: list[RelayProcs] = []

    def make(n: int, corrupt_chunks: list[int] | None = None, **overrides) -> RelayProcs:
        procs = RelayProcs(
            short_dir / f"c{len(started)}", n, overrides, corrupt_chunks=corrupt_chunks
        )
        started.append(procs.start())
        return procs

    yield make
    for procs in started:
        procs.stop()  # by pid; also removes the segments a SIGKILLed relay left behind


async def _setup(procs: RelayProcs) -> tuple[list[int], WeightPusher]:
    await procs.wait_ready(timeout=30)
    order = await procs.wait_chain(timeout=30)
    pusher = procs.pusher("trainer-0")
    await pusher.start()
    return order, pusher


async def test_push_is_bit_identical_at_every_relay_of_a_4_relay_chain(relays):
    procs = relays(4, **{"relay.chunk_bytes": 1 << 18})
    try:
        order, pusher = await _setup(procs)
        state = _state(2, seed=1)
        for version in (1, 2):
            state["layer.0.w"] += 1.0
            stall = await pusher.push(version, state)
            assert stall < 10
            infos = await procs.wait_version(version, order, timeout=30)
            assert len({info.checksum for info in infos.values()}) == 1, infos
            assert all(info.version == version for info in infos.values())
        # what a rollout reads at the end of the chain is bit-identical to what was pushed
        puller = procs.puller("rollout-9", relay_index=order[-1])
        await puller.start()
        async with await puller.pull() as w:
            assert w.version == 2 and w.checksum == infos[order[-1]].checksum and w.verify()
            got = dict(w.named_tensors())
            assert list(got) == list(state)
            for name, t in state.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        await puller.close()
        await pusher.close()
    finally:
        await procs.close_clients()


async def test_corrupted_chunk_is_detected_and_refetched(relays):
    # every relay corrupts chunks 1 and 3 the first time it sends them (tests/relay_faults.py)
    procs = relays(3, corrupt_chunks=[1, 3], **{"relay.chunk_bytes": 1 << 18})
    try:
        order, pusher = await _setup(procs)
        await pusher.push(1, _state(1.5, seed=2))
        infos = await procs.wait_version(1, order, timeout=30)
        assert len({info.checksum for info in infos.values()}) == 1
        # every corrupted send was caught by the relay that fetched it, which fetched it again
        # (who fetched what from whom depends on timing: a hop may fall back to the master)
        sent_bad = sum(i.counters.get("chunks_corrupted_on_purpose", 0) for i in infos.values())
        caught = sum(i.counters.get("chunks_corrupt", 0) for i in infos.values())
        assert sent_bad >= 2 and caught == sent_bad, infos
        await pusher.close()
    finally:
        await procs.close_clients()


async def test_killing_a_middle_relay_mid_broadcast_heals_the_chain(relays):
    # an emulated 4 MB/s link makes the broadcast last ~1.3 s per hop, so the kill lands mid-way
    procs = relays(4, **{"relay.chunk_bytes": 1 << 17, "relay.link_bytes_per_s": 4e6})
    try:
        order, pusher = await _setup(procs)
        await pusher.push(1, _state(8, seed=3))
        middle, last = order[1], order[-1]
        t0 = time.monotonic()
        while True:  # wait until the end of the chain is receiving, then kill a middle hop
            info = await procs.info(last)
            if info is not None and info.incoming_version == 1 and info.incoming_have > 0:
                break
            assert info is None or info.version < 1, (
                "broadcast finished before the kill: slow the link"
            )
            assert time.monotonic() - t0 < 30, "the end of the chain never started receiving"
            await asyncio.sleep(0.01)  # poll interval of a deadline-bounded wait
        procs.kill(middle)
        survivors = [i for i in order if i != middle]
        infos = await procs.wait_version(1, survivors, timeout=60)
        assert len({infos[i].checksum for i in survivors}) == 1
        assert infos[last].incoming_have == 0
        # the healed chain carries the next version too
        await pusher.push(2, _state(1, seed=4))
        infos = await procs.wait_version(2, survivors, timeout=60)
        assert len({infos[i].checksum for i in survivors}) == 1
        assert all(middle not in infos[i].order or infos[i].upstream != middle for i in survivors)
        await pusher.close()
    finally:
        await procs.close_clients()


async def test_killing_the_master_elects_a_new_one_and_the_next_push_reaches_everyone(relays):
    procs = relays(3, **{"relay.chunk_bytes": 1 << 18})
    try:
        order, pusher = await _setup(procs)
        await pusher.push(1, _state(1, seed=5))
        await procs.wait_version(1, order, timeout=30)
        master = order[0]
        procs.kill(master)
        survivors = order[1:]
        stall = await pusher.push(2, _state(1, seed=6))  # finds the new master by itself
        assert stall < 30
        infos = await procs.wait_version(2, survivors, timeout=60)
        assert len({infos[i].checksum for i in survivors}) == 1
        masters = {infos[i].master for i in survivors}
        assert len(masters) == 1 and masters <= set(survivors), infos
        assert pusher.failovers >= 1 or pusher.endpoint != procs.cfg.endpoint("relay", master)
        await pusher.close()
    finally:
        await procs.close_clients()
