"""Decode utilisation beside staleness, per refill variant, in the simulator (issue 18).

    for each variant (BenchParams overrides: how a rollout refills, retraction, repack period):
        bench/cluster_run.make_config(sync | laminar, N) ──► simconfig.params_from_config
        ──► bench/simulate.simulate (steady-state window: 4 warm-up + 8 measured updates)
    ──► decode_util, laminar / sync throughput, staleness of consumed trajectories (mean, p50,
        p99, max, histogram) per variant ──► JSON + a table

The emulated workload of bench/cluster.py (B = 8, groups of 4, lognormal lengths p50 100 / p99
1000) at any N, e.g. 1024 simulated GPUs (one rollout per GPU), where the emulation cannot go.
The variants are the steps of bench/README.md "Decode utilisation": before (a credit per group,
repack every 1 s), per-sequence refill (rollout.refill_slots), retraction of unstarted groups
(rollout.retract_unstarted), repack every 0.5 s.

Staleness is counted in versions, and a version lasts one iteration, so a trajectory's staleness
is about its age at consumption (queueing + its group's longest member + the wait for the
batch) / iteration_s. The table prints p99 x iteration_s, that age: the workload fixes it (a
1024-token member alone decodes for 5 s), so a variant that shortens the iteration (more
tokens per second through the same batch size) raises p99 staleness in versions unless the
bound (buffer.max_staleness) makes the trainer wait. (The simulator models a bound by dropping
groups past it, where the buffer waits and never drops, so bounded runs belong to the emulation.)

Run (~10 min):
    .venv/bin/python bench/refill_sweep.py --n 64 1024 --out bench/results/refill_sweep.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from cluster_run import BenchParams, make_config  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "before: a credit per group, repack 1 s": {
        "refill_slots": None,
        "retract_unstarted": False,
        "repack_interval_s": 1.0,
    },
    "per-sequence refill (refill_slots 12)": {"retract_unstarted": False, "repack_interval_s": 1.0},
    "+ retraction of unstarted groups": {"repack_interval_s": 1.0},
    "+ repack every 0.5 s (adopted)": {},
    "adopted without retraction": {"retract_unstarted": False},
    "adopted, refill_slots 10": {"refill_slots": 10},
    "adopted, refill_slots 8 (no queue)": {"refill_slots": 8},
}


def run_variant(n: int, overrides: dict[str, Any], seed: int) -> dict[str, Any]:
    from simconfig import params_from_config
    from simulate import simulate

    prm = BenchParams(**overrides)
    out: dict[str, Any] = {}
    for mode in ("sync", "laminar"):
        with tempfile.TemporaryDirectory(prefix="lam-rs-") as tmp:
            cfg = make_config(mode, n, seed, prm, Path(tmp), Path(tmp))
            p = params_from_config(cfg, n, prompt_tokens=prm.prompt_tokens)
        t0 = time.time()
        r = simulate(mode, params=p, seed=seed, warmup_steps=4, measure_steps=8)
        out[mode] = {
            k: r[k]
            for k in (
                "decode_util",
                "throughput_tok_s",
                "iteration_s",
                "rollout_idle_frac",
                "staleness_consumed",
                "staleness_finished",
                "retracted_groups",
                "moves",
            )
        }
        out[mode]["sim_s"] = round(time.time() - t0, 1)
    out["laminar_vs_sync"] = out["laminar"]["throughput_tok_s"] / out["sync"]["throughput_tok_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--n", type=int, nargs="+", default=[64, 1024], help="simulated rollouts (= GPUs)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=HERE / "results" / "refill_sweep.json")
    args = ap.parse_args(argv)
    doc: dict[str, Any] = {
        "bench": "refill_sweep",
        "seed": args.seed,
        "params": BenchParams().__dict__,
        "variants": {k: VARIANTS[k] for k in args.variants or VARIANTS},
        "results": {},
    }
    print(
        f"{'N':>5} {'variant':42} {'util':>6} {'/sync':>6} {'stale mean':>10} {'p50':>4} "
        f"{'p99':>4} {'max':>4} {'iter s':>7} {'p99 x iter s':>13}"
    )
    for n in args.n:
        for name in args.variants or VARIANTS:
            r = run_variant(n, VARIANTS[name], args.seed)
            doc["results"].setdefault(str(n), {})[name] = r
            lam, st = r["laminar"], r["laminar"]["staleness_consumed"]
            print(
                f"{n:>5} {name:42} {lam['decode_util']:6.3f} {r['laminar_vs_sync']:6.2f} "
                f"{st['mean']:10.2f} {st['p50']:>4} {st['p99']:>4} {st['max']:>4} "
                f"{lam['iteration_s']:7.2f} {st['p99'] * lam['iteration_s']:13.2f}",
                flush=True,
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
