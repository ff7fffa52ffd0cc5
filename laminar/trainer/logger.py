"""Per-step metrics: run_dir/metrics.jsonl, TensorBoard (run_dir/tb), optional wandb.

    log = MetricsLogger(run_dir, cfg)
    log.log(step, {"loss": 0.1, "reward": 0.4, ...})      # one JSON line, scalars to tb/wandb
    log.close()

wandb is used only when it is importable *and* cfg.extra["wandb"] is a mapping
(its keys go to wandb.init, e.g. {project: laminar, mode: offline}); otherwise it
is skipped silently. TensorBoard is skipped (with one warning) if it cannot load.
NaN/inf become null in JSON so every line stays valid JSON.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import structlog

from laminar.config import LaminarConfig


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


class MetricsLogger:
    def __init__(self, run_dir: str | os.PathLike, cfg: LaminarConfig | None = None, tensorboard: bool = True,
                 log: structlog.typing.FilteringBoundLogger | None = None):  # fmt: skip
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(
            self.run_dir / "metrics.jsonl", "a", buffering=1
        )  # line-buffered: a crash loses <= 1 line
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"))
            except (
                Exception
            ) as exc:  # tensorboard missing or broken: metrics.jsonl still has everything
                if log is not None:
                    log.warning("tensorboard_unavailable", error=str(exc))
        settings = cfg.extra.get("wandb") if cfg is not None else None
        if cfg is not None and isinstance(settings, dict):
            try:
                import wandb
            except ImportError:
                wandb = None
            if wandb is not None:
                kw = {"name": cfg.name, "dir": str(self.run_dir), **settings}
                kw.setdefault("config", cfg.model_dump(mode="json"))
                self._wandb = wandb.init(**kw)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self._jsonl.write(json.dumps(_clean(record), sort_keys=False) + "\n")
        scalars = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if self._tb is not None:
            for k, v in scalars.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in scalars.items() if math.isfinite(v)}, step=step)

    def flush(self) -> None:
        self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def append_jsonl(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """One durable JSON line (the consumption audit log: which batch each step trained on)."""
    with open(path, "a") as f:
        f.write(json.dumps(_clean(record)) + "\n")
        f.flush()
        os.fsync(f.fileno())
