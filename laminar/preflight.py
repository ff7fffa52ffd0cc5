"""Input checks before any node starts: the model, the data and the functions a config names.

    problems = input_problems(cfg, roles={"buffer", "trainer", "rollout"})
    check_inputs(cfg, roles)          # raises ConfigError listing every problem, one line each

`laminar run` checks every role it is about to start, `laminar node --role R` (outside
`laminar run`) the inputs of R, so a bad path or a typo'd function is one clear line at
once, never a traceback from each node after they all started. What each role reads:

    model.path      trainer (engine torch), rollout (engine torch/vllm), buffer (tokenizer)
    data.train      buffer; a torch/vllm rollout needs it (no prompts otherwise)
    data.eval       trainer (periodic validation)
    reward.fn       rollout (scores trajectories), trainer (validation)
    env.fn          rollout (multi-turn episodes)
    trainer.resume  trainer, when it names a checkpoint directory

Functions are imported the way the nodes will import them: `laminar run` starts its nodes
as `python -m laminar` in this directory, so the current directory is on the import path
here too. Importing runs the user's module's top level, once, in the launcher.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from laminar.config import ConfigError, LaminarConfig, Role
from laminar.resolve import resolve_spec

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_LOCAL_DIRS = frozenset("models model runs data checkpoints ckpt outputs weights tmp".split())


class InputError(ConfigError):
    """A path or function named by the config does not exist; the message names the fix."""


def looks_like_hub_id(path: str) -> bool:
    """`org/name` that is not a local path: what a user copies from a Hugging Face model page.
    A first part that exists here, or is a usual local folder name (models/...), is a path."""
    if not _HUB_ID.match(path) or Path(path).exists():
        return False
    first = path.split("/", 1)[0]
    return first not in _LOCAL_DIRS and not Path(first).exists()


def _where(path: str) -> str:
    return "" if Path(path).expanduser().is_absolute() else f" (relative to {os.getcwd()})"


def model_problem(path: str | None, needed_by: list[str]) -> str | None:
    if not path:
        if needed_by:
            return (
                f"model.path is not set; {', '.join(needed_by)} need a local Hugging Face model "
                "directory (config.json, weights, tokenizer)"
            )
        return None
    if looks_like_hub_id(path):
        local = f"models/{path.rsplit('/', 1)[1]}"
        return (
            f"model.path {path!r} looks like a Hugging Face hub id, but models load from a local "
            f"path only: download it first (`huggingface-cli download {path} --local-dir {local}`) "
            f"and set model.path={local}"
        )
    p = Path(path).expanduser()
    if not p.exists():
        return f"model.path {path!r} does not exist{_where(path)}"
    if not p.is_dir():
        return (
            f"model.path {path!r} is a file; give the model's directory (the one holding "
            "config.json)"
        )
    if not (p / "config.json").is_file():
        return (
            f"model.path {path!r} has no config.json; give a Hugging Face model directory "
            "(save_pretrained output: config.json, *.safetensors, tokenizer files)"
        )
    return None


def data_problem(key: str, path: str | None) -> str | None:
    if not path:
        return None
    from laminar.data.prompts import SUFFIXES  # what the buffer reads (numpy: loaded only here)

    p = Path(path).expanduser()
    if not p.exists():
        return f"{key} {path!r} does not exist{_where(path)}"
    if p.is_dir():
        if not any(f.suffix in SUFFIXES and f.is_file() for f in p.iterdir()):
            return f"{key} {path!r} is a directory with no {'/'.join(SUFFIXES)} files"
        return None
    if p.suffix not in SUFFIXES:
        return f"{key} {path!r}: use a {'/'.join(SUFFIXES)} file (or a directory of them)"
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            return f"{key} {path!r} is parquet but pyarrow is not installed (`pip install pyarrow`)"
    return None


@contextmanager
def _cwd_importable() -> Iterator[None]:
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def function_problem(key: str, spec: str | None) -> str | None:
    """`module:attr` importable, the attribute present and callable (a class counts)."""
    if not spec:
        return None
    with _cwd_importable():
        try:
            resolve_spec(spec, key, "'package.module:function'", ValueError)
        except ValueError as exc:
            return str(exc)
    return None


def input_problems(cfg: LaminarConfig, roles: Collection[Role | str]) -> list[str]:
    """Every problem with the inputs the given roles read, one line each (empty: all fine)."""
    out: list[str | None] = []
    needs_model = []
    if "trainer" in roles and cfg.trainer.engine == "torch":
        needs_model.append("trainer.engine=torch")
    if "rollout" in roles and cfg.rollout.engine != "sim":
        needs_model.append(f"rollout.engine={cfg.rollout.engine}")
    if needs_model or ("buffer" in roles and cfg.model.path):
        out.append(model_problem(cfg.model.path, needs_model))
    if "buffer" in roles or "rollout" in roles:
        if not cfg.data.train and "rollout" in roles and cfg.rollout.engine != "sim":
            out.append(
                f"data.train is not set; rollout.engine={cfg.rollout.engine} needs prompts "
                "(a jsonl or parquet file with a `prompt` column)"
            )
        out.append(data_problem("data.train", cfg.data.train))
    if "trainer" in roles:
        out.append(data_problem("data.eval", cfg.data.eval))
        resume = cfg.trainer.resume
        if resume not in ("auto", "never") and not (Path(resume) / "meta.json").is_file():
            out.append(
                f"trainer.resume {resume!r} is not a checkpoint directory (no meta.json); "
                "use auto, never or a run_dir/checkpoints/step_N directory"
            )
    if "rollout" in roles or ("trainer" in roles and cfg.data.eval):
        out.append(function_problem("reward.fn", cfg.reward.fn))
    if "rollout" in roles:
        out.append(function_problem("env.fn", cfg.env.fn))
    return [p for p in out if p]


def check_inputs(cfg: LaminarConfig, roles: Collection[Role | str]) -> None:
    """Raise InputError naming every problem input_problems finds."""
    problems = input_problems(cfg, roles)
    if len(problems) == 1:
        raise InputError(problems[0])
    if problems:
        raise InputError(
            f"{len(problems)} problems with the run's inputs:\n  " + "\n  ".join(problems)
        )
