"""Weight transport benchmark: trainer stall, chain broadcast, rollout pull (one run, ratios).

    .venv/bin/python bench/weights.py          # 100 MB and 1 GB states (minutes)
    .venv/bin/python bench/weights.py --quick  # 100 MB and 256 MB, fewer repeats (< 5 min, 2 cores)
    .venv/bin/python bench/weights.py --hosts 8 --quick --out F  # relays on emulated hosts (root)
    .venv/bin/python bench/weights.py --delta --quick --out F    # sparse deltas, 100M model
    .venv/bin/python bench/weights.py --paths relay,nccl --out F  # relay vs broadcast (8 rollouts)
    .venv/bin/python bench/weights.py --digest --out F           # attestation digest, s per GB

Real processes: one manager + 8 relays (`python -m laminar node --role relay`); this
process is the trainer (WeightPusher) and the rollouts (one WeightPuller per relay,
whose WeightsReady tells when a relay has a version). The bench sends ChainUpdate
itself (as the manager would) to choose chains of 1, 2, 4 and 8 relays.

Figures (min/median/max over repeats, all measured in this run):
  stall_s[k]        trainer stall of one push with k relays in the chain (two passes, k up
                    then down, so machine drift hits every k), the chain idle and settled
                    (--settle s after the previous broadcast: the relays' cleanup of 1 GB of
                    frames and pages must not run inside the trainer's memcpy, as it never
                    would with one relay per host; --settle 0 measures that contention)
                    when the push starts (a relay on another host costs the trainer nothing;
                    on this 2-core box a still-running broadcast would steal the trainer's
                    CPU, which `stall_busy8_s` shows separately).
  hop_s / chain8_s  commit -> the last relay has the version, for a chain of 2 (one hop)
                    and of 8 relays. Measured twice:
                    * link-emulated (the summary ratio): each relay paces its sends to
                      `link_MBps` (~1/12 of the unthrottled hop speed), so 8 relays need
                      < 2 cores and the figure shows what the chain does when the link,
                      not the CPU, is the limit (the paper's regime: one relay per host).
                    * unthrottled: 8 relay processes share 2 cores, so every hop runs at a
                      fraction of a core; this ratio measures the CPU, not the chain.
  pull_s / memcpy_s a rollout's pull (PullRequest, mapped shm views, copy every tensor
                    into its own buffers, release) vs the same per-tensor copies from
                    private memory. The first (cold: page tables not yet built) pull is
                    reported apart; the summary uses warm pulls (slots are reused, and a
                    puller keeps its read-only mapping).
Summary: stall_ratio_8_vs_1 = stall[8]/stall[1] (goal <= 1.2), chain_vs_single_hop =
chain8/hop link-emulated (goal <= 1.3), shm_pull_vs_memcpy = memcpy/pull (goal >= 0.7),
all at the largest size; `delta_*` says how often delta mode pays off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from laminar.protocol.relay import RelayReset  # noqa: E402
from tests.relay_procs import RelayProcs  # noqa: E402

N_RELAYS = 8


def stats(values: list[float]) -> dict:
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "values": values,
    }


def make_state(nbytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformer-like state: 16 MiB bf16 matrices plus small fp32 norms."""
    g = torch.Generator().manual_seed(seed)
    out, total, i = {}, 0, 0
    while total < nbytes:
        rows = min(8192, max(1, (nbytes - total) // 2048))
        out[f"layers.{i}.mlp.weight"] = torch.randn(rows, 1024, generator=g).to(torch.bfloat16)
        out[f"layers.{i}.norm.weight"] = torch.randn(1024, generator=g)
        total += rows * 2048 + 4096
        i += 1
    return out


class Bench:
    def __init__(self, procs: RelayProcs, state: dict[str, torch.Tensor]):
        self.procs, self.state, self.epoch, self.version = procs, state, 1000, 0

    async def start(self) -> None:
        p = self.procs
        await p.wait_ready(60)
        await p.wait_chain(timeout=60)
        self.pusher = p.pusher("trainer-0")
        await self.pusher.start()
        self.pullers = [p.puller(f"rollout-{i}", relay_index=i) for i in range(N_RELAYS)]
        for q in self.pullers:
            await q.start()

    async def chain(self, k: int) -> None:
        self.epoch += 1
        await self.procs.set_chain(list(range(k)), self.epoch)
        self.k = k

    async def push(self, reset: bool = True, settle_s: float = 0.0) -> tuple[float, float]:
        """One push into the idle chain; returns (stall, commit -> last relay ready)."""
        if reset:  # downstream relays drop their version but keep the slot: no new page faults
            for i in range(1, self.k):
                await self.procs._rpc(i, RelayReset(keep_spare=True), 10, role="trainer")
        if settle_s:  # let the relays' post-broadcast cleanup (frees, GC) end: on 2 shared cores it
            await asyncio.sleep(
                settle_s
            )  # would run inside the trainer's memcpy; across hosts it never does
        self.version += 1
        self.state[next(iter(self.state))].view(-1)[0] += 1  # a new version differs
        stall = await self.pusher.push(self.version, self.state)
        t0 = time.perf_counter()
        await self.wait_all(self.version, self.k)
        return stall, time.perf_counter() - t0

    async def wait_all(self, version: int, k: int, timeout: float = 300.0) -> None:
        try:
            for q in self.pullers[:k]:
                await q.wait_version(version, timeout=max(1.0, timeout))
        except TimeoutError:  # say where the chain stopped, then fail
            for i, info in (await self.procs.infos(list(range(k)))).items():
                print(f"  relay-{i}: {info}", flush=True)
            raise

    async def pull(self, dst: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        async with await self.pullers[0].pull() as w:
            await asyncio.to_thread(_copy_views, w, dst)
        return time.perf_counter() - t0

    async def close(self) -> None:
        for q in self.pullers:
            await q.close()
        await self.pusher.close()
        await self.procs.close_clients()


def _copy_views(w, dst: dict[str, torch.Tensor]) -> None:
    for name, t in w.named_tensors():
        dst[name].copy_(t)


def _copy_private(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> None:
    for name, t in src.items():
        dst[name].copy_(t)


def _cluster(root: Path, name: str, extra: dict) -> RelayProcs:
    ov = {
        "transport.heartbeat_interval_s": 0.5,
        "transport.heartbeat_liveness": 8,
        "transport.request_timeout_s": 60.0,
        "relay.probe_timeout_s": 3.0,
        "relay.max_slots": 3,
        "relay.spare_slots": 1,
        "logging.level": "info",
        **extra,
    }
    return RelayProcs(root / name, N_RELAYS, ov).start()


async def run_size(
    nbytes: int, repeats: int, root: Path, link_divisor: float, settle_s: float, log
) -> dict:
    stall_repeats = (
        repeats if repeats < 3 else repeats + 2
    )  # stalls are short and noisy: more samples
    state = make_state(nbytes)
    res: dict = {
        "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "tensors": len(state),
    }
    procs = _cluster(root, f"u{nbytes}", {"relay.chunk_bytes": 4 << 20})
    b = Bench(procs, state)
    try:
        await b.start()
        runs: dict[int, list[tuple[float, float]]] = {1: [], 2: [], 4: [], 8: []}
        for ks in ((1, 2, 4, 8), (8, 4, 2, 1)):  # two passes in opposite order: drift cancels
            for k in ks:
                await b.chain(k)
                for _ in range(2):  # warm-up: slots created, mappings cached
                    await b.push()
                runs[k] += [await b.push(settle_s=settle_s) for _ in range(stall_repeats)]
                log(
                    f"  {nbytes >> 20} MB k={k}: stall "
                    f"{statistics.median(s for s, _ in runs[k]):.3f}s bcast "
                    f"{statistics.median(c for _, c in runs[k]):.3f}s"
                )
        for k, r in runs.items():
            res[f"stall_s_{k}"] = stats([s for s, _ in r])
        res["hop_unthrottled_s"] = stats([c for _, c in runs[2]])
        res["chain8_unthrottled_s"] = stats([c for _, c in runs[8]])
        if (
            nbytes <= 256 << 20
        ):  # two versions in flight per relay: skipped where RAM would not hold it
            busy = []
            await b.chain(8)
            await b.push()
            for _ in range(repeats):  # push again while the previous 8-relay broadcast still runs
                b.version += 1
                await b.pusher.push(b.version, state)
                b.version += 1
                busy.append(await b.pusher.push(b.version, state))
                await b.wait_all(b.version, N_RELAYS)
            res["stall_busy8_s"] = stats(busy)
        await b.chain(1)
        await b.push()
        dst = {k: torch.empty_like(t) for k, t in state.items()}
        res["pull_cold_s"] = await b.pull(dst)
        pulls, copies = [], []
        for _ in range(repeats + 1):
            pulls.append(await b.pull(dst))
            t0 = time.perf_counter()
            await asyncio.to_thread(_copy_private, state, dst)
            copies.append(time.perf_counter() - t0)
        res["pull_s"], res["memcpy_s"] = stats(pulls), stats(copies)
        log(
            f"  {nbytes >> 20} MB pull {res['pull_s']['median']:.3f}s memcpy "
            f"{res['memcpy_s']['median']:.3f}s cold {res['pull_cold_s']:.3f}s"
        )
    finally:
        await b.close()
        procs.stop()
    # link-emulated chain: pace every hop well below what 2 cores can feed 8 relays
    rate = res["bytes"] / res["hop_unthrottled_s"]["median"] / link_divisor
    res["link_MBps"] = rate / 1e6
    procs = _cluster(
        root, f"t{nbytes}", {"relay.chunk_bytes": 1 << 20, "relay.link_bytes_per_s": rate}
    )
    b = Bench(procs, state)
    try:
        await b.start()
        for k, key in ((2, "hop_s"), (8, "chain8_s")):
            await b.chain(k)
            await b.push()
            res[key] = stats([(await b.push())[1] for _ in range(repeats)])
            log(f"  {nbytes >> 20} MB link {rate / 1e6:.0f} MB/s k={k}: {res[key]['median']:.3f}s")
    finally:
        await b.close()
        procs.stop()
    chunks = res["bytes"] / (1 << 20)
    res["chain_model_ratio"] = (N_RELAYS + chunks - 2) / chunks  # (p+k-2)/k, T_start ignored
    return res


async def run_delta(root: Path, nbytes: int, repeats: int, log) -> dict:
    """Delta mode vs full sends on 2 relays (link-emulated at 100 MB/s), for a few fractions of
    the bytes changed per version (each changed tensor has a changed element in every chunk)."""
    out: dict = {}
    state = make_state(nbytes, seed=1)
    big = [
        n for n in state if "mlp" in n
    ]  # ~all the bytes: the fraction of these is a byte fraction
    for delta in (False, True):
        procs = _cluster(
            root,
            f"d{int(delta)}",
            {"relay.chunk_bytes": 1 << 20, "relay.delta": delta, "relay.link_bytes_per_s": 100e6},
        )
        b = Bench(procs, state)
        try:
            await b.start()
            await b.chain(2)
            await b.push(reset=False)
            for frac in (0.0, 0.25, 0.5, 1.0):
                times = []
                for _ in range(repeats):
                    for n in big[: int(round(frac * len(big)))]:
                        state[n].view(-1)[::2048] += 1
                    times.append((await b.push(reset=False))[1])
                out.setdefault(f"frac_{frac}", {})["delta_s" if delta else "full_s"] = stats(times)
        finally:
            await b.close()
            procs.stop()
    for v in out.values():
        v["speedup"] = v["full_s"]["median"] / v["delta_s"]["median"]
    log(f"  delta speedup: {json.dumps({k: round(v['speedup'], 2) for k, v in out.items()})}")
    return out


def machine() -> dict:
    du = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "dev_shm_gib": du.total / 2**30 if du else None,
    }


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _stop_on_sigterm() -> None:
    """A SIGTERM (timeout, Ctrl-C from a runner) must not leave 9 processes and GBs of /dev/shm."""

    def handler(signum, frame):
        for procs in list(RelayProcs.live):
            procs.stop(timeout=5)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main() -> int:
    _stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 MB and 256 MB, 2 repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument(
        "--link-divisor",
        type=float,
        default=12.0,
        help="emulated link = unthrottled hop speed / this",
    )
    ap.add_argument(
        "--settle",
        type=float,
        default=1.0,
        help="seconds between a broadcast's end and the next stall-measured push (0: none)",
    )
    ap.add_argument("--out", default=None, help="default bench/results/weights[_delta].json")
    ap.add_argument(
        "--delta",
        action="store_true",
        help="sparse weight deltas on a 100M model (bench/weights_delta.py; its own flags follow)",
    )
    ap.add_argument(
        "--vllm",
        action="store_true",
        help=(
            "version loads into vLLM: safetensors bytes vs shared-memory views "
            "(bench/weights_vllm.py)"
        ),
    )
    ap.add_argument(
        "--hosts",
        type=int,
        default=None,
        help="K emulated hosts on tbf-shaped links, tcp + CURVE (bench/weights_hosts.py; root)",
    )
    ap.add_argument(
        "--paths",
        default=None,
        help="relay,nccl: trainer stall and rollout wait per version, 8 rollouts, relay chain vs "
        "broadcast group (gloo on CPU; bench/weights_paths.py)",
    )
    ap.add_argument("--mb", type=int, default=None, help="--paths: state size in MB")
    ap.add_argument("--versions", type=int, default=None, help="--paths: versions per path")
    ap.add_argument(
        "--digest", action="store_true", help="attestation digest cost per GB (digest.py)"
    )
    args, rest = ap.parse_known_args()
    if args.paths or args.digest:
        return paths_main(args)
    if args.hosts:
        from weights_hosts import main as hosts_main

        argv = ["--hosts", str(args.hosts), *(["--quick"] if args.quick else []), *rest]
        argv += ["--out", args.out or "bench/results/weights_hosts.json"]
        argv += ["--repeats", str(args.repeats)] if args.repeats else []
        return hosts_main(argv)
    if args.vllm:
        from weights_vllm import main as vllm_main

        out = args.out or "bench/results/weights_vllm.json"
        rest += ["--repeats", str(args.repeats)] if args.repeats else []
        return vllm_main(rest, args.quick, out, {"machine": machine(), "git_commit": git_commit()})
    if args.delta:
        from weights_delta import main as delta_main

        out = args.out or "bench/results/weights_delta.json"
        return delta_main(rest, args.quick, out, {"machine": machine(), "git_commit": git_commit()})
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    args.out = args.out or "bench/results/weights.json"
    sizes = [100 << 20, 256 << 20] if args.quick else [100 << 20, 1 << 30]
    repeats = args.repeats or (2 if args.quick else 3)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    root = Path(tempfile.mkdtemp(prefix="lam-wbench-", dir="/tmp"))
    results: dict = {"sizes": {}}
    try:
        for nbytes in sizes:
            log(f"size {nbytes >> 20} MB")
            results["sizes"][str(nbytes)] = asyncio.run(
                run_size(nbytes, repeats, root, args.link_divisor, args.settle, log)
            )
        results["delta"] = asyncio.run(run_delta(root, 64 << 20, repeats, log))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    big = results["sizes"][str(sizes[-1])]
    summary = {
        "stall_ratio_8_vs_1": big["stall_s_8"]["median"] / big["stall_s_1"]["median"],
        "chain_vs_single_hop": big["chain8_s"]["median"] / big["hop_s"]["median"],
        "shm_pull_vs_memcpy": big["memcpy_s"]["median"] / big["pull_s"]["median"],
        "chain_vs_single_hop_unthrottled": big["chain8_unthrottled_s"]["median"]
        / big["hop_unthrottled_s"]["median"],
        "chain_model_ratio": big["chain_model_ratio"],
        "stall_s_1": big["stall_s_1"]["median"],
        "stall_busy8_vs_idle": next(
            r["stall_busy8_s"]["median"] / r["stall_s_8"]["median"]
            for r in results["sizes"].values()
            if "stall_busy8_s" in r
        ),
        "delta_pays_off_at": [
            k for k, v in results["delta"].items() if v["full_s"]["min"] > v["delta_s"]["max"]
        ],
    }
    doc = {
        "bench": "weights",
        "config": {
            "sizes": sizes,
            "repeats": repeats,
            "relays": N_RELAYS,
            "quick": args.quick,
            "link_divisor": args.link_divisor,
            "settle_s": args.settle,
        },
        "machine": machine(),
        "git_commit": git_commit(),
        "elapsed_s": time.time() - t_start,
        "summary": summary,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(
        f"\n{'size':>8} {'stall1':>8} {'stall8':>8} {'hop':>8} {'chain8':>8} {'hop_u':>8} "
        f"{'chain8_u':>8} {'pull':>8} {'memcpy':>8}"
    )
    for nb, r in results["sizes"].items():
        m = {
            k: r[k]["median"]
            for k in (
                "stall_s_1",
                "stall_s_8",
                "hop_s",
                "chain8_s",
                "hop_unthrottled_s",
                "chain8_unthrottled_s",
                "pull_s",
                "memcpy_s",
            )
        }
        print(f"{int(nb) >> 20:>6}MB " + " ".join(f"{v:8.3f}" for v in m.values()))
    print()
    for k, v in summary.items():
        print(f"{k:>34}: {v:.3f}" if isinstance(v, float) else f"{k:>34}: {v}")
    print(f"wrote {args.out} in {time.time() - t_start:.0f}s")
    return 0


def digest_cost(sizes_mb: list[int], repeats: int) -> dict:
    """Seconds per GB of weights_digest on this machine's CPU (and its GPU when there is one)."""
    from laminar.weights.digest import weights_digest

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out: dict = {}
    for dev in devices:
        for mb in sizes_mb:
            state = {k: v.to(dev) for k, v in make_state(mb << 20).items()}
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                weights_digest(state.items())
                times.append(time.perf_counter() - t0)
            out[f"{dev}_{mb}MB"] = {
                "bytes": nbytes,
                "s": stats(times),
                "s_per_GB": statistics.median(times) / (nbytes / 1e9),
            }
    return out


def paths_main(args: argparse.Namespace) -> int:
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    doc: dict = {"bench": "weights_paths", "machine": machine(), "git_commit": git_commit()}
    if args.digest:
        doc["digest"] = digest_cost([64, 256] if args.quick else [256, 1024], args.repeats or 3)
        for k, v in doc["digest"].items():
            print(f"digest {k:>12}: {v['s_per_GB']:.3f} s/GB")
    if args.paths:
        from weights_paths import run

        mb = args.mb or (64 if args.quick else 256)
        versions = args.versions or (3 if args.quick else 6)
        root = Path(tempfile.mkdtemp(prefix="lam-wpaths-", dir="/tmp"))
        try:
            doc["paths"] = run(args.paths.split(","), mb << 20, versions, root, log)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(f"\n{'path':>6} {'stall':>8} {'mean wait':>10} {'max wait':>10}")
        for p, r in doc["paths"]["paths"].items():
            print(
                f"{p:>6} {r['stall_s']['median']:8.3f} {r['mean_wait_s']['median']:10.3f} "
                f"{r['max_wait_s']['median']:10.3f}"
            )
        for k, v in doc["paths"]["summary"].items():
            print(f"{k:>26}: {v:.3f}")
    doc["elapsed_s"] = time.time() - t_start
    out = Path(args.out or "bench/results/weights_paths.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out} in {time.time() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
