"""Process-level entry points behind the CLI: one node, a whole host, status.

`laminar run` writes the resolved config into the run directory, starts one child
process per node (`python -m laminar node ...`, each in its own session so the
launcher alone decides who gets signals), and supervises them:
  * the trainer exiting 0 means the job is done: the rest are stopped, exit 0;
  * any other exit (a crash, or a node stopping by itself) is reported with the
    node's name, pid and code, the rest are stopped, exit 1;
  * Ctrl-C / SIGTERM: every child gets SIGTERM, then SIGKILL after the stop budget.

`laminar node` runs one node (or `--count` of them sharing one zmq context) with
`run_nodes`; `laminar status` asks the manager with a one-off RpcClient.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from laminar.config import ROLES, LaminarConfig, Role, load_config, write_resolved

if TYPE_CHECKING:  # the node runtime (zmq) loads inside the commands that need it
    from laminar.node import Node
    from laminar.protocol.manager import StatusReply


def _setup_process(cfg: LaminarConfig) -> None:
    from laminar.logs import configure_logging

    configure_logging(cfg.logging.level, cfg.logging.json_logs)


def _use_uvloop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        pass


async def _watch_parent(nodes: list[Node], parent: int) -> None:
    # a child of `laminar run` stops if its launcher vanished (e.g. kill -9)
    while True:
        await asyncio.sleep(1.0)  # a timer
        if os.getppid() != parent:
            for n in nodes:
                n.request_stop("launcher died")
            return


def node_main(
    role: Role, config: str | None, overrides: list[str], index: int = 0, count: int = 1
) -> int:
    cfg = load_config(config, overrides)
    _setup_process(cfg)
    from laminar.node import NodeFailed, node_class, run_nodes
    from laminar.supervise import detached_spawn
    from laminar.transport.sockets import new_context

    cls = node_class(role)

    async def amain() -> None:
        # several nodes in one process (emulated scale) share one zmq context: one I/O thread, not N
        ctx = new_context() if count > 1 else None
        nodes = [cls(cfg, index=i, ctx=ctx) for i in range(index, index + count)]
        parent = os.environ.get("LAMINAR_PARENT_PID")
        watcher = (
            detached_spawn(_watch_parent(nodes, int(parent)), "watch-parent") if parent else None
        )
        try:
            await run_nodes(nodes)
        finally:
            if watcher:
                watcher.cancel()
            if ctx is not None:
                ctx.destroy(linger=0)

    _use_uvloop()
    try:
        asyncio.run(amain())
    except NodeFailed as exc:
        print(f"laminar node {role}-{index}: FAILED: {exc} ({exc.__cause__!r})", file=sys.stderr)
        return 1
    return 0


def _node_commands(cfg: LaminarConfig, config_path: Path) -> list[tuple[str, list[str]]]:
    cmds = []
    for role in ROLES:
        n = cfg.cluster.roles.get(role, 0)
        per = cfg.cluster.rollouts_per_process if role == "rollout" else 1
        for start in range(0, n, per):
            count = min(per, n - start)
            name = f"{role}-{start}" if count == 1 else f"{role}-{start}..{start + count - 1}"
            cmd = [sys.executable, "-m", "laminar", "node", "--role", role, "--index", str(start),
                   "--count", str(count), "--config", str(config_path)]  # fmt: skip
            cmds.append((name, cmd))
    return cmds


def run_main(config: str | None, overrides: list[str]) -> int:
    cfg = load_config(config, overrides)
    run_dir = cfg.resolved_run_dir()
    cfg_path = write_resolved(cfg, run_dir)
    print(f"laminar run: {cfg.name} mode={cfg.mode} run_dir={run_dir}", file=sys.stderr, flush=True)
    env = dict(os.environ, LAMINAR_PARENT_PID=str(os.getpid()), PYTHONUNBUFFERED="1")
    if cfg.cluster.threads_per_process:
        n = str(cfg.cluster.threads_per_process)
        env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n)
    children: dict[str, subprocess.Popen[bytes]] = {}
    stop_requested: dict[str, int | None] = {"sig": None}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop_requested["sig"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for name, cmd in _node_commands(cfg, cfg_path):
        children[name] = subprocess.Popen(cmd, env=env, start_new_session=True)
        print(f"laminar run: started {name} pid={children[name].pid}", file=sys.stderr, flush=True)
    (run_dir / "pids.json").write_text(json.dumps({k: p.pid for k, p in children.items()}))

    code = 0
    try:
        while True:
            sig = stop_requested["sig"]
            if sig is not None:
                print(
                    f"laminar run: signal {signal.Signals(sig).name}, stopping all nodes",
                    file=sys.stderr,
                )
                break
            ended = {k: p.returncode for k, p in children.items() if p.poll() is not None}
            trainer_done = any(k.startswith("trainer") and rc == 0 for k, rc in ended.items())
            failed = {k: rc for k, rc in ended.items() if not (k.startswith("trainer") and rc == 0)}
            if failed:
                for k, rc in failed.items():
                    print(
                        f"laminar run: node {k} (pid {children[k].pid}) exited with code {rc}",
                        file=sys.stderr,
                    )
                code = 1
                break
            if (
                trainer_done
                and all(rc == 0 for k, rc in ended.items() if k.startswith("trainer"))
                and all(k in ended for k in children if k.startswith("trainer"))
            ):
                print("laminar run: trainer finished; stopping the other nodes", file=sys.stderr)
                break
            time.sleep(0.2)  # polling child processes; no network wait here
    finally:
        code = max(code, _stop_children(children, cfg.transport.stop_timeout_s + 5))
    return code


def _stop_children(children: dict[str, subprocess.Popen[bytes]], timeout: float) -> int:
    alive = {k: p for k, p in children.items() if p.poll() is None}
    for p in alive.values():
        try:
            p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    code = 0
    for k, p in alive.items():
        try:
            rc = p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(
                f"laminar run: {k} (pid {p.pid}) did not stop in time; killing it", file=sys.stderr
            )
            p.kill()
            p.wait()
            code = 1
            continue
        if rc not in (0, -signal.SIGTERM):
            print(
                f"laminar run: {k} (pid {p.pid}) exited with code {rc} while stopping",
                file=sys.stderr,
            )
            code = 1
    return code


def fetch_status(cfg: LaminarConfig, timeout: float = 3.0) -> StatusReply:
    from laminar.protocol.manager import StatusReply, StatusRequest
    from laminar.transport.client import RpcClient
    from laminar.transport.security import security_from_config
    from laminar.transport.sockets import SocketOptions, TransportError, new_context

    async def ask() -> StatusReply:
        ctx = new_context()
        cli = RpcClient(ctx, cfg.endpoint("manager"), f"status-{os.getpid()}", "cli",
                        SocketOptions.from_config(cfg, security_from_config(cfg)))  # fmt: skip
        try:
            await cli.connect(timeout=timeout)
            reply = await cli.request(StatusRequest(), timeout=timeout, retries=0)
            if not isinstance(reply, StatusReply):
                raise TransportError(f"manager answered {type(reply).__name__}, not StatusReply")
            return reply
        finally:
            await cli.close()
            ctx.destroy(linger=0)

    return asyncio.run(ask())


def status_main(config: str | None, overrides: list[str], as_json: bool, timeout: float) -> int:
    cfg = load_config(config, overrides)
    from laminar.logs import configure_logging

    configure_logging("warning", cfg.logging.json_logs)
    from laminar.transport.sockets import TransportError

    try:
        reply = fetch_status(cfg, timeout)
    except TransportError as exc:
        print(
            f"laminar status: manager at {cfg.endpoint('manager')} did not answer: {exc}",
            file=sys.stderr,
        )
        return 1
    rows = []
    for e in sorted(reply.nodes, key=lambda e: (e.role, e.node_id)):
        s = e.status
        rows.append({
            "node": e.node_id, "role": e.role, "alive": e.alive, "pid": e.pid,
            "version": s.version if s else -1, "kv_use": round(s.kv_use, 3) if s else 0.0,
            "inflight": s.inflight if s else 0, "staleness": s.staleness if s else 0.0,
            "last_beat_s": e.last_beat_s,
        })  # fmt: skip
    if as_json:
        print(
            json.dumps(
                {"mode": reply.mode, "trainer_version": reply.trainer_version, "nodes": rows},
                indent=2,
            )
        )
        return 0
    cols = [
        "node",
        "role",
        "alive",
        "version",
        "kv_use",
        "inflight",
        "staleness",
        "last_beat_s",
        "pid",
    ]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) if rows else len(c) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    return 0
