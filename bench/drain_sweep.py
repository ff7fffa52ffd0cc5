"""Laminar against partial rollout per drain / repack variant, in the simulator (issue 44).

    for each variant (BenchParams overrides: refill budget K, repack candidates, split sources,
    round period; the single-turn or multi-turn workload):
        bench/cluster_run.make_config(partial | laminar, N) ──► simconfig.params_from_config
        ──► bench/simulate.simulate (steady-state window, every latency zero) per seed
    ──► laminar / partial throughput, decode utilisation of both, consumed staleness p99 of both,
        repack moves ──► medians over seeds, JSON + a table

The emulated workload of bench/cluster.py (B = 8, groups of 4, lengths p50 100 / p99 1000,
prefill at 5x saturated decode, weight loads charged) at N = 64, where one variant costs
seconds instead of the emulation's ten minutes: it picks what the emulation then measures.
Partial's figures do not depend on the variants (its rollouts never drain or repack); it is
simulated beside each for the ratio.

Run (~2 min):
    .venv/bin/python bench/drain_sweep.py --out bench/results/drain_sweep.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from cluster_run import MULTITURN, BenchParams, make_config  # noqa: E402

R05 = {"repack_interval_s": 0.5, "refill_versions": 3}
"""The bench's repack period before this sweep, at the K = 3 it adopted then."""
K3 = {"refill_versions": 3, "repack_interval_s": 0.25}
"""The budget this sweep adopted; the bench runs K = 2 since the open-groups cap was fixed."""
K2_025 = {"refill_versions": 2, "repack_interval_s": 0.25}
"""The bench from the open-groups fix until 2026-12-07 (repack every 0.1 s since)."""
BEFORE_44 = {**R05, "refill_versions": 0, "repack_candidates": "kv_falling", "repack_split": False}
VARIANTS: dict[str, dict[str, Any]] = {
    "K = 0, kv_falling, whole, 0.5 s (old drain rules, new charges)": BEFORE_44,
    "K = 3, draining, whole sources, 0.5 s": {**R05, "repack_split": False},
    "K = 3, draining, split sources, 0.5 s": R05,
    "K = 3, split, 0.25 s (adopted then)": K3,
    "K = 3, split, 0.1 s": {**K3, "repack_interval_s": 0.1},
    "K = 2, split, 0.5 s": {**R05, "refill_versions": 2},
    "K = 2, split, 0.25 s (the bench's default until 2026-12-07)": K2_025,
    "K = 4, split, 0.25 s": {"refill_versions": 4, "repack_interval_s": 0.25},
    # issue 44, third session: the staleness / throughput trade and a larger decode bound
    "K = 2, split, 0.1 s (the bench's default now)": {
        "refill_versions": 2,
        "repack_interval_s": 0.1,
    },
    "K = 3, split, 0.1 s, c_max 1.0": {**K3, "repack_interval_s": 0.1, "c_max": 1.0},
    "refill_slots 16 (partial and laminar)": {**K3, "refill_slots": 16},
    "B = 16 (credits, slots, batch, trainer scaled)": {
        **K3,
        "bound_b": 16,
        "credits": 4,
        "refill_slots": 24,
        "batch_groups_per_rollout": 4,
        "trainer_s_per_token_x_n": 2.5e-4,
    },
    "B = 32 (credits, slots, batch, trainer scaled)": {
        **K3,
        "bound_b": 32,
        "credits": 8,
        "refill_slots": 48,
        "batch_groups_per_rollout": 8,
        "trainer_s_per_token_x_n": 1.25e-4,
    },
    "multi-turn, K = 3, whole sources, 0.25 s": {**MULTITURN, **K3, "repack_split": False},
    "multi-turn, credits 2 (before), split, 0.25 s": {**MULTITURN, **K3, "queued_credits": None},
    "multi-turn, K = 3, split sources, 0.25 s": {**MULTITURN, **K3},
    # issue 44, sixth session (run with --latencies, the fifteenth session's measured ones):
    # shorter periods, denser destinations, and what a fixed stall per move would cost
    "K = 2, split, 0.05 s": {"refill_versions": 2, "repack_interval_s": 0.05},
    "K = 2, split, 0.02 s": {"refill_versions": 2, "repack_interval_s": 0.02},
    "K = 2, destinations up to 10, 0.25 s": {**K2_025, "sim": {"repack_bound_b": 10}},
    "K = 2, destinations up to 12, 0.25 s": {**K2_025, "sim": {"repack_bound_b": 12}},
    "K = 1, destinations up to 10, 0.1 s": {
        "refill_versions": 1,
        "repack_interval_s": 0.1,
        "sim": {"repack_bound_b": 10},
    },
    **{
        f"K = 2, {period} s, {stall * 1000:.0f} ms fixed stall a move": {
            "refill_versions": 2,
            "repack_interval_s": period,
            "sim": {"repack_fixed_s": stall},
        }
        for stall in (0.02, 0.05, 0.1)
        for period in (0.25, 0.1)
    },
}
"""`sim`: SimParams fields set after params_from_config (what BenchParams has no setting for)."""


def stored_latencies(path: Path, n: int) -> dict[str, dict[str, Any]]:
    """The latencies a bench/cluster.py run measured and fed its simulator, per mode (weight
    loads, pushes, prompt round trips, repack moves; bench/cluster.py measured_latencies)."""
    sim = json.loads(path.read_text())["simulation"][str(n)]
    return {mode: sim[mode]["latencies"] for mode in ("partial", "laminar")}


def run_variant(
    n: int,
    overrides: dict[str, Any],
    seeds: list[int],
    latencies: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    from simconfig import params_from_config
    from simulate import simulate

    sim_over = overrides.get("sim", {})
    prm = BenchParams(**{k: v for k, v in overrides.items() if k != "sim"})
    per: dict[str, list[dict[str, Any]]] = {}
    t0 = time.time()
    for mode in ("partial", "laminar"):
        with tempfile.TemporaryDirectory(prefix="lam-ds-") as tmp:
            cfg = make_config(mode, n, 0, prm, Path(tmp), Path(tmp))
            lat = (latencies or {}).get(mode, {})
            p = params_from_config(cfg, n, prompt_tokens=prm.prompt_tokens, **lat)
        if mode == "laminar":  # partial never repacks: the variants' simulator fields are laminar's
            p = replace(p, **sim_over)
        per[mode] = [simulate(mode, params=p, seed=s) for s in seeds]
    ratios = [
        lam["throughput_tok_s"] / par["throughput_tok_s"]
        for lam, par in zip(per["laminar"], per["partial"], strict=True)
    ]
    med = statistics.median
    return {
        "laminar_vs_partial": {"median": med(ratios), "min": min(ratios), "max": max(ratios)},
        "decode_util": {m: med(r["decode_util"] for r in rs) for m, rs in per.items()},
        "staleness_p99": {
            m: med(r["staleness_consumed"]["p99"] for r in rs) for m, rs in per.items()
        },
        "throughput_tok_s": {m: med(r["throughput_tok_s"] for r in rs) for m, rs in per.items()},
        "moves": med(r["moves"] for r in per["laminar"]),
        "moved_trajs": med(r["moved_trajs"] for r in per["laminar"]),
        "sim_s": round(time.time() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=64, help="simulated rollouts (= GPUs)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=HERE / "results" / "drain_sweep.json")
    ap.add_argument(
        "--latencies",
        type=Path,
        default=None,
        metavar="CLUSTER.json",
        help="feed the latencies a bench/cluster.py run measured (default: every latency zero)",
    )
    args = ap.parse_args(argv)
    lat = stored_latencies(args.latencies, args.n) if args.latencies else None
    doc: dict[str, Any] = {
        "bench": "drain_sweep",
        "n": args.n,
        "seeds": args.seeds,
        "params": BenchParams().__dict__,
        "variants": {k: VARIANTS[k] for k in args.variants or VARIANTS},
        "latencies": lat,
        "results": {},
    }
    print(
        f"{'variant':58} {'lam/par':>7} {'(min-max)':>13} {'util lam':>8} {'util par':>8} "
        f"{'p99 lam':>7} {'p99 par':>7} {'moves':>6}"
    )
    for name in args.variants or VARIANTS:
        r = run_variant(args.n, VARIANTS[name], args.seeds, lat)
        doc["results"][name] = r
        lp, u, st = r["laminar_vs_partial"], r["decode_util"], r["staleness_p99"]
        print(
            f"{name:58} {lp['median']:7.3f} {lp['min']:6.3f}-{lp['max']:.3f} "
            f"{u['laminar']:8.3f} {u['partial']:8.3f} {st['laminar']:7.0f} {st['partial']:7.0f} "
            f"{r['moves']:6.0f}",
            flush=True,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
