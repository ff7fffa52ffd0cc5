"""Engine start-up off the rollout's event loop, its deadline, and engines that die with their
rollout.

    .venv/bin/python -m pytest tests/test_engine_start.py -q

A slow fake engine blocks a worker thread in start() (as vLLM's AsyncLLM construction does)
while the rollout keeps beating and reports starting_engine; past rollout.engine_start_timeout_s
the node fails loudly. A fake engine with a child process (tests/engine_child.py) checks that the
engine process is gone after every way a rollout can end: a normal stop, SIGTERM, and kill -9
(laminar/engines/lifeline.py: the child watches the rollout's pid).
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from rollout_fakes import harness, make_cfg, make_items, uids_of, wait_for

from laminar.engines.lifeline import alive, lifeline_env
from laminar.node import NodeFailed
from laminar.rollout.node import STARTING_ENGINE, EngineStartTimeout
from laminar.supervise import Spawn, detached_spawn
from laminar.wiring.nodes import build_node

HERE = Path(__file__).parent
CHILD = HERE / "engine_child.py"


class SlowStartEngine(FakeEngine):
    """start() blocks a worker thread until the test opens the gate (vLLM: spawn + load +
    warm-up)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.closed = False

    async def start(self, spawn: Spawn = detached_spawn) -> None:
        ok = await asyncio.to_thread(self.gate.wait, 30.0)
        assert ok, "the test never opened the start gate"
        await super().start(spawn)

    async def close(self) -> None:
        self.closed = True
        self.gate.set()  # a start still blocked in its thread returns
        await super().close()


class NeverStartsEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    async def start(self, spawn: Spawn = detached_spawn) -> None:
        await asyncio.Event().wait()

    async def close(self) -> None:
        self.closed = True


def _wait_gone(pids: Iterable[int], timeout: float) -> None:
    pids = list(pids)
    end = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        _reap(pids)
        if time.monotonic() > end:
            raise AssertionError(f"engine processes still alive: {[p for p in pids if alive(p)]}")
        time.sleep(0.02)  # poll of another process's liveness, under a deadline


def _reap(pids: list[int]) -> None:
    """Our own children become zombies until waited for: collect them (others are reaped
    elsewhere)."""
    for p in pids:
        try:
            os.waitpid(p, os.WNOHANG)
        except ChildProcessError:
            pass


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The process's "PIDS ..." line (log lines before it are skipped)."""
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, end - time.monotonic()))
        assert ready, f"no PIDS line from pid {proc.pid} within {timeout}s"
        line = proc.stdout.readline().decode()
        assert line, f"pid {proc.pid} exited before reporting its engine"
        if line.startswith("PIDS "):
            return line.removeprefix("PIDS ").strip()


class ChildProcessEngine(FakeEngine):
    """A fake engine whose start() launches a real engine process (like vLLM's EngineCore)."""

    def __init__(self) -> None:
        super().__init__()
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []

    async def start(self, spawn: Spawn = detached_spawn) -> None:
        env = {**os.environ, **lifeline_env()}
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), "engine"], env=env, stdout=subprocess.PIPE
        )
        line = await asyncio.to_thread(_read_line, self.proc, 20.0)
        self.pids = [int(p) for p in line.split()]
        await super().start(spawn)

    async def close(self) -> None:
        await super().close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            await asyncio.to_thread(self.proc.wait, 10.0)


# ---- start-up off the loop, status, deadline ---------------------------------------------


async def test_heartbeats_flow_and_status_says_starting_engine_while_the_engine_starts(tmp_path):
    items = make_items(4, n=2)
    cfg = make_cfg(tmp_path)
    async with harness(cfg, items) as h:
        engine = SlowStartEngine()
        node = build_node(cfg, "rollout", 0, ctx=h.ctx, engine=engine)
        task = asyncio.create_task(node.run())
        h.tasks.append(task)
        h.nodes.append(node)
        h.rollouts.append(node)
        try:
            peers = h.manager.srv.peers
            await wait_for(
                lambda: "rollout-0" in peers and peers["rollout-0"].status is not None,
                10,
                "the rollout registered while its engine starts",
            )
            st = peers["rollout-0"].status
            assert st.state == STARTING_ENGINE and st.version == -1
            assert any(w.startswith("starting_engine") for w in st.warnings)  # laminar status
            assert st.extra["engine_deadline_s"] == cfg.rollout.engine_start_timeout_s
            # beats keep arriving at the manager and the buffer while start() blocks its thread
            beats: set[float] = set()
            buffer_peer = h.buffer.srv.peers  # type: ignore[union-attr]

            def beating() -> bool:
                beats.add(peers["rollout-0"].last_seen)
                return len(beats) >= 6

            await wait_for(beating, 10, "heartbeats during engine start")
            assert not engine.gate.is_set() and not node.ready.is_set()
            assert peers["rollout-0"].alive and all(p.alive for p in buffer_peer.values())
            assert peers["rollout-0"].status.extra["engine_start_s"] >= 0
            engine.gate.set()
            await asyncio.wait_for(node.ready.wait(), 10)
            await h.wait_stored(uids_of(items), 20)
            await wait_for(
                lambda: peers["rollout-0"].status.state != STARTING_ENGINE,
                5,
                "a serving status",
            )
            assert peers["rollout-0"].status.rollout is not None
        finally:
            engine.gate.set()


async def test_engine_start_deadline_fails_the_node_loudly(tmp_path):
    cfg = make_cfg(tmp_path, rollout__engine_start_timeout_s=0.5)
    async with harness(cfg, make_items(2, n=1)) as h:
        engine = NeverStartsEngine()
        node = build_node(cfg, "rollout", 0, ctx=h.ctx, engine=engine)
        with pytest.raises(NodeFailed) as err:
            await asyncio.wait_for(node.run(), 15)
        cause = err.value.__cause__
        assert isinstance(cause, EngineStartTimeout)
        assert "did not start within 0.5 s" in str(cause) and "engine_start_timeout_s" in str(cause)
        assert engine.closed, "an engine whose start was cut short is closed too"


async def test_stop_while_the_engine_starts_closes_it(tmp_path):
    cfg = make_cfg(tmp_path)
    async with harness(cfg, make_items(2, n=1)) as h:
        engine = SlowStartEngine()
        node = build_node(cfg, "rollout", 0, ctx=h.ctx, engine=engine)
        task = asyncio.create_task(node.run())
        peers = h.manager.srv.peers
        await wait_for(lambda: "rollout-0" in peers, 10, "registration")
        node.request_stop("test")
        await asyncio.wait_for(task, 15)  # a clean stop, not a failure
        assert engine.closed and node.failure is None


# ---- engines die with their rollout ---------------------------------------------------------


async def test_normal_stop_stops_the_engine_process(tmp_path):
    items = make_items(4, n=2)
    cfg = make_cfg(tmp_path)
    async with harness(cfg, items) as h:
        engine = ChildProcessEngine()
        node = await h.add_rollout(engine)
        await h.wait_stored(uids_of(items), 20)
        assert engine.pids and all(alive(p) for p in engine.pids)
        node.request_stop("test over")
        await asyncio.wait_for(h.tasks[-1], 15)
        await asyncio.to_thread(_wait_gone, engine.pids, 10)


def _rollout_process(tmp_path: Path, how: str) -> tuple[subprocess.Popen, list[int]]:
    """A rollout-like process (a Node whose engine has a child and a grandchild, like vLLM's
    EngineCore and its worker); returns it with the engine pids it reports."""
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), "rollout", how],
        stdout=subprocess.PIPE,
        cwd=tmp_path,
        start_new_session=True,
    )
    line = _read_line(proc, 30.0)
    pids = [int(p) for p in line.split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    return proc, pids


@pytest.mark.parametrize("how", ["node", "bare"])
def test_sigterm_to_the_rollout_stops_its_engine(tmp_path, how):
    proc, pids = _rollout_process(tmp_path, how)
    try:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=15)
        # a Node closes its engine on SIGTERM (exit 0); a bare process dies of it and the lifeline
        # acts
        assert rc == (0 if how == "node" else -signal.SIGTERM)
        _wait_gone(pids, 10)
    finally:
        _cleanup(proc, pids)


def test_kill_9_of_the_rollout_leaves_no_engine_process(tmp_path):
    proc, pids = _rollout_process(tmp_path, "node")
    try:
        proc.kill()  # SIGKILL: no code runs in the rollout; the engine must notice by itself
        assert proc.wait(timeout=10) == -signal.SIGKILL
        _wait_gone(pids, 10)
    finally:
        _cleanup(proc, pids)


def _cleanup(proc: subprocess.Popen, pids: list[int]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
    for p in pids:  # only the pids this test's processes reported
        if alive(p):
            os.kill(p, signal.SIGKILL)
