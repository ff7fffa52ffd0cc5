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
                            no "reward" key, the dict's single numeric value. Anything else is an error.

A function that raises, returns something else, returns a non-finite number or
runs past `timeout_s` marks its sample: reward None and reward_info {"error": ...,
"error_kind": exception | format | timeout | worker_died}, counted in `stats`.
Nothing here ever stalls the caller's event loop.

Where it runs (`workers`):
    >= 1  that many spawned worker processes, one call at a time each. A call that
          times out kills its worker (SIGKILL) and a fresh one replaces it in the
          background, so a hung reward costs one timeout, never a worker slot.
          Arguments travel to the child over a multiprocessing pipe (a local,
          trusted channel to our own child; the network never sees pickle).
    0     threads in this process, for trusted fast rewards: sync functions on a small
          thread pool, async ones on one background event loop. A timed-out async call
          is cancelled; a timed-out sync call cannot be killed and keeps its thread
          (counted as `stuck`) — use workers >= 1 for rewards that may hang.

Tests: .venv/bin/python -m pytest tests/test_reward_runner.py -q
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import inspect
import math
import multiprocessing as mp
import numbers
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from laminar.config import ConfigError

__all__ = ["RewardRunner", "RewardResult", "RewardSpecError", "load_reward_fn", "normalize_reward"]

_START_TIMEOUT_S = 60.0
"""A worker process must import the reward module within this long."""


class RewardSpecError(ConfigError):
    """cfg.reward.fn does not name an importable callable; the message says what to fix."""


class RewardFormatError(ValueError):
    """A reward function returned something that is not a reward."""


@dataclass
class RewardResult:
    reward: float | None
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return "error" in self.info


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """Import `module:function`; raise RewardSpecError naming the fix."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise RewardSpecError(f"reward.fn must look like 'package.module:function', got {spec!r}")
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise RewardSpecError(f"reward.fn must look like 'package.module:function', got {spec!r}")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise RewardSpecError(f"reward.fn {spec!r}: cannot import module {mod_name!r} ({exc})") from None
    obj: Any = mod
    for part in fn_name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RewardSpecError(f"reward.fn {spec!r}: module {mod_name!r} has no attribute {fn_name!r}") from None
    if not callable(obj):
        raise RewardSpecError(f"reward.fn {spec!r} is a {type(obj).__name__}, not a function")
    return obj


def _number(value: Any, what: str) -> float:
    if isinstance(value, numbers.Real):
        out = float(value)
        if not math.isfinite(out):
            raise RewardFormatError(f"{what} is not finite ({out})")
        return out
    raise RewardFormatError(f"{what} must be a number or None, got {type(value).__name__}")


def _plain(value: Any) -> Any:
    """Log-safe (msgpack-able) version of a component value."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return str(value)[:200]


def normalize_reward(out: Any) -> tuple[float | None, dict[str, Any]]:
    """A reward function's return value -> (reward, components). Raises RewardFormatError."""
    if out is None:
        return None, {}
    if isinstance(out, Mapping):
        info = {str(k): _plain(v) for k, v in out.items()}
        if "reward" in out:
            raw = out["reward"]
        else:
            nums = [k for k, v in out.items() if isinstance(v, numbers.Real)]
            if len(nums) != 1:
                raise RewardFormatError(
                    f"a dict reward needs a 'reward' key or exactly one numeric value; got keys {sorted(map(str, out))}"
                )
            raw = out[nums[0]]
        info.pop("reward", None)
        return (None if raw is None else _number(raw, "dict['reward']")), info
    return _number(out, "reward"), {}


def _call_sync(fn: Callable[..., Any], prompt: str, completion: str, row: dict[str, Any],
               loop_box: list) -> tuple[float | None, dict[str, Any]]:  # fmt: skip
    """Run fn to completion in this thread/process (async fns on a private loop)."""
    out = fn(prompt, completion, **row)
    if inspect.isawaitable(out):
        if not loop_box:
            loop_box.append(asyncio.new_event_loop())
        out = loop_box[0].run_until_complete(out)
    return normalize_reward(out)


def _log_respawn_failure(why: str, exc: BaseException) -> None:
    import structlog

    structlog.get_logger("laminar.rewards").error("reward_worker_respawn_failed", why=why, error=f"{type(exc).__name__}: {exc}")


def _error(kind: str, text: str) -> dict[str, Any]:
    return {"error": text[:500], "error_kind": kind}


def _worker_main(spec: str, conn: Any) -> None:
    """Child process: import the function, then answer (job_id, prompt, completion, row) forever."""
    try:
        fn = load_reward_fn(spec)
    except Exception as exc:  # reported to the parent, which raises it at start()
        conn.send(("init", False, f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("init", True, None))
    loop_box: list = []
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        jid, prompt, completion, row = job
        try:
            conn.send((jid, True, _call_sync(fn, prompt, completion, row, loop_box)))
        except RewardFormatError as exc:
            conn.send((jid, False, ("format", str(exc))))
        except BaseException as exc:  # the user's code: any failure marks the sample only
            conn.send((jid, False, ("exception", f"{type(exc).__name__}: {exc}")))


class _Worker:
    """One spawned reward process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, spec: str):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(spec, child), daemon=True, name="laminar-reward")
        self.proc.start()
        child.close()
        self.jobs = 0

    @property
    def pid(self) -> int:
        return self.proc.pid or 0

    def wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"reward worker {self.pid} did not start within {timeout}s")
        tag, ok, err = self.conn.recv()
        if not ok:
            raise RewardSpecError(f"reward worker failed to load the function: {err}")

    def roundtrip(self, job: tuple, timeout: float) -> tuple[bool, Any]:
        """Blocking (runs on a helper thread): send one job, wait for its answer."""
        self.jobs += 1
        self.conn.send(job)
        if not self.conn.poll(timeout):
            raise TimeoutError
        jid, ok, value = self.conn.recv()  # EOFError when the child died
        if jid != job[0]:
            raise RuntimeError(f"reward worker answered job {jid}, expected {job[0]}")
        return ok, value

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
        self.proc.join(5.0)
        with contextlib.suppress(Exception):
            self.conn.close()


class RewardRunner:
    def __init__(self, spec: str, timeout_s: float = 10.0, workers: int = 1, threads: int = 4):
        self.spec, self.timeout_s, self.workers, self.threads = spec, float(timeout_s), int(workers), threads
        self.stats: dict[str, int] = dict(calls=0, ok=0, excluded=0, errors=0, timeouts=0, replaced=0, stuck=0)
        self.seconds_total = 0.0
        self._fn: Callable[..., Any] | None = None
        self._is_async = False
        self._jid = 0
        self._idle: asyncio.Queue[_Worker] | None = None
        self._all: set[_Worker] = set()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._bg_loop: asyncio.AbstractEventLoop | None = None
        self._bg_thread: threading.Thread | None = None
        self._replacing: set[asyncio.Task] = set()
        self._tls = threading.local()
        self._closed = False

    @classmethod
    def from_config(cls, cfg: Any) -> RewardRunner:
        return cls(cfg.reward.fn, cfg.reward.timeout_s, cfg.reward.workers)

    async def start(self) -> None:
        """Import the function here first (a clear error at startup), then start the workers."""
        self._fn = load_reward_fn(self.spec)
        self._is_async = inspect.iscoroutinefunction(self._fn)
        loop = asyncio.get_running_loop()
        if self.workers == 0:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="reward")
            if self._is_async:
                self._bg_loop = asyncio.new_event_loop()
                self._bg_thread = threading.Thread(target=self._bg_loop.run_forever, name="reward-loop", daemon=True)
                self._bg_thread.start()
            return
        # one helper thread per worker carries its blocking pipe round trip
        self._pool = concurrent.futures.ThreadPoolExecutor(self.workers + 1, thread_name_prefix="reward-io")
        self._idle = asyncio.Queue()
        workers = [_Worker(mp.get_context("spawn"), self.spec) for _ in range(self.workers)]
        self._all.update(workers)
        try:
            await asyncio.gather(*(loop.run_in_executor(self._pool, w.wait_ready, _START_TIMEOUT_S) for w in workers))
        except BaseException:
            await self.close()
            raise
        for w in workers:
            self._idle.put_nowait(w)

    @property
    def worker_pids(self) -> list[int]:
        return sorted(w.pid for w in self._all)

    async def score(self, prompt: str, completion: str, row: Mapping[str, Any] | None = None) -> RewardResult:
        """Reward of one sample; never raises for the user's function's failures."""
        if self._fn is None:
            raise RuntimeError("RewardRunner.start() was not awaited")
        kwargs = {str(k): v for k, v in (row or {}).items() if k not in ("prompt", "completion")}
        self.stats["calls"] += 1
        t0 = time.monotonic()
        if self.workers == 0:
            res = await self._score_local(prompt, completion, kwargs)
        else:
            res = await self._score_process(prompt, completion, kwargs)
        res.seconds = time.monotonic() - t0
        self.seconds_total += res.seconds
        if res.failed:
            self.stats["errors"] += 1
        elif res.reward is None:
            self.stats["excluded"] += 1
        else:
            self.stats["ok"] += 1
        return res

    async def _score_local(self, prompt: str, completion: str, row: dict[str, Any]) -> RewardResult:
        assert self._fn is not None and self._pool is not None
        if self._is_async:
            assert self._bg_loop is not None
            fut = asyncio.run_coroutine_threadsafe(self._fn(prompt, completion, **row), self._bg_loop)
        else:  # normalised on the thread too; an awaitable from a sync fn runs on a per-thread loop
            fut = self._pool.submit(self._run_on_thread, prompt, completion, row)
        try:
            out = await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
        except TimeoutError:
            fut.cancel()  # cancels an async reward; a running sync one keeps its thread
            self.stats["timeouts"] += 1
            if not self._is_async:
                self.stats["stuck"] += 1
            return RewardResult(None, _error("timeout", f"reward exceeded {self.timeout_s}s"))
        except RewardFormatError as exc:
            return RewardResult(None, _error("format", str(exc)))
        except Exception as exc:
            return RewardResult(None, _error("exception", f"{type(exc).__name__}: {exc}"))
        if not self._is_async:
            return RewardResult(*out)
        try:
            reward, info = normalize_reward(out)
        except RewardFormatError as exc:
            return RewardResult(None, _error("format", str(exc)))
        return RewardResult(reward, info)

    def _run_on_thread(self, prompt: str, completion: str, row: dict[str, Any]) -> tuple[float | None, dict[str, Any]]:
        assert self._fn is not None
        box = getattr(self._tls, "loops", None)
        if box is None:
            box = self._tls.loops = []
        return _call_sync(self._fn, prompt, completion, row, box)

    async def _score_process(self, prompt: str, completion: str, row: dict[str, Any]) -> RewardResult:
        assert self._idle is not None
        worker = await self._idle.get()
        while not worker.proc.is_alive():  # died between jobs: not this sample's fault
            self._replace(worker, "died")
            worker = await self._idle.get()
        self._jid += 1
        job = (self._jid, prompt, completion, row)
        loop = asyncio.get_running_loop()
        try:
            ok, value = await loop.run_in_executor(self._pool, worker.roundtrip, job, self.timeout_s)
        except TimeoutError:
            self.stats["timeouts"] += 1
            self._replace(worker, "timeout")
            return RewardResult(None, _error("timeout", f"reward exceeded {self.timeout_s}s; worker replaced"))
        except asyncio.CancelledError:
            self._replace(worker, "cancelled")  # its answer may still arrive: never reuse the pipe
            raise
        except Exception as exc:  # EOFError/OSError: the child died (segfault, os._exit, OOM kill)
            self._replace(worker, "died")
            return RewardResult(None, _error("worker_died", f"reward worker died ({type(exc).__name__}: {exc})"))
        self._idle.put_nowait(worker)
        if ok:
            reward, info = value
            return RewardResult(reward, info)
        kind, text = value
        return RewardResult(None, _error(kind, text))

    def _replace(self, worker: _Worker, why: str) -> None:
        """Kill a worker and start a fresh one in the background (the caller does not wait)."""
        self.stats["replaced"] += 1
        task = asyncio.get_running_loop().create_task(self._respawn(worker, why))
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _respawn(self, old: _Worker, why: str) -> None:
        loop = asyncio.get_running_loop()
        self._all.discard(old)
        await loop.run_in_executor(None, old.kill)
        delay = 0.1
        while not self._closed:
            new: _Worker | None = None
            try:
                new = _Worker(mp.get_context("spawn"), self.spec)
                self._all.add(new)
                await loop.run_in_executor(None, new.wait_ready, _START_TIMEOUT_S)
            except Exception as exc:
                self.stats["respawn_failures"] = self.stats.get("respawn_failures", 0) + 1
                _log_respawn_failure(why, exc)
                if new is not None:
                    self._all.discard(new)
                    await loop.run_in_executor(None, new.kill)
                await asyncio.sleep(delay)  # respawn backoff
                delay = min(delay * 2, 5.0)
                continue
            assert self._idle is not None
            self._idle.put_nowait(new)
            return

    async def wait_workers(self, timeout: float) -> None:
        """Until every replacement worker is up (tests; a drain)."""
        if self._replacing:
            await asyncio.wait_for(asyncio.gather(*self._replacing, return_exceptions=True), timeout)

    async def close(self) -> None:
        self._closed = True
        for t in list(self._replacing):
            t.cancel()
        loop = asyncio.get_running_loop()
        workers = list(self._all)
        self._all.clear()
        for w in workers:
            with contextlib.suppress(Exception):
                w.conn.send(None)
        if workers:
            await loop.run_in_executor(None, lambda: [w.kill() for w in workers])
        if self._bg_loop is not None:
            self._bg_loop.call_soon_threadsafe(self._bg_loop.stop)
            if self._bg_thread is not None:
                self._bg_thread.join(2.0)
            self._bg_loop = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
