"""Real node processes for the fault tests (test_faults, test_multiturn_faults,
test_agent_faults): one config, nodes started by role, killed and stopped by pid, waits with
deadlines, and the exactly-once check of what the nodes wrote.

    cfg = fault_config(tmp, short_dir, name="faults", prompts=48, group=2, roles={...}, over={...})
    procs = Procs(tmp, cfg, pythonpath=[TESTS_DIR], env={"X": "y"})
    procs.start("rollout-0", "rollout", 0)          # `python -m laminar node --role rollout ...`
    procs.wait(lambda: procs.status()["rollout-0"].alive, "rollout-0 registered")
    t_kill = procs.kill9("rollout-0")               # SIGKILL by pid; the time of the kill
    procs.wait_trainer_done()                       # one epoch, then "data exhausted"
    procs.stop_all()                                # SIGTERM, then SIGKILL: only these pids
    steps, trajectories = procs.check_exactly_once(prompts=48, group=2)

Each node logs to tmp/NAME.K.log (K counts the starts, so a restarted node keeps both logs);
a failing wait shows the tail of every log. Tests stop only the processes they started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from laminar.config import load_config
from laminar.protocol.data import Trajectory
from tests.sim_cluster import PROCESS_FAULT_TRANSPORT, merge, read_jsonl, write_prompts

DEADLINE_S = 150.0  # start-up of five or six Python processes plus the run, on 2 busy cores

T = TypeVar("T")


def fault_config(
    tmp: Path,
    ipc_dir: Path,
    *,
    name: str,
    prompts: int,
    group: int,
    roles: dict[str, int],
    over: dict[str, Any],
) -> dict[str, Any]:
    """A sim cluster over ipc in `ipc_dir` that trains one epoch of `prompts` prompts with
    checkpoint-gated commits (the exactly-once setting); `over` is merged into it."""
    cfg: dict[str, Any] = {
        "name": name,
        "mode": "laminar",
        "run_dir": str(tmp / "run"),
        "cluster": {"transport": "ipc", "ipc_dir": str(ipc_dir), "roles": roles},
        "transport": dict(PROCESS_FAULT_TRANSPORT),
        "data": {
            "train": str(write_prompts(tmp / "prompts.jsonl", prompts)),
            "epochs": 1,
            "shuffle": False,
        },
        "rollout": {
            "engine": "sim",
            "group_size": group,
            "credits": 2,
            "max_running": 8,
            "prompt_retry_s": 0.1,
            "refresh_wait_s": 2.0,
            "sim": {"bound_b": 8},
        },
        "trainer": {
            "engine": "sim",
            "total_steps": 1000,
            "sim_time_per_token_s": 2e-4,
            "checkpoint_every": 1,
            "commit": "checkpoint",
            "batch_wait_s": 0.5,
        },
        "buffer": {"fsync": "always", "retry_after_s": 0.1},
        "manager": {"timeline_interval_s": 0.25},
        "logging": {"level": "info"},
    }
    return merge(cfg, over)


class Procs:
    """The nodes of one test: start by role, kill -9 by name, stop all (only these pids)."""

    def __init__(
        self,
        tmp: Path,
        cfg: dict[str, Any],
        *,
        pythonpath: Sequence[Path] = (),
        env: Mapping[str, str] | None = None,
    ):
        """`pythonpath`: folders the nodes import test modules from (an env, a tool, an agent by
        name); `env`: more environment variables for the nodes."""
        self.tmp = tmp
        self.cfg_path = tmp / "config.yaml"
        self.cfg_path.write_text(yaml.safe_dump(cfg))
        self.cfg = load_config(self.cfg_path)
        self.run_dir = Path(cfg["run_dir"])
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started: list[subprocess.Popen[bytes]] = []
        self.log_files: dict[str, list[Path]] = {}
        self.env: dict[str, str] | None = None
        if pythonpath or env:
            self.env = dict(os.environ)
            self.env["PYTHONPATH"] = os.pathsep.join(
                p for p in (*map(str, pythonpath), self.env.get("PYTHONPATH", "")) if p
            )
            self.env.update(env or {})

    def start(
        self,
        name: str,
        role: str,
        index: int = 0,
        count: int = 1,
        via: Sequence[str] = (),
        over: Sequence[str] = (),
    ) -> None:
        """`via`: a script (and its arguments) that patches a fault point in, then runs the CLI
        (tests/colocate_faults.py, tests/trainer_faults.py); default `-m laminar`. `over`: this
        node's `key=value` overrides of the config."""
        cmd = [sys.executable, *(via or ("-m", "laminar")), "node", "--role", role]
        cmd += ["--index", str(index), "--count", str(count), "--config", str(self.cfg_path)]
        cmd += list(over)
        path = self.tmp / f"{name}.{len(self.started)}.log"
        self.log_files.setdefault(name, []).append(path)
        with open(path, "w") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
            )
        self.procs[name] = proc
        self.started.append(proc)

    def kill9(self, name: str) -> float:
        """SIGKILL the node's process; returns the time of the kill."""
        t = time.time()
        os.kill(self.procs[name].pid, signal.SIGKILL)
        assert self.procs[name].wait(10) == -signal.SIGKILL
        return t

    def stop_all(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.started:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def log(self, name: str) -> str:
        """The log of the node's latest start."""
        return self.log_files[name][-1].read_text()

    def logs(self) -> str:
        return "\n".join(
            f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.tmp.glob("*.log"))
        )

    def status(self) -> dict[str, Any]:
        """The manager's table: node id -> entry (alive, status)."""
        from laminar.launch.status import fetch_status

        return {e.node_id: e for e in fetch_status(self.cfg, timeout=1.0).nodes}

    def wait(
        self, cond: Callable[[], T], what: str, timeout: float = DEADLINE_S, every: float = 0.2
    ) -> T:
        """Poll a condition (files, processes or the manager's table) against a deadline; returns
        its value. A node that exits with an error fails the wait at once."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"{name} exited with {p.returncode}\n{self.logs()}")
            try:
                value = cond()
            except Exception:  # the manager is not up yet / a file is mid-write
                value = None  # type: ignore[assignment]
            if value:
                return value
            time.sleep(every)  # polling processes and files; no event to wait on across processes
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")

    def wait_registered(self, want: set[str]) -> None:
        self.wait(
            lambda: want <= {k for k, e in self.status().items() if e.alive},
            "every node registered",
        )

    def wait_trainer_done(self) -> None:
        self.wait(lambda: self.procs["trainer"].poll() == 0, "the trainer finishing the epoch")

    # ---- what the nodes wrote -------------------------------------------------------------
    def timeline(self) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / "timeline.jsonl")

    def steps(self) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / "consumed.jsonl")

    def check_exactly_once(
        self, prompts: int, group: int
    ) -> tuple[list[dict[str, Any]], list[Trajectory]]:
        """Every prompt consumed once, as a whole group of `group`; the buffer journal agrees
        (every group committed, nothing held, dropped or abandoned). Returns the effective steps
        (a restarted trainer re-logs the steps after its checkpoint: the last record of each step
        counts) and the journal's trajectories."""
        from laminar.journal_check import replay_buffer_journal
        from laminar.wiring.buffer import experience_state

        last: dict[int, dict[str, Any]] = {}
        for rec in self.steps():
            last[rec["step"]] = rec
        eff = [last[k] for k in sorted(last)]
        uids = [u for rec in eff for u in rec["uids"]]
        dup = [u for u, c in Counter(uids).items() if c > 1]
        assert not dup, f"consumed twice: {dup[:5]}"
        groups = Counter(u.rpartition("/")[0] for u in uids)
        assert set(groups.values()) == {group}, "a consumed group was not whole"
        by_prompt = Counter(g.split("@")[0] for g in groups)
        assert len(by_prompt) == prompts and set(by_prompt.values()) == {1}, (
            "a prompt was lost or consumed twice"
        )
        journal = self.run_dir / "buffer-0.journal"
        state, trajectories = replay_buffer_journal(journal, experience_state(self.cfg))
        s = state.summary()
        assert s["held"] == 0 and s["pending"] == 0 and s["outstanding_batches"] == 0, s
        assert (
            s.get("groups_committed") == len(groups)
            and not s.get("groups_dropped")
            and not s.get("abandoned")
        ), s
        return eff, trajectories
