"""The stages of the GPU check (bench/gpu/check.sh runs each under its own time limit).

    python bench/gpu/stages.py STAGE --out DIR [--dry-run]

Stages (one JSON each in DIR, written even when the stage fails: `ok`, `error`, `seconds`):
  env      GPU, driver, torch / CUDA / NCCL versions
  weights  CUDA IPC handoff against a device-to-device copy of the same bytes, several sizes (the
           handoff counts what a rollout does before it can serve: map the handle, lease it, copy
           into its engine's parameters, release); then the two-reader lifetime probe (a reader
           killed while holding its lease, another holding: never freed under a reader, freed
           after the lease). summary.cuda_ipc_vs_d2d_copy = d2d seconds / handoff seconds
  engine   the torch engine against HF generate on a long-tailed batch, a random-weight
           Qwen2-shaped model (bench/gpu/qwen2_0.5b.json, ~0.5B) in bf16
  trainer  one bf16 optimizer step of that model (HF forward/backward + AdamW: the raw cost the
           trainer's step is built on; the trainer's own scale figures are another issue's)
  run      `laminar run` on one GPU (trainer, relay, two torch rollouts, a tiny model), 20 steps
           with rollout.weights=cuda_ipc, then with relay: trainer stall and rollout wait per
           version
  colocate colocated placement (docs/colocated.md): the torch engine's sleep / wake and the
           trainer state's offload / onload (params, grads, AdamW) on the Qwen2-shaped model in
           bf16 (bytes, seconds, device memory allocated awake / asleep), then a colocated
           `laminar run` (trainer + one torch rollout on one GPU, mode sync, cuda_ipc, 10 steps):
           sleep, wake and handoff per step from its metrics.jsonl (colocate/*)
--dry-run: the same code on CPU at tiny sizes (CUDA IPC -> the lease logic and a host copy; nccl
on gloo instead of cuda_ipc in `run`), so the check cannot rot (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _cuda(dry: bool) -> bool:
    import torch

    return not dry and torch.cuda.is_available()


def stage_env(dry: bool) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "host": platform.node(),
    }
    if torch.cuda.is_available():
        out["gpus"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "uuid": str(torch.cuda.get_device_properties(i).uuid),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
            }
            for i in range(torch.cuda.device_count())
        ]
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out["nccl"] = f"unknown ({exc})"
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            out["driver"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["driver"] = f"unknown ({exc})"
    return out


# ---- weights: CUDA IPC handoff vs a device-to-device copy --------------------------------------


def _ipc_reader(frames: list[bytes], port: int, sizes: list[int], q: Any) -> None:
    """Another process on the host: map, lease, copy into 'engine parameters', release."""
    import datetime

    import torch
    import torch.distributed as dist

    from laminar.transport.codec import decode
    from laminar.weights.cuda_ipc import open_cuda_ipc
    from laminar.weights.leases import LeaseBoard, StoreKV

    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    board = LeaseBoard(StoreKV(store))
    torch.cuda.init()
    params = {n: torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for raw in frames:
        msg = decode([raw[:1], raw[1:]])
        n = msg.layout.total_bytes
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        w = open_cuda_ipc(msg, board, reader="probe")
        assert w is not None
        (_name, t), *_ = list(w.named_tensors())
        params[n].copy_(t.reshape(-1).view(torch.uint8))
        torch.cuda.synchronize()
        w.release_now()
        times[n].append(time.perf_counter() - t0)
    q.put(times)


def stage_weights(dry: bool) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from laminar.transport.codec import encode
    from laminar.weights.leases import DictKV, LeaseBoard, StoreKV, VersionBuffers

    cuda = _cuda(dry)
    sizes = [1 << 20, 1 << 24] if dry else [64 << 20, 512 << 20, 2 << 30]
    repeats = 2 if dry else 5
    out: dict[str, Any] = {"cuda": cuda, "sizes": sizes, "repeats": repeats, "results": []}
    dev = "cuda" if cuda else "cpu"
    d2d: dict[int, list[float]] = {}
    for n in sizes:
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        d2d[n] = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            if cuda:
                torch.cuda.synchronize()
            d2d[n].append(time.perf_counter() - t0)
    handoff: dict[int, list[float]] = {}
    if cuda:
        from laminar.weights.cuda_ipc import CudaIpcExporter
        from tests.conftest import free_port

        port = free_port()
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore("127.0.0.1", port, True, wait_for_workers=False, timeout=timeout)
        exp = CudaIpcExporter(LeaseBoard(StoreKV(store)), device="cuda", keep=len(sizes) * repeats)
        frames = []
        v = 0
        for n in sizes:
            src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
            for _ in range(repeats):
                v += 1
                frames.append(b"".join(bytes(f) for f in encode(exp.export(v, {"w": src}))))
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_ipc_reader, args=(frames, port, sizes, q))
        p.start()
        try:
            handoff = {int(k): v for k, v in q.get(timeout=240).items()}
        finally:
            p.join(60)
        exp.close()
    else:  # CPU: the reader's side is a copy out of a shared host buffer
        for n in sizes:
            src = torch.randint(0, 255, (n,), dtype=torch.uint8)
            dst = torch.empty_like(src)
            handoff[n] = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                dst.copy_(src)
                handoff[n].append(time.perf_counter() - t0)
    ratios = []
    for n in sizes:
        a, b = statistics.median(d2d[n]), statistics.median(handoff[n])
        ratios.append(a / b)
        out["results"].append(
            {"bytes": n, "d2d_copy_s": a, "cuda_ipc_handoff_s": b, "ratio": a / b}
        )
    # at the largest size: the handle's map and lease are a fixed cost a small copy cannot hide
    out["summary"] = {"cuda_ipc_vs_d2d_copy": ratios[-1], "ratio_by_size": ratios}
    # two-reader lifetime probe on the lease logic both paths share
    clock = [0.0]
    board = LeaseBoard(DictKV(), lambda: clock[0])
    bufs = VersionBuffers(board, keep=1)
    bufs.add(1, object())
    board.acquire(1, "killed", 5.0)
    board.acquire(1, "holder", 60.0)
    bufs.add(2, object())
    clock[0] = 6.0
    held_while_read = 1 in bufs.held() and not bufs.collect()
    board.release(1, "holder")
    freed_after = bufs.collect() == [1]
    out["lifetime"] = {"held_while_read": held_while_read, "freed_after_leases": freed_after}
    if not (held_while_read and freed_after):
        raise AssertionError(f"lifetime probe failed: {out['lifetime']}")
    return out


# ---- engine and trainer on a Qwen2-shaped random model -----------------------------------------


def _model(dry: bool, dev: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = json.loads((REPO / "bench" / "gpu" / "qwen2_0.5b.json").read_text())
    if dry:
        tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
        tiny |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
        cfg.update(tiny, max_position_embeddings=512, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(Qwen2Config(**cfg), dtype=dtype)
    return model.to(dev).eval()


def stage_engine(dry: bool) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    from engine import make_workload, run_engine  # bench/engine.py

    from laminar.engines.torch_engine import TorchEngine

    dev = "cuda" if _cuda(dry) else "cpu"
    model = _model(dry, dev)
    n, batch, p50 = (4, 2, 4) if dry else (128, 32, 64)
    vocab = model.config.vocab_size
    work = make_workload(n, p50, 8.0, 16 if dry else 1024, vocab, seed=1)

    def hf() -> float:
        t0, useful = time.perf_counter(), sum(t for _, t in work)
        for i in range(0, len(work), batch):
            chunk = work[i : i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=dev)
            pad = torch.tensor([width - len(p) for p, _ in chunk], device=dev)
            mask = (torch.arange(width, device=dev)[None, :] >= pad[:, None]).long()
            longest = max(t for _, t in chunk)
            n_new = {"max_new_tokens": longest, "min_new_tokens": longest}
            with torch.inference_mode():
                model.generate(
                    input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0, **n_new
                )
        if dev == "cuda":
            torch.cuda.synchronize()
        return useful / (time.perf_counter() - t0)

    async def engine_tps() -> float:
        engine = TorchEngine(model, None, max_running=batch, max_model_len=2048)
        await engine.start()
        try:
            await run_engine(engine, work[:batch], "warm")
            return (await run_engine(engine, work, "run"))["tokens_per_s"]
        finally:
            await engine.close()

    hf()  # warm-up
    hf_tps = hf()
    eng_tps = asyncio.run(engine_tps())
    return {
        "device": dev,
        "requests": n,
        "batch": batch,
        "p50": p50,
        "params": sum(p.numel() for p in model.parameters()),
        "hf_generate_tokens_per_s": hf_tps,
        "engine_tokens_per_s": eng_tps,
        "summary": {"engine_vs_hf_generate": eng_tps / hf_tps},
    }


def stage_trainer(dry: bool) -> dict[str, Any]:
    import torch

    dev = "cuda" if _cuda(dry) else "cpu"
    model = _model(dry, dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    b, t = (2, 32) if dry else (8, 1024)
    ids = torch.randint(0, model.config.vocab_size, (b, t), device=dev)
    times = []
    for _ in range(2):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"device": dev, "batch": b, "seq": t, "step_s": times}
    if dev == "cuda":
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    out["summary"] = {"step_s": times[-1], "tokens_per_s": b * t / times[-1]}
    return out


# ---- a short laminar run -------------------------------------------------------------------------


def _laminar_run(
    tmp: Path, weights: str, steps: int, dev: str, timeout: float, colocated: bool = False
) -> dict[str, Any]:
    """`laminar run` of a tiny model; colocated: the trainer and one rollout time-share the
    device (mode sync, no relay), else trainer, relay, two rollouts."""
    import random

    import yaml

    from laminar.models.tiny import build_tiny_model
    from laminar.tasks import countup
    from tests.conftest import free_port

    shape = {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 1, "max_positions": 128}
    model = build_tiny_model(tmp / "model", alphabet=countup.ALPHABET, **shape)
    rng = random.Random(0)
    data = tmp / "train.jsonl"
    with data.open("w") as f:
        for _ in range(2000):
            p = countup.make_prompt(rng.randint(0, 9), rng.randint(1, 3), 30)
            f.write(json.dumps({"prompt": p, "answer": countup.answer_of(p)}) + "\n")
    run_dir = tmp / f"run-{weights}"
    roles = {"manager": 1, "buffer": 1, "relay": 1, "trainer": 1, "rollout": 2}
    if colocated:
        roles |= {"relay": 0, "rollout": 1}
    cfg: dict[str, Any] = {
        "name": f"gpucheck-{weights}",
        "run_dir": str(run_dir),
        "cluster": {
            "transport": "ipc",
            "ipc_dir": f"/tmp/lam-gpucheck-{os.getpid()}-{weights}",
            "base_port": free_port() % 30000 + 20000,
            "roles": roles,
        },
        "logging": {"progress_every_s": 0},
        "model": {"path": str(model), "device": dev},
        "data": {"train": str(data)},
        "reward": {"fn": "laminar.tasks.countup:reward", "workers": 0},
        "rollout": {
            "engine": "torch",
            "group_size": 2,
            "credits": 2,
            "max_running": 16,
            "sampling": {"max_tokens": 16},
            "weights": weights,
            "weights_group": {"bound_s": 5.0, "beat_s": 0.2},
        },
        "trainer": {"engine": "torch", "total_steps": steps, "batch_groups": 2},
    }
    if colocated:
        cfg["mode"] = "sync"
        cfg["cluster"]["placement"] = "colocated"
    path = tmp / f"{weights}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "laminar", "run", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    wall = time.perf_counter() - t0
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stalls = [r["push_s"] for r in rows if "push_s" in r]
    waits = []
    sources: dict[str, int] = {}
    for log in (run_dir / "logs").glob("rollout-*.log"):
        for line in log.read_text().splitlines():
            if '"weights_loaded"' in line:
                e = json.loads(line)
                waits.append(e.get("load_s", 0.0))
                sources[e.get("source", "")] = sources.get(e.get("source", ""), 0) + 1
    res: dict[str, Any] = {
        "weights": weights,
        "rc": proc.returncode,
        "wall_s": wall,
        "steps": len(stalls),
        "trainer_stall_s": _stats(stalls),
        "rollout_load_s": _stats(waits),
        "loads_by_source": sources,
    }
    if colocated:  # the cycle's costs, per step, as the trainer logged them
        cycles = [r for r in rows if "colocate/sleep_s" in r]
        res["cycles"] = len(cycles)
        for k in ("drain_s", "sleep_s", "wake_s", "handoff_s", "acquire_s", "release_s"):
            res[k] = _stats([r[f"colocate/{k}"] for r in cycles])
        for k in ("trainer_offload_s", "trainer_onload_s"):
            res[k] = _stats([r[f"colocate/{k}"] for r in cycles])
    if proc.returncode != 0:
        res["output_tail"] = (proc.stdout + proc.stderr)[-2000:]
    return res


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def stage_run(dry: bool) -> dict[str, Any]:
    import tempfile

    dev = "cuda" if _cuda(dry) else "cpu"
    steps = 5 if dry else 20  # dry: enough versions for the broadcast group to form and carry one
    # CPU has no CUDA IPC: the dry run exercises the other GPU path (nccl, on gloo) instead
    paths = ["nccl", "relay"] if dev == "cpu" else ["cuda_ipc", "relay"]
    if dry:
        paths = paths[:1]
    tmp = Path(tempfile.mkdtemp(prefix="lam-gpucheck-"))
    runs = [_laminar_run(tmp / p, p, steps, dev, 100 if dry else 140) for p in paths]
    bad = [r for r in runs if r["rc"] != 0]
    out = {"device": dev, "runs": runs}
    if bad:
        raise AssertionError(f"laminar run failed: {[r['weights'] for r in bad]}")
    return out


# ---- colocated placement: sleep, wake, handoff ---------------------------------------------


def _allocated(dev: str) -> int:
    import torch

    return torch.cuda.memory_allocated() if dev == "cuda" else 0


def stage_colocate(dry: bool) -> dict[str, Any]:
    """The torch engine's sleep / wake and the trainer state's offload / onload on the
    Qwen2-shaped model (bytes moved, seconds, device memory before / asleep / after), then a
    colocated `laminar run` (cuda_ipc; dir in a dry run): sleep, wake, handoff per step."""
    import tempfile

    import numpy as np
    import torch

    from laminar.engines.base import GenRequest, SamplingParams
    from laminar.engines.torch_engine import TorchEngine
    from laminar.models.offload import HostStash

    dev = "cuda" if _cuda(dry) else "cpu"
    repeats = 2 if dry else 3
    model = _model(dry, dev)

    async def engine_cycles(model: Any) -> dict[str, Any]:
        engine = TorchEngine(model, None, max_running=8, max_model_len=2048)
        await engine.start()
        try:
            prompt = np.array([2, 3, 4, 5], np.int32)
            req = GenRequest("w", prompt, SamplingParams(max_tokens=8), n=2)
            async for _ in engine.generate(req):
                pass
            before = _allocated(dev)
            rows = []
            for _ in range(repeats):
                slept = await engine.sleep()
                asleep = _allocated(dev)
                woke = await engine.wake_up()
                rows.append((slept, asleep, woke))
            return {
                "weight_bytes": rows[-1][0].weight_bytes,
                "kv_bytes": rows[-1][0].kv_bytes,
                "device_allocated_awake": before,
                "device_allocated_asleep": rows[-1][1],
                "sleep_s": _stats([r[0].seconds for r in rows]),
                "wake_s": _stats([r[2].seconds for r in rows]),
            }
        finally:
            await engine.close()

    eng = asyncio.run(engine_cycles(model))
    # the trainer's state: parameters + gradients and the AdamW state after one step
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), device=dev)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    params = list(model.parameters())
    state = [params, [p.grad for p in params if p.grad is not None]]
    state.append([t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)])
    tensors = [t for group in state for t in group]
    stash = HostStash()
    offs, ons, freed = [], [], 0
    for _ in range(repeats):
        before = _allocated(dev)
        moved = stash.offload(tensors)
        freed = before - _allocated(dev)
        back = stash.restore()
        offs.append(moved.seconds)
        ons.append(back.seconds)
    trainer = {
        "bytes": moved.nbytes,
        "device_freed_bytes": freed,
        "offload_s": _stats(offs),
        "onload_s": _stats(ons),
    }
    del model, opt, tensors, state, params
    if dev == "cuda":
        torch.cuda.empty_cache()
    tmp = Path(tempfile.mkdtemp(prefix="lam-gpucheck-"))
    weights = "dir" if dev == "cpu" else "cuda_ipc"
    run = _laminar_run(tmp, weights, 2 if dry else 10, dev, 80 if dry else 120, colocated=True)
    out = {"device": dev, "engine": eng, "trainer": trainer, "run": run}
    if run["rc"] != 0 or run["cycles"] == 0:
        raise AssertionError(f"colocated laminar run failed (rc {run['rc']})")
    out["summary"] = {
        "engine_sleep_s": eng["sleep_s"]["median"],
        "engine_wake_s": eng["wake_s"]["median"],
        "trainer_offload_s": trainer["offload_s"]["median"],
        "trainer_onload_s": trainer["onload_s"]["median"],
        "run_sleep_s": run["sleep_s"]["median"],
        "run_wake_s": run["wake_s"]["median"],
        "run_handoff_s": run["handoff_s"]["median"],
    }
    return out


def stage_tests(dry: bool) -> dict[str, Any]:
    """The `gpu`-marked tests (collected only in a dry run: there is no GPU to run them on)."""
    import tempfile
    import xml.etree.ElementTree as ET

    junit = Path(tempfile.mkdtemp(prefix="lam-gpucheck-")) / "junit.xml"
    # only the files that hold gpu tests: collecting the whole suite takes half a minute
    files = sorted(
        str(f.relative_to(REPO))
        for f in (REPO / "tests").glob("test_*.py")
        if "pytest.mark.gpu" in f.read_text()
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *files]
    cmd += ["--collect-only"] if dry else [f"--junitxml={junit}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    out: dict[str, Any] = {"rc": proc.returncode, "output_tail": proc.stdout[-3000:]}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        out["counts"] = {
            k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")
        }
        out["failed"] = [
            f"{c.get('classname')}::{c.get('name')}"
            for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None
        ]
    if proc.returncode not in (0, 5):  # 5: nothing collected
        raise AssertionError(f"pytest -m gpu exited {proc.returncode}")
    return out


STAGES = {
    "env": stage_env,
    "tests": stage_tests,
    "weights": stage_weights,
    "engine": stage_engine,
    "trainer": stage_trainer,
    "run": stage_run,
    "colocate": stage_colocate,
}


class StageTimeout(Exception):
    pass


_FIRED: list[bool] = []


def _alarm(signum: int, frame: Any) -> None:
    _FIRED.append(True)  # a library may wrap the exception (transformers' lazy imports do)
    raise StageTimeout("past the stage's time limit")


def run_stage(name: str, dry: bool, out: Path, limit_s: int = 0) -> bool:
    """One stage; its JSON is written whatever happens (a limit_s > 0 is enforced here)."""
    import signal

    t0 = time.perf_counter()
    result: dict[str, Any] = {"stage": name, "dry_run": dry, "limit_s": limit_s}
    _FIRED.clear()
    if limit_s:
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(limit_s)
    try:
        result.update(STAGES[name](dry))
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - the JSON says what failed; the rc says that it did
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"
        if _FIRED:
            result["error"] = f"StageTimeout: past the stage's limit of {limit_s} s ({exc!r})"
        result["traceback"] = traceback.format_exc()[-4000:]
    finally:
        if limit_s:
            signal.alarm(0)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    print(
        f"{name}: {'ok' if result['ok'] else 'FAILED ' + result['error']} ({result['seconds']} s)"
    )
    return bool(result["ok"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stages", nargs="+", help=f"of {sorted(STAGES)}; NAME=SECONDS sets a limit")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ok = True
    for spec in args.stages:
        name, _, limit = spec.partition("=")
        if name not in STAGES:
            ap.error(f"unknown stage {name!r}; use one of {sorted(STAGES)}")
        ok = run_stage(name, args.dry_run, out, int(limit or 0)) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
