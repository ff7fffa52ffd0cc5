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
    >= 1  that many worker processes (`python -m laminar.rewards.runner --worker SPEC`),
          one call at a time each, driven with asyncio subprocess pipes: length-prefixed
          msgpack frames, no pickle, and no re-import of the parent's __main__ (so a
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
import contextlib
import importlib
import inspect
import math
import numbers
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from laminar.config import ConfigError, LaminarConfig
from laminar.supervise import Spawn, detached_spawn

__all__ = ["RewardRunner", "RewardResult", "RewardSpecError", "load_reward_fn", "normalize_reward"]

_START_TIMEOUT_S = 60.0
"""A worker process must import the reward module within this long."""
_LEN = struct.Struct("<I")


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
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return "error" in self.info


# ---- the function and its return value ------------------------------------------------------


def resolve_spec(spec: str, key: str, shape: str, error: type[Exception]) -> Any:
    """The object `package.module:attr` names (attr may be dotted); `error` names `key` and the fix."""
    if (
        not isinstance(spec, str)
        or spec.count(":") != 1
        or spec.startswith(":")
        or spec.endswith(":")
    ):
        raise error(f"{key} must look like {shape}, got {spec!r}")
    mod_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise error(f"{key} {spec!r}: cannot import module {mod_name!r} ({exc})") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise error(f"{key} {spec!r}: module {mod_name!r} has no attribute {attr!r}") from None
    return obj


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """Import `module:function`; raise RewardSpecError naming the fix."""
    obj = resolve_spec(spec, "reward.fn", "'package.module:function'", RewardSpecError)
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


def _error(kind: str, text: str) -> dict[str, Any]:
    return {"error": text[:500], "error_kind": kind}


# ---- worker processes -------------------------------------------------------------------------


def _frame(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def worker_main(spec: str) -> None:
    """Child: import the function, say hello, then answer [job_id, prompt, completion, row] frames."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # print() in a reward goes to stderr, never into the protocol stream
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    try:
        fn = load_reward_fn(spec)
    except Exception as exc:
        out.write(_frame({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        return
    out.write(_frame({"ok": True, "pid": os.getpid()}))
    loops: list = []
    while True:
        head = inp.read(_LEN.size)
        if len(head) < _LEN.size:
            return  # parent gone
        jid, prompt, completion, row = msgpack.unpackb(inp.read(_LEN.unpack(head)[0]), raw=False)
        try:
            reward, info = _call(fn, prompt, completion, row, loops)
            reply = [jid, True, reward, info]
        except RewardFormatError as exc:
            reply = [jid, False, "format", str(exc)]
        except BaseException as exc:  # the user's code: any failure marks the sample only
            reply = [jid, False, "exception", f"{type(exc).__name__}: {exc}"]
        out.write(_frame(reply))


class _Worker:
    """One reward process and the parent's ends of its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.pid = proc.pid

    @classmethod
    async def spawn(cls, spec: str) -> _Worker:
        env = dict(os.environ)
        # the child finds what the parent imports from (a tests/ dir, a notebook's cwd ...)
        env["PYTHONPATH"] = os.pathsep.join(
            [p for p in sys.path if p] + [env.get("PYTHONPATH", "")]
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "laminar.rewards.runner",
            "--worker",
            spec,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        w = cls(proc)
        try:
            hello = await asyncio.wait_for(w._read(), _START_TIMEOUT_S)
        except BaseException:
            await w.kill()
            raise
        if not hello.get("ok"):
            await w.kill()
            raise RewardSpecError(
                f"reward worker failed to load the function: {hello.get('error')}"
            )
        return w

    async def _read(self) -> Any:
        assert self.proc.stdout is not None
        head = await self.proc.stdout.readexactly(_LEN.size)  # IncompleteReadError: the child died
        return msgpack.unpackb(await self.proc.stdout.readexactly(_LEN.unpack(head)[0]), raw=False)

    async def call(self, job: list, timeout: float) -> list:
        assert self.proc.stdin is not None
        self.proc.stdin.write(_frame(job))
        await self.proc.stdin.drain()
        reply = await asyncio.wait_for(self._read(), timeout)
        if reply[0] != job[0]:
            raise RuntimeError(f"reward worker answered job {reply[0]}, expected {job[0]}")
        return reply

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proc.wait(), 5.0)


# ---- the runner -------------------------------------------------------------------------------


class RewardRunner:
    def __init__(self, spec: str, timeout_s: float = 10.0, workers: int = 1, threads: int = 4):
        self.spec, self.timeout_s, self.workers, self.threads = (
            spec,
            float(timeout_s),
            int(workers),
            threads,
        )
        self.stats: dict[str, int] = dict(
            calls=0, ok=0, excluded=0, errors=0, timeouts=0, replaced=0, stuck=0
        )
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
        self._tls = _ThreadLoops()
        self._closed = False
        self._spawn: Spawn = detached_spawn

    @classmethod
    def from_config(cls, cfg: LaminarConfig) -> RewardRunner:
        return cls(cfg.reward.fn, cfg.reward.timeout_s, cfg.reward.workers)

    async def start(self, spawn: Spawn = detached_spawn) -> None:
        """Import the function here first (a clear error at startup), then start the workers.
        A dead worker's replacement starts in the background through `spawn`."""
        self._spawn = spawn
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
        self._idle = asyncio.Queue()
        results = await asyncio.gather(
            *(_Worker.spawn(self.spec) for _ in range(self.workers)), return_exceptions=True
        )
        for r in results:
            if isinstance(r, _Worker):
                self._all.add(r)
                self._idle.put_nowait(r)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]

    @property
    def worker_pids(self) -> list[int]:
        return sorted(w.pid for w in self._all)

    async def score(
        self, prompt: str, completion: str, row: Mapping[str, Any] | None = None
    ) -> RewardResult:
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
            fut = asyncio.run_coroutine_threadsafe(
                self._fn(prompt, completion, **row), self._bg_loop
            )
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
            return RewardResult(*normalize_reward(out))
        except RewardFormatError as exc:
            return RewardResult(None, _error("format", str(exc)))

    def _run_on_thread(self, prompt: str, completion: str, row: dict[str, Any]) -> tuple:
        assert self._fn is not None
        return _call(self._fn, prompt, completion, row, self._tls.loops)

    async def _score_process(
        self, prompt: str, completion: str, row: dict[str, Any]
    ) -> RewardResult:
        assert self._idle is not None
        worker = await self._idle.get()
        while not worker.alive:  # died between jobs: not this sample's fault
            self._replace(worker)
            worker = await self._idle.get()
        self._jid += 1
        try:
            reply = await worker.call([self._jid, prompt, completion, row], self.timeout_s)
        except TimeoutError:
            self.stats["timeouts"] += 1
            self._replace(worker)
            return RewardResult(
                None, _error("timeout", f"reward exceeded {self.timeout_s}s; worker replaced")
            )
        except asyncio.CancelledError:
            self._replace(worker)  # its answer may still arrive: never reuse that pipe
            raise
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            RuntimeError,
        ) as exc:  # the child died
            self._replace(worker)
            return RewardResult(
                None, _error("worker_died", f"reward worker died ({type(exc).__name__}: {exc})")
            )
        except (TypeError, ValueError) as exc:  # a row msgpack cannot carry; the worker is fine
            self._idle.put_nowait(worker)
            return RewardResult(
                None, _error("exception", f"cannot send the sample to the worker: {exc}")
            )
        self._idle.put_nowait(worker)
        _jid, ok, a, b = reply
        return RewardResult(a, b) if ok else RewardResult(None, _error(a, b))

    def _replace(self, worker: _Worker) -> None:
        """Kill a worker and start a fresh one in the background (the caller does not wait)."""
        self.stats["replaced"] += 1
        task = self._spawn(self._respawn(worker), "reward-respawn")
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _respawn(self, old: _Worker) -> None:
        self._all.discard(old)
        await old.kill()
        delay = 0.1
        while not self._closed:
            try:
                new = await _Worker.spawn(self.spec)
            except Exception as exc:
                self.stats["respawn_failures"] = self.stats.get("respawn_failures", 0) + 1
                _log().error(
                    "reward_worker_respawn_failed",
                    error=f"{type(exc).__name__}: {exc}",
                    retry_s=delay,
                )
                await asyncio.sleep(delay)  # respawn backoff
                delay = min(delay * 2, 5.0)
                continue
            if self._closed:
                await new.kill()
                return
            self._all.add(new)
            assert self._idle is not None
            self._idle.put_nowait(new)
            return

    async def wait_workers(self, timeout: float) -> None:
        """Until every replacement worker is up (tests; a drain)."""
        if self._replacing:
            await asyncio.wait_for(
                asyncio.gather(*self._replacing, return_exceptions=True), timeout
            )

    async def close(self) -> None:
        self._closed = True
        for t in list(self._replacing):
            t.cancel()
        workers, self._all = list(self._all), set()
        await asyncio.gather(*(w.kill() for w in workers), return_exceptions=True)
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
