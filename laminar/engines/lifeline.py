"""Engine processes die with their rollout, however the rollout ends (stop, SIGTERM, kill -9).

    # in the rollout, before it starts an engine process:
    env = lifeline_env()        # {"LAMINAR_ENGINE_PARENT": "<rollout pid>"}, inherited by the child
    # in each engine process: vLLM runs our general plugin (pyproject.toml entry point
    # vllm.general_plugins -> vllm_plugin) in the EngineCore and its workers, and importing
    # vllm_ext (the worker extension) does the same; both call
    die_with_parent()                    # no-op in the rollout itself (the pid is its own)

A normal stop and SIGTERM reach the engine through the rollout's close() (vLLM's shutdown).
kill -9 of the rollout runs no code there at all, so the engine child must notice by itself:

  * PR_SET_PDEATHSIG (prctl through ctypes): the kernel sends SIGKILL to the child when its
    parent *thread* exits. Only safe when the thread that started the child lives as long
    as the engine, so it is opt-in (`pdeathsig=True`): vLLM's EngineCore is started from
    whichever thread built the AsyncLLM.
  * a watchdog thread blocked in poll() on a pidfd of the rollout process (Linux >= 5.3;
    without pidfd, it checks the pid every 0.2 s): when the rollout is gone, the engine
    process SIGKILLs itself (SIGKILL: vLLM's EngineCore traps SIGTERM). It follows the
    process, not a thread, and works from a grandchild too (vLLM's tensor-parallel workers
    import the extension as well); vLLM's own workers also die with their EngineCore.

Both are in place before the engine loads a model, so an orphan never holds memory or a GPU.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
import time

PARENT_ENV = "LAMINAR_ENGINE_PARENT"
PR_SET_PDEATHSIG = 1


def lifeline_env(pid: int | None = None) -> dict[str, str]:
    """What a rollout puts in an engine child's environment so the child can watch it."""
    return {PARENT_ENV: str(os.getpid() if pid is None else pid)}


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread exits (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    return True


def _wait_gone(pid: int) -> None:
    """Block until process `pid` has exited (pidfd poll; a 0.2 s liveness check without pidfd)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        try:
            p = select.poll()
            p.register(fd, select.POLLIN)
            while not p.poll(None):  # readable once the process has exited
                pass
        finally:
            os.close(fd)
        return
    while alive(pid):
        time.sleep(0.2)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(parent: int | None = None, *, pdeathsig: bool = False) -> bool:
    """In an engine child: die (SIGKILL) as soon as the rollout process `parent` is gone.

    `parent` defaults to $LAMINAR_ENGINE_PARENT; returns False (and does nothing) when that
    is unset or names this very process (the module is also imported in the rollout)."""
    if parent is None:
        raw = os.environ.get(PARENT_ENV, "")
        if not raw.isdigit():
            return False
        parent = int(raw)
    if parent == os.getpid():
        return False
    if pdeathsig:
        set_pdeathsig()
    if not alive(parent):  # the rollout died while this child was starting
        _die()

    def watch() -> None:
        _wait_gone(parent)
        _die()

    threading.Thread(target=watch, name="laminar-lifeline", daemon=True).start()
    return True


def vllm_plugin() -> None:
    """vLLM general plugin (entry point in pyproject.toml): vLLM calls it in each process it
    starts, the EngineCore included, before any model is loaded."""
    die_with_parent()
