"""Live progress line while a run goes: step, reward, tokens/s, staleness, versions per rollout.

Reads the trainer's metrics.jsonl (tail) and asks the manager for the cluster table;
prints one line every `every_s` seconds (overwriting itself on a terminal).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # config loads lazily, inside _versions
    from laminar.config import LaminarConfig


class Progress:
    def __init__(self, run_dir: Path, mode: str, t0: float, every_s: float = 5.0):
        self.run_dir, self.mode, self.t0, self.every_s = run_dir, mode, t0, every_s
        self.last_print = 0.0
        self._pos = 0
        self.last: dict[str, Any] = {}
        self.tty = sys.stdout.isatty()
        self._cfg: LaminarConfig | None = None

    def _read_metrics(self) -> None:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        with open(path) as f:
            f.seek(self._pos)
            for line in f:
                if not line.endswith("\n"):
                    break
                self._pos += len(line)
                try:
                    self.last = json.loads(line)
                except json.JSONDecodeError:
                    pass

    def _versions(self) -> str:
        try:
            from laminar.config import load_config
            from laminar.launch import fetch_status

            if self._cfg is None:
                self._cfg = load_config(self.run_dir / "config.yaml")
            reply = fetch_status(self._cfg, timeout=0.5)
        except Exception:  # the cluster is starting or stopping: no table this time
            return ""
        rows = sorted((e.node_id, e.status) for e in reply.nodes if e.role == "rollout" and e.alive)
        return " ".join(
            f"{n.split('-')[-1]}:v{s.version}/{s.running}" for n, s in rows if s is not None
        )

    def tick(self, final: bool = False) -> None:
        now = time.time()
        if not final and now - self.last_print < self.every_s:
            return
        self.last_print = now
        self._read_metrics()
        m = self.last
        line = f"[{self.mode} {now - self.t0:5.0f}s] "
        if m:
            line += (f"step {m.get('step', 0):4d}  reward {m.get('reward', float('nan')):.3f}  "
                     f"tok/s {m.get('tokens_per_s', float('nan')):7.0f}  "
                     f"staleness {m.get('staleness', float('nan')):.2f} (max {m.get('staleness_max', 0)})")  # fmt: skip
        else:
            line += "starting nodes ..."
        if not final:
            v = self._versions()
            if v:
                line += f"  rollouts(v/running) {v}"
        if self.tty:
            print("\r" + line[:160].ljust(160), end="" if not final else "\n", flush=True)
        else:
            print(line, flush=True)
