"""Trainer checkpoints: written atomically, found again by `resume: auto`.

    run_dir/checkpoints/step_00000040/
        model/                 HF directory: config.json + model.safetensors (save_pretrained) +
                               tokenizer files
        adapter/               instead of model/ with model.lora: a peft adapter directory
                               (adapter_config.json + adapter_model.safetensors; base: model.path)
        trainer_state.pt       optimizer (keyed by parameter name), scheduler, RNG states
        meta.json              step, version, consumption frontier, time   (written last)

    sharded (trainer.checkpoint_format; FSDP's default), every rank writing its own shards:
        dcp/                   torch.distributed.checkpoint: {"model", "optim"} as each rank holds
                               them (.distcp files + .metadata), loadable on any rank count
        hf_config/             the model's config.json + tokenizer files (`laminar export` makes an
                               HF directory of dcp/ + these)
        trainer_state.pt       scheduler, RNG states (rank 0's)
        meta.json              (written last, by rank 0, after every rank's shards are written)

A checkpoint is built in `.tmp-step_N-<pid>` and renamed into place, so a crash
mid-write leaves no half checkpoint that `latest_checkpoint` could pick up; the
oldest complete checkpoints beyond `keep` are deleted after the rename.

The consumption frontier (see laminar/trainer/commits.py) records which
buffer batches the saved weights contain: the last committed batch, and in
commit=checkpoint mode the batches not yet committed, which a restarted trainer
commits before asking for new data.

What a save reads of the torch trainer, and a restore fills, is the small `Checkpointable`
protocol below (its TrainedModel, AdamW, the lr schedule): this module never imports the trainer.
The sim trainer writes its counters and frontier with `write_checkpoint` directly.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from laminar.trainer.protocol import PendingSave

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageWriter

    from laminar.config import LoraConfig
    from laminar.trainer.dist import DistContext
    from laminar.trainer.model import TrainedModel

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


class Checkpointable(Protocol):
    """What a checkpoint writes and restores of a torch trainer (laminar/trainer/torch_trainer.py):
    its model, AdamW and the lr schedule, live. `checkpoint_group`: the process group of async
    sharded saves, made by the first one (None until then, or in one process)."""

    @property
    def model(self) -> TrainedModel: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler: ...

    checkpoint_group: Any


def sharded(fmt: str, ctx: DistContext) -> bool:
    """Are checkpoints sharded under trainer.checkpoint_format `fmt` on these ranks?"""
    return fmt == "sharded" or (fmt == "auto" and ctx.enabled)


def _all_agree(ctx: DistContext, flag: bool) -> bool:
    """Rank 0's `flag` on every rank."""
    if not ctx.enabled:
        return flag
    import torch.distributed as dist

    box = [flag]
    dist.broadcast_object_list(box, src=0, group=ctx.cpu_group)
    return bool(box[0])


def _barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        import torch.distributed as dist

        dist.barrier(group=ctx.cpu_group)


def storage_writer(path: str) -> StorageWriter:
    """Where DCP writes a checkpoint's shards (tests swap in a writer that waits on a gate)."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(path)


def save_sharded(
    trainer: Checkpointable,
    run_dir: str | os.PathLike,
    step: int,
    meta: dict[str, Any],
    tokenizer_src: str | os.PathLike | None = None,
    keep: int = 2,
    asynchronous: bool = False,
) -> PendingSave:
    """Every rank writes its own shards of the weights and AdamW state (collective); rank 0 adds
    the small files, then renames the directory into place. run_dir must be on a filesystem every
    rank sees.

    asynchronous: returns once the state is staged (copied to host memory: training may change
    the weights from then on) and the shards are written by DCP's `async_save` on a thread, over
    `trainer.checkpoint_group` (its own gloo group, so its collectives never interleave with the
    training step's); the returned PendingSave lands it. Everything rank 0 writes besides the
    shards (scheduler, RNG, meta with the consumption frontier) is taken now, at staging time."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, ctx = trainer.model, trainer.model.ctx
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:08d}"
    if _all_agree(ctx, ctx.is_main and (final / "meta.json").is_file()):
        return PendingSave.completed(step, final if ctx.is_main else None)
    tmp = root / f".tmp-step_{step:08d}"  # one name every rank knows (one trainer per run_dir)
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(ctx)
    model_sd, optim_sd = get_state_dict(model.module, trainer.optimizer)
    state = {"scheduler": trainer.scheduler.state_dict(), "rng": rng_state()}
    meta = {**meta, "step": step}
    sd = {"model": model_sd, "optim": optim_sd}
    writer = storage_writer(str(tmp / "dcp"))
    upload: Future[Any] | None = None
    if asynchronous and ctx.enabled and trainer.checkpoint_group is None:
        import torch.distributed as dist

        trainer.checkpoint_group = dist.new_group(backend="gloo")  # every rank, here, in order
    if asynchronous:
        saved = dcp.async_save(sd, storage_writer=writer, process_group=trainer.checkpoint_group)
        assert isinstance(saved, Future)  # the default stager stages before returning
        upload = saved
    else:
        dcp.save(sd, storage_writer=writer)

    def finish() -> Path | None:
        if not ctx.is_main:
            return None
        _finish_sharded(model, tmp, final, state, meta, tokenizer_src)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    pending = PendingSave(step, upload, finish)
    if not asynchronous:
        _barrier(ctx)  # every rank's shards are on disk
        pending.wait()
        _barrier(ctx)
    return pending


def _finish_sharded(
    model: TrainedModel,
    tmp: Path,
    final: Path,
    state: dict[str, Any],
    meta: dict[str, Any],
    tokenizer_src: str | os.PathLike | None,
) -> None:
    """Rank 0, once every rank's shards are durable: the small files, meta.json last, rename."""
    torch.save(state, tmp / "trainer_state.pt")
    (tmp / "hf_config").mkdir()
    config = Path(model.model_path) / "config.json"
    if config.is_file():
        shutil.copy2(config, tmp / "hf_config" / "config.json")
    else:  # the model object knows its config
        model.module.config.to_json_file(str(tmp / "hf_config" / "config.json"))
    copy_tokenizer_files(tokenizer_src, tmp / "hf_config")
    (tmp / "meta.json").write_text(json.dumps({**meta, "saved_at": time.time()}, indent=1))
    _fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def load_sharded(trainer: Checkpointable, path: Path) -> dict[str, Any]:
    """Each rank reads its own shards of path/dcp into its model, then its optimizer (collective).
    The weights first: a model built empty (TrainedModel(empty=True)) holds its share from then
    on, and AdamW's state is created only after."""
    module = trainer.model.module
    read_sharded_weights(module, path)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    # creates AdamW's state first, so every entry has a tensor to load into
    optim_sd = get_optimizer_state_dict(module, trainer.optimizer)
    dcp.load({"optim": optim_sd}, checkpoint_id=str(path / "dcp"))
    set_optimizer_state_dict(module, trainer.optimizer, optim_state_dict=optim_sd)
    meta = json.loads((path / "meta.json").read_text())
    state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    trainer.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return meta


def read_sharded_weights(module: torch.nn.Module, path: Path) -> None:
    """Each rank reads its own shards of the weights in path/dcp into `module` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model_sd = get_model_state_dict(module)
    dcp.load({"model": model_sd}, checkpoint_id=str(path / "dcp"))
    set_model_state_dict(module, model_sd)


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike) -> Path:
    """An HF directory (config, safetensors, tokenizer) of a checkpoint's weights, in one process:
    a sharded checkpoint's dcp/ is read whole (its model part only) on this host's CPU."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    src, dst = Path(checkpoint), Path(out)
    if (src / "model").is_dir():  # a full checkpoint is an HF directory already
        shutil.copytree(src / "model", dst, dirs_exist_ok=True)
        return dst
    if not (src / "dcp").is_dir():
        raise FileNotFoundError(f"{src} is not a checkpoint (neither model/ nor dcp/ in it)")
    sd: dict[str, Any] = {}
    _load_state_dict(
        sd,
        storage_reader=FileSystemReader(str(src / "dcp")),
        planner=_EmptyStateDictLoadPlanner(keys={"model"}),
        no_dist=True,
    )
    weights = {k: v for k, v in sd["model"].items() if isinstance(v, torch.Tensor)}
    from laminar.models.tiny import IMPORT_LOCK

    with IMPORT_LOCK:
        from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(src / "hf_config"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(dst, state_dict=weights, safe_serialization=True)
    copy_tokenizer_files(src / "hf_config", dst)
    return dst


def save_trainer(
    trainer: Checkpointable,
    run_dir: str | os.PathLike,
    step: int,
    meta: dict[str, Any],
    tokenizer_src: str | os.PathLike | None = None,
    keep: int = 2,
    asynchronous: bool = False,
) -> PendingSave:
    """Write a checkpoint (collective on every rank): with LoRA the adapters (fp32, gathered:
    they are small) instead of the model; else sharded (`asynchronous`: see save_sharded), or
    gathered and written by rank 0 (trainer.checkpoint_format)."""
    model = trainer.model
    adapter = None
    if model.lora is not None:
        model_sd = None
        adapter = (model.lora, model.export_weights("float32"), model.settings.model.path)
    elif sharded(model.settings.trainer.checkpoint_format, model.ctx):
        return save_sharded(trainer, run_dir, step, meta, tokenizer_src, keep, asynchronous)
    else:
        model_sd = model.full_state_dict()
    state = {
        "optimizer": optimizer_state(model.module, trainer.optimizer),
        "scheduler": trainer.scheduler.state_dict(),
        "rng": rng_state(),
    }
    if not model.ctx.is_main:
        return PendingSave.completed(step, None)
    path = write_checkpoint(
        run_dir,
        step,
        model.module,
        model_sd,
        state,
        meta,
        tokenizer_src=tokenizer_src,
        keep=keep,
        adapter=adapter,
    )
    return PendingSave.completed(step, path)


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


def restore_trainer(trainer: Checkpointable, path: str | os.PathLike) -> dict[str, Any]:
    """Restore optimizer, scheduler and RNG into a trainer built from path/model (a sharded
    checkpoint: weights too, each rank its own shards); returns meta."""
    if (Path(path) / "dcp").is_dir():
        return load_sharded(trainer, Path(path))
    meta, state = read_checkpoint(path)
    load_optimizer_state(trainer.model.module, trainer.optimizer, state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return meta


def optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full optimizer state keyed by parameter name (rank 0; collective when distributed)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(module, optimizer, options=opts)


def load_optimizer_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    set_optimizer_state_dict(
        module, optimizer, state, options=StateDictOptions(full_state_dict=True)
    )
