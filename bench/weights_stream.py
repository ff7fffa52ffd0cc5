"""The trainer's stall per weight version: the export streamed into the relay's slot (gathered,
cast and written tensor by tensor: laminar/weights/sink.py) against the whole version exported
first, then pushed (one run, ratio).

    .venv/bin/python bench/weights_stream.py                 # ~100 MB fp32 model, bf16 versions
    .venv/bin/python bench/weights_stream.py --quick         # smaller, fewer repeats (< 1 min)
    .venv/bin/python bench/weights_stream.py --hidden 1024 --layers 16 --out F.json

One relay process (`python -m laminar node --role relay`), this process the trainer: a real
`TorchTrainer` (one process, fp32 master weights, model.dtype=bfloat16) and a WeightPusher to the
relay's shared memory. Each repeat publishes one version both ways, alternating which goes first
(machine drift hits both):
  unstreamed_s  policy.export() (the whole bf16 version on the host) + digest (in a thread beside
                the push, as the trainer node does) + WeightPusher.push
  streamed_s    WeightPusher.push_stream: stage, export_into the slot (the writer thread copies
                tensor i while tensor i+1 is cast), finish + digest, commit
Both are what the trainer node waits per version (`weights_stall_s`). On a CPU host there is no
gather to overlap with: the figure shows the host copy saved (no intermediate version) and the
pipelining of cast and copy. Under FSDP on GPUs the gathers overlap the writes too (the lead's
GPU run). Summary: streamed_vs_unstreamed = median streamed / median unstreamed (< 1: faster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchinfo import git_state  # noqa: E402

from laminar.trainer.torch_trainer import TorchTrainer  # noqa: E402
from laminar.weights.digest import weights_digest  # noqa: E402
from laminar.weights.sink import VersionSink  # noqa: E402
from laminar.wiring.trainer import trainer_settings  # noqa: E402
from tests.relay_procs import RelayProcs  # noqa: E402
from tests.test_trainer import make_cfg  # noqa: E402


def stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


async def measure(policy: TorchTrainer, procs: RelayProcs, repeats: int) -> dict[str, list[float]]:
    layout = policy.stream_layout()
    assert layout is not None
    pusher = procs.pusher("trainer-0")
    await pusher.start()
    out: dict[str, list[float]] = {"unstreamed_s": [], "streamed_s": []}
    version = 0

    async def produce(sink: VersionSink) -> None:
        await asyncio.to_thread(policy.export_into, sink)

    async def unstreamed(v: int) -> float:
        t0 = time.perf_counter()
        weights = await asyncio.to_thread(policy.export)
        digest = asyncio.ensure_future(asyncio.to_thread(weights_digest, list(weights.items())))
        await pusher.push(v, weights)
        await digest
        return time.perf_counter() - t0

    async def streamed(v: int) -> float:
        t0 = time.perf_counter()
        await pusher.push_stream(v, layout, produce, digest=True)
        return time.perf_counter() - t0

    try:
        for r in range(repeats + 1):  # the first round warms the slots and page tables
            order = [("unstreamed_s", unstreamed), ("streamed_s", streamed)]
            for key, run in order if r % 2 else order[::-1]:
                version += 1
                took = await run(version)
                if r:
                    out[key].append(took)
    finally:
        await pusher.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.repeats = 256, 4, 3
    from laminar.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="lam-wstream-") as tmp:
        root = Path(tmp)
        shape = {"hidden": args.hidden, "layers": args.layers, "heads": 8, "kv_heads": 4}
        model = str(build_tiny_model(root / "model", **shape))
        cfg = make_cfg(model, root / "run")
        cfg.model.dtype = "bfloat16"
        policy = TorchTrainer(trainer_settings(cfg), model)
        layout = policy.stream_layout()
        assert layout is not None
        overrides = {"relay.max_slots": 3, "transport.request_timeout_s": 60.0}
        procs = RelayProcs(root / "relay", 1, overrides).start()
        try:

            async def run() -> dict[str, list[float]]:
                await procs.wait_ready(60)
                try:
                    return await measure(policy, procs, args.repeats)
                finally:
                    await procs.close_clients()

            raw = asyncio.run(run())
        finally:
            procs.stop()
    figures = {k: stats(v) for k, v in raw.items()}
    ratio = figures["streamed_s"]["median"] / figures["unstreamed_s"]["median"]
    result: dict[str, Any] = {
        "bench": "weights_stream",
        **git_state(),
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
        "config": {**shape, "repeats": args.repeats, "version_bytes": layout.total_bytes},
        "figures": figures,
        "raw": raw,
        "summary": {"streamed_vs_unstreamed": ratio},
    }
    print(f"version: {layout.total_bytes / 2**20:.1f} MiB bf16 ({len(layout.names)} tensors)")
    print(f"{'path':<14}{'min':>9}{'median':>9}{'max':>9}   (trainer stall per version, s)")
    for key, f in figures.items():
        print(f"{key:<14}{f['min']:>9.3f}{f['median']:>9.3f}{f['max']:>9.3f}")
    print(f"streamed / unstreamed (median): {ratio:.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
