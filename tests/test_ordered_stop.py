"""SIGTERM to `laminar run` mid-training stops the nodes in order (laminar/children.py): the
trainer checkpoints while buffer and relays are still up, the rollouts flush their outboxes,
then the rest; exit 143, no unretrieved future exceptions, the ipc directory removed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from laminar.engines.lifeline import alive

REPO = Path(__file__).resolve().parent.parent
SKELETON = REPO / "configs" / "skeleton.yaml"
DEADLINE_S = 180.0  # five Python processes on 2 busy cores, a few steps, a staged stop


def _events(log: Path) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def test_sigterm_checkpoints_first_flushes_rollouts_and_exits_143(
    tmp_path: Path, short_dir: Path
) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(64)))
    run, ipc = tmp_path / "run", short_dir / "ipc"
    cmd = [
        sys.executable,
        "-m",
        "laminar",
        "run",
        str(SKELETON),
        f"run_dir={run}",
        f"cluster.ipc_dir={ipc}",
        f"data.train={data}",
        "trainer.total_steps=100000",
        "trainer.batch_groups=1",
        "logging.progress_every_s=0",
    ]
    log = tmp_path / "launcher.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=tmp_path)
    pids: dict[str, int] = {}
    try:
        deadline = time.monotonic() + DEADLINE_S
        trainer_log = run / "logs" / "trainer-0.log"
        stepped = False
        while not stepped and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            stepped = trainer_log.exists() and '"event": "step"' in trainer_log.read_text()
            time.sleep(0.2)  # polling a file of a deadline-bounded wait
        assert stepped, log.read_text()[-3000:]
        pids = json.loads((run / "pids.json").read_text())
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(max(1.0, deadline - time.monotonic()))
        out = log.read_text()
        assert rc == 128 + signal.SIGTERM, out[-3000:]
        assert "never retrieved" not in out
        assert [n for n, pid in pids.items() if alive(pid)] == []
        ev = {n: _events(run / "logs" / f"{n}.log") for n in pids}
        ckpt = [e for e in ev["trainer-0"] if e["event"] == "checkpoint"]
        assert ckpt and ckpt[-1]["reason"] == "stop", ev["trainer-0"][-5:]
        assert (run / "checkpoints" / f"step_{ckpt[-1]['step']:08d}").exists()
        drained = [e for e in ev["rollout-0"] if e["event"] == "drained"]
        assert drained and drained[-1]["flushed"] and drained[-1]["outbox_left"] == 0

        def at(node: str, event: str) -> str:
            return next(e["timestamp"] for e in ev[node] if e["event"] == event)

        # the order: each node gone before the next is asked to stop; the manager asked last
        order = ["trainer-0", "rollout-0", "buffer-0", "relay-0", "manager-0"]
        for first, then in zip(order[:-1], order[1:], strict=True):
            assert at(first, "stopped") <= at(then, "stopping"), (first, then)
        assert not ipc.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
