"""Supervised background tasks: the one way a long-running coroutine is started.

    sup = Supervisor("rollout-0", on_exit=node_saw_exit)   # the node owns one
    sup.spawn(outbox.run(), "outbox")                      # a part's loop, started by the node
    RpcServer(..., spawn=sup.spawn)                        # transport objects take the spawn too

A task started here that raises is reported to `on_exit(task, exc)`; for a node that means
it stops loudly (the error is logged and `run()` re-raises it as NodeFailed). A task that
returns is reported with `exc=None` (the node's main loop finishing ends the node); a
cancelled task is not reported. Parts that need a background loop take a `Spawn` (the bound
`spawn` method) as a typed dependency, so they never see their node and never start a bare
`asyncio.ensure_future` whose death nobody would notice.

Code outside a node (a test, a bench script, a tool) gets `detached_spawn`: the same
bookkeeping, and a task that dies is logged as `task_died`, never swallowed silently.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

from laminar.logs import get_logger

EXIT_OK = 0
"""The trainer finished (total_steps, or the data ran out), or there was nothing left to train."""
EXIT_FAILED = 1
"""A node crashed or stopped by itself before the trainer finished, or would not stop."""
EXIT_USAGE = 2
"""Nothing started: a config error, a missing input, or a run directory that needs a choice."""
# stopped by a signal: 128 + its number (130 for Ctrl-C, 143 for SIGTERM), as shells report it
EXIT_PERMANENT = 3
"""Exit code of a node process whose failure a restart cannot fix (a PermanentFailure): the
process supervisors (laminar/children.py, launchers/host_daemons.sh) give up at once."""


class PermanentFailure(RuntimeError):
    """A node failure that a restart would only repeat (e.g. nothing to train): its process
    exits EXIT_PERMANENT, and supervision ends the job instead of restarting it."""


Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any]"]
"""Start a supervised background task: `spawn(coro, name) -> Task`."""

OnExit = Callable[["asyncio.Task[Any]", BaseException | None], None]


class Supervisor:
    """Starts, tracks and cancels a set of background tasks; reports each exit once."""

    def __init__(self, name: str, on_exit: OnExit | None = None):
        self.name = name
        self._on_exit = on_exit
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def tasks(self) -> set[asyncio.Task[Any]]:
        return set(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(f"{self.name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._exited)
        return task

    def _exited(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if self._on_exit is not None:
            self._on_exit(task, exc)
        elif exc is not None:
            _log_death(task, exc)

    async def cancel_all(self, timeout: float = 2.0) -> None:
        """Cancel every task but the caller's and wait (bounded) for each to finish."""
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(t, timeout)


def _log_death(task: asyncio.Task[Any], exc: BaseException) -> None:
    get_logger(role="detached").error(
        "task_died", task=task.get_name(), error=f"{type(exc).__name__}: {exc}", exc_info=exc
    )


_DETACHED = Supervisor("detached")


def detached_spawn(coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
    """Spawn for code outside any node: tracked, and a death is logged, never silent."""
    return _DETACHED.spawn(coro, name)
