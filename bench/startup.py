"""Time from `laminar run` to the first trainer step of the demo job, module-free start vs through
transformers, alternating in one run.

    laminar run configs/demo.yaml trainer.total_steps=3
        ──► each node's `ready` and the first step, seconds after the launch
            (bench/learning.py startup_breakdown)
      module_free: the defaults (rollout.torch_forward=auto, trainer.forward=auto: no transformers)
      hf:          rollout.torch_forward=hf trainer.forward=hf (models, tokenizers via transformers)

The demo's data and warm-up policy come from bench/learning.py's cache (runs/bench-learning/data,
runs/.cache/countup-policy0-seed0; `make run` or one bench/learning.py run makes them).

    .venv/bin/python bench/startup.py --pairs 3 --out bench/results/startup.json  # ~2 min, 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from learning import machine, startup_breakdown  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    "model.path=runs/.cache/countup-policy0-seed0",
    "data.train=runs/bench-learning/data/train.jsonl",
    "data.eval=runs/bench-learning/data/eval.jsonl",
    "trainer.eval_every=0",
    "trainer.total_steps=3",
]
VARIANTS = {"module_free": [], "hf": ["rollout.torch_forward=hf", "trainer.forward=hf"]}
MARKS = ("buffer_ready", "trainer_ready", "rollouts_ready", "first_step")


def one_start(run_dir: Path, extra: list[str]) -> dict[str, float]:
    t0 = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "laminar",
            "run",
            "--overwrite",
            "configs/demo.yaml",
            f"run_dir={run_dir}",
            *BASE,
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=True,
        timeout=300,
    )
    b = startup_breakdown(run_dir, t0)
    rollouts = [v["ready"] for k, v in b.items() if k.startswith("rollout-") and "ready" in v]
    return {
        "buffer_ready": b["buffer-0"]["ready"],
        "trainer_ready": b["trainer-0"]["ready"],
        "rollouts_ready": max(rollouts),
        "first_step": b["first_step_done_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=3, help="alternating module_free / hf starts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for need in ("runs/.cache/countup-policy0-seed0", "runs/bench-learning/data/train.jsonl"):
        if not (ROOT / need).exists():
            sys.exit(
                f"bench/startup.py: {need} is missing; run `make run` or bench/learning.py once "
                "first"
            )
    work = Path(tempfile.mkdtemp(prefix="lam-bench-startup-"))
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in VARIANTS}
    for i in range(args.pairs):
        for name in list(VARIANTS) if i % 2 == 0 else list(VARIANTS)[::-1]:
            runs[name].append(one_start(work / f"{name}-{i}", VARIANTS[name]))
            print(
                f"  {name:<12} " + "  ".join(f"{k} {v:5.2f}" for k, v in runs[name][-1].items()),
                flush=True,
            )
    med = {
        n: {k: round(statistics.median(r[k] for r in rs), 2) for k in MARKS}
        for n, rs in runs.items()
    }
    result = {
        "config": {"pairs": args.pairs, "base": BASE, "variants": VARIANTS},
        "machine": machine(),
        "runs": runs,
        "median_s": med,
        "summary": {
            "first_step_hf_minus_module_free_s": round(
                med["hf"]["first_step"] - med["module_free"]["first_step"], 2
            ),
            "first_step_hf_over_module_free": round(
                med["hf"]["first_step"] / med["module_free"]["first_step"], 3
            ),
        },
    }
    print(f"\n{'median s after launch':<24}" + "".join(f"{k:>16}" for k in MARKS))
    for name, row in med.items():
        print(f"{name:<24}" + "".join(f"{row[k]:>16.2f}" for k in MARKS))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
