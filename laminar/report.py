"""`laminar report RUN_DIR`: report.png and summary.md (+ summary.json) for any run directory.

    laminar report runs/my-run          # after (or during) `laminar run`

Reads what the trainer wrote: metrics.jsonl (step lines with reward, tokens_per_s, staleness,
and validation lines with eval/*), completions.jsonl (sampled completions) and config.yaml
(name, mode, total steps; optional). report.png has three rows, each against trainer step
(left) and wall-clock since the run started (right):

    reward (per step, faint; trailing mean of 8) and eval accuracy (points)
    trainer tokens/s
    staleness at consumption (mean and max per step)

and, when the run directory holds a buffer journal, a fourth: the per-length audit (what the
staleness policy did to the data, laminar/fates.py): each trajectory's fate by response
length and by the group's mean reward. summary.md gives the headline figures, the audit's
tables (and its warning) and a few completions of the last step.

This is the one report module: `write_outputs` writes report.png (a grid of panels),
summary.json and summary.md for any caller. The demos (laminar/demo/results.py,
laminar/demo/tooldemo/results.py) pass their own panels and summary lines in, and use the
readers and averaging below; nothing here knows about them.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

Panel = Callable[[Any], None]
"""Draws one subplot on the matplotlib Axes it is given."""

_WINDOW = 8
"""Trailing-mean window of the reward curve (one batch's reward swings with its prompt mix)."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON object line of a file ([] when it does not exist); a torn last line is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a torn last line of a killed writer
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "metrics.jsonl")


def mean(vals: Any) -> float:
    """Mean of the finite numbers among vals (None and NaN skipped); NaN when there are none."""
    xs = [float(v) for v in vals if isinstance(v, int | float) and math.isfinite(v)]
    return sum(xs) / len(xs) if xs else float("nan")


def rolling(vals: list[float], k: int) -> list[float]:
    """Trailing mean over the last k values (fewer at the start); NaNs skipped."""
    return [mean(vals[max(0, i - k + 1) : i + 1]) for i in range(len(vals))]


def _num(rec: dict[str, Any], key: str) -> float:
    v = rec.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else float("nan")


def _start_time(run_dir: Path, metrics: list[dict[str, Any]]) -> float:
    """When the run started: the resolved config is written first, else the first metrics line."""
    times = [float(m["time"]) for m in metrics if isinstance(m.get("time"), int | float)]
    cfg = run_dir / "config.yaml"
    if cfg.exists():
        times.append(cfg.stat().st_mtime)
    return min(times) if times else 0.0


def _config(run_dir: Path) -> dict[str, Any]:
    import yaml

    path = run_dir / "config.yaml"
    if not path.exists():
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def summarize(run_dir: Path) -> dict[str, Any]:
    """Headline figures of a run directory (every figure NaN/None when its metric is missing)."""
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if "reward" in m]
    evals = [m for m in metrics if "eval/accuracy" in m]
    cfg = _config(run_dir)
    t0 = _start_time(run_dir, metrics)
    k = max(5, len(steps) // 10)  # a tenth of the run at each end, at least 5 steps
    tps = [v for m in steps if math.isfinite(v := _num(m, "tokens_per_s"))]
    last_time = max((float(m["time"]) for m in metrics if "time" in m), default=t0)
    return {
        "run_dir": str(run_dir),
        "name": cfg.get("name"),
        "mode": cfg.get("mode"),
        "model": (cfg.get("model") or {}).get("path"),
        "train_data": (cfg.get("data") or {}).get("train"),
        "total_steps": (cfg.get("trainer") or {}).get("total_steps"),
        "steps": max((int(m["step"]) for m in steps), default=0),
        "wall_clock_s": round(last_time - t0, 1),
        "reward_window_steps": k,
        "reward_first": mean(m.get("reward") for m in steps[:k]),
        "reward_last": mean(m.get("reward") for m in steps[-k:]),
        "eval_first": (
            {
                "step": evals[0]["step"],
                "accuracy": evals[0]["eval/accuracy"],
                "n": evals[0].get("eval/n"),
            }
            if evals
            else None
        ),
        "eval_last": (
            {
                "step": evals[-1]["step"],
                "accuracy": evals[-1]["eval/accuracy"],
                "n": evals[-1].get("eval/n"),
            }
            if evals
            else None
        ),
        "eval_best": max(
            (m["eval/accuracy"] for m in evals if m["eval/accuracy"] is not None), default=None
        ),
        "tokens_per_s_median": statistics.median(tps) if tps else float("nan"),
        "step_s_mean": mean(m.get("step_s") for m in steps),
        "staleness_mean": mean(m.get("staleness") for m in steps),
        "staleness_max": max(
            (
                int(_num(m, "staleness_max"))
                for m in steps
                if math.isfinite(_num(m, "staleness_max"))
            ),
            default=0,
        ),
        "dropped": int(sum(v for m in steps if math.isfinite(v := _num(m, "dropped")))),
    }


def draw(
    out: Path,
    grid: Sequence[Sequence[Panel]],
    *,
    title: str = "",
    size: tuple[float, float] = (13.0, 11.0),
    dpi: int = 90,
    sharex: Literal["none", "all", "row", "col"] | bool = False,
) -> Path:
    """Draw `grid` (rows of panels) into one figure at `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(len(row) for row in grid)
    fig, ax = plt.subplots(len(grid), cols, figsize=size, sharex=sharex, squeeze=False)
    for i, row in enumerate(grid):
        for j, panel in enumerate(row):
            panel(ax[i][j])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def write_outputs(
    run_dir: Path,
    summary: dict[str, Any],
    md: str,
    grid: Sequence[Sequence[Panel]],
    **figure: Any,
) -> tuple[Path, Path]:
    """summary.json (NaN as null), summary.md, then report.png (`draw(..., **figure)`) in
    run_dir; returns (png, md). The figure comes last: without matplotlib the numbers stay."""
    (run_dir / "summary.json").write_text(json.dumps(_finite(summary), indent=2, default=str))
    md_path = run_dir / "summary.md"
    md_path.write_text(md)
    return draw(run_dir / "report.png", grid, **figure), md_path


def _no_data(p: Any) -> None:
    where = {"ha": "center", "va": "center", "transform": p.transAxes, "color": "gray"}
    p.text(0.5, 0.5, "no data in metrics.jsonl", **where)


def run_panels(run_dir: Path) -> list[list[Panel]]:
    """The generic report's panels: reward and eval accuracy, throughput, staleness (rows),
    each against trainer step and wall-clock (columns); a panel with no data says so."""
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if "reward" in m]
    evals = [m for m in metrics if "eval/accuracy" in m and m["eval/accuracy"] is not None]
    t0 = _start_time(run_dir, metrics)

    def column(xlabel: str, xof: Callable[[dict[str, Any]], float]) -> list[Panel]:
        xs = [xof(m) for m in steps]

        def reward(a: Any) -> None:
            rw = [_num(m, "reward") for m in steps]
            if steps:
                a.plot(xs, rw, color="tab:blue", alpha=0.25, lw=0.8, label="batch reward")
                label = f"batch reward (mean of {_WINDOW})"
                a.plot(xs, rolling(rw, _WINDOW), color="tab:blue", lw=1.6, label=label)
            if evals:
                a.plot(
                    [xof(m) for m in evals],
                    [m["eval/accuracy"] for m in evals],
                    "o-",
                    color="tab:green",
                    lw=1.4,
                    label="eval accuracy (greedy, data.eval)",
                )
            a.set_ylabel("reward / accuracy")
            a.set_title(f"Reward and eval accuracy vs {xlabel.split(' (')[0]}")
            a.grid(alpha=0.3)
            if steps or evals:
                a.legend(fontsize=8, loc="best")
            else:
                _no_data(a)

        def throughput(b: Any) -> None:
            if steps:
                b.plot(xs, [_num(m, "tokens_per_s") for m in steps], color="tab:purple", lw=1.2)
            else:
                _no_data(b)
            b.set_ylabel("trainer tokens/s")
            b.set_title("Trainer throughput (tokens per second of compute)")
            b.grid(alpha=0.3)

        def staleness(c: Any) -> None:
            if steps:
                c.plot(
                    xs,
                    [_num(m, "staleness") for m in steps],
                    color="tab:orange",
                    lw=1.2,
                    label="mean staleness of the batch",
                )
                c.step(
                    xs,
                    [_num(m, "staleness_max") for m in steps],
                    where="mid",
                    color="tab:red",
                    lw=1.0,
                    alpha=0.7,
                    label="max staleness",
                )
                c.legend(fontsize=8, loc="best")
            else:
                _no_data(c)
            c.set_ylabel("versions behind")
            c.set_xlabel(xlabel)
            c.set_title("Staleness at consumption (trainer version - trajectory version)")
            c.grid(alpha=0.3)

        return [reward, throughput, staleness]

    by_step = column("trainer step", lambda m: m["step"])
    by_time = column("wall-clock (s)", lambda m: m["time"] - t0)
    return [list(row) for row in zip(by_step, by_time, strict=True)]


def run_title(run_dir: Path) -> str:
    metrics = read_metrics(run_dir)
    steps = sum(1 for m in metrics if "reward" in m)
    evals = sum(1 for m in metrics if m.get("eval/accuracy") is not None)
    name = _config(run_dir).get("name") or run_dir.name
    return f"{name}: {steps} logged steps, {evals} validations"


def _finite(value: Any) -> Any:
    """NaN/inf -> None, so summary.json is valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def fmt(v: Any, spec: str = "{:.3f}", missing: str = "n/a") -> str:
    """A figure for a summary table; None and NaN read `missing`."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return missing
    return spec.format(v)


def _cell(text: Any, limit: int = 160) -> str:
    s = str(text if text is not None else "")
    s = s if len(s) <= limit else s[:limit] + " …"
    return s.replace("|", "\\|").replace("\n", " ⏎ ")


def summary_md(
    s: dict[str, Any],
    completions: list[dict[str, Any]],
    extra_lines: Sequence[str] = (),
    sections: Sequence[str] = (),
) -> str:
    """The table of headline figures (+ `extra_lines` rows), then `sections` (lines), then the
    last step's completions."""
    ev0, ev1 = s["eval_first"], s["eval_last"]

    def ev(e: dict[str, Any] | None) -> str:
        if e is None:
            return "n/a"
        return f"{fmt(e['accuracy'])} (step {e['step']}, {fmt(e.get('n'), '{:.0f}')} prompts)"

    lines = [
        f"# Run summary: {s.get('name') or Path(s['run_dir']).name}",
        "",
        f"`{s['run_dir']}`, mode {s.get('mode') or 'n/a'}, model `{s.get('model') or 'n/a'}`, "
        f"data `{s.get('train_data') or 'n/a'}`. Curves: report.png.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| trainer steps | {s['steps']} / {s.get('total_steps') or '?'} |",
        f"| wall-clock (config written to last metrics line) | {fmt(s['wall_clock_s'], '{:.0f}')}"
        " s |",
        f"| batch reward, mean of the first → last {s['reward_window_steps']} steps | "
        f"{fmt(s['reward_first'])} → {fmt(s['reward_last'])} |",
        f"| eval accuracy, first → last validation | {ev(ev0)} → {ev(ev1)} |",
        f"| best eval accuracy | {fmt(s['eval_best'])} |",
        f"| trainer tokens/s (median over steps) | {fmt(s['tokens_per_s_median'], '{:.0f}')} |",
        f"| step time (mean) | {fmt(s['step_s_mean'], '{:.2f}')} s |",
        f"| staleness mean / max | {fmt(s['staleness_mean'], '{:.2f}')} / {s['staleness_max']} |",
        f"| trajectories dropped by the trainer | {s['dropped']} |",
        *extra_lines,
        *sections,
    ]
    train = [c for c in completions if not c.get("eval")]
    if train:
        last = max(int(c.get("step", 0)) for c in train)
        lines += [
            "",
            f"## Completions of step {last} (from completions.jsonl)",
            "",
            "| version | reward | prompt | completion |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {c.get('version')} | {fmt(c.get('reward'))} | {_cell(c.get('prompt'))} | "
            f"{_cell(c.get('completion'))} |"
            for c in train
            if c.get("step") == last
        ]
    evals = [c for c in completions if c.get("eval")]
    if evals:
        last = max(int(c.get("step", 0)) for c in evals)
        lines += [
            "",
            f"## Eval completions at step {last} (greedy)",
            "",
            "| reward | prompt | completion | answer |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {fmt(c.get('reward'))} | {_cell(c.get('prompt'))} | {_cell(c.get('completion'))} | "
            f"{_cell(c.get('answer'))} |"
            for c in evals
            if c.get("step") == last
        ]
    return "\n".join(lines) + "\n"


def write_report(
    run_dir: str | Path,
    extra_panels: Sequence[Panel] = (),
    extra_lines: Sequence[str] = (),
) -> tuple[Path, Path]:
    """report.png, summary.md and summary.json in run_dir; returns (png, md). A caller's
    `extra_panels` make one more row of the figure, `extra_lines` more rows of the table."""
    from laminar.fates import fate_md, fate_panels, run_fates, summary_keys

    run_dir = Path(run_dir)
    s = summarize(run_dir)
    audit = run_fates(run_dir)
    s.update(summary_keys(audit))
    sections = fate_md({"run": audit}) if audit is not None else []
    md = summary_md(s, read_jsonl(run_dir / "completions.jsonl"), extra_lines, sections)
    grid = run_panels(run_dir) + ([list(extra_panels)] if extra_panels else [])
    if audit is not None:
        grid.append(fate_panels({"run": audit}))
    figure = {"title": run_title(run_dir), "size": (13.0, 11.0 * len(grid) / 3)}
    # a caller's row (and the audit's) has x axes of its own
    sharex: Literal["col"] | bool = "col" if len(grid) == 3 else False
    return write_outputs(run_dir, s, md, grid, sharex=sharex, **figure)


def report_main(run_dir: str) -> int:
    """`laminar report RUN_DIR`; 1 with a message when there is nothing to report."""
    path = Path(run_dir)
    if not (path / "metrics.jsonl").exists():
        where = "is not a directory" if not path.is_dir() else "has no metrics.jsonl"
        print(
            f"laminar report: {path} {where}; give the run_dir of a `laminar run` "
            "(default runs/<name>) after its trainer logged a step",
            file=sys.stderr,
        )
        return 1
    png, md = write_report(path)
    print(f"wrote {png} and {md}")
    return 0
