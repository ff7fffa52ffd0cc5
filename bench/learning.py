"""Learning under staleness: the CPU count-up demo job per mode x staleness x correction x seed.

    # <= 15 min on 2 cores; then the full table (hours)
    .venv/bin/python bench/learning.py --quick --out bench/results/learning_quick.json
    .venv/bin/python bench/learning.py --out bench/results/learning.json
    .venv/bin/python bench/learning.py --cells laminar:2:tis,laminar:2:ppo_mb --seeds 0,1,2 --out F

Each run is the demo's own runner (laminar/demo/__main__.py run_mode: `laminar run
configs/demo.yaml` as a child, every role its own process), started from the demo's
cached warm-up policy (seed 0; built on first use, ~4 min) with seed=S and data.seed=S
(sampling and prompt order differ per seed, the starting policy does not). Weight
snapshots (every trainer.snapshot_every steps) are evaluated after each run, greedy, on
the held-out prompts (laminar/demo/results.py eval_curve), so the timing of a run is not disturbed.

    # LoRA beside full fine-tuning (steps and seconds to 0.90, "lora_vs_full" in the JSON)
    .venv/bin/python bench/learning.py --cells laminar:2:default,laminar:2:lora --seeds 0,1,2

    cells: sync (staleness 0 by construction) and laminar at max_staleness 1, 2, 4; partial
      (AReaL-style partial rollout: updates interrupt in-flight trajectories, which continue
      under the new version; the staleness bounds the oldest token, e.g. partial:4:default as
      AReaL's convergence runs), run on request with --cells
    corrections (on top of configs/demo.yaml):
      default  the demo config as it is (today: ppo_mb)
      none     decoupled, no behaviour weight (is_mode=none), 1 optimizer step per batch, lr 2e-4
      tis      token TIS: w = min(pi_prox/mu, 2), 1 optimizer step per batch, lr 2e-4
      ppo_mb   decoupled PPO with a trust region: TIS + trainer.minibatches=4 (the clip acts),
               lr 5e-5
      icepop   masked IS (IcePop, 2025): tokens whose pi_prox/mu leaves [1/2, 2] get no gradient,
               1 optimizer step per batch, lr 2e-4
      lora     ppo_mb training LoRA adapters (model.lora rank 16, alpha 32) on the frozen policy,
               lr 5e-4 (`lora@LR` sets another rate)
      live_routes  the demo config with model.moe.routing_replay=false: an MoE policy
               (demo.model.kind=moe) trained with its trainer routing live instead of replaying
               the rollout's routes (docs/moe.md; `default` replays them)

    # MoE: rollout routing replay on (default) and off, bf16 rollouts against the fp32 trainer
    .venv/bin/python bench/learning.py --cells laminar:2:default,laminar:2:live_routes \
        --seeds 0,1,2 --out bench/results/learning_moe.json --work runs/bench-learning-moe \
        demo.model.kind=moe demo.cache_dir=runs/.cache-moe model.dtype=bfloat16 \
        trainer.total_steps=40

Figures per run: the accuracy curve (step, seconds since launch), its 3-snapshot smoothing
(results.smooth), steps and seconds to 0.85 / 0.90 on the smoothed curve (interpolated;
null and `short_by_*` when never reached; `seconds_to_*_from_ready` counts from the moment
the run's last node was ready instead of from the launch, `ready_s` after it), trainer
steps/s, CPU-seconds of the run (all its processes) and cores used (CPU-s / wall-s), and
learning per step relative to the sync run of the same seed and correction (else the
default sync run): the area under (accuracy - start) over the steps both ran, cell / sync.
A run is void when its processes did not get their CPU (other processes on the machine took
more than 0.5 cores on average while it ran, from /proc/stat less the run's and the bench's own
CPU: `others_cores`; or its trainer stepped at less than half its cell's median rate over the
other seeds): it is listed in summary.void_runs with its reason and counted nowhere.
Per cell: min / median / max over seeds. Summary (paired by seed, median over seeds):
steps_to_090_laminar_over_sync and time_to_090_sync_over_laminar at the demo's staleness
with the default correction, and what each mode's staleness policy did to the data:
audit_long_vs_short_{laminar,sync}, the share of the longest response-length bucket trained
on over the shortest's (1 = no length bias; the per-length audit of each run's buffer
journal, laminar/fates.py). A PNG (matplotlib if installed) shows median + range bands.
Timings on a shared or loaded machine are not comparable to a quiet one's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchinfo, also when loaded as a module

from benchinfo import git_state  # noqa: E402

from laminar.config import DemoConfig, load_config  # noqa: E402
from laminar.demo.__main__ import (  # noqa: E402
    DEMO_CONFIG,
    demo_settings,
    prepare_data,
    run_mode,
    warm_up,
)

TARGETS = (0.85, 0.90)
CORRECTIONS: dict[str, list[str]] = {
    "default": [],
    "none": [
        "algo.decoupled=true",
        "algo.is_mode=none",
        "trainer.minibatches=1",
        "trainer.lr=2e-4",
    ],
    "tis": [
        "algo.decoupled=true",
        "algo.is_mode=truncate",
        "algo.is_cap=2.0",
        "trainer.minibatches=1",
        "trainer.lr=2e-4",
    ],
    "ppo_mb": [
        "algo.decoupled=true",
        "algo.is_mode=truncate",
        "algo.is_cap=2.0",
        "trainer.minibatches=4",
        "trainer.lr=5e-5",
    ],
    "icepop": [
        "algo.decoupled=true",
        "algo.is_mode=mask",
        "algo.is_low=0.5",
        "algo.is_high=2.0",
        "trainer.minibatches=1",
        "trainer.lr=2e-4",
    ],
    "lora": [
        "algo.decoupled=true",
        "algo.is_mode=truncate",
        "algo.is_cap=2.0",
        "trainer.minibatches=4",
        "model.lora={rank: 16, alpha: 32}",
        "trainer.lr=5e-4",
    ],
    "live_routes": ["model.moe.routing_replay=false"],
}
"""Each correction pins its own learning rate: one optimizer step a batch at 2e-4, four at 5e-5 (a
batch then moves the weights about as far). The full table of 2026-11-27 ran ppo_mb at 2e-4.
`lora` is ppo_mb training rank-16 adapters (alpha 32, every projection) on the frozen policy: a
version is the adapters; LoRA wants a higher rate than full fine-tuning. A cell's correction may
name its own rate after `@` (laminar:2:lora@1e-3), for tuning."""
QUICK_STEPS = 60
QUICK_SEEDS = "0,1,2,3,4"
"""Five: on this shared 2-core box the same code's sync run to 0.90 took 12.2 s once and 17.4 s
the next time, so a 3-seed median of paired ratios moved by +-0.2 between runs (bench/README.md)."""
_TABLE = [c for c in CORRECTIONS if c not in ("default", "live_routes")]  # live_routes: MoE only
FULL_CELLS = ["sync:0:" + c for c in _TABLE] + [
    f"laminar:{k}:{c}" for k in (1, 2, 4) for c in _TABLE
]


def say(msg: str) -> None:
    print(f"[learning {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _box_busy_s() -> float | None:
    """CPU-seconds the whole machine has been busy (every process, every core; /proc/stat),
    None where there is no /proc."""
    try:
        f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal: idle and iowait are not busy
    ticks = [int(x) for x in f[:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


# A run is void (listed, not counted) when its processes did not get their CPU: other
# processes took more than this many cores on average while it ran, or its trainer stepped at
# less than VOID_RATE of the median rate of its cell's other seeds (a run that starved for any
# reason the box cannot see, e.g. one of partial's 3 seeds at 0.22 steps/s on 0.33 cores).
VOID_OTHERS_CORES = 0.5
VOID_RATE = 0.5


def crossing(curve: list[dict[str, Any]], key: str, target: float) -> float | None:
    """`key` (step or t) where the curve first reaches target, linear between points."""
    prev = None
    for p in curve:
        if p["accuracy"] >= target - 1e-9:
            if prev is None or p["accuracy"] == prev["accuracy"]:
                return float(p[key])
            frac = (target - prev["accuracy"]) / (p["accuracy"] - prev["accuracy"])
            return float(prev[key] + frac * (p[key] - prev[key]))
        prev = p
    return None


def gain_area(curve: list[dict[str, Any]], upto: float) -> float:
    """Trapezoid area of (accuracy - accuracy at step 0) over steps [0, upto]."""
    a0, area = curve[0]["accuracy"], 0.0
    for p, q in zip(curve, curve[1:], strict=False):
        if p["step"] >= upto:
            break
        hi = min(q["step"], upto)
        frac = (hi - p["step"]) / (q["step"] - p["step"]) if q["step"] > p["step"] else 0.0
        qa = p["accuracy"] + frac * (q["accuracy"] - p["accuracy"])
        area += (hi - p["step"]) * ((p["accuracy"] + qa) / 2 - a0)
    return area


def run_cell(
    cell: str,
    seed: int,
    work: Path,
    base: list[str],
    s: DemoConfig,
    policy0: Path,
    ev: list[dict],
    before: dict[str, Any],
    max_tokens: int,
) -> dict[str, Any]:
    from laminar.demo import results
    from laminar.fates import run_fates, summary_keys
    from laminar.report import read_metrics

    mode, staleness, corr = cell.split(":")
    corr, _, lr = corr.partition("@")
    over = [*base, *CORRECTIONS[corr], f"seed={seed}", f"data.seed={seed}"]
    if lr:
        over.append(f"trainer.lr={lr}")
    if mode in ("laminar", "partial"):
        over.append(f"buffer.max_staleness={staleness}")
    run_dir = work / cell.replace(":", "_") / f"seed{seed}"
    c0, self0, busy0 = _cpu_children(), _cpu_self(), _box_busy_s()
    r = run_mode(DEMO_CONFIG, run_dir, mode, over, s)
    cpu = _cpu_children() - c0
    busy1 = _box_busy_s()
    # what every other process on the machine took meanwhile (this bench's own CPU excluded)
    others = (
        None
        if busy0 is None or busy1 is None or not r["wall_clock_s"]
        else max(0.0, busy1 - busy0 - cpu - (_cpu_self() - self0)) / r["wall_clock_s"]
    )
    curve = results.eval_curve(
        run_dir, policy0, ev, s, before, r["t0"], log=lambda _m: None, max_tokens=max_tokens
    )
    metrics = read_metrics(run_dir)
    sm = results.smooth(curve)
    out: dict[str, Any] = {
        "cell": cell,
        "seed": seed,
        "overrides": over,
        "wall_s": round(r["wall_clock_s"], 1),
        "cpu_s": round(cpu, 1),
        "cores": round(cpu / r["wall_clock_s"], 2) if r["wall_clock_s"] else None,
        "others_cores": None if others is None else round(others, 2),
        "steps": metrics[-1]["step"] if metrics else 0,
        "steps_per_s": results.steps_per_s(metrics),
        "first_step_s": round(metrics[0]["time"] - r["t0"], 1) if metrics else None,
        "staleness_mean": _mean([m.get("staleness") for m in metrics]),
        "clip_frac_mean": _mean([m.get("frac/clip") for m in metrics]),
        # mode partial: per-token staleness and trajectories that spanned versions (else None)
        "staleness_token_mean": _mean([m.get("staleness_token") for m in metrics]),
        "spanning_versions_mean": _mean([m.get("spanning_versions") for m in metrics]),
        "curve": curve,
        "smoothed": sm,
        "best_smoothed": max(p["accuracy"] for p in sm),
        "final": curve[-1]["accuracy"],
        "startup": startup_breakdown(run_dir, r["t0"]),
        # the per-length audit of the run's buffer journal (laminar/fates.py)
        **summary_keys(run_fates(run_dir)),
    }
    for tgt in TARGETS:
        k = f"{round(tgt * 100):03d}"
        out[f"steps_to_{k}"] = crossing(sm, "step", tgt)
        out[f"seconds_to_{k}"] = crossing(sm, "t", tgt)
        out[f"short_by_{k}"] = round(max(0.0, tgt - out["best_smoothed"]), 3)
    with_ready_times(out)
    say(
        f"{cell} seed {seed}: {out['steps']} steps in {out['wall_s']:.0f}s ({out['cores']} cores), "
        f"best smoothed acc {out['best_smoothed']:.3f}, steps/s to 0.90: {out['steps_to_090']} / "
        f"{out['seconds_to_090']}"
    )
    return out


def with_ready_times(run: dict[str, Any]) -> dict[str, Any]:
    """The run's seconds to each target counted from the moment its last node was ready (a
    rollout: its engine started) instead of from the launch: training time, which a run of
    hours is made of, without the few seconds of process start-up that every mode pays alike
    and that a 20-step crossing would otherwise dilute. Computed from the run's own startup
    marks, so stored runs get it too."""
    marks = [m for m in run.get("startup", {}).values() if isinstance(m, dict)]
    ready = [m.get("engine_started", m.get("ready")) for m in marks]
    ready = [x for x in ready if x is not None]
    run["ready_s"] = max(ready) if ready else None
    for tgt in TARGETS:
        k = f"{round(tgt * 100):03d}"
        sec = run.get(f"seconds_to_{k}")
        run[f"seconds_to_{k}_from_ready"] = (
            None if sec is None or run["ready_s"] is None else round(sec - run["ready_s"], 3)
        )
    return run


def startup_breakdown(run_dir: Path, t0: float) -> dict[str, Any]:
    """Seconds after `laminar run` was launched at which each node logged `starting` (its
    interpreter and laminar imports done), `ready` (setup: torch, model, sockets) and, for
    rollouts, `engine_started`; and the first trainer step's end and compute time."""
    from datetime import datetime

    from laminar.report import read_jsonl

    out: dict[str, Any] = {}
    for log in sorted((run_dir / "logs").glob("*.log")):
        marks: dict[str, float] = {}
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                e = json.loads(line)
            except ValueError:
                continue
            ev = e.get("event")
            if (
                ev in ("starting", "ready", "engine_started")
                and ev not in marks
                and "timestamp" in e
            ):
                ts = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
                marks[ev] = round(ts - t0, 2)
        if marks:
            out[log.stem] = marks
    m = read_jsonl(run_dir / "metrics.jsonl")
    if m:
        out["first_step_done_s"] = round(m[0]["time"] - t0, 2)
        out["first_step_compute_s"] = round(m[0].get("compute_s", math.nan), 2)
    return out


def _mean(xs: list[Any]) -> float | None:
    v = [float(x) for x in xs if isinstance(x, int | float) and math.isfinite(x)]
    return sum(v) / len(v) if v else None


def spread(xs: list[float | None]) -> dict[str, Any] | None:
    """min / median / max of the values; None counts as +inf (never reached) in the median."""
    if not xs:
        return None
    v = sorted(math.inf if x is None else float(x) for x in xs)
    med = statistics.median(v)

    def j(x: float) -> float | None:
        return None if math.isinf(x) else round(x, 4)

    return {
        "min": j(v[0]),
        "median": j(med),
        "max": j(v[-1]),
        "n": len(v),
        "not_reached": sum(x is None for x in xs),
    }


def learning_vs_sync(run: dict[str, Any], sync: dict[str, Any] | None) -> float | None:
    if sync is None:
        return None
    upto = min(run["curve"][-1]["step"], sync["curve"][-1]["step"])
    ref = gain_area(sync["smoothed"], upto)
    return round(gain_area(run["smoothed"], upto) / ref, 3) if ref > 0 else None


def _ratio(a: float | None, b: float | None, inf_when: str) -> float:
    """a / b with 'never reached' (None) as inf: a None numerator is inf, a None denominator 0."""
    if a is None and b is None:
        return math.nan
    if a is None:
        return math.inf if inf_when == "num" else 0.0
    if b is None:
        return 0.0 if inf_when == "num" else math.inf
    return a / b if b > 0 else math.inf


def _json_num(x: float) -> float | None:
    """inf (never reached) and nan (neither run reached it) as null: JSON has neither."""
    return None if math.isinf(x) or math.isnan(x) else round(x, 3)


def _from_ready_ratios(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[float]:
    """Seconds to 0.90 from ready, numerator run over denominator run, for each pair whose runs
    both have their ready mark."""
    return [
        _ratio(n["seconds_to_090_from_ready"], d["seconds_to_090_from_ready"], "num")
        for n, d in pairs
        if n.get("ready_s") is not None and d.get("ready_s") is not None
    ]


def _median_json(xs: list[float]) -> float | None:
    v = [x for x in xs if not math.isnan(x)]
    if not v:
        return None
    m = statistics.median(v)
    return None if math.isinf(m) else round(m, 3)


def void_reason(run: dict[str, Any], cell_runs: list[dict[str, Any]]) -> str | None:
    """Why a run does not count (its processes did not get their CPU), else None."""
    oc = run.get("others_cores")
    if oc is not None and oc > VOID_OTHERS_CORES:
        return f"other processes took {oc} cores while it ran (> {VOID_OTHERS_CORES})"
    rates = [
        x["steps_per_s"] for x in cell_runs if x is not run and x.get("steps_per_s") is not None
    ]
    if len(rates) >= 2 and run.get("steps_per_s") is not None:
        med = statistics.median(rates)
        if run["steps_per_s"] < VOID_RATE * med:
            return (
                f"{run['steps_per_s']:.2f} steps/s on {run.get('cores')} cores against its "
                f"cell's median {med:.2f} of the other seeds (< {VOID_RATE}x)"
            )
    return None


def aggregate(runs: list[dict[str, Any]], headline: tuple[str, str]) -> dict[str, Any]:
    every: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        every.setdefault(r["cell"], []).append(r)
    void = []
    for r in runs:
        if "ready_s" not in r and "startup" in r:
            with_ready_times(r)  # a run stored before the figure existed
        r["void"] = void_reason(r, every[r["cell"]])
        if r["void"]:
            void.append({"cell": r["cell"], "seed": r["seed"], "reason": r["void"]})
    runs = [r for r in runs if not r["void"]]
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_cell.setdefault(r["cell"], []).append(r)
    sync_of = {
        (r["cell"].split(":")[2], r["seed"]): r for r in runs if r["cell"].startswith("sync:")
    }
    cells: dict[str, Any] = {}
    for cell, rs in by_cell.items():
        corr = cell.split(":")[2]
        c: dict[str, Any] = {}
        for key in (
            "steps_to_085",
            "steps_to_090",
            "seconds_to_085",
            "seconds_to_090",
            "seconds_to_090_from_ready",
            "ready_s",
            "steps_per_s",
            "wall_s",
            "cpu_s",
            "cores",
            "best_smoothed",
            "final",
            "staleness_mean",
            "clip_frac_mean",
            "staleness_token_mean",
            "spanning_versions_mean",
            "first_step_s",
            "short_by_090",
        ):
            c[key] = spread([r.get(key) for r in rs])
        for key in ("audit_long_vs_short", "audit_long_kept", "audit_dropped"):
            # None here is "no journal", not "never reached": left out
            c[key] = spread([r[key] for r in rs if r.get(key) is not None])
        # against the sync run of the same correction and seed, else the default sync run
        c["learning_per_step_vs_sync"] = spread(
            [
                learning_vs_sync(
                    r, sync_of.get((corr, r["seed"])) or sync_of.get(("default", r["seed"]))
                )
                for r in rs
            ]
        )
        cells[cell] = c
    lam, sync = headline
    pairs = [
        (r, b)
        for r in by_cell.get(lam, [])
        if (b := sync_of.get((sync.split(":")[2], r["seed"]))) is not None
    ]
    steps = [_ratio(a["steps_to_090"], b["steps_to_090"], "num") for a, b in pairs]
    times = [_ratio(b["seconds_to_090"], a["seconds_to_090"], "num") for a, b in pairs]
    train_times = _from_ready_ratios([(b, a) for a, b in pairs])
    rate = [
        a["steps_per_s"] / b["steps_per_s"]
        for a, b in pairs
        if a["steps_per_s"] and b["steps_per_s"]
    ]
    summary = {
        "headline_cells": {"laminar": lam, "sync": sync},
        "seeds": len(pairs),
        "steps_to_090_laminar_over_sync": _median_json(steps),
        "time_to_090_sync_over_laminar": _median_json(times),
        "steps_to_090_laminar_over_sync_per_seed": [_json_num(x) for x in steps],
        "time_to_090_sync_over_laminar_per_seed": [_json_num(x) for x in times],
        # the same, counted from the moment each run's last node was ready (training time)
        "time_to_090_sync_over_laminar_from_ready": _median_json(train_times),
        "time_to_090_sync_over_laminar_from_ready_per_seed": [_json_num(x) for x in train_times],
        "short_of_090_laminar": _median_json([a["short_by_090"] for a, _ in pairs]),
        "short_of_090_sync": _median_json([b["short_by_090"] for _, b in pairs]),
        "steps_per_s_laminar_over_sync": _median_json(rate),
        # per-length audit: kept share of the longest length bucket over the shortest's (1 = no
        # length bias), median over the seeds of each headline cell
        "audit_long_vs_short_laminar": _median_json(
            [x for a, _ in pairs if (x := a.get("audit_long_vs_short")) is not None]
        ),
        "audit_long_vs_short_sync": _median_json(
            [x for _, b in pairs if (x := b.get("audit_long_vs_short")) is not None]
        ),
        "steps_to_090_goal": "<= 1.10",
        "time_to_090_goal": ">= 1.4",
        # runs not counted in any figure above or below, each with its reason
        "void_runs": void,
    }
    part = next((c for c in by_cell if c.startswith("partial:")), None)
    if part is not None:  # the strongest baseline's learning per step, measured beside laminar's
        lam_of = {r["seed"]: r for r in by_cell.get(lam, [])}
        pp = [(a, lam_of[a["seed"]]) for a in by_cell[part] if a["seed"] in lam_of]
        summary["partial_cell"] = part
        summary["learning_per_step_vs_sync"] = {
            c: cells[c]["learning_per_step_vs_sync"]["median"] for c in (part, lam) if c in cells
        }
        summary["steps_to_090_partial_over_laminar"] = _median_json(
            [_ratio(a["steps_to_090"], b["steps_to_090"], "num") for a, b in pp]
        )
        summary["time_to_090_partial_over_laminar"] = _median_json(
            [_ratio(a["seconds_to_090"], b["seconds_to_090"], "num") for a, b in pp]
        )
        summary["time_to_090_partial_over_laminar_goal"] = ">= 1.2"
        summary["time_to_090_partial_over_laminar_from_ready"] = _median_json(
            _from_ready_ratios(pp)
        )
    return {"cells": cells, "summary": summary}


def lora_vs_full(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """LoRA cells against full fine-tuning (the default correction) at the same mode and
    staleness, paired by seed: medians of steps and seconds to 0.90, and their ratios."""
    by = {(r["cell"], r["seed"]): r for r in runs}
    out: dict[str, Any] = {}
    for cell in dict.fromkeys(r["cell"] for r in runs):
        mode, k, corr = cell.split(":")
        if not corr.startswith("lora"):
            continue
        full = f"{mode}:{k}:default"
        pairs = [(r, by.get((full, r["seed"]))) for r in runs if r["cell"] == cell]
        out[cell] = {
            "against": full,
            "lora_steps_to_090": spread([a["steps_to_090"] for a, _ in pairs]),
            "lora_seconds_to_090": spread([a["seconds_to_090"] for a, _ in pairs]),
            "lora_best_smoothed": spread([a["best_smoothed"] for a, _ in pairs]),
            "steps_to_090_lora_over_full": _median_json(
                [_ratio(a["steps_to_090"], b["steps_to_090"], "num") for a, b in pairs if b]
            ),
            "seconds_to_090_lora_over_full": _median_json(
                [_ratio(a["seconds_to_090"], b["seconds_to_090"], "num") for a, b in pairs if b]
            ),
        }
    return out or None


def plot(path: Path, runs: list[dict[str, Any]]) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        say("matplotlib is not installed: no PNG (the JSON has every figure)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_cell: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_cell.setdefault(r["cell"], []).append(r)
    fig, ax = plt.subplots(1, 2, figsize=(14, 5.5))
    for cell, rs in sorted(by_cell.items()):
        for a, key in ((ax[0], "step"), (ax[1], "t")):
            top = max(r["smoothed"][-1][key] for r in rs)
            grid = [top * i / 60 for i in range(61)]
            ys = [[_interp(r["smoothed"], key, x) for r in rs] for x in grid]
            ok = [(x, [v for v in y if v is not None]) for x, y in zip(grid, ys, strict=True)]
            ok = [(x, y) for x, y in ok if y]
            (line,) = a.plot(
                [x for x, _ in ok],
                [statistics.median(y) for _, y in ok],
                label=f"{cell} (n={len(rs)})",
            )
            a.fill_between(
                [x for x, _ in ok],
                [min(y) for _, y in ok],
                [max(y) for _, y in ok],
                color=line.get_color(),
                alpha=0.15,
            )
    for a, label in ((ax[0], "trainer step"), (ax[1], "seconds since `laminar run`")):
        for tgt in TARGETS:
            a.axhline(tgt, color="grey", lw=0.6, ls=":")
        a.set_xlabel(label)
        a.set_ylabel("held-out accuracy (3-snapshot smoothed)")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    ax[0].set_title("accuracy vs step: median and range over seeds")
    ax[1].set_title("accuracy vs wall-clock: median and range over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _interp(curve: list[dict[str, Any]], key: str, x: float) -> float | None:
    if x > curve[-1][key]:
        return None
    for p, q in zip(curve, curve[1:], strict=False):
        if p[key] <= x <= q[key]:
            return p["accuracy"] + (x - p[key]) / max(q[key] - p[key], 1e-9) * (
                q["accuracy"] - p["accuracy"]
            )
    return curve[0]["accuracy"]


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        **git_state(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=(
            f"sync vs laminar, default staleness and correction, {len(QUICK_SEEDS.split(','))} "
            "seeds"
        ),
    )
    ap.add_argument(
        "--cells", default=None, help="comma list of mode:staleness:correction (default: all)"
    )
    ap.add_argument(
        "--seeds",
        default=None,
        help=(
            "comma list of RL seeds (>= 3 for the acceptance figures; default 0,1,2, --quick "
            f"{QUICK_SEEDS})"
        ),
    )
    ap.add_argument(
        "--out", default="bench/results/learning.json", help="JSON path; the PNG goes next to it"
    )
    ap.add_argument(
        "--work", default="runs/bench-learning", help="run directories (snapshots, logs)"
    )
    ap.add_argument(
        "overrides", nargs="*", help="config key=value for every run (e.g. trainer.total_steps=60)"
    )
    args = ap.parse_args(argv)
    if args.quick and not any(o.startswith("trainer.total_steps=") for o in args.overrides):
        # both modes cross 0.90 by step ~50 (the 120-step runs): 60 steps fit 5 seeds x 2 cells
        # in the 15-minute budget (the cosine learning rate then ends at step 60, in both alike)
        args.overrides.append(f"trainer.total_steps={QUICK_STEPS}")
    cfg = load_config(DEMO_CONFIG, args.overrides)
    # no live line per run: one summary line each (the settings are a pydantic section now)
    s = demo_settings(cfg).model_copy(update={"progress_every_s": 1e9})
    default_cell = f"laminar:{cfg.buffer.max_staleness}:default"
    if args.cells:
        cells = args.cells.split(",")
    elif args.quick:
        cells = [default_cell, "sync:0:default"]
    else:
        cells = FULL_CELLS + [default_cell, "sync:0:default"]
    bad = [
        c
        for c in cells
        if len(c.split(":")) != 3
        or c.split(":")[2].partition("@")[0] not in CORRECTIONS
        or c.split(":")[0] not in ("sync", "laminar", "partial")
    ]
    if bad:
        ap.error(
            f"bad cells {bad}: use mode:staleness:correction with mode sync|laminar|partial, "
            f"correction one of {list(CORRECTIONS)}"
        )
    seeds = [int(x) for x in (args.seeds or (QUICK_SEEDS if args.quick else "0,1,2")).split(",")]
    work = Path(args.work)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from laminar.logs import configure_logging
    from laminar.tasks import countup as cu
    from laminar.tasks.evaluate import evaluate_model

    configure_logging("warning", True)
    t0 = time.time()
    train_path, eval_path, train, ev = prepare_data(work, s, 0)
    policy0 = Path(s.policy) if s.policy else warm_up(s, train, 0)
    max_tokens = cfg.rollout.sampling.max_tokens
    before = evaluate_model(str(policy0), ev, cu.verify, max_tokens=max_tokens)
    before.pop("completions", None)
    base = [
        f"model.path={policy0}",
        f"data.train={train_path}",
        f"data.eval={eval_path}",
        "trainer.eval_every=0",
        *args.overrides,
    ]
    say(f"{len(cells)} cells x {len(seeds)} seeds; start accuracy {before['accuracy']:.3f}")
    runs: list[dict[str, Any]] = []
    # seed-major, cells alternating: machine drift hits every cell alike
    for seed in seeds:
        for cell in cells:
            runs.append(run_cell(cell, seed, work, base, s, policy0, ev, before, max_tokens))
            result = {
                "config": {
                    "cells": cells,
                    "seeds": seeds,
                    "overrides": args.overrides,
                    "quick": args.quick,
                    "targets": TARGETS,
                },
                "machine": machine(),
                "wall_s": round(time.time() - t0, 1),
                **aggregate(runs, (default_cell, "sync:0:default")),
                "lora_vs_full": lora_vs_full(runs),
                "runs": runs,
            }
            out.write_text(json.dumps(result, indent=1))  # partial results survive an interrupt
    png = plot(out.with_suffix(".png"), runs)
    sm = result["summary"]
    say(
        f"done in {time.time() - t0:.0f}s: steps_to_090_laminar_over_sync "
        f"{sm['steps_to_090_laminar_over_sync']} (goal <= 1.10), time_to_090_sync_over_laminar "
        f"{sm['time_to_090_sync_over_laminar']} (goal >= 1.4); void runs {len(sm['void_runs'])}; "
        f"{out}{' + ' + str(png) if png else ''}"
    )
    print(
        f"{'cell':<24} {'steps->0.90':>14} {'s->0.90':>14} {'steps/s':>8} {'cores':>6} "
        f"{'learn/sync':>10} {'long/short':>10}"
    )
    for cell, c in result["cells"].items():

        def med(k: str, c: dict[str, Any] = c) -> str:
            v = c.get(k)
            return "-" if not v or v["median"] is None else f"{v['median']:.2f}"

        print(
            f"{cell:<24} {med('steps_to_090'):>14} {med('seconds_to_090'):>14} "
            f"{med('steps_per_s'):>8} {med('cores'):>6} {med('learning_per_step_vs_sync'):>10} "
            f"{med('audit_long_vs_short'):>10}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
