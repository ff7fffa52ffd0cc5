"""Reader leases (laminar/weights/leases.py): what CUDA IPC frees and when, tested on CPU.

    .venv/bin/python -m pytest tests/test_weights_leases.py -q

The buffers here are plain objects: the lease logic is what decides when a GPU buffer goes.
The process test runs two real readers against the trainer's kind of store (a c10d TCPStore):
one is killed with SIGKILL while holding its lease, the other holds and then releases.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from laminar.weights.leases import DictKV, LeaseBoard, StoreKV, VersionBuffers
from tests.conftest import free_port


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_withdrawn_version_is_freed_only_when_no_live_lease_is_left():
    clock = Clock()
    board = LeaseBoard(DictKV(), clock)
    bufs = VersionBuffers(board, keep=1)
    bufs.add(1, "v1")
    assert board.acquire(1, "a", ttl_s=10) and board.acquire(1, "b", ttl_s=10)
    assert bufs.add(2, "v2") == [] and bufs.held() == [1, 2]  # withdrawn, still read
    board.release(1, "a")
    assert bufs.collect() == [] and bufs.held() == [1, 2]  # b still holds it
    board.release(1, "b")
    assert bufs.collect() == [1] and bufs.held() == [2]


def test_a_reader_that_never_releases_holds_nothing_past_its_lease():
    clock = Clock()
    board = LeaseBoard(DictKV(), clock)
    bufs = VersionBuffers(board, keep=1)
    bufs.add(1, "v1")
    assert board.acquire(1, "dead", ttl_s=5)
    bufs.add(2, "v2")
    clock.t += 4.9
    assert bufs.collect() == []
    clock.t += 0.2
    assert bufs.collect() == [1]


def test_a_withdrawn_version_cannot_be_leased():
    board = LeaseBoard(DictKV(), Clock())
    bufs = VersionBuffers(board, keep=1)
    bufs.add(1, "v1")
    bufs.add(2, "v2")  # 1 withdrawn and, unread, freed
    assert bufs.held() == [2]
    assert not board.acquire(1, "late", ttl_s=10)
    assert board.live_readers(1) == []


def _reader(port: int, name: str, version: int, ttl_s: float, q, release) -> None:
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    board = LeaseBoard(StoreKV(store))
    q.put((name, board.acquire(version, name, ttl_s)))
    if release.wait(300):  # the parent sets it within its own deadlines (a bound, not a sleep)
        board.release(version, name)
        q.put((name, "released"))


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)  # poll interval of a deadline-bounded condition wait


def test_two_reader_processes_one_killed_holding_its_lease():
    port = free_port()
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timeout
    )
    bufs = VersionBuffers(LeaseBoard(StoreKV(store)), keep=1)
    bufs.add(1, "v1")
    ctx = mp.get_context("spawn")
    # a queue each: a process killed while it holds a shared queue's lock would wedge the other's
    q_dead, q = ctx.Queue(), ctx.Queue()
    release, never = ctx.Event(), ctx.Event()
    ttl_dead, ttl_live = 3.0, 120.0
    dead = ctx.Process(target=_reader, args=(port, "dead", 1, ttl_dead, q_dead, never))
    live = ctx.Process(target=_reader, args=(port, "live", 1, ttl_live, q, release))
    try:
        dead.start()
        live.start()
        assert q_dead.get(timeout=60) == ("dead", True)
        assert q.get(timeout=60) == ("live", True)
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(10)
        leased_at = time.time()
        bufs.add(2, "v2")  # version 1 withdrawn: both leases keep it
        # past the dead reader's lease, the live one still holds it: never freed under a reader
        wait_until(lambda: time.time() > leased_at + ttl_dead + 0.5, 10, "dead lease expired")
        assert bufs.collect() == [] and 1 in bufs.held()
        release.set()
        assert q.get(timeout=30) == ("live", "released")
        # the live reader released and the dead one's lease is past: freed now
        assert bufs.collect() == [1] and bufs.held() == [2]
    finally:
        for p in (dead, live):
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)


def test_a_dead_readers_lease_alone_expires_and_frees_the_version():
    port = free_port()
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timeout
    )
    board = LeaseBoard(StoreKV(store))
    bufs = VersionBuffers(board, keep=1)
    bufs.add(1, "v1")
    # a reader that leased then died (its lease written as a killed process leaves it)
    assert board.acquire(1, "gone", ttl_s=1.0)
    bufs.add(2, "v2")
    assert 1 in bufs.held()
    wait_until(lambda: bool(bufs.collect()), 10, "version 1 freed after the lease")
    assert bufs.held() == [2]
