"""The tool sandbox: a pool of worker processes, one forked child per call, each call limited.

    pool = SandboxPool(cfg.tools, registry, spawn)
    await pool.start()                                   # tools.workers workers, each says HELLO
    res = await pool.run(call_id, "python", {"code": "1+1"}, timeout_s=5.0)  # ToolResult, no raise
    pool.stats()                       # calls, errors by kind, latency p50/p99, restarts
    await pool.close()

    SandboxPool ──frame(call)──► worker (own session, own netns) ──fork──► child: setpgid, rlimits,
        ▲                          │  waits on the child's result pipe        stdout captured,
        └──frame(outcome)──────────┘  until the wall limit, then SIGKILLs     runs the tool, writes
                                      the child's process group               its outcome, _exit

The workers, their framing, kill and restart are laminar/subprocess_pool.py's (shared with the
reward runner): `subprocess` executables talking length-prefixed msgpack on stdin/stdout, each
in its own session. Why a fork per call: the worker is single-threaded and clean, so fork is
safe and cheap (a few ms), and whatever a call does (loop forever, allocate without end,
`os._exit`, segfault, leave files open) dies with its child while the worker survives and
reports it.

Limits per call (tools.*): wall_s (the worker SIGKILLs the child's process group; the pool
gives the worker a grace period more, then kills and restarts the worker), cpu_s
(RLIMIT_CPU, whole seconds rounded up: SIGXCPU, then SIGKILL one second later), memory_mb
(RLIMIT_AS set to the child's current address space plus memory_mb, so it is the tool's own
allowance, not the interpreter's), max_output_bytes (stdout and the returned value together;
beyond it the text is cut and the call fails with output_limit), no core dumps.

Outcome classification (ToolResult.error_kind): killed by the wall timer or by the CPU
limit -> timeout; MemoryError (RLIMIT_AS) -> memory; a socket refused or unreachable ->
network; nonzero exit or a signal -> crash; output beyond the limit -> output_limit; the
tool raised -> error (the traceback's last line is the error text); refused before running:
unknown_tool, bad_call, busy (more than tools.max_queue calls already wait for a worker).

Network (tools.network): `netns` and `auto` make each worker unshare(CLONE_NEWNET) (via
ctypes; also tried with CLONE_NEWUSER for an unprivileged user) before it runs anything: a
fresh namespace whose only interface is a loopback that is down, so nothing is reachable,
not even 127.0.0.1 on the host. Where the OS refuses (no privilege, user namespaces off),
`auto` falls back to `none`, and `netns` fails at start with the reason. `none` replaces
socket creation in the worker (socket.socket for every family but AF_UNIX, _socket.socket,
socket.create_connection) with a function raising PermissionError. THAT FALLBACK IS NOT AN
OS BOUNDARY: code that execs a program (curl) or uses ctypes gets past it. Run the tools node
where namespaces are allowed (root, or unprivileged user namespaces) for a real boundary.

Workers die with their pool (PR_SET_PDEATHSIG), and a call's child dies with its worker.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import json
import math
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, NoReturn

import msgspec

from laminar.config import ToolsConfig
from laminar.envs.base import ToolResult
from laminar.logs import get_logger
from laminar.subprocess_pool import (
    Worker,
    WorkerLost,
    WorkerPool,
    frame,
    protocol_fds,
    read_frame,
    write_all,
    write_frame,
)
from laminar.supervise import Spawn, detached_spawn
from laminar.tools.registry import Registry

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
MEMORY_EXIT = 86
"""A child that hit MemoryError where it could not even report it exits with this status."""
GRACE_S = 2.0
"""The pool waits this much past the wall limit for the worker's own answer before killing it."""
START_TIMEOUT_S = 30.0
"""A worker must say HELLO within this."""
MAX_ERROR_CHARS = 2000
NET_ERRNOS = {
    errno.ENETUNREACH,
    errno.EHOSTUNREACH,
    errno.EAFNOSUPPORT,
    errno.ECONNREFUSED,
    errno.EADDRNOTAVAIL,
    errno.ENETDOWN,
    errno.EPERM,
    errno.EACCES,
}
_WORKER_CMD = "from laminar.tools.sandbox import worker_main; worker_main()"


class Outcome(msgspec.Struct):
    """What one call gave (child -> worker -> pool)."""

    ok: bool
    output: str = ""
    error: str = ""
    error_kind: str = ""
    truncated: bool = False
    seconds: float = 0.0


class SandboxError(RuntimeError):
    """The pool could not start (a worker failed to come up, or netns was demanded and refused)."""


# ---- worker process --------------------------------------------------------------------------
class NetworkDisabled(PermissionError):
    """Raised by the socket guard (tools.network=none): the sandbox has no network."""


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _isolate_network(mode: str) -> str:
    """Enter a fresh network namespace, or install the socket guard; returns what was done."""
    if mode in ("auto", "netns"):
        libc = _libc()
        for flags, name in (
            (CLONE_NEWNET, "netns"),
            (CLONE_NEWUSER | CLONE_NEWNET, "userns+netns"),
        ):
            if libc.unshare(flags) == 0:
                return name
        err = ctypes.get_errno()
        if mode == "netns":
            raise SandboxError(
                f"tools.network=netns: unshare(CLONE_NEWNET) failed: {os.strerror(err)}; run as "
                "root or enable user namespaces, or set tools.network=auto (falls back to the "
                "socket guard, which is not an OS boundary)"
            )
    _guard_sockets()
    return "none"


def _guard_sockets() -> None:
    """Refuse new sockets of every family but AF_UNIX. socket.socket initialises through
    `_socket.socket.__init__` looked up at call time, so guarding the C type guards both (and
    socket.create_connection, which builds a socket.socket); sockets made from an existing
    descriptor (socketpair) pass."""
    import _socket
    import socket

    real = _socket.socket

    def refuse(*_a: Any, **_k: Any) -> NoReturn:
        raise NetworkDisabled("network access is disabled in the tool sandbox")

    class GuardedSocket(real):  # type: ignore[valid-type,misc]
        def __init__(self, family: int = -1, type: int = -1, proto: int = -1, fileno: Any = None):  # noqa: A002
            if fileno is None and family != socket.AF_UNIX:
                refuse()
            real.__init__(self, family, type, proto, fileno)

    _socket.socket = GuardedSocket  # type: ignore[misc]
    socket.create_connection = refuse


class OutputLimit(Exception):
    """The tool printed more than max_output_bytes."""


class _Capture:
    """sys.stdout/sys.stderr of a call's child: keeps at most `limit` bytes, then stops the tool."""

    def __init__(self, limit: int):
        self.limit, self.size, self.truncated = limit, 0, False
        self.parts: list[bytes] = []

    def write(self, s: str) -> int:
        data = str(s).encode("utf-8", "replace")
        room = self.limit - self.size
        if len(data) > room:
            self.parts.append(data[: max(room, 0)])
            self.size = self.limit
            self.truncated = True
            raise OutputLimit(f"output exceeded {self.limit} bytes")
        self.parts.append(data)
        self.size += len(data)
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


def _classify(exc: BaseException) -> tuple[str, str]:
    """(error_kind, error text) of an exception a tool raised."""
    import socket

    text = traceback.format_exception_only(type(exc), exc)[-1].strip()
    qualified = f"{type(exc).__module__}.{type(exc).__qualname__}"
    if text.startswith(qualified):  # the model reads `CalculatorError: ...`, not the module path
        text = type(exc).__name__ + text[len(qualified) :]
    if isinstance(exc, NetworkDisabled | socket.gaierror) or (
        isinstance(exc, OSError) and exc.errno in NET_ERRNOS and _is_socket_error(exc)
    ):
        return "network", text
    return "error", text


def _is_socket_error(exc: OSError) -> bool:
    """An EPERM/EACCES from a file is not a network error; one raised in socket code is."""
    tb = exc.__traceback__
    while tb is not None:
        if "socket" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return exc.errno not in (errno.EPERM, errno.EACCES)


def _vm_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _child(registry: Registry, req: dict[str, Any], result_fd: int) -> NoReturn:
    """Runs in the forked child: limit, run, report, _exit. Never returns."""
    os.setpgid(0, 0)
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    cpu = max(1, math.ceil(float(req["cpu_s"])))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    limit_as = _vm_bytes() + int(req["memory_mb"]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))
    limit = int(req["max_output_bytes"])
    memory_report = frame(
        Outcome(
            ok=False,
            error_kind="memory",
            error=f"MemoryError: over the {req['memory_mb']} MB limit",
        )
    )
    cap = _Capture(limit)
    sys.stdout = sys.stderr = cap
    kind = error = ""
    returned = ""
    tool = registry.get(req["name"])
    try:
        assert tool is not None  # the pool checked the name
        returned = str(tool.fn(**req["args"]))
    except MemoryError:
        kind = "memory"  # nothing allocated here: leaving the block frees the tool's frames
    except OutputLimit:
        kind = "output_limit"
    except BaseException as exc:  # noqa: BLE001 - every failure of the tool is an observation
        kind, error = _classify(exc)
    if kind == "memory":
        write_all(result_fd, memory_report)
        os._exit(0)
    out = cap.getvalue()
    if returned:
        out += (b"\n" if out and not out.endswith(b"\n") else b"") + returned.encode(
            "utf-8", "replace"
        )
    truncated = cap.truncated or len(out) > limit
    if truncated:
        out = out[:limit]
        kind = kind or "output_limit"
    if kind == "output_limit":
        error = f"output exceeded {limit} bytes and was cut"
    res = Outcome(
        ok=not kind,
        output=out.decode("utf-8", "ignore"),
        error=error[:MAX_ERROR_CHARS],
        error_kind=kind,
        truncated=truncated,
    )
    write_frame(result_fd, res)
    os._exit(0)


def _serve_one(registry: Registry, req: dict[str, Any], keep: tuple[int, ...]) -> Outcome:
    """Fork a child for one call, wait for its outcome until the wall limit, classify its end."""
    wall = float(req["wall_s"])
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(r)
            for fd in keep:
                os.close(fd)
            _child(registry, req, w)
        except MemoryError:
            os._exit(MEMORY_EXIT)
        except BaseException:  # noqa: BLE001
            os._exit(70)
    os.close(w)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also here: no window where a kill misses the group
    payload = read_frame(r, t0 + wall, limit=int(req["max_output_bytes"]) + 65536)
    timed_out = payload is None and time.monotonic() - t0 >= wall
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # the call is over: the child and anything it started
    _, status, usage = os.wait4(pid, 0)
    os.close(r)
    seconds = time.monotonic() - t0
    if payload is not None:
        try:
            res = msgspec.msgpack.decode(payload, type=Outcome)
        except msgspec.DecodeError:
            res = Outcome(ok=False, error_kind="crash", error="the tool wrote a malformed result")
        res.output = res.output[: int(req["max_output_bytes"])]
        res.seconds = seconds
        return res
    if timed_out:
        return Outcome(
            ok=False,
            error_kind="timeout",
            seconds=seconds,
            error=f"timed out after {wall:g}s (killed)",
        )
    cpu_used = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        cpu_limit = max(1, math.ceil(float(req["cpu_s"])))
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used >= cpu_limit - 0.05):
            return Outcome(
                ok=False,
                error_kind="timeout",
                seconds=seconds,
                error=f"CPU limit of {cpu_limit}s exceeded (killed)",
            )
        name = signal.Signals(sig).name if sig in signal.Signals.__members__.values() else str(sig)
        return Outcome(
            ok=False, error_kind="crash", seconds=seconds, error=f"the tool crashed (signal {name})"
        )
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
    if code == MEMORY_EXIT:
        return Outcome(
            ok=False,
            error_kind="memory",
            seconds=seconds,
            error=f"MemoryError: over the {req['memory_mb']} MB limit",
        )
    return Outcome(
        ok=False,
        error_kind="crash",
        seconds=seconds,
        error=f"the tool exited with status {code} before answering",
    )


def worker_main() -> None:
    """Entry point of a worker process (`python -c`): spec as JSON in argv[1], frames on
    stdin/stdout."""
    spec = json.loads(sys.argv[1])
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != spec["parent"]:
        os._exit(0)  # the pool died before the death signal was armed
    proto_in, proto_out = protocol_fds()  # a stray print (a tool's import) goes to /dev/null
    workdir = tempfile.mkdtemp(prefix="laminar-tool-")
    os.chdir(workdir)
    hello: dict[str, Any] = {"pid": os.getpid(), "network": "", "error": ""}
    registry: Registry | None = None
    try:
        hello["network"] = _isolate_network(spec["network"])
        registry = Registry.from_entries(spec["tools"])
    except Exception as exc:  # noqa: BLE001 - reported to the pool, which fails its start
        hello["error"] = f"{type(exc).__name__}: {exc}"
    write_frame(proto_out, hello)
    try:
        while registry is not None:
            raw = read_frame(proto_in)
            if raw is None:
                break
            req = msgspec.msgpack.decode(raw)
            write_frame(proto_out, _serve_one(registry, req, (proto_in, proto_out)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ---- pool side (asyncio) ----------------------------------------------------------------------
async def _start_worker(tools: list[str], network: str) -> Worker:
    """One worker in its own session (killed as a group), or SandboxError."""
    spec = json.dumps({"tools": tools, "network": network, "parent": os.getpid()})
    try:
        worker = await Worker.start(
            ["-c", _WORKER_CMD, spec], hello_timeout_s=START_TIMEOUT_S, new_session=True
        )
    except WorkerLost as exc:
        raise SandboxError(f"sandbox worker did not start: {exc}") from None
    if worker.hello.get("error"):
        await worker.kill()
        raise SandboxError(f"sandbox worker failed to start: {worker.hello['error']}")
    return worker


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class SandboxPool:
    """At most tools.workers calls at once, up to tools.max_queue more waiting, the rest busy."""

    def __init__(self, cfg: ToolsConfig, registry: Registry, spawn: Spawn = detached_spawn):
        self.cfg, self.registry = cfg, registry
        self.log = get_logger(role="tools", part="sandbox")
        entries = registry.entries or registry.names()
        self._procs = WorkerPool(
            lambda: _start_worker(entries, cfg.network),
            cfg.workers,
            name="sandbox",
            spawn=spawn,
            log=self.log,
            restart_attempts=5,
            close_grace_s=1.0,
        )
        self._waiting = self._running = 0
        self.network = ""
        self.counts: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self._latency: collections.deque[float] = collections.deque(maxlen=4096)
        self.peak_running = 0

    async def start(self) -> None:
        await self._procs.start()
        self.network = ",".join(sorted({str(w.hello["network"]) for w in self._procs.workers}))
        self.log.info("sandbox_started", workers=self.cfg.workers, network=self.network)

    def _finish(self, res: ToolResult, t0: float) -> ToolResult:
        res.seconds = time.monotonic() - t0
        self.counts["calls"] += 1
        self._latency.append(res.seconds)
        if not res.ok:
            self.errors[res.error_kind] += 1
        return res

    def refusal(self, call_id: str, name: str, arguments: Any) -> ToolResult | None:
        """The answer to a call that must not run (unknown_tool, bad_call), or None. Callers that
        journal a call's start ask this first, so a call that cannot run leaves no trace."""
        tool = self.registry.get(name)
        if tool is None:
            known = ", ".join(self.registry.names())
            return ToolResult(
                call_id,
                name,
                False,
                error_kind="unknown_tool",
                error=f"unknown tool {name!r}; available: {known}",
            )
        problem = tool.check(arguments)
        if problem is not None:
            return ToolResult(call_id, name, False, error=problem, error_kind="bad_call")
        return None

    async def run(
        self, call_id: str, name: str, arguments: dict[str, Any], timeout_s: float = 0.0
    ) -> ToolResult:
        """Run one call; every failure is a ToolResult(ok=False, error_kind=...), never an
        exception."""
        t0 = time.monotonic()

        def fail(kind: str, error: str) -> ToolResult:
            return self._finish(ToolResult(call_id, name, False, error=error, error_kind=kind), t0)

        refused = self.refusal(call_id, name, arguments)
        if refused is not None:
            return self._finish(refused, t0)
        if self._procs.closed:
            return fail("unavailable", "the tool sandbox is shut down")
        if not self._procs.idle and self._waiting >= self.cfg.max_queue:
            return fail("busy", f"tool sandbox busy: {self._waiting} calls already waiting")
        wall = min(timeout_s, self.cfg.wall_s) if timeout_s > 0 else self.cfg.wall_s
        self._waiting += 1
        try:
            worker = await self._procs.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        self.peak_running = max(self.peak_running, self._running)
        req = {
            "name": name,
            "args": arguments,
            "wall_s": wall,
            "cpu_s": self.cfg.cpu_s,
            "memory_mb": self.cfg.memory_mb,
            "max_output_bytes": self.cfg.max_output_bytes,
        }
        try:
            out = await worker.call(req, wall + GRACE_S, Outcome)
        except WorkerLost as exc:
            self._procs.replace(worker, str(exc))
            late = time.monotonic() - t0 >= wall
            return fail("timeout" if late else "crash", f"sandbox worker lost: {exc}")
        except BaseException:
            self._procs.replace(worker, "call cancelled")  # its answer would arrive out of turn
            raise
        finally:
            self._running -= 1
        self._procs.release(worker)
        res = ToolResult(
            call_id,
            name,
            out.ok,
            output=out.output,
            error=out.error,
            error_kind=out.error_kind,
            truncated=out.truncated,
        )
        return self._finish(res, t0)

    async def close(self) -> None:
        await self._procs.close()

    def worker_pids(self) -> list[int]:
        return self._procs.pids()

    def stats(self) -> dict[str, Any]:
        lat = list(self._latency)
        calls = self.counts["calls"]
        return {
            "calls": calls,
            "errors": sum(self.errors.values()),
            "errors_by_kind": dict(self.errors),
            "error_rate": sum(self.errors.values()) / calls if calls else 0.0,
            "latency_p50_s": round(percentile(lat, 0.5), 4),
            "latency_p99_s": round(percentile(lat, 0.99), 4),
            "restarts": self._procs.restarts,
            "queue_depth": self._waiting,
            "running": self._running,
            "peak_running": self.peak_running,
            "workers": len(self._procs.workers),
            "network": self.network,
        }
