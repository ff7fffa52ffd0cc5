"""CLI and launcher: `laminar --help` is fast; `laminar run` starts, reports and stops real
processes.

    .venv/bin/python -m pytest tests/test_cli.py -q

The launcher tests run `laminar run configs/skeleton.yaml` as a real subprocess with
its own run_dir and ipc_dir, wait (with a deadline) until the manager lists every
node, then stop it with SIGINT or kill one child with SIGKILL. They stop only the
launcher they started and the children it lists in run_dir/pids.json, by pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from laminar.cli import main as cli_main
from laminar.engines.lifeline import alive

REPO = Path(__file__).resolve().parent.parent
SKELETON = REPO / "configs" / "skeleton.yaml"
_script = Path(sys.executable).parent / "laminar"
LAMINAR = [str(_script)] if _script.exists() else [sys.executable, "-m", "laminar"]
STARTUP_DEADLINE_S = 90.0  # five Python processes importing numpy/zmq on 2 busy cores


def test_help_is_fast() -> None:
    best = min(
        _timed([*LAMINAR, "--help"]) for _ in range(2)
    )  # best of two: a cold disk cache is not the CLI
    assert best < 1.0, f"laminar --help took {best:.2f}s"


def _timed(cmd: list[str]) -> float:
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "run" in out.stdout and "keys" in out.stdout, out.stderr
    return time.monotonic() - t0


def test_config_errors_exit_2_and_name_the_field(capsys) -> None:
    assert cli_main(["run", str(SKELETON), "transport.heartbeat_liveness=many"]) == 2
    err = capsys.readouterr().err
    assert "transport.heartbeat_liveness" in err and "'many'" in err


def test_status_without_a_manager_fails_fast(tmp_path: Path, short_dir: Path, capsys) -> None:
    t0 = time.monotonic()
    rc = cli_main(
        ["status", "--config", str(SKELETON), "--timeout", "0.3", f"cluster.ipc_dir={short_dir}"]
    )
    assert rc == 1 and "did not answer" in capsys.readouterr().err
    assert time.monotonic() - t0 < 3.0


# ---- laminar run ---------------------------------------------------------------------------------


class Launcher:
    """One `laminar run` subprocess with its own run_dir and ipc_dir."""

    def __init__(self, tmp_path: Path, ipc_dir: Path, *overrides: str):
        self.run_dir = tmp_path / "run"
        self.log = tmp_path / "launcher.log"
        cmd = [
            *LAMINAR,
            "run",
            str(SKELETON),
            f"run_dir={self.run_dir}",
            f"cluster.ipc_dir={ipc_dir}",
            "logging.level=warning",
            *overrides,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, cwd=REPO
        )
        self.pids: dict[str, int] = {}

    def output(self) -> str:
        return self.log.read_text()

    def wait_registered(self) -> dict:
        """Poll the manager until every node of the skeleton is listed alive; returns the status
        rows."""
        from laminar.config import load_config
        from laminar.launch.status import fetch_status
        from laminar.transport.sockets import TransportError

        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"launcher exited early:\n{self.output()}"
            if not self.pids and (self.run_dir / "pids.json").exists():
                self.pids = json.loads((self.run_dir / "pids.json").read_text())
            if (self.run_dir / "config.yaml").exists():
                try:
                    reply = fetch_status(load_config(self.run_dir / "config.yaml"), timeout=1.0)
                except TransportError:
                    continue  # the manager is not up yet; fetch_status itself waited up to 1 s
                alive = {e.node_id for e in reply.nodes if e.alive}
                if alive >= {"buffer-0", "relay-0", "trainer-0", "rollout-0"}:
                    return {e.node_id: e for e in reply.nodes}
            time.sleep(0.2)  # polling interval of a deadline-bounded wait for child processes
        raise AssertionError(f"nodes not registered within {STARTUP_DEADLINE_S}s:\n{self.output()}")

    def kill_everything(self) -> None:
        """Cleanup after a failed test: only our launcher and the children it recorded."""
        for pid in [self.proc.pid, *self.pids.values()]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def launcher(tmp_path: Path, short_dir: Path):
    started: list[Launcher] = []
    yield lambda *o: started.append(Launcher(tmp_path, short_dir, *o)) or started[-1]
    for lnch in started:
        lnch.kill_everything()


def test_run_starts_every_node_and_sigint_stops_them_all(launcher) -> None:
    lnch = launcher()
    rows = lnch.wait_registered()
    assert set(lnch.pids) == {"manager-0", "buffer-0", "relay-0", "trainer-0", "rollout-0"}
    assert {n: rows[n].pid for n in rows} == lnch.pids  # the manager lists itself too
    out = subprocess.run(
        [*LAMINAR, "status", "--config", str(lnch.run_dir / "config.yaml"), "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    table = json.loads(out.stdout)
    assert {r["node"] for r in table["nodes"] if r["alive"]} == {
        "manager-0",
        "buffer-0",
        "relay-0",
        "trainer-0",
        "rollout-0",
    }
    lnch.proc.send_signal(signal.SIGINT)
    assert lnch.proc.wait(30) == 128 + signal.SIGINT, lnch.output()  # stopped, not finished
    assert [n for n, pid in lnch.pids.items() if alive(pid)] == []
    assert "signal SIGINT, stopping all nodes" in lnch.output()


def test_run_reports_a_killed_node_and_exits_nonzero(launcher) -> None:
    lnch = launcher("cluster.restart.max_restarts=0")  # no restarts: the first death ends the job
    lnch.wait_registered()
    victim = lnch.pids["rollout-0"]
    os.kill(victim, signal.SIGKILL)
    rc = lnch.proc.wait(30)
    assert rc != 0
    assert f"node rollout-0 (pid {victim}) exited with code -9" in lnch.output()
    assert "node rollout-0: restart budget spent" in lnch.output()
    assert [n for n, pid in lnch.pids.items() if alive(pid)] == []
