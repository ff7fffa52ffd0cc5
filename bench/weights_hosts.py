"""Chain broadcast across emulated hosts: relays in network namespaces on tbf-shaped links.

    .venv/bin/python bench/weights.py --hosts 8 --quick --out bench/results/weights_hosts_quick.json
    .venv/bin/python bench/weights_hosts.py --hosts 8 [--quick] [--rate-mbps 200] --out F  # same

Root only (tests/hosts.py makes the namespaces). K hosts on a private bridge; every host's link
is shaped to `--rate-mbps` both ways (tbf), host i runs relay-i (`laminar node --role relay`),
host 0 also runs the manager; every socket is tcp with CURVE (`laminar keys --roles ...`). The
trainer end (WeightPusher) and one rollout end per relay (WeightPuller: its WeightsReady says when
that relay has the version) run in a worker process inside host 0's namespace: the trainer pushes
to the master on its own host (loopback, unshaped, as on a real host) and the chain carries the
version host to host over the shaped links.

Figures (min/median/max over repeats; one run):
  bcast_s[k]   commit -> the last of k relays has the version, chains of k = 1, 2, 4, 8 (k <= K);
               next to the model M/B + (h-1)*chunk/B for h = k-1 shaped hops (the issue's
               M/B + (K-1)*chunk/B with K counting hops; B the shaped rate, pipelined chain).
  stall_s[k]   the trainer's stall of one push with k relays in the chain.
  straggler    one relay's link 10x slower (relay 1 of 4, so 2 relays sit behind it): the time
               until every *other* relay has the version with the manager's order (the fix:
               laminar/manager/chain_order.py moves a relay that falls behind its own upstream
               to the tail, seen during a warm-up push) and with the chain forced into index
               order (the straggler's slowness passes to everyone behind it); and the time until
               all relays have it.
Summary: chain_vs_single_hop_hosts = bcast[8]/bcast[2] (goal <= 1.3), stall_ratio_8_vs_1_hosts =
stall[8]/stall[1] (goal <= 1.2), straggler_fast_relays_s_{index_order,reordered}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from laminar.config import load_config  # noqa: E402
from laminar.wiring.common import socket_options  # noqa: E402
from tests.hosts import (  # noqa: E402
    Hosts,
    HostsUnavailable,
    make_keys,
    node_cmd,
    shape_link,
    tcp_endpoints,
)
from tests.relay_procs import RelayProcs  # noqa: E402

CHUNK = 1 << 20


class NsRelays(RelayProcs):
    """RelayProcs' clients (ChainInfo, ChainUpdate, pusher, pullers) for relays someone else
    started in namespaces: the config is read from the file they run with."""

    def __init__(self, config_path: Path, n_relays: int):  # no super(): nothing to start here
        self.cfg = load_config(config_path)
        self.n, self.procs, self._ctx = n_relays, {}, None
        # the server pair ("node": may claim any role) for the bench's trainer, rollout and cli ends
        self.opts = socket_options(self.cfg)


# ---- the worker: runs inside host 0's namespace ---------------------------------------------
async def worker(
    config_path: Path,
    k_max: int,
    nbytes: int,
    repeats: int,
    straggler: int | None,
    slow_link: tuple[str, str, float] | None = None,
) -> dict:
    import weights as wb  # bench/weights.py: the same Bench (push, wait on every relay's puller)

    wb.N_RELAYS = k_max
    state = wb.make_state(nbytes)
    procs = NsRelays(config_path, k_max)
    b = wb.Bench(procs, state)
    res: dict = {"bytes": sum(t.numel() * t.element_size() for t in state.values())}
    try:
        await b.start()
        if straggler is None:
            ks = [k for k in (1, 2, 4, 8) if k <= k_max]
            runs: dict[int, list[tuple[float, float]]] = {k: [] for k in ks}
            for order in (ks, ks[::-1]):  # two passes in opposite order: drift cancels
                for k in order:
                    await b.chain(k)
                    await b.push()  # warm-up: slots made, mappings cached
                    runs[k] += [await b.push(settle_s=1.0) for _ in range(repeats)]
                    print(
                        f"  k={k}: stall {statistics.median(s for s, _ in runs[k]):.3f}s bcast "
                        f"{statistics.median(c for _, c in runs[k]):.3f}s",
                        flush=True,
                    )
            for k, r in runs.items():
                res[f"stall_s_{k}"] = wb.stats([s for s, _ in r])
                res[f"bcast_s_{k}"] = wb.stats([c for _, c in r])
            return res
        # straggler: first the manager's order (it sees relay-`straggler` fall behind its upstream
        # during the warm-up push and moves it last), then the chain forced into index order
        # (a ChainUpdate with a higher epoch than the manager's: the planner is out of the loop)
        fast = [i for i in range(k_max) if i != straggler]
        assert slow_link is not None
        b.k = k_max
        await b.push()  # every link healthy: the manager learns what a fast hop looks like
        host_ns, bridge_ns, slow_rate = slow_link
        shape_link(host_ns, bridge_ns, straggler, slow_rate)  # then this relay's link degrades
        for name in ("reordered", "index_order"):
            if name == "index_order":
                b.epoch += 1
                await procs.set_chain(list(range(k_max)), b.epoch)
            b.k = k_max
            fast_t, all_t = [], []
            for rep in range(repeats + 1):  # the first: warm-up (and the manager's detection)
                for i in range(1, k_max):
                    await procs._rpc(i, wb.RelayReset(keep_spare=True), 30, role="trainer")
                b.version += 1
                state[next(iter(state))].view(-1)[0] += 1
                await b.pusher.push(b.version, state)
                t0 = time.perf_counter()
                for i in fast:
                    await b.pullers[i].wait_version(b.version, timeout=300)
                t_fast = time.perf_counter() - t0
                await b.pullers[straggler].wait_version(b.version, timeout=300)
                if rep:
                    fast_t.append(t_fast)
                    all_t.append(time.perf_counter() - t0)
            order = (await procs.infos([0]))[0]
            res[f"straggler_{name}"] = {
                "order": order.order if order else None,
                "fast_relays_s": wb.stats(fast_t),
                "all_relays_s": wb.stats(all_t),
            }
            print(
                f"  straggler relay-{straggler}, chain {res[f'straggler_{name}']['order']}: others "
                f"{statistics.median(fast_t):.2f}s, all {statistics.median(all_t):.2f}s",
                flush=True,
            )
        return res
    finally:
        await b.close()


# ---- the driver: makes the hosts, starts the relays, runs the worker in host 0 ---------------
def run_cluster(
    root: Path, k: int, rate: float, nbytes: int, repeats: int, straggler: int | None, log
) -> dict:
    with Hosts(k) as hosts:
        d = root / f"k{k}{'s' if straggler is not None else ''}"
        d.mkdir(parents=True)
        cfg = {
            "name": f"wh{os.getpid()}",
            "run_dir": str(d / "run"),
            "cluster": {
                "transport": "tcp",
                "endpoints": tcp_endpoints(hosts, k),
                "roles": {"manager": 1, "relay": k},
            },
            "security": {"keys_dir": str(make_keys(d / "keys", "manager,relay,trainer,rollout"))},
            "transport": {
                "heartbeat_interval_s": 0.25,
                "heartbeat_liveness": 20,
                "request_timeout_s": 60.0,
            },
            "relay": {
                "chunk_bytes": CHUNK,
                "shm_prefix": f"lamwh{os.getpid()}",
                "max_slots": 3,
                "spare_slots": 1,
                "probe_timeout_s": 3.0,
                "fetch_timeout_s": 120.0,
                "chunk_wait_s": 60.0,
            },
            "logging": {"level": "info", "json_logs": True},
        }
        path = d / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        for i in range(k):
            hosts.shape(i, rate_bytes_s=rate)
        hosts.popen(0, node_cmd("manager", path), d / "manager.log")
        for i in range(k):
            hosts.popen(i, node_cmd("relay", path, i), d / f"relay-{i}.log")
        out = d / "worker.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            str(path),
            "--hosts",
            str(k),
            "--bytes",
            str(nbytes),
            "--repeats",
            str(repeats),
            "--out",
            str(out),
        ]
        if straggler is not None:  # the worker slows this link itself, after a healthy push
            cmd += [
                "--straggler",
                str(straggler),
                "--slow-link",
                f"{hosts.ns(straggler)},{hosts.bridge_ns},{rate / 10}",
            ]
        w = hosts.popen(0, cmd, sys.stdout, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        hosts.procs[0].remove(w)
        w.wait(timeout=3000)
        if w.returncode != 0 or not out.exists():
            tails = "\n".join(
                f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}"
                for f in sorted(d.glob("*.log"))
            )
            raise RuntimeError(f"worker exited with {w.returncode}\n{tails}")
        res = json.loads(out.read_text())
        RelayProcs.remove_segments(NsRelays(path, k))  # what a killed relay could leave in /dev/shm
        return res


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--hosts", type=int, default=8, help="K hosts (relays); chains of 1, 2, 4, 8 <= K"
    )
    ap.add_argument("--quick", action="store_true", help="64 MB, 4 repeats (default 256 MB, 6)")
    ap.add_argument(
        "--rate-mbps", type=float, default=200.0, help="shaped link rate, Mbit/s, both ways"
    )
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default="bench/results/weights_hosts.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--straggler", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--slow-link", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    repeats = args.repeats or (4 if args.quick else 6)
    if args.worker:
        from laminar.logs import configure_logging

        configure_logging("warning")
        slow = None
        if args.slow_link:
            host_ns, bridge_ns, r = args.slow_link.split(",")
            slow = (host_ns, bridge_ns, float(r))
        res = asyncio.run(
            worker(Path(args.worker), args.hosts, args.bytes, repeats, args.straggler, slow)
        )
        Path(args.out).write_text(json.dumps(res))
        return 0
    why = Hosts.unavailable()
    if why:
        raise HostsUnavailable(why)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # unwind: Hosts' teardown kills and deletes
    nbytes = args.bytes or ((64 if args.quick else 256) << 20)
    rate = args.rate_mbps * 1e6 / 8
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    root = Path(tempfile.mkdtemp(prefix="lam-whosts-", dir="/tmp"))
    try:
        log(f"{args.hosts} hosts, links {args.rate_mbps:g} Mbit/s, {nbytes >> 20} MB")
        res = run_cluster(root, args.hosts, rate, nbytes, repeats, None, log)
        strag = None
        if args.hosts >= 4:
            log("straggler: relay-1 of 4 at a tenth of the rate")
            strag = run_cluster(root, 4, rate, nbytes // 4, repeats, 1, log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ks = [k for k in (1, 2, 4, 8) if k <= args.hosts]
    m = res["bytes"]
    # k relays = k - 1 shaped hops (the trainer's push to the master stays on its host): the
    # first hop takes M/B, each further hop adds one chunk time; k = 1 moves nothing
    model = {k: (m + (k - 2) * CHUNK) / rate if k > 1 else 0.0 for k in ks}
    kmax = ks[-1]
    summary = {
        "chain_vs_single_hop_hosts": res[f"bcast_s_{kmax}"]["median"] / res["bcast_s_2"]["median"],
        "stall_ratio_8_vs_1_hosts": res[f"stall_s_{kmax}"]["median"] / res["stall_s_1"]["median"],
        "model_chain_vs_single_hop": model[kmax] / model[2],
        "link_MBps": rate / 1e6,
    }
    if strag:
        for name in ("index_order", "reordered"):
            summary[f"straggler_fast_relays_s_{name}"] = strag[f"straggler_{name}"][
                "fast_relays_s"
            ]["median"]
            summary[f"straggler_all_relays_s_{name}"] = strag[f"straggler_{name}"]["all_relays_s"][
                "median"
            ]
    import weights as wb

    doc = {
        "bench": "weights_hosts",
        "config": {
            "hosts": args.hosts,
            "bytes": m,
            "chunk_bytes": CHUNK,
            "rate_mbps": args.rate_mbps,
            "repeats": repeats,
            "quick": args.quick,
            "transport": "tcp+curve",
            "shaping": "tbf",
        },
        "machine": wb.machine(),
        "git_commit": wb.git_commit(),
        "elapsed_s": time.time() - t_start,
        "load_avg": os.getloadavg(),
        "summary": summary,
        "results": res,
        "straggler": strag,
        "model_s": {str(k): v for k, v in model.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"\n{'k':>3} {'bcast_s':>9} {'model_s':>9} {'stall_s':>9}")
    for k in ks:
        print(
            f"{k:>3} {res[f'bcast_s_{k}']['median']:9.3f} {model[k]:9.3f} "
            f"{res[f'stall_s_{k}']['median']:9.4f}"
        )
    print()
    for key, v in summary.items():
        print(f"{key:>38}: {v:.3f}")
    print(f"wrote {args.out} in {time.time() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
