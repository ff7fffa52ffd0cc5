"""Trainer checkpoints: written atomically, found again by `resume: auto`.

    run_dir/checkpoints/step_00000040/
        model/                 HF directory: config.json + model.safetensors (save_pretrained) +
                               tokenizer files
        adapter/               instead of model/ with model.lora: a peft adapter directory
                               (adapter_config.json + adapter_model.safetensors; base: model.path)
        trainer_state.pt       optimizer (keyed by parameter name), scheduler, RNG states
        meta.json              step, version, consumption frontier, time   (written last)

A checkpoint is built in `.tmp-step_N-<pid>` and renamed into place, so a crash
mid-write leaves no half checkpoint that `latest_checkpoint` could pick up; the
oldest complete checkpoints beyond `keep` are deleted after the rename.

The consumption frontier (see laminar/trainer/commits.py) records which
buffer batches the saved weights contain: the last committed batch, and in
commit=checkpoint mode the batches not yet committed, which a restarted trainer
commits before asking for new data.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from laminar.config import LoraConfig
    from laminar.trainer.policy import Policy

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
_SKIP_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
}


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (meta.json present), oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.name.startswith("step_") and (p / "meta.json").is_file()
    ]
    return sorted(found, key=lambda p: int(p.name.split("_", 1)[1]))


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_resume(resume: str, run_dir: str | os.PathLike) -> Path | None:
    """`never` -> None; `auto` -> newest checkpoint in run_dir (or None); otherwise a checkpoint
    path."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(
            f"trainer.resume={resume!r} is not a checkpoint (no meta.json); use auto, never or a "
            "step_N dir"
        )
    return path


def rng_state() -> dict[str, Any]:
    np_state: tuple[Any, ...] = tuple(np.random.get_state(legacy=True))
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_tokenizer_files(src: str | os.PathLike | None, dst: Path) -> None:
    """Copy everything of a model directory except weights and the config (save_pretrained wrote
    those)."""
    if not src or not Path(src).is_dir():
        return
    for f in Path(src).iterdir():
        if f.is_file() and f.name not in _SKIP_FILES and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, dst / f.name)


def write_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model: Any,
    model_state: dict[str, torch.Tensor] | None,
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    *,
    tokenizer_src: str | os.PathLike | None = None,
    keep: int = 2,
    adapter: tuple[LoraConfig, dict[str, torch.Tensor], str | None] | None = None,
) -> Path:
    """Write one checkpoint atomically; returns its directory. Runs on rank 0 only.

    `model` is an HF PreTrainedModel (save_pretrained writes its directory) or None (sim);
    `adapter` (settings, tensors, base path): LoRA's adapter directory instead of the model."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    if (
        final / "meta.json"
    ).is_file():  # same step saved already (e.g. periodic, then SIGTERM): identical state
        return final
    tmp = root / f".tmp-step_{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if adapter is not None:
        from laminar.models.lora import write_adapter_dir

        write_adapter_dir(tmp / "adapter", adapter[0], adapter[1], base_path=adapter[2])
    elif model is not None:  # the sim trainer has no model: its checkpoint is counters + frontier
        model.save_pretrained(tmp / "model", state_dict=model_state, safe_serialization=True)
        copy_tokenizer_files(tokenizer_src, tmp / "model")
    torch.save(trainer_state, tmp / "trainer_state.pt")
    (tmp / "meta.json").write_text(
        json.dumps({**meta, "step": step, "saved_at": time.time()}, indent=1)
    )
    _fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)  # an incomplete dir of the same step (no meta.json)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, trainer_state) of a checkpoint directory; its weights are in path/model."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    return meta, state


def remove_partial(run_dir: str | os.PathLike) -> int:
    """Delete half-written checkpoints left by a crashed trainer (one trainer per run_dir)."""
    root = checkpoint_root(run_dir)
    n = 0
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".tmp-step_"):
                shutil.rmtree(p, ignore_errors=True)
                n += 1
    return n


def save_policy(
    policy: Policy,
    run_dir: str | os.PathLike,
    step: int,
    meta: dict[str, Any],
    tokenizer_src: str | os.PathLike | None = None,
    keep: int = 2,
) -> Path | None:
    """Gather the policy's full state (collective on every rank) and write it on rank 0; with
    LoRA the adapters (fp32) instead of the model."""
    adapter = None
    if policy.lora is not None:
        model_sd = None
        adapter = (policy.lora, policy.export_weights("float32"), policy.settings.model.path)
    else:
        model_sd = policy.full_state_dict()
    state = {
        "optimizer": policy.optimizer_state(),
        "scheduler": policy.scheduler.state_dict(),
        "rng": rng_state(),
    }
    if not policy.ctx.is_main:
        return None
    return write_checkpoint(
        run_dir,
        step,
        policy.model,
        model_sd,
        state,
        meta,
        tokenizer_src=tokenizer_src,
        keep=keep,
        adapter=adapter,
    )


def adapter_of(ckpt: Path | None, lora: bool) -> Path | None:
    """The checkpoint's adapter directory (None: no checkpoint, or a full-model one); a checkpoint
    of the other kind than the config's (model.lora set or not) is refused."""
    if ckpt is None:
        return None
    adapter = ckpt / "adapter"
    if lora != adapter.is_dir():
        held = "LoRA adapters" if adapter.is_dir() else "a full model"
        want = "set" if lora else "not set"
        raise ValueError(
            f"checkpoint {ckpt} holds {held} but model.lora is {want}: resume with the settings "
            "it was trained with, or trainer.resume=never"
        )
    return adapter if lora else None


def load_policy_state(policy: Policy, path: str | os.PathLike) -> dict[str, Any]:
    """Restore optimizer, scheduler and RNG into a policy built from path/model; returns meta."""
    meta, state = read_checkpoint(path)
    policy.load_optimizer_state(state["optimizer"])
    policy.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return meta
