"""structlog setup: one event name per line, role and node id bound, JSON when not a TTY.

configure_logging("info")                     # JSON on a pipe: NaN/inf become null
bad = RateLimitedLog(log, "bad_message")      # first few in full, then a counted summary
bad.warning(error="3 frames is too few")      # per bad message
bad.flush()                                   # from a periodic loop: emit a pending summary
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO, cast

import structlog
from structlog.typing import FilteringBoundLogger


class _CurrentStderr:
    """Write to whatever sys.stderr is *now* (test runners and daemons swap it out), never to a
    stream captured at configure time that may since have been closed."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def finite_json(obj: Any) -> Any:
    """`obj` with every NaN/inf float (numpy scalars included) replaced by None: strict JSON
    parsers reject the bare `NaN` that json.dumps writes by default."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_json(v) for v in obj]
    item = getattr(obj, "item", None)  # numpy scalars: compare as Python numbers
    if callable(item) and type(obj).__module__ == "numpy" and getattr(obj, "ndim", 1) == 0:
        return finite_json(item())
    return obj


def dumps_finite(obj: Any, **kw: Any) -> str:
    """JSONRenderer's serializer: NaN/inf -> null, and a leftover one is an error, not bare NaN."""
    return json.dumps(finite_json(obj), allow_nan=False, **kw)


def configure_logging(level: str = "info", json_logs: bool | None = None) -> None:
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    renderer = (
        structlog.processors.JSONRenderer(serializer=dumps_finite)
        if json_logs
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _CurrentStderr())),
        cache_logger_on_first_use=False,
    )


def get_logger(**bind: Any) -> FilteringBoundLogger:
    return cast(FilteringBoundLogger, structlog.get_logger("laminar").bind(**bind))


class RateLimitedLog:
    """One warning event that can fire per message from the network (a fuzzer sends thousands):
    the first `first` occurrences are logged in full, later ones are counted and summarised as
    `<event>_summary` with `suppressed` and the last fields at most once per `every_s`."""

    def __init__(
        self,
        log: FilteringBoundLogger,
        event: str,
        first: int = 5,
        every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.log, self.event, self.first, self.every_s, self._clock = (
            log,
            event,
            first,
            every_s,
            clock,
        )
        self.total = 0
        self.suppressed = 0
        self._last: dict[str, Any] = {}
        self._last_summary = clock()

    def warning(self, **fields: Any) -> None:
        self.total += 1
        if self.total <= self.first:
            self.log.warning(self.event, **fields)
            self._last_summary = self._clock()
            return
        self.suppressed += 1
        self._last = fields
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Log the pending summary if `every_s` passed since the last line (or `force`)."""
        if not self.suppressed:
            return
        now = self._clock()
        if not force and now - self._last_summary < self.every_s:
            return
        self.log.warning(
            f"{self.event}_summary",
            suppressed=self.suppressed,
            total=self.total,
            window_s=round(now - self._last_summary, 2),
            **{f"last_{k}": v for k, v in self._last.items()},
        )
        self.suppressed = 0
        self._last_summary = now
