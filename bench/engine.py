"""Torch engine (continuous batching) vs HF `generate` (static batches): useful tokens/s, same run;
and the engine's lean forward vs the same engine on the HF model's forward.

    requests (prompt, target length) ──► TorchEngine(max_running=B): all at t=0, slots refill
                                     └─► HF generate: consecutive batches of B, left-padded

Workload (stated in the JSON): N requests, prompts of 16-48 random tokens, target
response lengths lognormal (median `p50`, p99 = `tail` x p50, clipped to
[4, max_len]) — the long tail of RL rollouts. Both sides decode greedily with EOS
disabled, so each request produces exactly its target length:
  * engine: max_tokens = target, ignore_eos; at most B sequences decode at once,
    a finished one's slot is refilled at the next step;
  * HF generate: batches of B requests in order, max_new_tokens = min_new_tokens =
    the longest target of the batch (a static batch runs until its longest member
    is done; shorter members' extra tokens are padding work, not counted).
Throughput = useful tokens (sum of targets) / wall time. A second workload with
equal lengths (no tail) isolates the per-step cost: there HF wastes nothing.
HF runs with attn_implementation="sdpa" and its default DynamicCache; the engine
also computes every token's logprob (HF does not). Same model weights, same
process, alternating within each repeat. Also reported: the same ratio per
CPU-second of the process (useful tokens / process CPU time), which shared,
loaded machines distort much less than wall time.

    .venv/bin/python bench/engine.py --quick --out bench/results/engine.json   # < 5 min on 2 cores
    .venv/bin/python bench/engine.py --out bench/results/engine.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchinfo, also when loaded as a module

import numpy as np  # noqa: E402
import torch  # noqa: E402
from benchinfo import git_state  # noqa: E402

from laminar.engines.base import GenRequest, SamplingParams  # noqa: E402
from laminar.engines.torch_engine import TorchEngine  # noqa: E402
from laminar.models.tiny import build_tiny_model, load_causal_lm  # noqa: E402

MODEL = dict(hidden=256, layers=4, heads=4, kv_heads=2, max_positions=1024)


def make_workload(
    n: int, p50: float, tail: float, max_len: int, vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    sigma = math.log(tail) / 2.3263478740408408 if tail > 1 else 0.0
    out = []
    for _ in range(n):
        prompt = rng.integers(4, vocab, int(rng.integers(16, 49))).tolist()
        target = int(np.clip(round(p50 * math.exp(sigma * rng.standard_normal())), 4, max_len))
        out.append((prompt, target))
    return out


def run_hf(model: Any, work: list[tuple[list[int], int]], batch: int) -> dict[str, float]:
    t0, c0, computed = time.perf_counter(), time.process_time(), 0
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = (
            torch.arange(width)[None, :]
            >= torch.tensor([width - len(p) for p, _ in chunk])[:, None]
        ).long()
        longest = max(t for _, t in chunk)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + longest
        computed += longest * len(chunk)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    useful = sum(t for _, t in work)
    return {
        "wall_s": wall,
        "tokens_per_s": useful / wall,
        "tokens_per_cpu_s": useful / cpu,
        "computed_tokens": computed,
        "useful_tokens": useful,
    }


async def run_engine(
    engine: TorchEngine, work: list[tuple[list[int], int]], tag: str
) -> dict[str, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    steps0 = engine.steps
    reqs = [
        GenRequest(
            f"{tag}-{i}",
            np.array(p, np.int32),
            SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True),
            single=True,
        )
        for i, (p, t) in enumerate(work)
    ]
    results = await asyncio.gather(*(engine.generate_all(r, timeout=600) for r in reqs))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for (_, target), res in zip(work, results, strict=True):
        ((ids, _lps, reason),) = res.values()
        assert len(ids) == target and reason == "length", (len(ids), target, reason)
    useful = sum(t for _, t in work)
    return {
        "wall_s": wall,
        "tokens_per_s": useful / wall,
        "tokens_per_cpu_s": useful / cpu,
        "steps": engine.steps - steps0,
        "useful_tokens": useful,
    }


def stats(xs: list[float]) -> dict[str, float]:
    return {
        "min": round(min(xs), 3),
        "median": round(statistics.median(xs), 3),
        "max": round(max(xs), 3),
    }


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": __import__("transformers").__version__,
        **git_state(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="lam-bench-engine-"))
    path = build_tiny_model(tmp / "model", seed=0, **MODEL)
    hf = load_causal_lm(path)
    hf.set_attn_implementation("sdpa")
    # the engine on its lean forward, and the same engine stepping the HF model's own forward (slot
    # attention plugged in): what the lean forward saves
    engine, engine_hf = (
        TorchEngine(
            load_causal_lm(path),
            None,
            max_running=args.batch,
            max_model_len=MODEL["max_positions"],
            forward=fwd,
        )
        for fwd in ("lean", "hf")
    )
    await engine.start()
    await engine_hf.start()
    vocab = hf.config.vocab_size
    workloads = {
        "longtail": make_workload(args.requests, args.p50, args.tail, args.max_len, vocab, seed=1),
        "uniform": make_workload(args.requests, args.p50, 1.0, args.max_len, vocab, seed=2),
    }
    # warm-up both paths (allocator, first-call overheads)
    warm = make_workload(args.batch, 8, 1.0, 8, vocab, seed=3)
    run_hf(hf, warm, args.batch)
    await run_engine(engine, warm, "warm")
    await run_engine(engine_hf, warm, "warm")
    rows: dict[str, dict[str, list[float]]] = {
        w: {
            "hf": [],
            "engine": [],
            "ratio": [],
            "cpu_ratio": [],
            "engine_hf": [],
            "lean_ratio": [],
            "lean_cpu_ratio": [],
        }
        for w in workloads
    }
    extra: dict[str, dict[str, Any]] = {}
    for rep in range(args.repeats):
        for name, work in workloads.items():
            h = run_hf(hf, work, args.batch)
            e = await run_engine(engine, work, f"{name}{rep}")
            eh = await run_engine(engine_hf, work, f"{name}{rep}")
            rows[name]["engine_hf"].append(eh["tokens_per_s"])
            rows[name]["lean_ratio"].append(e["tokens_per_s"] / eh["tokens_per_s"])
            rows[name]["lean_cpu_ratio"].append(e["tokens_per_cpu_s"] / eh["tokens_per_cpu_s"])
            rows[name]["hf"].append(h["tokens_per_s"])
            rows[name]["engine"].append(e["tokens_per_s"])
            rows[name]["ratio"].append(e["tokens_per_s"] / h["tokens_per_s"])
            rows[name]["cpu_ratio"].append(e["tokens_per_cpu_s"] / h["tokens_per_cpu_s"])
            extra[name] = {
                "useful_tokens": h["useful_tokens"],
                "hf_computed_tokens": h["computed_tokens"],
                "hf_padding_waste": round(1 - h["useful_tokens"] / h["computed_tokens"], 3),
                "engine_steps": e["steps"],
            }
            print(
                f"  repeat {rep} {name:<9} hf {h['tokens_per_s']:8.1f} tok/s  engine "
                f"{e['tokens_per_s']:8.1f} tok/s  ratio {rows[name]['ratio'][-1]:.2f} (per "
                f"CPU-second {rows[name]['cpu_ratio'][-1]:.2f})  | engine on HF's forward "
                f"{eh['tokens_per_s']:8.1f} tok/s, lean / HF forward "
                f"{rows[name]['lean_ratio'][-1]:.2f}",
                flush=True,
            )
    await engine.close()
    await engine_hf.close()
    lengths = [t for _, t in workloads["longtail"]]
    summary = {
        "torch_engine_vs_hf_generate": round(statistics.median(rows["longtail"]["ratio"]), 3),
        "torch_engine_vs_hf_generate_uniform_lengths": round(
            statistics.median(rows["uniform"]["ratio"]), 3
        ),
        "torch_engine_vs_hf_generate_per_cpu_s": round(
            statistics.median(rows["longtail"]["cpu_ratio"]), 3
        ),
        "torch_engine_vs_hf_generate_uniform_per_cpu_s": round(
            statistics.median(rows["uniform"]["cpu_ratio"]), 3
        ),
        "engine_tokens_per_s_longtail": round(statistics.median(rows["longtail"]["engine"]), 1),
        "hf_tokens_per_s_longtail": round(statistics.median(rows["longtail"]["hf"]), 1),
        "engine_tokens_per_s_uniform": round(statistics.median(rows["uniform"]["engine"]), 1),
        "hf_tokens_per_s_uniform": round(statistics.median(rows["uniform"]["hf"]), 1),
        "hf_padding_waste_longtail": extra["longtail"]["hf_padding_waste"],
        "lean_forward_vs_hf_forward": round(statistics.median(rows["longtail"]["lean_ratio"]), 3),
        "lean_forward_vs_hf_forward_per_cpu_s": round(
            statistics.median(rows["longtail"]["lean_cpu_ratio"]), 3
        ),
        "lean_forward_vs_hf_forward_uniform": round(
            statistics.median(rows["uniform"]["lean_ratio"]), 3
        ),
    }
    return {
        "benchmark": "engine",
        "config": {
            "quick": args.quick,
            "repeats": args.repeats,
            "model": MODEL,
            "vocab": vocab,
            "dtype": "float32",
            "batch_B": args.batch,
            "requests": args.requests,
            "length_p50": args.p50,
            "length_p99_over_p50": args.tail,
            "max_len": args.max_len,
            "prompt_tokens": "uniform 16-48",
            "decoding": (
                "greedy, EOS disabled (engine ignore_eos; HF min_new_tokens=max_new_tokens)"
            ),
            "workload": "all N requests available at t=0; engine: continuous batching with <= B "
            "running, slots refilled as sequences finish; HF generate: consecutive static batches "
            "of B, left-padded, each runs to its longest target; throughput counts useful tokens "
            "only",
            "hf": "model.generate, attn sdpa, DynamicCache",
            "engine": "TorchEngine (paged KV cache, packed steps, computes logprobs), lean forward",
            "engine_hf": "the same engine on the HF model's forward",
            "longtail_lengths": {
                "p50": float(np.percentile(lengths, 50)),
                "p99": float(np.percentile(lengths, 99)),
                "max": max(lengths),
                "sum": sum(lengths),
            },
        },
        "machine": None,
        "summary": summary,
        "results": [
            {
                "workload": w,
                "hf_tokens_per_s": stats(r["hf"]),
                "engine_tokens_per_s": stats(r["engine"]),
                "ratio": stats(r["ratio"]),
                "ratio_per_cpu_s": stats(r["cpu_ratio"]),
                "engine_hf_forward_tokens_per_s": stats(r["engine_hf"]),
                "lean_vs_hf_forward": stats(r["lean_ratio"]),
                "lean_vs_hf_forward_per_cpu_s": stats(r["lean_cpu_ratio"]),
                **extra[w],
            }
            for w, r in rows.items()
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="fewer requests and repeats (< 5 min on 2 cores)"
    )
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16, help="B: engine max_running = HF batch size")
    ap.add_argument("--p50", type=float, default=48)
    ap.add_argument("--tail", type=float, default=8.0, help="p99 / p50 of the long-tail workload")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both sides (1: stable on a shared 2-core box)",
    )
    ap.add_argument("--out", default=None, help="write JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.requests = args.requests or (48 if args.quick else 96)
    args.repeats = args.repeats or (2 if args.quick else 3)
    t0 = time.perf_counter()
    info = machine()
    out = asyncio.run(main_async(args))
    out["machine"] = info
    out["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    s = out["summary"]
    print(
        f"\n{'workload':<12}{'HF generate tok/s':>19}{'torch engine tok/s':>20}{'engine / HF':>13}"
    )
    for r in out["results"]:
        print(
            f"{r['workload']:<12}{r['hf_tokens_per_s']['median']:>19.1f}"
            f"{r['engine_tokens_per_s']['median']:>20.1f}"
            f"{r['ratio']['median']:>13.2f}"
        )
    print(
        f"torch_engine_vs_hf_generate = {s['torch_engine_vs_hf_generate']} (long tail; HF padding "
        f"waste {s['hf_padding_waste_longtail']:.0%}), uniform lengths: "
        f"{s['torch_engine_vs_hf_generate_uniform_lengths']}"
    )
    print(
        f"lean_forward_vs_hf_forward = {s['lean_forward_vs_hf_forward']} (long tail; per "
        f"CPU-second {s['lean_forward_vs_hf_forward_per_cpu_s']}), uniform lengths: "
        f"{s['lean_forward_vs_hf_forward_uniform']}"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out} ({out['wall_s']} s)")


if __name__ == "__main__":
    main()
