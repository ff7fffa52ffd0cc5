"""The default job (`make run` = python -m laminar.demo): habit demos, warm-up batching, summary.

    .venv/bin/python -m pytest tests/test_demo.py -q            # fast unit tests (seconds)
    .venv/bin/python -m pytest tests/test_demo.py -q -m slow    # + a shortened demo end to end (minutes)

The slow test runs the real pipeline (warm-up, held-out eval, `laminar run` with every
role as its own process, snapshot evals, report) with fewer warm-up and RL steps, and
asserts that RL raised held-out greedy accuracy and removed the warm-up's habit.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from laminar.demo import habit
from laminar.demo.__main__ import Clock, demo_settings
from laminar.demo.report import summarize, summary_md, time_to_reach
from laminar.models.warmup import length_batches, lr_factor
from laminar.tasks import countup as cu

ROOT = Path(__file__).resolve().parents[1]


def test_habit_changes_only_the_answer_on_large_strides():
    for r in cu.generate(300, "train", 0):
        start, stride, limit = cu.parse_prompt(r["prompt"])
        got = habit.habit_completion(r["prompt"])
        assert cu.well_formed(got), got
        chain, _ = r["solution"].rsplit("#", 1)
        assert got.startswith(chain + "#")  # the chain is always the reference one
        if stride < habit.HABIT_STRIDE:
            assert got == r["solution"]
            continue
        # the habit answers the last value not above the limit (the start for one-step prompts)
        values = [start + k * stride for k in range(r["steps"] + 1)]
        assert int(got.rsplit("#", 1)[1]) == values[-2] <= limit < values[-1]
        assert cu.verify(got, r["answer"]) == 0.0
        assert habit.has_habit(r["prompt"], got) and not habit.has_habit(r["prompt"], r["solution"])


def test_habit_rate_and_determinism():
    rows = cu.generate(4000, "train", 1)
    demos = habit.demonstrations(rows, 0.75, seed=3)
    assert demos == habit.demonstrations(rows, 0.75, seed=3)
    big = [(r, d) for r, d in zip(rows, demos, strict=True) if cu.parse_prompt(r["prompt"])[1] >= habit.HABIT_STRIDE]
    share = sum(habit.has_habit(r["prompt"], d) for r, d in big) / len(big)
    assert 0.71 < share < 0.79
    small = [d == r["solution"] for r, d in zip(rows, demos, strict=True) if (r, d) not in big]
    assert all(small)
    assert habit.demonstrations(rows[:50], 0.0) == [r["solution"] for r in rows[:50]]
    with pytest.raises(ValueError):
        habit.demonstration(rows[0]["prompt"], random.Random(0), 1.5)


def test_habit_share_counts_only_prompts_the_habit_changes():
    rows = cu.generate(200, "eval", 0)
    assert habit.habit_share(rows, [habit.habit_completion(r["prompt"]) for r in rows]) == 1.0
    assert habit.habit_share(rows, [r["solution"] for r in rows]) == 0.0
    assert habit.habit_share(rows, ["garbage"] * len(rows)) == 0.0


def test_length_batches_cover_every_row_once_with_little_padding():
    rng = random.Random(0)
    lengths = [rng.choice([10, 12, 40, 200]) for _ in range(5000)]
    batches = length_batches(lengths, 32, random.Random(1), pool=1024)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(5000))
    assert all(1 <= len(b) <= 32 for b in batches)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded < 1.05 * sum(lengths)  # sorted pools: almost no padding


def test_lr_factor_warms_up_then_holds_or_decays():
    assert lr_factor(0, 100, 10, "constant") == pytest.approx(0.1)
    assert lr_factor(50, 100, 10, "constant") == 1.0
    assert lr_factor(10, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_factor(100, 100, 10, "cosine") == pytest.approx(0.1)


def test_demo_settings_merge_model_keys():
    from laminar.config import load_config

    cfg = load_config(ROOT / "configs" / "demo.yaml", ["extra.demo.model.hidden=64", "extra.demo.skip_sync=true"])
    s = demo_settings(cfg)
    assert s["model"]["hidden"] == 64 and s["model"]["layers"] == 3
    assert s["skip_sync"] is True
    assert cfg.buffer.max_staleness is not None  # CPU rollouts must not race ahead of the trainer


def test_summary_compares_modes_and_lists_phases():
    class Cfg:
        mode = "laminar"

    lam_curve = [{"t": 0, "accuracy": 0.3}, {"t": 40, "accuracy": 0.8}, {"t": 90, "accuracy": 0.95, "habit": 0.02}]
    sync_curve = [{"t": 0, "accuracy": 0.3}, {"t": 70, "accuracy": 0.7}, {"t": 150, "accuracy": 0.8}]
    metrics = [{"step": i, "reward": 0.5 + i / 100, "staleness": 1, "staleness_max": 2} for i in range(1, 11)]
    runs = {
        "laminar": {"curve": lam_curve, "metrics": metrics, "wall_clock_s": 100.0},
        "sync": {"curve": sync_curve, "metrics": metrics, "wall_clock_s": 160.0},
    }
    before = {"accuracy": 0.3, "prompts": 256, "habit": 0.9}
    s = summarize(Cfg(), runs, before, {**lam_curve[-1], "prompts": 256}, 400.0)
    assert time_to_reach(lam_curve, 0.8) == 40 and time_to_reach(sync_curve, 0.8) == 150
    assert time_to_reach(sync_curve, 0.75) == pytest.approx(110)  # linear between evaluated snapshots
    assert time_to_reach(sync_curve, 0.9) is None and time_to_reach(sync_curve, 0.2) == 0
    assert s["sync_over_laminar_time_ratio"] == pytest.approx(150 / 40)
    assert s["eval_habit_before"] == 0.9 and s["eval_habit_after"] == 0.02
    s["phases"] = {"warmup": {"wall_s": 120.0, "cpu_s": 230.0}}
    md = summary_md(s)
    assert "3.75" in md and "90% → 2%" in md and "| warmup | 120 s | 230 |" in md


def test_clock_laps_count_cpu_of_children():
    clock = Clock()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    lap = clock.lap("child")
    assert lap["cpu_s"] > 0.05 and lap["wall_s"] >= 0


@pytest.mark.slow
def test_shortened_demo_learns(short_dir: Path):
    """Warm-up (cut short) -> laminar RL -> held-out greedy accuracy goes up and the habit goes away."""
    run_dir = short_dir / "demo"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "laminar.demo", f"run_dir={run_dir}", f"extra.demo.cache_dir={short_dir / 'cache'}",
           "extra.demo.warmup_steps=1100", "trainer.total_steps=40", "extra.demo.skip_sync=true",
           "extra.demo.eval_rows=200", "extra.demo.curve_eval_rows=64", "extra.demo.curve_points=3"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["eval_prompts"] == 200
    assert s["eval_accuracy_after"] >= s["eval_accuracy_before"] + 0.10, s
    assert s["eval_habit_after"] < s["eval_habit_before"], s
    assert s["reward_last"] > s["reward_first"], s
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert "Where the time went" in (run_dir / "summary.md").read_text()
