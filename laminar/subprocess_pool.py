"""Subprocess workers: child interpreters that answer one request at a time over their pipes.

    pool = WorkerPool(lambda: Worker.start(["-m", "my.worker"], hello_timeout_s=30), size=2,
                      name="reward", spawn=spawn, log=log)
    await pool.start()                      # `size` workers, each said hello (or the first error)
    worker = await pool.acquire()           # waits for an idle worker
    try:
        reply = await worker.call(request, timeout_s)   # one frame out, one frame back
    except WorkerLost as exc:
        pool.replace(worker, str(exc))      # killed; a fresh one starts in the background
    else:
        pool.release(worker)
    await pool.close()

    pool ──frame(request)──► stdin  worker process  stdout ──frame(reply)──► pool
         (4-byte big-endian length + msgpack, both ways; the first reply frame is its hello)

Why `subprocess` executables and not multiprocessing: a fresh interpreter inherits neither the
node's zmq sockets nor its event loop, never re-imports the parent's __main__ (a notebook or an
unguarded script can use it), and no pickle crosses the pipe (msgspec msgpack only).

The child side uses `protocol_fds` (the pipes move off fds 0/1, so a stray print cannot corrupt
the stream), `read_frame` and `write_frame` on raw fds. A worker with a call in flight that
times out, is cancelled or breaks the framing is never reused: its answer could arrive out of
turn. The two users keep their own policy: the reward runner (laminar/rewards/runner.py: what
a reward call means) and the tool sandbox (laminar/tools/sandbox.py: fork per call, rlimits,
network isolation, its working directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from laminar.supervise import Spawn

__all__ = [
    "Worker",
    "WorkerLost",
    "WorkerPool",
    "WorkerTimeout",
    "frame",
    "protocol_fds",
    "read_frame",
    "write_all",
    "write_frame",
]

MAX_FRAME = 1 << 26
"""Largest frame a child reads (64 MiB); a longer length prefix reads as a broken stream."""


class WorkerLost(Exception):
    """The worker exited, broke the framing or gave no answer in time: never reuse it."""


class WorkerTimeout(WorkerLost):
    """No answer within the call's deadline (the worker may be stuck in the request)."""


# ---- framing: 4-byte big-endian length + msgpack -----------------------------------------------


def frame(obj: Any) -> bytes:
    """One frame; raises TypeError for a value msgpack cannot carry (nothing was sent)."""
    payload = msgspec.msgpack.encode(obj)
    return len(payload).to_bytes(4, "big") + payload


# ---- the child's side (blocking, raw fds) --------------------------------------------------


def protocol_fds(stdout_to: int | None = None) -> tuple[int, int]:
    """Move the protocol pipes off fds 0 and 1 and return them as (read_fd, write_fd). fd 0
    becomes /dev/null, fd 1 `stdout_to` (e.g. 2: prints go to stderr) or /dev/null, so nothing
    the worker's code prints or reads can touch the stream."""
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull if stdout_to is None else stdout_to, 1)
    os.close(devnull)
    return proto_in, proto_out


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """n bytes from fd, or None on EOF / past the deadline (a time.monotonic() value)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(fd: int, deadline: float | None = None, limit: int = MAX_FRAME) -> bytes | None:
    """The payload of the next frame, or None on EOF, past the deadline or over `limit` bytes."""
    head = _read_exact(fd, 4, deadline)
    if head is None:
        return None
    n = int.from_bytes(head, "big")
    if n > limit:
        return None
    return _read_exact(fd, n, deadline)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_frame(fd: int, obj: Any) -> None:
    write_all(fd, frame(obj))


# ---- the pool's side (asyncio) -------------------------------------------------------------


class Worker:
    """One worker process and the pool's ends of its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process, new_session: bool):
        self.proc, self.pid, self.new_session = proc, proc.pid, new_session
        self.hello: dict[str, Any] = {}
        """The worker's first frame (what it says about itself: pid, a load error ...)."""

    @classmethod
    async def start(
        cls, args: list[str], *, hello_timeout_s: float, new_session: bool = False
    ) -> Worker:
        """`python ARGS` with pipes on stdin/stdout, once it said hello. The child finds what
        this process imports from (a tests/ dir, a notebook's cwd ...) through PYTHONPATH;
        `new_session`: its own session and process group, killed as a group. Raises WorkerLost
        (the process killed) when no hello comes; the caller judges the hello itself."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [p for p in sys.path if p] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=new_session,
            env=env,
        )
        worker = cls(proc, new_session)
        try:
            worker.hello = msgspec.msgpack.decode(
                await worker._read(hello_timeout_s), type=dict[str, Any]
            )
        except BaseException as exc:
            await worker.kill()
            if isinstance(exc, msgspec.DecodeError):
                raise WorkerLost(f"worker {worker.pid} sent a malformed hello: {exc}") from None
            raise
        return worker

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def _read(self, timeout_s: float) -> bytes:
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(timeout_s):
                head = await self.proc.stdout.readexactly(4)
                return await self.proc.stdout.readexactly(int.from_bytes(head, "big"))
        except asyncio.IncompleteReadError:
            raise WorkerLost(f"worker {self.pid} exited") from None
        except TimeoutError:
            raise WorkerTimeout(f"worker {self.pid} gave no answer in {timeout_s:g}s") from None

    async def call(self, request: Any, timeout_s: float, reply_type: Any = Any) -> Any:
        """Send one request, wait for its reply (decoded as `reply_type`). Raises TypeError /
        ValueError for a request msgpack cannot carry (the worker is fine), WorkerLost else."""
        data = frame(request)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise WorkerLost(f"worker {self.pid}: {exc}") from None
        payload = await self._read(timeout_s)
        try:
            return msgspec.msgpack.decode(payload, type=reply_type)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WorkerLost(f"worker {self.pid} sent a malformed answer: {exc}") from None

    async def kill(self) -> None:
        """SIGKILL (its process group when it has its own session) and reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.new_session:
                os.killpg(self.pid, signal.SIGKILL)
            elif self.proc.returncode is None:
                self.proc.kill()
        with contextlib.suppress(TimeoutError, ProcessLookupError):
            await asyncio.wait_for(self.proc.wait(), 5.0)

    async def close(self, grace_s: float) -> None:
        """Ask the worker to leave (EOF on its stdin); kill it if it has not within grace_s."""
        if grace_s <= 0:
            await self.kill()
            return
        if self.proc.stdin is not None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s)
        except TimeoutError:
            await self.kill()


class WorkerPool:
    """`size` workers, one call at a time each; a lost worker is replaced in the background.

    `start_worker` makes one started worker (or raises); a replacement that fails to start is
    retried with a doubling backoff (0.1 s, at most 5 s apart): forever while the pool is open
    when `restart_attempts` is None, else that many times before the restart task raises (and
    its spawn reports it)."""

    def __init__(
        self,
        start_worker: Callable[[], Awaitable[Worker]],
        size: int,
        *,
        name: str,
        spawn: Spawn,
        log: Any,
        restart_attempts: int | None = None,
        close_grace_s: float = 0.0,
    ):
        self._start_worker, self.size, self.name = start_worker, size, name
        self._spawn, self.log = spawn, log
        self.restart_attempts, self.close_grace_s = restart_attempts, close_grace_s
        self._idle: asyncio.Queue[Worker] = asyncio.Queue()
        self.workers: set[Worker] = set()
        self._restarting: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.restarts = 0
        """Workers killed and replaced (a timeout, a death, a cancelled call)."""
        self.restart_failures = 0
        """Replacement starts that failed (each retried, see the class docstring)."""

    async def start(self) -> None:
        """Start every worker at once; on any failure stop the others and raise the first."""
        results = await asyncio.gather(
            *(self._start_worker() for _ in range(self.size)), return_exceptions=True
        )
        for r in results:
            if isinstance(r, Worker):
                self.workers.add(r)
                self._idle.put_nowait(r)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def idle(self) -> int:
        return self._idle.qsize()

    def pids(self) -> list[int]:
        return sorted(w.pid for w in self.workers)

    async def acquire(self) -> Worker:
        """An idle worker (waits for one); give it back with `release` or `replace`."""
        return await self._idle.get()

    def release(self, worker: Worker) -> None:
        self._idle.put_nowait(worker)

    def replace(self, worker: Worker, why: str) -> None:
        """Kill a worker and start a fresh one in the background (the caller does not wait)."""
        self.workers.discard(worker)
        self.restarts += 1
        self.log.warning("worker_restart", pool=self.name, pid=worker.pid, reason=why)
        task = self._spawn(self._restart(worker), f"{self.name}-worker-restart")
        self._restarting.add(task)
        task.add_done_callback(self._restarting.discard)

    async def _restart(self, old: Worker) -> None:
        await old.kill()
        delay, attempt = 0.1, 0
        while not self._closed:
            attempt += 1
            try:
                new = await self._start_worker()
            except Exception as exc:
                self.restart_failures += 1
                self.log.error(
                    "worker_restart_failed",
                    pool=self.name,
                    error=f"{type(exc).__name__}: {exc}",
                    attempt=attempt,
                    retry_s=delay,
                )
                if self.restart_attempts is not None and attempt >= self.restart_attempts:
                    raise
                await asyncio.sleep(delay)  # restart backoff, not synchronisation
                delay = min(delay * 2, 5.0)
                continue
            if self._closed:
                await new.kill()
                return
            self.workers.add(new)
            self._idle.put_nowait(new)
            return

    async def wait_restarts(self, timeout_s: float) -> None:
        """Until every replacement worker is up (tests; a drain)."""
        if self._restarting:
            await asyncio.wait_for(
                asyncio.gather(*self._restarting, return_exceptions=True), timeout_s
            )

    async def close(self) -> None:
        self._closed = True
        for task in list(self._restarting):
            task.cancel()
        workers, self.workers = list(self.workers), set()
        await asyncio.gather(
            *(w.close(self.close_grace_s) for w in workers), return_exceptions=True
        )
