"""Colocated placement's costs on CPU (docs/colocated.md): what the torch engine's sleep / wake and
the torch trainer's offload / onload move, and how long they take, next to a plain copy of the
same bytes; then the sleep / wake / handoff of a short colocated run, from its metrics.jsonl.

    .venv/bin/python bench/colocate.py --out bench/results/colocate.json
    .venv/bin/python bench/colocate.py --quick --out F        # 2 repeats, 2-step run (a smoke)

    tiny model (small / medium) ─► TorchEngine: generate once (KV pool, fused copies up)
        repeat: sleep()  -> SleepStats(seconds, weight_bytes, kv_bytes), device_bytes() asleep
                wake_up() -> SleepStats
    the same model ─► TorchTrainer: one AdamW step (its state exists)
        repeat: offload(params, optimizer) -> Moved(nbytes, seconds); onload() -> Moved
    baseline, same run: one contiguous tensor of the moved bytes copied into a buffer allocated
        beforehand (memory bandwidth alone: no allocation, no per-tensor work); ratio = offload
        seconds / copy seconds
    LocalCluster (inproc, gloo, placement=colocated, mode sync): colocate/sleep_s, wake_s,
        handoff_s, drain_s, acquire_s, release_s per step

On CPU the "host" copy is a second CPU buffer (models/offload.py), so the seconds are those of a
real memory copy plus the per-tensor work; on a GPU the same code pins host memory and crosses
PCIe (bench/gpu/check.sh's colocate stage). Each figure: min / median / max over repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchinfo import git_state  # noqa: E402 - bench/ is the script's folder

SHAPES: dict[str, dict[str, int]] = {
    "small": {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 1, "max_positions": 256},
    "medium": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2, "max_positions": 512},
}


def _stats(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def _copy_s(nbytes: int, repeats: int) -> list[float]:
    """The baseline: the same bytes as one contiguous float32 tensor copied into a buffer
    allocated (and touched) beforehand: memory bandwidth alone, no allocation."""
    import torch

    src = torch.rand(max(1, nbytes // 4))
    dst = torch.zeros_like(src)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(time.perf_counter() - t0)
    return out


def _build(root: Path, name: str) -> Path:
    from laminar.models.tiny import build_tiny_model
    from laminar.tasks import countup

    return build_tiny_model(root / name, alphabet=countup.ALPHABET, **SHAPES[name])


async def engine_cycle(model: Path, repeats: int) -> dict[str, Any]:
    import numpy as np

    from laminar.config import LaminarConfig
    from laminar.engines.base import GenRequest, SamplingParams
    from laminar.engines.factory import make_engine
    from laminar.engines.torch_engine import TorchEngine

    cfg = LaminarConfig()
    cfg.model.path = str(model)
    cfg.rollout.max_running = 8
    eng = make_engine(cfg.rollout, cfg.model)
    assert isinstance(eng, TorchEngine)
    await eng.start()
    try:
        req = GenRequest("w", np.array([3, 4, 5], np.int32), SamplingParams(max_tokens=8), n=2)
        async for _ in eng.generate(req):
            pass
        awake = eng.device_bytes()
        sleeps, wakes = [], []
        asleep: dict[str, int] = {}
        slept = woke = None
        for _ in range(repeats):
            slept = await eng.sleep()
            asleep = eng.device_bytes()
            woke = await eng.wake_up()
            sleeps.append(slept.seconds)
            wakes.append(woke.seconds)
        assert slept is not None and woke is not None
        return {
            "device_bytes_awake": awake,
            "device_bytes_asleep": asleep,
            "weight_bytes": slept.weight_bytes,
            "kv_bytes_freed": slept.kv_bytes,
            "sleep_s": _stats(sleeps),
            "wake_s": _stats(wakes),
        }
    finally:
        await eng.close()


def trainer_cycle(model: Path, repeats: int) -> dict[str, Any]:
    import torch

    from laminar.config import LaminarConfig
    from laminar.trainer.torch_trainer import TorchTrainer
    from laminar.wiring.trainer import trainer_settings

    cfg = LaminarConfig()
    cfg.model.path = str(model)
    tr = TorchTrainer(trainer_settings(cfg), str(model))
    params = [p for p in tr.model.module.parameters() if p.requires_grad]
    for p in params:  # one AdamW step: its exp_avg / exp_avg_sq exist, as after a real step
        p.grad = torch.zeros_like(p)
    tr.optimizer.step()
    offs, ons = [], []
    moved = None
    for _ in range(repeats):
        moved = tr.offload(True, True)
        back = tr.onload()
        assert back.nbytes == moved.nbytes
        offs.append(moved.seconds)
        ons.append(back.seconds)
    assert moved is not None
    return {
        "params": sum(p.numel() for p in params),
        "bytes": moved.nbytes,
        "tensors": moved.tensors,
        "offload_s": _stats(offs),
        "onload_s": _stats(ons),
    }


async def colocated_run(root: Path, model: Path, steps: int) -> dict[str, Any]:
    """A short colocated run in this process (tests/test_colocate_run.py's setup)."""
    from laminar.cluster import LocalCluster
    from laminar.config import config_from_dict
    from laminar.tasks import countup

    data = root / "train.jsonl"
    prompts = [countup.make_prompt(i % 7, 1 + i % 3, 30) for i in range(64)]
    data.write_text(
        "".join(json.dumps({"prompt": p, "answer": countup.answer_of(p)}) + "\n" for p in prompts)
    )
    cfg = config_from_dict(
        {
            "name": "bench-colocate",
            "mode": "sync",
            "run_dir": str(root / "run"),
            "cluster": {
                "transport": "inproc",
                "placement": "colocated",
                "roles": {"manager": 1, "buffer": 1, "trainer": 1, "rollout": 1, "relay": 0},
            },
            "logging": {"progress_every_s": 0},
            "model": {"path": str(model)},
            "data": {"train": str(data)},
            "reward": {"fn": "laminar.tasks.countup:reward", "workers": 0},
            "rollout": {
                "engine": "torch",
                "group_size": 2,
                "credits": 2,
                "max_running": 8,
                "weights": "dir",
                "sampling": {"max_tokens": 12},
            },
            "trainer": {"engine": "torch", "total_steps": steps, "batch_groups": 2},
        }
    )
    t0 = time.perf_counter()
    async with LocalCluster(cfg) as cluster:
        await cluster.wait_trainer(600)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "colocate/sleep_s" in r]
    keys = ("drain_s", "sleep_s", "wake_s", "handoff_s", "acquire_s", "release_s")
    out: dict[str, Any] = {"steps": len(rows), "wall_s": wall}
    for k in keys:
        out[k] = _stats([r[f"colocate/{k}"] for r in rows])
    out["trainer_offload_s"] = _stats([r["colocate/trainer_offload_s"] for r in rows])
    out["trainer_onload_s"] = _stats([r["colocate/trainer_onload_s"] for r in rows])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/colocate.json")
    ap.add_argument("--quick", action="store_true", help="2 repeats, a 2-step run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="steps of the colocated run (0: none)")
    args = ap.parse_args()
    repeats, steps = (2, 2) if args.quick else (args.repeats, args.steps)
    import torch

    torch.set_num_threads(1)  # the cores are shared: one thread, as the demo's nodes run
    t_start, load_start = time.time(), os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="lam-colocate-"))
    models: dict[str, Any] = {}
    for name in SHAPES:
        path = _build(root, name)
        eng = asyncio.run(engine_cycle(path, repeats))
        tr = trainer_cycle(path, repeats)
        eng_copy = _stats(_copy_s(eng["weight_bytes"], repeats))
        tr_copy = _stats(_copy_s(tr["bytes"], repeats))
        models[name] = {
            "shape": SHAPES[name],
            "engine": {**eng, "copy_s": eng_copy},
            "trainer": {**tr, "copy_s": tr_copy},
            "summary": {
                "engine_sleep_vs_copy": eng["sleep_s"]["median"] / eng_copy["median"],
                "trainer_offload_vs_copy": tr["offload_s"]["median"] / tr_copy["median"],
            },
        }
    run = asyncio.run(colocated_run(root, root / "small", steps)) if steps else None
    result = {
        "bench": "colocate",
        "config": {"repeats": repeats, "steps": steps, "threads": 1},
        "machine": {
            "host": platform.node(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "load_avg_start": load_start,
        },
        **git_state(),
        "models": models,
        "run": run,
    }
    result["machine"]["load_avg_end"] = os.getloadavg()
    result["wall_s"] = time.time() - t_start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    _table(result)
    print(f"wrote {out}")
    return 0


def _table(r: dict[str, Any]) -> None:
    print(f"{'model':8} {'what':22} {'MiB':>9} {'median s':>9} {'GB/s':>7} {'vs copy':>8}")
    for name, m in r["models"].items():
        e, t = m["engine"], m["trainer"]
        rows = [
            ("engine sleep", e["weight_bytes"], e["sleep_s"], e["copy_s"]),
            ("engine wake", e["weight_bytes"], e["wake_s"], e["copy_s"]),
            ("trainer offload", t["bytes"], t["offload_s"], t["copy_s"]),
            ("trainer onload", t["bytes"], t["onload_s"], t["copy_s"]),
        ]
        for what, nbytes, s, copy in rows:
            med = s["median"]
            print(
                f"{name:8} {what:22} {nbytes / 2**20:9.2f} {med:9.5f} "
                f"{nbytes / med / 1e9 if med else float('nan'):7.2f} {med / copy['median']:8.2f}"
            )
        print(
            f"{name:8} {'engine KV freed':22} {e['kv_bytes_freed'] / 2**20:9.2f}   asleep on "
            f"device: {e['device_bytes_asleep']}"
        )
    run = r["run"]
    if run:
        cells = ", ".join(
            f"{k} {run[k]['median']:.4f}"
            for k in ("drain_s", "sleep_s", "wake_s", "handoff_s", "acquire_s", "release_s")
        )
        print(f"colocated run, {run['steps']} steps (median s): {cells}")


if __name__ == "__main__":
    sys.exit(main())
