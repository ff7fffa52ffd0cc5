"""The node under test in bench/control_plane.py: a real ManagerNode or BufferNode in its own
process, with a probe in its loop that writes one line a second, and the readers of those lines.

    .venv/bin/python bench/cp_node.py ROLE CFG_JSON PROBE_PATH [INDEX]     # control_plane spawns it

The process is set up as `laminar node` sets up its own (uvloop, logging, the collector). Every
handler the node registers is counted per message type (thread CPU, `CONTROL_PLANE_HANDLER_CPU=0`
turns it off); its servers' PolledSockets are kept to count messages and wake-ups
(`CP_GATHER_S` sets their gathering pause); `CONTROL_PLANE_PROFILE=PREFIX` writes a cProfile of
the node to PREFIX.ROLEINDEX.prof. The probe sleeps PROBE_S in the node's loop and records the
overshoot (the loop's lag); once a second it appends a JSON line:
    {"t": unix time, "lags": [ms...], "handler_cpu": {type: CPU-s so far},
     "wakeups": {"received", "waits", "gathers": counts so far}, "gc": [collections per generation]}
read_lag, read_handler_cpu and read_wakeups turn a window of those lines into figures.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROBE_S = 0.01


HANDLER_CPU: dict[str, float] = {}
"""Thread CPU-seconds spent in each message type's handler so far (the
accounting hook below); the lag probe writes it with each line."""
SOCKETS: list[Any] = []
"""This node's servers' PolledSockets (their received / waits / gathers counters,
written by the lag probe with each line: messages per wake-up)."""


class _Steps:
    """Drives a handler's coroutine and adds the thread CPU of each step to HANDLER_CPU[key] (the
    time it waits, e.g. for the journal's fsync, is not its CPU)."""

    __slots__ = ("coro", "key")

    def __init__(self, coro: Any, key: str):
        self.coro, self.key = coro, key

    def __await__(self) -> Any:
        coro, key, clock = self.coro, self.key, time.thread_time
        value: Any = None
        exc: BaseException | None = None
        while True:
            t0 = clock()
            try:
                fut = coro.throw(exc) if exc is not None else coro.send(value)
            except StopIteration as stop:
                HANDLER_CPU[key] += clock() - t0
                return stop.value
            except BaseException:
                HANDLER_CPU[key] += clock() - t0
                raise
            HANDLER_CPU[key] += clock() - t0
            try:
                value, exc = (yield fut), None
            except BaseException as e:  # noqa: BLE001 - handed on to the coroutine, as a Task would
                value, exc = None, e


def _timed(msg_type: type, handler: Any) -> Any:
    """`handler` with its CPU counted under the message type's name (two thread_time reads per
    call and per resumption: ~1 us, reported beside the figures it measures)."""
    key = msg_type.__name__
    HANDLER_CPU.setdefault(key, 0.0)
    if asyncio.iscoroutinefunction(handler):

        async def run_async(peer: Any, msg: Any) -> Any:
            return await _Steps(handler(peer, msg), key)

        return run_async

    def run(peer: Any, msg: Any) -> Any:
        t0 = time.thread_time()
        try:
            return handler(peer, msg)
        finally:
            HANDLER_CPU[key] += time.thread_time() - t0

    return run


async def _serve(role: str, cfg_path: str, lag_path: str, index: int = 0) -> None:
    from laminar.config import config_from_dict
    from laminar.launch.tuning import setup_process
    from laminar.node import run_nodes
    from laminar.transport.server import RpcServer
    from laminar.wiring.nodes import build_node

    cfg = config_from_dict(json.loads(Path(cfg_path).read_text()))
    setup_process(cfg)  # as `laminar node` sets up its process: logging, the collector
    if os.environ.get("CONTROL_PLANE_HANDLER_CPU", "1") != "0":
        on = RpcServer.on  # every handler the node registers, counted per message type

        def timed_on(self: Any, msg_type: type, handler: Any) -> None:
            on(self, msg_type, _timed(msg_type, handler))

        RpcServer.on = timed_on  # type: ignore[method-assign]
    import laminar.transport.polled as polled
    from laminar.transport.polled import PolledSocket

    if os.environ.get("CP_GATHER_S"):  # the readers' gathering pause (an experiment's knob)
        polled.GATHER_S = float(os.environ["CP_GATHER_S"])
    init = PolledSocket.__init__

    def counted_init(self: Any, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        SOCKETS.append(self)

    PolledSocket.__init__ = counted_init  # type: ignore[method-assign]
    node = build_node(cfg, role, index)  # type: ignore[arg-type]

    async def probe() -> None:
        """Event-loop lag: overshoot of a 10 ms sleep, one line per second (t, lags in ms, the
        handler CPU so far per message type)."""
        with open(lag_path, "a") as f:
            lags: list[float] = []
            t_flush = time.monotonic() + 1.0
            while True:
                t0 = time.monotonic()
                await asyncio.sleep(PROBE_S)
                now = time.monotonic()
                lags.append((now - t0 - PROBE_S) * 1e3)
                if now >= t_flush:
                    row = {
                        "t": time.time(),
                        "lags": [round(v, 2) for v in lags],
                        "handler_cpu": {k: round(v, 6) for k, v in HANDLER_CPU.items()},
                        "wakeups": {
                            k: sum(getattr(io, k) for io in SOCKETS)
                            for k in ("received", "waits", "gathers")
                        },
                        "gc": [g["collections"] for g in gc.get_stats()],
                    }
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    lags, t_flush = [], now + 1.0

    task = asyncio.create_task(probe())
    prof = None
    if os.environ.get("CONTROL_PLANE_PROFILE"):  # where the node's time goes: ROLE lag file + .prof
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        await run_nodes([node])
    finally:
        task.cancel()
        if prof is not None:
            prof.disable()
            prof.dump_stats(os.environ["CONTROL_PLANE_PROFILE"] + f".{role}{index}.prof")


def read_lag(path: Path, t0: float, t1: float) -> dict[str, float]:
    """p99 / max of every probe sample in [t0, t1] (the probe writes one line of samples per
    second)."""
    rows = (
        [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        if path.exists()
        else []
    )
    lags = sorted(v for r in rows if t0 <= r["t"] <= t1 for v in r["lags"])
    if not lags:
        return {"p99_ms": float("nan"), "max_ms": float("nan"), "samples": 0}
    return {
        "p50_ms": lags[len(lags) // 2],
        "p99_ms": lags[int(len(lags) * 0.99)],
        "max_ms": lags[-1],
        "samples": len(lags),
    }


def _probe_span(
    path: Path, t0: float, t1: float, key: str
) -> tuple[dict[str, Any], dict[str, Any], float] | None:
    """The probe's first and last lines (one a second) inside [t0, t1] that carry `key`, and
    the seconds between them; None with fewer than two."""
    rows = (
        [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        if path.exists()
        else []
    )
    inside = [r for r in rows if t0 <= r["t"] <= t1 and key in r]
    if len(inside) < 2:
        return None
    a, b = inside[0], inside[-1]
    return a, b, b["t"] - a["t"]


def read_handler_cpu(path: Path, t0: float, t1: float) -> dict[str, float]:
    """Handler CPU-seconds per second of each message type over [t0, t1], from the cumulative
    figures of the probe's lines (one a second) nearest inside the window."""
    span = _probe_span(path, t0, t1, "handler_cpu")
    if span is None:
        return {}
    a, b, dt = span
    return {
        k: round((v - a["handler_cpu"].get(k, 0.0)) / dt, 4) for k, v in b["handler_cpu"].items()
    }


def read_wakeups(path: Path, t0: float, t1: float) -> dict[str, float] | None:
    """Messages the node's sockets took per second over [t0, t1], the reader's wake-ups (waits
    on the descriptor plus gathering pauses) per second, and messages per wake-up."""
    span = _probe_span(path, t0, t1, "wakeups")
    if span is None:
        return None
    a, b, dt = span
    msgs = (b["wakeups"]["received"] - a["wakeups"]["received"]) / dt
    wakes = (
        b["wakeups"]["waits"]
        + b["wakeups"]["gathers"]
        - a["wakeups"]["waits"]
        - a["wakeups"]["gathers"]
    ) / dt
    gcs = [round((y - x) / dt, 2) for x, y in zip(a.get("gc", []), b.get("gc", []), strict=False)]
    return {
        "messages_per_s": round(msgs, 1),
        "wakeups_per_s": round(wakes, 1),
        "messages_per_wakeup": round(msgs / wakes, 2) if wakes > 0 else None,
        "gc_collections_per_s": gcs,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from laminar.launch.tuning import use_uvloop

    use_uvloop()  # the event loop of `laminar node`
    asyncio.run(_serve(argv[0], argv[1], argv[2], int(argv[3]) if len(argv) > 3 else 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
