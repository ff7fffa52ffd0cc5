"""torch.distributed plumbing for the FSDP2 trainer: process group, rank commands.

    torchrun --nproc_per_node 2 -m laminar node --role trainer --config FILE
    srun ... python -m laminar node --role trainer --config FILE  # RANK/WORLD_SIZE: the launcher's

Rank 0 is the only rank on the cluster network; before each collective it tells every
other rank which one comes next with `lead(ctx, RankCommand(...))` (init + the resume
path, step + the batch, export, checkpoint, stop); the other ranks wait for it in
laminar/trainer/follower.py. Commands travel as our codec's frames in a uint8 tensor
over a gloo group, so no pickle and no GPU memory is involved. world_size 1 never
initialises torch.distributed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from laminar.message import Limits, Message
from laminar.protocol.trainer import RankCommand
from laminar.transport.codec import decode, encode

# a batch of thousands of trajectories is 3 frames each: far more than a network message may hold
_RANK_LIMITS = Limits(
    max_frames=1 << 24, max_header_bytes=1 << 31, max_message_bytes=1 << 40, max_list_len=1 << 24
)


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    cpu_group: Any = None
    """A gloo group for CPU tensors (commands, metric reduction); None when world == 1."""
    mesh: Any = None
    """The device mesh FSDP2 shards over; None: built from the default group when sharding."""

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_rank() -> tuple[int, int, int]:
    """(rank, world, local_rank) from torchrun/srun environment variables; (0, 1, 0) otherwise."""
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    rank = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)
    local = int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or 0)
    return rank, world, local


def init_distributed(device: str) -> DistContext:
    """Initialise the default process group when launched with world_size > 1."""
    rank, world, local = env_rank()
    if world <= 1:
        return DistContext()
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    cpu_group = dist.new_group(backend="gloo") if device.startswith("cuda") else dist.group.WORLD
    return DistContext(rank=rank, world=world, local_rank=local, cpu_group=cpu_group)


def broadcast_message(ctx: DistContext, msg: Message | None) -> Message:
    """Rank 0 passes `msg`; every rank returns it (validated by the codec like any wire message)."""
    import torch.distributed as dist

    if ctx.is_main:
        assert msg is not None
        frames = [bytes(f) if not isinstance(f, bytes) else f for f in encode(msg)]
        sizes = torch.tensor([len(frames), *[len(f) for f in frames]], dtype=torch.int64)
        head = torch.tensor([sizes.numel()], dtype=torch.int64)
    else:
        head = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(head, 0, group=ctx.cpu_group)
    if not ctx.is_main:
        sizes = torch.zeros(int(head[0]), dtype=torch.int64)
    dist.broadcast(sizes, 0, group=ctx.cpu_group)
    lengths = sizes[1:].tolist()
    if ctx.is_main:
        payload = torch.from_numpy(np.frombuffer(b"".join(frames), dtype=np.uint8).copy())
    else:
        payload = torch.zeros(sum(lengths), dtype=torch.uint8)
    dist.broadcast(payload, 0, group=ctx.cpu_group)
    if ctx.is_main:
        assert msg is not None
        return msg
    raw = payload.numpy().tobytes()
    out, pos = [], 0
    for n in lengths:
        out.append(raw[pos : pos + n])
        pos += n
    return decode(out, _RANK_LIMITS)


def lead(ctx: DistContext, cmd: RankCommand) -> None:
    """Rank 0: announce the next collective to the other ranks (a no-op anywhere else)."""
    if ctx.enabled and ctx.is_main:
        broadcast_message(ctx, cmd)


def agree_on_path(ctx: DistContext, path: Path | None) -> Path | None:
    """Every rank gets rank 0's `path` (the checkpoint to resume from; rank 0 alone reads
    run_dir)."""
    if not ctx.enabled:
        return path
    cmd = broadcast_message(
        ctx, RankCommand(kind="init", path=str(path or "")) if ctx.is_main else None
    )
    assert isinstance(cmd, RankCommand)
    return Path(cmd.path) if cmd.path else None


def destroy(ctx: DistContext) -> None:
    """Every rank calls it: none tears the group down while a peer is still mid-collective
    (gloo aborts the process whose peer's connection closes under it)."""
    if ctx.enabled:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier(group=ctx.cpu_group)
            dist.destroy_process_group()
