"""The control-plane bench's synthetic cluster (bench/control_plane.py measures with it): the
node processes under test (one manager, K buffer shards, each a bench/cp_node.py process), their
config, CPU accounting and priorities, and the driver (bench/cp_driver.py) that stands in for the
rollouts and the trainer."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchinfo, also when loaded as a module

import zmq  # noqa: E402
from cp_driver import TRAINER_BATCH_GROUPS, Driver  # noqa: E402
from cp_workload import CHUNK_TOKENS, FLUSH_S, HEARTBEAT_S, STATUS_PUSH_MIN_S  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
DELIVER_WINDOW_FRAC = os.environ.get("CP_DELIVER_WINDOW_FRAC")
"""rollout.deliver_window_frac for the synthetic rollouts' outboxes (unset: the config's default;
0: each trajectory alone, as before 2026-12-08)."""


def make_cfg_dict(tmp: Path, rollouts: int) -> dict[str, Any]:
    data = tmp / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "answer": "a"}) + "\n" for i in range(4096))
    )
    return {
        "name": f"cp{uuid.uuid4().hex[:6]}",
        "run_dir": str(tmp / "run"),
        "mode": "laminar",
        "logging": {"level": os.environ.get("CP_LOG", "warning")},
        # the synthetic rollouts' ids rollout-0 .. are admitted past the run's own two
        "cluster": {"transport": "ipc", "ipc_dir": str(tmp / "ipc"), "max_rollouts": rollouts + 2},
        "transport": {"heartbeat_interval_s": HEARTBEAT_S, "request_timeout_s": 10.0},
        "data": {"train": str(data), "seed": 1},
        "rollout": {
            "group_size": 4,
            "partial_chunk_tokens": CHUNK_TOKENS,
            "partial_flush_s": FLUSH_S,
            "max_running": 128,
            "status_push_min_s": STATUS_PUSH_MIN_S,
            **(
                {}
                if DELIVER_WINDOW_FRAC is None
                else {"deliver_window_frac": float(DELIVER_WINDOW_FRAC)}
            ),
            # synthetic responses are chunks_per_traj x entry_tokens long: the buffer refuses a
            # response longer than any the config lets a rollout make
            "sampling": {"max_tokens": 1 << 16},
        },
        "trainer": {"batch_groups": TRAINER_BATCH_GROUPS},
        "buffer": {"capacity": 1 << 20, "fsync": os.environ.get("CP_FSYNC", "batch")},
        # the synthetic statuses name made-up samples (built once, stamped per push), so the
        # reconciliation would take every real one for stranded; off (its cost: one HeldRequest
        # a round, every manager.reconcile_interval_s)
        "manager": {"reconcile_interval_s": 0},
    }


def cpu_seconds(pid: int) -> float:
    """CPU time of a process so far, in nanoseconds' resolution: the run time of each of its
    threads (/proc/PID/task/*/schedstat). A node's threads (its loop, zmq's I/O thread, executor
    threads) live as long as it does, so none takes its time away between two readings. The
    clock ticks of /proc/PID/stat (10 ms) where schedstat is missing: at a shard's ~0.02 core-s/s
    over a 10 s phase a tick is ~5% of its idle, and a shard's cost is a difference of two such
    readings; 0 off Linux."""
    ns = _schedstat_ns(pid)
    if ns is not None:
        return ns / 1e9
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _schedstat_ns(pid: int) -> int | None:
    """The summed run time (ns) of a process's threads, or None without schedstat."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total, seen = 0, False
    for tid in tasks:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            seen = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that just exited, or no schedstat
    return total if seen else None


_BASE_NICE = os.getpriority(os.PRIO_PROCESS, 0)
"""The niceness this process started with: the servers' (the driver's is raised after they
start)."""


def _server_priority() -> None:
    """In a server child: back to the starting niceness when an earlier pass raised the driver's
    (lowering it needs CAP_SYS_NICE; without it the child keeps the driver's, as it says)."""
    if os.getpriority(os.PRIO_PROCESS, 0) != _BASE_NICE:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, _BASE_NICE)
        except PermissionError:
            pass


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (Linux: affinity is per thread, and a process's
    threads that exist already keep theirs)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def pinned_cpus() -> tuple[set[int], set[int]]:
    """(the buffers' CPU, everyone else's) for a pinned pass: the last CPU this process may use
    for the buffer processes alone, the rest for the manager and the driver."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs two CPUs or more")
    return {cpus[-1]}, set(cpus[:-1])


class Cluster:
    """One manager and `shards` buffer processes (rollout i -> shard i % shards) with the driver
    connected; `async with` starts them and stops them (by pid) and keeps their warnings.
    `pin`: the buffers on a CPU of their own, the manager and the driver on the others, until
    the cluster stops (pinned_cpus)."""

    def __init__(
        self,
        args: argparse.Namespace,
        rates: dict[str, float],
        shards: int,
        driver_nice: int,
        pin: bool = False,
    ):
        from laminar.config import config_from_dict
        from laminar.transport.sockets import new_context

        self.args, self.rates, self.shards = args, rates, shards
        self.pin = pinned_cpus() if pin else None
        self._cpus = os.sched_getaffinity(0)
        self.driver_nice = driver_nice
        tmp = Path(tempfile.mkdtemp(prefix="lamcp-"))
        cfg_d = make_cfg_dict(tmp, int(rates["rollouts"]))
        (tmp / "ipc").mkdir()
        (tmp / "cfg.json").write_text(json.dumps(cfg_d))
        cfg = config_from_dict(cfg_d)
        endpoints = [f"ipc://{tmp}/ipc/buffer-shard{k}.sock" for k in range(shards)]
        servers: list[tuple[str, str, int]] = [("manager", "manager", 0)]  # (name, role, index)
        for k, ep in enumerate(endpoints):  # each shard: the same config, own endpoint and journal
            d = json.loads(json.dumps(cfg_d))
            d["cluster"]["endpoints"] = {"buffer": ep}
            (tmp / f"cfg-buffer{k}.json").write_text(json.dumps(d))
            servers.append((f"buffer{k}" if shards > 1 else "buffer", "buffer", k))
        procs: dict[str, subprocess.Popen[bytes]] = {}
        lag = {name: tmp / f"lag-{name}.jsonl" for name, _, _ in servers}
        self.server_logs: dict[str, list[str]] = {}
        ctx = new_context()
        ctx.set(zmq.MAX_SOCKETS, 8192)  # two sockets per synthetic rollout (1,023 by default)
        drv = Driver(cfg, rates, ctx, endpoints)
        self.tmp, self.cfg_d, self.cfg, self.servers = tmp, cfg_d, cfg, servers
        self.procs, self.lag, self.ctx, self.drv = procs, lag, ctx, drv
        self.idle_cpu: dict[str, float] = {}

    async def __aenter__(self) -> Cluster:
        tmp, procs, lag, drv = self.tmp, self.procs, self.lag, self.drv
        shards = self.shards
        try:
            for name, role, k in self.servers:
                cfg_path = tmp / ("cfg.json" if role == "manager" else f"cfg-buffer{k}.json")
                procs[name] = subprocess.Popen(
                    [
                        sys.executable,
                        str(HERE / "cp_node.py"),
                        role,
                        str(cfg_path),
                        str(lag[name]),
                        str(k),
                    ],
                    stdout=open(tmp / f"{name}.log", "wb"),
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                    preexec_fn=self._child_setup(role),
                )
            # after the servers started (they would inherit it); absolute: a second pass adds
            # nothing
            os.setpriority(os.PRIO_PROCESS, 0, _BASE_NICE + self.driver_nice)
            if self.pin is not None:
                pin_threads(os.getpid(), self.pin[1])
            await asyncio.wait_for(drv.connect(), 60)
            for k in range(shards):
                drv.spawn(drv.supply(k))
                drv.spawn(drv.train(k))
            self.idle_cpu = await self._idle()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    def _child_setup(self, role: str) -> Callable[[], None] | None:
        """What a server child does before it runs: the servers' priority back when an earlier
        pass raised the driver's, and its CPUs when pinned (before any thread of its own, so
        zmq's and the journal's threads inherit them)."""
        reprioritize = os.getpriority(os.PRIO_PROCESS, 0) != _BASE_NICE
        cpus = None if self.pin is None else self.pin[0] if role == "buffer" else self.pin[1]
        if not reprioritize and cpus is None:
            return None

        def setup() -> None:
            if reprioritize:
                _server_priority()
            if cpus is not None:
                os.sched_setaffinity(0, cpus)

        return setup

    async def _idle(self) -> dict[str, float]:
        """The nodes' CPU with heartbeats, prompt supply and the trainer only (no partials, no
        pushes)."""
        procs = self.procs
        await asyncio.sleep(1.0)
        c0, t0 = {name: cpu_seconds(p.pid) for name, p in procs.items()}, time.monotonic()
        await asyncio.sleep(3.0)
        return {
            name: round((cpu_seconds(p.pid) - c0[name]) / (time.monotonic() - t0), 3)
            for name, p in procs.items()
        }

    def check(self) -> None:
        for p in self.procs.values():
            if p.poll() is not None:
                raise RuntimeError(f"a server exited rc {p.returncode}; see {self.tmp}")

    async def __aexit__(self, *exc: object) -> None:
        args, tmp, procs, ctx, drv = self.args, self.tmp, self.procs, self.ctx, self.drv
        server_logs = self.server_logs
        await drv.close()
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        ctx.destroy(linger=0)
        if self.pin is not None:  # the driver's threads back on every CPU (a ramp may follow)
            pin_threads(os.getpid(), self._cpus)
        for name in procs:  # what went wrong in a node, if anything (warnings and errors only)
            text = (tmp / f"{name}.log").read_text(errors="replace").splitlines()
            server_logs[name] = [ln[:400] for ln in text if '"level": "info"' not in ln][-20:]
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
