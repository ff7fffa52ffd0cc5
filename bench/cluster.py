"""Emulated-scale cluster benchmark: the real system (nodes, ZeroMQ, relay, manager, buffer) with
sim rollout engines and a sim trainer, N = 8..128 emulated rollout GPUs on 2 CPU cores.

    for repeat r, for N, for mode in (sync, one_step, stream, partial, laminar_norepack, laminar):
        bench/cluster_run.py run ──► control process (manager, buffer, relay, trainer; ipc)
                                      └─► worker process (N RolloutNodes with sim engines)
        ──► figures of one window (training / generation throughput, idle fractions, KV, staleness,
            event-loop lag and CPU of both processes)
    ──► min/median/max over repeats, ratios per repeat (same seed in every mode of a repeat)
    ──► cross-check: bench/simulate.py's simulate() on the very same parameters (bench/simconfig.py)
        plus the delays the runs measured (measured_latencies; mechanisms in bench/simrepack.py),
        measured over the emulation's own window (steps ending in [warmup_s, warmup_s + window_s])
    ──► JSON (--out F, default bench/results/cluster.json), a table, a plot beside F (F with .png),
        and where each mode's rollout-time goes (decode at B / below B: drain, refill, repack move
        / loading / idle; cluster_run.BREAKDOWN), a stacked bar per mode (F_breakdown.png); a run
        writes only beside its --out, never over another run's committed plots

Workload (BenchParams in bench/cluster_run.py, documented in bench/README.md): response lengths
lognormal with p50 = 100 and p99 = 10 x p50, capped at 1024; decode step 5 ms flat up to B = 8
running sequences; a baseline rollout holds 2 groups of 4 (= B), a laminar one asks for a group
whenever its unfinished sequences leave room within 12 (rollout.refill_slots: up to 4 queued) and
retracts the groups that never started when newer weights are wanted; a global batch is 2 groups per
rollout; the sim trainer spends 5e-4 / N s per consumed token (the trainer grows with the cluster),
so it is busy about a third of the time under laminar and never the bottleneck.

Multi-turn (--workload multiturn): the same comparison on tool-calling episodes: every rollout
runs laminar.envs.sim:SimToolEnv (up to 8 tool calls with a long-tailed sandbox latency, tool
output tokens between model turns; cluster_run.MULTITURN), the sim engine ends each model turn
at a drawn length, and bench/simulate.py models the same episodes for the cross-check. Summary
`laminar_vs_sync_64_multiturn` and `laminar_vs_baselines_64_multiturn` (mean of laminar over
sync, one_step and stream), to set against the paper's 2.62x average over the baselines.

The strongest baseline (mode partial: AReaL-style partial rollout, configured as laminar is:
the same queue and staleness bound, only the update differs: global, interrupting every
in-flight trajectory, which continues under the new version): `laminar_vs_partial_64` (the
paper: 1.39x average over AReaL, 1.81x at most), `breakdown_partial_64` beside
`breakdown_laminar_64` (where the rollout-time goes in each), and with --workload multiturn
`laminar_vs_partial_64_multiturn`.

Run:
    .venv/bin/python bench/cluster.py --quick --out bench/results/cluster.json    (~12 min: N = 64)
    .venv/bin/python bench/cluster.py --quick --workload multiturn \\
        --out bench/results/cluster_quick_multiturn.json
    .venv/bin/python bench/cluster.py                                             (N = 8..128, ~1 h)
    .venv/bin/python bench/cluster.py --resim bench/results/cluster.json \\
        --out bench/results/cluster.json
        (no emulation: only the simulator, cross-check and summary again, against the stored runs;
        ~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from cluster_run import (  # noqa: E402
    MODES,
    MULTITURN,
    BenchParams,
    dilate,
    for_mode,
    make_config,
)

SIM_SEEDS = 20
"""Seeds of the simulator per point in the cross-check (at least; more at small N, see
sim_seeds)."""


def sim_seeds(n: int, repeats: int) -> list[int]:
    """The simulator's seeds at N rollouts: its figures come from the emulation's short window (4-6
    global steps), where one batch's longest trajectory sets an iteration, and at small N that
    longest one varies most (64 samples a batch at N = 8) while a run costs least: 320 / N seeds
    there (40 at N = 8), SIM_SEEDS from N = 16 on."""
    return list(range(max(repeats, SIM_SEEDS, 320 // max(1, n))))


FIGS = (
    "train_tok_s",
    "gen_tok_s",
    "rollout_idle_frac",
    "trainer_idle_frac",
    "decode_util",
    "kv_use",
    "iteration_s",
    "trainer_push_s_median",
)


def mmm(xs: list[float]) -> dict[str, float]:
    xs = [x for x in xs if x == x]  # NaN-safe
    if not xs:
        return {"min": float("nan"), "median": float("nan"), "max": float("nan")}
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def run_one(mode: str, n: int, seed: int, prm: BenchParams, keep: Path | None) -> dict[str, Any]:
    prm = for_mode(prm, mode)  # the barrier modes' own window, where set
    with tempfile.TemporaryDirectory(prefix="lam-cb-") as tmp:
        out = Path(tmp) / "fig.json"
        cmd = [
            sys.executable,
            str(HERE / "cluster_run.py"),
            "run",
            "--mode",
            mode,
            "--n",
            str(n),
            "--seed",
            str(seed),
            "--params",
            json.dumps(asdict(prm)),
            "--out",
            str(out),
        ]
        if keep is not None:
            cmd += ["--work", str(keep / f"{mode}-n{n}-s{seed}")]
        t0 = time.time()
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=prm.warmup_s + prm.window_s + prm.ready_timeout_s + 300,
        )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"{mode} N={n} seed={seed} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        fig = json.loads(out.read_text())
        fig["wall_s"] = round(time.time() - t0, 1)
        return fig


def trained_nothing(fig: dict[str, Any]) -> str | None:
    """Why a run is void (no trainer step ended in its window: every ratio against it would be
    0 or a division by zero), with what the rollouts counted; None when it trained."""
    if fig.get("steps_in_window", 0) > 0 and fig.get("train_tok_s", 0.0) > 0:
        return None
    c = fig.get("rollout_counters", {})
    agent = {k: v for k, v in c.items() if k.startswith("agent_")}
    return (
        f"{fig.get('mode')} N={fig.get('n')} seed={fig.get('seed')} trained nothing in its "
        f"{fig.get('window_s')} s window (gen {fig.get('gen_tok_s', float('nan')):.0f} tok/s, "
        f"start-up {fig.get('startup_s')} s, load {fig.get('loadavg_1m')}, agent counters "
        f"{agent or 'none'}): the rollouts did not deliver whole batches in time"
    )


def merge_staleness(runs: list[dict[str, Any]]) -> dict[str, Any]:
    from laminar.modes import StalenessStats

    st = StalenessStats()
    for r in runs:
        for k, v in r["staleness"]["hist"].items():
            st.add(int(k), v)
    return st.summary()


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures of one (N, mode) over its repeats."""
    row: dict[str, Any] = {f: mmm([r.get(f, float("nan")) for r in runs]) for f in FIGS}
    row["staleness"] = merge_staleness(runs)
    row["steps_in_window"] = [r["steps_in_window"] for r in runs]
    row["repack"] = {
        k: mmm([r["repack"][k] for r in runs])
        for k in ("moves", "trajectories", "failed", "overhead_s_mean")
    }
    row["control"] = {
        k: mmm([r["control"][k] for r in runs])
        for k in ("cpu_frac", "lag_ms_p50", "lag_ms_p99", "lag_ms_max")
    }
    row["worker"] = {
        k: mmm([r["worker"][k] for r in runs])
        for k in ("cpu_frac", "lag_ms_p50", "lag_ms_p99", "lag_ms_max")
    }
    bds = [r["breakdown"] for r in runs if "breakdown" in r]
    if bds:  # median share of each state over the repeats (see cluster_run.BREAKDOWN)
        row["breakdown"] = {
            part: {k: statistics.median(b[part][k] for b in bds) for k in bds[0][part]}
            for part in ("time", "util")
        }
    row["loadavg_1m"] = mmm(
        [r["loadavg_1m"]["start"] for r in runs] + [r["loadavg_1m"]["end"] for r in runs]
    )
    return row


def _partial_mean(runs: list[dict[str, Any]], where: str, name: str) -> float | None:
    """Median over runs of a metric mean the nodes recorded (None: no run recorded it)."""
    xs = [r[where][name]["mean"] for r in runs if name in (r.get(where) or {})]
    return statistics.median(xs) if xs else None


def measured_latencies(runs: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """What the emulation measured that the simulator needs as inputs: a rollout's weight load
    (relay pull; in global modes the whole update waits for it), the trainer's push stall, and
    for laminar the control plane's delays (see bench/simrepack.py):

    - repack_move_s, how long moved trajectories decode nowhere: half the export round trip (the
      source aborts when the request lands) + the import, where the manager timed those
      (move_export_s, move_place_s); older runs only have the whole round's overhead
      (repack.overhead_s_mean: export + import + refresh of the slowest move), an upper bound;
    - status_age_s, the period of the status reports repack plans from, for runs whose rollouts
      did not push their status on change: twice the measured mean age of the statuses moves were
      planned on (a periodic report's mean age is half its period), or the heartbeat (configured)
      where that was not measured; runs that pushed (rollout counter status_pushed) keep the
      heartbeat period plus the configured push on change (params_from_config), and the age they
      measured is compared with the simulator's (`view_age_s`), not fed in;
    - prompt_rtt_s, a dry rollout's prompt request round trip, where the rollouts timed it;
    - the code the runs measured: runs from before the rollouts timed their refills (no
      rollout_partials) neither pushed their status nor asked for prompts while loading, so
      those two mechanisms are off for them."""
    loads = [r["weight_load_s"]["mean"] for r in runs if r.get("weight_load_s")]
    pushes = [
        r["trainer_push_s_median"]
        for r in runs
        if r.get("trainer_push_s_median") == r.get("trainer_push_s_median")
    ]
    load = statistics.median(loads) if loads else 0.0
    push = statistics.median(pushes) if pushes else 0.0
    if mode == "partial":  # the whole interrupt (abort + load + resubmission), where timed
        held = _partial_mean(runs, "rollout_partials", "interrupt_s")
        part: dict[str, Any] = {
            "global_update_s": load if held is None else held,
            "actor_push_s": push,
        }
        rtt = _partial_mean(runs, "rollout_partials", "prompt_rtt_idle_s")
        if rtt is not None:
            part["prompt_rtt_s"] = rtt
        return part
    if not mode.startswith("laminar"):
        return {"global_update_s": load}
    out: dict[str, Any] = {"relay_pull_s": load, "actor_push_s": push}
    if not any("rollout_partials" in r for r in runs):
        out.update(prompt_during_load=False, status_push_min_s=0.0)  # older code: neither mechanism
    rtt = _partial_mean(runs, "rollout_partials", "prompt_rtt_idle_s")
    if rtt is not None:
        out["prompt_rtt_s"] = rtt
    if mode == "laminar":
        export = _partial_mean(runs, "manager_partials", "move_export_s")
        place = _partial_mean(runs, "manager_partials", "move_place_s")
        if export is not None and place is not None:
            out["repack_move_s"] = export / 2 + place
        else:
            rounds = [
                r["repack"]["overhead_s_mean"] for r in runs if r.get("repack", {}).get("moves")
            ]
            out["repack_move_s"] = statistics.median(rounds) if rounds else 0.0
        age = _partial_mean(runs, "manager_partials", "repack_status_age_s")
        pushed = any((r.get("rollout_counters") or {}).get("status_pushed") for r in runs)
        if age is not None and not pushed:
            out["status_age_s"] = 2 * age
        elif not pushed:
            out["status_push_min_s"] = 0.0
    return out


def simulate_point(
    prm: BenchParams,
    n: int,
    seeds: list[int],
    runs: dict[tuple[int, str], list[dict]] | None = None,
) -> dict[str, dict[str, Any]]:
    """bench/simulate.py on the same parameters: throughput per mode (min/median/max over seeds).
    With `runs`, the weight-load and push latencies the emulation measured go in as well."""
    from simconfig import params_from_config
    from simulate import simulate

    with tempfile.TemporaryDirectory(prefix="lam-cbs-") as tmp:
        out: dict[str, dict[str, Any]] = {}
        for mode in MODES:
            cfg = make_config(mode, n, 0, prm, Path(tmp), Path(tmp))
            lat = measured_latencies(runs[(n, mode)], mode) if runs else {}
            # measured over the emulation's own window (a fixed time after start, steps ending in
            # it)
            p = params_from_config(
                cfg,
                n,
                prompt_tokens=prm.prompt_tokens,
                fixed_window_s=(prm.warmup_s, for_mode(prm, mode).window_s),
                **lat,
            )
            rs = [simulate(mode, params=p, seed=s) for s in seeds]
            out[mode] = {
                "train_tok_s": mmm([r["throughput_tok_s"] for r in rs]),
                "gen_tok_s": mmm([r["gen_tok_s"] for r in rs]),
                "rollout_idle_frac": mmm([r["rollout_idle_frac"] for r in rs]),
                "decode_util": mmm([r["decode_util"] for r in rs]),
                "trainer_busy_frac": mmm([r["trainer_busy_frac"] for r in rs]),
                "latencies": lat,
                "view_age_s": mmm([r["view_age_s"] for r in rs]),
                "counts": {
                    k: mmm([r[k] for r in rs])
                    for k in (
                        "moves",
                        "moved_trajs",
                        "export_missing",
                        "export_empty",
                        "import_rejected",
                        "restarted_from_prompt",
                        "status_pushes",
                    )
                },
            }
        return out


def ratios(
    results: dict[int, dict[str, Any]], runs: dict[tuple[int, str], list[dict]], n: int
) -> dict[str, Any]:
    """Per-repeat ratios at one N (same seed across modes), then min/median/max."""

    def per(mode: str, base: str, fig: str) -> dict[str, float]:
        a = {r["seed"]: r.get(fig, float("nan")) for r in runs[(n, mode)]}
        b = {r["seed"]: r.get(fig, float("nan")) for r in runs[(n, base)]}
        return mmm([a[s] / b[s] for s in a if s in b and b[s]])

    out = {f"{m}_vs_sync": per(m, "sync", "train_tok_s") for m in MODES if m != "sync"}
    out["laminar_vs_stream"] = per("laminar", "stream", "train_tok_s")
    out["laminar_vs_partial"] = per("laminar", "partial", "train_tok_s")
    out["laminar_vs_one_step"] = per("laminar", "one_step", "train_tok_s")
    out["repack_vs_norepack_gen"] = per("laminar", "laminar_norepack", "gen_tok_s")
    out["repack_vs_norepack_train"] = per("laminar", "laminar_norepack", "train_tok_s")
    return out


def cross_check(
    emu: dict[str, Any], sim: dict[str, Any], emu_ratios: dict[str, Any]
) -> dict[str, Any]:
    """Throughput ratios (mode / sync, laminar / partial, and repack / no repack) in emulation vs
    simulation."""
    out = {}
    sync_sim = sim["sync"]["train_tok_s"]["median"]
    for m in MODES:
        if m == "sync":
            continue
        e = emu_ratios[f"{m}_vs_sync"]["median"]
        s = sim[m]["train_tok_s"]["median"] / sync_sim
        out[f"{m}_vs_sync"] = {"emulation": e, "simulation": s, "rel_err": abs(e - s) / s}
    e = emu_ratios["laminar_vs_partial"]["median"]
    s = sim["laminar"]["train_tok_s"]["median"] / sim["partial"]["train_tok_s"]["median"]
    out["laminar_vs_partial"] = {"emulation": e, "simulation": s, "rel_err": abs(e - s) / s}
    e = emu_ratios["repack_vs_norepack_gen"]["median"]
    s = sim["laminar"]["gen_tok_s"]["median"] / sim["laminar_norepack"]["gen_tok_s"]["median"]
    out["repack_vs_norepack_gen"] = {"emulation": e, "simulation": s, "rel_err": abs(e - s) / s}
    return out


def analyse(
    prm: BenchParams,
    ns: list[int],
    repeats: int,
    runs: dict[tuple[int, str], list[dict[str, Any]]],
    failed: list[dict[str, Any]],
    config: dict[str, Any],
    machine: dict[str, Any],
    commit: str,
    t_start: float,
    wall_s: float | None = None,
) -> dict[str, Any]:
    """Everything after the emulation runs: aggregates, ratios, the simulator on the same
    parameters (+ the latencies the runs measured), the cross-check and the summary."""
    results = {n: {m: aggregate(runs[(n, m)]) for m in MODES} for n in ns}
    rat = {n: ratios(results, runs, n) for n in ns}
    print("cross-checking with bench/simulate.py ...", file=sys.stderr, flush=True)
    # the simulator's own seeds (its length draws are not the emulation's hashed ones): more than
    # the emulation's repeats, because a batch's longest trajectory makes one seed's figure noisy
    # (sync at N = 8: +-8% between seeds) and that noise is not a mechanism
    sims = {n: simulate_point(prm, n, sim_seeds(n, repeats), runs) for n in ns}
    sims_ideal = {n: simulate_point(prm, n, sim_seeds(n, repeats)) for n in ns}
    checks = {n: cross_check(results[n], sims[n], rat[n]) for n in ns}
    checks_ideal = {n: cross_check(results[n], sims_ideal[n], rat[n]) for n in ns}
    print_table(results, rat)
    print_checks(checks)
    n0 = 64 if 64 in ns else max(ns)
    errs = [c["rel_err"] for per_n in checks.values() for c in per_n.values()]
    summary = {
        f"laminar_vs_sync_{n0}": rat[n0]["laminar_vs_sync"]["median"],
        f"laminar_vs_stream_{n0}": rat[n0]["laminar_vs_stream"]["median"],
        # the strongest baseline (AReaL-style partial rollout); the paper: 1.39x average
        f"laminar_vs_partial_{n0}": rat[n0]["laminar_vs_partial"]["median"],
        "laminar_vs_partial": {str(n): rat[n]["laminar_vs_partial"]["median"] for n in ns},
        "paper_laminar_vs_areal": {"avg": 1.39, "max": 1.81},
        "repack_vs_norepack": rat[n0]["repack_vs_norepack_gen"]["median"],
        "repack_vs_norepack_train": rat[n0]["repack_vs_norepack_train"]["median"],
        "repack_kv_use": {
            "laminar": results[n0]["laminar"]["kv_use"]["median"],
            "laminar_norepack": results[n0]["laminar_norepack"]["kv_use"]["median"],
        },
        "repack_gen_tok_s": {
            "laminar": results[n0]["laminar"]["gen_tok_s"]["median"],
            "laminar_norepack": results[n0]["laminar_norepack"]["gen_tok_s"]["median"],
        },
        "laminar_ge_norepack_at": {
            str(n): rat[n]["repack_vs_norepack_train"]["median"] >= 1.0 for n in ns
        },
        "laminar_vs_sync": {str(n): rat[n]["laminar_vs_sync"]["median"] for n in ns},
        "sim_vs_emulation_max_rel_err": max(errs),
        "sim_vs_emulation_rel_err": {
            str(n): {k: round(v["rel_err"], 3) for k, v in c.items()} for n, c in checks.items()
        },
        "sim_vs_emulation_max_rel_err_zero_latency": max(
            c["rel_err"] for per_n in checks_ideal.values() for c in per_n.values()
        ),
        "max_loop_lag_ms_p99": max(
            max(r["control"]["lag_ms_p99"]["max"], r["worker"]["lag_ms_p99"]["max"])
            for rows in results.values()
            for r in rows.values()
        ),
        "max_cpu_frac": max(
            max(r["control"]["cpu_frac"]["max"], r["worker"]["cpu_frac"]["max"])
            for rows in results.values()
            for r in rows.values()
        ),
        "wall_s": round(time.time() - t_start, 1) if wall_s is None else wall_s,
    }
    summary[f"laminar_vs_sync_{n0}_ge_2"] = summary[f"laminar_vs_sync_{n0}"] >= 2.0
    # utilisation beside staleness (issue 18): every mode's decode_util next to the staleness
    # of the trajectories its trainer consumed, so more slots used never hides staler data
    for m in MODES:
        summary[f"decode_util_{m}_{n0}"] = results[n0][m]["decode_util"]["median"]
        st = results[n0][m]["staleness"]
        summary[f"staleness_{m}_{n0}"] = {k: st.get(k) for k in ("mean", "p50", "p99", "max")}
    summary[f"staleness_p99_laminar_{n0}"] = results[n0]["laminar"]["staleness"].get("p99")
    for m in ("laminar", "partial"):  # where the time goes in each: the gap between the two
        if "breakdown" in results[n0][m]:
            summary[f"breakdown_{m}_{n0}"] = results[n0][m]["breakdown"]
    summary[f"interrupted_partial_{n0}"] = mmm(
        [(r.get("rollout_counters") or {}).get("interrupted", 0) for r in runs[(n0, "partial")]]
    )
    if prm.workload != "single":  # the same figures, named for the workload (the files differ too)
        sfx = f"_{prm.workload}"
        summary["workload"] = prm.workload
        summary[f"laminar_vs_sync_{n0}{sfx}"] = summary[f"laminar_vs_sync_{n0}"]
        summary[f"laminar_vs_partial_{n0}{sfx}"] = summary[f"laminar_vs_partial_{n0}"]
        summary[f"laminar_vs_baselines_{n0}{sfx}"] = statistics.mean(
            rat[n0][k]["median"]
            for k in ("laminar_vs_sync", "laminar_vs_one_step", "laminar_vs_stream")
        )
        summary[f"sim_vs_emulation_max_rel_err{sfx}"] = summary["sim_vs_emulation_max_rel_err"]
        summary["paper_laminar_vs_baselines_multiturn_avg"] = 2.62
    print("\nsummary:", json.dumps(summary, indent=1))
    return {
        "bench": "cluster",
        "config": config,
        "machine": machine,
        "git_commit": commit,
        "results": {str(n): rows for n, rows in results.items()},
        "ratios": {str(n): r for n, r in rat.items()},
        "simulation": {str(n): s for n, s in sims.items()},
        "simulation_zero_latency": {str(n): s for n, s in sims_ideal.items()},
        "cross_check": {str(n): c for n, c in checks.items()},
        "cross_check_zero_latency": {str(n): c for n, c in checks_ideal.items()},
        "runs": {f"{n}/{m}": rs for (n, m), rs in runs.items()},
        "failed_runs": failed,
        "summary": summary,
    }


def resim(path: Path) -> dict[str, Any]:
    """Recompute only the simulation, cross-check and summary against the emulation runs stored
    in an earlier results file: seconds per calibration step instead of a 45-minute sweep."""
    old = json.loads(path.read_text())
    cfg = old["config"]
    prm = BenchParams.from_dict(cfg["params"])
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for key, rs in old["runs"].items():
        n, mode = key.split("/", 1)
        runs[(int(n), mode)] = rs
    ns = [n for n in cfg["ns"] if all(runs.get((n, m)) for m in MODES)]
    t0 = time.time()
    doc = analyse(
        prm,
        ns,
        cfg["repeats"],
        runs,
        old.get("failed_runs", []),
        cfg,
        old["machine"],
        old["git_commit"],
        t0,
        wall_s=old["summary"].get("wall_s"),
    )
    doc["resim"] = {
        "from": str(path),
        "git_commit": git_commit(),
        "sim_files_modified": sim_dirty(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sim_wall_s": round(time.time() - t0, 1),
        "note": "emulation runs (runs, results, ratios, machine, git_commit) are from the original "
        "sweep; simulation, cross_check and summary were recomputed by bench/cluster.py --resim",
    }
    return doc


def sim_dirty() -> bool:
    """Do the simulator's files differ from the commit (the figures came from uncommitted code)?"""
    files = ["simulate.py", "simcore.py", "simrepack.py", "simscale.py", "cluster.py"]
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--", *files],
            capture_output=True,
            text=True,
            cwd=HERE,
            timeout=10,
        ).stdout
    except OSError:
        return True
    return bool(out.strip())


def git_commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def print_table(results: dict[int, dict[str, Any]], rat: dict[int, dict[str, Any]]) -> None:
    print(
        f"\n{'N':>4} {'mode':>16} {'train tok/s':>12} {'gen tok/s':>10} {'vs sync':>8} "
        f"{'ro idle':>7} {'tr idle':>7} {'util':>5} {'KV':>5} {'stale p50/max':>13} "
        f"{'lag p99 ms':>10} {'cpu':>9}"
    )
    for n, rows in results.items():
        for mode, row in rows.items():
            vs = 1.0 if mode == "sync" else rat[n][f"{mode}_vs_sync"]["median"]
            st, c, w = row["staleness"], row["control"], row["worker"]
            lag = max(c["lag_ms_p99"]["median"], w["lag_ms_p99"]["median"])
            cpu = f"{c['cpu_frac']['median']:.2f}/{w['cpu_frac']['median']:.2f}"
            print(
                f"{n:>4} {mode:>16} {row['train_tok_s']['median']:>12.0f} "
                f"{row['gen_tok_s']['median']:>10.0f} {vs:>7.2f}x "
                f"{row['rollout_idle_frac']['median']:>7.2f} "
                f"{row['trainer_idle_frac']['median']:>7.2f} {row['decode_util']['median']:>5.2f} "
                f"{row['kv_use']['median']:>5.3f} {st['p50']:>6}/{st['max']:<6} {lag:>10.0f} "
                f"{cpu:>9}"
            )


def print_checks(checks: dict[int, dict[str, Any]]) -> None:
    print(f"\n{'N':>4} {'ratio':>26} {'emulation':>9} {'simulation':>10} {'rel err':>7}")
    for n, per in checks.items():
        for k, c in per.items():
            print(
                f"{n:>4} {k:>26} {c['emulation']:>9.3f} {c['simulation']:>10.3f} "
                f"{c['rel_err']:>7.3f}"
            )


def markdown_table(doc: dict[str, Any]) -> str:
    """The cross-check as bench/README.md's comparison table (emulation median and range over
    the repeats, simulation median over its seeds, relative error)."""
    names = {
        "one_step_vs_sync": "one_step / sync",
        "stream_vs_sync": "stream / sync",
        "partial_vs_sync": "partial / sync",
        "laminar_vs_partial": "laminar / partial",
        "laminar_norepack_vs_sync": "laminar_norepack / sync",
        "laminar_vs_sync": "laminar / sync",
        "repack_vs_norepack_gen": "repack / no repack (gen)",
    }
    rows = [
        "| N | ratio | emulation median (min-max over repeats) | simulation (median over seeds) | "
        "rel. err |",
        "|---:|---|---:|---:|---:|",
    ]
    for n, per in doc["cross_check"].items():
        for k, c in per.items():
            r = doc["ratios"][n][k]
            rows.append(
                f"| {n} | {names.get(k, k)} | {c['emulation']:.2f} ({r['min']:.2f}-{r['max']:.2f}) "
                f"| {c['simulation']:.2f} | {c['rel_err']:.3f} |"
            )
    rows.append(
        f"\nsim_vs_emulation_max_rel_err = {doc['summary']['sim_vs_emulation_max_rel_err']:.3f}"
    )
    return "\n".join(rows)


def plot(doc: dict[str, Any], path: Path) -> None:
    results = {int(n): rows for n, rows in doc["results"].items()}
    sims = {int(n): rows for n, rows in doc["simulation"].items()}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(results)
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    for mode in MODES:
        med = [results[n][mode]["train_tok_s"]["median"] for n in ns]
        lo = [results[n][mode]["train_tok_s"]["min"] for n in ns]
        hi = [results[n][mode]["train_tok_s"]["max"] for n in ns]
        ax[0, 0].errorbar(
            ns,
            med,
            yerr=[
                [m - a for m, a in zip(med, lo, strict=True)],
                [b - m for m, b in zip(med, hi, strict=True)],
            ],
            marker="o",
            capsize=3,
            label=mode,
        )
        ax[1, 0].plot(
            ns,
            [results[n][mode]["rollout_idle_frac"]["median"] for n in ns],
            marker="o",
            label=mode,
        )
        emu = [
            results[n][mode]["train_tok_s"]["median"] / results[n]["sync"]["train_tok_s"]["median"]
            for n in ns
        ]
        sim = [
            sims[n][mode]["train_tok_s"]["median"] / sims[n]["sync"]["train_tok_s"]["median"]
            for n in ns
        ]
        line = ax[0, 1].plot(ns, emu, marker="o", label=f"{mode} (emulated)")[0]
        ax[0, 1].plot(ns, sim, ls="--", color=line.get_color(), marker="x")
    ax[0, 0].set(
        title="training throughput (tokens consumed / s)", xlabel="emulated rollout GPUs (N)"
    )
    ax[0, 1].set(
        title="throughput / sync: emulated (o, solid) vs simulate.py (x, dashed)", xlabel="N"
    )
    ax[1, 0].set(title="rollout idle fraction", xlabel="N", ylim=(0, 1))
    n0 = 64 if 64 in results else ns[-1]
    for i, mode in enumerate(("one_step", "stream", "partial", "laminar_norepack", "laminar")):
        hist = results[n0][mode]["staleness"]["hist"]
        xs = sorted(int(k) for k in hist)
        tot = sum(hist.values()) or 1
        ax[1, 1].bar(
            [x + (i - 2) * 0.16 for x in xs],
            [hist[str(x)] / tot for x in xs],
            width=0.16,
            label=mode,
        )
    ax[1, 1].set(
        title=f"staleness at consumption, N={n0}", xlabel="trainer version - trajectory version"
    )
    for a in ax.flat:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    for a in (ax[0, 0], ax[0, 1], ax[1, 0]):
        a.set_xscale("log", base=2)
        a.set_xticks(ns, [str(n) for n in ns])
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def plot_breakdown(doc: dict[str, Any], path: Path) -> None:
    """One stacked bar per mode at N = 64 (or the largest N): where rollout-time goes
    (bench/cluster_run.py BREAKDOWN); below-B states split into the util they still gave
    (hatched) and the slots they left empty."""
    from cluster_run import BREAKDOWN

    results = {int(n): rows for n, rows in doc["results"].items()}
    n0 = 64 if 64 in results else max(results)
    modes = [m for m in MODES if "breakdown" in results[n0][m]]
    if not modes:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "full": "tab:green",
        "drain": "tab:orange",
        "refill": "tab:blue",
        "move": "tab:purple",
        "loading": "tab:red",
        "idle": "tab:gray",
    }
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, m in enumerate(modes):
        bd = results[n0][m]["breakdown"]
        y = 0.0
        for state in BREAKDOWN:
            t, u = bd["time"][state], bd["util"][state]
            if state in ("drain", "refill", "move"):
                ax.bar(
                    i,
                    u,
                    bottom=y,
                    color=colors[state],
                    hatch="//",
                    edgecolor="white",
                    label=f"{state}: decoding" if i == 0 else None,
                )
                ax.bar(
                    i,
                    t - u,
                    bottom=y + u,
                    color=colors[state],
                    alpha=0.45,
                    label=f"{state}: slots empty" if i == 0 else None,
                )
            else:
                ax.bar(i, t, bottom=y, color=colors[state], label=state if i == 0 else None)
            y += t
        ax.text(
            i, 1.01, f"util {results[n0][m]['decode_util']['median']:.2f}", ha="center", fontsize=8
        )
    ax.set_xticks(range(len(modes)), modes)
    ax.set(
        ylim=(0, 1.08),
        ylabel="share of rollout-time",
        title=(
            f"where a rollout's time goes, N={n0} (decode at B / below B by cause / loading / idle)"
        ),
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="N = 64 only, 3 repeats, shorter windows (~15 min)"
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "cluster.json")
    ap.add_argument("--plot", type=Path, default=None, help="line plot (default: --out with .png)")
    ap.add_argument(
        "--breakdown-plot",
        type=Path,
        default=None,
        help="stacked bar of where rollout-time goes (default: --plot's name + _breakdown)",
    )
    ap.add_argument("--ns", type=int, nargs="+", default=None, help="emulated rollout counts")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--params", default="{}", help="JSON overrides of BenchParams")
    ap.add_argument(
        "--workload",
        choices=("single", "multiturn"),
        default="single",
        help="multiturn: tool-calling episodes (cluster_run.MULTITURN; summary *_multiturn)",
    )
    ap.add_argument(
        "--agents",
        action="store_true",
        help="multiturn episodes from a black-box agent through each rollout's OpenAI endpoint",
    )
    ap.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="run the workload k times slower in every time constant (cluster_run.dilate; "
        "default 3 with --agents, whose clients share the host's cores, else 1)",
    )
    ap.add_argument("--keep", type=Path, default=None, help="keep every run's directory here")
    ap.add_argument(
        "--resim",
        type=Path,
        default=None,
        metavar="RESULTS.json",
        help="no emulation: re-run only the simulation + cross-check + summary against the runs "
        "stored in RESULTS.json (may be the same file as --out)",
    )
    args = ap.parse_args(argv)
    if args.plot is None:  # beside --out: a run never rewrites another run's (committed) plots
        args.plot = args.out.with_suffix(".png")
    if args.resim is not None:
        doc = resim(args.resim)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
        plot(doc, args.plot)
        plot_breakdown(
            doc, args.breakdown_plot or args.plot.with_name(args.plot.stem + "_breakdown.png")
        )
        print(markdown_table(doc))
        print(f"wrote {args.out} and {args.plot}")
        return 0
    if set(args.modes) != set(MODES):
        ap.error("the summary needs every mode; run cluster_run.py directly for one mode")
    ns = args.ns or ([64] if args.quick else [8, 16, 32, 64, 128])
    repeats = args.repeats or 3
    prm = BenchParams(
        **({"warmup_s": 6.0, "window_s": 18.0, "barrier_window_s": 36.0} if args.quick else {})
    )  # quick: ~30 s a run (the barrier modes ~50 s: 6-8 of their steps)
    if args.workload == "multiturn":
        prm = replace(prm, **MULTITURN)
    if args.agents:
        prm = replace(prm, agents=True)
    prm = replace(prm, **json.loads(args.params))
    time_scale = args.time_scale if args.time_scale is not None else (3.0 if args.agents else 1.0)
    prm = dilate(prm, time_scale)
    t_start = time.time()
    load0 = os.getloadavg()
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    failed: list[dict[str, Any]] = []
    total = len(ns) * len(MODES) * repeats
    k = 0
    for seed in range(
        repeats
    ):  # modes interleaved, so slow drifts of the machine hit every mode alike
        for n in ns:
            for mode in MODES:
                k += 1
                for attempt in (
                    1,
                    2,
                ):  # one retry: a run can die of the machine (e.g. a start-up timeout)
                    try:
                        fig = run_one(mode, n, seed, prm, args.keep)
                        if (why := trained_nothing(fig)) is not None:
                            raise RuntimeError(why)
                        break
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        print(
                            f"[{k}/{total}] N={n} {mode} seed={seed} attempt {attempt} failed: "
                            f"{exc}",
                            file=sys.stderr,
                            flush=True,
                        )
                        fig, reason = None, str(exc)
                if fig is None:
                    failed.append({"n": n, "mode": mode, "seed": seed, "why": reason[-400:]})
                    continue
                runs.setdefault((n, mode), []).append(fig)
                print(
                    f"[{k}/{total}] N={n} {mode} seed={seed}: train {fig['train_tok_s']:.0f} "
                    f"tok/s, gen {fig.get('gen_tok_s', float('nan')):.0f} tok/s, {fig['wall_s']} s",
                    file=sys.stderr,
                    flush=True,
                )
    ns = [
        n for n in ns if all(runs.get((n, m)) for m in MODES)
    ]  # a scale with a mode missing cannot compare
    if not ns:
        raise SystemExit(
            "no scale has every mode measured (a ratio needs them all); failed runs:\n"
            + "\n".join(f"  N={f['n']} {f['mode']} seed={f['seed']}: {f['why']}" for f in failed)
        )
    machine = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_1m_start": load0[0],
        "loadavg_1m_end": os.getloadavg()[0],
    }
    config = {
        "quick": args.quick,
        "ns": ns,
        "modes": list(MODES),
        "repeats": repeats,
        "params": asdict(prm),
        "time_scale": time_scale,
        "seeds": list(range(repeats)),
    }
    doc = analyse(prm, ns, repeats, runs, failed, config, machine, git_commit(), t_start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    plot(doc, args.plot)
    plot_breakdown(
        doc, args.breakdown_plot or args.plot.with_name(args.plot.stem + "_breakdown.png")
    )
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
