"""Shared fixtures for the transport / node / CLI tests.

    .venv/bin/python -m pytest tests -q

Every socket test gets its own zmq context (destroyed with linger=0), its own short
ipc directory (unix socket paths are limited to ~107 bytes, and pytest's tmp_path
can be longer), random free tcp ports, and `fast_opts()` (a fixture): heartbeats every 100 ms so
liveness tests finish in well under a second. `wait_until` is the only way tests
wait for state that has no event of its own: it polls a condition against a
deadline and fails with a message naming what never happened.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# 2 slow cores: no per-example deadline, no example database written into the repo.
settings.register_profile(
    "laminar", deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
# HYPOTHESIS_PROFILE=fuzz: a long fuzzing session (minutes), for after codec changes.
settings.register_profile("fuzz", parent=settings.get_profile("laminar"), max_examples=20_000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "laminar"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A `hosts` test (tests/hosts.py) needs network namespaces: probed when it runs, not at
    collection, so the default suite never touches the network."""
    if item.get_closest_marker("hosts") is not None:
        from tests.hosts import Hosts

        why = Hosts.unavailable()
        if why:
            pytest.skip(f"no emulated hosts: {why}")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short private directory under /tmp (ipc socket paths must stay short)."""
    path = Path(tempfile.mkdtemp(prefix="lam-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def ipc(short_dir: Path) -> Callable[[str], str]:
    """ipc endpoint factory: ipc("server") -> "ipc:///tmp/lam-xxxx/server.sock"."""
    return lambda name: f"ipc://{short_dir}/{name}.sock"


def free_port() -> int:
    """A tcp port that was free a moment ago on 127.0.0.1 (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tcp() -> Callable[[], str]:
    return lambda: f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture
async def zctx():
    """A fresh zmq.asyncio context per test; anything left open is closed with it."""
    from laminar.transport.security import stop_authenticators
    from laminar.transport.sockets import new_context

    ctx = new_context()
    yield ctx
    stop_authenticators()
    ctx.destroy(linger=0)


def _fast_opts(**kw):
    """Socket options for tests: 100 ms heartbeats, 4 beats to death, short deadlines."""
    from laminar.transport.sockets import SocketOptions

    base = dict(
        heartbeat_interval_s=0.1,
        heartbeat_liveness=4,
        handshake_timeout_s=1.0,
        request_timeout_s=1.0,
        request_retries=0,
        reconnect_backoff_s=0.02,
        reconnect_backoff_max_s=0.1,
    )
    base.update(kw)
    return SocketOptions(**base)


async def _wait_until(
    cond: Callable[[], bool], timeout: float, what: str, every: float = 0.005
) -> float:
    """Poll `cond` until true; return the time it took, or fail naming `what` after `timeout`."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(every)  # poll interval of a deadline-bounded condition wait
    return time.monotonic() - t0


@pytest.fixture
def fast_opts() -> Callable[..., object]:
    """fast_opts(**overrides) -> SocketOptions with 100 ms heartbeats."""
    return _fast_opts


@pytest.fixture
def wait_until():
    """await wait_until(cond, timeout, what) -> seconds it took (fails after timeout)."""
    return _wait_until


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random policy on the tool task's alphabet (the agent tests' model)."""
    from laminar.models.tiny import build_tiny_model
    from laminar.tasks import tooluse

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model",
        alphabet=tooluse.ALPHABET,
        hidden=32,
        layers=1,
        heads=2,
        kv_heads=1,
        max_positions=256,
    )
