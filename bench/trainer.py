"""Trainer step time, packed forward vs HF's padded forward; a model process's start,
module-free vs through transformers; the trainer's peak memory, LoRA vs full fine-tuning. Same
run, alternating, ratios against the baseline measured beside them.

    GRPO batches (groups of n samples, one prompt) ──► TorchTrainer.train_step
                                                        (trainer.forward=packed|hf)
    a fresh `python -c` that imports torch, loads the model ──► CPU-s and wall s (module_free | HF)

Workload (stated in the JSON): the demo's policy shape (3 layers, hidden 128, char vocabulary),
batches of `groups` x `group` samples, prompts of 12-30 tokens shared by a group, response
lengths lognormal (median ~30, long tail clipped at 250): the count-up task's shape. Both
forwards run the demo's trainer settings (4 PPO mini-batches, the pi_prox pass, 1024-token
micro-batches, one thread). Reported: median step seconds over `steps` batches per repeat,
tokens per second, and the packed / HF ratio; for the start, CPU seconds and wall seconds of
the whole child (interpreter, imports, load) and which modules it imported.

    .venv/bin/python bench/trainer.py --quick --out /tmp/trainer.json     # ~1 min on 2 cores
    .venv/bin/python bench/trainer.py --out bench/results/trainer.json
    .venv/bin/python bench/trainer.py --lora-memory-only --out /tmp/trainer_lora.json  # ~1 min

LoRA memory (--lora-memory-only, and in every full run; model.lora rank 16, alpha 32, every
projection, against full fine-tuning): each variant in a fresh child that builds the trainer and
runs `steps` batches; its peak RSS (ru_maxrss: the process high-water mark, torch's runtime
included, so also the RSS of a child that only imports the same modules, peft included, and
loads), the peak CUDA allocation on a GPU, and the trainer's own tensors: parameters, their
gradients and the AdamW state, summed from the live tensors after the last step.

Memory (--memory, or --memory-only): one long micro-batch (2 rows of --seq-len tokens, the
response 7/8 of each) through the same trainer with activation checkpointing off/on and
log-probabilities chunked (trainer.logprob_chunk_tokens=1024) or all at once (0), each variant in
a fresh child process: peak memory of the step (the tensors alive before it + the rise of the
resident set during it, glibc's mmap threshold pinned so freed tensors leave at once; as
tests/plan_measure.py), median step seconds, and `laminar plan`'s traced peak beside it. Two
models: the demo's (its character vocabulary makes the head tiny) and the demo's shape with a
32k vocabulary (where the head's [tokens, vocab] logits matter).

    .venv/bin/python bench/trainer.py --memory-only --out bench/results/trainer_memory.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from engine import machine, stats  # noqa: E402  (the same figures' helpers as bench/engine.py)

from laminar.config import config_from_dict  # noqa: E402
from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.protocol.data import Trajectory  # noqa: E402
from laminar.trainer.torch_trainer import TorchTrainer  # noqa: E402
from laminar.wiring.trainer import trainer_settings  # noqa: E402

MODEL = dict(
    hidden=128, layers=3, heads=4, kv_heads=2, max_positions=320
)  # the demo policy's shape
ALPHABET = "0123456789+<=>;#?"  # the count-up task's characters
START_CHILD = """
import resource, sys, time
t = time.time()
from laminar.models.decoder_lm import load_model
model = load_model(sys.argv[1], module_free=sys.argv[2] == "1")
r = resource.getrusage(resource.RUSAGE_SELF)
print(r.ru_utime + r.ru_stime, time.time() - t, type(model).__name__,
      int(any(m.split(".")[0] == "transformers" for m in sys.modules)))
"""


def batches(
    n: int, groups: int, group: int, vocab: int, seed: int, uniform: float = 0.0
) -> list[list[Trajectory]]:
    """`uniform`: the share of groups whose rewards all agree (advantage 0 on every sample)."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(n):
        trajs = []
        for g in range(groups):
            prompt = rng.integers(3, vocab, size=int(rng.integers(12, 31)))
            same = float(rng.random() < 0.5) if g < round(uniform * groups) else None
            for i in range(group):
                r = int(min(250, max(2, rng.lognormal(3.4, 0.6))))
                trajs.append(
                    Trajectory(
                        uid=f"{b}-{g}/{i}",
                        group_id=f"{b}-{g}",
                        prompt_uid=f"{b}-{g}",
                        sample_index=i,
                        prompt_ids=prompt,
                        response_ids=rng.integers(3, vocab, size=r),
                        logprobs=np.full(r, -1.0, np.float32),
                        version=0,
                        reward=same if same is not None else float(rng.random() < 0.5),
                    )
                )
        out.append(trajs)
    return out


def policy(
    path: Path, run_dir: Path, forward: str, skip: bool = True, lora: bool = False
) -> TorchTrainer:
    """The demo's trainer settings; `lora`: rank-16 adapters at lr 5e-4 (bench/learning.py)."""
    model: dict[str, Any] = {"path": str(path)}
    if lora:
        model["lora"] = {"rank": 16, "alpha": 32}
    cfg = config_from_dict(
        {
            "run_dir": str(run_dir),
            "model": model,
            "rollout": {"max_model_len": 320, "sampling": {"max_tokens": 256}},
            "trainer": {
                "lr": 5e-5,
                "minibatches": 4,
                "micro_batch_tokens": 1024,
                "forward": forward,
                "skip_zero_advantage": skip,
            },
            "algo": {"loss": "ppo", "decoupled": True, "is_mode": "truncate", "is_cap": 2.0},
        }
    )
    return TorchTrainer(trainer_settings(cfg), str(path))


def time_steps(pol: TorchTrainer, work: list[list[Trajectory]]) -> list[float]:
    out = []
    for trajs in work:
        batch = pol.prepare(trajs)
        t = time.perf_counter()
        pol.train_step(batch)
        out.append(time.perf_counter() - t)
    return out


def alternate(
    repeats: int, work: list[list[Trajectory]], variants: dict[str, Callable[[], TorchTrainer]]
) -> dict[str, list[float]]:
    """Step times of each variant's fresh trainer over `work` (its first batch a warm-up step:
    allocator, first-call paths), the variants alternating in order from repeat to repeat."""
    steps: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            pol = variants[name]()
            time_steps(pol, work[:1])
            ts = time_steps(pol, work[1:])
            steps[name] += ts
            print(f"  repeat {rep} {name:<7} median step {statistics.median(ts):.3f} s")
    return steps


def start_child(path: Path, module_free: bool) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, "-c", START_CHILD, str(path), "1" if module_free else "0"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    cpu, wall, kind, hf = res.stdout.split()
    return {
        "cpu_s": float(cpu),
        "wall_s": float(wall),
        "model": kind,
        "imported_transformers": hf == "1",
    }


MEMORY_CHILD = """
import json, resource, sys, time
sys.path.insert(0, sys.argv[4])
import torch
torch.set_num_threads(1)
import peft  # every child imports what the LoRA one does (peft imports transformers): the RSS
import trainer as tb  # figures then differ by memory, not by code loaded
variant, path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
vocab = json.loads(open(path + "/config.json").read())["vocab_size"]
work = tb.batches(steps, 16, 8, vocab, seed=0)
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
pol = tb.policy(tb.Path(path), tb.Path(sys.argv[5]), "packed", lora=variant == "lora")
if variant != "load_only":
    for trajs in work:
        pol.train_step(pol.prepare(trajs))
ps = list(pol.model.module.parameters())
opt = [t for st in pol.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
print(json.dumps({
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "rss_before_model_mib": rss0 / 1024,
    "cuda_peak_mib": (
        torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    ),
    "params_mib": nbytes(ps) / 2**20,
    "trainable_params": sum(p.numel() for p in ps if p.requires_grad),
    "grads_mib": nbytes([p.grad for p in ps if p.grad is not None]) / 2**20,
    "optimizer_state_mib": nbytes(opt) / 2**20,
}))
"""


def lora_memory_child(path: Path, run_dir: Path, variant: str, steps: int) -> dict[str, Any]:
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            MEMORY_CHILD,
            variant,
            str(path),
            str(steps),
            str(Path(__file__).resolve().parent),
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def lora_memory(path: Path, tmp: Path, repeats: int, steps: int) -> dict[str, Any]:
    """Peak memory of the trainer, LoRA vs full fine-tuning (and a child that only loads)."""
    runs: dict[str, list[dict[str, Any]]] = {"full": [], "lora": [], "load_only": []}
    for rep in range(repeats):
        for v in ("full", "lora", "load_only") if rep % 2 == 0 else ("load_only", "lora", "full"):
            runs[v].append(lora_memory_child(path, tmp / f"mem-{v}", v, steps))
            print(f"  repeat {rep} {v:<9} peak RSS {runs[v][-1]['peak_rss_mib']:.1f} MiB")
    out: dict[str, Any] = {
        v: {
            "peak_rss_mib": stats([r["peak_rss_mib"] for r in rs]),
            **{k: rs[0][k] for k in rs[0] if k != "peak_rss_mib"},
        }
        for v, rs in runs.items()
    }
    base = out["load_only"]["peak_rss_mib"]["median"]
    for v in ("full", "lora"):
        out[v]["peak_rss_over_load_mib"] = round(out[v]["peak_rss_mib"]["median"] - base, 1)
        own = ("params_mib", "grads_mib", "optimizer_state_mib")
        out[v]["trainer_tensors_mib"] = round(sum(out[v][k] for k in own), 3)
    out["lora_over_full"] = {
        "peak_rss": round(
            out["lora"]["peak_rss_mib"]["median"] / out["full"]["peak_rss_mib"]["median"], 3
        ),
        "peak_rss_over_load": round(
            out["lora"]["peak_rss_over_load_mib"]
            / max(out["full"]["peak_rss_over_load_mib"], 1e-9),
            3,
        ),
        "trainer_tensors": round(
            out["lora"]["trainer_tensors_mib"] / out["full"]["trainer_tensors_mib"], 3
        ),
    }
    return out


def print_lora_memory(m: dict[str, Any]) -> None:
    print(f"\n{'trainer memory (MiB)':<28}{'full':>10}{'lora r16':>10}{'lora/full':>10}")
    rows = [
        ("peak RSS", m["full"]["peak_rss_mib"]["median"], m["lora"]["peak_rss_mib"]["median"]),
        (
            "peak RSS over a load",
            m["full"]["peak_rss_over_load_mib"],
            m["lora"]["peak_rss_over_load_mib"],
        ),
        ("params+grads+AdamW", m["full"]["trainer_tensors_mib"], m["lora"]["trainer_tensors_mib"]),
        ("AdamW state", m["full"]["optimizer_state_mib"], m["lora"]["optimizer_state_mib"]),
    ]
    for name, full, lora in rows:
        print(f"{name:<28}{full:>10.2f}{lora:>10.2f}{lora / max(full, 1e-9):>10.3f}")


VARIANTS = {  # name: (activation_checkpointing, logprob_chunk_tokens)
    "baseline": (False, 0),
    "chunked": (False, 1024),
    "checkpointing": (True, 0),
    "both": (True, 1024),
}


def _rss(key: str) -> int:
    import re

    text = Path("/proc/self/status").read_text()
    found = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    assert found is not None
    return int(found.group(1)) * 1024


def memory_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant's step in this (fresh) process: peak bytes, step seconds, the plan's figure."""
    from laminar.plan.trainer import _trajectories, trace_trainer

    torch.set_num_threads(1)
    ac, chunk = VARIANTS[spec["variant"]]
    row = spec["seq_len"]
    cfg = config_from_dict(
        {
            "run_dir": spec["run_dir"],
            "model": {"path": spec["model"]},
            "rollout": {"max_model_len": row, "sampling": {"max_tokens": row * 7 // 8}},
            "trainer": {
                "micro_batch_tokens": 2 * row,
                "activation_checkpointing": ac,
                "logprob_chunk_tokens": chunk,
                "eval_every": 0,
            },
        }
    )
    settings = trainer_settings(cfg)
    pol = TorchTrainer(settings, spec["model"])
    batch = pol.prepare(_trajectories(2, row, row * 7 // 8, pol.model.vocab_size))
    pol.train_step(batch)  # AdamW's state
    before = sum(p.numel() * p.element_size() for p in pol.model.module.parameters())
    before += sum(
        p.grad.numel() * p.grad.element_size()
        for p in pol.model.module.parameters()
        if p.grad is not None
    )
    before += sum(
        t.numel() * t.element_size()
        for st in pol.optimizer.state.values()
        for t in st.values()
        if t.dim() > 0
    )
    Path("/proc/self/clear_refs").write_text("5")
    rss = _rss("VmRSS")
    times = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        pol.train_step(batch)
        times.append(time.perf_counter() - t0)
    peak = before + _rss("VmHWM") - rss
    planned = trace_trainer(settings, spec["model"], world=1, device="cpu").peak_bytes
    return {"peak_bytes": peak, "planned_peak_bytes": planned, "step_s": times}


def memory_bench(tmp: Path, seq_len: int, steps: int) -> dict[str, Any]:
    """Every variant on both models, each in a fresh child (see the module docstring)."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM

    out: dict[str, Any] = {}
    for name, vocab in (("demo", 20), ("demo_32k_vocab", 32768)):
        shape = dict(
            model_type="qwen2",
            hidden_size=MODEL["hidden"],
            intermediate_size=4 * MODEL["hidden"],
            num_hidden_layers=MODEL["layers"],
            num_attention_heads=MODEL["heads"],
            num_key_value_heads=MODEL["kv_heads"],
            vocab_size=vocab,
            max_position_embeddings=seq_len,
            tie_word_embeddings=False,
        )
        path = tmp / f"model-{name}"
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(**shape)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
        out[name] = {}
        for variant in VARIANTS:
            spec = {
                "variant": variant,
                "model": str(path),
                "seq_len": seq_len,
                "steps": steps,
                "run_dir": str(tmp / f"run-{name}-{variant}"),
            }
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            proc = subprocess.run(
                [sys.executable, __file__, "--memory-child", json.dumps(spec)],
                capture_output=True,
                text=True,
                env=env,
                timeout=3600,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            out[name][variant] = {
                "peak_mib": round(res["peak_bytes"] / 2**20, 1),
                "planned_peak_mib": round(res["planned_peak_bytes"] / 2**20, 1),
                "step_s": stats(res["step_s"]),
            }
    print(f"\nmemory at {seq_len}-token rows (2 a micro-batch), one thread")
    print(
        f"{'model':<16}{'variant':<15}{'peak MiB':>10}{'plan MiB':>10}{'vs base':>9}{'step s':>9}"
    )
    for name, rows in out.items():
        base = rows["baseline"]
        for variant, r in rows.items():
            print(
                f"{name:<16}{variant:<15}{r['peak_mib']:>10.1f}{r['planned_peak_mib']:>10.1f}"
                f"{r['peak_mib'] / base['peak_mib']:>8.2f}x{r['step_s']['median']:>9.3f}"
            )
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--memory-child":
        print(json.dumps(memory_child(json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats of 4 batches, 3 starts each")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="batches per repeat and forward")
    ap.add_argument("--starts", type=int, default=5, help="child starts per loader")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument(
        "--uniform",
        type=float,
        default=0.5,
        help=(
            "share of groups whose rewards agree, for the zero-advantage skip (the demo: 0.3-0.75)"
        ),
    )
    ap.add_argument("--memory", action="store_true", help="also the memory variants")
    ap.add_argument("--memory-only", action="store_true", help="only the memory variants")
    ap.add_argument("--seq-len", type=int, default=4096, help="memory: tokens a row")
    ap.add_argument("--memory-steps", type=int, default=3, help="memory: timed steps a variant")
    ap.add_argument(
        "--lora-memory-only", action="store_true", help="only the LoRA vs full memory figures"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.steps, args.starts = 2, 4, 3
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="lam-bench-trainer-"))
    if args.memory_only:
        result = {
            "config": vars(args),
            "machine": machine(),
            "memory": memory_bench(tmp, args.seq_len, args.memory_steps),
        }
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {args.out}")
        return
    path = build_tiny_model(tmp / "model", alphabet=ALPHABET, seed=0, **MODEL)
    mem = lora_memory(path, tmp, args.repeats, args.steps)
    if args.lora_memory_only:
        result = {"config": {**vars(args), "model": MODEL}, "machine": machine(), "memory": mem}
        print_lora_memory(mem)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {args.out}")
        return
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    work = batches(args.steps + 1, args.groups, args.group, vocab, seed=0)
    tokens = [sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs) for trajs in work[1:]]
    steps = alternate(
        args.repeats,
        work,
        {
            forward: (lambda f=forward: policy(path, tmp / f"run-{f}", f))
            for forward in ("packed", "hf")
        },
    )
    # the zero-advantage skip: the same packed trainer with it on and off, batches with uniform
    # groups
    skip_work = batches(
        args.steps + 1, args.groups, args.group, vocab, seed=1, uniform=args.uniform
    )
    skip_steps = alternate(
        args.repeats,
        skip_work,
        {
            name: (lambda n=name: policy(path, tmp / f"run-{n}", "packed", skip=n == "skip"))
            for name in ("skip", "no_skip")
        },
    )
    starts: dict[str, list[dict[str, Any]]] = {"module_free": [], "hf": []}
    for i in range(args.starts):
        for name in ("module_free", "hf") if i % 2 == 0 else ("hf", "module_free"):
            starts[name].append(start_child(path, name == "module_free"))
    per_tok = statistics.median(tokens)
    step = {k: stats(v) for k, v in steps.items()}
    start = {
        k: {
            "cpu_s": stats([r["cpu_s"] for r in v]),
            "wall_s": stats([r["wall_s"] for r in v]),
            "model": v[0]["model"],
            "imported_transformers": v[0]["imported_transformers"],
        }
        for k, v in starts.items()
    }
    result = {
        "config": {**vars(args), "model": MODEL, "tokens_per_batch_median": per_tok},
        "machine": machine(),
        "step_s": step,
        "tokens_per_s": {k: round(per_tok / v["median"], 1) for k, v in step.items()},
        "zero_advantage_skip": {
            "uniform_groups": args.uniform,
            "step_s": {k: stats(v) for k, v in skip_steps.items()},
        },
        "start": start,
        "memory": memory_bench(tmp, args.seq_len, args.memory_steps) if args.memory else None,
        "lora_memory": mem,
        "summary": {
            "packed_over_hf_step_speed": round(step["hf"]["median"] / step["packed"]["median"], 3),
            "skip_over_no_skip_step_speed": round(
                statistics.median(skip_steps["no_skip"]) / statistics.median(skip_steps["skip"]), 3
            ),
            "start_cpu_s_saved": round(
                start["hf"]["cpu_s"]["median"] - start["module_free"]["cpu_s"]["median"], 3
            ),
            "start_wall_hf_over_module_free": round(
                start["hf"]["wall_s"]["median"] / start["module_free"]["wall_s"]["median"], 3
            ),
        },
    }
    print(f"\n{'':<24}{'packed / module-free':>22}{'hf':>12}{'ratio':>8}")
    print(
        f"{'train step s (median)':<24}{step['packed']['median']:>22.3f}"
        f"{step['hf']['median']:>12.3f}"
        f"{result['summary']['packed_over_hf_step_speed']:>8.2f}x"
    )
    print(
        f"{'step s, zero-adv skip':<24}{statistics.median(skip_steps['skip']):>22.3f}"
        f"{statistics.median(skip_steps['no_skip']):>12.3f}"
        f"{result['summary']['skip_over_no_skip_step_speed']:>8.2f}x  (off; {args.uniform:.0%} "
        "uniform groups)"
    )
    cpu_free, cpu_hf = start["module_free"]["cpu_s"]["median"], start["hf"]["cpu_s"]["median"]
    print(f"{'model start CPU-s':<24}{cpu_free:>22.2f}{cpu_hf:>12.2f}{cpu_hf / cpu_free:>8.2f}x")
    print(
        f"{'model start wall s':<24}{start['module_free']['wall_s']['median']:>22.2f}"
        f"{start['hf']['wall_s']['median']:>12.2f}"
        f"{result['summary']['start_wall_hf_over_module_free']:>8.2f}x"
    )
    print_lora_memory(mem)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
