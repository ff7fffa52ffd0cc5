"""Reward runner: user reward functions run off the event loop, with a timeout, isolated.

    runner = RewardRunner("laminar.tasks.countup:reward", timeout_s=10, workers=2)
    await runner.start()                     # imports the function (bad spec -> RewardSpecError)
    res = await runner.score(prompt, completion, row)   # RewardResult(reward, info, seconds)
    await runner.close()

A reward function is referenced as `module:function`, sync or async, and is called
as `fn(prompt, completion, **row)` (row = the dataset row's other columns; keys
`prompt`/`completion` are dropped from row so they cannot collide). It returns:

    float / int / bool      the reward
    None                    "not applicable": the sample is excluded (Trajectory.reward None)
    dict                    named components, all logged in Trajectory.reward_info; the reward is
                            dict["reward"] (None there excludes the sample), or, when there is
                            no "reward" key, the dict's single numeric value. Anything else is
                            an error.

A function that raises, returns something else, returns a non-finite number or
runs past `timeout_s` marks its sample: reward None, RewardResult.error and error_kind
(exception | format | timeout | worker_died; Trajectory.reward_error / reward_error_kind),
counted in `stats`.
Nothing here ever stalls the caller's event loop.

Where it runs (`workers`):
    >= 1  that many worker processes (`python -m laminar.rewards.runner --worker SPEC`),
          one call at a time each (laminar/subprocess_pool.py: length-prefixed msgpack
          frames on the pipes, no pickle, no re-import of the parent's __main__, so a
          notebook or an unguarded script can use them). The child's stdout is moved to
          stderr so a print() in a reward cannot corrupt the protocol. A call that times
          out kills its worker (SIGKILL) and a fresh one replaces it in the background,
          so a hung reward costs one timeout, never a worker slot; a worker that died
          (segfault, os._exit, OOM kill) is replaced the same way.
    0     threads in this process, for trusted fast rewards: sync functions on a small
          thread pool, async ones on one background event loop. A timed-out async call
          is cancelled; a timed-out sync call cannot be killed and keeps its thread
          (counted as `stuck`): use workers >= 1 for rewards that may hang.

Tests: .venv/bin/python -m pytest tests/test_reward_runner.py -q
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from laminar.config import ConfigError, RewardConfig
from laminar.resolve import resolve_spec
from laminar.subprocess_pool import (
    Worker,
    WorkerLost,
    WorkerPool,
    WorkerTimeout,
    protocol_fds,
    read_frame,
    write_frame,
)
from laminar.supervise import Spawn, detached_spawn

__all__ = ["RewardRunner", "RewardResult", "RewardSpecError", "load_reward_fn", "normalize_reward"]

_START_TIMEOUT_S = 60.0
"""A worker process must import the reward module within this long."""


class _ThreadLoops(threading.local):
    """Each reward thread's own event loops for async reward functions (made on first use)."""

    def __init__(self) -> None:
        self.loops: list[Any] = []


class RewardSpecError(ConfigError):
    """cfg.reward.fn does not name an importable callable; the message says what to fix."""


class RewardFormatError(ValueError):
    """A reward function returned something that is not a reward."""


@dataclass
class RewardResult:
    reward: float | None
    info: dict[str, Any] = field(default_factory=dict)
    """The components a dict reward returned: logged (Trajectory.reward_info), never decided on."""
    seconds: float = 0.0
    error: str = ""
    """Why there is no reward (the exception, the timeout, ...); empty when the function
    returned one (None included)."""
    error_kind: str = ""
    """exception | format | timeout | worker_died here; an episode's environment adds env, the
    rollout engine; empty: no error."""

    @property
    def failed(self) -> bool:
        return bool(self.error_kind)

    @classmethod
    def failure(cls, kind: str, text: str) -> RewardResult:
        """No reward, because of `kind`: `text` says what happened."""
        return cls(None, error=text[:500], error_kind=kind)


# ---- the function and its return value ------------------------------------------------------


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """Import `module:function`; raise RewardSpecError naming the fix."""
    fn: Callable[..., Any] = resolve_spec(
        spec, "reward.fn", "'package.module:function'", RewardSpecError
    )
    return fn


def _number(value: Any, what: str) -> float:
    if isinstance(value, numbers.Real):
        try:
            out = float(value)
        except OverflowError:  # an integer past the float range
            raise RewardFormatError(f"{what} is too large for a float") from None
        if not math.isfinite(out):
            raise RewardFormatError(f"{what} is not finite ({out})")
        return out
    raise RewardFormatError(f"{what} must be a number or None, got {type(value).__name__}")


_INT64 = (-(1 << 63), (1 << 63) - 1)
"""What an integer component may be on the wire (msgpack); a larger one travels as its text."""


def _plain(value: Any) -> Any:
    """Log-safe (msgpack-able) version of a component value: None, bool, an int64, a float or a
    string of at most 200 characters (an integer past int64 becomes its text: msgpack cannot
    carry it, and a rollout's outbox must never hold what it cannot encode)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        n = int(value)
        return n if _INT64[0] <= n <= _INT64[1] else _text(str(n))
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:
            return _text(str(value))
    return _text(str(value))


def _text(s: str) -> str:
    """At most 200 characters of valid UTF-8 (a lone surrogate cannot be encoded)."""
    s = s[:200]
    return s if s.isascii() else s.encode("utf-8", "replace").decode("utf-8")


def normalize_reward(out: Any) -> tuple[float | None, dict[str, Any]]:
    """A reward function's return value -> (reward, components). Raises RewardFormatError."""
    if out is None:
        return None, {}
    if isinstance(out, Mapping):
        info = {_text(str(k)): _plain(v) for k, v in out.items()}
        if "reward" in out:
            raw = out["reward"]
        else:
            nums = [k for k, v in out.items() if isinstance(v, numbers.Real)]
            if len(nums) != 1:
                keys = sorted(map(str, out))
                raise RewardFormatError(
                    f"a dict reward needs a 'reward' key or exactly one numeric value; got {keys}"
                )
            raw = out[nums[0]]
        info.pop("reward", None)
        return (None if raw is None else _number(raw, "dict['reward']")), info
    return _number(out, "reward"), {}


def _call(
    fn: Callable[..., Any], prompt: str, completion: str, row: dict[str, Any], loops: list
) -> tuple:
    """Run fn to completion in this thread (an awaitable on a private loop) and normalise it."""
    out = fn(prompt, completion, **row)
    if inspect.isawaitable(out):
        if not loops:
            loops.append(asyncio.new_event_loop())
        out = loops[0].run_until_complete(out)
    return normalize_reward(out)


# ---- worker processes -------------------------------------------------------------------------


def worker_main(spec: str) -> None:
    """Child: import the function, say hello, then answer [prompt, completion, row] frames with
    [True, reward, info] or [False, error_kind, error]."""
    inp, out = protocol_fds(stdout_to=2)  # print() in a reward goes to stderr, never the stream
    sys.stdout = sys.stderr
    try:
        fn = load_reward_fn(spec)
    except Exception as exc:
        write_frame(out, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    write_frame(out, {"ok": True, "pid": os.getpid()})
    loops: list = []
    while (raw := read_frame(inp)) is not None:  # None: the parent is gone
        prompt, completion, row = msgspec.msgpack.decode(raw)
        try:
            reward, info = _call(fn, prompt, completion, row, loops)
            reply = [True, reward, info]
        except RewardFormatError as exc:
            reply = [False, "format", str(exc)]
        except BaseException as exc:  # the user's code: any failure marks the sample only
            reply = [False, "exception", f"{type(exc).__name__}: {exc}"]
        write_frame(out, reply)


async def _start_worker(spec: str) -> Worker:
    worker = await Worker.start(
        ["-m", "laminar.rewards.runner", "--worker", spec], hello_timeout_s=_START_TIMEOUT_S
    )
    if not worker.hello.get("ok"):
        await worker.kill()
        raise RewardSpecError(
            f"reward worker failed to load the function: {worker.hello.get('error')}"
        )
    return worker


# ---- the runner -------------------------------------------------------------------------------


class RewardRunner:
    def __init__(self, spec: str, timeout_s: float = 10.0, workers: int = 1, threads: int = 4):
        self.spec, self.timeout_s, self.workers, self.threads = (
            spec,
            float(timeout_s),
            int(workers),
            threads,
        )
        self._counts: dict[str, int] = dict(
            calls=0, ok=0, excluded=0, errors=0, timeouts=0, stuck=0
        )
        self.seconds_total = 0.0
        self._fn: Callable[..., Any] | None = None
        self._is_async = False
        self._procs: WorkerPool | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._bg_loop: asyncio.AbstractEventLoop | None = None
        self._bg_thread: threading.Thread | None = None
        self._tls = _ThreadLoops()

    @classmethod
    def from_config(cls, rc: RewardConfig) -> RewardRunner:
        return cls(rc.fn, rc.timeout_s, rc.workers)

    @property
    def stats(self) -> dict[str, int]:
        """calls, ok, excluded, errors, timeouts, stuck, replaced (+ respawn_failures)."""
        out = dict(self._counts, replaced=self._procs.restarts if self._procs else 0)
        if self._procs is not None and self._procs.restart_failures:
            out["respawn_failures"] = self._procs.restart_failures
        return out

    async def start(self, spawn: Spawn = detached_spawn) -> None:
        """Import the function here first (a clear error at startup), then start the workers.
        A dead worker's replacement starts in the background through `spawn`."""
        self._fn = load_reward_fn(self.spec)
        self._is_async = inspect.iscoroutinefunction(self._fn)
        if self.workers == 0:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.threads, thread_name_prefix="reward"
            )
            if self._is_async:
                self._bg_loop = asyncio.new_event_loop()
                self._bg_thread = threading.Thread(
                    target=self._bg_loop.run_forever, name="reward-loop", daemon=True
                )
                self._bg_thread.start()
            return
        spec = self.spec
        self._procs = WorkerPool(
            lambda: _start_worker(spec), self.workers, name="reward", spawn=spawn, log=_log()
        )
        await self._procs.start()

    @property
    def worker_pids(self) -> list[int]:
        return self._procs.pids() if self._procs is not None else []

    async def score(
        self, prompt: str, completion: str, row: Mapping[str, Any] | None = None
    ) -> RewardResult:
        """Reward of one sample; never raises for the user's function's failures."""
        if self._fn is None:
            raise RuntimeError("RewardRunner.start() was not awaited")
        kwargs = {str(k): v for k, v in (row or {}).items() if k not in ("prompt", "completion")}
        self._counts["calls"] += 1
        t0 = time.monotonic()
        if self.workers == 0:
            res = await self._score_local(prompt, completion, kwargs)
        else:
            res = await self._score_process(prompt, completion, kwargs)
        res.seconds = time.monotonic() - t0
        self.seconds_total += res.seconds
        if res.failed:
            self._counts["errors"] += 1
        elif res.reward is None:
            self._counts["excluded"] += 1
        else:
            self._counts["ok"] += 1
        return res

    async def _score_local(self, prompt: str, completion: str, row: dict[str, Any]) -> RewardResult:
        assert self._fn is not None and self._pool is not None
        if self._is_async:
            assert self._bg_loop is not None
            fut = asyncio.run_coroutine_threadsafe(
                self._fn(prompt, completion, **row), self._bg_loop
            )
        else:  # normalised on the thread too; an awaitable from a sync fn runs on a per-thread loop
            fut = self._pool.submit(self._run_on_thread, prompt, completion, row)
        try:
            out = await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
        except TimeoutError:
            fut.cancel()  # cancels an async reward; a running sync one keeps its thread
            self._counts["timeouts"] += 1
            if not self._is_async:
                self._counts["stuck"] += 1
            return RewardResult.failure("timeout", f"reward exceeded {self.timeout_s}s")
        except RewardFormatError as exc:
            return RewardResult.failure("format", str(exc))
        except Exception as exc:
            return RewardResult.failure("exception", f"{type(exc).__name__}: {exc}")
        if not self._is_async:
            return RewardResult(*out)
        try:
            return RewardResult(*normalize_reward(out))
        except RewardFormatError as exc:
            return RewardResult.failure("format", str(exc))

    def _run_on_thread(self, prompt: str, completion: str, row: dict[str, Any]) -> tuple:
        assert self._fn is not None
        return _call(self._fn, prompt, completion, row, self._tls.loops)

    async def _score_process(
        self, prompt: str, completion: str, row: dict[str, Any]
    ) -> RewardResult:
        procs = self._procs
        assert procs is not None
        worker = await procs.acquire()
        while not worker.alive:  # died between jobs: not this sample's fault
            procs.replace(worker, "exited while idle")
            worker = await procs.acquire()
        try:
            ok, a, b = await worker.call([prompt, completion, row], self.timeout_s)
        except WorkerTimeout:
            self._counts["timeouts"] += 1
            procs.replace(worker, f"reward exceeded {self.timeout_s}s")
            return RewardResult.failure(
                "timeout", f"reward exceeded {self.timeout_s}s; worker replaced"
            )
        except asyncio.CancelledError:
            procs.replace(worker, "call cancelled")  # its answer may still arrive: never reuse
            raise
        except WorkerLost as exc:  # the child died
            procs.replace(worker, str(exc))
            return RewardResult.failure("worker_died", f"reward worker died ({exc})")
        except (TypeError, ValueError, OverflowError) as exc:  # a row msgpack cannot carry
            procs.release(worker)  # nothing was sent: the worker is fine
            return RewardResult.failure("exception", f"cannot send the sample to the worker: {exc}")
        procs.release(worker)
        return RewardResult(a, b) if ok else RewardResult.failure(a, b)

    async def wait_workers(self, timeout: float) -> None:
        """Until every replacement worker is up (tests; a drain)."""
        if self._procs is not None:
            await self._procs.wait_restarts(timeout)

    async def close(self) -> None:
        if self._procs is not None:
            await self._procs.close()
        if self._bg_loop is not None:
            self._bg_loop.call_soon_threadsafe(self._bg_loop.stop)
            if self._bg_thread is not None:
                self._bg_thread.join(2.0)
            self._bg_loop = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _log() -> Any:
    import structlog

    return structlog.get_logger("laminar.rewards")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit("usage: python -m laminar.rewards.runner --worker module:function")
    worker_main(sys.argv[2])
