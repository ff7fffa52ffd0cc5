"""The default job: a tiny model that visibly learns with asynchronous RL on CPU.

    make run                      # = python -m laminar.demo [run_dir=runs/demo] [key=value ...]

    countup task ─► train.jsonl / eval.jsonl
    demos with one habit (habit.py) ─► supervised warm-up ─► policy v0 (cached in runs/.cache)
    eval v0 on the held-out prompts, greedy                           (eval_accuracy_before)
    laminar run configs/demo.yaml  (trainer, relay, 2 torch rollouts, manager, buffer: processes
                                    over ZeroMQ)
    laminar run configs/demo.yaml mode=sync                           (the baseline, same steps)
    eval the weight snapshots of both runs ─► accuracy vs wall-clock and step
    report.png, summary.json, summary.md in the run directory

Overrides are the config's dotted keys (trainer.total_steps=40, rollout.group_size=8 ...)
plus the demo's own under demo (demo.skip_sync=true ...; laminar.config.DemoConfig).

What RL has to fix: the warm-up demos answer the last value *not* above the limit on
large-stride prompts 75% of the time (habit.py), so greedy decoding of policy v0 is
wrong on about half the held-out prompts while sampling is right there a quarter of
the time; GRPO on the verifier's reward unlearns the habit within a few dozen steps.
Time and CPU-seconds of every phase go to summary.json (the box may be shared).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from laminar.config import DemoConfig, LaminarConfig, load_config, write_resolved

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Clock:
    """Wall-clock and CPU-seconds (this process + finished children) per phase."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self._t, self._c = time.time(), self._cpu()

    @staticmethod
    def _cpu() -> float:
        me, kids = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def lap(self, name: str) -> dict[str, float]:
        t, c = time.time(), self._cpu()
        self.phases[name] = {"wall_s": round(t - self._t, 1), "cpu_s": round(c - self._c, 1)}
        self._t, self._c = t, c
        return self.phases[name]


def demo_settings(cfg: LaminarConfig) -> DemoConfig:
    """The config's demo section (its defaults when the config has none)."""
    return cfg.demo if cfg.demo is not None else DemoConfig()


def prepare_data(
    run_dir: Path, s: DemoConfig, seed: int
) -> tuple[Path, Path, list[dict], list[dict]]:
    from laminar.tasks import countup as cu

    data = run_dir / "data"
    train = cu.generate(s.train_rows, "train", seed)
    ev = cu.generate(s.eval_rows, "eval", seed)
    tp, ep = cu.write_jsonl(train, data / "train.jsonl"), cu.write_jsonl(ev, data / "eval.jsonl")
    stats = cu.length_stats(train)
    say(
        f"task countup: {len(train)} train / {len(ev)} held-out prompts; solution length p50 "
        f"{stats.get('p50')} p99 {stats.get('p99')} (p99/p50 {stats.get('p99_over_p50', 0):.1f})"
    )
    return tp, ep, train, ev


def warm_up(s: DemoConfig, train: list[dict], seed: int) -> Path:
    from laminar.demo.habit import demonstrations
    from laminar.models.warmup import sft_warmup
    from laminar.tasks import countup as cu

    demos = demonstrations(train, s.habit_rate, seed)
    pairs = [(r["prompt"], d) for r, d in zip(train, demos, strict=True)]
    out = Path(s.cache_dir) / f"countup-policy0-seed{seed}"
    t0 = time.time()
    say(
        f"warm-up: {s.warmup_steps} supervised steps on demos with the answer habit "
        f"(rate {s.habit_rate} on large strides); cached in {out}"
    )
    path = sft_warmup(
        out,
        pairs,
        cu.ALPHABET,
        model_kw=s.model.builder_kw(),
        steps=s.warmup_steps,
        batch_size=s.warmup_batch,
        lr=s.warmup_lr,
        schedule=s.warmup_schedule,
        seed=seed,
        log=say,
        log_every=250,
    )
    say(f"warm-up policy ready at {path} ({time.time() - t0:.0f}s)")
    return path


def run_mode(
    cfg_path: Path, run_dir: Path, mode: str, overrides: list[str], s: DemoConfig
) -> dict[str, Any]:
    """`laminar run` as a child process with a live progress line; returns timing info."""
    import functools

    from laminar.launch.status import fetch_status
    from laminar.progress import Progress

    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_args = [f"mode={mode}", f"run_dir={run_dir}", f"name=demo-{mode}", *overrides]
    cmd = [sys.executable, "-m", "laminar", "run", str(cfg_path), *run_args]
    cfg = load_config(cfg_path, run_args)  # what the child resolves: total steps, the manager
    say(f"starting {mode}: {' '.join(cmd[3:])}")
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / "nodes.log", "w")
    t0, c0 = time.time(), Clock._cpu()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    progress = Progress(
        run_dir,
        mode,
        t0,
        s.progress_every_s,
        total_steps=cfg.trainer.total_steps,
        status=functools.partial(fetch_status, cfg, timeout=0.5),
    )
    try:
        while proc.poll() is None:
            progress.tick()
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(30)
        raise
    finally:
        log.close()
    progress.tick(final=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        tail = (run_dir / "nodes.log").read_text().splitlines()[-30:]
        raise SystemExit(
            f"demo: the {mode} run failed (exit {proc.returncode}); last log lines:\n"
            + "\n".join(tail)
        )
    cpu = Clock._cpu() - c0  # the `laminar run` child waited for its nodes: every role counts
    say(f"{mode} run finished in {wall:.0f}s ({cpu:.0f} CPU-s, {cpu / wall:.2f} cores)")
    return {
        "mode": mode,
        "wall_clock_s": wall,
        "t0": t0,
        "run_dir": str(run_dir),
        "cpu_s": round(cpu, 1),
        "cores": round(cpu / wall, 2) if wall > 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = load_config(DEMO_CONFIG, args)
    s = demo_settings(cfg)
    run_dir = cfg.resolved_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from laminar.logs import configure_logging

    configure_logging(
        "warning", cfg.logging.json_logs
    )  # the nodes' own logs go to each run's nodes.log

    from laminar.demo import results
    from laminar.demo.habit import habit_share
    from laminar.report import read_metrics
    from laminar.tasks import countup as cu
    from laminar.tasks.evaluate import evaluate_model

    clock = Clock()
    train_path, eval_path, train, ev = prepare_data(run_dir, s, cfg.seed)
    policy0 = Path(s.policy) if s.policy else warm_up(s, train, cfg.seed)
    clock.lap("warmup")
    before = evaluate_model(str(policy0), ev, cu.verify, max_tokens=cfg.rollout.sampling.max_tokens)
    before["habit"] = habit_share(ev, before.pop("completions"))
    say(
        f"held-out accuracy of the warm-up model: {before['accuracy']:.3f} on {before['prompts']} "
        f"prompts (answers the habit's value on {before['habit']:.0%} of the large-stride ones)"
    )

    # trainer.eval_every=0: the demo evaluates weight snapshots after the run, not inside it
    common = [
        f"model.path={policy0}",
        f"data.train={train_path}",
        f"data.eval={eval_path}",
        "trainer.eval_every=0",
        *[a for a in args if not a.startswith(("run_dir=", "mode=", "name="))],
    ]
    clock.lap("eval_before")
    runs = {"laminar": run_mode(DEMO_CONFIG, run_dir / "laminar", cfg.mode, common, s)}
    clock.lap("rl_laminar")
    if not s.skip_sync:
        runs["sync"] = run_mode(DEMO_CONFIG, run_dir / "sync", "sync", common, s)
        clock.lap("rl_sync")

    for name, r in runs.items():
        say(f"evaluating the weight snapshots of the {name} run")
        r["curve"] = results.eval_curve(
            Path(r["run_dir"]),
            policy0,
            ev,
            s,
            before,
            r["t0"],
            log=say,
            max_tokens=cfg.rollout.sampling.max_tokens,
        )
        r["metrics"] = read_metrics(Path(r["run_dir"]))
    after = runs["laminar"]["curve"][-1]
    clock.lap("eval_curves")
    summary = results.summarize(cfg.mode, runs, before, after, time.time() - t_start)
    summary["phases"] = clock.phases
    write_resolved(cfg, run_dir)
    results.write_outputs(run_dir, runs, summary)
    if "target" in summary:
        say(results.headline(summary).replace("**", ""))
    say(
        f"held-out accuracy: {summary['eval_accuracy_before']:.3f} -> "
        f"{summary['eval_accuracy_after']:.3f} ({summary['eval_prompts']} prompts); report at "
        f"{run_dir}/report.png, summary at {run_dir}/summary.md"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
