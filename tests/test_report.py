"""`laminar report RUN_DIR`, the live progress line, and the wandb option.

    .venv/bin/python -m pytest tests/test_report.py -q

The run directory is synthetic: a resolved config, a metrics.jsonl written the way the
trainer writes it (step lines, then validation lines with only eval/* keys) and a
completions.jsonl.
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest

from laminar.cli import main
from laminar.config import ConfigError, config_from_dict, write_resolved

STEPS = 30


def make_run(tmp_path: Path, steps: int = STEPS) -> Path:
    run = tmp_path / "run"
    cfg = config_from_dict(
        {"name": "synthetic", "run_dir": str(run), "trainer": {"total_steps": 40}}
    )
    write_resolved(cfg, run)
    t0 = (run / "config.yaml").stat().st_mtime + 2.0
    lines, comps = [], []
    for s in range(1, steps + 1):
        t = t0 + 1.5 * s
        lines.append(
            {
                "step": s,
                "time": t,
                "reward": 0.2 + 0.5 * s / steps,
                "tokens_per_s": 1000.0 + s,
                "staleness": 0.5,
                "staleness_max": 1 + s % 2,
                "step_s": 1.5,
                "dropped": 0.0,
            }
        )
        comps += [
            {
                "step": s,
                "version": s - 1,
                "prompt": f"p{s}-{i}",
                "completion": f"c{s}|{i}\nx",
                "reward": float(i),
            }
            for i in range(2)
        ]
        if s % 10 == 0:
            lines.append({"step": s, "time": t + 0.5, "eval/accuracy": s / 40, "eval/n": 8.0})
            comps.append(
                {
                    "step": s,
                    "eval": True,
                    "prompt": "q",
                    "completion": "a",
                    "reward": 1.0,
                    "answer": "a",
                }
            )
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines) + '{"step": 31, "ti'
    )
    (run / "completions.jsonl").write_text("".join(json.dumps(x) + "\n" for x in comps))
    return run


def test_report_writes_png_and_summary(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path)
    assert main(["report", str(run)]) == 0
    png = (run / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    s = json.loads((run / "summary.json").read_text())
    assert s["name"] == "synthetic" and s["steps"] == STEPS and s["total_steps"] == 40
    assert s["reward_first"] == pytest.approx(0.2 + 0.5 * 3 / STEPS)  # steps 1..5
    assert s["reward_last"] == pytest.approx(0.2 + 0.5 * 28 / STEPS)  # steps 26..30
    assert s["eval_first"] == {"step": 10, "accuracy": 0.25, "n": 8.0}
    assert s["eval_last"]["accuracy"] == 0.75 and s["eval_best"] == 0.75
    assert s["staleness_max"] == 2 and s["tokens_per_s_median"] == pytest.approx(1015.5)
    assert s["wall_clock_s"] == pytest.approx(2.0 + 1.5 * STEPS + 0.5, abs=0.2)
    md = (run / "summary.md").read_text()
    assert "| trainer steps | 30 / 40 |" in md
    assert "0.250 (step 10, 8 prompts) → 0.750 (step 30, 8 prompts)" in md
    assert "## Completions of step 30" in md and "c30\\|1 ⏎ x" in md  # table-safe cells
    assert "## Eval completions at step 30" in md
    assert "report.png" in capsys.readouterr().out


def test_report_on_a_run_without_steps_still_draws(tmp_path: Path) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    assert main(["report", str(run)]) == 0
    assert (run / "report.png").exists()
    assert "| trainer steps | 0 / ? |" in (run / "summary.md").read_text()


def test_report_refuses_a_directory_that_is_not_a_run(tmp_path: Path, capsys) -> None:
    assert main(["report", str(tmp_path / "nope")]) == 1
    assert "is not a directory" in capsys.readouterr().err


def test_progress_line_has_step_total_reward_eval_and_eta(tmp_path: Path) -> None:
    from laminar.progress import Progress

    run = make_run(tmp_path, steps=20)
    out = io.StringIO()
    start = (run / "config.yaml").stat().st_mtime
    p = Progress(run, "laminar", start, every_s=5.0, total_steps=40, stream=out)
    p.tick(final=True)  # final: no manager query
    line = out.getvalue().strip()
    assert line.startswith("[laminar")
    assert "step   20/40" in line and "reward 0.700" in line and "eval 0.500" in line
    assert "tok/s    1020" in line and "staleness 0.50 (max 1)" in line
    assert p.eta_s(40) == pytest.approx(20 * 1.5) and "ETA 30s" in line
    # the torn last line is read once it is whole, and only the new bytes are read
    with open(run / "metrics.jsonl", "a") as f:
        f.write('me": 0, "reward": 0.9, "tokens_per_s": 5}\n')
    p.read_metrics()
    assert p.last["step"] == 31 and p.last["reward"] == 0.9 and p.last["eval/accuracy"] == 0.5


def test_progress_before_the_first_step(tmp_path: Path) -> None:
    from laminar.progress import Progress

    out = io.StringIO()
    p = Progress(tmp_path, "sync", 0.0, stream=out)
    assert "starting nodes" in p.line(now=3.0) and math.isnan(p.eta_s(10))


def test_wandb_requested_but_missing_is_a_clear_error(tmp_path: Path, monkeypatch, capsys) -> None:
    from laminar.trainer.logger import require_wandb, wandb_init_kwargs

    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable, whether installed or not
    cfg = config_from_dict(
        {
            "name": "wb",
            "run_dir": str(tmp_path / "run"),
            "logging": {"wandb": {"project": "p", "mode": "offline"}},
        }
    )
    with pytest.raises(
        ConfigError, match=r"logging.wandb is set but wandb is not installed: `pip install wandb`"
    ):
        require_wandb(cfg.logging)
    with pytest.raises(ConfigError, match="pip install wandb"):
        wandb_init_kwargs(cfg.logging, cfg.name, {})
    with pytest.raises(ConfigError, match="wandb is logging.wandb"):  # the old extra.wandb
        config_from_dict({"name": "wb", "extra": {"wandb": {"project": "p"}}})
    plain = config_from_dict({"name": "wb"})
    require_wandb(plain.logging)  # not asked for: fine
    # `laminar run` refuses before any node starts (exit 2, nothing written)
    sim = ["trainer.engine=sim", "rollout.engine=sim"]  # inputs that pass the other checks
    rc = main(["run", f"run_dir={tmp_path / 'cli'}", "logging.wandb={project: p}", *sim])
    assert rc == 2 and "pip install wandb" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()
