"""`laminar run` with rollout.weights=nccl on CPU (gloo): versions reach the rollouts through the
broadcast group; kill -9 of a rollout leaves the trainer's stall under the bound, the group is
rebuilt without a trainer restart, and the restarted rollout rejoins.

    .venv/bin/python -m pytest tests/test_weights_nccl_run.py -q -m slow

One `laminar run` subprocess (manager, buffer, one relay, torch trainer, two torch rollouts with a
tiny random model, ipc), killed only by pid if the test fails.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from laminar.engines.lifeline import alive
from laminar.tasks import countup
from tests.conftest import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BOUND_S = 3.0
STEPS = 200
DEADLINE_S = 420.0  # six Python processes with torch on 2 busy cores, a restart, 24 steps


def _events(path: Path, event: str) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if f'"{event}"' in line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _config(tmp: Path, short: Path) -> Path:
    from laminar.models.tiny import build_tiny_model

    shape = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "max_positions": 128}
    model = build_tiny_model(tmp / "model", alphabet=countup.ALPHABET, **shape)
    rng = random.Random(0)
    data = tmp / "train.jsonl"
    with data.open("w") as f:
        for _ in range(4000):
            p = countup.make_prompt(rng.randint(0, 9), rng.randint(1, 3), 30)
            f.write(json.dumps({"prompt": p, "answer": countup.answer_of(p)}) + "\n")
    base = free_port()
    while base + 200 > 65000 or base < 20000:
        base = free_port()
    cfg = {
        "name": "nccl-run",
        "run_dir": str(tmp / "run"),
        "cluster": {
            "transport": "ipc",
            "ipc_dir": str(short / "ipc"),
            "base_port": base,
            "roles": {"manager": 1, "buffer": 1, "relay": 1, "trainer": 1, "rollout": 2},
            "threads_per_process": 1,
            "restart": {"backoff_s": 0.2},
        },
        "transport": {"heartbeat_interval_s": 0.5, "heartbeat_liveness": 6},
        "logging": {"progress_every_s": 0},
        "model": {"path": str(model)},
        "data": {"train": str(data)},
        "reward": {"fn": "laminar.tasks.countup:reward", "workers": 0},
        "rollout": {
            "engine": "torch",
            "group_size": 2,
            "credits": 2,
            "max_running": 8,
            "sampling": {"max_tokens": 12},
            "weights": "nccl",
            "weights_group": {"bound_s": BOUND_S, "beat_s": 0.2},
        },
        "trainer": {"engine": "torch", "total_steps": STEPS, "batch_groups": 4},
    }
    path = tmp / "nccl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_nccl_run_delivers_through_the_group_and_survives_a_kill_9(tmp_path, short_dir):
    cfg = _config(tmp_path, short_dir)
    run = tmp_path / "run"
    log = tmp_path / "launcher.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "laminar", "run", str(cfg)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    pids: set[int] = set()
    r0, r1 = run / "logs" / "rollout-0.log", run / "logs" / "rollout-1.log"
    try:
        deadline = time.monotonic() + DEADLINE_S

        def wait(cond, what: str) -> None:
            while not cond():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, f"{what} never happened"
                time.sleep(0.2)  # polling files of a deadline-bounded wait

        # both rollouts loaded a version through the group: then kill -9 rollout-0
        def loaded_by_group(p: Path) -> bool:
            return any(e.get("source") == "group" for e in _events(p, "weights_loaded"))

        wait(lambda: loaded_by_group(r0) and loaded_by_group(r1), "a load through the group")
        victim = json.loads((run / "pids.json").read_text())["rollout-0"]
        pids.add(victim)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)

        # the restarted rollout-0 rejoins and loads through the group again
        def rejoined() -> bool:
            joins = [e for e in _events(r0, "weights_group_joined") if _ts(e) > killed_at]
            loads = [e for e in _events(r0, "weights_loaded") if _ts(e) > killed_at]
            return bool(joins) and any(e.get("source") == "group" for e in loads)

        wait(rejoined, "rollout-0 rejoining the group")
        rc = proc.wait(max(1.0, deadline - time.monotonic()))
        out = log.read_text()
        assert rc == 0, out[-3000:]
        state = json.loads((run / "supervisor.json").read_text())
        pids.update(v["pid"] for v in state["nodes"].values())
        assert state["nodes"]["rollout-0"]["restarts"] == 1, state
        assert state["nodes"]["trainer-0"]["restarts"] == 0, state  # the group was rebuilt live

        steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [s for s in steps if "push_s" in s]
        assert len(steps) >= 20
        after = [s for s in steps if s["time"] > killed_at]
        assert len(after) >= 5, "the run ended before the kill mattered: raise STEPS"
        stalls = [s["push_s"] for s in steps]
        # the stated bound: pack + relay push + at most bound_s waiting for the broadcast
        assert max(stalls) < BOUND_S + 2.0, stalls

        # rollout-1 was never dropped: every version it loaded came through the group
        loads1 = _events(r1, "weights_loaded")
        assert loads1 and all(e["source"] == "group" for e in loads1), loads1
        # rollout-0 before the kill: the same
        before = [e for e in _events(r0, "weights_loaded") if _ts(e) < killed_at]
        assert before and all(e["source"] == "group" for e in before), before
        trainer_log = (run / "logs" / "trainer-0.log").read_text()
        assert trainer_log.count('"weights_group_built"') >= 2  # rebuilt without the dead one
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _ts(event: dict) -> float:
    from datetime import datetime

    ts = event.get("timestamp", "")
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() if ts else 0.0
