"""The prepared GPU check (bench/gpu/check.sh) on CPU: every stage runs at tiny sizes and writes
its JSON, so the check cannot rot between GPU sessions.

    .venv/bin/python -m pytest tests/test_gpu_check.py -q

About a minute on a quiet 2-core machine (two and more when it is shared); the stages that
dominate are `run`, a real `laminar run` (nccl on gloo, 5 steps), and `colocate`'s colocated
`laminar run` (2 steps).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("env", "tests", "weights", "engine", "trainer", "run", "colocate")


def test_gpu_check_dry_run_runs_every_stage_on_cpu(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu" / "check.sh"), "--dry-run", "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{s}.json" for s in STAGES] + ["check.json"]
    )  # at most 8 files: what the GPU machine may hand back
    res = {s: json.loads((out / f"{s}.json").read_text()) for s in STAGES}
    assert all(r["ok"] and r["dry_run"] for r in res.values()), res
    assert res["weights"]["lifetime"] == {"held_while_read": True, "freed_after_leases": True}
    assert res["weights"]["summary"]["cuda_ipc_vs_d2d_copy"] > 0
    (run,) = res["run"]["runs"]
    assert run["rc"] == 0 and run["steps"] == 5 and run["trainer_stall_s"]["n"] == 5
    assert run["loads_by_source"].get("group", 0) >= 1  # the nccl path, on gloo
    assert res["engine"]["summary"]["engine_vs_hf_generate"] > 0
    co = res["colocate"]  # the engine asleep and the trainer offloaded, then a colocated run
    assert co["engine"]["weight_bytes"] > 0 and co["engine"]["kv_bytes"] > 0
    assert co["trainer"]["bytes"] > 0 and co["run"]["rc"] == 0 and co["run"]["cycles"] == 2
    assert all(co["summary"][k] >= 0 for k in ("run_sleep_s", "run_wake_s", "run_handoff_s"))
    assert json.loads((out / "check.json").read_text())["ok"]


def test_a_stage_past_its_limit_still_writes_its_json(tmp_path):
    stages = str(REPO / "bench" / "gpu" / "stages.py")
    proc = subprocess.run(
        [sys.executable, stages, "--dry-run", "--out", str(tmp_path), "run=1"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    r = json.loads((tmp_path / "run.json").read_text())
    assert not r["ok"] and "StageTimeout" in r["error"] and r["limit_s"] == 1
