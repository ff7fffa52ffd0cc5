"""The default job (`make run` = python -m laminar.demo): habit demos, warm-up batching, summary.

    .venv/bin/python -m pytest tests/test_demo.py -q          # fast unit tests (seconds)
    .venv/bin/python -m pytest tests/test_demo.py -q -m slow  # + a shortened demo run (minutes)

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
from laminar.demo.results import smooth, summarize, summary_md, time_to_reach
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
    big = [
        (r, d)
        for r, d in zip(rows, demos, strict=True)
        if cu.parse_prompt(r["prompt"])[1] >= habit.HABIT_STRIDE
    ]
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

    cfg = load_config(
        ROOT / "configs" / "demo.yaml", ["demo.model.hidden=64", "demo.skip_sync=true"]
    )
    s = demo_settings(cfg)
    assert s.model.hidden == 64 and s.model.layers == 3
    assert s.skip_sync is True
    assert cfg.buffer.max_staleness is not None  # CPU rollouts must not race ahead of the trainer


def _curve(points):
    return [{"t": t, "step": 5 * i, "accuracy": a} for i, (t, a) in enumerate(points)]


def test_time_to_reach_interpolates_between_snapshots():
    c = _curve([(0, 0.3), (70, 0.7), (150, 0.8)])
    assert time_to_reach(c, 0.8) == 150 and time_to_reach(c, 0.3) == 0
    assert time_to_reach(c, 0.75) == pytest.approx(110)
    assert time_to_reach(c, 0.9) is None


def test_smooth_averages_neighbouring_snapshots_and_keeps_the_start():
    c = smooth(_curve([(0, 0.3), (20, 0.6), (40, 0.8), (60, 0.9), (80, 0.9)]))
    assert [round(p["accuracy"], 4) for p in c] == [0.3, 0.7, 0.7667, 0.8667, 0.9]
    assert [p["t"] for p in c] == [0, 20, 40, 60, 80]


def test_summary_compares_modes_and_lists_phases():
    lam_curve = _curve([(0, 0.3), (20, 0.6), (40, 0.8), (60, 0.9), (80, 0.9)])
    lam_curve[-1]["habit"] = 0.02
    sync_curve = _curve([(0, 0.3), (30, 0.5), (60, 0.7), (90, 0.8), (120, 0.8)])
    lam_m = [
        {"step": i, "time": 10 + i, "reward": 0.5 + i / 100, "staleness": 2, "staleness_max": 2}
        for i in range(1, 21)
    ]
    sync_m = [
        {"step": i, "time": 10 + 2 * i, "reward": 0.5, "staleness": 0, "staleness_max": 0}
        for i in range(1, 21)
    ]
    runs = {
        "laminar": {"curve": lam_curve, "metrics": lam_m, "wall_clock_s": 100.0},
        "sync": {"curve": sync_curve, "metrics": sync_m, "wall_clock_s": 160.0},
    }
    before = {"accuracy": 0.3, "prompts": 256, "habit": 0.9}
    s = summarize("laminar", runs, before, {**lam_curve[-1], "prompts": 256}, 400.0)
    # target: sync's smoothed final 0.8; laminar's smoothed curve crosses it between 40 s (0.767)
    # and 60 s (0.867)
    assert s["sync_eval_accuracy_after_smoothed"] == pytest.approx(0.8)
    assert s["time_to_sync_final_accuracy_sync_s"] == pytest.approx(120)
    assert s["time_to_sync_final_accuracy_laminar_s"] == pytest.approx(40 + 20 / 3)
    assert s["sync_over_laminar_time_ratio"] == pytest.approx(120 / (40 + 20 / 3))
    assert s["steps_per_s_ratio_laminar_over_sync"] == pytest.approx(2.0)
    assert s["eval_habit_before"] == 0.9 and s["eval_habit_after"] == 0.02
    assert s["reward_last"] > s["reward_first"]
    s["phases"] = {"warmup": {"wall_s": 120.0, "cpu_s": 230.0}}
    md = summary_md(s)
    assert (
        "**2.57**" in md
        and "sooner" in md
        and "90% → 2%" in md
        and "| warmup | 120 s | 230 |" in md
    )


def test_summary_without_a_crossing_says_so():
    lam = _curve([(0, 0.3), (20, 0.4), (40, 0.45)])
    sync = _curve([(0, 0.3), (20, 0.7), (40, 0.8)])
    m = [{"step": i, "time": i, "reward": 0.5} for i in range(1, 5)]
    runs = {
        "laminar": {"curve": lam, "metrics": m, "wall_clock_s": 50.0},
        "sync": {"curve": sync, "metrics": m, "wall_clock_s": 50.0},
    }
    before = {"accuracy": 0.3, "prompts": 10}
    s = summarize("laminar", runs, before, {**lam[-1], "prompts": 10}, 100.0)
    assert s["sync_over_laminar_time_ratio"] is None
    md = summary_md(s)
    assert "never reached" in md and "n/a s" not in md


def test_clock_laps_count_cpu_of_children():
    clock = Clock()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    lap = clock.lap("child")
    assert lap["cpu_s"] > 0.05 and lap["wall_s"] >= 0


@pytest.mark.slow
def test_shortened_demo_learns(short_dir: Path):
    """Warm-up (cut short) -> laminar RL -> held-out greedy accuracy goes up and the habit goes
    away."""
    run_dir = short_dir / "demo"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "laminar.demo",
        f"run_dir={run_dir}",
        f"demo.cache_dir={short_dir / 'cache'}",
        "demo.warmup_steps=1100",
        "trainer.total_steps=40",
        "demo.skip_sync=true",
        "demo.eval_rows=200",
        "demo.curve_eval_rows=64",
        "demo.curve_points=3",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["eval_prompts"] == 200
    assert s["eval_accuracy_after"] >= s["eval_accuracy_before"] + 0.10, s
    assert s["eval_habit_after"] < s["eval_habit_before"], s
    # no batch-reward trend check here: over 40 steps of 8 groups the batch reward swings by
    # +-0.3 with the prompt mix, and laminar's first batches are the quickest (easiest) groups;
    # the full demo (make run) reports the reward curve, the greedy held-out accuracy is the test
    assert s["steps"] == 40 and 0.0 <= s["reward_first"] <= 1.0 and 0.0 <= s["reward_last"] <= 1.0
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert "Where the time went" in (run_dir / "summary.md").read_text()


def test_strict_reward_credits_only_a_well_formed_right_answer():
    from laminar.demo.reward import strict

    p = cu.make_prompt(10, 3, 20)
    good = cu.solve(p)
    ans = cu.answer_of(p)
    assert cu.well_formed(good)
    assert strict(p, good, answer=ans) == {"reward": 1.0, "correct": 1.0, "format": 1.0}
    run_on = good + "+3=25>20;#25"  # right answer, then more steps: the lenient verifier credits it
    assert cu.reward(p, run_on, answer=ans)["reward"] == 1.0
    assert strict(p, run_on, answer=ans)["reward"] == 0.0
    wrong = good.rsplit("#", 1)[0] + "#" + str(int(ans) + 1)
    assert (
        strict(p, wrong, answer=ans)["reward"] == 0.0
        and strict(p, wrong, answer=ans)["format"] == 1.0
    )
    assert strict(p, good) is None  # no reference: the row is excluded
