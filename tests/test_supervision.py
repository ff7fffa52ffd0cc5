"""Supervision of node processes: `laminar run` (laminar/children.py) and launchers/host_daemons.sh
restart a node that died, within a budget, and keep the rest running."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from laminar.children import Children, ChildSpec, Finished, GivingUp
from laminar.config import RestartConfig, load_config
from laminar.engines.lifeline import alive
from laminar.launch.ipc_dir import IpcDirError, prepare_ipc_dir
from laminar.launch.status import restarts_by_node
from laminar.supervise import EXIT_PERMANENT

REPO = Path(__file__).resolve().parent.parent
SKELETON = REPO / "configs" / "skeleton.yaml"
SCRIPT = REPO / "launchers" / "host_daemons.sh"
RUN_DEADLINE_S = 240.0  # five Python processes on 2 busy cores, a restart, a few steps


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _poll_until(kids: Children, deadline_s: float) -> Finished | GivingUp:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        end = kids.poll()
        if end is not None:
            return end
        time.sleep(0.05)  # polling child processes of a deadline-bounded wait
    raise AssertionError("no end within the deadline")


def test_a_crashing_node_is_restarted_until_its_budget_is_spent(tmp_path: Path) -> None:
    policy = RestartConfig(max_restarts=2, window_s=60, backoff_s=0.05, backoff_max_s=0.1)
    specs = [
        ChildSpec("rollout-0", "rollout", ["rollout-0"], _py("import sys; sys.exit(5)")),
        ChildSpec("relay-0", "relay", ["relay-0"], _py("import time; time.sleep(60)")),
    ]
    kids = Children(specs, dict(os.environ), tmp_path, policy, stop_timeout_s=5)
    kids.start_all()
    relay_pid = json.loads((tmp_path / "pids.json").read_text())["relay-0"]
    try:
        end = _poll_until(kids, 30)
        assert end == GivingUp("rollout-0", 5)
        state = json.loads((tmp_path / "supervisor.json").read_text())
        assert state["nodes"]["rollout-0"]["restarts"] == 2
        assert state["nodes"]["rollout-0"]["last_exit"] == 5
        assert state["nodes"]["relay-0"]["restarts"] == 0 and alive(relay_pid)  # untouched
        cfg = load_config(SKELETON, [f"run_dir={tmp_path}"])
        assert restarts_by_node(cfg) == {"rollout-0": 2, "relay-0": 0}  # `laminar status` column
    finally:
        assert kids.stop()  # the relay stops on SIGTERM: clean
    assert not alive(relay_pid)


def test_a_permanent_failure_is_not_restarted(tmp_path: Path) -> None:
    policy = RestartConfig(max_restarts=5, backoff_s=0.05)
    code = f"import sys; sys.exit({EXIT_PERMANENT})"  # e.g. NothingTrained: a restart repeats it
    specs = [ChildSpec("trainer-0", "trainer", ["trainer-0"], _py(code))]
    kids = Children(specs, dict(os.environ), tmp_path, policy, stop_timeout_s=5)
    kids.start_all()
    assert _poll_until(kids, 30) == GivingUp("trainer-0", EXIT_PERMANENT)
    kids.stop()
    assert json.loads((tmp_path / "supervisor.json").read_text())["restarts"] == 0


def test_a_trainer_exiting_zero_finishes_the_job_and_is_not_restarted(tmp_path: Path) -> None:
    policy = RestartConfig(max_restarts=3, backoff_s=0.05)
    specs = [ChildSpec("trainer-0", "trainer", ["trainer-0"], _py("pass"))]
    kids = Children(specs, dict(os.environ), tmp_path, policy, stop_timeout_s=5)
    kids.start_all()
    assert _poll_until(kids, 30) == Finished()
    kids.stop()
    assert json.loads((tmp_path / "supervisor.json").read_text())["restarts"] == 0


def test_the_ipc_dir_is_private_and_must_be_ours(tmp_path: Path) -> None:
    ipc = tmp_path / "ipc"
    cfg = load_config(SKELETON, [f"cluster.ipc_dir={ipc}"])
    prepare_ipc_dir(cfg)
    assert stat.S_IMODE(ipc.stat().st_mode) == 0o700
    ipc.chmod(0o777)
    prepare_ipc_dir(cfg)  # ours but open: closed again
    assert stat.S_IMODE(ipc.stat().st_mode) == 0o700
    ipc.rmdir()
    ipc.symlink_to(tmp_path)
    with pytest.raises(IpcDirError, match="not a directory"):
        prepare_ipc_dir(cfg)
    ipc.unlink()
    if os.getuid() == 0:  # only root can hand a directory to another uid
        ipc.mkdir()
        os.chown(ipc, 54321, -1)
        with pytest.raises(IpcDirError, match="owned by uid 54321"):
            prepare_ipc_dir(cfg)


def test_kill_9_of_a_rollout_under_laminar_run_is_restarted_and_the_job_completes(
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
        "trainer.total_steps=4",
        "trainer.batch_groups=1",
        "logging.progress_every_s=0",
        "cluster.restart.backoff_s=0.2",
    ]
    log = tmp_path / "launcher.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=tmp_path)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + RUN_DEADLINE_S
        victim = None
        while victim is None and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            rollout_log = run / "logs" / "rollout-0.log"
            if rollout_log.exists() and '"event": "ready"' in rollout_log.read_text():
                victim = json.loads((run / "pids.json").read_text())["rollout-0"]
            time.sleep(0.2)  # polling a file of a deadline-bounded wait
        assert victim is not None, log.read_text()[-3000:]
        seen.add(victim)
        os.kill(victim, signal.SIGKILL)
        rc = proc.wait(max(1.0, deadline - time.monotonic()))
        out = log.read_text()
        assert rc == 0, out[-3000:]
        state = json.loads((run / "supervisor.json").read_text())
        seen.update(v["pid"] for v in state["nodes"].values())
        assert state["nodes"]["rollout-0"]["restarts"] == 1, state
        assert state["nodes"]["rollout-0"]["pid"] != victim
        assert all(v["restarts"] == 0 for k, v in state["nodes"].items() if k != "rollout-0")
        assert f"node rollout-0 (pid {victim}) exited with code -9" in out
        assert "restarted rollout-0 (restart 1)" in out and "trainer finished" in out
        assert (run / "checkpoints" / "step_00000004").exists()
        assert not ipc.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in seen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


FAKE_LAMINAR = """#!/usr/bin/env bash
# a stand-in for `laminar node`: the first rollout dies at once, a trainer finishes in 2 s
role=$3
trap 'kill "$s" 2>/dev/null; exit 0' TERM
if [ "$role" = rollout ] && [ ! -e "$MARK" ]; then touch "$MARK"; exit 7; fi
if [ "$role" = trainer ]; then sleep 2; exit 0; fi
sleep 60 & s=$!; wait "$s"
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_host_daemons_restarts_a_dead_node_and_ends_when_the_trainer_finishes(
    tmp_path: Path,
) -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    if shutil.which("shellcheck"):
        out = subprocess.run(
            ["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stdout
    fake = tmp_path / "laminar"
    fake.write_text(FAKE_LAMINAR)
    fake.chmod(0o755)
    env = dict(
        os.environ,
        HOST_INDEX="0",
        ROLLOUTS="1",
        LAMINAR=str(fake),
        BACKOFF_S="0",
        MARK=str(tmp_path / "died"),
        STOP_TIMEOUT_S="5",
    )
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "cfg.yaml"],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what this test started
            proc.wait(10)
    assert proc.returncode == 0, out
    assert "node rollout-0" in out and "exited with code 7" in out, out
    assert "started rollout-0" in out and "(restarts: 1)" in out, out
    assert "trainer finished" in out, out


FAKE_NODE = """#!/usr/bin/env bash
# a stand-in for `laminar node` that says when it is up and when it is asked to stop
role=$3
trap 'echo "fake $role: TERM" >&2; kill "$s" 2>/dev/null; exit 0' TERM
sleep 60 & s=$!
touch "$UP/$role"
wait "$s"
"""


def test_host_daemons_stops_in_order_on_sigterm(tmp_path: Path) -> None:
    fake, up = tmp_path / "laminar", tmp_path / "up"
    fake.write_text(FAKE_NODE)
    fake.chmod(0o755)
    up.mkdir()
    env = dict(
        os.environ, HOST_INDEX="0", ROLLOUTS="1", LAMINAR=str(fake), UP=str(up), STOP_TIMEOUT_S="5"
    )
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "cfg.yaml"],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    roles = ["trainer", "rollout", "buffer", "relay", "manager"]
    try:
        deadline = time.monotonic() + 60
        while len(list(up.iterdir())) < len(roles) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling marker files of a deadline-bounded wait
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what this test started
            proc.wait(10)
    assert proc.returncode == 143, out
    stopped = [line.split()[1].rstrip(":") for line in out.splitlines() if line.endswith(": TERM")]
    assert stopped == roles, out
