"""GPU weight paths, tested on CPU where their logic allows: the broadcast group on gloo (the
same code runs NCCL on GPUs), flat buffers and their on-device checksum; CUDA IPC itself is
`gpu`-marked.

    .venv/bin/python -m pytest tests/test_weights_gpu.py -q           # gloo and CPU parts
    .venv/bin/python -m pytest tests/test_weights_gpu.py -q -m gpu    # CUDA IPC / NCCL (GPUs)

Members that must die run as spawned processes, killed by pid with SIGKILL and joined here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time

import pytest
import structlog
import torch
import torch.multiprocessing as mp

from laminar.weights.cuda_ipc import resolve_device
from laminar.weights.gpu import FlatWeights, flat_checksum, pack_flat
from laminar.weights.group import GroupBroadcaster, GroupMember, GroupSettings
from laminar.weights.nccl import GroupPublisher
from tests.conftest import free_port

LOG = structlog.get_logger()
BOUND_S = 1.5


def wait_until(cond, timeout: float, what: str) -> None:
    """Poll `cond` (threads and processes: no event to await) until true, or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.01)  # poll interval of a deadline-bounded condition wait


def _state(device: str = "cpu", seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 17, generator=g).to(torch.bfloat16).to(device),
        "b": torch.randn(33, generator=g).to(device),
        "n": torch.arange(10, device=device),
    }


def _settings(members: tuple[str, ...], backend: str = "gloo") -> GroupSettings:
    return GroupSettings(
        host="127.0.0.1",
        port=free_port(),
        backend=backend,
        members=members,
        bound_s=BOUND_S,
        beat_s=0.1,
        connect_timeout_s=60.0,
    )


def test_flat_pack_views_and_checksum_on_cpu():
    state = _state()
    layout, flat = pack_flat(state, "cpu")
    w = FlatWeights(1, flat_checksum(flat), layout, flat)
    got = dict(w.named_tensors())
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in state.items())
    assert w.verify()
    flat[layout.offsets[1]] ^= 1  # one bit of one tensor
    assert not w.verify()


def test_device_is_resolved_by_uuid_among_what_the_process_sees():
    # CUDA_VISIBLE_DEVICES=2,3 in the reader: the trainer's GPU 3 is the reader's index 1
    assert resolve_device("GPU-c", ["GPU-b", "GPU-c"]) == 1
    with pytest.raises(LookupError, match="not visible"):
        resolve_device("GPU-a", ["GPU-b", "GPU-c"])
    with pytest.raises(LookupError):
        resolve_device("", [])


class _Got:
    def __init__(self) -> None:
        self.versions: dict[str, list[int]] = {}
        self.ok: dict[str, bool] = {}

    def sink(self, name: str, want: dict[int, dict[str, torch.Tensor]]):
        def on_weights(w: FlatWeights) -> None:
            got = dict(w.named_tensors())
            ok = all(torch.equal(got[k], v) for k, v in want[w.version].items())
            self.ok[name] = self.ok.get(name, True) and ok
            self.versions.setdefault(name, []).append(w.version)

        return on_weights


def _deliver(caster: GroupBroadcaster, version: int, state) -> concurrent.futures.Future:
    layout, flat = pack_flat(state, "cpu")
    return caster.submit(version, layout, flat)


def test_group_delivers_bit_identical_versions_over_gloo():
    s = _settings(("r0", "r1"))
    caster = GroupBroadcaster(s, LOG)
    caster.start()
    want = {v: _state(seed=v) for v in (1, 2, 3)}
    got = _Got()
    members = [GroupMember(s, m, "cpu", got.sink(m, want), LOG) for m in s.members]
    try:
        for m in members:
            m.start()
        wait_until(lambda: caster.members == ("r0", "r1"), 30, "both members in the group")
        for v in (1, 2, 3):
            d = _deliver(caster, v, want[v]).result(30)
            assert d.members == ("r0", "r1") and not d.error, d
        wait_until(lambda: all(len(got.versions.get(m, [])) == 3 for m in s.members), 10, "3 each")
        assert got.versions == {"r0": [1, 2, 3], "r1": [1, 2, 3]} and all(got.ok.values())
    finally:
        for m in members:
            m.close()
        caster.close()


def _member_proc(s: GroupSettings, node_id: str, q) -> None:
    member = GroupMember(
        s, node_id, "cpu", lambda w: q.put((node_id, w.version)), structlog.get_logger()
    )
    member.start()
    time.sleep(600)  # killed by the test (SIGKILL) long before


@pytest.mark.slow  # two spawned members importing torch: ~20 s on 2 busy cores
def test_a_member_killed_mid_broadcast_is_dropped_within_the_bound_and_rejoins():
    s = _settings(("r0", "r1"))
    caster = GroupBroadcaster(s, LOG)
    caster.start()
    big = {"w": torch.randn(8 << 20)}  # 32 MiB: a broadcast long enough to be killed in
    got = _Got()
    local = GroupMember(s, "r0", "cpu", got.sink("r0", {v: big for v in range(1, 9)}), LOG)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_member_proc, args=(s, "r1", q), daemon=True)]
    try:
        local.start()
        procs[0].start()
        wait_until(lambda: caster.members == ("r0", "r1"), 60, "both members in the group")
        assert _deliver(caster, 1, big).result(30).members == ("r0", "r1")
        assert q.get(timeout=10) == ("r1", 1)

        # kill -9 r1 as soon as version 2 is announced (the broadcast is under way); the
        # trainer's publish returns within bound_s whatever the group's thread is doing
        pub = GroupPublisher(None, caster, "cpu")
        key = f"gen{caster.gen}/ann/{caster.seq}"

        async def publish_and_kill() -> float:
            task = asyncio.create_task(pub.publish(2, 2, big))
            while not caster.store.check([key]):
                await asyncio.sleep(0.005)  # poll of a store key, bounded by the wait_for below
            os.kill(procs[0].pid, signal.SIGKILL)
            return (await asyncio.wait_for(task, 4 * BOUND_S)).stall_s

        stall = asyncio.run(publish_and_kill())
        procs[0].join(10)
        assert stall <= BOUND_S + 0.5
        # the thread rebuilt the group without r1 and resent version 2 to the survivor
        wait_until(lambda: caster.members == ("r0",), 4 * BOUND_S + 10, "a group without r1")
        wait_until(lambda: 2 in got.versions.get("r0", []), 4 * BOUND_S + 10, "r0 gets v2")
        assert "r1" in caster.dropped

        # the restarted r1 beats again, is taken back into the next generation, and receives
        procs.append(ctx.Process(target=_member_proc, args=(s, "r1", q), daemon=True))
        procs[1].start()
        wait_until(lambda: caster.members == ("r0", "r1"), 60, "r1 back in the group")
        assert _deliver(caster, 3, big).result(30).members == ("r0", "r1")
        assert q.get(timeout=10) == ("r1", 3)
        assert got.ok["r0"]
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
        local.close()
        caster.close()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 1, reason="NCCL needs a GPU"
)
def test_group_with_nccl_on_one_gpu():
    """Trainer and one member share GPU 0 (two communicators on one device are allowed)."""
    s = _settings(("r0",), backend="nccl")
    caster = GroupBroadcaster(s, LOG)
    caster.start()
    want = {1: _state("cuda:0", seed=1)}
    got = _Got()
    member = GroupMember(s, "r0", "cuda:0", got.sink("r0", want), LOG)
    try:
        member.start()
        wait_until(lambda: caster.members == ("r0",), 60, "member in the group")
        layout, flat = pack_flat(want[1], "cuda:0")
        assert caster.submit(1, layout, flat).result(60).members == ("r0",)
        wait_until(lambda: got.versions.get("r0") == [1], 10, "version 1 received")
        assert got.ok["r0"]
    finally:
        member.close()
        caster.close()


def _ipc_reader(frames: list[bytes], host: str, port: int, hold_s: float, q) -> None:
    import datetime

    import torch.distributed as dist

    from laminar.transport.codec import decode
    from laminar.weights.cuda_ipc import open_cuda_ipc
    from laminar.weights.leases import LeaseBoard, StoreKV

    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
    w = open_cuda_ipc(decode(frames), LeaseBoard(StoreKV(store)), reader=f"r{os.getpid()}")
    assert w is not None
    got = dict(w.named_tensors())
    ok = all(torch.equal(got[k].cpu(), v) for k, v in _state().items())
    q.put((w.version, ok))
    time.sleep(hold_s)
    w.release_now()
    q.put("released")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_handle_opens_in_another_process_and_leases_hold_the_buffer():
    import datetime

    import torch.distributed as dist

    from laminar.transport.codec import encode
    from laminar.weights.cuda_ipc import CudaIpcExporter
    from laminar.weights.leases import LeaseBoard, StoreKV

    port = free_port()
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timeout
    )
    exp = CudaIpcExporter(LeaseBoard(StoreKV(store)), device="cuda:0", keep=1)
    msg = exp.export(5, _state("cuda:0"))
    frames = [bytes(f) for f in encode(msg)]  # what travels through the store
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_ipc_reader, args=(frames, "127.0.0.1", port, 2.0, q))
    p.start()
    try:
        assert q.get(timeout=120) == (5, True)
        exp.export(6, _state("cuda:0"))  # 5 is withdrawn but the reader still holds it
        assert 5 in exp.buffers.held()
        assert q.get(timeout=30) == "released"
        wait_until(lambda: bool(exp.collect()) or 5 not in exp.buffers.held(), 10, "5 freed")
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    exp.close()


class _Relay:
    """A relay subscriber stand-in: version 4, loads count."""

    name = "relay"
    last_source = ""

    def __init__(self) -> None:
        self.loads = 0

    async def start(self) -> None:
        pass

    def latest_version(self) -> int:
        return 4

    async def load_into(self, engine) -> int:
        self.loads += 1
        return 4

    async def close(self) -> None:
        pass


async def test_cuda_ipc_rollout_off_the_trainers_host_reads_its_relay():
    """Path choice per process: the trainer's boot id is another host's (or no CUDA here), so
    the rollout never maps a handle and loads from its relay, without any host list."""
    import datetime

    import torch.distributed as dist

    from laminar.weights.cuda_ipc import CudaIpcSubscriber

    s = _settings(("rollout-0",))
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore(s.host, s.port, is_master=True, wait_for_workers=False, timeout=timeout)
    store.set("ipc/boot", "another-host-boot-id")
    store.set("ipc/version", "7")  # what a local reader would see
    relay = _Relay()
    sub = CudaIpcSubscriber(relay, s, "rollout-0", LOG)  # type: ignore[arg-type]
    await sub.start()
    assert not sub.local
    assert sub.latest_version() == 4  # the relay's, not the handle's
    assert await sub.load_into(object()) == 4  # type: ignore[arg-type]
    assert relay.loads == 1 and sub.loads == {"cuda_ipc": 0, "relay": 1}
    await sub.close()
