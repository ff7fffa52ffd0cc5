"""The tool demo's results: accuracy and tool-call rate from weight snapshots, and the panels
and summary lines it hands to the report module (laminar/report.py).

    curve = eval_curve(run_dir, policy0, rows, settings, before, t0, evaluate)  # [{t, step, ...}]
    summary = summarize(mode, run, before, wall)
    write_outputs(run_dir, run, summary)   # summary.json, summary.md, report.png (report.py)

Snapshots are evaluated after the run (never inside it), so evaluation does not slow RL.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from laminar import report
from laminar.config import DemoConfig
from laminar.report import Panel, mean, read_jsonl

Evaluate = Callable[[Any, list[dict], Any], dict[str, Any]]
"""(model, rows, tokenizer) -> the held-out figures (laminar/tasks/evaluate.py:
summarize_outcomes)."""


def point(res: dict[str, Any], **where: Any) -> dict[str, Any]:
    """One curve point from an evaluation summary."""
    hard, easy = res.get("hard", {}), res.get("easy", {})
    return {
        **where,
        "accuracy": res["accuracy"],
        "prompts": res["prompts"],
        "tool_rate": res["tool_rate"],
        "hard_accuracy": hard.get("accuracy"),
        "hard_tool_rate": hard.get("tool_rate"),
        "easy_accuracy": easy.get("accuracy"),
        "easy_tool_rate": easy.get("tool_rate"),
    }


def eval_curve(
    run_dir: Path,
    policy0: Path,
    rows: list[dict],
    s: DemoConfig,
    before: dict[str, Any],
    t0: float,
    evaluate: Evaluate,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """The warm-up point, then every snapshot (or `curve_points` evenly spaced ones) on the first
    `curve_eval_rows` rows, the last one on all rows."""
    from laminar.demo.results import load_snapshot
    from laminar.models.tiny import load_tokenizer

    curve = [point(before, t=0.0, step=0, version=0)]
    snaps = run_dir / "snapshots"
    index = [
        e
        for e in read_jsonl(snaps / "index.jsonl")
        if (snaps / f"v{e['version']}.safetensors").exists()
    ]
    if not index:
        log(f"no snapshots in {run_dir}; the curve has only the warm-up point")
        return curve
    k = s.curve_points
    picks = list(range(len(index)))
    if 0 < k < len(index):
        picks = sorted(
            {round(i * (len(index) - 1) / max(1, k - 1)) for i in range(k)} | {len(index) - 1}
        )
    tok = load_tokenizer(policy0)
    subset = rows[: s.curve_eval_rows]
    for i in picks:
        e = index[i]
        last = i == len(index) - 1
        model = load_snapshot(policy0, snaps / f"v{e['version']}.safetensors")
        res = evaluate(model, rows if last else subset, tok)
        curve.append(point(res, t=e["time"] - t0, step=e["step"], version=e["version"]))
        if last:
            curve[-1]["samples"] = res.get("samples", [])
        log(
            f"  v{e['version']} (step {e['step']}, {e['time'] - t0:.0f}s): accuracy "
            f"{res['accuracy']:.3f}, hard {curve[-1]['hard_accuracy']:.3f}, tool-call rate on hard "
            f"{curve[-1]['hard_tool_rate']:.2f}"
        )
    return curve


def summarize(
    mode: str, run: dict[str, Any], before: dict[str, Any], wall: float
) -> dict[str, Any]:
    m = run.get("metrics", [])
    after = run["curve"][-1]
    b = point(before)
    k = max(5, len(m) // 10)
    multiturn = {
        key: mean([r.get(key) for r in m])
        for key in sorted({key for r in m for key in r})
        if _is_multiturn_metric(key)
    }
    return {
        "mode": mode,
        "eval_prompts": after["prompts"],
        "eval_accuracy_before": b["accuracy"],
        "eval_accuracy_after": after["accuracy"],
        "hard_accuracy_before": b["hard_accuracy"],
        "hard_accuracy_after": after["hard_accuracy"],
        "easy_accuracy_before": b["easy_accuracy"],
        "easy_accuracy_after": after["easy_accuracy"],
        "hard_tool_rate_before": b["hard_tool_rate"],
        "hard_tool_rate_after": after["hard_tool_rate"],
        "easy_tool_rate_before": b["easy_tool_rate"],
        "easy_tool_rate_after": after["easy_tool_rate"],
        "steps": m[-1]["step"] if m else 0,
        "reward_first": mean([r.get("reward") for r in m[:k]]),
        "reward_last": mean([r.get("reward") for r in m[-k:]]),
        "staleness_mean": mean([r.get("staleness") for r in m]),
        "multiturn_metrics_mean": multiturn,
        "run_wall_clock_s": round(run["wall_clock_s"], 1),
        "wall_clock_s": round(wall, 1),
        "curve": [{k: v for k, v in p.items() if k != "samples"} for p in run["curve"]],
        "samples_after": after.get("samples", [])[:6],
    }


def _is_multiturn_metric(key: str) -> bool:
    return any(w in key for w in ("turn", "tool", "env_token")) and not key.startswith("staleness")


def _episodes(curve: list[dict[str, Any]], x: str, label: str) -> Panel:
    """Held-out accuracy and tool-call rate, all / hard / easy prompts, against `x`."""

    def draw(a: Any) -> None:
        xs = [p[x] for p in curve]
        for key, style, color, name in (
            ("accuracy", "o-", "tab:blue", "held-out accuracy"),
            ("hard_accuracy", "s--", "tab:purple", "accuracy, hard prompts"),
            ("easy_accuracy", "d--", "tab:red", "accuracy, easy prompts"),
            ("hard_tool_rate", "^-", "tab:green", "tool-call rate, hard prompts"),
            ("easy_tool_rate", "v:", "tab:olive", "tool-call rate, easy prompts"),
        ):
            alpha = 0.6 if key == "easy_accuracy" else 1.0
            a.plot(xs, [p[key] for p in curve], style, color=color, alpha=alpha, label=name)
        a.set_xlabel(label)
        a.set_ylim(-0.02, 1.02)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
        a.set_title("Greedy held-out episodes vs wall-clock" if x == "t" else "... vs trainer step")

    return draw


def _training(m: list[dict[str, Any]]) -> Panel:
    """Batch reward and the episode shape (tool calls, turns, environment tokens) per step."""

    def draw(a: Any) -> None:
        steps = [r["step"] for r in m]
        rewards = [r.get("reward", float("nan")) for r in m]
        a.plot(steps, rewards, color="tab:blue", alpha=0.6, label="batch reward")
        for key, color in (
            ("episode/tool_calls", "tab:green"),
            ("episode/turns", "tab:orange"),
            ("episode/env_token_frac", "tab:gray"),
        ):
            if any(key in r for r in m):
                ys = [r.get(key, float("nan")) for r in m]
                a.plot(steps, ys, color=color, alpha=0.8, label=key)
        a.set_xlabel("trainer step")
        a.set_title("Training batches")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)

    return draw


def panels(run: dict[str, Any]) -> list[list[Panel]]:
    """The tool demo's figure: one row, episodes vs wall-clock and vs step, training batches."""
    curve = run["curve"]
    return [
        [
            _episodes(curve, "t", "wall-clock since launch (s)"),
            _episodes(curve, "step", "trainer step"),
            _training(run.get("metrics", [])),
        ]
    ]


def summary_md(s: dict[str, Any]) -> str:
    f = report.fmt

    rows = [
        ("held-out accuracy", "eval_accuracy"),
        ("accuracy on hard prompts (products)", "hard_accuracy"),
        ("accuracy on easy prompts (sums)", "easy_accuracy"),
        ("tool-call rate on hard prompts", "hard_tool_rate"),
        ("tool-call rate on easy prompts", "easy_tool_rate"),
    ]
    lines = [
        "# Tool demo: a tiny policy learns to call a calculator",
        "",
        f"Greedy episodes on {s['eval_prompts']} held-out prompts (ToolEnv, calculator), "
        "before RL (the warm-up policy) and at the last weight snapshot.",
        "",
        "| figure | before | after |",
        "|---|---|---|",
    ]
    lines += [
        f"| {name} | {f(s[key + '_before'])} | {f(s[key + '_after'])} |" for name, key in rows
    ]
    lines += [
        "",
        "| run | |",
        "|---|---|",
        f"| trainer steps | {s['steps']} |",
        f"| batch reward, first → last tenth | {f(s['reward_first'])} → {f(s['reward_last'])} |",
        f"| staleness mean | {f(s['staleness_mean'], '{:.2f}')} |",
        f"| RL run wall-clock | {f(s['run_wall_clock_s'], '{:.0f}')} s |",
        f"| whole demo wall-clock | {f(s['wall_clock_s'], '{:.0f}')} s |",
    ]
    lines += [
        f"| {k} (run mean) | {f(v)} |" for k, v in s.get("multiturn_metrics_mean", {}).items()
    ]
    lines += [
        "",
        "## Curve",
        "",
        "| t (s) | step | accuracy | hard accuracy | tool-call rate, hard |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {p['t']:.0f} | {p['step']} | {f(p['accuracy'])} | {f(p['hard_accuracy'])} | "
        f"{f(p['hard_tool_rate'], '{:.2f}')} |"
        for p in s["curve"]
    ]
    if s.get("samples_after"):
        lines += ["", "## Completions after RL (first held-out prompts)", ""]
        lines += [
            f"- `{x['prompt']}` → `{x['completion']!r}` (answer {x['answer']}, score "
            f"{x['score']:.0f})"
            for x in s["samples_after"]
        ]
    if s.get("phases"):
        lines += ["", "| phase | wall-clock | CPU-seconds |", "|---|---|---|"]
        lines += [
            f"| {k} | {v['wall_s']:.0f} s | {v['cpu_s']:.0f} |" for k, v in s["phases"].items()
        ]
    return "\n".join(lines) + "\n"


def write_outputs(run_dir: Path, run: dict[str, Any], summary: dict[str, Any]) -> None:
    try:
        report.write_outputs(
            run_dir, summary, summary_md(summary), panels(run), size=(17, 4.8), dpi=110
        )
    except ImportError:  # matplotlib is optional here; the summary has the numbers
        pass
