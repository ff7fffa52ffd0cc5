"""What the trainer records: run_dir/metrics.jsonl, run_dir/completions.jsonl, TensorBoard
(run_dir/tb) and, when `logging.wandb` is set, Weights & Biases.

    log = MetricsLogger(run_dir, wandb_init_kwargs(cfg.logging, cfg.name, config))
    log.log(step, {"loss": 0.1, "reward": 0.4, ...})      # one JSON line, scalars to tb/wandb
    log.log(step, {"eval/accuracy": 0.6, "eval/n": 64})   # validation: a line of its own
    log.log_completions(step, sample_completions(trajectories, 4, step, version))
    log.close()

metrics.jsonl holds one line per logged step (every key the step measured) plus one
line per validation (step, time and the eval/* keys only): readers merge by step.
completions.jsonl holds `trainer.completions_per_step` trajectories of each step
(prompt, completion, reward, the version that generated it, the step that trained on it);
TensorBoard shows the same as a text table per step.

wandb: `logging.wandb` is a mapping of wandb.init keyword arguments (e.g. {project: p,
mode: offline}); when it is set and wandb is not installed the trainer refuses to start
(`require_wandb`, also called by the launcher before any node starts). The old
undocumented `extra.wandb` is a config error naming logging.wandb (laminar/config.py).
TensorBoard is skipped (with one warning) if it cannot load.
NaN/inf become null in JSON so every line stays valid JSON.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from laminar.config import ConfigError, LoggingConfig

if TYPE_CHECKING:
    from laminar.protocol.data import Trajectory

_TEXT_CHARS = 2000
"""Prompt/completion characters shown per sample in TensorBoard (the jsonl keeps them whole)."""


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def require_wandb(logging: LoggingConfig) -> None:
    """Raise a ConfigError naming the fix when wandb is asked for and not installed."""
    if logging.wandb is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "logging.wandb is set but wandb is not installed: `pip install wandb`, "
            "or set logging.wandb=null"
        )


def wandb_init_kwargs(
    logging: LoggingConfig, name: str, run_config: dict[str, Any]
) -> dict[str, Any] | None:
    """What wandb.init gets (None: wandb is off): the settings, the run's name and its
    resolved config (`run_config`, unless the settings name one). Raises when wandb is
    asked for and not installed."""
    if logging.wandb is None:
        return None
    require_wandb(logging)
    return {"name": name, "config": run_config, **logging.wandb}


def sample_completions(
    trajectories: Sequence[Trajectory], k: int, step: int, trainer_version: int
) -> list[dict[str, Any]]:
    """k trajectories spread evenly over the batch (so several groups show), as plain records."""
    if k <= 0 or not trajectories:
        return []
    n = len(trajectories)
    picks = sorted({i * n // min(k, n) for i in range(min(k, n))})
    out = []
    for i in picks:
        t = trajectories[i]
        out.append(
            {
                "step": step,
                "trainer_version": trainer_version,
                "version": t.version,
                "uid": t.uid,
                "prompt": t.prompt,
                "completion": t.completion,
                "reward": t.reward,
                "finish_reason": t.finish_reason,
                "response_tokens": len(t.response_ids),
                "turns": t.turns,
            }
        )
    return out


def _md_cell(text: Any) -> str:
    s = str(text)
    if len(s) > _TEXT_CHARS:
        s = s[:_TEXT_CHARS] + " …"
    return s.replace("|", "\\|").replace("\n", "<br>")


def completions_markdown(records: Sequence[dict[str, Any]]) -> str:
    rows = ["| version | reward | prompt | completion |", "|---|---|---|---|"]
    for r in records:
        reward = "None" if r.get("reward") is None else f"{r['reward']:.3f}"
        rows.append(
            f"| {r.get('version')} | {reward} | {_md_cell(r.get('prompt', ''))} | "
            f"{_md_cell(r.get('completion', ''))} |"
        )
    return "\n".join(rows)


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | os.PathLike,
        wandb_init: dict[str, Any] | None = None,
        tensorboard: bool = True,
        log: structlog.typing.FilteringBoundLogger | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # line-buffered: a crash loses <= 1 line
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._completions = open(self.run_dir / "completions.jsonl", "a", buffering=1)
        self._tb: Any = None
        self._wandb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"))
            except (
                Exception
            ) as exc:  # tensorboard missing or broken: the jsonl files have everything
                if log is not None:
                    log.warning("tensorboard_unavailable", error=str(exc))
        if wandb_init is not None:  # wandb_init_kwargs: settings, name, config
            import wandb

            self._wandb = wandb.init(**{"dir": str(self.run_dir), **wandb_init})

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self._jsonl.write(json.dumps(_clean(record), sort_keys=False) + "\n")
        scalars = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def log_completions(self, step: int, records: Sequence[dict[str, Any]]) -> None:
        """Sampled completions: one JSON line each, one TensorBoard text table per step."""
        if not records:
            return
        for r in records:
            self._completions.write(json.dumps(_clean(r), ensure_ascii=False) + "\n")
        if self._tb is not None:
            self._tb.add_text("completions", completions_markdown(records), step)
        if self._wandb is not None:
            import wandb

            cols = ["step", "version", "reward", "prompt", "completion"]
            table = wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in records])
            self._wandb.log({"completions": table}, step=step)

    def flush(self) -> None:
        self._jsonl.flush()
        self._completions.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._completions.close()
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
