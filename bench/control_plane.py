"""Control-plane headroom: one buffer and one manager under the message rates of a 1024-GPU cluster.

    server processes (`serve ROLE`):  ManagerNode, BufferNode (real nodes, ipc), each with a lag probe
        ▲ PartialChunk (one-way) · Trajectory (acked) · PromptRequest · BatchRequest/Commit · heartbeats
        │                                                       ▲ Heartbeat(NodeStatus) = status pushes
    driver (this process, `run`): R synthetic rollouts ─────────┘ + one synthetic trainer
    ramp: offered rate = x * (1024-GPU rate), x = 0.25 ... ; each step `step_s` long

Rates (derivation, from the committed simulator results bench/results/simulate.json, every row at
1024 GPUs in laminar mode; the heaviest row sets the target, the others are listed in the JSON):
    tokens/s        gen_tok_s (median over seeds)
    trajectories/s  staleness_finished.count / (counts.steps_measured * iteration_s)
    chunks/s        tokens/s / rollout.partial_chunk_tokens (32): the rollout streams one
                    PartialChunk per sequence per 32 new tokens (laminar/rollout/deliver.py)
    heartbeats/s    rollouts / transport.heartbeat_interval_s (0.5 s), to the buffer and to the manager
    status pushes/s rollouts / rollout.status_push_min_s (0.05 s): the upper bound; with thousands of
                    sequences finishing per second every rollout's status changes every push window
Chunks per trajectory = chunks/s / trajectories/s; the driver streams that many chunks per synthetic
trajectory (header on the first), then sends the finished Trajectory (acked), so both rates follow x.

A step is sustainable when the driver delivered >= 95 % of the offered chunks and trajectories, the
trajectory ack p99 is under `--ack-bound-s`, and the event-loop lag p99 of both nodes (a probe task
in each node's loop: sleep 10 ms, record the overshoot) is under `--lag-bound-ms`.
headroom_vs_1024gpu_rate = highest sustainable x. If the driver itself cannot offer a rate (it
shares the machine's cores), the step says `driver_bound` and the figure is a lower bound.

    .venv/bin/python bench/control_plane.py --quick --out bench/results/control_plane_quick.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHUNK_TOKENS = 32
HEARTBEAT_S = 0.5
STATUS_PUSH_MIN_S = 0.05
PROBE_S = 0.01
TRAJ_LIFE_S = 1.0


def workload_rates(sim_json: Path) -> dict[str, dict[str, float]]:
    """Message rates of every 1024-GPU laminar row of the simulator results (see the docstring)."""
    d = json.loads(sim_json.read_text())
    rows: dict[str, dict[str, Any]] = {}
    for model, by_scale in d.get("results", {}).items():
        if "1024" in by_scale:
            rows[model] = by_scale["1024"]["laminar"]
    mt = d.get("multiturn", {})
    if "1024" in mt.get("results", {}):
        rows[f"{mt.get('model', '?')}_multiturn"] = mt["results"]["1024"]["laminar"]
    out = {}
    for name, r in rows.items():
        tok_s = r["gen_tok_s"]["median"]
        window = r["counts"]["steps_measured"] * r["iteration_s"]["median"]
        traj_s = r["staleness_finished"]["count"] / window
        n = r["rollouts"]
        out[name] = {"rollouts": n, "tokens_s": tok_s, "trajectories_s": traj_s,
                     "chunks_s": tok_s / CHUNK_TOKENS, "heartbeats_s": n / HEARTBEAT_S,
                     "status_pushes_s": n / STATUS_PUSH_MIN_S}  # fmt: skip
    return out


def make_cfg_dict(tmp: Path, rollouts: int) -> dict[str, Any]:
    data = tmp / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "answer": "a"}) + "\n" for i in range(4096))
    )
    return {
        "name": f"cp{uuid.uuid4().hex[:6]}", "run_dir": str(tmp / "run"), "mode": "laminar",
        "cluster": {"transport": "ipc", "ipc_dir": str(tmp / "ipc")},
        "transport": {"heartbeat_interval_s": HEARTBEAT_S, "request_timeout_s": 10.0},
        "data": {"train": str(data), "seed": 1},
        "rollout": {"group_size": 4, "partial_chunk_tokens": CHUNK_TOKENS, "max_running": 128,
                    "status_push_min_s": STATUS_PUSH_MIN_S},
        "trainer": {"batch_groups": 16},
        "buffer": {"capacity": 1 << 20, "fsync": "batch"},
    }  # fmt: skip


# ---- server side -----------------------------------------------------------------------------
async def _serve(role: str, cfg_path: str, lag_path: str) -> None:
    from laminar.config import config_from_dict
    from laminar.logs import configure_logging
    from laminar.node import node_class, run_nodes

    configure_logging("warning")
    cfg = config_from_dict(json.loads(Path(cfg_path).read_text()))
    node = node_class(role)(cfg)  # type: ignore[arg-type]

    async def probe() -> None:
        """Event-loop lag: overshoot of a 10 ms sleep, one line per second (t, p50, p99, max in ms)."""
        with open(lag_path, "a") as f:
            lags: list[float] = []
            t_flush = time.monotonic() + 1.0
            while True:
                t0 = time.monotonic()
                await asyncio.sleep(PROBE_S)
                now = time.monotonic()
                lags.append((now - t0 - PROBE_S) * 1e3)
                if now >= t_flush:
                    f.write(
                        json.dumps({"t": time.time(), "lags": [round(v, 2) for v in lags]}) + "\n"
                    )
                    f.flush()
                    lags, t_flush = [], now + 1.0

    task = asyncio.create_task(probe())
    prof = None
    if os.environ.get("CONTROL_PLANE_PROFILE"):  # where the node's time goes: ROLE lag file + .prof
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        await run_nodes([node])
    finally:
        task.cancel()
        if prof is not None:
            prof.disable()
            prof.dump_stats(os.environ["CONTROL_PLANE_PROFILE"] + f".{role}.prof")


# ---- driver ----------------------------------------------------------------------------------
class Driver:
    def __init__(self, cfg: Any, rates: dict[str, float], ctx: Any):
        self.cfg, self.rates, self.ctx = cfg, rates, ctx
        self.rollouts = int(rates["rollouts"])
        self.chunks_per_traj = max(1, round(rates["chunks_s"] / rates["trajectories_s"]))
        self.resp_len = self.chunks_per_traj * CHUNK_TOKENS
        self.ids = np.arange(self.resp_len, dtype=np.int32) % 1000
        self.lps = np.full(self.resp_len, -0.5, np.float32)
        self.queue: asyncio.Queue[tuple[Any, int]] = asyncio.Queue()
        self.sent = {"chunks": 0, "trajectories": 0, "acked": 0, "pushes": 0, "ack_failed": 0}
        self.ack_lat: list[float] = []
        self.traj_sem = asyncio.Semaphore(256)
        self.bg: set[asyncio.Task[Any]] = set()
        self.active: list[list[Any]] = []

    def status(self, i: int) -> Any:
        from laminar.protocol.core import NodeStatus
        from laminar.protocol.rollout import RolloutStatus

        toks = {f"syn{i}-{k}": 1000 + k for k in range(128)}
        rs = RolloutStatus(traj_tokens=toks, kv_capacity_tokens=1 << 20, measured_at=time.time(),
                           target_version=0, groups=32, credits_free=0)  # fmt: skip
        return NodeStatus(node_id=f"rollout-{i}", role="rollout", version=0, kv_use=0.5, running=128,
                          rollout=rs)  # fmt: skip

    async def connect(self) -> None:
        from laminar.transport.client import RpcClient
        from laminar.transport.sockets import SocketOptions

        opts = SocketOptions.from_config(self.cfg)
        self.buf = [RpcClient(self.ctx, self.cfg.endpoint("buffer"), f"rollout-{i}", "rollout", opts)
                    for i in range(self.rollouts)]  # fmt: skip
        self.mgr = [RpcClient(self.ctx, self.cfg.endpoint("manager"), f"rollout-{i}", "rollout", opts,
                              status=functools.partial(self.status, i)) for i in range(self.rollouts)]  # fmt: skip
        self.trainer = RpcClient(
            self.ctx, self.cfg.endpoint("buffer"), "trainer-0", "trainer", opts
        )
        for c in [*self.buf, *self.mgr, self.trainer]:
            await c.connect(timeout=30)

    def spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self.bg.add(t)
        t.add_done_callback(self.bg.discard)

    async def supply(self) -> None:
        """Keeps served samples queued: the synthetic rollouts ask for prompts like real ones."""
        from laminar.protocol.buffer import PromptReply, PromptRequest

        k = 0
        while True:
            if self.queue.qsize() > 4096:
                await asyncio.sleep(0.05)
                continue
            cli = self.buf[k % self.rollouts]
            rep = await cli.request(PromptRequest(rollout_id=cli.node_id, max_groups=64, version=0))
            k += 1
            assert isinstance(rep, PromptReply)
            for it in rep.items:
                for s in range(it.n):
                    self.queue.put_nowait((it, s))
            if not rep.items:
                await asyncio.sleep(rep.retry_after_s or 0.05)

    async def train(self) -> None:
        """A synthetic trainer: takes batches and commits them, so the buffer never fills."""
        from laminar.protocol.buffer import BatchCommit, BatchReply, BatchRequest

        step = 0
        while True:
            rep = await self.trainer.request(BatchRequest(trainer_id="trainer-0", groups=16, trainer_version=0,
                                                          wait_s=0.5, restart=step == 0))  # fmt: skip
            assert isinstance(rep, BatchReply)
            if rep.batch_id:
                step += 1
                await self.trainer.request(BatchCommit(batch_id=rep.batch_id, step=step, version=0))

    async def finish(self, cli: Any, t: Any) -> None:
        async with self.traj_sem:
            t0 = time.monotonic()
            try:
                await cli.request(t, timeout=10.0, retries=0)
                self.sent["acked"] += 1
                self.ack_lat.append(time.monotonic() - t0)
            except Exception:
                self.sent["ack_failed"] += 1

    def trajectory(self, it: Any, s: int, rid: str) -> Any:
        from laminar.protocol.data import Trajectory

        return Trajectory(uid=f"{it.group_id}/{s}", group_id=it.group_id, prompt_uid=it.uid, sample_index=s,
                          prompt_ids=it.prompt_ids, response_ids=self.ids, logprobs=self.lps, version=0,
                          reward=float(s % 2), rollout_id=rid, finish_reason="stop")  # fmt: skip

    async def stream(self, x: float, until: float) -> None:
        """Paced chunk stream at x * chunks/s over a pool of in-flight samples; a sample that has
        sent its chunks finishes (Trajectory, acked)."""
        from laminar.protocol.data import PartialChunk, PartialTrajectory

        rate = x * self.rates["chunks_s"]
        active = self.active  # [item, sample, next_chunk, client index]; kept across steps
        # each sample lives ~TRAJ_LIFE_S, so finished trajectories flow within a short step
        target_active = max(8, int(x * self.rates["trajectories_s"] * TRAJ_LIFE_S))
        t_start, due_sent, k = time.monotonic(), 0, 0
        while time.monotonic() < until:
            now = time.monotonic()
            due = int((now - t_start) * rate) - due_sent
            if due <= 0:
                await asyncio.sleep(0.002)
                continue
            for _ in range(min(due, 2000)):
                while len(active) < target_active and not self.queue.empty():
                    it, s = self.queue.get_nowait()
                    active.append([it, s, 0, k % self.rollouts])
                    k += 1
                if not active:
                    break
                j = due_sent % len(active)
                a = active[j]
                it, s, c, ci = a
                cli = self.buf[ci]
                lo = c * CHUNK_TOKENS
                header = None
                if c == 0:
                    header = PartialTrajectory(uid=f"{it.group_id}/{s}", group_id=it.group_id, prompt_uid=it.uid,
                                               sample_index=s, prompt_ids=it.prompt_ids, response_ids=self.ids[:0],
                                               logprobs=self.lps[:0], version=0, n=it.n,
                                               rollout_id=cli.node_id)  # fmt: skip
                msg = PartialChunk(uid=f"{it.group_id}/{s}", version=0, offset=lo,
                                   token_ids=self.ids[lo : lo + CHUNK_TOKENS],
                                   logprobs=self.lps[lo : lo + CHUNK_TOKENS], rollout_id=cli.node_id,
                                   header=header)  # fmt: skip
                try:
                    await cli.send(msg)
                    self.sent["chunks"] += 1
                except Exception:
                    pass
                due_sent += 1
                a[2] += 1
                if a[2] >= self.chunks_per_traj:
                    active[j] = active[-1]
                    active.pop()
                    self.sent["trajectories"] += 1
                    self.spawn(self.finish(cli, self.trajectory(it, s, cli.node_id)))
            await asyncio.sleep(0)

    async def pushes(self, x: float, until: float) -> None:
        """Status pushes and the extra heartbeats above 1x (the client timers send 1x) to the manager."""
        rate = x * self.rates["status_pushes_s"] + max(0.0, x - 1) * self.rates["heartbeats_s"]
        t_start, done = time.monotonic(), 0
        while time.monotonic() < until:
            due = int((time.monotonic() - t_start) * rate) - done
            for _ in range(min(max(due, 0), 1000)):
                with_cli = self.mgr[done % self.rollouts]
                try:
                    await with_cli.beat(1.0)
                    self.sent["pushes"] += 1
                except Exception:
                    pass
                done += 1
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        for t in list(self.bg):
            t.cancel()
        for c in [*self.buf, *self.mgr, self.trainer]:
            await c.close()


def read_lag(path: Path, t0: float, t1: float) -> dict[str, float]:
    """p99 / max of every probe sample in [t0, t1] (the probe writes one line of samples per second)."""
    rows = (
        [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        if path.exists()
        else []
    )
    lags = sorted(v for r in rows if t0 <= r["t"] <= t1 for v in r["lags"])
    if not lags:
        return {"p99_ms": float("nan"), "max_ms": float("nan"), "samples": 0}
    return {"p50_ms": lags[len(lags) // 2], "p99_ms": lags[int(len(lags) * 0.99)], "max_ms": lags[-1],
            "samples": len(lags)}  # fmt: skip


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from laminar.config import config_from_dict
    from laminar.logs import configure_logging
    from laminar.transport.sockets import new_context

    configure_logging("warning")

    all_rates = workload_rates(ROOT / "bench/results/simulate.json")
    target_name = max(all_rates, key=lambda k: all_rates[k]["chunks_s"])
    rates = all_rates[target_name]
    tmp = Path(tempfile.mkdtemp(prefix="lamcp-"))
    cfg_d = make_cfg_dict(tmp, int(rates["rollouts"]))
    (tmp / "ipc").mkdir()
    (tmp / "cfg.json").write_text(json.dumps(cfg_d))
    cfg = config_from_dict(cfg_d)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    lag = {r: tmp / f"lag-{r}.jsonl" for r in ("manager", "buffer")}
    steps: list[dict[str, Any]] = []
    server_logs: dict[str, list[str]] = {}
    ctx = new_context()
    drv = Driver(cfg, rates, ctx)
    try:
        for role in ("manager", "buffer"):
            procs[role] = subprocess.Popen([sys.executable, __file__, "serve", role, str(tmp / "cfg.json"), str(lag[role])],
                                           stdout=open(tmp / f"{role}.log", "wb"), stderr=subprocess.STDOUT,
                                           cwd=ROOT)  # fmt: skip
        await asyncio.wait_for(drv.connect(), 60)
        drv.spawn(drv.supply())
        drv.spawn(drv.train())
        # warm-up (not measured): connections, first prompts, the journal's first writes
        await asyncio.gather(drv.stream(args.ramp[0], time.monotonic() + args.warmup_s),
                             drv.pushes(args.ramp[0], time.monotonic() + args.warmup_s))  # fmt: skip
        fails = 0
        for x in args.ramp:
            for p in procs.values():
                if p.poll() is not None:
                    raise RuntimeError(f"a server exited rc {p.returncode}; see {tmp}")
            before = dict(drv.sent)
            drv.ack_lat = []
            t0 = time.time()
            until = time.monotonic() + args.step_s
            await asyncio.gather(drv.stream(x, until), drv.pushes(x, until))
            await asyncio.sleep(1.0)  # acks of the step's last trajectories (a timer, bounded)
            t1 = time.time()
            dt = args.step_s
            got = {k: (drv.sent[k] - before[k]) / dt for k in drv.sent}
            acks = sorted(drv.ack_lat)
            ack_p99 = acks[int(len(acks) * 0.99)] if acks else float("nan")
            offered = {
                "chunks_s": x * rates["chunks_s"],
                "trajectories_s": x * rates["trajectories_s"],
            }
            row = {"x": x, "offered": offered, "achieved": {k: round(v, 1) for k, v in got.items()},
                   "ack_p99_s": round(ack_p99, 4), "lag": {r: read_lag(p, t0, t1) for r, p in lag.items()}}  # fmt: skip
            delivered = (got["chunks"] >= 0.95 * offered["chunks_s"]
                         and got["acked"] >= 0.95 * offered["trajectories_s"])  # fmt: skip
            lag_ok = all(row["lag"][r]["p99_ms"] < args.lag_bound_ms for r in lag)
            row["driver_bound"] = got["chunks"] < 0.95 * offered["chunks_s"] and lag_ok
            row["ok"] = bool(delivered and lag_ok and ack_p99 < args.ack_bound_s)
            steps.append(row)
            print(f"x={x:5.2f} chunks/s {got['chunks']:9.0f}/{offered['chunks_s']:9.0f}  traj acked/s "
                  f"{got['acked']:7.1f}/{offered['trajectories_s']:7.1f}  ack p99 {ack_p99 * 1e3:7.1f} ms  "
                  f"lag p99 buffer {row['lag']['buffer']['p99_ms']:7.1f} ms manager "
                  f"{row['lag']['manager']['p99_ms']:7.1f} ms  {'ok' if row['ok'] else 'FAIL'}"
                  f"{' (driver-bound)' if row['driver_bound'] else ''}", flush=True)  # fmt: skip
            fails = 0 if row["ok"] else fails + 1
            if fails >= 2:
                break
    finally:
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
        for role in procs:  # what went wrong in a node, if anything (warnings and errors only)
            text = (tmp / f"{role}.log").read_text(errors="replace").splitlines()
            server_logs[role] = [ln[:400] for ln in text if '"level": "info"' not in ln][-20:]
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    ok = [s["x"] for s in steps if s["ok"]]
    best = max(ok, default=0.0)
    return {
        "bench": "control_plane",
        "config": {
            "quick": args.quick,
            "ramp": args.ramp,
            "step_s": args.step_s,
            "lag_bound_ms": args.lag_bound_ms,
            "ack_bound_s": args.ack_bound_s,
            "chunk_tokens": CHUNK_TOKENS,
            "heartbeat_s": HEARTBEAT_S,
            "status_push_min_s": STATUS_PUSH_MIN_S,
            "target_workload": target_name,
            "chunks_per_trajectory": drv.chunks_per_traj,
        },  # fmt: skip
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "git_commit": _git(),
        "rates_1024gpu": all_rates,
        "steps": steps,
        "server_logs": server_logs,
        "summary": {
            "headroom_vs_1024gpu_rate": best,
            "target_workload": target_name,
            "highest_sustainable_chunks_s": best * rates["chunks_s"],
            "highest_sustainable_trajectories_s": best * rates["trajectories_s"],
            "driver_bound_steps": [s["x"] for s in steps if s["driver_bound"]],
            "one_buffer_holds_2x": best >= 2,
            # the same sustained chunk rate against each 1024-GPU workload's own rate
            "headroom_by_workload": {
                k: round(best * rates["chunks_s"] / v["chunks_s"], 3) for k, v in all_rates.items()
            },
        },  # fmt: skip
    }


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        asyncio.run(_serve(argv[1], argv[2], argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short steps (<= 5 min in all)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/control_plane.json")
    ap.add_argument("--ramp", type=float, nargs="+", default=None)
    ap.add_argument("--step-s", type=float, default=None)
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (node logs)")
    ap.add_argument("--lag-bound-ms", type=float, default=100.0)
    ap.add_argument("--ack-bound-s", type=float, default=1.0)
    args = ap.parse_args(argv)
    args.ramp = args.ramp or [0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 3.0]
    args.step_s = args.step_s or (15.0 if args.quick else 60.0)
    res = asyncio.run(run_bench(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"headroom_vs_1024gpu_rate = {res['summary']['headroom_vs_1024gpu_rate']} ({res['summary']['target_workload']})"
          f" -> {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
