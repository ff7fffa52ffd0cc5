"""Transport benchmark: trajectory messages through the codec vs raw pyzmq with the same frames.

    sender process (this one)                         receiver process (spawned)
    Trajectory ─encode─► PUSH ══ ipc / tcp ══► PULL ─decode─► Trajectory      (codec)
    same frames ───────► PUSH ══ ipc / tcp ══► PULL ─► frames                 (raw)

Messages are Trajectory-sized: 256 prompt ids + 1k or 8k response ids (int32) and as
many float32 logprobs, plus a realistic header (uid, timings, reward info). The raw
baseline sends exactly the frames `encode()` produces for that message (type byte,
msgpack header, array buffers) with the same copy semantics (copy=False both ways);
the only difference is the codec's work: encode on the sender, decode + validation on
the receiver. Codec and raw trials alternate within each repeat, so the ratios come
from the same run under the same load. Two discarded trials of each mode come first: both
processes' rates climb for about a second after start, and the first case would measure it.

Two socket layers: `sync` (blocking pyzmq, the strictest case: nothing hides the codec
cost) and `asyncio` (PushStream/PullStream, the path nodes use, vs raw zmq.asyncio).
Also measured in-process: encode and decode time per message (no sockets).

    .venv/bin/python bench/transport.py --quick --out bench/results/transport.json
    .venv/bin/python bench/transport.py --out bench/results/transport.json        # longer trials
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchinfo, also when loaded as a module

import numpy as np  # noqa: E402
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402
from benchinfo import git_state  # noqa: E402

import laminar.protocol  # noqa: E402,F401
from laminar.protocol.data import Trajectory  # noqa: E402
from laminar.transport.codec import decode, encode  # noqa: E402
from laminar.transport.sockets import SocketOptions  # noqa: E402
from laminar.transport.streams import PullStream, PushStream  # noqa: E402

SIZES = {"1k": 1024, "8k": 8192}
PROMPT_TOKENS = 256


def make_trajectory(n: int) -> Trajectory:
    rng = np.random.default_rng(n)
    return Trajectory(
        uid="grp-000123/3",
        group_id="grp-000123",
        prompt_uid="gsm8k-train-004711",
        sample_index=3,
        prompt_ids=rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int32),
        response_ids=rng.integers(0, 150_000, n, dtype=np.int32),
        logprobs=-rng.exponential(1.0, n).astype(np.float32),
        version=17,
        finish_reason="stop",
        reward=1.0,
        reward_info={"correct": 1.0, "format": 1.0},
        rollout_id="rollout-3",
        timings={"t_start": 1.7e9, "t_first_token": 1.7e9 + 0.21, "t_finish": 1.7e9 + 9.8},
        row={"answer": "42"},
        resumed=1,
        staleness_at_finish=2,
    )


def frame_bytes(frames: list[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


# ---- receiver process ------------------------------------------------------------------------


def _recv_sync(sock: zmq.Socket, mode: str, warm: int, n: int) -> tuple[float, float, Any]:
    last = None
    for _ in range(warm):
        last = sock.recv_multipart(copy=False)
    t0, c0 = time.perf_counter(), time.process_time()
    if mode == "codec":
        for _ in range(n):
            last = decode(sock.recv_multipart(copy=False))
    else:
        for _ in range(n):
            last = sock.recv_multipart(copy=False)
    return time.perf_counter() - t0, time.process_time() - c0, last


async def _recv_async(
    ctx: zmq.asyncio.Context, endpoint: str, mode: str, warm: int, n: int, ready
) -> tuple[float, float, Any]:
    if mode == "codec":
        pull = PullStream(ctx, endpoint, bind=True, opts=SocketOptions())
        ready(pull._sock.last_endpoint.decode())
        for _ in range(warm):
            last = await pull.recv()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            last = await pull.recv()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        pull.close()
        return dt, cpu, last
    sock = ctx.socket(zmq.PULL)
    sock.linger = 0
    sock.bind(endpoint)
    ready(sock.last_endpoint.decode())
    for _ in range(warm):
        last = await sock.recv_multipart(copy=False)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        last = await sock.recv_multipart(copy=False)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    sock.close()
    return dt, cpu, last


def receiver(conn) -> None:
    """Serve trials until told to stop: bind, report the endpoint, receive, report the time."""
    ctx = zmq.Context()
    actx = zmq.asyncio.Context()
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        _, api, endpoint, mode, warm, n, (n_tokens, ids_sum) = cmd
        if api == "sync":
            sock = ctx.socket(zmq.PULL)
            sock.linger = 0
            sock.bind(endpoint)
            conn.send(("ready", sock.last_endpoint.decode()))
            dt, cpu, last = _recv_sync(sock, mode, warm, n)
            sock.close()
        else:
            dt, cpu, last = asyncio.run(
                _recv_async(actx, endpoint, mode, warm, n, lambda ep: conn.send(("ready", ep)))
            )
        if mode == "codec":  # the last message decoded into the trajectory that was sent
            ok = isinstance(last, Trajectory) and len(last.response_ids) == n_tokens
            ok = ok and int(last.response_ids.sum(dtype=np.int64)) == ids_sum
        else:
            ok = len(last) == 5 and len(last[3].buffer) == 4 * n_tokens
        conn.send(("done", dt, cpu, bool(ok)))
    ctx.destroy(linger=0)
    actx.destroy(linger=0)


# ---- sender side ---------------------------------------------------------------------------------


def _send_sync(
    ctx: zmq.Context, endpoint: str, msg: Trajectory, frames: list[Any], mode: str, total: int
) -> tuple[float, zmq.Socket]:
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    t0 = time.perf_counter()
    if mode == "codec":
        for _ in range(total):
            sock.send_multipart(encode(msg), copy=False)
    else:
        for _ in range(total):
            sock.send_multipart(frames, copy=False)
    dt = time.perf_counter() - t0
    return dt, sock


async def _send_async(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    msg: Trajectory,
    frames: list[Any],
    mode: str,
    total: int,
):
    if mode == "codec":
        push = PushStream(ctx, endpoint, bind=False, opts=SocketOptions())
        t0 = time.perf_counter()
        for _ in range(total):
            await push.send(msg)
        return time.perf_counter() - t0, push._sock
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    t0 = time.perf_counter()
    for _ in range(total):
        await sock.send_multipart(frames, copy=False)
    return time.perf_counter() - t0, sock


def trial(
    conn,
    ctx,
    actx,
    api: str,
    transport: str,
    mode: str,
    msg: Trajectory,
    frames,
    warm: int,
    n: int,
    tmp: str,
) -> dict:
    bind = f"ipc://{tmp}/bench.sock" if transport == "ipc" else "tcp://127.0.0.1:*"
    expect = (len(msg.response_ids), int(msg.response_ids.sum(dtype=np.int64)))
    conn.send(("trial", api, bind, mode, warm, n, expect))
    tag, endpoint = conn.recv()
    assert tag == "ready"
    c0 = time.process_time()
    if api == "sync":
        send_s, sock = _send_sync(ctx, endpoint, msg, frames, mode, warm + n)
    else:
        send_s, sock = asyncio.run(_send_async(actx, endpoint, msg, frames, mode, warm + n))
    tag, recv_s, recv_cpu, ok = (
        conn.recv()
    )  # the receiver has every message: nothing left to linger on
    send_cpu = (
        time.process_time() - c0
    )  # this process's CPU (sender thread + zmq I/O thread) for warm + n
    sock.close(linger=0)
    assert tag == "done" and ok, "receiver got a wrong message"
    cpu_us = (send_cpu / (warm + n) + recv_cpu / n) * 1e6
    return {"msg_per_s": n / recv_s, "send_s": send_s, "recv_s": recv_s, "cpu_us_per_msg": cpu_us}


def stats(values: list[float]) -> dict:
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "values": values,
    }


def microbench(msg: Trajectory, seconds: float) -> dict:
    frames = [bytes(f) for f in encode(msg)]
    out = {}
    for name, fn in (("encode_us", lambda: encode(msg)), ("decode_us", lambda: decode(frames))):
        per = []
        for _ in range(3):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / 3:
                for _ in range(200):
                    fn()
                n += 200
            per.append((time.perf_counter() - t0) / n * 1e6)
        out[name] = stats(per)
    return out


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "numpy": np.__version__,
        "msgpack": __import__("msgpack").version,
        **git_state(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short trials (< 1 min on 2 cores)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--trial-s", type=float, default=None, help="target seconds per trial")
    ap.add_argument("--apis", default="sync,asyncio")
    ap.add_argument("--out", default=None, help="write JSON here")
    args = ap.parse_args()
    repeats = args.repeats or (7 if args.quick else 9)
    trial_s = args.trial_s or (0.25 if args.quick else 0.8)
    apis = args.apis.split(",")
    t_start = time.perf_counter()
    info = machine()  # load average before we add our own

    import tempfile

    tmp = tempfile.mkdtemp(prefix="lam-bench-", dir="/tmp")
    mpctx = mp.get_context("spawn")
    conn, child_conn = mpctx.Pipe()
    proc = mpctx.Process(target=receiver, args=(child_conn,), daemon=True)
    proc.start()
    ctx, actx = zmq.Context(), zmq.asyncio.Context()
    results, summary = [], {}
    try:
        for size, n_tokens in SIZES.items():
            msg = make_trajectory(n_tokens)
            frames = encode(msg)
            nbytes = frame_bytes(frames)
            # calibrate the message count so one trial lasts about trial_s
            rate = trial(conn, ctx, actx, "sync", "ipc", "raw", msg, frames, 200, 2000, tmp)[
                "msg_per_s"
            ]
            n = max(1000, int(rate * trial_s))
            if size == next(iter(SIZES)):
                # discarded warm-up: both processes' rates climb for about a second after start
                # (allocator, caches, the receiver's imports settling); without it the first
                # case's early repeats measure the climb, which hits whichever mode runs first
                for mode in ("codec", "raw") * 2:
                    trial(conn, ctx, actx, "sync", "ipc", mode, msg, frames, 200, n, tmp)
            # in-process costs, measured once the receiver is up (its start-up no longer competes)
            micro = microbench(msg, 0.3 if args.quick else 1.0)
            summary[f"encode_us_{size}"] = round(micro["encode_us"]["median"], 2)
            summary[f"decode_us_{size}"] = round(micro["decode_us"]["median"], 2)
            results.append({"name": f"micro_{size}", "bytes_per_msg": nbytes, **micro})
            for api in apis:
                n_api = n if api == "sync" else max(1000, n // 2)
                for transport in ("ipc", "tcp"):
                    runs: dict[str, list[float]] = {"codec": [], "raw": []}
                    cpus: dict[str, list[float]] = {"codec": [], "raw": []}
                    ratios = []
                    for rep in range(repeats):
                        # ABBA order: a load that drifts during the run hits codec and raw alike
                        for mode in ("codec", "raw") if rep % 2 == 0 else ("raw", "codec"):
                            r = trial(
                                conn,
                                ctx,
                                actx,
                                api,
                                transport,
                                mode,
                                msg,
                                frames,
                                n_api // 10,
                                n_api,
                                tmp,
                            )
                            runs[mode].append(r["msg_per_s"])
                            cpus[mode].append(r["cpu_us_per_msg"])
                        ratios.append(runs["codec"][-1] / runs["raw"][-1])
                    key = f"{size}_{transport}" + ("" if api == "sync" else "_asyncio")
                    for mode in ("codec", "raw"):
                        results.append(
                            {
                                "name": f"{mode}_{key}",
                                "api": api,
                                "transport": transport,
                                "size": size,
                                "mode": mode,
                                "messages": n_api,
                                "bytes_per_msg": nbytes,
                                "msg_per_s": stats(runs[mode]),
                                "gb_per_s": stats([r * nbytes / 1e9 for r in runs[mode]]),
                                "cpu_us_per_msg": stats(cpus[mode]),
                            }
                        )
                        summary[f"{mode}_cpu_us_per_msg_{key}"] = round(
                            statistics.median(cpus[mode]), 1
                        )
                        summary[f"{mode}_msg_per_s_{key}"] = round(statistics.median(runs[mode]))
                        summary[f"{mode}_gb_per_s_{key}"] = round(
                            statistics.median(runs[mode]) * nbytes / 1e9, 3
                        )
                    summary[f"codec_vs_raw_msg_rate_{key}"] = round(
                        statistics.median(runs["codec"]) / statistics.median(runs["raw"]), 3
                    )
                    # load-robust companion: messages per CPU-second (both processes, all threads),
                    # codec / raw
                    summary[f"codec_vs_raw_cpu_rate_{key}"] = round(
                        statistics.median(cpus["raw"]) / statistics.median(cpus["codec"]), 3
                    )
                    results.append({"name": f"ratio_{key}", "codec_vs_raw_msg_rate": stats(ratios)})
    finally:
        conn.send(("stop",))
        proc.join(10)
        ctx.destroy(linger=0)
        actx.destroy(linger=0)
    out = {
        "benchmark": "transport",
        "config": {
            "quick": args.quick,
            "repeats": repeats,
            "trial_s": trial_s,
            "apis": apis,
            "sizes": SIZES,
            "prompt_tokens": PROMPT_TOKENS,
            "socket": "PUSH/PULL, default HWM, copy=False both ways",
        },
        "machine": info,
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.perf_counter() - t_start, 1),
        "summary": summary,
        "results": results,
    }
    print_table(summary, apis)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out} ({out['wall_s']} s)")


def print_table(summary: dict, apis: list[str]) -> None:
    print(
        f"{'case':<22}{'codec msg/s':>13}{'raw msg/s':>13}{'codec GB/s':>12}{'raw GB/s':>10}"
        f"{'codec/raw':>11}"
        f"{'cpu us/msg codec':>18}{'raw':>7}{'cpu ratio':>11}"
    )
    for api in apis:
        for size in SIZES:
            for transport in ("ipc", "tcp"):
                key = f"{size}_{transport}" + ("" if api == "sync" else "_asyncio")
                print(
                    f"{key:<22}{summary[f'codec_msg_per_s_{key}']:>13,}{summary[f'raw_msg_per_s_{key}']:>13,}"
                    f"{summary[f'codec_gb_per_s_{key}']:>12.3f}{summary[f'raw_gb_per_s_{key}']:>10.3f}"
                    f"{summary[f'codec_vs_raw_msg_rate_{key}']:>11.3f}{summary[f'codec_cpu_us_per_msg_{key}']:>18.1f}"
                    f"{summary[f'raw_cpu_us_per_msg_{key}']:>7.1f}{summary[f'codec_vs_raw_cpu_rate_{key}']:>11.3f}"
                )
    for size in SIZES:
        print(
            f"in-process {size}: encode {summary[f'encode_us_{size}']} us, decode "
            f"{summary[f'decode_us_{size}']} us"
        )


if __name__ == "__main__":
    main()
