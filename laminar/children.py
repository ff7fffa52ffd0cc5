"""The node processes of `laminar run`: started, restarted when they die, stopped in order.

    kids = Children(specs, env, run_dir, cfg.cluster.restart, stop_timeout_s=15)
    kids.start_all()
    while (end := kids.poll()) is None:   # every ~0.2 s: reap, restart what is due
        ...
    kids.stop()                           # trainer, rollouts, buffer + tools, relays, manager

A child that exits while nobody asked it to (a crash, kill -9, or a non-trainer exiting by
itself) is restarted after a backoff (backoff_s, doubling per restart of that node within
window_s, capped at backoff_max_s); the others keep running, since the nodes already survive
a peer's death (liveness, resends, exactly-once). More than max_restarts deaths of one node
within window_s, or one exit with EXIT_PERMANENT (laminar/supervise.py: a failure a restart
would only repeat, e.g. nothing to train), ends the job: poll() returns `GivingUp(name, code)`. The
trainer exiting 0 is the job being done: poll() returns `Finished()` once every trainer process did.

The stop goes role by role so that no node's last work waits on a peer that is already gone:
the trainer first (its drain checkpoints and commits, which needs the buffer and the relays it
publishes to), then the rollouts (their outboxes flush to the buffer), then buffer and tools,
relays, and the manager last. Each stage has its own budget, after which its processes are
killed.

Every start, death and restart is printed and written to run_dir/supervisor.json (read by
`laminar status`); run_dir/pids.json always holds the current pid of each child.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from laminar.config import RestartConfig, Role
from laminar.supervise import EXIT_PERMANENT

STOP_ORDER: tuple[tuple[Role, ...], ...] = (
    ("trainer",),
    ("rollout",),
    ("buffer", "tools"),
    ("relay",),
    ("manager",),
)
"""Who stops first: each stage's drain may still need the stages after it."""


@dataclass
class ChildSpec:
    """One node process: `name` (rollout-0, or rollout-0..3 for several in one process), its
    role, the node ids it hosts and its command line."""

    name: str
    role: Role
    node_ids: list[str]
    cmd: list[str]


@dataclass
class Finished:
    """Every trainer process exited 0: the run is done."""


@dataclass
class GivingUp:
    """A node died more than max_restarts times within window_s, or exited EXIT_PERMANENT."""

    name: str
    code: int


@dataclass
class _Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    recent: deque[float] = field(default_factory=deque)
    restart_at: float | None = None
    last_exit: int | None = None
    done: bool = False  # a trainer that finished: never restarted
    tee: threading.Thread | None = None


def _say(msg: str) -> None:
    print(f"laminar run: {msg}", file=sys.stderr, flush=True)


class Children:
    """Starts, watches, restarts and stops the node processes of one `laminar run`."""

    def __init__(
        self,
        specs: list[ChildSpec],
        env: dict[str, str],
        run_dir: Path,
        policy: RestartConfig,
        stop_timeout_s: float,
    ):
        self.env = env
        self.run_dir = run_dir
        self.policy = policy
        self.stop_timeout_s = stop_timeout_s
        self.kids = {s.name: _Child(s) for s in specs}
        self.stopping = False

    # ---- running ---------------------------------------------------------------------------
    def start_all(self) -> None:
        for kid in self.kids.values():
            self._start(kid)
        self._write_state()

    def _start(self, kid: _Child) -> None:
        kid.proc = subprocess.Popen(
            kid.spec.cmd,
            env=self.env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        kid.tee = _tee(kid.proc, self.run_dir / "logs" / f"{kid.spec.name}.log")
        kid.restart_at = None
        what = (
            f"restarted {kid.spec.name} (restart {kid.restarts})"
            if kid.restarts
            else (f"started {kid.spec.name}")
        )
        _say(f"{what} pid={kid.proc.pid}")

    def poll(self, now: float | None = None) -> Finished | GivingUp | None:
        """Reap children that exited, start the restarts that are due; what ends the job, if
        anything."""
        now = time.monotonic() if now is None else now
        changed = False
        for kid in self.kids.values():
            proc = kid.proc
            if proc is None or kid.done or kid.restart_at is not None:
                continue
            rc = proc.poll()
            if rc is None:
                continue
            changed = True
            kid.last_exit = rc
            if kid.spec.role == "trainer" and rc == 0:
                kid.done = True
                continue
            _say(f"node {kid.spec.name} (pid {proc.pid}) exited with code {rc}")
            if rc == EXIT_PERMANENT:
                _say(
                    f"node {kid.spec.name} failed in a way a restart cannot fix "
                    f"(exit {EXIT_PERMANENT}, see its log); stopping the job"
                )
                return GivingUp(kid.spec.name, rc)
            while kid.recent and now - kid.recent[0] > self.policy.window_s:
                kid.recent.popleft()
            if len(kid.recent) >= self.policy.max_restarts:
                self._write_state()
                _say(
                    f"node {kid.spec.name}: restart budget spent ({len(kid.recent)} restarts "
                    f"within {self.policy.window_s:g}s, cluster.restart.max_restarts="
                    f"{self.policy.max_restarts}); stopping the job"
                )
                return GivingUp(kid.spec.name, rc)
            kid.recent.append(now)
            delay = min(
                self.policy.backoff_max_s, self.policy.backoff_s * 2 ** (len(kid.recent) - 1)
            )
            kid.restart_at = now + delay
            _say(
                f"node {kid.spec.name}: restarting in {delay:.1f}s "
                f"({len(kid.recent)}/{self.policy.max_restarts} within {self.policy.window_s:g}s)"
            )
        for kid in self.kids.values():
            if kid.restart_at is not None and now >= kid.restart_at and not self.stopping:
                kid.restarts += 1
                self._start(kid)
                changed = True
        if changed:
            self._write_state()
        trainers = [k for k in self.kids.values() if k.spec.role == "trainer"]
        if trainers and all(k.done for k in trainers):
            return Finished()
        return None

    def _write_state(self) -> None:
        nodes = {}
        for name, kid in self.kids.items():
            alive = kid.proc is not None and kid.proc.poll() is None
            nodes[name] = {
                "role": kid.spec.role,
                "node_ids": kid.spec.node_ids,
                "pid": kid.proc.pid if kid.proc else None,
                "alive": alive,
                "restarts": kid.restarts,
                "last_exit": kid.last_exit,
                "restart_pending": kid.restart_at is not None,
            }
        state = {"restarts": sum(k.restarts for k in self.kids.values()), "nodes": nodes}
        _write_json(self.run_dir / "supervisor.json", state)
        _write_json(self.run_dir / "pids.json", {n: v["pid"] for n, v in nodes.items()})

    # ---- stopping --------------------------------------------------------------------------
    def stop(self) -> bool:
        """Stop every child, stage by stage (STOP_ORDER); False if one had to be killed or
        exited with an error while stopping."""
        self.stopping = True
        clean = True
        for stage in STOP_ORDER:
            group = {
                n: k.proc
                for n, k in self.kids.items()
                if k.spec.role in stage and k.proc is not None
            }
            clean &= _stop_group(group, self.stop_timeout_s)
        for kid in self.kids.values():
            kid.restart_at = None
            if kid.tee is not None:
                kid.tee.join(timeout=5.0)  # the children are gone: their pipes end
        self._write_state()
        return clean

    def kill_all(self) -> None:
        """Last resort (the launcher itself is failing): SIGKILL whatever is still running."""
        for kid in self.kids.values():
            if kid.proc is not None and kid.proc.poll() is None:
                kid.proc.kill()


def _stop_group(group: dict[str, subprocess.Popen[bytes]], timeout: float) -> bool:
    alive = {k: p for k, p in group.items() if p.poll() is None}
    for p in alive.values():
        try:
            p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    clean = True
    for k, p in alive.items():
        try:
            rc = p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _say(f"{k} (pid {p.pid}) did not stop in time; killing it")
            p.kill()
            p.wait()
            clean = False
            continue
        if rc not in (0, -signal.SIGTERM):
            _say(f"{k} (pid {p.pid}) exited with code {rc} while stopping")
            clean = False
    return clean


def _write_json(path: Path, obj: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)  # a reader (laminar status, a test) never sees half a file


def _tee(proc: subprocess.Popen[bytes], log_path: Path) -> threading.Thread:
    """Copy a child's output to this process's stderr and to run_dir/logs/<node>.log (made at
    its first line: a node that says nothing leaves no file; a restarted node appends)."""
    assert proc.stdout is not None
    src = proc.stdout

    def pump() -> None:
        log: BinaryIO | None = None
        try:
            for line in iter(src.readline, b""):
                if log is None:
                    log_path.parent.mkdir(parents=True, exist_ok=True)
                    log = open(log_path, "ab")  # held across the loop, closed below
                log.write(line)
                log.flush()
                try:
                    sys.stderr.write(line.decode("utf-8", "replace"))
                    sys.stderr.flush()
                except (OSError, ValueError):  # our stderr went away: the log file still gets it
                    pass
        finally:
            if log is not None:
                log.close()
            src.close()

    t = threading.Thread(target=pump, name=f"tee-{log_path.stem}", daemon=True)
    t.start()
    return t
