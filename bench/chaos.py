"""Chaos soak: a sim cluster under random faults; exactly-once, recovery times and the training-time ratio.

    this process (supervisor + fault injector)
        │ starts every node as `python -m laminar node --role R --index I --config cfg.yaml`
        ▼
    manager · buffer · relay (master) · trainer (sim) · rollout-0..R-1 (sim), one process each, ipc
    phase 1 (no faults, `baseline_s`) ─► phase 2 (a fault every `interval_s`, `chaos_s`) ─► tail ─► SIGTERM all
    faults: kill -9 of any node (manager, buffer, master relay, trainer, a rollout); SIGSTOP for 10 s, then SIGCONT
    a node that exits is restarted by this script after `restart_backoff_s` (the same command line)

Why this script supervises: `laminar run` did not restart dead nodes when this bench was written
(issue 15 item 1 lands restart-on-death in laminar/launch.py); with it landed, the launcher would
do the restarts and this loop only injects. The nodes and the command lines are what `laminar run`
starts.

Figures (from the files the nodes write, offline after the stop):
  lost / duplicated   trainer run_dir/consumed.jsonl (last record of each step counts: a restarted
                      trainer re-logs the steps after its checkpoint) and the buffer journal replayed
                      (tests/test_faults.py's check): uids consumed twice, groups consumed partly,
                      groups the journal committed that the trainer never logged, abandoned/dropped
  detection_s         kill/stop -> the manager's `dead` event for that node (run_dir/timeline.jsonl)
  resume_s            fault -> the next trainer step (consumed.jsonl, polled every 0.25 s)
  rss_growth_mb       per node and incarnation: last - first VmRSS sample (every 2 s, from 20 s
                      after the incarnation started)
  effective_time_ratio steps/s during the chaos phase / steps/s during the no-fault phase, same run

    .venv/bin/python bench/chaos.py --quick --out bench/results/chaos_quick.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchinfo, also when loaded as a module

from benchinfo import git  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GROUP = 2
STOP_PAUSE_S = 10.0
RSS_WARM_S = 20.0


def make_config(tmp: Path, rollouts: int, relays: int, prompts: int) -> dict[str, Any]:
    data = tmp / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"prompt {i:06d}"}) + "\n" for i in range(prompts))
    )
    return {
        "name": "chaos", "mode": "laminar", "run_dir": str(tmp / "run"),
        "cluster": {"transport": "ipc", "ipc_dir": str(tmp / "ipc"),
                    "roles": {"manager": 1, "buffer": 1, "relay": relays, "trainer": 1, "rollout": rollouts}},
        "transport": {"heartbeat_interval_s": 0.25, "heartbeat_liveness": 8, "request_timeout_s": 2.0,
                      "startup_timeout_s": 120.0, "stop_timeout_s": 5.0, "reconnect_backoff_s": 0.05,
                      "reconnect_backoff_max_s": 0.5},
        "data": {"train": str(data), "shuffle": False},
        "rollout": {"engine": "sim", "group_size": GROUP, "credits": 2, "max_running": 8,
                    "partial_chunk_tokens": 16, "prompt_retry_s": 0.1, "refresh_wait_s": 2.0,
                    "sampling": {"max_tokens": 1000},
                    "sim": {"step_time_s": 0.01, "bound_b": 8, "length_p50": 100, "length_p99_over_p50": 10,
                            "kv_capacity_tokens": 8 * 1100}},
        "trainer": {"engine": "sim", "batch_groups": 4, "total_steps": 1_000_000, "sim_time_per_token_s": 2e-4,
                    "checkpoint_every": 1, "commit": "checkpoint", "batch_wait_s": 0.5},
        "buffer": {"fsync": "always", "retry_after_s": 0.1},
        "manager": {"repack": {"interval_s": 1.0}, "timeline_interval_s": 0.25},
        "logging": {"level": "info"},
    }  # fmt: skip


@dataclass
class NodeProc:
    name: str
    role: str
    index: int
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    restarts: int = 0
    stopped_until: float = 0.0
    """SIGSTOPped: SIGCONT is due at this monotonic time (0 = running)."""
    rss: list[list[tuple[float, float]]] = field(default_factory=list)
    """Per incarnation: (t, VmRSS MiB) samples, from RSS_WARM_S after its start (imports, first
    weights and buffers are start-up, not growth)."""
    started: list[float] = field(default_factory=list)


class Cluster:
    """The nodes of one soak: start, restart on exit, kill -9, stop/cont, stop all (only these pids)."""

    def __init__(self, tmp: Path, cfg_path: Path, rollouts: int, relays: int, backoff_s: float):
        self.tmp, self.cfg_path, self.backoff_s = tmp, cfg_path, backoff_s
        self.nodes = {n.name: n for n in [NodeProc("manager", "manager", 0), NodeProc("buffer", "buffer", 0),
                                           *(NodeProc(f"relay-{i}", "relay", i) for i in range(relays)), NodeProc("trainer", "trainer", 0),
                                           *(NodeProc(f"rollout-{i}", "rollout", i) for i in range(rollouts))]}  # fmt: skip
        self.dead_since: dict[str, float] = {}
        self.all_procs: list[subprocess.Popen[bytes]] = []
        self.closing = False

    def start(self, n: NodeProc) -> None:
        cmd = [sys.executable, "-m", "laminar", "node", "--role", n.role, "--index", str(n.index),
               "--config", str(self.cfg_path)]  # fmt: skip
        log = open(self.tmp / f"{n.name}.{n.incarnation}.log", "wb")
        n.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
        self.all_procs.append(n.proc)
        n.rss.append([])
        n.started.append(time.time())
        n.incarnation += 1

    def start_all(self) -> None:
        for n in self.nodes.values():
            self.start(n)

    def tick(self) -> None:
        """Restart what exited (after the backoff); SIGCONT what is due."""
        now = time.monotonic()
        for n in self.nodes.values():
            assert n.proc is not None
            if n.stopped_until and now >= n.stopped_until:
                if n.proc.poll() is None:
                    os.kill(n.proc.pid, signal.SIGCONT)
                n.stopped_until = 0.0
            if self.closing or n.proc.poll() is None:
                continue
            since = self.dead_since.setdefault(n.name, now)
            if now - since >= self.backoff_s:
                del self.dead_since[n.name]
                n.restarts += 1
                self.start(n)

    def sample_rss(self) -> None:
        for n in self.nodes.values():
            if n.proc is None or n.proc.poll() is not None or n.stopped_until:
                continue
            if time.time() - n.started[-1] < RSS_WARM_S:
                continue
            try:
                for line in Path(f"/proc/{n.proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        n.rss[-1].append((time.time(), int(line.split()[1]) / 1024))
            except OSError:
                pass

    def kill9(self, name: str) -> None:
        p = self.nodes[name].proc
        assert p is not None
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)

    def pause(self, name: str) -> None:
        n = self.nodes[name]
        assert n.proc is not None
        os.kill(n.proc.pid, signal.SIGSTOP)
        n.stopped_until = time.monotonic() + STOP_PAUSE_S

    def stop_all(self) -> None:
        self.closing = True
        for n in self.nodes.values():
            if n.proc is not None and n.proc.poll() is None and n.stopped_until:
                os.kill(n.proc.pid, signal.SIGCONT)
        # the trainer first (it checkpoints and commits), then the rest
        order = [
            "trainer",
            *[k for k in self.nodes if k.startswith("rollout")],
            "buffer",
            *[k for k in self.nodes if k.startswith("relay")],
            "manager",
        ]
        try:
            for name in order:
                p = self.nodes[name].proc
                if p is not None and p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    try:
                        p.wait(20)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait(10)
        finally:
            self.kill_rest()

    def kill_rest(self) -> None:
        for p in self.all_procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


class Steps:
    """The trainer's progress, read incrementally from consumed.jsonl."""

    def __init__(self, path: Path):
        self.path, self.pos, self.max_step = path, 0, 0
        self.series: list[tuple[float, int]] = []

    def poll(self) -> int:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                if line.strip():
                    self.max_step = max(self.max_step, json.loads(line)["step"])
            self.pos += end
        self.series.append((time.time(), self.max_step))
        return self.max_step

    def at(self, t: float) -> int:
        best = 0
        for ts, s in self.series:
            if ts <= t:
                best = s
        return best


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill -9 mid-write
            continue
    return out


def check_exactly_once(run_dir: Path, cfg_path: Path) -> dict[str, Any]:
    """Offline: consumed.jsonl against the replayed buffer journal (tests/test_faults.py's check)."""
    from laminar.buffer.admission import Admission
    from laminar.buffer.experience import ExperienceState
    from laminar.buffer.journal import Journal
    from laminar.config import load_config

    last: dict[int, dict[str, Any]] = {}
    for rec in read_jsonl(run_dir / "consumed.jsonl"):
        last[rec["step"]] = rec
    uids = [u for k in sorted(last) for u in last[k]["uids"]]
    dup_uids = sum(c - 1 for c in Counter(uids).values() if c > 1)
    groups = Counter(u.rpartition("/")[0] for u in set(uids))
    partial_groups = {g: c for g, c in groups.items() if c != GROUP}
    prompts = Counter(g.split("@")[0] for g in groups)
    cfg = load_config(cfg_path)
    state = ExperienceState(group_size=GROUP, lost_member_policy="release_partial",
                            admission=Admission.from_config(cfg))  # fmt: skip
    journal = Journal(run_dir / "buffer-0.journal", "never")
    try:
        for kind, body, msgs in journal.replay():
            state.apply(kind, body, msgs)
    finally:
        journal.close()
    s = state.summary()
    committed = int(s.get("groups_committed", 0))
    lost = (sum(GROUP - c for c in partial_groups.values()) + int(s.get("abandoned", 0) or 0)
            + GROUP * int(s.get("groups_dropped", 0) or 0) + GROUP * max(0, committed - len(groups)))  # fmt: skip
    return {
        "steps": len(last), "uids_consumed": len(uids), "groups_consumed": len(groups),
        "prompts_consumed_more_than_once": sum(1 for c in prompts.values() if c > 1),
        "duplicate_uids": dup_uids, "partial_groups": len(partial_groups),
        "journal": {k: v for k, v in s.items() if isinstance(v, (int, float, str))},
        "lost": lost,
        "duplicated": dup_uids + GROUP * max(0, len(groups) - committed),
    }  # fmt: skip


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="lamchaos-", dir="/tmp"))
    (tmp / "ipc").mkdir()
    cfg = make_config(tmp, args.rollouts, args.relays, prompts=200_000)
    cfg_path = tmp / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run_dir = Path(cfg["run_dir"])
    cl = Cluster(tmp, cfg_path, args.rollouts, args.relays, args.restart_backoff_s)
    steps = Steps(run_dir / "consumed.jsonl")
    rng = random.Random(args.seed)
    faults: list[dict[str, Any]] = []
    t_wall0 = time.time()
    try:
        cl.start_all()
        end = time.monotonic() + args.startup_timeout_s
        while steps.poll() < 2:  # polling files of other processes: no event to wait on
            if time.monotonic() > end:
                raise RuntimeError(
                    f"no training steps within {args.startup_timeout_s} s; logs in {tmp}"
                )
            cl.tick()
            time.sleep(0.25)
        t_base0 = time.time()
        phases = [("baseline", args.baseline_s), ("chaos", args.chaos_s), ("tail", args.tail_s)]
        bounds: dict[str, tuple[float, float]] = {}
        for phase, dur in phases:
            t0 = time.time()
            t_end = time.monotonic() + dur
            next_fault = time.monotonic()
            last_rss = 0.0
            while time.monotonic() < t_end:
                cl.tick()
                steps.poll()
                if time.monotonic() - last_rss >= 2.0:
                    cl.sample_rss()
                    last_rss = time.monotonic()
                if phase == "chaos" and time.monotonic() >= next_fault:
                    next_fault += args.interval_s
                    up = [n for n, p in cl.nodes.items() if p.proc is not None and p.proc.poll() is None
                          and not p.stopped_until]  # fmt: skip
                    victim = rng.choice(up)
                    kind = "sigstop" if rng.random() < args.stop_frac else "kill9"
                    t = time.time()
                    (cl.pause if kind == "sigstop" else cl.kill9)(victim)
                    faults.append({"t": t, "kind": kind, "node": victim, "step_at": steps.max_step})
                    print(f"[{t - t_base0:6.1f}s] {kind:7s} {victim}", flush=True)
                time.sleep(0.25)
            bounds[phase] = (t0, time.time())
        cl.sample_rss()
    finally:
        cl.stop_all()
    steps.poll()
    timeline = read_jsonl(run_dir / "timeline.jsonl")
    for f in faults:
        dead = [e["t"] for e in timeline if e.get("event") == "dead" and e.get("node") == _node_id(f["node"])
                and e["t"] >= f["t"]]  # fmt: skip
        f["detection_s"] = round(min(dead) - f["t"], 3) if dead else None
        later = [ts for ts, s in steps.series if ts >= f["t"] and s > f["step_at"]]
        f["resume_s"] = round(later[0] - f["t"], 3) if later else None
    rates = {}
    for phase, (t0, t1) in bounds.items():
        rates[phase] = (steps.at(t1) - steps.at(t0)) / max(t1 - t0, 1e-9)
    check = check_exactly_once(run_dir, cfg_path)
    rss = {}
    for n in cl.nodes.values():
        growth = [s[-1][1] - s[0][1] for s in n.rss if len(s) >= 2]
        rss[n.name] = {"restarts": n.restarts, "incarnations": n.incarnation,
                       "growth_mb_max": round(max(growth), 1) if growth else None,
                       "first_incarnation_mb": [round(n.rss[0][0][1], 1), round(n.rss[0][-1][1], 1)]
                       if n.rss and n.rss[0] else None}  # fmt: skip
    det = [f["detection_s"] for f in faults if f["detection_s"] is not None]
    res = [f["resume_s"] for f in faults if f["resume_s"] is not None]
    ratio = rates["chaos"] / rates["baseline"] if rates.get("baseline") else None
    return {
        "bench": "chaos",
        "config": {
            "quick": args.quick,
            "baseline_s": args.baseline_s,
            "chaos_s": args.chaos_s,
            "tail_s": args.tail_s,
            "interval_s": args.interval_s,
            "stop_frac": args.stop_frac,
            "stop_pause_s": STOP_PAUSE_S,
            "rollouts": args.rollouts,
            "seed": args.seed,
            "restart_backoff_s": args.restart_backoff_s,
            "supervisor": "bench/chaos.py restarts exited nodes (laminar run had no restart-on-death)",
            "cluster": cfg,
        },  # fmt: skip
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "git_commit": git("rev-parse", "HEAD"),
        "wall_s": round(time.time() - t_wall0, 1),
        "faults": faults,
        "steps_per_s": {k: round(v, 3) for k, v in rates.items()},
        "exactly_once": check,
        "rss": rss,
        "summary": {
            "faults": len(faults),
            "faults_by_kind": dict(Counter(f["kind"] for f in faults)),
            "lost": check["lost"],
            "duplicated": check["duplicated"],
            "detection_s": {"p50": pct(det, 0.5), "p99": pct(det, 0.99), "n": len(det)},
            "resume_s": {"p50": pct(res, 0.5), "p99": pct(res, 0.99), "n": len(res)},
            "effective_time_ratio": round(ratio, 3) if ratio is not None else None,
            "restarts": sum(n.restarts for n in cl.nodes.values()),
            "rss_growth_mb_max": max(
                (v["growth_mb_max"] or 0.0 for v in rss.values()), default=0.0
            ),
            "steps": check["steps"],
        },  # fmt: skip
        "logs_dir": str(tmp),
    }


def _node_id(name: str) -> str:
    return {"manager": "manager-0", "buffer": "buffer-0", "trainer": "trainer-0"}.get(name, name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="5 minutes: 45 s baseline, 200 s chaos (a fault / 18 s)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/chaos.json")
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--relays", type=int, default=1, help="relay nodes (relay-0 is the master)")
    ap.add_argument("--interval-s", type=float, default=None)
    ap.add_argument("--baseline-s", type=float, default=None)
    ap.add_argument("--chaos-s", type=float, default=None)
    ap.add_argument("--tail-s", type=float, default=15.0)
    ap.add_argument(
        "--stop-frac",
        type=float,
        default=0.25,
        help="share of faults that are SIGSTOP (else kill -9)",
    )
    ap.add_argument("--restart-backoff-s", type=float, default=0.5)
    ap.add_argument("--startup-timeout-s", type=float, default=180.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.interval_s = args.interval_s or (18.0 if args.quick else 30.0)
    args.baseline_s = args.baseline_s or (45.0 if args.quick else 300.0)
    args.chaos_s = args.chaos_s or (200.0 if args.quick else 1800.0)
    res = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    s = res["summary"]
    print(f"faults {s['faults']} {s['faults_by_kind']}  lost {s['lost']}  duplicated {s['duplicated']}  "
          f"detection p50/p99 {s['detection_s']['p50']}/{s['detection_s']['p99']} s  "
          f"resume p50/p99 {s['resume_s']['p50']}/{s['resume_s']['p99']} s  "
          f"effective_time_ratio {s['effective_time_ratio']}  restarts {s['restarts']} -> {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
