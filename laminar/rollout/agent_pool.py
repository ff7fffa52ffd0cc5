"""The rollout's agent worker processes, each running many episodes at once.

    pool = AgentPool(spec, workers=2, concurrency=16, hello_timeout_s=60, spawn=..., log=...)
    await pool.start()                                  # every worker said hello (or it raises)
    reply = await pool.run(request, timeout_s)          # one episode: {ok, reward | error}
        raises WorkerTimeout (the episode was cancelled in its worker) or WorkerLost (the worker
        died: every episode it ran fails so; a fresh worker starts in the background)
    await pool.close()

    pool ──frame({id, ...} | {cancel: id})──► laminar/agents/worker.py ──frame({id, ...})──► pool

A request goes to the live worker with the fewest episodes; a semaphore bounds the episodes
in flight to workers x concurrency (the rest wait their turn here). Workers are started with
laminar/subprocess_pool.py's `Worker.start` (hello, PYTHONPATH, own session, killed as a group).

    pool = await shared_pool(spec, workers=4, concurrency=256, hello_timeout_s=60, log=...)
    ...                                                 # every rollout of this process: one pool
    await release_shared(pool)                          # the last user closes it

agent.shared_workers: the rollouts of one process (an embedded LocalCluster, the emulated
cluster bench's many sim rollouts) share one pool, so a host runs agent.workers processes, not
that many per rollout. A request carries its rollout's endpoint, so any worker serves any
rollout's episodes; the shared pool's reader tasks belong to the pool (its own Supervisor), not
to the rollout that happened to start it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import msgspec

from laminar.subprocess_pool import Worker, WorkerLost, WorkerTimeout, frame
from laminar.supervise import Spawn, Supervisor


class _Slot:
    def __init__(self, worker: Worker):
        self.worker = worker
        self.inflight: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.dead = False


class AgentPool:
    def __init__(
        self,
        spec: str,
        *,
        workers: int,
        concurrency: int,
        hello_timeout_s: float,
        spawn: Spawn,
        log: Any,
    ):
        self.spec, self.size, self.concurrency = spec, workers, concurrency
        self.hello_timeout_s = hello_timeout_s
        self.spawn, self.log = spawn, log
        self.slots: list[_Slot] = []
        self._room = asyncio.Semaphore(workers * concurrency)
        self._ids = itertools.count()
        self._closed = False
        self._up = asyncio.Event()
        """Set when a worker came up (a request with no live worker waits for it)."""
        self.restarts = 0

    async def _start_one(self) -> _Slot:
        w = await Worker.start(
            ["-m", "laminar.agents.worker", self.spec],
            hello_timeout_s=self.hello_timeout_s,
            new_session=True,
        )
        if w.hello.get("error"):
            await w.kill()
            raise RuntimeError(f"agent.fn {self.spec!r}: {w.hello['error']}")
        slot = _Slot(w)
        self.slots.append(slot)
        self._up.set()
        self.spawn(self._read(slot), "agent-worker-read")
        return slot

    async def start(self) -> None:
        await asyncio.gather(*(self._start_one() for _ in range(self.size)))

    def pids(self) -> list[int]:
        return [s.worker.pid for s in self.slots if not s.dead]

    async def _read(self, slot: _Slot) -> None:
        """Replies of one worker to their episodes; its death fails the ones it still ran."""
        out = slot.worker.proc.stdout
        assert out is not None
        try:
            while True:
                head = await out.readexactly(4)
                reply = msgspec.msgpack.decode(
                    await out.readexactly(int.from_bytes(head, "big")), type=dict[str, Any]
                )
                fut = slot.inflight.pop(int(reply.get("id", -1)), None)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError) as exc:
            why = f"agent worker {slot.worker.pid} exited ({type(exc).__name__})"
        slot.dead = True
        if slot in self.slots:
            self.slots.remove(slot)
        for fut in slot.inflight.values():
            if not fut.done():
                fut.set_exception(WorkerLost(why))
        slot.inflight.clear()
        await slot.worker.kill()
        if not self._closed:
            self.restarts += 1
            self.log.warning("agent_worker_restart", pid=slot.worker.pid, reason=why)
            await self._start_one()

    async def _slot(self, timeout_s: float) -> _Slot:
        """A live worker with room (fewest episodes first); waits for a restart, within the
        deadline, when every worker with room is down."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            room = [s for s in self.slots if not s.dead and len(s.inflight) < self.concurrency]
            if room:
                return min(room, key=lambda s: len(s.inflight))
            self._up.clear()
            left = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(self._up.wait(), max(left, 0.0))
            except TimeoutError:
                raise WorkerTimeout("no agent worker came up in time") from None

    async def run(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        async with self._room:
            slot = await self._slot(timeout_s)
            rid = next(self._ids)
            fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            slot.inflight[rid] = fut
            stdin = slot.worker.proc.stdin
            assert stdin is not None
            try:
                stdin.write(frame({**request, "id": rid}))
                await stdin.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                slot.inflight.pop(rid, None)
                raise WorkerLost(f"agent worker {slot.worker.pid}: {exc}") from None
            try:
                return await asyncio.wait_for(fut, timeout_s)
            except TimeoutError:
                slot.inflight.pop(rid, None)
                with contextlib.suppress(Exception):
                    stdin.write(frame({"cancel": rid}))
                raise WorkerTimeout(f"the agent ran past {timeout_s:g}s") from None
            except asyncio.CancelledError:
                slot.inflight.pop(rid, None)
                with contextlib.suppress(Exception):
                    stdin.write(frame({"cancel": rid}))
                raise

    async def close(self) -> None:
        self._closed = True
        slots, self.slots = list(self.slots), []
        await asyncio.gather(*(s.worker.close(2.0) for s in slots), return_exceptions=True)


class _Shared:
    def __init__(self, pool: AgentPool, tasks: Supervisor):
        self.pool, self.tasks = pool, tasks
        self.users = 0
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()


_SHARED: dict[tuple[str, int, int, int], _Shared] = {}
"""(spec, workers, concurrency, id of the event loop) -> the pool its rollouts share."""


async def shared_pool(
    spec: str, *, workers: int, concurrency: int, hello_timeout_s: float, log: Any
) -> AgentPool:
    """This process's pool for `spec` (started by the first caller, the others wait for it);
    each call is one user, to be given back with `release_shared`."""
    key = (spec, workers, concurrency, id(asyncio.get_running_loop()))
    entry = _SHARED.get(key)
    if entry is None:
        tasks = Supervisor("agent-pool")
        pool = AgentPool(
            spec,
            workers=workers,
            concurrency=concurrency,
            hello_timeout_s=hello_timeout_s,
            spawn=tasks.spawn,
            log=log,
        )
        entry = _SHARED[key] = _Shared(pool, tasks)
        try:
            await pool.start()
        except BaseException as exc:
            del _SHARED[key]
            entry.started.set_exception(exc)
            entry.started.exception()  # retrieved: the waiters get it too
            await _close(entry)
            raise
        entry.started.set_result(None)
    else:
        await asyncio.shield(entry.started)
    entry.users += 1
    return entry.pool


async def release_shared(pool: AgentPool) -> None:
    """One user less; the last one closes the pool (its workers, its reader tasks)."""
    for key, entry in list(_SHARED.items()):
        if entry.pool is pool:
            entry.users -= 1
            if entry.users <= 0:
                del _SHARED[key]
                await _close(entry)
            return


async def _close(entry: _Shared) -> None:
    await entry.pool.close()
    await entry.tasks.cancel_all()
