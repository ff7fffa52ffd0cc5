"""The tool sandbox, registry, built-in tools and the exactly-once cache (no transport).

    .venv/bin/python -m pytest tests/test_tools_sandbox.py -q

Each hostile call (infinite loop, CPU burn, os._exit, segfault, memory bombs, network sockets,
output floods) must come back as an error observation of the right kind while the same worker
keeps serving the next call. Workers are real processes (`python -c`), so each pool costs
about half a second to start; limits are short (wall 1 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from laminar.config import ToolsConfig
from laminar.tools.builtin import CalculatorError, calculator
from laminar.tools.cache import ToolCache
from laminar.tools.client import LocalToolClient
from laminar.tools.registry import Registry, ToolLoadError, load_tool, tool
from laminar.tools.sandbox import SandboxPool

APPEND = "test_tools_sandbox:append_line"


@tool(side_effects=True, description="append a line to a file (a side effect to count)")
def append_line(path: str, text: str) -> str:
    with open(path, "a") as f:
        f.write(text + "\n")
    with open(path) as f:
        return str(sum(1 for _ in f))


@tool(side_effects=False)
def sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


MakePool = Callable[..., Awaitable[SandboxPool]]


@pytest.fixture
async def make_pool() -> AsyncIterator[MakePool]:
    pools: list[SandboxPool] = []

    async def make(tools: list[str] | None = None, **kw: object) -> SandboxPool:
        base: dict[str, object] = {
            "workers": 1,
            "wall_s": 1.0,
            "cpu_s": 5.0,
            "memory_mb": 64,
            "max_output_bytes": 1024,
            "network": "auto",
        }
        base.update(kw)
        pool = SandboxPool(
            ToolsConfig(**base), Registry.from_entries(tools or ["python", "calculator"])
        )  # type: ignore[arg-type]
        pools.append(pool)
        await asyncio.wait_for(pool.start(), 60)
        return pool

    yield make
    for p in pools:
        await p.close()


async def py(pool: SandboxPool, code: str, cid: str = "c") -> object:
    return await asyncio.wait_for(pool.run(cid, "python", {"code": code}), 30)


async def test_hostile_calls_get_error_observations_and_the_worker_keeps_serving(make_pool):
    listener = socket.socket()  # something to reach on the host's loopback: the sandbox must not
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    pool = await make_pool(workers=1)
    (worker,) = pool.worker_pids()
    cases = [
        ("while True: pass", "timeout"),
        ("import os; os._exit(3)", "crash"),
        ("import ctypes; ctypes.string_at(0)", "crash"),
        ("b'x' * (10**10)", "memory"),
        ("l = []\nwhile True: l.append(bytearray(10**6))", "memory"),
        (
            "import socket; s = socket.socket(); s.settimeout(0.5); s.connect(('127.0.0.1', "
            f"{port}))",
            "network",
        ),
        ("import socket; socket.create_connection(('1.1.1.1', 80), timeout=0.5)", "network"),
        ("print('x' * 5000)", "output_limit"),
        ("while True: print('flood')", "output_limit"),
    ]
    try:
        for i, (code, kind) in enumerate(cases):
            t0 = time.monotonic()
            res = await py(pool, code, f"bad{i}")
            assert not res.ok and res.error_kind == kind, (code, res)
            assert res.error, code
            assert time.monotonic() - t0 < 1.0 + 1.5, (code, "the wall limit was not enforced")
            if kind == "output_limit":
                assert res.truncated and 0 < len(res.output.encode()) <= 1024
            ok = await py(pool, "6 * 7", f"good{i}")
            assert ok.ok and ok.output == "42", (code, ok)
    finally:
        listener.close()
    st = pool.stats()
    assert st["restarts"] == 0 and pool.worker_pids() == [worker]  # only the per-call child died
    assert st["errors_by_kind"]["memory"] == 2 and st["errors_by_kind"]["crash"] == 2
    assert st["calls"] == 2 * len(cases) and st["latency_p99_s"] >= 1.0 > st["latency_p50_s"]


async def test_cpu_limit_and_the_socket_guard_fallback(make_pool):
    pool = await make_pool(network="none", cpu_s=1.0, wall_s=5.0)
    assert pool.network == "none"
    t0 = time.monotonic()
    res = await py(pool, "while True: pass")
    assert res.error_kind == "timeout" and "CPU" in res.error and time.monotonic() - t0 < 4.0
    res = await py(pool, "import socket; socket.socket().connect(('127.0.0.1', 9))")
    assert res.error_kind == "network" and "NetworkDisabled" in res.error
    res = await py(pool, "import socket; socket.create_connection(('1.1.1.1', 80))")
    assert res.error_kind == "network"
    res = await py(pool, "import socket; a, b = socket.socketpair(); a.send(b'k'); b.recv(1)")
    assert res.ok and res.output == "b'k'"  # local AF_UNIX pairs still work


async def test_python_repl_and_calculator_in_the_sandbox(make_pool):
    pool = await make_pool()
    assert (await py(pool, "x = 3\nprint('a')\nx * 2")).output == "a\n6"
    assert (await py(pool, "print('only')")).output == "only\n"
    assert (await py(pool, "None")).output == ""
    assert (await py(pool, "def f(n):\n    return n + 1\nf(41)")).output == "42"
    err = await py(pool, "print('before')\n1 / 0")
    assert not err.ok and err.error_kind == "error"
    assert err.error == "ZeroDivisionError: division by zero" and err.output == "before\n"
    syn = await py(pool, "def (")
    assert syn.error_kind == "error" and syn.error.startswith("SyntaxError")
    calc = await pool.run(
        "k", "calculator", {"expression": "123456789123456789 * 987654321987654321"}
    )
    assert calc.ok and calc.output == str(123456789123456789 * 987654321987654321)
    bad = await pool.run("k", "calculator", {"expression": "__import__('os').system('true')"})
    assert bad.error_kind == "error" and bad.error.startswith("CalculatorError")


def test_calculator_is_safe_arithmetic():
    assert calculator("2 ** 100") == str(2**100)
    assert calculator("(1 + 2) * 3 - -4") == "13"
    assert calculator("7 // 2 + 7 % 3") == "4"
    assert calculator("1 / 4") == "0.25"
    assert calculator(" 10**30 + 1 ") == str(10**30 + 1)
    for expr in [
        "9**9**9",
        "2**100000",
        "x + 1",
        "abs(-1)",
        "[1]",
        "'a' * 3",
        "1 if 1 else 2",
        "(10**4000) * (10**4000)",
        "1 +",
        "True + 1",
        "1j * 1j",
        "1" * 3000,
    ]:
        with pytest.raises(CalculatorError):
            calculator(expr)
    with pytest.raises(ZeroDivisionError):
        calculator("1 // 0")


def test_registry_schema_and_load_errors():
    calc = load_tool("calculator")
    assert not calc.side_effects and calc.schema["required"] == ["expression"]
    assert calc.check({"expression": "1"}) is None
    assert "missing" in (calc.check({}) or "")
    assert "unexpected" in (calc.check({"expression": "1", "x": 2}) or "")
    assert "must be str" in (calc.check({"expression": 5}) or "")
    assert "JSON object" in (calc.check(["1"]) or "")
    user = load_tool(APPEND)
    assert user.name == "append_line" and user.side_effects
    assert not load_tool("test_tools_sandbox:sleepy").side_effects
    assert load_tool("test_tools_sandbox:sleepy").check({"seconds": 1}) is None  # int is a float
    assert "must be float" in (
        load_tool("test_tools_sandbox:sleepy").check({"seconds": True}) or ""
    )
    with pytest.raises(ToolLoadError, match="no_such_module_xyz:fn"):
        load_tool("no_such_module_xyz:fn")
    with pytest.raises(ToolLoadError, match="has no 'missing'"):
        load_tool("test_tools_sandbox:missing")
    with pytest.raises(ToolLoadError, match="not a built-in"):
        load_tool("shell")
    with pytest.raises(ToolLoadError, match="two tools"):
        Registry.from_entries(["python", "python"])


async def test_bad_call_and_unknown_tool_never_reach_a_worker(make_pool):
    pool = await make_pool()
    res = await pool.run("a", "python", {"source": "1"})
    assert res.error_kind == "bad_call" and "missing argument" in res.error
    res = await pool.run("a", "python", {"code": 5})
    assert res.error_kind == "bad_call" and "must be str" in res.error
    res = await pool.run("a", "shell", {"cmd": "ls"})
    assert res.error_kind == "unknown_tool" and "python, calculator" in res.error
    assert (await py(pool, "1 + 1")).output == "2"


async def test_concurrency_is_bounded_and_overflow_is_busy(make_pool):
    pool = await make_pool(["test_tools_sandbox:sleepy"], workers=2, max_queue=1, wall_s=5.0)
    t0 = time.monotonic()
    results = await asyncio.wait_for(
        asyncio.gather(*(pool.run(f"s{i}", "sleepy", {"seconds": 0.4}) for i in range(4))), 30
    )
    kinds = sorted(r.error_kind for r in results)
    assert kinds == ["", "", "", "busy"], results
    assert pool.stats()["peak_running"] == 2
    assert time.monotonic() - t0 >= 0.8  # the third waited for a free worker


async def test_a_dead_worker_is_restarted(make_pool):
    pool = await make_pool(workers=1)
    (pid,) = pool.worker_pids()
    os.kill(pid, signal.SIGKILL)  # a process this test's pool started
    res = await py(pool, "1")
    assert not res.ok and res.error_kind == "crash" and "worker lost" in res.error
    again = await py(pool, "2 + 2")  # waits for the replacement worker
    assert again.ok and again.output == "4"
    assert pool.stats()["restarts"] == 1 and pool.worker_pids() != [pid]


async def test_each_call_id_runs_once_also_after_a_restart(make_pool, tmp_path: Path):
    pool = await make_pool(["python", APPEND], workers=2)
    target = tmp_path / "effects.txt"
    journal = tmp_path / "tools" / "tools-0.journal"
    cache = ToolCache(journal)
    cache.load()
    client = LocalToolClient(pool, cache)
    args = {"path": str(target), "text": "hello"}
    first, second = await asyncio.gather(
        client.call("ep#t0#c0", "append_line", args), client.call("ep#t0#c0", "append_line", args)
    )
    assert first.ok and second.ok and first.output == second.output == "1"
    assert [first.cached, second.cached].count(True) == 1
    later = await client.call("ep#t0#c0", "append_line", args)
    assert later.cached and later.output == "1"
    assert target.read_text() == "hello\n"
    # a crash result is stored too: the call ran
    boom = await client.call("ep#t0#c1", "python", {"code": "import os; os._exit(9)"})
    assert (
        boom.error_kind == "crash"
        and (await client.call("ep#t0#c1", "python", {"code": "1"})).cached
    )
    # refusals ran nothing and are not stored
    assert (await client.call("ep#t0#c2", "append_line", {})).error_kind == "bad_call"
    cache.close()

    # a restarted tools node: the journal answers, nothing runs again
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [r["t"] for r in records if r["id"] == "ep#t0#c0"] == ["start", "done"]
    with journal.open("a") as f:  # a side-effecting call that was running when the node died
        f.write(json.dumps({"t": "start", "id": "ep#t1#c0", "name": "append_line"}) + "\n")
        f.write('{"t": "done", "id": "torn')  # a torn last line
    again = ToolCache(journal, max_entries=1)  # older results are read back from the journal
    assert again.load() == 3
    client2 = LocalToolClient(pool, again)
    res = await client2.call("ep#t0#c0", "append_line", args)
    assert res.cached and res.output == "1"
    lost = await client2.call("ep#t1#c0", "append_line", args)
    assert lost.error_kind == "interrupted" and lost.cached
    assert target.read_text() == "hello\n"
    fresh = await client2.call("ep#t2#c0", "append_line", args)
    assert fresh.ok and not fresh.cached and fresh.output == "2"
    assert again.stats()["cache_interrupted"] == 1 and again.stats()["cache_journal_bad_lines"] == 1
    again.close()
