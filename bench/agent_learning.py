"""Does the tool demo's task learn when it is written as an OpenAI-client agent? Median over seeds.

    python bench/agent_learning.py [--seeds 0 1 2] [--env] [--out bench/results/agent_learning.json]
                                   [key=value ...]                  (extra tool-demo overrides)

Each seed is one `python -m laminar.demo.tooldemo` run with the episodes driven by
laminar/demo/tooldemo/agent.py (the calculator through `tools=`, trained through the rollouts'
OpenAI-compatible endpoint: env.fn=null agent.fn=laminar.demo.tooldemo.agent:run); the warm-up
policy is the demo's own (cached per seed in runs/.cache). The figure is the held-out accuracy
gain (greedy ToolEnv episodes after RL minus before, summary.json of each run), min / median /
max over seeds; `--env` runs the in-process ToolEnv the same way in the same invocation for the
comparison (agent / env gain). The issue's bar: median agent gain >= 0.3 (ToolEnv: +0.41).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchinfo import git_state  # noqa: E402

AGENT = ["env.fn=null", "agent.fn=laminar.demo.tooldemo.agent:run"]


def one(path: str, seed: int, runs: Path, extra: list[str]) -> dict[str, Any]:
    run_dir = runs / f"{path}-seed{seed}"
    cmd = [sys.executable, "-m", "laminar.demo.tooldemo", f"seed={seed}", f"run_dir={run_dir}"]
    cmd += (AGENT if path == "agent" else []) + extra
    t0 = time.time()
    print(f"[{path} seed {seed}] {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    s = json.loads((run_dir / "summary.json").read_text())
    gain = s["eval_accuracy_after"] - s["eval_accuracy_before"]
    print(f"[{path} seed {seed}] gain {gain:+.3f} ({time.time() - t0:.0f}s)", flush=True)
    return {"seed": seed, "gain": gain, "wall_s": time.time() - t0, "summary": s}


def spread(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--env", action="store_true", help="also the in-process ToolEnv, same seeds")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "agent-learning")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "agent_learning.json")
    args, extra = ap.parse_known_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    paths = ["agent", "env"] if args.env else ["agent"]
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    for seed in args.seeds:  # paths interleaved per seed: a drift of the machine hits both
        for path in paths:
            results[path].append(one(path, seed, args.runs, extra))
    figures = {f"{p}_gain": spread([r["gain"] for r in rs]) for p, rs in results.items()}
    out = {
        "bench": "agent_learning",
        "config": {"seeds": args.seeds, "overrides": extra, "paths": paths},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        **git_state(),
        "figures": figures,
        "runs": {
            p: [{k: v for k, v in r.items() if k != "summary"} for r in rs]
            for p, rs in results.items()
        },
        "summaries": {p: [r["summary"] for r in rs] for p, rs in results.items()},
    }
    if args.env:
        out["agent_over_env_median_gain"] = figures["agent_gain"]["median"] / max(
            1e-9, figures["env_gain"]["median"]
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"{'path':6} {'gain min':>9} {'median':>9} {'max':>9}")
    for p in paths:
        f = figures[f"{p}_gain"]
        print(f"{p:6} {f['min']:+9.3f} {f['median']:+9.3f} {f['max']:+9.3f}")
    bar = figures["agent_gain"]["median"] >= 0.3
    print(f"median agent gain >= 0.3: {'yes' if bar else 'NO'} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
