"""One emulated-cluster run: the real control plane with N sim rollouts, measured over a window.

    run process (this file, `run`):  manager + buffer + relay + trainer (LocalCluster over ipc)
        │ spawns
        ▼
    worker process (this file, `worker`): N RolloutNodes with sim engines, one zmq context/loop;
        samples every rollout's engine (running, KV, tokens) every `sample_s` into a series file
    run: wait for N serving rollouts (manager) ─► warm-up ─► window ─► SIGTERM worker ─► figures

Two processes, because the 2-core budget is the point: the rollouts' event handling and the
buffer/trainer/manager each get a core (one Python process uses one). Both measure their own
event-loop lag and CPU, so a run that became CPU-bound says so instead of silently reporting a
slowed-down emulation. The sim engines advance on the clock (closed form), so loop lag delays
events but does not slow decoding; it does delay the control plane (prompts, repack, batches).

Figures (all over the same wall-clock window, see `figures`):
  train_tok_s        tokens (prompt + response) consumed by trainer steps / time between step ends
  gen_tok_s          response tokens the engines generated / window
  rollout_idle_frac  share of rollout-time with nothing decoding (sampled)
  decode_util        mean of min(running, B) / B over rollout-time (sampled)
  kv_use             mean KV-cache use over rollout-time (sampled)
  trainer_idle_frac  1 - (emulated compute time of steps in the window) / window
  staleness          trainer version at consumption - trajectory version (per-step histograms)

Run by bench/cluster.py; by hand:
  .venv/bin/python bench/cluster_run.py run --mode laminar --n 64 --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("sync", "one_step", "stream", "partial", "laminar_norepack", "laminar")
QUEUED = ("partial", "laminar_norepack", "laminar")
"""Modes whose rollouts keep a queue (rollout.refill_slots) and run under buffer.max_staleness:
laminar, and partial (AReaL-style, the strongest baseline) configured alike, so the two differ
only in how a new version reaches the rollouts."""


@dataclass
class BenchParams:
    """The emulated workload; every run of a sweep uses the same values (see bench/README.md)."""

    step_time_s: float = 0.005
    """Sim decode step, flat up to bound_b running sequences (time compression: ~10x a real
    step)."""
    bound_b: int = 8
    """Decode bound B = rollout.max_running = repack bound."""
    group_size: int = 4
    credits: int = 2
    """Groups a rollout holds: credits * group_size = B, so a fresh rollout runs a full batch."""
    queued_credits: int | None = None
    """partial and laminar modes: their rollout.credits, where set (None: credits). With
    refill_slots their decode slots are bounded per sequence; credits then only cap the groups
    in hand multi-turn (2 x credits, waiting on tools or not: laminar/rollout/feeder.py), so
    the barrier modes, whose global batch is spread evenly, keep `credits`."""
    refill_slots: int | None = 12
    """laminar modes and partial: credits per sequence (rollout.refill_slots): a rollout asks for
    a group whenever its unfinished sequences leave room for one within this many, so up to
    12 - 8 = 4 wait in its engine's queue and a slot a finished sequence frees is refilled in the
    same decode step; when a newer version is wanted the groups not started go to it
    (rollout.retract_unstarted; partial never drains: its queue continues under the new version).
    The other baselines keep `credits`: their global batch is spread evenly and drained, a queue
    would only unbalance it. None: a credit per group, as before (bench/README.md)."""
    prefill_over_decode: float | None = 5.0
    """Prefill rate / saturated decode rate (bound_b / step_time_s), the one ratio that sets the
    sim engine's prefill charge (rollout.sim.prefill_tok_s) and the simulator's: 5 is the
    conservative 32B-72B ratio (prefill is compute-bound, decode weight-read-bound; 7B on one GPU
    is ~2). Every sequence entering a batch pays for its prompt and resumed tokens: a partial
    rollout's interrupted sequences after each update, a repack import, a new prompt. None:
    prefill is free (the emulation before issue 44)."""
    load_frac: float = 0.013
    """A weight load (rollout.sim.load_time_s) as a share of a median response's decode time:
    the 32B paper-scale figure (bench/simscale.py: a 65.6 GB version over PCIe on TP 4, 0.66 s,
    against 2,000 tokens at 25 ms a step). Every load pays it, in every mode."""
    length_p50: int = 100
    length_p99_over_p50: float = 10.0
    max_tokens: int = 1024
    """Response cap (just above p99 = 1000)."""
    prompt_tokens: int = 32
    trainer_s_per_token_x_n: float = 5e-4
    """Sim trainer time per token = this / N: the trainer grows with the cluster (a fixed share of
    it)."""
    batch_groups_per_rollout: int = 2
    """trainer.batch_groups = this * N: one global batch = one full batch on every rollout."""
    retract_unstarted: bool = True
    """laminar modes: rollout.retract_unstarted (queued groups go to the next version)."""
    max_staleness: int | None = None
    """laminar modes and partial: buffer.max_staleness (None: unbounded, as measured, and as the
    paper ran AReaL for throughput; see bench/README.md)."""
    heartbeat_s: float = 0.5
    repack_interval_s: float = 0.1
    """Manager repack period (and a round right after each update). 0.1 s (0.25 s until
    2026-12-07, 0.5 and 1 s before): a source freed sooner is that much more time at full B. At
    K = 2 the simulator gives +0.018 decode utilisation for 0.25 -> 0.1 s with laminar's consumed
    staleness p99 unchanged (0.05 s: +0.002 more for twice the rounds; drain_sweep_s16.json), and an
    interleaved emulation A/B read laminar +1.6-2.1% in each of 3 seeds for +0.03 of a core in the
    manager: a round's moves now take ~25 ms (0.2-0.27 s when the period was first cut)
    (bench/README.md, issues 18 and 44)."""
    c_max: float = 0.9
    warmup_s: float = 8.0
    window_s: float = 24.0
    barrier_window_s: float | None = None
    """sync, one_step and stream measure over this window instead of window_s (None: window_s):
    their steps wait for a global batch's longest sequence (4-6 s here), so an 18 s window holds
    two or three whole steps, and one step more or fewer moved sync's rate by a quarter."""
    sample_s: float = 0.1
    workload: str = "single"
    """single: one response per prompt. multiturn: tool-calling episodes
    (laminar.envs.sim:SimToolEnv, the fields below; length_p50 is then per model turn), see
    MULTITURN."""
    agents: bool = False
    """multiturn only: the episodes are driven by a black-box agent through each rollout's
    OpenAI-compatible endpoint (laminar.agents.sim:sim_tool_agent, the same draws) instead of
    the in-process SimToolEnv."""
    agent_workers: int = 4
    """Agent worker processes (agents only): shared by the N rollouts of the worker process
    (agent.shared_workers), as one host's agents would be; per rollout when agent_shared is
    off."""
    agent_shared: bool = True
    """agent.shared_workers. Off: N x agent_workers processes, each importing the client (a
    second of CPU each) and running its own loop: at N = 64 on 2 cores they, not the control
    plane, were what the run measured."""
    agent_client_call: str = "post"
    """How the sim agent calls the endpoint (laminar/agents/sim.py): "post" skips the openai
    client's per-call parameter transform (~2.5 ms of CPU a call on this box's 2 cores, shared
    with the 64 rollouts; a real agent's client runs on its own host), "create" is the full
    `chat.completions.create` path."""
    agent_startup_timeout_s: float = 600.0
    """agent.startup_timeout_s: the workers import the client before their hello (a second of
    CPU each: a minute of wall clock for 64 unshared ones on 2 busy cores)."""
    ready_timeout_s: float = 600.0
    """How long the run waits, after the N rollouts registered, for all of them to serve (engine
    up, agent workers said hello) before the warm-up starts."""
    tool_calls_max: int = 8
    p_call: float = 0.8
    tool_latency_p50_s: float = 0.1
    tool_latency_p99_s: float = 2.0
    tool_latency_max_s: float = 6.0
    """The sandbox's wall-clock limit (3x p99): without it one 1-in-10^4 draw (20-40 s) stalls
    a whole quick window of the barrier modes."""
    obs_tokens_min: int = 10
    obs_tokens_max: int = 100

    refill_versions: int = 2
    """laminar modes: rollout.refill_versions K (a busy rollout refills at its version until the
    newest is K ahead; 0: it drains for anything newer, as before issue 44). 2 (was 3): once the
    buffer let a rollout hold a group per straggler, K = 2 kept laminar / partial above 1.15 with
    consumed staleness p99 no higher than partial's, where K = 3 gave 1.20 at p99 9 against 8
    (bench/README.md, "Fourth session (2026-12-06, issue 44)")."""
    repack_candidates: str = "draining"
    """manager.repack.candidates: draining (the rollout's word) or kv_falling (before issue 44)."""
    repack_split: bool = True
    """manager.repack.split_sources: a draining tail no single destination fits is spread over
    several (at B = 8 two or three long sequences rarely fit beside another whole tail; False:
    whole sources only, as before)."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchParams:
        names = {f.name for f in fields(cls)}
        if "repack_split" not in d:  # stored before sources could be split: whole ones
            d = {"repack_split": False, **d}
        if "prefill_over_decode" not in d:  # a stored run from before issue 44: its own rules
            d = {
                "prefill_over_decode": None,
                "load_frac": 0.0,
                "refill_versions": 0,
                "repack_candidates": "kv_falling",
                **d,
            }
        return cls(**{k: v for k, v in d.items() if k in names})

    def prefill_tok_s(self) -> float | None:
        """The sim engine's prefill rate: prefill_over_decode x saturated decode."""
        if self.prefill_over_decode is None:
            return None
        return self.prefill_over_decode * self.bound_b / self.step_time_s


TIMED = (
    "step_time_s",
    "trainer_s_per_token_x_n",
    "repack_interval_s",
    "warmup_s",
    "window_s",
    "barrier_window_s",
    "sample_s",
    "tool_latency_p50_s",
    "tool_latency_p99_s",
    "tool_latency_max_s",
)
"""The workload's time constants: `dilate` scales them together (the control plane's own
heartbeats and timeouts stay as they are)."""


BARRIER = ("sync", "one_step", "stream")
"""Modes whose trainer steps wait for a whole global batch (BenchParams.barrier_window_s)."""


def for_mode(prm: BenchParams, mode: str) -> BenchParams:
    """The run's parameters for one mode: the barrier modes' own window where one is set."""
    if mode in BARRIER and prm.barrier_window_s is not None:
        return replace(prm, window_s=prm.barrier_window_s)
    return prm


def dilate(prm: BenchParams, k: float) -> BenchParams:
    """The same workload k times slower: every time constant of the emulated cluster (decode
    step, trainer time, tool latencies, repack period) and the run's windows x k, so each mode's
    shape (steps per tool call, per repack round, per trainer step) is unchanged while the host's
    CPU has k times longer per emulated step. bench/cluster.py --agents uses k = 3: 15 ms decode
    steps (a 7B GPU's, where 5 ms compressed it ~10x), because the agents' clients, which in a
    deployment run on the rollouts' own hosts, share this box's 2 cores with 64 rollouts."""
    if k == 1:
        return prm
    scaled = {f: getattr(prm, f) * k for f in TIMED if getattr(prm, f) is not None}
    return replace(prm, **scaled)


MULTITURN: dict[str, Any] = {"workload": "multiturn", "length_p50": 50, "queued_credits": 4}
"""The multi-turn workload's BenchParams (bench/cluster.py --workload multiturn): up to 8 tool calls
(paper §8), a run of p_call = 0.8 coins (mean ~3.3 calls), model turns of median 50 tokens (p99 500:
the same 10x tail) and a whole response still capped at 1024, sandbox latency lognormal with
p50 0.1 s and p99 2 s, killed at 6 s (about a turn's decode time at the median, the time compression
of the 5 ms step: paper-scale estimates in bench/simscale.py MULTITURN), 10-100 tool-output
tokens. partial and laminar hold up to 8 groups (32 episodes) on B = 8, most of them waiting on
a tool at any time (`queued_credits` 4; with 2, four groups in hand left slots idle: decode
utilisation 0.62 -> 0.71 for laminar, 0.59 -> 0.64 for partial in the simulator, issue 44)."""


def env_section(prm: BenchParams, seed: int) -> dict[str, Any]:
    """The config's env section: none single-turn, SimToolEnv with the bench's draws multi-turn."""
    if prm.workload == "single":
        return {}
    if prm.workload != "multiturn":
        raise ValueError(f"unknown workload {prm.workload!r}; expected single or multiturn")
    kwargs = {
        "seed": seed,
        "max_calls": prm.tool_calls_max,
        "p_call": prm.p_call,
        "latency_p50_s": prm.tool_latency_p50_s,
        "latency_p99_s": prm.tool_latency_p99_s,
        "latency_max_s": prm.tool_latency_max_s,
        "obs_min": prm.obs_tokens_min,
        "obs_max": prm.obs_tokens_max,
    }
    return {
        "fn": "laminar.envs.sim:SimToolEnv",
        "kwargs": kwargs,
        "limits": {"max_turns": prm.tool_calls_max + 1, "max_tool_calls": prm.tool_calls_max},
    }


def write_prompts(path: Path, rows: int, tokens: int = 32) -> Path:
    """Distinct prompts of exactly `tokens` byte ids (no model: the buffer encodes bytes)."""
    filler = "x" * max(0, tokens - 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"prompt": f"p{i:06d} {filler}"}) + "\n" for i in range(rows))
    )
    return path


_BENCH_SEGMENT = re.compile(r"^laminar-cb(\d+)-relay\d+-")
"""The relay's /dev/shm segments of a bench run: the config name carries the run's pid."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_segments(pid: int | None = None) -> int:
    """Unlink the bench's relay segments: this run's (`pid`), or (None) those of runs whose
    process is gone. A run ends with os._exit, skipping the relay's own cleanup, and the
    relay's stale-segment sweep only matches its own name, which carries the dead run's pid."""
    from laminar.weights.segment import default_shm_dir

    seg_dir = default_shm_dir()
    n = 0
    try:
        names = os.listdir(seg_dir)
    except FileNotFoundError:
        return 0
    for name in names:
        m = _BENCH_SEGMENT.match(name)
        if m is None:
            continue
        owner = int(m.group(1))
        if (owner == pid) if pid is not None else (owner != os.getpid() and not _alive(owner)):
            try:
                os.unlink(os.path.join(seg_dir, name))
                n += 1
            except OSError:
                pass
    return n


def make_config(mode: str, n: int, seed: int, prm: BenchParams, work: Path, ipc_dir: Path):
    """The laminar config of one run (mode laminar_norepack = laminar with repack off)."""
    queued = mode in QUEUED
    from laminar.config import config_from_dict

    data = write_prompts(work / "prompts.jsonl", 40 * n * prm.credits + 4000, prm.prompt_tokens)
    cap = prm.max_tokens
    return config_from_dict(
        {
            "name": f"cb{os.getpid()}",
            "mode": "laminar" if mode.startswith("laminar") else mode,
            "seed": seed,
            "run_dir": str(work / "run"),
            "cluster": {
                "transport": "ipc",
                "ipc_dir": str(ipc_dir),
                "roles": {"manager": 1, "buffer": 1, "relay": 1, "trainer": 1, "rollout": n},
            },
            # a loaded 2-core box: 5 s of silence before a death (nothing dies in a bench run)
            "transport": {
                "heartbeat_interval_s": prm.heartbeat_s,
                "heartbeat_liveness": max(4, int(5 / prm.heartbeat_s)),
                "startup_timeout_s": 120,
                "stop_timeout_s": 3.0,
            },
            "data": {"train": str(data), "shuffle": True, "seed": seed},
            "rollout": {
                "engine": "sim",
                "weights": "relay",
                "group_size": prm.group_size,
                "credits": prm.queued_credits if queued and prm.queued_credits else prm.credits,
                "refill_slots": prm.refill_slots if queued else None,
                "retract_unstarted": prm.retract_unstarted,
                "refill_versions": prm.refill_versions if queued else 0,
                "max_running": prm.bound_b,
                "partial_chunk_tokens": 256,
                "prompt_retry_s": 0.05,
                "sampling": {"max_tokens": cap},
                "sim": {
                    "step_time_s": prm.step_time_s,
                    "bound_b": prm.bound_b,
                    "length_p50": prm.length_p50,
                    "length_p99_over_p50": prm.length_p99_over_p50,
                    "seed": seed,
                    # sized for B worst-case sequences: the bound B, not memory, limits a rollout
                    "kv_capacity_tokens": prm.bound_b * (prm.prompt_tokens + cap),
                    "prefill_tok_s": prm.prefill_tok_s(),
                    "load_time_s": round(prm.load_frac * prm.length_p50 * prm.step_time_s, 9),
                },
            },
            "trainer": {
                "engine": "sim",
                "batch_groups": prm.batch_groups_per_rollout * n,
                "total_steps": 1_000_000,
                "sim_time_per_token_s": prm.trainer_s_per_token_x_n / n,
                "sim_weight_bytes": 4096,
                "batch_wait_s": 1.0,
            },
            "buffer": {
                "capacity": 1_000_000,
                "fsync": "never",
                "retry_after_s": 0.05,
                **({"max_staleness": prm.max_staleness} if queued else {}),
            },
            "manager": {
                "repack": {
                    "enabled": mode == "laminar",
                    "interval_s": prm.repack_interval_s,
                    "c_max": prm.c_max,
                    "candidates": prm.repack_candidates,
                    "split_sources": prm.repack_split,
                },
                "timeline_interval_s": float(os.environ.get("LCB_TIMELINE", 0)),
            },
            **episode_sections(prm, seed, n),
            "logging": {"level": "warning"},
        }
    )


def episode_sections(prm: BenchParams, seed: int, n: int) -> dict[str, Any]:
    """{"env": ...} (in-process environments), or with prm.agents {"agent": ...}: the same
    episodes from an agent through the endpoint."""
    env = env_section(prm, seed)
    if not prm.agents:
        return {"env": env}
    if prm.workload != "multiturn":
        raise ValueError("agents=true needs workload multiturn")
    agent = {
        "fn": "laminar.agents.sim:sim_tool_agent",
        "kwargs": {**env["kwargs"], "client_call": prm.agent_client_call},
        "workers": prm.agent_workers,
        "shared_workers": prm.agent_shared,
        # room for every episode a rollout holds (4B: running, waiting on tools, refilling)
        "concurrency": 4 * prm.bound_b * (-(-n // prm.agent_workers) if prm.agent_shared else 1),
        "max_calls": prm.tool_calls_max + 1,
        "episode_timeout_s": 600,
        "startup_timeout_s": prm.agent_startup_timeout_s,
    }
    return {"agent": agent}


class LoopProbe:
    """Event-loop lag (how late a 50 ms timer fires) and process CPU time, sampled with wall-clock
    timestamps so the figures cover exactly the measurement window (not the start-up imports)."""

    def __init__(self, period: float = 0.05):
        self.period = period
        self.lags: list[tuple[float, float]] = []
        self.cpu: list[tuple[float, float]] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.period)  # the probe itself: lateness of this timer is the lag
            now = time.time()
            self.lags.append((now, loop.time() - t - self.period))
            self.cpu.append((now, time.process_time()))

    def dump(self) -> dict[str, Any]:
        return {"lags": self.lags, "cpu": self.cpu}


def probe_summary(dump: dict[str, Any], t0: float, t1: float) -> dict[str, float]:
    """CPU share of one core and loop lag percentiles of a LoopProbe dump, within [t0, t1]."""
    xs = sorted(lag for t, lag in dump["lags"] if t0 <= t <= t1) or [0.0]
    cpu = [(t, c) for t, c in dump["cpu"] if t0 <= t <= t1]
    q = lambda p: round(1000 * xs[min(len(xs) - 1, int(p * len(xs)))], 2)  # noqa: E731
    frac = (cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0]) if len(cpu) >= 2 else float("nan")
    return {
        "cpu_frac": round(frac, 3),
        "lag_ms_p50": q(0.5),
        "lag_ms_p99": q(0.99),
        "lag_ms_max": round(1000 * xs[-1], 2),
    }


# ---- worker: N rollouts in one process ------------------------------------------------------

BREAKDOWN = ("full", "drain", "refill", "move", "loading", "idle")
"""Where a rollout's time goes (sampled every sample_s): decoding at the full bound B; decoding
below B while it drains before a refresh (a newer version is wanted: no new work at the old one),
while it waits for a repack move (an export or import of its trajectories runs), or otherwise
while it waits for work (refill: a credit comes back per finished group, prompts take a round
trip); loading weights (mode partial: the whole interrupt, abort + load + resubmission, with its
in-flight sequences held); idle (nothing to decode and no load running)."""


def rollout_state(node: Any, running: int, b: int) -> int:
    """Index in BREAKDOWN of a rollout's state now (its parts, read-only)."""
    if node.feeder.loading:
        return 4
    if running <= 0:
        return 5
    if running >= b:
        return 0
    if node.gate.lock.locked() or any(q.exporting for q in node.table.seqs.values()):
        return 3  # an import holds the gate's lock; an export marks what it takes
    if node.gate.behind():
        return 1
    return 2


def agent_workers_cpu_s(nodes: list[Any]) -> float | None:
    """CPU seconds (user + system, since their start) of the rollouts' agent worker processes
    alive now (None: no agents): the endpoint path's client side, which the worker's own probe
    does not see, so a run the agents made CPU-bound says so."""
    pids = {  # a shared pool (agent.shared_workers) is listed by every rollout
        pid
        for n in nodes
        if n.agents is not None and n.agents.pool is not None
        for pid in n.agents.pool.pids()
    }
    if not pids:
        return None
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(stat[11]) + int(stat[12])  # utime, stime (fields 14, 15)
    return round(total / tick, 2)


def kill_agent_workers(nodes: list[Any]) -> None:
    """SIGKILL the rollouts' agent worker processes (each its own process group), which os._exit
    would leave behind: a worker whose rollout is gone finishes its episodes elsewhere
    (laminar/agents/worker.py), here retrying dead endpoints for agent.reconnect_timeout_s,
    64 of them at once into the next run's start-up."""
    for n in nodes:
        pool = n.agents.pool if n.agents is not None else None
        for pid in pool.pids() if pool is not None else []:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


async def worker_main(cfg_path: Path, count: int, out: Path, sample_s: float) -> None:
    import importlib

    from laminar.config import load_config
    from laminar.transport.sockets import new_context
    from laminar.wiring.nodes import build_node

    cfg = load_config(cfg_path)
    ctx = new_context()  # one context (one I/O thread) for all N nodes, not N of them
    nodes = [build_node(cfg, "rollout", i, ctx=ctx) for i in range(count)]
    series: list[list[float]] = []
    per_rollout: list[list[float]] = []
    """With LCB_DETAIL=1: [t, running of rollout 0, 1, ...] per sample (where repack loses, per
    rollout)."""
    detail = bool(os.environ.get("LCB_DETAIL"))
    probe = LoopProbe()

    def on_term() -> None:
        from laminar.metrics import reduce_partials

        probe.stop()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        parts = reduce_partials([n.metrics.snapshot(reset=False) for n in nodes])
        counters: dict[str, int] = {}
        for n in nodes:
            for k, v in n.metrics.counters.items():
                counters[k] = counters.get(k, 0) + v
        load = parts.get("weight_load_s")
        doc = {
            "series": series,
            "probe": probe.dump(),
            "max_rss_mb": rss,
            "counters": counters,
            "partials": {
                k: {"mean": v.mean, "max": v.max, "count": v.count} for k, v in parts.items()
            },
            "per_rollout": per_rollout,
            "weight_load_s": {"mean": load.mean, "max": load.max, "count": load.count}
            if load
            else None,
            "agent_workers_cpu_s": agent_workers_cpu_s(nodes),
        }
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, out)
        kill_agent_workers(nodes)
        # the window is over and nothing here needs a graceful stop: exit at once (as a crash
        # would) instead of draining 128 rollouts for seconds
        os._exit(0)

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, on_term)
    # the relay reader hands out torch views: import torch now, in a thread, while the nodes start,
    # rather than on the event loop at the first weight load (seconds with every rollout frozen)
    importer = asyncio.ensure_future(asyncio.to_thread(importlib.import_module, "torch"))
    tasks = [asyncio.create_task(n.run()) for n in nodes]
    await importer
    probe.start()
    b = cfg.rollout.max_running
    while True:
        # t, tokens, busy, util, kv, ready, then the breakdown (BREAKDOWN: rollouts in each state,
        # then the util summed over the rollouts below B in drain, refill, move)
        row = [time.time(), 0.0, 0.0, 0.0, 0.0, 0.0] + [0.0] * (len(BREAKDOWN) + 3)
        for n in nodes:
            if n.engine is None or not n.ready.is_set():
                continue
            st = n.engine.stats()
            row[1] += st.tokens_generated
            row[2] += st.running > 0
            row[3] += min(st.running, b) / b
            row[4] += st.kv_use
            row[5] += 1
            k = rollout_state(n, st.running, b)
            row[6 + k] += 1
            if 1 <= k <= 3:  # below B: drain, refill, move
                row[6 + len(BREAKDOWN) + k - 1] += st.running / b
        series.append(row)
        if detail:
            per_rollout.append(
                [row[0]] + [n.engine.stats().running if n.engine is not None else -1 for n in nodes]
            )
        failed = [t for t in tasks if t.done()]
        if failed:  # a rollout died on its own: the run is void, say why
            raise RuntimeError(f"a rollout stopped during the run: {failed[0].exception()!r}")
        await asyncio.sleep(sample_s)  # the sampling timer


# ---- run: control plane in this process -------------------------------------------------------


async def run_main(
    mode: str, n: int, seed: int, prm: BenchParams, work: Path, done: Any = None
) -> dict[str, Any]:
    """One run; `done(fig)` is called with the figures before the control plane is stopped (the
    CLI writes them and exits there: after the window nothing needs a graceful stop)."""
    from laminar.config import write_resolved

    ipc_dir = Path(
        tempfile.mkdtemp(prefix="lcb-", dir="/tmp")
    )  # short: unix socket paths are limited
    worker: subprocess.Popen | None = None
    try:
        cfg = make_config(mode, n, seed, prm, work, ipc_dir)
        cfg_path = write_resolved(cfg)
        series_path = work / "worker.json"
        t_start = time.time()
        load0 = os.getloadavg()
        # the worker first: its imports overlap ours, and its nodes wait for the services to come up
        worker = subprocess.Popen(
            [
                sys.executable,
                os.environ.get("LCB_WORKER", __file__),
                "worker",
                "--config",
                str(cfg_path),
                "--count",
                str(n),
                "--out",
                str(series_path),
                "--sample-s",
                str(prm.sample_s),
            ],
            stderr=open(work / "worker.log", "w"),
        )

        def finish(fig: dict[str, Any]) -> None:
            fig.update(
                mode=mode,
                n=n,
                seed=seed,
                startup_s=round(fig.pop("t_ready") - t_start, 2),
                loadavg_1m={"start": load0[0], "end": os.getloadavg()[0]},
                params=asdict(prm),
            )
            if done is not None:
                shutil.rmtree(ipc_dir, ignore_errors=True)
                done(fig)

        fig = await _control(cfg, n, prm, worker, series_path, finish)
        return fig
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait()
        shutil.rmtree(ipc_dir, ignore_errors=True)


async def _control(
    cfg: Any, n: int, prm: BenchParams, worker: subprocess.Popen, series_path: Path, finish: Any
) -> dict[str, Any]:
    """Start the control plane, wait for the N rollouts, measure the window, stop the worker."""
    # (no torch import here: the trainer imports it in a thread while it starts)
    from laminar.cluster import LocalCluster

    roles = {r: c for r, c in cfg.cluster.roles.items() if r != "rollout"}
    async with LocalCluster(cfg, transport="ipc", roles=roles) as cluster:
        try:
            manager = cluster.node("manager-0")
            deadline = time.monotonic() + 180
            while len(manager._live("rollout")) < n:  # registration has no event of its own: poll
                cluster.check()
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{n} rollouts did not register (worker rc={worker.poll()}), "
                        f"see {series_path.parent}/worker.log"
                    )
                await asyncio.sleep(0.2)
            await _wait_ready(manager, cluster, n, prm, worker, series_path)
            t_ready = time.time()
            probe = LoopProbe()
            probe.start()
            await asyncio.sleep(prm.warmup_s)  # warm-up: the first batches are a synchronised start
            t0 = time.time()
            await asyncio.sleep(prm.window_s)  # the measurement window itself
            t1 = time.time()
            probe.stop()
            control = probe_summary(probe.dump(), t0, t1)
            control["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            cluster.check()
            manager_log = list(manager.repack_log)
            mgr_counters = dict(manager.metrics.counters)
            mgr_parts = manager.metrics.snapshot(reset=False)
            buf = cluster.node("buffer-0").stats()
        finally:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)  # it writes its series and exits at once
            try:
                await asyncio.get_running_loop().run_in_executor(None, worker.wait, 30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        w = json.loads(series_path.read_text())
        steps = [
            json.loads(x)
            for x in (Path(cfg.resolved_run_dir()) / "metrics.jsonl").read_text().splitlines()
        ]
        fig = figures(steps, w["series"], manager_log, t0, t1, n)
        fig.update(
            t_ready=t_ready,
            control=control,
            weight_load_s=w["weight_load_s"],
            rollout_counters=w["counters"],
            worker={**probe_summary(w["probe"], t0, t1), "max_rss_mb": w["max_rss_mb"]},
            agent_workers_cpu_s=w.get("agent_workers_cpu_s"),
            manager_counters=mgr_counters,
            rollout_partials=w.get("partials", {}),
            manager_partials={
                k: {"mean": v.mean, "max": v.max, "count": v.count} for k, v in mgr_parts.items()
            },
            buffer={
                "staleness_consumed": msgspec.to_builtins(buf.staleness_consumed),
                "counters": dict(buf.counters),
            },
        )
        finish(fig)
    return fig


async def _wait_ready(
    manager: Any, cluster: Any, n: int, prm: BenchParams, worker: subprocess.Popen, where: Path
) -> None:
    """Until every rollout serves (its heartbeats no longer say starting_engine: its engine is up
    and, with agents, its endpoint listens and its agent workers said hello): a rollout registers
    before that, and a window opened at registration would measure start-up (with 64 rollouts'
    agent workers importing their client, all of it)."""
    deadline = time.monotonic() + prm.ready_timeout_s
    while True:
        peers = manager._live("rollout")
        serving = [p for p in peers if p.status is not None and not p.status.state]
        if len(serving) >= n:
            return
        cluster.check()
        if worker.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"{len(serving)} of {n} rollouts serving after {prm.ready_timeout_s:g} s "
                f"(ready_timeout_s; worker rc={worker.poll()}), see {where.parent}/worker.log"
            )
        await asyncio.sleep(0.2)  # heartbeats carry the state: poll them


def figures(
    steps: list[dict],
    series: list[list[float]],
    repack_log: list[dict],
    t0: float,
    t1: float,
    n: int,
) -> dict[str, Any]:
    """The window's figures (see the module docstring)."""
    from laminar.modes import StalenessStats

    win = [s for s in steps if t0 <= s["time"] <= t1]
    before = [s for s in steps if s["time"] < t0]
    out: dict[str, Any] = {"steps_in_window": len(win), "window_s": round(t1 - t0, 3)}
    # throughput between update completions, over whole steps: from the last step before the
    # window to the last step in it, counting the tokens of the steps that ended in between.
    # With none before it (a barrier mode's first step outlasts the warm-up), the first step in
    # the window began before it, for an unknown time: it is only the starting point (timing
    # it from the window's start credited a whole step's tokens to part of its time, sync up to
    # a third too fast in an 18 s window: bench/README.md, issue 44). A lone step in the window
    # with none before it is still timed from the window's start (a rate, if a rough one).
    whole = bool(before) or len(win) < 2
    start = before[-1]["time"] if before else (t0 if whole else win[0]["time"])
    counted = win if whole else win[1:]
    if counted:
        out["train_tok_s"] = sum(s["tokens_total"] for s in counted) / max(
            1e-9, win[-1]["time"] - start
        )
        out["iteration_s"] = (win[-1]["time"] - start) / len(counted)
    else:
        out["train_tok_s"], out["iteration_s"] = 0.0, float("nan")
    push = sorted(s["push_s"] for s in win if s.get("push_s") is not None)
    out["trainer_push_s_median"] = push[len(push) // 2] if push else float("nan")
    busy = sum(
        min(s["time"], t1) - max(s["time"] - s["compute_s"], t0)
        for s in steps
        if s["time"] - s["compute_s"] < t1 and s["time"] > t0
    )
    out["trainer_idle_frac"] = max(0.0, 1 - busy / (t1 - t0))
    st = StalenessStats()
    for s in win:
        for k, v in s.items():
            if k.startswith("staleness_hist/"):
                st.add(int(k.split("/")[1]), int(v))
    out["staleness"] = st.summary()
    rows = [r for r in series if t0 <= r[0] <= t1 and r[5] == n]
    if len(rows) >= 2:
        dt = rows[-1][0] - rows[0][0]
        out["gen_tok_s"] = (rows[-1][1] - rows[0][1]) / dt
        out["rollout_idle_frac"] = 1 - sum(r[2] for r in rows) / (n * len(rows))
        out["decode_util"] = sum(r[3] for r in rows) / (n * len(rows))
        out["kv_use"] = sum(r[4] for r in rows) / (n * len(rows))
        out["samples"] = len(rows)
    if len(rows) >= 2 and len(rows[0]) >= 6 + len(BREAKDOWN) + 3:
        out["breakdown"] = breakdown(rows, n)
    rp = [r for r in repack_log if t0 <= r["t"] <= t1]
    out["repack"] = {
        "rounds_with_moves": len(rp),
        "moves": sum(r["moves"] for r in rp),
        "trajectories": sum(r["trajectories"] for r in rp),
        "failed": sum(r["failed"] for r in rp),
        "overhead_s_mean": round(sum(r["overhead_s"] for r in rp) / len(rp), 4) if rp else 0.0,
    }
    return out


def breakdown(rows: list[list[float]], n: int) -> dict[str, Any]:
    """Shares of rollout-time in each BREAKDOWN state (they sum to 1), and the decode_util
    each state contributes (they sum to decode_util; the lost share of a state is its time
    minus its util)."""
    total = n * len(rows)
    k = len(BREAKDOWN)
    time_frac = {s: sum(r[6 + i] for r in rows) / total for i, s in enumerate(BREAKDOWN)}
    util = {"full": time_frac["full"], "loading": 0.0, "idle": 0.0}
    for j, s in enumerate(("drain", "refill", "move")):
        util[s] = sum(r[6 + k + j] for r in rows) / total
    return {
        "time": {s: round(v, 4) for s, v in time_frac.items()},
        "util": {s: round(util[s], 4) for s in BREAKDOWN},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--config", type=Path, required=True)
    w.add_argument("--count", type=int, required=True)
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--sample-s", type=float, default=0.1)
    pr = sub.add_parser(
        "prompts", help="write the bench's prompt file (for configs/emulated_*.yaml)"
    )
    pr.add_argument("path", type=Path)
    pr.add_argument("--rows", type=int, default=200_000)
    r = sub.add_parser("run")
    r.add_argument("--mode", choices=MODES, required=True)
    r.add_argument("--n", type=int, required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--params", default="{}", help="JSON overrides of BenchParams")
    r.add_argument(
        "--work", type=Path, default=None, help="run directory (default: a temp dir, removed)"
    )
    r.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    if args.cmd == "prompts":
        print(write_prompts(args.path, args.rows, BenchParams().prompt_tokens))
        return 0
    from laminar.launch.tuning import use_uvloop
    from laminar.logs import configure_logging

    configure_logging("warning", True)
    use_uvloop()
    if args.cmd == "worker":
        asyncio.run(worker_main(args.config, args.count, args.out, args.sample_s))
        return 0
    prm = BenchParams.from_dict(json.loads(args.params))
    remove_segments()  # left by earlier runs that were killed
    work = args.work or Path(tempfile.mkdtemp(prefix="lam-cluster-"))
    work.mkdir(parents=True, exist_ok=True)

    def done(fig: dict[str, Any]) -> None:
        args.out.write_text(json.dumps(fig, indent=1))
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
        sys.stdout.flush()
        remove_segments(os.getpid())  # the relay's own cleanup is skipped by os._exit
        os._exit(0)  # the window is measured: skip the graceful stop of the control plane

    try:
        asyncio.run(run_main(args.mode, args.n, args.seed, prm, work, done))
    finally:
        remove_segments(os.getpid())
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 1  # only reached when the run failed before its figures


if __name__ == "__main__":
    raise SystemExit(main())
