"""An agent worker process: runs the user's `agent.fn`, many episodes at once.

    python -m laminar.agents.worker my.module:run      (started by the rollout's AgentPool)

    rollout ──frame({id, base_url, api_key, row, kwargs, timeout_s})──► task run(row, client, **kw)
            ──frame({cancel: id})──► that episode's task is cancelled (its time is up)
            ◄──frame({id, ok: true, reward} | {id, ok: false, error})── as each one ends

`client` is an `openai.AsyncOpenAI(base_url=<the rollout's endpoint>/v1, api_key=<the episode's
token>)` with no retries (a failed call fails the attempt; the rollout starts the episode again
from its prompt) and the episode's time limit as its timeout. Its transport follows the episode
(laminar/agents/failover.py): when the episode is moved by repack or its rollout dies, the call
is repeated on the rollout that imported it, and the episode's result goes there by HTTP
(`/laminar/v1/episodes/close`), since the pipe leads to the rollout it left. EOF on the pipe
(the rollout left or died) lets the running episodes finish within their time limit, then the
process ends. Episodes are asyncio tasks of one
loop, so an agent that blocks the loop (CPU work, a blocking call) holds up the others of its
process: such agents want agent.concurrency 1 and more workers. The first frame is the hello,
sent once `fn` and the client's libraries are imported (`warm_imports`): {pid}, or {pid, error}
when `fn` cannot be loaded. A thread reads the pipe (blocking reads of
the framing in laminar/subprocess_pool.py); the loop writes replies. stdout goes to stderr, so
the user's prints cannot corrupt the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec

from laminar.resolve import resolve_spec
from laminar.subprocess_pool import protocol_fds, read_frame, write_frame

ERROR_CHARS = 2000
"""An episode's error text (the error, then its innermost frames) is cut at the end past this."""


def episode_error(exc: BaseException) -> str:
    """The error first, then its innermost frames, cut at the end (ERROR_CHARS): its start says
    what failed, however long the message (an HTTP error's body) or the traceback."""
    frames = "".join(traceback.format_tb(exc.__traceback__, limit=-4))
    return f"{type(exc).__name__}: {exc}\n{frames}"[:ERROR_CHARS]


class AgentLoadError(ValueError):
    pass


def load_agent(spec: str) -> Any:
    fn = resolve_spec(spec, "agent.fn", "async def run(row, client)", AgentLoadError)
    if not inspect.iscoroutinefunction(fn):
        raise AgentLoadError(f"agent.fn {spec!r} must be `async def run(row, client)`")
    return fn


def _plain_reward(out: Any) -> Any:
    """What crosses the pipe: numbers, None, or a dict of plain values."""
    if out is None or isinstance(out, bool | int | float):
        return out
    if isinstance(out, dict):
        return {
            str(k): v if isinstance(v, bool | int | float | str) else str(v) for k, v in out.items()
        }
    if hasattr(out, "__float__"):
        return float(out)
    raise TypeError(f"the agent returned {type(out).__name__}; return a float, a dict or None")


class _Episode:
    def __init__(self, req: dict[str, Any]):
        self.req = req
        self.transport: Any = None
        """laminar/agents/failover.py's FailoverTransport, once the episode runs (openai's HTTP
        library is imported there: without the `agents` extra, each episode fails, counted)."""

    def open(self) -> Any:
        """The episode's HTTP client, through its FailoverTransport."""
        from laminar.agents.failover import FailoverTransport, http_client

        req = self.req
        self.transport = FailoverTransport(
            req["base_url"], req.get("endpoints_dir", ""), float(req.get("reconnect_s", 30.0))
        )
        return http_client(self.transport, float(req.get("timeout_s", 300.0)))

    @property
    def moved(self) -> bool:
        """Its episode is held by another rollout now (the one that started it does not rule
        it: its cancel is ignored, the result goes by HTTP)."""
        return self.transport is not None and self.transport.moves > 0


async def _episode(fn: Any, ep: _Episode, pipe_open: Callable[[], bool]) -> dict[str, Any]:
    from laminar.agents.failover import close_episode, episode_client

    req = ep.req
    timeout = float(req.get("timeout_s", 300.0))
    http = ep.open()
    client = episode_client(req["base_url"], req["api_key"], ep.transport, http)
    try:
        out = await asyncio.wait_for(fn(req["row"], client, **req.get("kwargs", {})), timeout)
        result = {"id": req["id"], "ok": True, "reward": _plain_reward(out)}
    except Exception as exc:  # the user's agent: its failure is the episode's, not the worker's
        result = {"id": req["id"], "ok": False, "error": episode_error(exc)}
    try:
        if ep.moved or not pipe_open():  # the rollout that holds it now hears it by HTTP
            body = {"reward": result["reward"]} if result["ok"] else {"error": result["error"]}
            why = await close_episode(http, req["base_url"], req["api_key"], body)
            if why:
                print(f"agent worker: close of a moved episode: {why}", file=sys.stderr)
            result["moved"] = True
    finally:
        await client.close()
    return result


async def serve(fn: Any, proto_in: int, proto_out: int) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[bytes | None] = asyncio.Queue()

    def read() -> None:
        while True:
            payload = read_frame(proto_in)
            loop.call_soon_threadsafe(inbox.put_nowait, payload)
            if payload is None:
                return

    threading.Thread(target=read, name="agent-pipe", daemon=True).start()
    tasks: dict[int, tuple[asyncio.Task[Any], _Episode]] = {}
    pipe = {"open": True}

    def done(rid: int, task: asyncio.Task[dict[str, Any]]) -> None:
        tasks.pop(rid, None)
        if not task.cancelled() and pipe["open"]:
            try:
                write_frame(proto_out, task.result())
            except OSError:  # the rollout is gone
                pipe["open"] = False

    while (payload := await inbox.get()) is not None:
        req = msgspec.msgpack.decode(payload, type=dict[str, Any])
        if "cancel" in req:
            got = tasks.get(int(req["cancel"]))
            if got is not None and not got[1].moved:  # a moved one is its new rollout's to end
                got[0].cancel()
            continue
        rid = int(req["id"])
        ep = _Episode(req)
        task = asyncio.ensure_future(_episode(fn, ep, lambda: pipe["open"]))
        tasks[rid] = (task, ep)
        task.add_done_callback(functools.partial(done, rid))
    # the rollout left (or died): its episodes go on where they were moved (their calls find the
    # rollout that recovered them), each within its own time limit; then this process ends
    pipe["open"] = False
    await asyncio.gather(*(t for t, _ in list(tasks.values())), return_exceptions=True)


def warm_imports() -> None:
    """Import the client's libraries before the hello (~1 s of CPU for openai), so a rollout's
    first episodes do not each wait for it, and a host starting many workers pays it during
    start-up, not while it serves. Without the `agents` extra this does nothing: each episode
    fails, counted."""
    with contextlib.suppress(ImportError):
        import openai  # noqa: F401

        import laminar.agents.failover  # noqa: F401


def main() -> None:
    proto_in, proto_out = protocol_fds(stdout_to=2)
    try:
        fn = load_agent(sys.argv[1])
        warm_imports()
    except Exception as exc:
        write_frame(proto_out, {"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"})
        return
    write_frame(proto_out, {"pid": os.getpid()})
    asyncio.run(serve(fn, proto_in, proto_out))


if __name__ == "__main__":
    main()
