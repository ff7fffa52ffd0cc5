"""What a run directory already holds, so `laminar run` never continues or clobbers a run silently.

    prior = inspect_run(cfg)          # PriorRun(state="new" | "unfinished" | "finished", step, ...)
    clear_run(prior.run_dir)          # --overwrite: delete the previous run (guarded)

A run is *finished* when its newest checkpoint reached the configured trainer.total_steps,
or when the trainer ended it early because the data ran out (a "final" checkpoint short of
the total the run was started with, read from the run's config.yaml). Raising
trainer.total_steps makes a finished run unfinished again. A run is *unfinished* when it
holds a checkpoint short of that, or a buffer journal or metrics but no checkpoint yet.
Anything else (nothing there, or only files of a run that never got going) is *new*.

Checkpoints are read from their meta.json (run_dir/checkpoints/step_N/meta.json, the layout
laminar/trainer/checkpoint.py writes), without importing torch: the launcher stays light.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from laminar.config import ConfigError, LaminarConfig

RunState = Literal["new", "unfinished", "finished"]


class RunDirError(ConfigError):
    """The run directory is in a state the command cannot go on from; the message gives the
    options."""


@dataclass(frozen=True)
class PriorRun:
    run_dir: Path
    state: RunState
    step: int = 0
    """Step of the newest complete checkpoint (0: none)."""
    checkpoint: Path | None = None
    why: str = ""
    """One line saying what was found."""


def _newest_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for p in root.iterdir():
        if not p.name.startswith("step_") or not (p / "meta.json").is_file():
            continue  # .tmp-step_N-<pid>: a checkpoint that never completed
        try:
            step = int(p.name.split("_", 1)[1])
        except ValueError:
            continue
        if best is None or step > best[0]:
            best = (step, p)
    if best is None:
        return None
    try:
        meta = json.loads((best[1] / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"checkpoint {best[1]} has an unreadable meta.json ({exc})") from None
    return best[1], meta if isinstance(meta, dict) else {}


def _previous_total(run_dir: Path) -> int | None:
    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text())
        return int(data["trainer"]["total_steps"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None


def inspect_run(cfg: LaminarConfig) -> PriorRun:
    """Classify cfg's run directory (see the module docstring)."""
    run_dir = cfg.resolved_run_dir()
    total = cfg.trainer.total_steps
    if not run_dir.is_dir():
        return PriorRun(run_dir, "new", why="no run directory yet")
    found = _newest_checkpoint(run_dir)
    if found is not None:
        ckpt, meta = found
        step = int(meta.get("step", ckpt.name.split("_", 1)[1]))
        if step >= total:
            why = f"step {step} of trainer.total_steps={total}"
            return PriorRun(run_dir, "finished", step, ckpt, why)
        before = _previous_total(run_dir)
        if meta.get("reason") == "final" and before is not None and step < before:
            why = f"the data ran out at step {step} (data.epochs={cfg.data.epochs})"
            return PriorRun(run_dir, "finished", step, ckpt, why)
        return PriorRun(run_dir, "unfinished", step, ckpt, f"checkpoint at step {step} of {total}")
    journals = sorted(p.name for p in run_dir.glob("buffer-*.journal") if p.stat().st_size > 0)
    metrics = run_dir / "metrics.jsonl"
    if journals or (metrics.is_file() and metrics.stat().st_size > 0):
        what = ", ".join(journals + (["metrics.jsonl"] if metrics.is_file() else []))
        return PriorRun(run_dir, "unfinished", 0, None, f"no checkpoint yet, but {what}")
    return PriorRun(run_dir, "new", why="nothing to resume")


def clear_run(run_dir: Path) -> None:
    """Delete a previous run's directory (`--overwrite`). Refuses a directory that is not a run
    directory (no config.yaml) or that holds the current directory, the home directory or /."""
    target = run_dir.resolve()
    cwd = Path.cwd().resolve()
    if target in (Path(target.anchor), Path.home().resolve()) or cwd.is_relative_to(target):
        raise RunDirError(
            f"--overwrite will not delete {target}: it holds the current, home or root directory"
        )
    if not (target / "config.yaml").is_file():
        raise RunDirError(
            f"--overwrite will not delete {target}: it has no config.yaml, so it is not a laminar "
            "run directory; pick another run_dir= or remove it yourself"
        )
    shutil.rmtree(target)


def refusal(prior: PriorRun) -> str:
    """The message for starting a config whose run directory holds a finished run."""
    return (
        f"{prior.run_dir} holds a finished run ({prior.why}; {prior.checkpoint}). Choose one: "
        f"--resume to continue it (raise trainer.total_steps above {prior.step} to train further), "
        "--overwrite to delete it and start over, or a new name=NAME (or run_dir=DIR)"
    )
