"""LoRA (model.lora): what a version weighs, and what serving one costs the torch engine.

    .venv/bin/python bench/lora.py --quick --out /tmp/lora.json     # ~1 min on 2 cores
    .venv/bin/python bench/lora.py --out bench/results/lora.json

Bytes per version: the adapter's bytes, the flat aligned buffer the relay tier moves
(weights/layout.py), and the full model's, for the demo policy's shape (float32 rollouts) and a
Qwen2.5-7B-shaped model built on the meta device (bfloat16), rank 16 on every projection.

Serving: why the torch engine merges each version into a pristine copy of the base instead of
running the adapter unmerged. Decode steps of one engine with B sequences decoding at once (equal
lengths, EOS ignored), per variant, alternating within each repeat, CPU seconds and wall seconds
per step:
  lean_base    the lean forward, no adapter (the floor)
  lean_merged  the lean forward on merged weights: what the engine runs with model.lora
  hf_merged    HF's forward on merged weights
  hf_unmerged  HF's forward with peft's LoRA layers (x W^T + s B A x per projection); the lean
               forward has no unmerged form: it reads the weights, so it needs them merged
Merged costs nothing per step; its price is the merge at each load (the `merge_s` figures: one
B @ A per target and the fused-weight rebuild) and a copy of the target weights (the pristine
base: `pristine_mib`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from engine import machine, stats  # noqa: E402

from laminar.config import DemoModelConfig, LoraConfig  # noqa: E402
from laminar.engines.base import GenRequest, SamplingParams  # noqa: E402
from laminar.engines.torch_engine import TorchEngine  # noqa: E402
from laminar.models import lora as lo  # noqa: E402
from laminar.models.decoder_lm import load_model  # noqa: E402
from laminar.models.tiny import build_tiny_model, load_causal_lm  # noqa: E402
from laminar.weights.layout import layout_of, named_list  # noqa: E402

LORA = LoraConfig(rank=16, alpha=32)


def version_of(model_path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A trained-looking adapter version (A and B random, B non-zero)."""
    model = load_model(model_path)
    lo.add_adapters(model, LORA)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if lo.is_adapter_name(n):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return lo.adapter_state(model)


def sizes(model: torch.nn.Module, version: dict[str, torch.Tensor]) -> dict[str, Any]:
    adapter = sum(v.numel() * v.element_size() for v in version.values())
    shipped = layout_of(named_list(version)).total_bytes
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "adapter_bytes": adapter,
        "version_bytes": shipped,
        "version_over_adapter": round(shipped / adapter, 5),
        "full_bytes": full,
        "version_over_full": round(shipped / full, 5),
    }


def qwen7b_sizes() -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tests.test_lora import qwen25_7b_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            Qwen2Config(**qwen25_7b_config()), dtype=torch.bfloat16
        )
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    lo.add_adapters(model, LORA)
    version = {k: v.to(torch.bfloat16) for k, v in lo.adapter_state(model).items()}
    out = sizes(model, version)
    out["full_bytes"] = full  # the base alone (the adapters are now among its parameters)
    out["version_over_full"] = round(out["version_bytes"] / full, 5)
    return out


def engine_for(variant: str, path: Path, version: dict[str, torch.Tensor], b: int) -> TorchEngine:
    kw: dict[str, Any] = dict(max_running=b, max_model_len=320)
    if variant == "hf_unmerged":
        model = load_causal_lm(path)
        lo.add_adapters(model, LORA)
        lo.load_adapter_state(model, version)
        return TorchEngine(model.eval(), None, forward="hf", **kw)
    model = load_model(path) if variant.startswith("lean") else load_causal_lm(path)
    forward = "lean" if variant.startswith("lean") else "hf"
    return TorchEngine(
        model, None, forward=forward, lora=None if variant == "lean_base" else LORA, **kw
    )


async def decode(eng: TorchEngine, version: dict[str, torch.Tensor], b: int, n: int) -> dict:
    await eng.start()
    try:
        if eng.adapter is not None:
            await eng.load_weights(version.items(), 1)
        sp = SamplingParams(max_tokens=n, ignore_eos=True, seed=0)
        prompt = np.arange(5, 25)
        await eng.generate_all(GenRequest("warm", prompt, SamplingParams(max_tokens=4)), 600)
        s0, c0, t0 = eng.steps, time.process_time(), time.perf_counter()
        await eng.generate_all(GenRequest("r", prompt, sp, n=b), 600)
        steps = eng.steps - s0
        return {
            "cpu_ms_per_step": 1e3 * (time.process_time() - c0) / steps,
            "wall_ms_per_step": 1e3 * (time.perf_counter() - t0) / steps,
        }
    finally:
        await eng.close()


def merge_cost(path: Path, version: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    eng = TorchEngine(load_model(path), None, forward="lean", lora=LORA, max_running=1)
    assert eng.adapter is not None and eng.lean is not None
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        eng._copy_weights(list(version.items()))  # the load's compute: merge + fused rebuild
        times.append(time.perf_counter() - t)
    pristine = sum(w.numel() * w.element_size() for w in eng.adapter.pristine.values())
    return {"merge_s": stats(times), "pristine_mib": round(pristine / 2**20, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats, 32 tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="sequences decoding at once")
    ap.add_argument("--tokens", type=int, default=96, help="tokens per sequence")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.tokens = 2, 32
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="lam-bench-lora-"))
    d = DemoModelConfig()
    path = build_tiny_model(
        tmp / "demo", hidden=d.hidden, layers=d.layers, heads=d.heads, kv_heads=d.kv_heads
    )
    version = version_of(path)
    result: dict[str, Any] = {
        "config": {**vars(args), "lora": LORA.model_dump(), "model": d.model_dump()},
        "machine": machine(),
        "bytes": {"demo_fp32": sizes(load_model(path), version), "qwen2.5_7b_bf16": qwen7b_sizes()},
    }
    variants = ["lean_base", "lean_merged", "hf_merged", "hf_unmerged"]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        for v in variants if rep % 2 == 0 else variants[::-1]:
            eng = engine_for(v, path, version, args.batch)
            runs[v].append(asyncio.run(decode(eng, version, args.batch, args.tokens)))
            print(f"  repeat {rep} {v:<12} {runs[v][-1]['cpu_ms_per_step']:.3f} CPU-ms/step")
    step = {
        v: {k: stats([r[k] for r in rs]) for k in ("cpu_ms_per_step", "wall_ms_per_step")}
        for v, rs in runs.items()
    }
    cpu = {v: step[v]["cpu_ms_per_step"]["median"] for v in variants}
    result["decode_step"] = step
    result["merge"] = merge_cost(path, version, max(3, args.repeats))
    result["summary"] = {
        "lean_merged_over_base": round(cpu["lean_merged"] / cpu["lean_base"], 3),
        "hf_unmerged_over_hf_merged": round(cpu["hf_unmerged"] / cpu["hf_merged"], 3),
        "hf_unmerged_over_lean_merged": round(cpu["hf_unmerged"] / cpu["lean_merged"], 3),
        "merge_ms": round(1e3 * result["merge"]["merge_s"]["median"], 2),
    }
    print(f"\n{'bytes per version':<22}{'adapter':>12}{'version':>12}{'full':>14}{'share':>8}")
    for name, b in result["bytes"].items():
        print(
            f"{name:<22}{b['adapter_bytes'] / 2**20:>10.2f}Mi{b['version_bytes'] / 2**20:>10.2f}Mi"
            f"{b['full_bytes'] / 2**20:>12.1f}Mi{b['version_over_full']:>8.2%}"
        )
    print(f"\n{'decode step (B=' + str(args.batch) + ')':<22}{'CPU-ms':>10}{'vs lean_merged':>16}")
    for v in variants:
        print(f"{v:<22}{cpu[v]:>10.3f}{cpu[v] / cpu['lean_merged']:>15.2f}x")
    print(f"merge at each load: {result['summary']['merge_ms']} ms (demo model)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
