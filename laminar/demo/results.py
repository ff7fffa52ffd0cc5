"""The demo's results: accuracy curves from weight snapshots, the laminar-vs-sync comparison,
and the panels and summary lines it hands to the report module (laminar/report.py).

    curve = eval_curve(run_dir, policy0, eval_rows, settings, before, t0)  # [{t, step, accuracy}]
    summary = summarize(mode, runs, before, after, wall)
    write_outputs(run_dir, runs, summary)   # report.png, summary.json, summary.md (report.py)

Snapshots are evaluated after the run (never inside it) so the timing of each
mode is not disturbed by evaluation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from laminar import report
from laminar.config import DemoConfig
from laminar.fates import RunFates, fate_md, fate_panels, run_fates, summary_keys
from laminar.report import Panel, mean, read_jsonl, rolling


def load_snapshot(policy0: Path, weights: Path):
    """The policy at a snapshot: its weights, or (LoRA) its adapters merged into policy0."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from laminar.models.lora import MergedAdapter, lora_of_metadata
    from laminar.models.tiny import load_causal_lm

    model = load_causal_lm(policy0)
    with safe_open(str(weights), "pt") as f:
        lora = lora_of_metadata(f.metadata())
    if lora is not None:
        MergedAdapter(model, lora).apply(load_file(str(weights)))
        return model
    missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
    if unexpected or any(not k.startswith("lm_head") for k in missing):
        raise ValueError(
            f"snapshot {weights} does not fit the model: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    return model


def eval_curve(
    run_dir: Path,
    policy0: Path,
    rows: list[dict],
    s: DemoConfig,
    before: dict[str, Any],
    t0: float,
    log: Callable[[str], None] = print,
    max_tokens: int = 256,
) -> list[dict[str, Any]]:
    """Held-out accuracy at evenly spaced snapshots (all of them when curve_points is 0) on the
    first curve_eval_rows prompts, and at the last one on all rows."""
    from laminar.demo.habit import habit_share
    from laminar.models.tiny import load_tokenizer
    from laminar.tasks import countup as cu
    from laminar.tasks.evaluate import evaluate_model

    index = read_jsonl(run_dir / "snapshots" / "index.jsonl")
    index = [e for e in index if (run_dir / "snapshots" / f"v{e['version']}.safetensors").exists()]
    curve = [
        {
            "t": 0.0,
            "step": 0,
            "version": 0,
            "accuracy": before["accuracy"],
            "prompts": before["prompts"],
        }
    ]
    if not index:
        log(f"no snapshots in {run_dir}; the curve has only the warm-up point")
        return curve
    k = s.curve_points
    if k <= 0 or k >= len(index):  # 0: every snapshot
        picks = list(range(len(index)))
    else:
        picks = sorted(
            {round(i * (len(index) - 1) / max(1, k - 1)) for i in range(k)} | {len(index) - 1}
        )
    tok = load_tokenizer(policy0)
    subset = rows[: s.curve_eval_rows]
    for i in picks:
        e = index[i]
        last = i == len(index) - 1
        model = load_snapshot(policy0, run_dir / "snapshots" / f"v{e['version']}.safetensors")
        res = evaluate_model(
            model, rows if last else subset, cu.verify, max_tokens=max_tokens, tokenizer=tok
        )
        curve.append(
            {
                "t": e["time"] - t0,
                "step": e["step"],
                "version": e["version"],
                "accuracy": res["accuracy"],
                "prompts": res["prompts"],
            }
        )
        if last:
            curve[-1]["habit"] = habit_share(rows, res["completions"])
        log(
            f"  v{e['version']} (step {e['step']}, {e['time'] - t0:.0f}s): accuracy "
            f"{res['accuracy']:.3f} on {res['prompts']}"
        )
    return curve


def time_to_reach(curve: list[dict[str, Any]], target: float) -> float | None:
    """Wall-clock at which the accuracy curve first reaches `target`, linear between evaluated
    snapshots."""
    prev = None
    for p in curve:
        if p["accuracy"] >= target - 1e-9:
            if prev is None or p["accuracy"] == prev["accuracy"]:
                return p["t"]
            frac = (target - prev["accuracy"]) / (p["accuracy"] - prev["accuracy"])
            return prev["t"] + frac * (p["t"] - prev["t"])
        prev = p
    return None


def smooth(curve: list[dict[str, Any]], k: int = 3) -> list[dict[str, Any]]:
    """Accuracy averaged over k consecutive evaluated snapshots (centred, clipped at the ends).

    Consecutive snapshots are 5 trainer steps apart; the policy wobbles by a few
    points from one to the next and a 256-prompt eval adds +-0.02-0.03, so "the first time
    the curve reaches X" on raw points mostly measures luck. The t=0 point (the warm-up
    model, before any RL) is kept as measured.
    """
    out = [dict(curve[0])] if curve else []
    h = k // 2
    for i in range(1, len(curve)):
        window = curve[max(1, i - h) : i + h + 1]
        out.append({**curve[i], "accuracy": sum(p["accuracy"] for p in window) / len(window)})
    return out


def steps_per_s(metrics: list[dict[str, Any]]) -> float | None:
    """Trainer throughput over the run (first to last logged step)."""
    if len(metrics) < 2:
        return None
    dt = metrics[-1]["time"] - metrics[0]["time"]
    return (metrics[-1]["step"] - metrics[0]["step"]) / dt if dt > 0 else None


def summarize(
    mode: str,
    runs: dict[str, dict],
    before: dict[str, Any],
    after: dict[str, Any],
    wall: float,
) -> dict[str, Any]:
    lam = runs["laminar"]
    m = lam.get("metrics", [])
    # a tenth of the run at each end (at least 5 steps): one batch's reward swings with its
    # prompt mix
    k = max(5, len(m) // 10)
    summary: dict[str, Any] = {
        "mode": mode,
        "eval_accuracy_before": before["accuracy"],
        "eval_accuracy_after": after["accuracy"],
        "eval_prompts": after["prompts"],
        "eval_habit_before": before.get("habit"),
        "eval_habit_after": after.get("habit"),
        "wall_clock_s": round(wall, 1),
        "run_wall_clock_s": round(lam["wall_clock_s"], 1),
        "steps": m[-1]["step"] if m else 0,
        "reward_window_steps": k,
        "reward_first": mean([r.get("reward") for r in m[:k]]),
        "reward_last": mean([r.get("reward") for r in m[-k:]]),
        "staleness_mean": mean([r.get("staleness") for r in m]),
        "staleness_max": max((r.get("staleness_max", 0) for r in m), default=0),
    }
    if "sync" in runs:
        sync = runs["sync"]
        lam_s, sync_s = smooth(lam["curve"]), smooth(sync["curve"])
        target = sync_s[-1]["accuracy"]
        t_lam, t_sync = time_to_reach(lam_s, target), time_to_reach(sync_s, target)
        lam_rate, sync_rate = steps_per_s(m), steps_per_s(sync.get("metrics", []))
        summary.update(
            {
                "sync_eval_accuracy_after": sync["curve"][-1]["accuracy"],
                "eval_accuracy_after_smoothed": lam_s[-1]["accuracy"],
                "sync_eval_accuracy_after_smoothed": target,
                "sync_run_wall_clock_s": round(sync["wall_clock_s"], 1),
                "sync_steps": sync["metrics"][-1]["step"] if sync.get("metrics") else 0,
                "time_to_sync_final_accuracy_laminar_s": t_lam,
                "time_to_sync_final_accuracy_sync_s": t_sync,
                "sync_over_laminar_time_ratio": (t_sync / t_lam) if t_lam and t_sync else None,
                "run_wall_clock_ratio_sync_over_laminar": round(
                    sync["wall_clock_s"] / lam["wall_clock_s"], 3
                ),
                "trainer_steps_per_s": lam_rate,
                "sync_trainer_steps_per_s": sync_rate,
                "steps_per_s_ratio_laminar_over_sync": (lam_rate / sync_rate)
                if lam_rate and sync_rate
                else None,
            }
        )
        summary.update(fixed_target(lam_s, sync_s, TARGET))
    for name, r in runs.items():  # what each mode's staleness policy did to the data
        fates = run_fates(Path(r["run_dir"])) if "run_dir" in r else None
        summary.update(summary_keys(fates, f"{_key(name)}audit_"))
    for name, r in runs.items():  # how much of the machine each mode kept busy
        key = _key(name)
        summary[f"{key}run_cpu_s"] = r.get("cpu_s")
        summary[f"{key}cores_used"] = r.get("cores")
        summary[f"{key}first_step_s"] = (
            (m0[0]["time"] - r["t0"]) if (m0 := r.get("metrics")) and "t0" in r else None
        )
    return summary


def _key(name: str) -> str:
    """Summary key prefix of a run: none for laminar, `sync_` for the baseline."""
    return "" if name == "laminar" else f"{name}_"


TARGET = 0.90
"""The demo's fixed time-to-target accuracy (smoothed held-out; the issue's acceptance target)."""


def fixed_target(
    lam_s: list[dict[str, Any]], sync_s: list[dict[str, Any]], target: float
) -> dict[str, Any]:
    """Time and steps to `target` on both smoothed curves, their ratio, and each mode's
    shortfall (target - best smoothed accuracy) when it never got there. One run per mode."""
    out: dict[str, Any] = {"target": target, "target_runs_per_mode": 1}
    for name, c in (("laminar", lam_s), ("sync", sync_s)):
        best = max(p["accuracy"] for p in c)
        out[f"time_to_target_{name}_s"] = time_to_reach(c, target)
        out[f"steps_to_target_{name}"] = _steps_to_reach(c, target)
        out[f"best_smoothed_{name}"] = best
        out[f"short_of_target_{name}"] = round(max(0.0, target - best), 3)
    t_lam, t_sync = out["time_to_target_laminar_s"], out["time_to_target_sync_s"]
    s_lam, s_sync = out["steps_to_target_laminar"], out["steps_to_target_sync"]
    out["time_to_target_ratio_sync_over_laminar"] = t_sync / t_lam if t_lam and t_sync else None
    out["steps_to_target_ratio_laminar_over_sync"] = s_lam / s_sync if s_lam and s_sync else None
    return out


def _steps_to_reach(curve: list[dict[str, Any]], target: float) -> float | None:
    return time_to_reach([{**p, "t": p["step"]} for p in curve], target)


def headline(s: dict[str, Any]) -> str:
    """One sentence on time to the fixed target; never 'n/a': a mode that missed says by how
    much."""
    tgt = s["target"]
    t_lam, t_sync = s["time_to_target_laminar_s"], s["time_to_target_sync_s"]
    lead = (
        f"Time to {tgt:.2f} held-out accuracy (smoothed; one run per mode, not a median over seeds)"
    )
    if t_lam and t_sync:
        r = s["time_to_target_ratio_sync_over_laminar"]
        who = "laminar sooner" if r >= 1 else "sync sooner"
        return (
            f"{lead}: laminar {t_lam:.0f} s, sync {t_sync:.0f} s: **ratio sync/laminar {r:.2f}** "
            f"({who}); steps {s['steps_to_target_laminar']:.0f} vs {s['steps_to_target_sync']:.0f}."
        )
    parts = []
    for name, t in (("laminar", t_lam), ("sync", t_sync)):
        if t:
            parts.append(
                f"{name} reached it at {t:.0f} s (step {s[f'steps_to_target_{name}']:.0f})"
            )
        else:
            parts.append(
                f"{name} never reached it: best {s[f'best_smoothed_{name}']:.3f}, "
                f"**{s[f'short_of_target_{name}']:.3f} short**"
            )
    return f"{lead}: " + "; ".join(parts) + "."


def _resp_len(x: dict[str, Any]) -> float | None:
    for k in ("response_len/mean", "response_len_mean"):
        if k in x:
            return x[k]
    return None


COLORS = {"laminar": "tab:blue", "sync": "tab:orange"}


def _reward_and_accuracy(runs: dict[str, dict]) -> Panel:
    """Reward and held-out accuracy vs wall-clock."""

    def draw(a: Any) -> None:
        for name, r in runs.items():
            m = r.get("metrics", [])
            t0 = r["t0"]
            ts, rw = [x["time"] - t0 for x in m], [x.get("reward", float("nan")) for x in m]
            a.plot(ts, rw, color=COLORS.get(name), alpha=0.2)
            a.plot(
                ts,
                rolling(rw, 8),
                color=COLORS.get(name),
                alpha=0.7,
                lw=1.2,
                label=f"{name} batch reward (mean of 8)",
            )
            c = r.get("curve", [])
            a.plot(
                [p["t"] for p in c],
                [p["accuracy"] for p in c],
                "o-",
                color=COLORS.get(name),
                label=f"{name} held-out acc",
            )
        a.set_xlabel("wall-clock (s)")
        a.set_ylabel("reward / accuracy")
        a.set_title("Reward and held-out accuracy vs wall-clock")
        a.legend(fontsize=8)
        a.grid(alpha=0.3)

    return draw


def _accuracy_by_step(runs: dict[str, dict]) -> Panel:
    """Held-out accuracy vs step, response length dashed on a twin axis."""

    def draw(a: Any) -> None:
        b = a.twinx()
        b.set_ylabel("mean response length (tokens)")
        for name, r in runs.items():
            c = r.get("curve", [])
            a.plot(
                [p["step"] for p in c],
                [p["accuracy"] for p in c],
                "o-",
                color=COLORS.get(name),
                label=f"{name} held-out acc",
            )
            m = [x for x in r.get("metrics", []) if _resp_len(x) is not None]
            b.plot(
                [x["step"] for x in m],
                [_resp_len(x) for x in m],
                "--",
                color=COLORS.get(name),
                alpha=0.5,
            )
        a.set_xlabel("trainer step")
        a.set_ylabel("held-out accuracy")
        a.set_title("Held-out accuracy vs step (dashed: response length)")
        a.legend(fontsize=8, loc="upper left")
        a.grid(alpha=0.3)

    return draw


def _staleness_histogram(runs: dict[str, dict]) -> Panel:
    def draw(a: Any) -> None:
        width = 0.4
        for j, (name, r) in enumerate(runs.items()):
            hist: dict[int, float] = {}
            for x in r.get("metrics", []):
                for k, v in x.items():
                    if k.startswith("staleness_hist/"):
                        hist[int(k.split("/")[1])] = hist.get(int(k.split("/")[1]), 0) + v
            if hist:
                ks = sorted(hist)
                shift = (j - (len(runs) - 1) / 2) * width  # side by side, centred on the integer
                a.bar(
                    [k + shift for k in ks],
                    [hist[k] for k in ks],
                    width,
                    color=COLORS.get(name),
                    label=name,
                )
        a.xaxis.get_major_locator().set_params(integer=True)
        a.set_xlabel("staleness at consumption (trainer version − trajectory version)")
        a.set_ylabel("trajectories")
        a.set_title("Staleness histogram")
        a.legend(fontsize=8)

    return draw


def _rollout_timeline(r: dict[str, Any]) -> Panel:
    """Per-rollout utilisation of one run: running sequences, weight loads, repacks, deaths."""

    def draw(a: Any) -> None:
        tl = read_jsonl(Path(r["run_dir"]) / "timeline.jsonl")
        nodes = sorted({e["node"] for e in tl if e.get("event") == "rollout"})
        for i, node in enumerate(nodes):
            pts = [e for e in tl if e.get("event") == "rollout" and e["node"] == node]
            ts = [e["t"] - r["t0"] for e in pts]
            peak = max([e["running"] for e in pts] + [1])
            fill = [i + 0.8 * e["running"] / peak for e in pts]
            a.fill_between(ts, fill, i, step="post", alpha=0.5, label=None)
            prev = None
            for e in pts:
                if prev is not None and e["version"] != prev:
                    a.plot([e["t"] - r["t0"]] * 2, [i, i + 0.9], color="green", lw=1)
                prev = e["version"]
        for e in tl:
            if e.get("event") == "repack" and e.get("trajectories", 0) > 0:
                a.axvline(e["t"] - r["t0"], color="red", lw=0.8, alpha=0.6)
            if e.get("event") == "dead":
                a.axvline(e["t"] - r["t0"], color="black", lw=1.2, ls=":")
        a.set_yticks([i + 0.4 for i in range(len(nodes))], nodes)
        a.set_xlabel("wall-clock (s)")
        a.set_title("Rollout utilisation (fill: running seqs; green: weight load; red: repack)")

    return draw


def panels(runs: dict[str, dict], fates: dict[str, RunFates | None]) -> list[list[Panel]]:
    """The demo's figure: 3 x 2 panels comparing the runs (the timeline: the laminar run; the
    last row: the per-length audit of both, laminar/fates.py)."""
    return [
        [_reward_and_accuracy(runs), _accuracy_by_step(runs)],
        [_staleness_histogram(runs), _rollout_timeline(runs["laminar"])],
        fate_panels(fates),
    ]


def write_outputs(run_dir: Path, runs: dict[str, dict], summary: dict[str, Any]) -> None:
    """The laminar run's metrics, TensorBoard and last checkpoint copied into run_dir, the
    curves, then the report (laminar/report.py) with this demo's panels and summary."""
    import shutil

    lam = Path(runs["laminar"]["run_dir"])
    if (lam / "metrics.jsonl").exists():
        shutil.copy(lam / "metrics.jsonl", run_dir / "metrics.jsonl")
    if (lam / "tb").exists() and not (run_dir / "tb").exists():
        shutil.copytree(lam / "tb", run_dir / "tb")
    ckpts = sorted((lam / "checkpoints").glob("step_*"))
    if ckpts:
        final = run_dir / "final_checkpoint"
        if final.exists():
            shutil.rmtree(final)
        shutil.copytree(ckpts[-1], final)
    curves = {k: r.get("curve", []) for k, r in runs.items()}
    (run_dir / "curves.json").write_text(json.dumps(curves, indent=1))
    fates = {name: run_fates(Path(r["run_dir"])) for name, r in runs.items()}
    md = summary_md(summary, fate_md(fates))
    report.write_outputs(run_dir, summary, md, panels(runs, fates), size=(13.0, 13.5))


def summary_md(s: dict[str, Any], audit: list[str] | None = None) -> str:
    """The demo's summary.md; `audit`: the per-length audit's section (laminar/fates.py)."""
    f = report.fmt

    lines = [
        "# Laminar demo summary",
        "",
        "A tiny character-level policy learned the count-up task with asynchronous RL "
        f"({s['mode']} mode) on CPU.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| held-out accuracy before RL (warm-up model) | {f(s['eval_accuracy_before'])} |",
        f"| held-out accuracy after RL | {f(s['eval_accuracy_after'])} |",
        f"| held-out prompts | {s['eval_prompts']} |",
        f"| large-stride prompts answered with the warm-up's habit, before → after | "
        f"{f(s.get('eval_habit_before'), '{:.0%}')} → {f(s.get('eval_habit_after'), '{:.0%}')} |",
        f"| trainer steps | {s['steps']} |",
        f"| batch reward, mean of the first → last {s.get('reward_window_steps', 5)} steps | "
        f"{f(s['reward_first'])} → {f(s['reward_last'])} |",
        f"| staleness mean / max | {f(s['staleness_mean'], '{:.2f}')} / {s['staleness_max']} |",
        f"| RL run wall-clock | {f(s['run_wall_clock_s'], '{:.0f}')} s |",
        f"| whole demo wall-clock | {f(s['wall_clock_s'], '{:.0f}')} s |",
    ]
    if "sync_eval_accuracy_after" in s:
        lines += _comparison_md(s, f)
    lines += audit or []
    if s.get("phases"):
        lines += [
            "",
            "## Where the time went",
            "",
            "CPU-seconds count this process and every finished child (all roles of each run).",
            "",
            "| phase | wall-clock | CPU-seconds |",
            "|---|---|---|",
        ]
        lines += [
            f"| {k} | {v['wall_s']:.0f} s | {v['cpu_s']:.0f} |" for k, v in s["phases"].items()
        ]
    return "\n".join(lines) + "\n"


def _comparison_md(s: dict[str, Any], f: Callable[..., str]) -> list[str]:
    ratio, rate = (
        s.get("sync_over_laminar_time_ratio"),
        s.get("steps_per_s_ratio_laminar_over_sync"),
    )
    if ratio is None:
        verdict = (
            "One of the runs never reached the sync run's final (smoothed) accuracy, so there is "
            "no time ratio for this run; the curves in report.png show where each one got to."
        )
    elif ratio >= 1.1:
        verdict = f"Laminar got there {ratio:.2f}x sooner."
    elif ratio <= 0.9:
        verdict = (
            f"Sync got there first ({1 / ratio:.2f}x sooner) this time: laminar's higher step rate "
            "did not make up for its stale batches and the wobble of the curves (see below)."
        )
    else:
        verdict = "A draw within the wobble of the curves (see below)."
    head = [headline(s), ""] if "target" in s else []
    return [
        "",
        "## Against the synchronous baseline (same job, `mode=sync`, same steps)",
        "",
        *head,
        "| figure | laminar | sync |",
        "|---|---|---|",
        f"| trainer steps per second | {f(s.get('trainer_steps_per_s'), '{:.2f}')} | "
        f"{f(s.get('sync_trainer_steps_per_s'), '{:.2f}')} |",
        f"| CPU-seconds of the run (all its processes) | {f(s.get('run_cpu_s'), '{:.0f}')} | "
        f"{f(s.get('sync_run_cpu_s'), '{:.0f}')} |",
        f"| cores kept busy (CPU-s / wall-s) | {f(s.get('cores_used'), '{:.2f}')} | "
        f"{f(s.get('sync_cores_used'), '{:.2f}')} |",
        f"| `laminar run` to the first trainer step | {f(s.get('first_step_s'), '{:.1f} s')} | "
        f"{f(s.get('sync_first_step_s'), '{:.1f} s')} |",
        f"| final held-out accuracy (last snapshot) | {f(s['eval_accuracy_after'])} | "
        f"{f(s['sync_eval_accuracy_after'])} |",
        "| final held-out accuracy (mean of the last 2 snapshots) | "
        f"{f(s.get('eval_accuracy_after_smoothed'))} | "
        f"{f(s.get('sync_eval_accuracy_after_smoothed'))} |",
        f"| run wall-clock (process start to exit) | {f(s['run_wall_clock_s'], '{:.0f}')} s | "
        f"{f(s['sync_run_wall_clock_s'], '{:.0f}')} s |",
        "| longest / shortest length bucket, share trained on (per-length audit; 1 = no bias) | "
        f"{f(s.get('audit_long_vs_short'), '{:.2f}')} | "
        f"{f(s.get('sync_audit_long_vs_short'), '{:.2f}')} |",
        "| time to reach sync's final accuracy | "
        f"{f(s['time_to_sync_final_accuracy_laminar_s'], '{:.0f} s', 'never')} | "
        f"{f(s['time_to_sync_final_accuracy_sync_s'], '{:.0f} s', 'never')} |",
        "",
        (
            "**Ratio** (sync time / laminar time to reach sync's final accuracy): "
            f"**{ratio:.2f}**; "
            if ratio is not None
            else ""
        )
        + f"Trainer step rate laminar / sync: **{f(rate, '{:.2f}')}**. {verdict}",
        "",
        "How it is measured: every weight snapshot (every `trainer.snapshot_every` steps) is "
        "evaluated after the runs, greedy, on the held-out prompts; accuracy is averaged over 3 "
        "consecutive snapshots (one 256-prompt eval is +-0.02-0.03, and at this learning rate the "
        "policy itself wobbles by a few points between snapshots), the target is the sync run's "
        "smoothed final accuracy, and the crossing time is interpolated between snapshots. Clocks "
        "start when `laminar run` is launched, so process start-up counts for both modes.",
        "",
        "Why the two modes differ here: in sync mode the rollouts generate the whole batch, wait "
        "for its longest trajectory, then sit idle while the trainer trains and the new weights "
        "go out; so on these 2 cores one core idles for most of each step. In laminar mode "
        "generation and training overlap: rollouts keep generating (within the staleness bound, "
        "buffer.max_staleness) while the trainer trains, and pull new weights whenever they are "
        "idle, which is where the higher step rate comes from. What limits the gain on this "
        "machine: the trainer and both rollouts share 2 CPU cores (unlike on a GPU cluster, where "
        "each role has its own devices): the trainer keeps one core (cluster.nice lowers the "
        "rollouts' priority), so generation, on the other, sets laminar's pace, and there is "
        "little long tail for the overlap to hide on a policy this small; and laminar trains on "
        "data up to buffer.max_staleness versions old, which can cost learning per step "
        "(bench/learning.py).",
    ]
