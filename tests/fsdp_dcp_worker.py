"""Worker for tests/test_trainer_dcp.py (not a test itself): sharded checkpoints on 2 ranks.

    torchrun --standalone --nproc_per_node 2 tests/fsdp_dcp_worker.py MODEL_DIR OUT_DIR run
    torchrun --standalone --nproc_per_node 2 tests/fsdp_dcp_worker.py MODEL_DIR OUT_DIR resume

run: steps on batches 1, 2, an async sharded checkpoint (every rank writes its shards, on a
gloo group of their own, while step 3 trains); rank 0
writes the losses and the gathered weights after step 2. resume: a fresh policy per rank, the
checkpoint read back (each rank its shards, into a model built on the meta device: no rank loads
the full weights), step 3; rank 0 writes its loss, the meta and its peak host memory growth while
building and resuming. resume_full: the same over a model loaded whole first (the old way).
    torchrun --standalone --nproc_per_node 2 tests/fsdp_dcp_worker.py MODEL_DIR OUT_DIR resume_full
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from laminar.trainer import checkpoint as ck  # noqa: E402
from laminar.trainer.batch import TrainBatch  # noqa: E402
from laminar.trainer.dist import (  # noqa: E402
    DistContext,
    broadcast_message,
    destroy,
    init_distributed,
)
from laminar.trainer.torch_trainer import TorchTrainer  # noqa: E402
from laminar.weights.layout import layout_of, named_list  # noqa: E402
from laminar.weights.pusher import write_flat  # noqa: E402
from laminar.weights.sink import FlatSink  # noqa: E402
from laminar.wiring.trainer import trainer_settings  # noqa: E402
from tests.test_trainer import make_cfg, make_trajs  # noqa: E402

META = {"version": 2, "frontier": {"committed": [0, 1], "uncommitted": []}}


def host_peak_reset() -> int:
    """Reset this process's peak RSS (Linux: clear_refs 5) and return its RSS now, bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def host_peak() -> int:
    """Peak RSS since the last reset, bytes."""
    return _status_kib("VmHWM") * 1024


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class FailingSink:
    def put(self, name: str, tensor: torch.Tensor) -> None:
        raise OSError("injected: the write failed")


def stream_export(policy: TorchTrainer, ctx: DistContext) -> bool:
    """The export streamed into a FlatSink (rank 0) equals the unstreamed export written flat,
    byte for byte; a sink failing at the first tensor raises on rank 0 once the gathers are done
    (the other ranks are in them: no hang)."""
    dtype = policy.settings.model.dtype
    if not ctx.is_main:
        for _ in range(2):  # what follower.py runs for each export rank 0 leads
            broadcast_message(ctx, None)
            policy.model.export_weights(dtype)
        policy.model.export_weights(dtype)  # the unstreamed reference
        return True
    layout = policy.stream_layout()
    assert layout is not None
    try:
        policy.export_into(FailingSink())
        raise AssertionError("a failing sink did not fail the export")
    except OSError:
        pass
    dst = torch.full((layout.total_bytes,), 0xAB, dtype=torch.uint8)
    flat = FlatSink(dst, layout, digest=False)
    policy.export_into(flat)
    flat.finish(60)
    items = named_list(policy.model.export_weights(dtype))
    want = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    write_flat(want, items, layout_of(items))
    return bool(torch.equal(dst, want))


def main() -> None:
    model, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    ctx = init_distributed("cpu")
    cfg = make_cfg(model, out / "run", micro_batch_tokens=48, warmup_steps=2)
    settings = trainer_settings(cfg)
    result: dict = {"world": ctx.world}
    if mode == "run":
        policy = TorchTrainer(settings, model, ctx)
        losses = [policy.train_step(TrainBatch.build(make_trajs(seed=s)))["loss"] for s in (1, 2)]
        weights = policy.model.full_state_dict()
        result.update(streamed_equal=stream_export(policy, ctx))
        # asynchronous (trainer.checkpoint_async): step 3 trains while the shards are written
        pending = ck.save_trainer(policy, out / "run", 2, META, model, keep=2, asynchronous=True)
        losses.append(policy.train_step(TrainBatch.build(make_trajs(seed=3)))["loss"])
        path = pending.wait()
        result.update(losses=losses, checkpoint=str(path))
        if ctx.is_main:
            torch.save(weights, out / "weights2.pt")
    else:  # resume: the model built empty, each rank reads its shards; resume_full: as before
        path = ck.latest_checkpoint(out / "run")
        assert path is not None
        from laminar.models.tiny import empty_causal_lm

        empty_causal_lm(model)  # transformers and the model's modules imported: not measured
        base = host_peak_reset()
        policy = TorchTrainer(settings, model, ctx, empty=mode == "resume")
        ck.read_sharded_weights(policy.model.module, path)
        weights_read = host_peak() - base  # the model built and its weights read
        meta = ck.restore_trainer(policy, path)  # the whole resume (reads the weights again)
        resumed = host_peak() - base
        weights_bytes = sum(p.numel() * p.element_size() for p in policy.model.module.parameters())
        result.update(
            meta=meta,
            last_epoch=policy.scheduler.state_dict()["last_epoch"],
            loss=policy.train_step(TrainBatch.build(make_trajs(seed=3)))["loss"],
            empty=policy.model.empty,
            weights_peak_bytes=weights_read,
            resume_peak_bytes=resumed,
            full_weights_bytes=weights_bytes,  # a DTensor's numel is the full tensor's
        )
    destroy(ctx)
    if ctx.is_main:
        (out / f"{mode}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
