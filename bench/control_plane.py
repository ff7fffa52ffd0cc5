"""Control-plane headroom: one buffer and one manager under the message rates of a 1024-GPU cluster.

    server processes (bench/cp_node.py): ManagerNode, BufferNode (real, ipc), each with a lag probe
        ▲ PartialBatch (one-way) · Trajectory (acked) · PromptRequest · BatchRequest/Commit · beats
        │                                                   ▲ Heartbeat(NodeStatus) = status pushes
    driver (this process, `run`): R synthetic rollouts ─────┘ + one synthetic trainer
    ramp: offered rate = x * (1024-GPU rate), x = 0.25 ... ; each step `step_s` long

Rates (derivation, from the committed simulator results bench/results/simulate.json, every row at
1024 GPUs in laminar mode; the heaviest row sets the target, the others are listed in the JSON):
    tokens/s        gen_tok_s (median over seeds)
    trajectories/s  staleness_finished.count / (counts.steps_measured * iteration_s)
    entries/s       tokens/s / entry_tokens, + trajectories/s x tool calls a trajectory (multi-turn
                    rows: each call's turn end is an entry of its own). A rollout marks a sequence
                    once it has rollout.partial_chunk_tokens (32) unsent tokens
                    (laminar/rollout/node.py) and each flush window sends every marked sequence's
                    unsent tokens as one entry (laminar/rollout/deliver.py), so entry_tokens =
                    what a sequence decodes in a window (its decode speed, bench/simscale.py's
                    step at the row's model: 100 tok/s at 7B TP1, 100 tokens a 1 s window), or 32
                    and more for a sequence slower than 32 a window (cp_workload.entry_tokens).
                    Before 2026-12-07 the bench sent 32 tokens an entry at every speed
                    (CP_ENTRY_TOKENS=32 runs that model): for the 7B row, 1.5x the entries its
                    rollouts send at a 0.5 s window and 3x at 1 s
    batches/s       rollouts / rollout.partial_flush_s (1 s): a rollout sends at most one
                    PartialBatch per flush window (laminar/rollout/deliver.py), and at these rates
                    every window has entries (entries/batch = entries/s * flush_s / rollouts ~ 47
                    for 7B_multiturn, the sequences each rollout decodes), so this bound is the rate
    heartbeats/s    rollouts / transport.heartbeat_interval_s (0.5 s), to the buffer and to the
                    manager
    status pushes/s rollouts / rollout.status_push_min_s (0.05 s): the upper bound; with thousands
                    of sequences finishing per second every rollout's status changes every push
                    window
Offered at x: batches/s, trajectories/s and status pushes/s times x, with the entries per batch of
1x (x as x-times the rollouts: the buffer's message rate grows with x, the conservative reading).
Each synthetic rollout keeps in-flight samples; an entry moves one sample on by 32 tokens (the
first entry of a sample carries its header), a sample finishes after tokens/trajectory (entries/s
/ trajectories/s entries) with its Trajectory (acked), so both rates follow x. The samples of the
first fill start part-way (their first entry carries the tokens so far), so trajectories finish
at the steady rate from the start.

The servers are set up as `laminar node` sets up its process (uvloop, cluster.gc_threshold). The
driver stands in for 256 rollouts and a trainer that run on other machines; on this box it shares
the cores with the nodes under test, so it runs at a lower CPU priority (`--driver-nice`, default
10; 0 = the same): when the nodes need a core they get it first, and a driver that cannot then
offer the rate fails the step on delivery (below), never passes it.

A step is sustainable when the driver delivered >= 95 % of the offered batches and trajectories,
the trajectory ack p99 is under `--ack-bound-s`, and the event-loop lag p99 of both nodes (a probe
task in each node's loop: sleep 10 ms, record the overshoot) is under `--lag-bound-ms`.
headroom_vs_1024gpu_rate = highest sustainable x. If the driver itself cannot offer a rate (it
shares the machine's cores), the step says `driver_bound` and the figure is a lower bound.

CPU: each step also records every node's CPU-seconds per second (/proc), and the run its idle
CPU (heartbeats, prompts, trainer only). summary.cpu_core_s_per_1x_by_node is the CPU above idle
that 1x costs each node, and summary.one_core_per_node_holds_x_estimate the x at which the busiest
node would fill one core: a direction where the machine is shared and lag says little, never the
headline figure.

Shards: when one buffer holds less than 2x, the bench runs the ramp again (from 1x) with twice
the buffer processes, up to --max-shards, keyed by rollout (synthetic rollout i talks to shard
i % shards; each shard serves its own prompts, takes its own trajectories, has its own journal
and its own synthetic trainer). summary.buffer_shards says which pass the figure is from, and
summary.headroom_by_shards lists every pass. Shards add processes, not cores: on a machine with
fewer free cores than processes a sharded pass cannot show more than one buffer does. (The
system itself runs one buffer today; the sharded figure is what a buffer role keyed by rollout
would hold.)

Cost passes (the pass/fail figures, bench/README.md "Cost, not a race"): each node's CPU-seconds
per second at 1x above its idle (an idle phase before the kinds; one after them is recorded as a
check on drift, idle_cpu_per_s_after), per message kind (status, trajectory, chunk: one pass
with one buffer; the whole workload, `all`, in a pass of its own, since it leaves samples standing
part-way whose feeders then ask for prompts the buffer refuses), per buffer shard at
K = --cost-shards, and the manager's CPU per status push at other numbers of rollouts
(--status-rollouts, the same push rate). The shards are measured in passes of their own (the
trajectory and chunk phases), twice:
at 1x in all (summary.shard_cpu_us_per_trajectory_by_k: a shard of K takes 1/K of the messages)
and at one rate per shard (..._same_shard_rate: K shards at K / max(K) of 1x, so every shard takes
1/max(K) of 1x; the max-K pass is the same pass), which separates what sharding costs from what a
lower load per shard costs. They run --shard-rounds rounds (default 3), every K in each round, so
a stretch where the box charged more falls on each K alike: each K's figure is the median of its
rounds (..._rounds lists the rounds' means per K), and the spread is taken between the medians.
Each round's K = 1 pass runs the trajectory and chunk phases as the kinds' pass does, so each
node's per-kind figure (and the sum, the pass/fail figure) is the median over the passes with one
buffer at 1x that ran that kind (summary.cpu_core_s_per_1x_by_kind_passes lists them;
..._by_node_first_pass is the kinds' pass alone), and the idle beside the estimate the median of
those passes' idles.
A process's CPU is its threads' run time from /proc/PID/task/*/schedstat (ns), not the 10 ms
ticks of /proc/PID/stat: a shard of 4 idles at ~0.02 core-s/s, so over a 10 s phase one tick
was ~5% of the idle subtracted. Each phase also records what one wake-up of each node's reader
served (`wakeups`: messages/s, wake-ups/s, messages per wake-up, from the servers' PolledSocket
counters, and the collector's runs per generation per second), and
summary.shard_messages_per_wakeup_by_k lists it per shard. CP_FSYNC=never|batch|always sets the
buffers' buffer.fsync (default batch); CP_FLUSH_S the rollouts' partial flush window (default
1 s, rollout.partial_flush_s's default; 0.5 s was the default before 2026-12-07: twice the batches
and, at 7B, twice the entries of half the tokens); CP_ENTRY_TOKENS the tokens per entry (default:
from the row's decode speed; 32 = the model before 2026-12-07);
CP_GATHER_S the servers' gathering pause (laminar/transport/polled.py GATHER_S, 2 ms);
CP_LOSS_MASK=1 sends every entry and trajectory with a loss mask, as multi-turn rollouts do (the
7B multi-turn row the bench is sized by; default: plain entries, the stored figures).

summary.box_cpu_probe_ms is how fast the box ran a fixed piece of Python (benchinfo.cpu_probe_ms)
at the start, before each cost pass and at the end: the same code every run, so two runs whose
node figures differ by as much as their probes do measured the box, not a change.

    .venv/bin/python bench/control_plane.py --quick --out bench/results/control_plane_quick.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchinfo, also when loaded as a module

from benchinfo import cpu_probe_ms, git  # noqa: E402
from cp_cluster import ROOT, Cluster, cpu_seconds  # noqa: E402
from cp_figures import COST_PHASES, cost_summary, shard_figures  # noqa: E402
from cp_node import read_handler_cpu, read_lag, read_wakeups  # noqa: E402
from cp_workload import (  # noqa: E402
    CHUNK_TOKENS,
    FLUSH_S,
    HEARTBEAT_S,
    STATUS_PUSH_MIN_S,
    workload_rates,
)


async def run_cost_pass(
    args: argparse.Namespace,
    rates: dict[str, float],
    shards: int,
    kinds: list[str] | None = None,
    x: float = 1.0,
    drift_check: bool = True,
) -> dict[str, Any]:
    """CPU of each node at x (1: the 1024-GPU rate), whole and kind by kind (COST_PHASES), above
    its idle: what the code costs, whatever else the box runs (CPU-seconds of each process, not a
    race for the cores). The figures are normalized to 1x by what each phase delivered.
    drift_check: an idle phase after the kinds too (recorded, not subtracted)."""
    probe = cpu_probe_ms()  # the box, before the nodes start
    phases: dict[str, dict[str, Any]] = {}
    # the driver at the nodes' priority: here it must offer the rate, not yield the cores (the
    # figures are each node's own CPU-seconds; raising a niceness cannot be undone, so these
    # passes run before the ramp)
    async with Cluster(args, rates, shards, 0, pin=args.pin) as cl:
        drv, procs = cl.drv, cl.procs
        warm = time.monotonic() + args.warmup_s
        await asyncio.gather(drv.stream(x, warm, first_fill=True), drv.pushes(x, warm))
        # idle before the kinds (subtracted) and after them (a check on drift)
        ends = ("idle_end",) if drift_check else ()
        for kind in ("idle", *(kinds or args.cost_phases), *ends):
            cl.check()
            await drv.drain(10.0)  # the last phase's trajectories acked: none spills into this one
            before = dict(drv.sent)
            msgs0 = drv.delivery_messages()
            cpu0 = {name: cpu_seconds(p.pid) for name, p in procs.items()}
            drv0, t0 = time.process_time(), time.time()
            until = time.monotonic() + args.cost_s
            if kind == "all":
                await asyncio.gather(drv.stream(x, until), drv.pushes(x, until))
            elif kind == "status":
                await drv.pushes(x, until)
            elif kind == "trajectory":
                await drv.trajectories(x, until)
            elif kind.startswith("idle"):  # the background alone: heartbeats, prompts, trainer
                await asyncio.sleep(args.cost_s)
            else:
                await drv.stream(x, until, finish=False)
            await asyncio.sleep(1.0)  # acks of the phase's last trajectories (a timer, bounded)
            t1 = time.time()
            cpu = {
                name: round((cpu_seconds(p.pid) - cpu0[name]) / (t1 - t0), 4)
                for name, p in procs.items()
            }
            cpu["driver"] = round((time.process_time() - drv0) / (t1 - t0), 3)
            got = {k: round((drv.sent[k] - before[k]) / args.cost_s, 1) for k in drv.sent}
            got["delivery_messages"] = round((drv.delivery_messages() - msgs0) / args.cost_s, 1)
            phases[kind] = {
                "cpu_per_s": cpu,
                "achieved": got,
                "handler_cpu_per_s": {
                    name: read_handler_cpu(cl.lag[name], t0, t1) for name in procs
                },
                "wakeups": {name: read_wakeups(cl.lag[name], t0, t1) for name in procs},
            }
            print(
                f"cost shards={shards} x={x:.2f} {kind:10s} cpu/s "
                + " ".join(f"{k} {v:.3f}" for k, v in cpu.items())
                + f"  batches/s {got['batches']:.0f} entries/s {got['chunks']:.0f} "
                f"traj acked/s {got['acked']:.1f} pushes/s {got['pushes']:.0f}  msgs/wake-up "
                + " ".join(
                    f"{k} {w['messages_per_wakeup']}"
                    for k, w in phases[kind]["wakeups"].items()
                    if w is not None
                ),
                flush=True,
            )
    idle_phases = {k: phases.pop(k) for k in ("idle", "idle_end") if k in phases}
    idle_start = idle_phases["idle"]["cpu_per_s"]
    idle_end = idle_phases.get("idle_end", {}).get("cpu_per_s", {})
    return {
        "buffer_shards": shards,
        "x": x,
        "rollouts": int(rates["rollouts"]),
        "cpu_probe_ms": probe,
        # --pin: the buffers' CPU and the manager's and the driver's
        "pinned": None
        if cl.pin is None
        else {"buffers": sorted(cl.pin[0]), "others": sorted(cl.pin[1])},
        # idle: the idle phase (after the first fill, as long as a kind's phase); the 3 s at start
        # (no state yet, the connections just made) beside it
        "idle_cpu_per_s": {k: v for k, v in idle_start.items() if k != "driver"},
        # the same after the kinds, a check on drift (not subtracted: after a phase that finished
        # samples the synthetic rollouts refill their queues, so it is not always idle)
        "idle_cpu_per_s_after": {k: v for k, v in idle_end.items() if k != "driver"},
        "idle_phases": idle_phases,
        "idle_cpu_per_s_at_start": cl.idle_cpu,
        "phases": phases,
        "server_logs": cl.server_logs,
    }


def _nice_of(pid: int) -> int | None:
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        return None


async def run_pass(
    args: argparse.Namespace, rates: dict[str, float], shards: int, ramp: list[float]
) -> dict[str, Any]:
    """One ramp against one manager and `shards` buffer processes (rollout i -> shard i %
    shards)."""
    steps: list[dict[str, Any]] = []
    async with Cluster(args, rates, shards, args.driver_nice) as cl:
        procs, lag, drv, servers = cl.procs, cl.lag, cl.drv, cl.servers
        idle_cpu = cl.idle_cpu
        # warm-up (not measured): connections, first prompts, the journal's first writes
        await asyncio.gather(
            drv.stream(ramp[0], time.monotonic() + args.warmup_s, first_fill=True),
            drv.pushes(ramp[0], time.monotonic() + args.warmup_s),
        )
        fails = 0
        for x in ramp:
            cl.check()
            before = dict(drv.sent)
            drv.ack_lat = []
            cpu0 = {name: cpu_seconds(p.pid) for name, p in procs.items()}
            drv0 = time.process_time()
            t0 = time.time()
            until = time.monotonic() + args.step_s
            await asyncio.gather(drv.stream(x, until), drv.pushes(x, until))
            await asyncio.sleep(1.0)  # acks of the step's last trajectories (a timer, bounded)
            t1 = time.time()
            # CPU-seconds per second of each node: on a loaded machine the lag says little, this
            # says how much of one core the offered rate costs (1 / it = the rate one core would
            # hold)
            cpu = {
                name: round((cpu_seconds(p.pid) - cpu0[name]) / (t1 - t0), 3)
                for name, p in procs.items()
            }
            # the driver shares the same cores
            cpu["driver"] = round((time.process_time() - drv0) / (t1 - t0), 3)
            dt = args.step_s
            got = {k: (drv.sent[k] - before[k]) / dt for k in drv.sent}
            acks = sorted(drv.ack_lat)
            ack_p99 = acks[int(len(acks) * 0.99)] if acks else float("nan")
            offered = {
                "batches_s": x * rates["batches_s"],
                "chunks_s": x * rates["batches_s"] * drv.entries_per_batch,
                "trajectories_s": x * rates["trajectories_s"],
                "status_pushes_s": x * rates["status_pushes_s"],
            }
            row = {
                "x": x,
                "buffer_shards": shards,
                "offered": offered,
                "nice": {
                    "driver": os.getpriority(os.PRIO_PROCESS, 0),
                    **{n: _nice_of(p.pid) for n, p in procs.items()},
                },
                "achieved": {k: round(v, 1) for k, v in got.items()},
                "ack_p99_s": round(ack_p99, 4),
                "lag": {r: read_lag(p, t0, t1) for r, p in lag.items()},
                "cpu_per_s": cpu,
            }
            delivered = (
                got["batches"] >= 0.95 * offered["batches_s"]
                and got["acked"] >= 0.95 * offered["trajectories_s"]
            )
            lag_ok = all(row["lag"][r]["p99_ms"] < args.lag_bound_ms for r in lag)
            row["driver_bound"] = got["batches"] < 0.95 * offered["batches_s"] and lag_ok
            row["ok"] = bool(delivered and lag_ok and ack_p99 < args.ack_bound_s)
            steps.append(row)
            buf_lag = max(
                row["lag"][name]["p99_ms"] for name, role, _ in servers if role == "buffer"
            )
            cpu_s = " ".join(f"{k} {v:.2f}" for k, v in cpu.items())
            print(
                f"shards={shards} x={x:5.2f} "
                f"batches/s {got['batches']:7.0f}/{offered['batches_s']:7.0f} "
                f"entries/s {got['chunks']:7.0f}  "
                f"traj acked/s {got['acked']:7.1f}/{offered['trajectories_s']:7.1f}  "
                f"pushes/s {got['pushes']:6.0f}  "
                f"ack p99 {ack_p99 * 1e3:7.1f} ms  lag p99 buffer {buf_lag:7.1f} ms manager "
                f"{row['lag']['manager']['p99_ms']:7.1f} ms  cpu/s {cpu_s}  "
                f"{'ok' if row['ok'] else 'FAIL'}"
                f"{' (driver-bound)' if row['driver_bound'] else ''}",
                flush=True,
            )
            fails = 0 if row["ok"] else fails + 1
            if fails >= 2:
                break
    server_logs = cl.server_logs
    best = max((s["x"] for s in steps if s["ok"]), default=0.0)
    return {
        "buffer_shards": shards,
        "best": best,
        "steps": steps,
        "server_logs": server_logs,
        "idle_cpu_per_s": idle_cpu,
        "entries_per_batch": drv.entries_per_batch,
        "chunks_per_trajectory": drv.chunks_per_traj,
        "entry_tokens": drv.entry_tokens,
        "deliver_window_s": round(max((ob.window_s() for ob in drv.outboxes), default=0.0), 3),
        "trajectories_per_delivery": round(
            sum(ob.stats["put"] for ob in drv.outboxes)
            / max(1, sum(ob.stats["messages"] for ob in drv.outboxes)),
            2,
        ),
    }


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """One buffer first; while it holds less than 2x, again with twice the shards (up to
    --max-shards), from 1x up: the figure is the best pass's (summary says how many shards)."""
    from laminar.logs import configure_logging

    configure_logging("warning")
    all_rates = workload_rates(ROOT / "bench/results/simulate.json")
    target_name = max(all_rates, key=lambda k: all_rates[k]["chunks_s"])
    rates = all_rates[target_name]
    # the kinds, then the whole workload in a pass of its own: after it the synthetic rollouts'
    # samples stand still part-way, their groups stay open, and their feeders ask for prompts
    # the buffer refuses (rollout_full) every retry_after_s, ~600 requests a second more, which
    # a kind's phase after it would count as its own
    kinds = [k for k in args.cost_phases if k != "all"]
    # the kinds with one buffer: the per-node and per-kind figures
    cost_passes = [await run_cost_pass(args, rates, 1, kinds)] if kinds else []
    if "all" in args.cost_phases:
        cost_passes.append(await run_cost_pass(args, rates, 1, ["all"]))
    # the shards, in passes of their own (the trajectory and chunk phases: a pass's earlier
    # phases leave state behind), --shard-rounds rounds of every K interleaved, so a stretch where
    # the box charged more falls on every K alike and the medians leave it out. Each round at 1x
    # in all, then at one rate per shard: K shards at K/most of 1x, so each shard takes the same
    # messages a second (the max-K pass of the round is that one). At 1x in all, a shard of K
    # takes 1/K of them and pays more per message (fewer gather per wake-up, the journal's timed
    # fsyncs cover fewer records): that is the load, not the sharding, and it shows with one
    # buffer at a lower rate too
    most = max(args.cost_shards)
    shard_kinds = ["trajectory", "chunk"]
    whole: list[dict[str, Any]] = []
    same_rate: list[dict[str, Any]] = []
    if len(args.cost_shards) > 1 and all(k in kinds for k in shard_kinds):
        for r in range(args.shard_rounds):
            at_most = None
            for k in args.cost_shards:
                p = await run_cost_pass(args, rates, k, shard_kinds, 1.0, drift_check=False)
                p["shard_round"] = r
                whole.append(p)
                at_most = p if k == most else at_most
            for k in args.cost_shards:
                if k == most and at_most is not None:
                    same_rate.append(at_most)
                    continue
                p = await run_cost_pass(args, rates, k, shard_kinds, k / most, drift_check=False)
                same_rate.append({**p, "shard_round": r, "same_shard_rate": True})
    else:  # one K: the kinds' pass
        whole = [p for p in cost_passes if p["buffer_shards"] in args.cost_shards]
    cost_passes += [p for p in [*whole, *same_rate] if not any(p is q for q in cost_passes)]
    # the per-node and per-kind figures: each kind the median over the passes with one buffer
    # at 1x that ran it (the kinds' pass and each round's K = 1 pass)
    cost_sm = cost_summary(cost_passes, rates)
    cost_sm.update(shard_figures(whole, rates))
    cost_sm.update({f"{k}_same_shard_rate": v for k, v in shard_figures(same_rate, rates).items()})
    cost_sm["same_shard_rate_x"] = round(1 / most, 4)
    cost_sm["shard_rounds"] = args.shard_rounds
    # the manager's cost per status push at other numbers of rollouts, the same push rate: flat
    # when nothing per push scans the rollouts (their heartbeats are in each pass's idle)
    status_passes = [
        await run_cost_pass(args, {**rates, "rollouts": r}, 1, ["status"])
        for r in args.status_rollouts
        if r != int(rates["rollouts"])
    ]
    by_r = {
        str(p["rollouts"]): cost_summary([p], rates).get("manager_us_per_status")
        for p in status_passes
    }
    by_r[str(int(rates["rollouts"]))] = cost_sm.get("manager_us_per_status")
    cost_sm["manager_us_per_status_by_rollouts"] = dict(
        sorted(by_r.items(), key=lambda kv: int(kv[0]))
    )
    cost_passes += status_passes
    if args.no_ramp:
        return {
            "bench": "control_plane",
            "config": {
                "quick": args.quick,
                "cost_s": args.cost_s,
                "cost_shards": args.cost_shards,
                "shard_rounds": args.shard_rounds,
                "target_workload": target_name,
                "pin": args.pin,
                "chunk_tokens": CHUNK_TOKENS,
                "partial_flush_s": FLUSH_S,
            },
            "git_commit": git("rev-parse", "HEAD"),
            "rates_1024gpu": all_rates,
            "cost_passes": cost_passes,
            "summary": cost_sm,
        }
    passes = [await run_pass(args, rates, args.buffer_shards, args.ramp)]
    while passes[-1]["best"] < 2 and passes[-1]["buffer_shards"] * 2 <= args.max_shards:
        ramp = [x for x in args.ramp if x >= 1.0] or [1.0]
        passes.append(await run_pass(args, rates, passes[-1]["buffer_shards"] * 2, ramp))
    # the headline is the best pass (fewest shards on a tie): on a machine with fewer cores than
    # processes, more shards can hold less than one
    last = max(passes, key=lambda p: (p["best"], -p["buffer_shards"]))
    best = last["best"]
    # CPU per 1x of offered load, per node, from the most loaded step of the first pass, above the
    # node's idle CPU (heartbeats, prompts, trainer): the load of a buffer as its batch rate, of the
    # manager as its push rate (achieved / the 1x rate). x_one_core = (1 - idle) / per-1x: the rate
    # at which the busiest node would fill one core. A direction on a loaded machine, where lag and
    # acks say little; not the headroom figure.
    first = passes[0]
    cost: dict[str, tuple[float, float]] = {}
    for st in first["steps"]:
        for name, c in st["cpu_per_s"].items():
            if name not in first["idle_cpu_per_s"]:
                continue  # the driver: what it costs is not the control plane's
            got = (
                st["achieved"]["pushes"] / rates["status_pushes_s"]
                if name == "manager"
                else (st["achieved"]["batches"] / rates["batches_s"] / first["buffer_shards"])
            )
            if got > 0 and (name not in cost or got > cost[name][1]):
                cost[name] = (max(0.0, c - first["idle_cpu_per_s"][name]) / got, got)
    cpu_per_1x = {k: round(v[0], 3) for k, v in cost.items()}
    x_one_core = {
        k: round((1 - first["idle_cpu_per_s"][k]) / v, 2) for k, v in cpu_per_1x.items() if v > 0
    }
    one = next((p["best"] for p in passes if p["buffer_shards"] == 1), None)
    return {
        "bench": "control_plane",
        "config": {
            "quick": args.quick,
            "ramp": args.ramp,
            "step_s": args.step_s,
            "lag_bound_ms": args.lag_bound_ms,
            "ack_bound_s": args.ack_bound_s,
            "chunk_tokens": CHUNK_TOKENS,
            "entry_tokens": last["entry_tokens"],
            "partial_flush_s": FLUSH_S,
            "entries_per_batch": last["entries_per_batch"],
            "heartbeat_s": HEARTBEAT_S,
            "status_push_min_s": STATUS_PUSH_MIN_S,
            "target_workload": target_name,
            "chunks_per_trajectory": last["chunks_per_trajectory"],
            "deliver_window_s": last["deliver_window_s"],
            "trajectories_per_delivery": last["trajectories_per_delivery"],
            "buffer_shards": args.buffer_shards,
            "max_shards": args.max_shards,
            "driver_nice": args.driver_nice,
            "cost_s": args.cost_s,
            "cost_shards": args.cost_shards,
            "shard_rounds": args.shard_rounds,
            "status_rollouts": args.status_rollouts,
            "cost_phases": args.cost_phases,
            "pin": args.pin,
        },
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "git_commit": git("rev-parse", "HEAD"),
        "rates_1024gpu": all_rates,
        "cost_passes": cost_passes,
        "passes": [{k: v for k, v in p.items() if k != "steps"} for p in passes],
        "steps": [s for p in passes for s in p["steps"]],
        "summary": {
            # the pass/fail figures: what the code costs (cost passes, CPU-seconds per process)
            **cost_sm,
            # context: the ramp on this box (the nodes and the driver race for its cores)
            "headroom_vs_1024gpu_rate": best,
            "buffer_shards": last["buffer_shards"],
            "headroom_by_shards": {str(p["buffer_shards"]): p["best"] for p in passes},
            "target_workload": target_name,
            "highest_sustainable_batches_s": best * rates["batches_s"],
            "highest_sustainable_chunks_s": best * rates["batches_s"] * last["entries_per_batch"],
            "highest_sustainable_trajectories_s": best * rates["trajectories_s"],
            "highest_sustainable_status_pushes_s": best * rates["status_pushes_s"],
            "driver_bound_steps": [s["x"] for s in last["steps"] if s["driver_bound"]],
            "ramp_idle_cpu_per_s_by_node": first["idle_cpu_per_s"],
            "ramp_cpu_core_s_per_1x_by_node": cpu_per_1x,
            "ramp_one_core_per_node_holds_x_estimate": min(x_one_core.values())
            if x_one_core
            else None,
            "one_buffer_holds_2x": None if one is None else one >= 2,
            # the same sustained token rate against each 1024-GPU workload's own rate
            "headroom_by_workload": {
                k: round(best * rates["chunks_s"] / v["chunks_s"], 3) for k, v in all_rates.items()
            },
        },
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short steps and phases")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/control_plane.json")
    ap.add_argument("--ramp", type=float, nargs="+", default=None)
    ap.add_argument("--step-s", type=float, default=None)
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument(
        "--driver-nice",
        type=int,
        default=10,
        help="the driver's niceness above the nodes' (0: the same priority)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (node logs)")
    ap.add_argument("--lag-bound-ms", type=float, default=100.0)
    ap.add_argument("--ack-bound-s", type=float, default=1.0)
    ap.add_argument(
        "--buffer-shards", type=int, default=1, help="buffer processes of the first pass"
    )
    ap.add_argument(
        "--max-shards",
        type=int,
        default=4,
        help="while a pass holds < 2x, run again with twice the shards, up to this (1: never)",
    )
    ap.add_argument(
        "--cost-s", type=float, default=None, help="seconds of each cost phase (quick: 10)"
    )
    ap.add_argument(
        "--cost-shards",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        help="a cost pass with each number of buffer shards (the first 1: the headline)",
    )
    ap.add_argument(
        "--shard-rounds",
        type=int,
        default=3,
        help="rounds of the shard passes (every K at 1x, then at one rate per shard), "
        "interleaved; the figures are the medians",
    )
    ap.add_argument(
        "--cost-phases", nargs="+", default=list(COST_PHASES), choices=list(COST_PHASES)
    )
    ap.add_argument(
        "--status-rollouts",
        type=int,
        nargs="*",
        default=[128, 512],
        help="a status-only cost pass with each number of synthetic rollouts (same push rate)",
    )
    ap.add_argument("--no-ramp", action="store_true", help="the cost passes only")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="cost passes with the buffers on a CPU of their own and the manager and the driver on "
        "the others (the ramp is never pinned)",
    )
    args = ap.parse_args(argv)
    args.cost_s = args.cost_s or (10.0 if args.quick else 30.0)
    args.ramp = args.ramp or [0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 3.0]
    args.step_s = args.step_s or (15.0 if args.quick else 60.0)
    start = cpu_probe_ms()
    res = asyncio.run(run_bench(args))
    res["summary"]["box_cpu_probe_ms"] = {
        "start": start,
        "cost_passes": [p["cpu_probe_ms"] for p in res["cost_passes"]],
        "end": cpu_probe_ms(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    sm = res["summary"]
    print(
        f"cpu core-s/s per 1x above idle {sm['cpu_core_s_per_1x_by_node']}; one core per node "
        f"holds ~{sm['one_core_per_node_holds_x_estimate']}x; per kind "
        f"{sm['cpu_core_s_per_1x_by_kind']}; per shard us/trajectory by K "
        f"{sm['shard_cpu_us_per_trajectory_by_k']} "
        f"(spread {sm['shard_cpu_per_trajectory_spread']}), at {sm['same_shard_rate_x']}x a "
        f"shard {sm['shard_cpu_us_per_trajectory_by_k_same_shard_rate']} (spread "
        f"{sm['shard_cpu_per_trajectory_spread_same_shard_rate']}); manager us per status push by "
        f"rollouts {sm['manager_us_per_status_by_rollouts']}; the box's CPU probe (ms) "
        f"{sm['box_cpu_probe_ms']}"
    )
    if args.no_ramp:
        print(f"-> {args.out}")
        return 0
    print(
        f"headroom_vs_1024gpu_rate = {sm['headroom_vs_1024gpu_rate']} ({sm['target_workload']}, "
        f"{sm['buffer_shards']} buffer shard(s))"
        f" -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
