"""bench/learning.py's offline parts on synthetic curves (the bench itself runs the demo for
minutes).

.venv/bin/python -m pytest tests/test_learning_bench.py -q
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import learning  # noqa: E402


def curve(accs, dt=10.0):
    return [{"step": 5 * i, "t": 14.0 + dt * i, "accuracy": a} for i, a in enumerate(accs)]


def fake_run(cell, seed, accs, dt, rate):
    c = curve(accs, dt)
    out = {
        "cell": cell,
        "seed": seed,
        "curve": c,
        "smoothed": c,
        "steps_per_s": rate,
        "best_smoothed": max(accs),
        "final": accs[-1],
        "wall_s": 100.0,
        "cpu_s": 150.0,
        "cores": 1.5,
    }
    for tgt in learning.TARGETS:
        k = f"{round(tgt * 100):03d}"
        out[f"steps_to_{k}"] = learning.crossing(c, "step", tgt)
        out[f"seconds_to_{k}"] = learning.crossing(c, "t", tgt)
        out[f"short_by_{k}"] = round(max(0.0, tgt - max(accs)), 3)
    return out


def test_crossing_interpolates_and_says_never():
    c = curve([0.5, 0.8, 0.9, 0.95])
    assert learning.crossing(c, "step", 0.85) == pytest.approx(7.5)
    assert learning.crossing(c, "t", 0.90) == pytest.approx(34.0)
    assert learning.crossing(c, "step", 0.99) is None


def test_gain_area_is_relative_to_the_start():
    assert learning.gain_area(curve([0.5, 0.5, 0.5]), 10) == 0
    assert learning.gain_area(curve([0.5, 0.7, 0.7]), 10) == pytest.approx(5 * 0.1 + 5 * 0.2)
    assert learning.gain_area(curve([0.5, 0.7, 0.7]), 5) == pytest.approx(0.5)


def test_summary_pairs_runs_by_seed_and_takes_medians(tmp_path):
    sync_accs, lam_accs = [0.5, 0.8, 0.9, 0.95], [0.5, 0.75, 0.88, 0.92]
    runs = []
    for seed in range(3):
        runs.append(fake_run("sync:0:default", seed, sync_accs, dt=10.0, rate=0.5))
        runs.append(fake_run("laminar:2:default", seed, lam_accs, dt=6.0, rate=0.8))
    res = learning.aggregate(runs, ("laminar:2:default", "sync:0:default"))
    sm = res["summary"]
    steps_lam = learning.crossing(curve(lam_accs), "step", 0.9)
    assert sm["seeds"] == 3
    assert sm["steps_to_090_laminar_over_sync"] == pytest.approx(steps_lam / 10.0, abs=1e-3)
    t_lam = learning.crossing(curve(lam_accs, 6.0), "t", 0.9)
    assert sm["time_to_090_sync_over_laminar"] == pytest.approx(34.0 / t_lam, abs=1e-3)
    cell = res["cells"]["laminar:2:default"]
    assert cell["learning_per_step_vs_sync"]["median"] < 1
    assert res["cells"]["sync:0:default"]["learning_per_step_vs_sync"]["median"] == 1
    json.dumps(res)  # no inf/nan leaks into the JSON


def test_a_run_that_did_not_get_its_cpu_is_void_listed_and_not_counted():
    sync_accs, lam_accs = [0.5, 0.8, 0.9, 0.95], [0.5, 0.75, 0.88, 0.92]
    runs = []
    for seed in range(4):
        runs.append(fake_run("sync:0:default", seed, sync_accs, dt=10.0, rate=1.2))
        runs.append(fake_run("laminar:2:default", seed, lam_accs, dt=6.0, rate=1.6))
    # seed 1's laminar run starved (a quarter of its cell's rate, e.g. 0.33 cores); seed 2's
    # sync run shared the box with another job taking most of a core
    runs[3].update(steps_per_s=0.3, cores=0.33, seconds_to_090=500.0)
    runs[4]["others_cores"] = 0.9
    res = learning.aggregate(runs, ("laminar:2:default", "sync:0:default"))
    void = {(v["cell"], v["seed"]): v["reason"] for v in res["summary"]["void_runs"]}
    assert set(void) == {("laminar:2:default", 1), ("sync:0:default", 2)}
    assert "steps/s" in void[("laminar:2:default", 1)] and "cores" in void[("sync:0:default", 2)]
    # neither counts: 2 seeds pair up (0 and 3), the starved run's 500 s is not in any median
    assert res["summary"]["seeds"] == 2
    assert res["cells"]["laminar:2:default"]["seconds_to_090"]["n"] == 3
    assert res["cells"]["laminar:2:default"]["seconds_to_090"]["max"] < 100
    # the same runs with nothing wrong: none void
    runs[3].update(steps_per_s=1.5)
    runs[4]["others_cores"] = 0.2
    res = learning.aggregate(runs, ("laminar:2:default", "sync:0:default"))
    assert res["summary"]["void_runs"] == [] and res["summary"]["seeds"] == 4


def test_a_mode_that_never_reaches_the_target_reads_as_such():
    runs = [
        fake_run("sync:0:default", 0, [0.5, 0.8, 0.95], 10.0, 0.5),
        fake_run("laminar:2:default", 0, [0.5, 0.7, 0.8], 6.0, 0.8),
    ]
    res = learning.aggregate(runs, ("laminar:2:default", "sync:0:default"))
    assert res["summary"]["steps_to_090_laminar_over_sync"] is None  # infinitely many steps
    assert res["summary"]["time_to_090_sync_over_laminar"] == 0.0
    cell = res["cells"]["laminar:2:default"]
    assert cell["steps_to_090"]["not_reached"] == 1 and cell["short_by_090"]["median"] == 0.1


def test_every_correction_is_a_valid_config_override():
    from laminar.config import load_config
    from laminar.demo.__main__ import DEMO_CONFIG

    for name, over in learning.CORRECTIONS.items():
        cfg = load_config(DEMO_CONFIG, [*over, "buffer.max_staleness=4"])
        assert cfg.buffer.max_staleness == 4, name
    ppo = load_config(DEMO_CONFIG, learning.CORRECTIONS["ppo_mb"]).trainer
    assert ppo.minibatches > 1 and ppo.lr == 5e-5
    for one_step in (
        "none",
        "tis",
        "icepop",
    ):  # each correction pins its lr, whatever the demo's is
        t = load_config(DEMO_CONFIG, learning.CORRECTIONS[one_step]).trainer
        assert (t.minibatches, t.lr) == (1, 2e-4), one_step
    assert load_config(DEMO_CONFIG, learning.CORRECTIONS["icepop"]).algo.is_mode == "mask"


def test_demo_summary_headline_is_the_090_ratio_or_the_shortfall():
    from laminar.demo.results import fixed_target, headline

    lam = curve([0.5, 0.8, 0.92, 0.95], dt=6.0)
    sync = curve([0.5, 0.8, 0.9, 0.95], dt=10.0)
    s = fixed_target(lam, sync, 0.90)
    assert s["time_to_target_ratio_sync_over_laminar"] == pytest.approx(
        34.0 / (20.0 + 6.0 * 0.1 / 0.12)
    )
    text = headline(s)
    assert "one run per mode" in text and "ratio sync/laminar" in text and "n/a" not in text
    short = fixed_target(curve([0.5, 0.7, 0.86]), sync, 0.90)
    text = headline(short)
    assert short["time_to_target_ratio_sync_over_laminar"] is None
    assert "laminar never reached it: best 0.860, **0.040 short**" in text and "n/a" not in text


def test_plot_draws_median_and_range(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [fake_run("sync:0:default", s, [0.5, 0.8, 0.9 + s / 100], 10.0, 0.5) for s in range(3)]
    runs += [fake_run("laminar:2:default", s, [0.5, 0.75, 0.88], 6.0, 0.8) for s in range(3)]
    out = learning.plot(tmp_path / "l.png", runs)
    assert out is not None and out.stat().st_size > 5_000


def test_neither_mode_reaching_the_target_gives_strict_json():
    runs = [
        fake_run("sync:0:default", 0, [0.5, 0.7, 0.8], 10.0, 0.5),
        fake_run("laminar:1:default", 0, [0.5, 0.7, 0.85], 6.0, 0.8),
    ]
    res = learning.aggregate(runs, ("laminar:1:default", "sync:0:default"))
    sm = res["summary"]
    assert sm["steps_to_090_laminar_over_sync"] is None and sm[
        "steps_to_090_laminar_over_sync_per_seed"
    ] == [None]
    assert sm["short_of_090_laminar"] == pytest.approx(0.05) and sm[
        "short_of_090_sync"
    ] == pytest.approx(0.1)
    json.dumps(res, allow_nan=False)
