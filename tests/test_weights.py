"""WeightPusher / WeightPuller against relays: tearing, pins, reader death, slots, stream mode,
delta.

    .venv/bin/python -m pytest tests/test_weights.py -q

The torn-read test runs the relay as a real process; the others run relays inside the
test process (tests/inproc_relays.py: no manager, they skip registration) so they can look at relay
state.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from inproc_relays import InprocRelays

from laminar.config import config_from_dict
from laminar.logs import get_logger
from laminar.supervise import detached_spawn
from laminar.transport.sockets import RemoteError, Wiring
from laminar.weights.puller import WeightPuller
from laminar.weights.pusher import WeightPusher
from laminar.wiring.common import relay_links, socket_options
from tests.relay_procs import RelayProcs


def _state(mb: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = int(mb * (1 << 20)) // 4
    return {
        "a": torch.randn(n // 2, generator=g).to(torch.bfloat16),
        "b": torch.randn(n // 2, generator=g),
        "c": torch.arange(5),
    }


@pytest.fixture
async def inproc(short_dir, zctx):
    """start(n, **relay_overrides) -> (cfg, relays) running in this process over ipc."""
    relays = InprocRelays(zctx)

    async def start(n: int, **relay: object):
        cfg = config_from_dict(
            {
                "name": "wt",
                "cluster": {"transport": "ipc", "ipc_dir": str(short_dir), "roles": {"relay": n}},
                "transport": {
                    "heartbeat_interval_s": 0.05,
                    "heartbeat_liveness": 4,
                    "handshake_timeout_s": 1.0,
                    "request_timeout_s": 2.0,
                },
                "relay": {
                    "shm_prefix": f"lamw{os.getpid()}{short_dir.name}",
                    "chunk_bytes": 1 << 16,
                    "probe_timeout_s": 0.3,
                    "upstream_grace_s": 5.0,
                    **relay,
                },
            }
        )
        return cfg, await relays.start(cfg)

    yield start
    await relays.stop()


def _pusher(cfg, zctx, node_id: str = "trainer-0") -> WeightPusher:
    opts = socket_options(cfg)
    log = get_logger(role="trainer", node_id=node_id)
    return WeightPusher(
        relay_links(cfg), Wiring(zctx, opts, node_id, "trainer", log, detached_spawn)
    )


def _puller(cfg, zctx, node_id: str = "rollout-0", relay_index: int = 0) -> WeightPuller:
    opts = socket_options(cfg)
    log = get_logger(role="rollout", node_id=node_id)
    wiring = Wiring(zctx, opts, node_id, "rollout", log, detached_spawn)
    return WeightPuller(relay_links(cfg), wiring, relay_index=relay_index)


async def test_reader_holding_v_never_sees_a_torn_tensor_while_newer_versions_arrive(short_dir):
    # slots: the held v1, the reader's pin, the version being written, the newest, and a reader's
    # release still on its way under load (4 was one short: out_of_slots on a busy box)
    procs = RelayProcs(short_dir / "p", 1, {"relay.chunk_bytes": 1 << 18, "relay.max_slots": 6})
    procs.start()
    try:
        await procs.wait_ready(30)
        pusher = procs.pusher("trainer-0")
        await pusher.start()
        puller = procs.puller("rollout-0")
        await puller.start()
        state = _state(4, seed=0)
        await pusher.push(1, state)
        await puller.wait_version(1, timeout=10)
        held = await puller.pull()
        expected = {k: v.clone() for k, v in state.items()}
        seen = []

        async def reader() -> None:  # pulls the newest over and over while versions arrive
            while len(seen) < 40:
                async with await puller.pull() as w:
                    assert await asyncio.to_thread(w.verify), f"torn read of version {w.version}"
                    seen.append(w.version)
                await asyncio.sleep(0)

        read = asyncio.create_task(reader())
        for v in range(2, 7):
            for t in state.values():
                t.add_(1) if t.dtype != torch.int64 else t.add_(1)
            await pusher.push(v, state)
            # the held version is still intact, byte for byte, while v is written next to it
            assert held.verify()
            for name, t in held.named_tensors():
                assert torch.equal(t, expected[name]), name
        await puller.wait_version(6, timeout=10)
        await asyncio.wait_for(read, 60)
        assert seen == sorted(seen) and seen[-1] >= 2
        await held.release()
        await puller.close()
        await pusher.close()
    finally:
        await procs.close_clients()
        procs.stop()


async def test_pins_block_slot_reuse_and_a_dead_reader_is_released(
    inproc, zctx, fast_opts, wait_until
):
    cfg, (relay,) = await inproc(1, max_slots=2, spare_slots=0)
    pusher = _pusher(cfg, zctx)
    await pusher.start()
    puller = _puller(cfg, zctx)
    await puller.start()
    await pusher.push(1, _state(0.5, 1))
    await puller.wait_version(1, timeout=5)  # the push returns at the handoff; ready comes after
    w1 = await puller.pull()
    await pusher.push(2, _state(0.5, 2))  # v1 pinned + v2 current = both slots
    await puller.wait_version(2, timeout=5)
    with pytest.raises(RemoteError, match="out_of_slots"):
        await pusher.push(3, _state(0.5, 3))
    assert w1.verify() and relay.store.pinned() == 1
    await w1.release()
    await pusher.push(3, _state(0.5, 3))  # the released slot is reused
    await puller.wait_version(3, timeout=5)
    w3 = await puller.pull()
    assert relay.store.pins == {3: {"rollout-0": 1}}
    # the reader dies without releasing: its client stops heart-beating, the relay unpins
    await puller.client.close(say_bye=False)
    await wait_until(lambda: relay.store.pinned() == 0, 5, "the dead reader's pin to be released")
    assert w3.version == 3
    await pusher.close()


async def test_redirect_to_the_master_and_stream_mode_push(inproc, zctx, wait_until):
    from laminar.protocol.relay import ChainUpdate
    from laminar.transport.client import RpcClient

    cfg, relays = await inproc(2)
    for i in (0, 1):  # the manager makes relay-1 the master
        cli = RpcClient(zctx, cfg.endpoint("relay", i), "manager-0", "manager")
        await cli.connect(timeout=2)
        await cli.request(ChainUpdate(epoch=1, order=[1, 0]))
        await cli.close()
    pusher = _pusher(cfg, zctx)
    await pusher.start()
    pusher._same_host = lambda reply: False  # a trainer on another host: chunks over the socket
    state = _state(0.7, 4)
    await pusher.push(1, state)
    assert pusher.endpoint == cfg.endpoint("relay", 1) and pusher.mode == "stream"
    await wait_until(
        lambda: all(r.store.current and r.store.current.version == 1 for r in relays),
        10,
        "v1 on both relays",
    )
    assert relays[0].store.current.checksum == relays[1].store.current.checksum
    puller = _puller(cfg, zctx, relay_index=0)
    await puller.start()
    async with await puller.pull() as w:
        got = dict(w.named_tensors())
        assert all(torch.equal(got[k], state[k]) for k in state)
    await puller.close()
    await pusher.close()


async def test_delta_mode_sends_only_changed_chunks(inproc, zctx, wait_until):
    cfg, relays = await inproc(2, delta=True)
    pusher = _pusher(cfg, zctx)
    await pusher.start()
    state = _state(1, 5)
    await pusher.push(1, state)
    await wait_until(lambda: relays[1].store.current is not None, 10, "v1 downstream")
    state["c"] += 1  # one small tensor changes: one chunk differs
    await pusher.push(2, state)
    await wait_until(lambda: relays[1].store.current.version == 2, 10, "v2 downstream")
    assert relays[1].store.current.checksum == relays[0].store.current.checksum
    n = relays[1].store.current.n
    assert relays[1].metrics.counters.get("chunks_unchanged", 0) == n - 1
    await pusher.close()


async def test_bad_requests_get_clear_errors_and_the_relay_keeps_serving(inproc, zctx, wait_until):
    from laminar.protocol.relay import (
        ChainUpdate,
        FetchChunk,
        PullRequest,
        StageRequest,
        WeightLayout,
    )
    from laminar.transport.client import RpcClient

    cfg, (relay,) = await inproc(1)
    pusher = _pusher(cfg, zctx)
    await pusher.start()
    await pusher.push(1, _state(0.2, 1))
    await wait_until(lambda: relay.store.current is not None, 5, "v1 ready")
    # one client per role that may send each request (the others are refused: unauthorized)
    ctl = RpcClient(zctx, cfg.endpoint("relay", 0), "evil-0", "trainer")
    data = RpcClient(zctx, cfg.endpoint("relay_data", 0), "evil-1", "relay")
    reader = RpcClient(zctx, cfg.endpoint("relay", 0), "evil-2", "rollout")
    mgr = RpcClient(zctx, cfg.endpoint("relay", 0), "evil-3", "manager")
    for cli in (ctl, data, reader, mgr):
        await cli.connect(timeout=2)
    overlap = WeightLayout(
        names=["a", "b"],
        dtypes=["float32", "float32"],
        shapes=[[8], [8]],
        offsets=[0, 16],
        total_bytes=256,
    )
    cases = [
        (ctl, StageRequest(version=9, layout=overlap), "protocol"),
        (
            ctl,
            StageRequest(
                version=1,
                layout=WeightLayout(names=[], dtypes=[], shapes=[], offsets=[], total_bytes=0),
            ),
            "stale_version",
        ),
        (reader, PullRequest(version=77), "no_version"),
        (mgr, ChainUpdate(epoch=1, order=[0, 0]), "protocol"),
        (reader, StageRequest(version=3, layout=overlap), "unauthorized"),
        (data, FetchChunk(version=1, index=10_000), "protocol"),
        (data, FetchChunk(version=55, index=0), "gone"),
    ]
    for cli, msg, code in cases:
        with pytest.raises(RemoteError) as err:
            await cli.request(msg, timeout=2, retries=0)
        assert err.value.code == code, (msg, err.value)
    assert relay.srv.stats.bad_frames >= 2 and not relay.stopping.is_set()
    await pusher.push(2, _state(0.2, 2))  # still serving
    await wait_until(lambda: relay.store.current.version == 2, 5, "v2 ready")
    for cli in (ctl, data, reader, mgr):
        await cli.close()
    await pusher.close()


async def test_a_version_superseded_mid_fetch_gives_way_to_the_newer_one(inproc, zctx, wait_until):
    from laminar.protocol.relay import ChainUpdate
    from laminar.transport.client import RpcClient

    cfg, relays = await inproc(2, link_bytes_per_s=2e6, spare_slots=0)

    async def order(o: list[int], epoch: int) -> None:
        for i in (0, 1):
            cli = RpcClient(zctx, cfg.endpoint("relay", i), "manager-0", "manager")
            await cli.connect(timeout=2)
            await cli.request(ChainUpdate(epoch=epoch, order=o))
            await cli.close()

    await order([0], 1)  # relay-1 idle while v1..v3 are pushed
    pusher = _pusher(cfg, zctx)
    await pusher.start()
    for v in (1, 2, 3):
        await pusher.push(v, _state(0.5, v))
    await order([0, 1], 2)  # relay-1 joins and starts fetching v3 ...
    await wait_until(
        lambda: (inc := relays[1].store.newest_incoming()) is not None and inc.have_count > 0,
        10,
        "v3 in flight",
    )
    await pusher.push(4, _state(0.5, 4))  # ... which the master frees once v4 is complete
    await wait_until(
        lambda: relays[1].store.current is not None and relays[1].store.current.version == 4,
        20,
        "v4 downstream",
    )
    assert relays[1].store.current.checksum == relays[0].store.current.checksum
    await pusher.close()


async def test_an_empty_state_is_a_valid_version(inproc, zctx, wait_until):
    # the sim trainer pushes no tensors: versions still travel down the chain
    cfg, relays = await inproc(2)
    pusher = _pusher(cfg, zctx)
    await pusher.start()
    await pusher.push(1, {})
    await wait_until(lambda: relays[1].store.current is not None, 10, "empty v1 downstream")
    puller = _puller(cfg, zctx, relay_index=1)
    await puller.start()
    async with await puller.pull() as w:
        assert w.version == 1 and list(w.named_tensors()) == [] and w.verify()
    await puller.close()
    await pusher.close()


async def test_a_new_head_that_is_behind_catches_up_from_its_chain(inproc, zctx, wait_until):
    from laminar.protocol.relay import ChainUpdate
    from laminar.transport.client import RpcClient

    cfg, relays = await inproc(3)

    async def order(o: list[int], epoch: int) -> None:
        for i in range(3):
            cli = RpcClient(zctx, cfg.endpoint("relay", i), "manager-0", "manager")
            await cli.connect(timeout=2)
            await cli.request(ChainUpdate(epoch=epoch, order=o))
            await cli.close()

    await order([0, 1], 1)  # relay-2 outside the chain misses v1
    pusher = _pusher(cfg, zctx)
    await pusher.start()
    await pusher.push(1, _state(0.3, 1))
    await wait_until(lambda: relays[1].store.current is not None, 10, "v1 on relay-1")
    await order([2, 0, 1], 2)  # the manager makes the empty relay master
    await wait_until(lambda: relays[2].store.current is not None, 10, "the new master to catch up")
    assert relays[2].store.current.checksum == relays[0].store.current.checksum
    assert relays[2].metrics.counters.get("caught_up") == 1
    await pusher.push(2, _state(0.3, 2))  # redirected to the new master, reaches everyone
    await wait_until(lambda: all(r.store.current.version == 2 for r in relays), 10, "v2 everywhere")
    assert pusher.endpoint == cfg.endpoint("relay", 2)
    await pusher.close()
