"""The live progress line of a run: step/total, reward, eval accuracy, tokens/s, staleness,
versions per rollout, ETA. Shown by `laminar run` and by the demo (python -m laminar.demo).

    status = functools.partial(fetch_status, cfg, timeout=0.5)   # laminar/launch/status.py
    progress = Progress(run_dir, "laminar", time.time(), 5.0, total_steps=40, status=status)
    while running:
        progress.tick()              # prints at most every every_s seconds
    progress.tick(final=True)

    [laminar   42s] step   12/20  reward 0.412  eval 0.531  tok/s    1234  staleness 0.80 (max 2)
    ETA 28s  rollouts(v/running) 0:v11/8 1:v12/7        (one line: cut here to fit the page)

Reads what the trainer appends to run_dir/metrics.jsonl (only the new bytes each tick;
keys merge across lines, so an eval line does not hide the step's reward) and asks the
manager for the rollouts' versions through `status` (nothing shown while the cluster starts
or stops, or without one).
On a terminal the line overwrites itself (unless other output shares it); otherwise one
line per tick.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from laminar.protocol.manager import StatusReply


def _num(m: dict[str, Any], key: str) -> float:
    v = m.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan


def _eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(seconds)
    return (
        f"{s // 3600}h{s % 3600 // 60:02d}m"
        if s >= 3600
        else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")
    )


class Progress:
    def __init__(
        self,
        run_dir: str | Path,
        label: str,
        t0: float,
        every_s: float = 5.0,
        *,
        total_steps: int | None = None,
        status: Callable[[], StatusReply] | None = None,
        stream: TextIO | None = None,
        overwrite: bool | None = None,
    ) -> None:
        """total_steps: trainer.total_steps (shown as step/total, and the ETA). status: asks the
        manager (short deadline; it may raise while the cluster starts or stops).
        overwrite: redraw one line with a carriage return (default: when the stream is a
        terminal); False where other output shares the terminal (`laminar run` copies the
        nodes' logs there), so each tick is a line of its own."""
        self.run_dir, self.label, self.t0, self.every_s = Path(run_dir), label, t0, every_s
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if overwrite is None else overwrite
        self.last_print = 0.0
        self.last: dict[str, Any] = {}
        """Every key's latest value over the metrics lines read so far."""
        self._pos = 0
        self._first: tuple[int, float] | None = None  # (step, time) of the first step line
        self._latest: tuple[int, float] | None = None
        self.total_steps, self.status = total_steps, status

    def read_metrics(self) -> None:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        with open(path, "rb") as f:
            f.seek(self._pos)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a line being written: read it whole next time
                self._pos += len(line)
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(rec, dict):
                    continue
                self.last.update({k: v for k, v in rec.items() if v is not None})
                if "reward" in rec and isinstance(rec.get("step"), int):
                    point = (rec["step"], float(rec.get("time", time.time())))
                    self._first = self._first or point
                    self._latest = point

    def eta_s(self, total: int | None) -> float:
        """Seconds left at the step rate seen so far (NaN until two steps are logged)."""
        if total is None or self._first is None or self._latest is None:
            return math.nan
        (s0, t0), (s1, t1) = self._first, self._latest
        if s1 <= s0 or t1 <= t0:
            return math.nan
        return (total - s1) * (t1 - t0) / (s1 - s0)

    def _versions(self) -> str:
        if self.status is None:
            return ""
        try:
            reply = self.status()
        except Exception:  # the cluster is starting or stopping: no table this time
            return ""
        rows = sorted((e.node_id, e.status) for e in reply.nodes if e.role == "rollout" and e.alive)
        return " ".join(
            f"{n.split('-')[-1]}:v{s.version}/{s.running}" for n, s in rows if s is not None
        )

    def line(self, now: float | None = None) -> str:
        """The progress line from what has been read so far (no I/O)."""
        now = time.time() if now is None else now
        m = self.last
        head = f"[{self.label} {now - self.t0:5.0f}s] "
        if "step" not in m:
            return head + "starting nodes ..."
        total = self.total_steps
        text = head + f"step {int(m['step']):4d}" + (f"/{total}" if total else "")
        text += f"  reward {_num(m, 'reward'):.3f}"
        if "eval/accuracy" in m:
            text += f"  eval {_num(m, 'eval/accuracy'):.3f}"
        text += f"  tok/s {_num(m, 'tokens_per_s'):7.0f}"
        text += f"  staleness {_num(m, 'staleness'):.2f} (max {m.get('staleness_max', 0)})"
        if total:
            text += f"  ETA {_eta(self.eta_s(total))}"
        return text

    def tick(self, final: bool = False) -> None:
        now = time.time()
        if not final and now - self.last_print < self.every_s:
            return
        self.last_print = now
        self.read_metrics()
        text = self.line(now)
        if not final:
            v = self._versions()
            if v:
                text += f"  rollouts(v/running) {v}"
        if self.tty:  # cut to the terminal's width, or the carriage return cannot overwrite it
            width = max(40, shutil.get_terminal_size().columns - 1)
            end = "\n" if final else ""
            print("\r" + text[:width].ljust(width), end=end, file=self.stream, flush=True)
        else:
            print(text, file=self.stream, flush=True)
