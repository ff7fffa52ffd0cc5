"""Chaos soak: a sim cluster under random faults; exactly-once, recovery times and the training-time
ratio.

    this process (fault injector)
        │ starts `python -m laminar run --config cfg.yaml`: the launcher's supervisor
        │ (laminar/children.py) starts every node and restarts one that dies (backoff, budget)
        ▼
    manager · buffer · relay (master) · trainer (sim) · rollout-0..R-1 (sim, reward in a worker)
    phase 1 (no faults, `baseline_s`) ─► phase 2 (a fault every `interval_s`, `chaos_s`) ─► tail
    ─► SIGTERM to `laminar run` (its ordered stop: trainer, rollouts, buffer, relays, manager)
    faults (pids from run_dir/pids.json): kill -9 of any node (manager, buffer, master relay,
    trainer, a rollout); SIGSTOP of a node for 10 s, then SIGCONT; a rollout's reward worker
    stopped for 3 x reward.timeout_s (a hung reward: the runner's timeout kills and replaces it)

Figures (from the files the nodes write, offline after the stop):
  lost / duplicated   trainer run_dir/consumed.jsonl (last record of each step counts: a restarted
                      trainer re-logs the steps after its checkpoint; a uid served but not trained
                      on, e.g. its reward timed out, is in the line's "excluded") and the buffer
                      journal replayed (tests/test_faults.py's check): uids consumed twice, groups
                      consumed partly, groups the journal committed that the trainer never logged,
                      abandoned/dropped
  detection_s         kill/stop -> the manager's `dead` event for that node, or the `join` of its
                      restarted incarnation if that came first (run_dir/timeline.jsonl)
  resume_s            fault -> the next trainer step (consumed.jsonl, polled every 0.25 s)
  rss_growth_mb       per node and incarnation (a new pid in pids.json): last - first VmRSS
                      sample (every 2 s, from 20 s after the incarnation was first seen)
  restarts            the supervisor's count (run_dir/supervisor.json)
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
REWARD_TIMEOUT_S = 2.0
REWARD_HANG_S = 3 * REWARD_TIMEOUT_S
RSS_WARM_S = 20.0


def make_config(
    tmp: Path, rollouts: int, relays: int, prompts: int, backoff_s: float
) -> dict[str, Any]:
    data = tmp / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"prompt {i:06d}", "answer": "42"}) + "\n" for i in range(prompts)
        )
    )
    return {
        "name": "chaos",
        "mode": "laminar",
        "run_dir": str(tmp / "run"),
        "cluster": {
            "transport": "ipc",
            "ipc_dir": str(tmp / "ipc"),
            "roles": {
                "manager": 1,
                "buffer": 1,
                "relay": relays,
                "trainer": 1,
                "rollout": rollouts,
            },
            # a fault every 18-30 s over 5-7 nodes: the budget must outlast the soak
            "restart": {
                "max_restarts": 20,
                "window_s": 60.0,
                "backoff_s": backoff_s,
                "backoff_max_s": 4.0,
            },
        },
        # the reward runs in a worker process (sim engines make no text: fn is called with ""), so
        # a hung reward worker is a fault the rollouts must contain
        "reward": {
            "fn": "laminar.rewards.builtin:exact_match",
            "sim": "fn",
            "workers": 1,
            "timeout_s": REWARD_TIMEOUT_S,
        },
        "transport": {
            "heartbeat_interval_s": 0.25,
            "heartbeat_liveness": 8,
            "request_timeout_s": 2.0,
            "startup_timeout_s": 120.0,
            "stop_timeout_s": 5.0,
            "reconnect_backoff_s": 0.05,
            "reconnect_backoff_max_s": 0.5,
        },
        "data": {"train": str(data), "shuffle": False},
        "rollout": {
            "engine": "sim",
            "group_size": GROUP,
            "credits": 2,
            "max_running": 8,
            "partial_chunk_tokens": 16,
            "prompt_retry_s": 0.1,
            "refresh_wait_s": 2.0,
            "sampling": {"max_tokens": 1000},
            "sim": {
                "step_time_s": 0.01,
                "bound_b": 8,
                "length_p50": 100,
                "length_p99_over_p50": 10,
                "kv_capacity_tokens": 8 * 1100,
            },
        },
        "trainer": {
            "engine": "sim",
            "batch_groups": 4,
            "total_steps": 1_000_000,
            "sim_time_per_token_s": 2e-4,
            "checkpoint_every": 1,
            "commit": "checkpoint",
            "batch_wait_s": 0.5,
        },
        "buffer": {"fsync": "always", "retry_after_s": 0.1},
        "manager": {"repack": {"interval_s": 1.0}, "timeline_interval_s": 0.25},
        "logging": {"level": "info"},
    }


@dataclass
class Incarnation:
    pid: int
    started: float
    rss: list[tuple[float, float]] = field(default_factory=list)
    """(t, VmRSS MiB) samples, from RSS_WARM_S after its start (imports, first weights and
    buffers are start-up, not growth)."""


class Cluster:
    """One `laminar run` (its supervisor restarts a node that dies, with backoff and a budget);
    this class only injects faults into the pids it lists in run_dir/pids.json, samples their
    RSS, and stops the run with SIGTERM (the launcher's ordered stop)."""

    def __init__(self, tmp: Path, cfg_path: Path, run_dir: Path):
        self.tmp, self.cfg_path, self.run_dir = tmp, cfg_path, run_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused: dict[int, float] = {}
        """SIGSTOPped pid -> monotonic time its SIGCONT is due."""
        self.lives: dict[str, list[Incarnation]] = {}
        self.closing = False

    def start(self) -> None:
        cmd = [sys.executable, "-m", "laminar", "run", str(self.cfg_path)]
        log = open(self.tmp / "laminar-run.log", "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )

    def pids(self) -> dict[str, int]:
        """Current pid of each node (the supervisor rewrites pids.json on every start and exit)."""
        try:
            raw = json.loads((self.run_dir / "pids.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return {name: pid for name, pid in raw.items() if isinstance(pid, int)}

    def up(self) -> dict[str, int]:
        """Nodes alive and not paused (fault candidates)."""
        return {n: p for n, p in self.pids().items() if _alive(p) and p not in self.paused}

    def tick(self) -> None:
        """SIGCONT what is due; the run must still be there."""
        now = time.monotonic()
        for pid, due in list(self.paused.items()):
            if now >= due:
                if _alive(pid):
                    os.kill(pid, signal.SIGCONT)
                del self.paused[pid]
        assert self.proc is not None
        if not self.closing and self.proc.poll() is not None:
            raise RuntimeError(
                f"laminar run exited ({self.proc.returncode}); see {self.tmp}/laminar-run.log"
            )

    def sample_rss(self) -> None:
        for name, pid in self.pids().items():
            lives = self.lives.setdefault(name, [])
            if not lives or lives[-1].pid != pid:
                lives.append(Incarnation(pid, time.time()))
            if pid in self.paused or time.time() - lives[-1].started < RSS_WARM_S:
                continue
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        lives[-1].rss.append((time.time(), int(line.split()[1]) / 1024))
            except OSError:
                pass

    def kill9(self, name: str, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)  # the supervisor reaps and restarts it

    def pause(self, name: str, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        self.paused[pid] = time.monotonic() + STOP_PAUSE_S

    def reward_workers(self) -> list[int]:
        """Reward worker processes (`python -m laminar.rewards.runner --worker`) of the rollouts."""
        rollouts = {p for n, p in self.pids().items() if n.startswith("rollout")}
        found = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid in rollouts and b"laminar.rewards.runner" in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
        return found

    def hang_reward(self, pid: int) -> None:
        """A reward call that never returns: the worker is stopped for longer than reward.timeout_s,
        so its runner's timeout fires and replaces the worker (SIGKILL ends a stopped process)."""
        os.kill(pid, signal.SIGSTOP)
        self.paused[pid] = time.monotonic() + REWARD_HANG_S

    def stop_all(self) -> None:
        self.closing = True
        for pid in list(self.paused):
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
        self.paused.clear()
        if self.proc is None:
            return
        last = self.pids()
        if self.proc.poll() is None:
            self.proc.send_signal(
                signal.SIGTERM
            )  # trainer first, then rollouts, buffer, relays, manager
            try:
                self.proc.wait(180)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in {*last.values(), *self.pids().values()}:  # only what this run started, by pid
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


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
    """Offline: consumed.jsonl against the replayed buffer journal (tests/test_faults.py's
    check)."""
    from laminar.buffer.experience import usable
    from laminar.config import load_config
    from laminar.journal_check import replay_buffer_journal
    from laminar.wiring.buffer import experience_state

    last: dict[int, dict[str, Any]] = {}
    for rec in read_jsonl(run_dir / "consumed.jsonl"):
        last[rec["step"]] = rec
    trained = [u for k in sorted(last) for u in last[k]["uids"]]
    # served in a batch but not trained on (no reward: a hung reward timed out; a group left with
    # one member): accounted for, not lost
    excluded = [u for k in sorted(last) for u in last[k].get("excluded", [])]
    uids = trained + excluded
    dup_uids = sum(c - 1 for c in Counter(uids).values() if c > 1)
    groups = Counter(u.rpartition("/")[0] for u in set(uids))
    partial_groups = {g: c for g, c in groups.items() if c != GROUP}
    prompts = Counter(g.split("@")[0] for g in groups)
    cfg = load_config(cfg_path)
    state, trajs = replay_buffer_journal(run_dir / "buffer-0.journal", experience_state(cfg))
    unusable = {t.uid for t in trajs if not usable(t)}
    s = state.summary()
    committed = int(s.get("groups_committed", 0))
    # a member the journal holds as unusable (reward None: a hung reward timed out) is not sent
    # to the trainer, so its group arrives short: recorded and excluded, not lost
    seen = set(uids)
    missing = [f"{g}/{i}" for g in partial_groups for i in range(GROUP) if f"{g}/{i}" not in seen]
    excused = [u for u in missing if u in unusable]
    lost = (
        len(missing)
        - len(excused)
        + int(s.get("abandoned", 0) or 0)
        + GROUP * int(s.get("groups_dropped", 0) or 0)
        + GROUP * max(0, committed - len(groups))
    )
    return {
        "steps": len(last),
        "uids_consumed": len(uids),
        "excluded_uids": len(excluded) + len(excused),
        "excluded_by_trainer": len(excluded),
        "unusable_in_journal": len(unusable),
        "groups_consumed": len(groups),
        "prompts_consumed_more_than_once": sum(1 for c in prompts.values() if c > 1),
        "duplicate_uids": dup_uids,
        "partial_groups": len(partial_groups),
        "journal": {k: v for k, v in s.items() if isinstance(v, (int, float, str))},
        "lost": lost,
        "duplicated": dup_uids + GROUP * max(0, len(groups) - committed),
    }


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="lamchaos-", dir="/tmp"))
    (tmp / "ipc").mkdir()
    cfg = make_config(
        tmp, args.rollouts, args.relays, prompts=200_000, backoff_s=args.restart_backoff_s
    )
    cfg_path = tmp / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run_dir = Path(cfg["run_dir"])
    cl = Cluster(tmp, cfg_path, run_dir)
    steps = Steps(run_dir / "consumed.jsonl")
    rng = random.Random(args.seed)
    faults: list[dict[str, Any]] = []
    t_wall0 = time.time()
    try:
        cl.start()
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
                    fault = inject(cl, rng, args)
                    if fault is not None:
                        fault["step_at"] = steps.max_step
                        faults.append(fault)
                        print(
                            f"[{fault['t'] - t_base0:6.1f}s] {fault['kind']:11s} {fault['node']}",
                            flush=True,
                        )
                time.sleep(0.25)
            bounds[phase] = (t0, time.time())
        cl.sample_rss()
    finally:
        cl.stop_all()
    steps.poll()
    timeline = read_jsonl(run_dir / "timeline.jsonl")
    detect(faults, timeline)
    for f in faults:
        later = [ts for ts, s in steps.series if ts >= f["t"] and s > f["step_at"]]
        f["resume_s"] = round(later[0] - f["t"], 3) if later else None
    rates = {}
    for phase, (t0, t1) in bounds.items():
        rates[phase] = (steps.at(t1) - steps.at(t0)) / max(t1 - t0, 1e-9)
    check = check_exactly_once(run_dir, cfg_path)
    supervisor = _read_json(run_dir / "supervisor.json")
    rss = {}
    for name, lives in cl.lives.items():
        growth = [life.rss[-1][1] - life.rss[0][1] for life in lives if len(life.rss) >= 2]
        first = lives[0].rss
        rss[name] = {
            "restarts": supervisor.get("nodes", {}).get(name, {}).get("restarts"),
            "incarnations_seen": len(lives),
            "growth_mb_max": round(max(growth), 1) if growth else None,
            "first_incarnation_mb": [round(first[0][1], 1), round(first[-1][1], 1)]
            if first
            else None,
        }
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
            "reward_hang_frac": args.reward_hang_frac,
            "stop_pause_s": STOP_PAUSE_S,
            "reward_hang_s": REWARD_HANG_S,
            "rollouts": args.rollouts,
            "seed": args.seed,
            "restart_backoff_s": args.restart_backoff_s,
            "supervisor": "laminar run (laminar/children.py restarts a node that dies)",
            "cluster": cfg,
        },
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
        "supervisor": supervisor,
        "summary": {
            "faults": len(faults),
            "faults_by_kind": dict(Counter(f["kind"] for f in faults)),
            "lost": check["lost"],
            "duplicated": check["duplicated"],
            "excluded": check["excluded_uids"],
            "detection_s": {"p50": pct(det, 0.5), "p99": pct(det, 0.99), "n": len(det)},
            "resume_s": {"p50": pct(res, 0.5), "p99": pct(res, 0.99), "n": len(res)},
            "effective_time_ratio": round(ratio, 3) if ratio is not None else None,
            "restarts": supervisor.get("restarts"),
            "rss_growth_mb_max": max(
                (v["growth_mb_max"] or 0.0 for v in rss.values()), default=0.0
            ),
            "steps": check["steps"],
        },
        "logs_dir": str(tmp),
    }


def detect(faults: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> None:
    """Each fault's detection_s: the manager's first word on that node after it, either `dead`
    (liveness ran out) or the `join` of its restarted incarnation, whichever came first: the
    launcher restarts a killed node in 0.5 s, so it may be back before liveness (2 s) runs
    out, and the manager then handles it as a rejoin (its work recovered at once). None for
    the manager itself (its own timeline) and for a hung reward worker (not a node), and when
    nothing came before the next fault on the same node."""
    for i, f in enumerate(faults):
        f["detection_s"] = None
        if f["kind"] == "reward_hang" or f["node"].startswith("manager"):
            continue
        nxt = min((g["t"] for g in faults[i + 1 :] if g["node"] == f["node"]), default=float("inf"))
        seen = [
            e
            for e in timeline
            if e.get("node") == f["node"]
            and e.get("event") in ("dead", "join")
            and f["t"] <= e["t"] < nxt
        ]
        if seen:
            first = min(seen, key=lambda e: e["t"])
            f["detection_s"] = round(first["t"] - f["t"], 3)
            f["detected_by"] = first["event"]


def rescore(path: Path) -> dict[str, Any]:
    """Recompute detection from a finished run's timeline (its logs_dir) and rewrite the summary."""
    res = json.loads(path.read_text())
    timeline = read_jsonl(Path(res["logs_dir"]) / "run" / "timeline.jsonl")
    detect(res["faults"], timeline)
    det = [f["detection_s"] for f in res["faults"] if f["detection_s"] is not None]
    res["summary"]["detection_s"] = {"p50": pct(det, 0.5), "p99": pct(det, 0.99), "n": len(det)}
    return res


def inject(cl: Cluster, rng: random.Random, args: argparse.Namespace) -> dict[str, Any] | None:
    """One random fault: a reward worker hung, a node SIGSTOPped for STOP_PAUSE_S, or kill -9."""
    up = cl.up()
    if not up:
        return None
    draw = rng.random()
    workers = cl.reward_workers() if draw < args.reward_hang_frac else []
    t = time.time()
    if workers:
        pid = rng.choice(sorted(workers))
        cl.hang_reward(pid)
        return {"t": t, "kind": "reward_hang", "node": f"reward-worker pid {pid}"}
    name = rng.choice(sorted(up))
    kind = "sigstop" if draw < args.reward_hang_frac + args.stop_frac else "kill9"
    (cl.pause if kind == "sigstop" else cl.kill9)(name, up[name])
    return {"t": t, "kind": kind, "node": name}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError):
        return {}


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
    ap.add_argument(
        "--reward-hang-frac",
        type=float,
        default=0.15,
        help="share of faults that hang a rollout's reward worker (SIGSTOP past reward.timeout_s)",
    )
    ap.add_argument("--restart-backoff-s", type=float, default=0.5)
    ap.add_argument("--startup-timeout-s", type=float, default=180.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rescore",
        type=Path,
        default=None,
        help="no run: recompute detection in this result file from its run's timeline",
    )
    args = ap.parse_args(argv)
    if args.rescore is not None:
        res = rescore(args.rescore)
        args.rescore.write_text(json.dumps(res, indent=1))
        print(f"rescored {args.rescore}: detection {res['summary']['detection_s']}")
        return 0
    args.interval_s = args.interval_s or (18.0 if args.quick else 30.0)
    args.baseline_s = args.baseline_s or (45.0 if args.quick else 300.0)
    args.chaos_s = args.chaos_s or (200.0 if args.quick else 1800.0)
    res = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    s = res["summary"]
    print(
        f"faults {s['faults']} {s['faults_by_kind']}  lost {s['lost']}  duplicated "
        f"{s['duplicated']}  "
        f"detection p50/p99 {s['detection_s']['p50']}/{s['detection_s']['p99']} s  "
        f"resume p50/p99 {s['resume_s']['p50']}/{s['resume_s']['p99']} s  "
        f"effective_time_ratio {s['effective_time_ratio']}  restarts {s['restarts']} -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
