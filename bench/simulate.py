"""Discrete-event simulator of the five modes (+ laminar without repack): the sweep and its CLI.

    simscale.params_for(model, mode, n_gpus)         paper scale (7B/32B/72B, 64-1024 GPUs)
    simconfig.params_from_config(cfg, n_rollouts)    the emulated cluster of bench/cluster.py
        ──► SimParams ──► simulate(mode, params=...) ──► figures (throughput, idle, staleness, ...)
    main(): every (model, scale, mode, split, seed) on a process pool ──► table + JSON

The engine and its modelled mechanisms are described in bench/simcore.py, the paper-scale
constants in bench/simscale.py, the emulated cluster's translation in bench/simconfig.py. The
admission/staleness rules and the repack planner are the real ones (laminar.manager).

Multi-turn (tool calling, paper Fig. 12): the same sweep on simscale.MULTITURN (turns per
trajectory, per-turn lengths, long-tailed sandbox latency: bench/simcore.py) for the paper's
tool-calling model (7B) from 64 to 1024 GPUs; summary `laminar_scaling_efficiency_multiturn`
next to `best_baseline_scaling_efficiency_multiturn` (paper: 46.5% and 12.9%) and
`laminar_vs_baselines_multiturn_avg` (paper: 2.62x average over the baselines).

The strongest baseline (partial: AReaL-style partial rollout, bench/simcore.py): it and laminar
are swept on one split grid (laminar also at the paper's Table 2 row), and its figures are in
the summary beside the others (`laminar_vs_partial_1024_<model>`, 7B at 1024 GPUs past the
paper's scales in `laminar_vs_partial_1024_7B`, `laminar_vs_partial_avg` / `_max` over every
point, `laminar_vs_partial_multiturn_avg` and at the largest multi-turn scale; the paper:
1.39x average, 1.81x at most, over AReaL). It stays out of BASELINE_MODES, whose averages
are set against the paper's figures over verl-style baselines.

Run: .venv/bin/python bench/simulate.py --quick --out bench/results/simulate.json   (~minutes)
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
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simcore import SIM_MODES, Sim  # noqa: E402
from simparams import SimParams  # noqa: E402
from simscale import (  # noqa: E402
    LAMINAR_INFLIGHT,
    MINIBATCHES,
    MODELS,
    MULTITURN,
    MULTITURN_MODEL,
    TRAIN_MFU,
    balance,
    laminar_rollout_gpus,
    params_for,
    round_tp,
)

from laminar.modes import StalenessStats  # noqa: E402


def simulate(
    mode: str,
    n_gpus: int | None = None,
    model: str = "32B",
    seed: int = 0,
    *,
    params: SimParams | None = None,
    rollout_frac: float | None = None,
    warmup_steps: int = 4,
    measure_steps: int = 8,
    **overrides: Any,
) -> dict[str, Any]:
    """Simulate one mode. Either paper scale (model + n_gpus) or explicit `params` (e.g. from
    `params_from_config`). Returns throughput (tokens consumed/s), idle fraction, staleness..."""
    if params is None:
        if n_gpus is None:
            raise ValueError("give n_gpus (paper scale) or params (e.g. params_from_config)")
        params = params_for(model, mode, n_gpus, rollout_frac, **overrides)
    elif overrides:
        params = replace(params, **overrides)
    out = Sim(mode, params, seed, warmup_steps, measure_steps).run()
    out.update(
        model=model if n_gpus else None,
        n_gpus=params.n_gpus or params.n_rollouts,
        n_rollouts=params.n_rollouts,
        seed=seed,
    )
    return out


# ---- sweep, table, JSON -----------------------------------------------------------------------

BASELINE_MODES = ("one_step", "stream")
PAPER_DRAIN: dict[str, Any] = {
    "refill_per_group": False,
    "refill_versions": 0,
    "repack_by_draining": False,
}
"""The paper's rollout rule (take a batch, drain it, pull the newest; candidates by KV that did
not rise): the repack-in-isolation runs of §8.4 reproduce the paper's setup with it. With the
refill budget (simscale.REFILL_VERSIONS) the no-repack rollouts drain far less, so repack adds
+11% there instead of +27% (bench/README.md, issue 44 third session)."""
LAMINAR_MODES = ("laminar_norepack", "laminar")
SPLIT_MODES = (*BASELINE_MODES, "partial", *LAMINAR_MODES)
"""Modes on split GPUs whose rollout share is swept (the best split is kept per point). Laminar's
candidates are the paper's Table 2 row (rollout_frac None) and the same fractions as the
others: the paper chose its split for its own system, and under this cost model the best split
moves (7B at 256 GPUs: 96 rollout GPUs, not the table's 64)."""
RACE_FRACS = [0.375, 0.5, 0.625]
"""--quick, single-turn: the fractions partial and laminar are both swept over (the strongest
baseline and laminar on one grid; one_step and stream keep 0.5 and 0.75)."""

QUICK_FRACS = [0.5, 0.75]
FULL_FRACS = [0.25, 0.375, 0.5, 0.625, 0.75]


def split_options(
    mode: str, model: str, n: int, quick: bool, multiturn: bool = False
) -> list[float | None]:
    """The rollout fractions a (mode, model, scale) point runs (None: the mode's own allocation,
    Laminar's Table 2 row). Laminar gets the table's row and the grid of the others; quick keeps
    laminar without repack (context for repack's gain) and multi-turn laminar (~35 s a run) at
    the table's row, while partial keeps its sweep there."""
    if mode not in SPLIT_MODES:
        return [None]
    race = quick and not multiturn
    if mode in LAMINAR_MODES:
        if quick and (multiturn or mode == "laminar_norepack"):
            return [None]
        spec = MODELS[model]
        table = laminar_rollout_gpus(spec, n)
        grid = RACE_FRACS if race else FULL_FRACS
        # a fraction that lands on the table's row is that row (one run, not two)
        return [None, *(f for f in grid if round_tp(n * f, spec.tp_laminar) != table)]
    if race and mode == "partial":
        return list(RACE_FRACS)
    return list(QUICK_FRACS if quick else FULL_FRACS)


def mmm(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def _run_task(
    task: tuple[str, int, str, float | None, int, int, int, dict[str, Any]],
) -> dict[str, Any]:
    model, n, mode, frac, seed, warm, meas, kw = task
    r = simulate(
        mode, n, model, seed, rollout_frac=frac, warmup_steps=warm, measure_steps=meas, **kw
    )
    r["rollout_frac"] = frac
    return r


def run_all(tasks: list[tuple], jobs: int) -> list[dict[str, Any]]:
    if jobs <= 1:
        return [_run_task(t) for t in tasks]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_run_task, tasks, chunksize=1))


def merge_stale(rs: list[dict[str, Any]], key: str) -> dict[str, object]:
    st = StalenessStats()
    for r in rs:
        for k, v in r[key]["hist"].items():
            st.add(int(k), v)
    return st.summary()


def by_split(runs: list[dict[str, Any]]) -> dict[tuple[str, float | None], dict[int, Any]]:
    """One point's runs by (mode, rollout_frac), then by seed."""
    by: dict[tuple[str, float | None], dict[int, dict[str, Any]]] = {}
    for r in runs:
        by.setdefault((r["mode"], r["rollout_frac"]), {})[r["seed"]] = r
    return by


def best_split(by: dict[tuple[str, float | None], dict[int, Any]], mode: str) -> tuple:
    """The (mode, rollout_frac) of `mode`'s highest median throughput over seeds."""
    options = [(m, f) for (m, f) in by if m == mode]
    return max(
        options, key=lambda k: statistics.median(x["throughput_tok_s"] for x in by[k].values())
    )


def point_rows(runs: list[dict[str, Any]], seeds: list[int]) -> dict[str, dict[str, Any]]:
    """One (model, scale): pick each baseline's best split, then figures over seeds; ratios to
    sync are taken per seed (same seed = same length draws where the modes consume them)."""
    by = by_split(runs)
    rows = {}
    sync = by[("sync", None)]
    for mode in SIM_MODES:
        key = best_split(by, mode)
        rs = [by[key][s] for s in seeds]
        fig = lambda name, rs=rs: mmm([r[name] for r in rs])  # noqa: E731
        rows[mode] = {
            "rollouts": rs[0]["n_rollouts"],
            "rollout_frac": key[1],
            "throughput_tok_s": fig("throughput_tok_s"),
            "throughput_per_gpu": fig("throughput_per_gpu"),
            "vs_sync": mmm(
                [r["throughput_tok_s"] / sync[r["seed"]]["throughput_tok_s"] for r in rs]
            ),
            "gen_tok_s": fig("gen_tok_s"),
            "iteration_s": fig("iteration_s"),
            "rollout_idle_frac": fig("rollout_idle_frac"),
            "decode_util": fig("decode_util"),
            "trainer_busy_frac": fig("trainer_busy_frac"),
            "produced_over_consumed": fig("produced_over_consumed"),
            "staleness_consumed": merge_stale(rs, "staleness_consumed"),
            "staleness_finished": merge_stale(rs, "staleness_finished"),
            "counts": {
                k: rs[0][k]
                for k in (
                    "steps_measured",
                    "repack_rounds",
                    "moves",
                    "moved_trajs",
                    "preemptions",
                    "global_updates",
                    "pulls",
                    "interrupted_trajs",
                    "dropped_groups",
                )
            },
        }
    return rows


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def print_table(results: dict[str, dict[int, dict[str, Any]]]) -> None:
    print(
        f"\n{'model':>5} {'GPUs':>5} {'mode':>16} {'ro':>4} {'split':>5} {'tok/s':>9} "
        f"{'vs sync':>8} {'idle':>5} {'util':>5} {'train':>5} {'stale p50/max':>13}"
    )
    for model, per_n in results.items():
        for n, rows in per_n.items():
            for mode, row in rows.items():
                sc = row["staleness_consumed"]
                split = "-" if row["rollout_frac"] is None else f"{row['rollout_frac']:.3g}"
                print(
                    f"{model:>5} {n:>5} {mode:>16} {row['rollouts']:>4} {split:>5} "
                    f"{row['throughput_tok_s']['median']:>9.0f} {row['vs_sync']['median']:>7.2f}x "
                    f"{row['rollout_idle_frac']['median']:>5.2f} "
                    f"{row['decode_util']['median']:>5.2f} "
                    f"{row['trainer_busy_frac']['median']:>5.2f} {sc['p50']:>6}/{sc['max']:<6}"
                )


def multiturn_summary(
    tasks: list[tuple],
    runs: list[dict[str, Any]],
    scales: list[int],
    seeds: list[int],
    summary: dict[str, Any],
) -> dict[str, Any]:
    """The multi-turn sweep's rows, table and summary figures (added to `summary`), with the
    paper's tool-calling figures next to them."""
    per: dict[int, list[dict[str, Any]]] = {}
    for t, r in zip(tasks, runs, strict=True):
        per.setdefault(t[1], []).append(r)
    rows = {n: point_rows(per[n], seeds) for n in scales}
    print(f"\nmulti-turn tool calling ({MULTITURN_MODEL}, {MULTITURN}):")
    print_table({MULTITURN_MODEL: rows})
    lo, hi = min(scales), max(scales)
    eff = {
        mode: rows[hi][mode]["throughput_per_gpu"]["median"]
        / rows[lo][mode]["throughput_per_gpu"]["median"]
        for mode in SIM_MODES
    }
    best = max(("sync", *BASELINE_MODES), key=lambda m: eff[m])
    med = lambda n, mode: rows[n][mode]["throughput_tok_s"]["median"]  # noqa: E731
    summary["laminar_scaling_efficiency_multiturn"] = eff["laminar"]
    summary["best_baseline_scaling_efficiency_multiturn"] = eff[best]
    summary["best_baseline_multiturn"] = best
    summary["multiturn_scales"] = f"{MULTITURN_MODEL} {lo}->{hi} GPUs"
    summary["laminar_vs_sync_multiturn_avg"] = statistics.mean(
        rows[n]["laminar"]["vs_sync"]["median"] for n in scales
    )
    summary["laminar_vs_baselines_multiturn_avg"] = statistics.mean(
        med(n, "laminar") / med(n, b) for n in scales for b in ("sync", *BASELINE_MODES)
    )
    summary[f"laminar_vs_sync_multiturn_{hi}"] = rows[hi]["laminar"]["vs_sync"]["median"]
    summary["laminar_vs_partial_multiturn_avg"] = statistics.mean(
        med(n, "laminar") / med(n, "partial") for n in scales
    )
    summary[f"laminar_vs_partial_multiturn_{hi}"] = med(hi, "laminar") / med(hi, "partial")
    summary["paper_multiturn"] = {
        "laminar_vs_baselines_avg": 2.62,
        "laminar_scaling_efficiency": 0.465,
        "best_baseline_scaling_efficiency": 0.129,
    }
    print(f"scaling efficiency {lo}->{hi}: " + "  ".join(f"{k} {v:.1%}" for k, v in eff.items()))
    return {
        "model": MULTITURN_MODEL,
        "workload": MULTITURN,
        "scales": scales,
        "results": {str(n): r for n, r in rows.items()},
        "scaling_efficiency": eff,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="fewer scales/seeds/splits (minutes on 2 cores)"
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/simulate.json"))
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS))
    ap.add_argument(
        "--gpus", nargs="+", type=int, default=None, help="scales (default: per model, up to 1024)"
    )
    ap.add_argument("--seeds", type=int, default=None, help="repeats per point (seeds 0..N-1)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument(
        "--workloads",
        nargs="+",
        default=["single", "multiturn"],
        choices=["single", "multiturn"],
        help="single-turn math (the model sweep) and/or multi-turn tool calling",
    )
    args = ap.parse_args(argv)
    if "single" not in args.workloads:
        args.models = []
    models = list(MODELS) if args.models is None else args.models
    full = [64, 128, 256, 512, 1024]
    scales = {m: args.gpus or ([64, 256, 1024] if args.quick else full) for m in models}
    if "7B" in scales and not args.gpus:
        # the paper runs 7B up to 256 GPUs; past that a fixed 8192 batch trains in seconds and
        # the extrapolated 3:1 split is no configuration anyone would run
        scales["7B"] = [n for n in scales["7B"] if n <= 256]
    # quick: one seed (the simulator is deterministic per seed, and the seeds of the full runs
    # agree within 0.2%) and, single-turn, partial and laminar on RACE_FRACS (one_step and
    # stream on 0.5 and 0.75); the full run keeps the whole grid for every split mode
    seeds = list(range(args.seeds or (1 if args.quick else 3)))
    fracs = QUICK_FRACS if args.quick else FULL_FRACS

    warm, meas = (6, 8) if args.quick else (10, 10)
    t_start = time.time()
    tasks = []
    for m in models:
        for n in scales[m]:
            for mode in SIM_MODES:
                for frac in split_options(mode, m, n, args.quick):
                    tasks += [(m, n, mode, frac, s, warm, meas, {}) for s in seeds]
    # dynamic repack in isolation, as in paper §8.4 (32B, 128 GPUs, 16 rollouts; Fig. 9's
    # 512-trajectory batch per rollout): the paper measured +26% generation throughput
    repack_tasks = (
        [
            ("32B", 128, mode, None, s, warm, meas, {"rollout_groups": 32, **PAPER_DRAIN})
            for mode in ("laminar_norepack", "laminar")
            for s in seeds
        ]
        if models
        else []
    )
    # 7B past the paper's scales, for the strongest baseline alone: laminar and partial at 1024
    # GPUs, each at its best split (summary `laminar_vs_partial_1024_7B`)
    beyond_tasks = (
        [
            ("7B", 1024, mode, frac, s, warm, meas, {})
            for mode in ("partial", "laminar")
            for frac in split_options(mode, "7B", 1024, args.quick)
            for s in seeds
        ]
        if "7B" in models and not args.gpus
        else []
    )
    mt_scales = (
        []
        if "multiturn" not in args.workloads
        else args.gpus or ([64, 1024] if args.quick else full)
    )
    mt_tasks = [
        (MULTITURN_MODEL, n, mode, frac, s, warm, meas, MULTITURN)
        for n in mt_scales
        for mode in SIM_MODES
        for frac in split_options(mode, MULTITURN_MODEL, n, args.quick, multiturn=True)
        for s in seeds
    ]
    print(
        f"simulating {len(tasks) + len(repack_tasks) + len(beyond_tasks) + len(mt_tasks)} runs "
        f"on {args.jobs} processes ...",
        file=sys.stderr,
    )
    # the multi-turn runs first: they are the long ones (~10-45 s against ~1-5 s), so the pool
    # ends on short runs instead of one worker finishing a long one alone
    all_runs = run_all(mt_tasks + tasks + repack_tasks + beyond_tasks, args.jobs)
    n_single = len(mt_tasks) + len(tasks) + len(repack_tasks)
    mt_runs, runs, beyond_runs = (
        all_runs[: len(mt_tasks)],
        all_runs[len(mt_tasks) : n_single],
        all_runs[n_single:],
    )
    point_runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for t, r in zip(tasks, runs, strict=False):
        point_runs.setdefault((t[0], t[1]), []).append(r)
    results = {m: {n: point_rows(point_runs[(m, n)], seeds) for n in scales[m]} for m in models}
    rep_runs = runs[len(tasks) :]
    rep_gain = [
        b["gen_tok_s"] / a["gen_tok_s"]
        for a, b in zip(rep_runs[: len(seeds)], rep_runs[len(seeds) :], strict=True)
    ]
    summary: dict[str, Any] = {}
    multiturn: dict[str, Any] = {}
    if mt_tasks:
        multiturn = multiturn_summary(mt_tasks, mt_runs, mt_scales, seeds, summary)
    if not models:
        doc = {
            "bench": "simulate",
            "config": {
                "quick": args.quick,
                "workloads": args.workloads,
                "seeds": seeds,
                "baseline_rollout_fracs": fracs,
                "race_rollout_fracs": RACE_FRACS if args.quick else fracs,
                "laminar_table_row": True,
                "warmup_steps": warm,
                "measure_steps": meas,
            },
            "git_commit": git_commit(),
            "multiturn": multiturn,
            "summary": summary,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
        print("\nsummary:", json.dumps(summary, indent=1))
        print(f"wrote {args.out}")
        return 0
    print_table(results)
    scaling = {
        m: {
            mode: (
                per_n[max(per_n)][mode]["throughput_per_gpu"]["median"]
                / per_n[min(per_n)][mode]["throughput_per_gpu"]["median"]
            )
            for mode in SIM_MODES
        }
        for m, per_n in results.items()
    }
    print("\nscaling efficiency (throughput per GPU, largest / smallest scale):")
    for m, row in scaling.items():
        print(
            f"  {m:>4} {min(scales[m])}->{max(scales[m])}: "
            + "  ".join(f"{k} {v:.0%}" for k, v in row.items())
        )
    at_1024 = [m for m in models if 1024 in results[m]]
    if at_1024:
        per = {m: results[m][1024]["laminar"]["vs_sync"]["median"] for m in at_1024}
        summary["laminar_vs_sync_1024"] = statistics.mean(per.values())
        summary["laminar_vs_sync_1024_models"] = at_1024
        summary.update({f"laminar_vs_sync_1024_{m}": v for m, v in per.items()})
        for mode in ("one_step", "stream", "partial", "laminar_norepack"):
            summary[f"{mode}_vs_sync_1024"] = statistics.mean(
                results[m][1024][mode]["vs_sync"]["median"] for m in at_1024
            )
        # the strongest baseline at the largest scale, per model size (paper: 1.39x average)
        summary.update(
            {
                f"laminar_vs_partial_1024_{m}": results[m][1024]["laminar"]["throughput_tok_s"][
                    "median"
                ]
                / results[m][1024]["partial"]["throughput_tok_s"]["median"]
                for m in at_1024
            }
        )
    pts = [(m, n, rows) for m, per_n in results.items() for n, rows in per_n.items()]
    med = lambda rows, mode: rows[mode]["throughput_tok_s"]["median"]  # noqa: E731
    summary["laminar_vs_sync_avg"] = statistics.mean(
        rows["laminar"]["vs_sync"]["median"] for _, _, rows in pts
    )
    summary["laminar_vs_sync_max"] = max(rows["laminar"]["vs_sync"]["median"] for _, _, rows in pts)
    for base in BASELINE_MODES:
        summary[f"laminar_vs_{base}_avg"] = statistics.mean(
            med(rows, "laminar") / med(rows, base) for _, _, rows in pts
        )
    order = {
        f"{m}@{n}": med(rows, "sync") <= min(med(rows, b) for b in BASELINE_MODES)
        and max(med(rows, b) for b in BASELINE_MODES) < med(rows, "laminar")
        for m, n, rows in pts
    }
    vs_partial = [med(rows, "laminar") / med(rows, "partial") for _, _, rows in pts]
    summary["laminar_vs_partial_avg"] = statistics.mean(vs_partial)
    summary["laminar_vs_partial_max"] = max(vs_partial)
    summary["laminar_vs_partial_at"] = {
        f"{m}@{n}": round(v, 3) for (m, n, _), v in zip(pts, vs_partial, strict=True)
    }
    # per model at its largest scale (1024 GPUs; 7B stops at 256, as the paper's 7B runs do)
    summary["laminar_vs_partial_largest"] = {
        m: {
            "gpus": max(per_n),
            "ratio": med(per_n[max(per_n)], "laminar") / med(per_n[max(per_n)], "partial"),
        }
        for m, per_n in results.items()
    }
    if beyond_runs:
        by = by_split(beyond_runs)
        fig = lambda rs, k: statistics.median(r[k] for r in rs.values())  # noqa: E731
        best = {mode: by[best_split(by, mode)] for mode in ("partial", "laminar")}
        summary["laminar_vs_partial_1024_7B"] = fig(best["laminar"], "throughput_tok_s") / fig(
            best["partial"], "throughput_tok_s"
        )
        summary["beyond_paper_7B_1024"] = {
            mode: {
                "rollout_frac": next(iter(rs.values()))["rollout_frac"],
                "rollouts": next(iter(rs.values()))["n_rollouts"],
                **{k: fig(rs, k) for k in ("throughput_tok_s", "decode_util", "trainer_busy_frac")},
            }
            for mode, rs in best.items()
        }
    summary["paper_laminar_vs_areal"] = {"avg": 1.39, "max": 1.81}
    summary["ordering_holds"] = f"{sum(order.values())}/{len(order)}"
    summary["ordering_fails_at"] = [k for k, ok in order.items() if not ok]
    summary["one_step_over_stream_avg"] = statistics.mean(
        med(rows, "one_step") / med(rows, "stream") for _, _, rows in pts
    )
    summary["laminar_scaling_efficiency"] = {m: row["laminar"] for m, row in scaling.items()}
    summary["best_baseline_scaling_efficiency"] = {
        m: max(row[k] for k in ("sync", *BASELINE_MODES)) for m, row in scaling.items()
    }
    summary["repack_gen_gain_32B_128"] = statistics.median(rep_gain) - 1
    summary["wall_s"] = round(time.time() - t_start, 1)
    print("\nsummary:", json.dumps(summary, indent=1))
    doc = {
        "bench": "simulate",
        "config": {
            "quick": args.quick,
            "scales": scales,
            "seeds": seeds,
            "baseline_rollout_fracs": fracs,
            "race_rollout_fracs": RACE_FRACS if args.quick else fracs,
            "laminar_table_row": True,
            "warmup_steps": warm,
            "measure_steps": meas,
            "train_mfu": TRAIN_MFU,
            "minibatches": MINIBATCHES,
            "laminar_inflight_batches": LAMINAR_INFLIGHT,
            "specs": {
                m: {
                    **asdict(s),
                    "train_tok_s_per_gpu": s.train_tok_s_per_gpu(),
                    "minibatch_floor_s": s.minibatch_floor_s(),
                    "balance_at_paper_rows": {
                        n: round(balance(s, n), 2) for n in s.laminar_rollout_gpus
                    },
                }
                for m, s in MODELS.items()
            },
            "params_laminar_at_max_scale": {
                m: asdict(params_for(m, "laminar", max(scales[m]))) for m in models
            },
        },
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "git_commit": git_commit(),
        "results": {m: {str(n): rows for n, rows in per_n.items()} for m, per_n in results.items()},
        "scaling_efficiency": scaling,
        "multiturn": multiturn,
        "repack_32B_128": {
            "gen_gain": mmm([g - 1 for g in rep_gain]),
            "paper": 0.26,
            "runs": rep_runs,
        },
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
