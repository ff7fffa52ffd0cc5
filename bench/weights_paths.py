"""Relay chain vs global broadcast (NCCL's shape, on gloo here): trainer stall and the rollouts'
waiting time per version, 8 rollouts, one run (bench/weights.py --paths).

    .venv/bin/python bench/weights.py --paths relay,nccl --out bench/results/weights_paths.json
    .venv/bin/python bench/weights.py --paths relay,nccl --quick --out F   # 64 MB, 3 versions
    .venv/bin/python bench/weights.py --paths relay,nccl --mb 8 --versions 2 --out F  # smoke

Per version and path:
  stall_s   how long the trainer is held: relay = WeightPusher.push into the master relay's
            shared memory; nccl = GroupPublisher.publish (pack the flat buffer, broadcast to the
            8 members, wait for it, bounded by bound_s)
  wait_s    per rollout, from the start of the publish until the version is in that rollout's
            own memory: relay = the version reached its relay (chain of 8, one relay per rollout)
            and the rollout pulled and copied it; nccl = the broadcast delivered it into the
            member's buffer (and its checksum was verified)
Summary: the medians over versions of the stall and of the mean wait across rollouts, and
`relay_wait_vs_broadcast` = relay / nccl mean wait (the Laminar paper: relays cut the average
wait by up to 37% against a global broadcast, i.e. a ratio down to 0.63). On one 2-core machine
every rollout, relay and the trainer share the cores, so this measures CPU contention as much as
the paths; across hosts the relay chain's hops run in parallel.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

N = 8


def _mean_waits(rows: list[dict[str, Any]]) -> list[float]:
    return [statistics.mean(r["wait_s"]) for r in rows]


async def relay_path(root: Path, nbytes: int, versions: int, log) -> list[dict[str, Any]]:
    from weights import Bench, _cluster, make_state

    state = make_state(nbytes)
    procs = _cluster(root, f"paths-relay-{nbytes}", {"relay.chunk_bytes": 4 << 20})
    b = Bench(procs, state)
    rows = []
    try:
        await b.start()
        await b.chain(N)
        dst = [{k: torch.empty_like(t) for k, t in state.items()} for _ in range(N)]
        for i in range(versions + 1):  # the first is a warm-up
            b.version += 1
            state[next(iter(state))].view(-1)[0] += 1
            t0 = time.perf_counter()

            async def arrive(j: int, version: int, t0: float = t0) -> float:
                q = b.pullers[j]
                await q.wait_version(version, timeout=300)
                async with await q.pull() as w:
                    await asyncio.to_thread(_copy, w, dst[j])
                return time.perf_counter() - t0

            waiting = [asyncio.ensure_future(arrive(j, b.version)) for j in range(N)]
            stall = await b.pusher.push(b.version, state)
            waits = list(await asyncio.gather(*waiting))
            if i:
                rows.append({"version": b.version, "stall_s": stall, "wait_s": waits})
                log(f"  relay v{b.version}: stall {stall:.3f}s wait {statistics.mean(waits):.3f}s")
    finally:
        await b.close()
        procs.stop()
    return rows


def _copy(w: Any, dst: dict[str, torch.Tensor]) -> None:
    for name, t in w.named_tensors():
        dst[name].copy_(t)


async def nccl_path(nbytes: int, versions: int, log) -> list[dict[str, Any]]:
    import structlog
    from weights import make_state

    from laminar.weights.group import GroupBroadcaster, GroupMember, GroupSettings
    from laminar.weights.nccl import GroupPublisher
    from tests.conftest import free_port

    state = make_state(nbytes)
    names = tuple(f"rollout-{i}" for i in range(N))
    s = GroupSettings(
        "127.0.0.1", free_port(), "gloo", names, bound_s=120.0, beat_s=0.2, connect_timeout_s=120.0
    )
    quiet = structlog.get_logger()
    caster = GroupBroadcaster(s, quiet)
    pub = GroupPublisher(None, caster, "cpu")
    arrived: dict[int, dict[str, float]] = {}
    lock = threading.Lock()

    def on_weights(name: str):
        def got(w: Any) -> None:
            with lock:
                arrived.setdefault(w.version, {})[name] = time.perf_counter()

        return got

    members = [GroupMember(s, m, "cpu", on_weights(m), quiet) for m in names]
    rows = []
    await pub.start()
    try:
        for m in members:
            m.start()
        deadline = time.monotonic() + 120
        while caster.members != names:
            if time.monotonic() > deadline:
                raise TimeoutError(f"group never formed: {caster.members}")
            await asyncio.sleep(0.05)  # poll of the group's thread, under a deadline
        for v in range(1, versions + 2):  # the first is a warm-up
            state[next(iter(state))].view(-1)[0] += 1
            t0 = time.perf_counter()
            res = await pub.publish(v, v, state)
            deadline = time.monotonic() + 300
            while len(arrived.get(v, {})) < N:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"version {v} reached {sorted(arrived.get(v, {}))}")
                await asyncio.sleep(0.005)  # the members' threads have no event here: poll
            waits = [arrived[v][m] - t0 for m in names]
            if v > 1:
                rows.append({"version": v, "stall_s": res.stall_s, "wait_s": waits})
                log(f"  nccl v{v}: stall {res.stall_s:.3f}s wait {statistics.mean(waits):.3f}s")
    finally:
        for m in members:
            await asyncio.to_thread(m.close)
        await pub.close()
    return rows


def run(paths: list[str], nbytes: int, versions: int, root: Path, log) -> dict[str, Any]:
    from weights import stats

    out: dict[str, Any] = {"rollouts": N, "bytes": nbytes, "versions": versions, "paths": {}}
    for p in paths:
        log(f"path {p}: {nbytes >> 20} MB x {versions} versions, {N} rollouts")
        if p == "relay":
            rows = asyncio.run(relay_path(root, nbytes, versions, log))
        elif p == "nccl":
            rows = asyncio.run(nccl_path(nbytes, versions, log))
        else:
            raise ValueError(f"unknown path {p!r}: relay | nccl")
        out["paths"][p] = {
            "per_version": rows,
            "stall_s": stats([r["stall_s"] for r in rows]),
            "mean_wait_s": stats(_mean_waits(rows)),
            "max_wait_s": stats([max(r["wait_s"]) for r in rows]),
        }
    summary: dict[str, float] = {}
    for p, r in out["paths"].items():
        summary[f"{p}_stall_s"] = r["stall_s"]["median"]
        summary[f"{p}_mean_wait_s"] = r["mean_wait_s"]["median"]
    if {"relay", "nccl"} <= set(out["paths"]):
        summary["relay_wait_vs_broadcast"] = (
            summary["relay_mean_wait_s"] / summary["nccl_mean_wait_s"]
        )
        summary["relay_stall_vs_broadcast"] = summary["relay_stall_s"] / summary["nccl_stall_s"]
    out["summary"] = summary
    return out
