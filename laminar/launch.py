"""Process-level entry points behind the CLI: one node, a whole host, status.

`laminar run [--resume | --overwrite]` first checks the inputs of every role it will
start (laminar/preflight.py: model.path, data.train/eval, reward.fn, env.fn) and what the
run directory holds (laminar/rundir.py): a finished run is refused unless --resume (nothing
left to train: exit 0) or --overwrite (deleted, started over); an unfinished one resumes and
says so. Both failures exit 2 before anything starts. Then it writes the resolved config into
the run directory, starts one child process per node (`python -m laminar node ...`, each in
its own session so the launcher alone decides who gets signals; its output is copied to
run_dir/logs/<node>.log and to this terminal), and supervises them:
  * the trainer exiting 0 means the job is done: the rest are stopped, exit 0 (a node that
    had to be killed on the way out is reported, the exit stays 0: the run completed);
  * any other exit (a crash, or a node stopping by itself) is reported with the
    node's name, pid and code, the rest are stopped, exit 1;
  * Ctrl-C / SIGTERM: every child gets SIGTERM, then SIGKILL after the stop budget; exit
    128 + the signal (130, 143).
On the way out the ipc sockets and their directory go (cluster.transport=ipc).

`laminar node` runs one node (or `--count` of them sharing one zmq context) with
`run_nodes`; `laminar status` asks the manager with a one-off RpcClient.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, BinaryIO

from laminar.config import ROLES, LaminarConfig, Role, load_config, write_resolved

if TYPE_CHECKING:  # the node runtime (zmq) loads inside the commands that need it
    from laminar.node import Node
    from laminar.protocol.manager import StatusReply

EXIT_OK = 0
"""The trainer finished (total_steps, or the data ran out), or there was nothing left to train."""
EXIT_FAILED = 1
"""A node crashed or stopped by itself before the trainer finished, or would not stop."""
EXIT_USAGE = 2
"""Nothing started: a config error, a missing input, or a run directory that needs a choice."""
# stopped by a signal: 128 + its number (130 for Ctrl-C, 143 for SIGTERM), as shells report it


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
    if "LAMINAR_PARENT_PID" not in os.environ:  # `laminar run` checked every role already
        from laminar.preflight import check_inputs

        check_inputs(cfg, [role])
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


def _started_roles(cfg: LaminarConfig) -> list[Role]:
    return [r for r in ROLES if cfg.cluster.roles.get(r, 0) > 0]


def _prepare_run_dir(cfg: LaminarConfig, resume: bool, overwrite: bool) -> bool:
    """Say what happens to the run directory; False when there is nothing to run (a finished
    run with --resume). Raises RunDirError (exit 2) where the user must choose."""
    from laminar.rundir import RunDirError, clear_run, inspect_run, refusal

    prior = inspect_run(cfg)
    say = functools.partial(print, file=sys.stderr, flush=True)
    if overwrite:
        if prior.state != "new":
            clear_run(prior.run_dir)
            say(
                f"laminar run: --overwrite: deleted the previous run in {prior.run_dir} ({prior.why})"
            )
        return True
    if prior.state == "finished":
        if not resume:
            raise RunDirError(refusal(prior))
        say(f"laminar run: {prior.run_dir} is already finished ({prior.why}); nothing to train. "
            f"Raise trainer.total_steps above {prior.step} to train further.")  # fmt: skip
        return False
    if prior.state == "unfinished":
        say(f"laminar run: resuming the unfinished run in {prior.run_dir} ({prior.why}); "
            "--overwrite starts over instead")  # fmt: skip
    elif resume:
        raise RunDirError(f"--resume: nothing to resume in {prior.run_dir} ({prior.why})")
    return True


def run_main(
    config: str | None, overrides: list[str], resume: bool = False, overwrite: bool = False
) -> int:
    cfg = load_config(config, overrides)
    from laminar.preflight import check_inputs

    check_inputs(cfg, _started_roles(cfg))  # model, data, reward: one line each, nothing started
    from laminar.trainer.logger import require_wandb

    require_wandb(cfg)  # logging.wandb without wandb installed: refuse before any node starts
    if not _prepare_run_dir(cfg, resume, overwrite):
        return EXIT_OK
    from laminar.logs import configure_logging

    configure_logging("warning", cfg.logging.json_logs)  # this process: the progress line's client
    run_dir = cfg.resolved_run_dir()
    if cfg.logging.json_logs is None:  # children write into the tee's pipe: log as this terminal
        cfg.logging.json_logs = not sys.stderr.isatty()
    cfg_path = write_resolved(cfg, run_dir)
    print(f"laminar run: {cfg.name} mode={cfg.mode} run_dir={run_dir}", file=sys.stderr, flush=True)
    env = dict(os.environ, LAMINAR_PARENT_PID=str(os.getpid()), PYTHONUNBUFFERED="1")
    if cfg.cluster.threads_per_process:
        n = str(cfg.cluster.threads_per_process)
        env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n)
    children: dict[str, subprocess.Popen[bytes]] = {}
    tees: list[threading.Thread] = []
    stop_requested: dict[str, int | None] = {"sig": None}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop_requested["sig"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    log_dir = run_dir / "logs"
    for name, cmd in _node_commands(cfg, cfg_path):
        children[name] = subprocess.Popen(cmd, env=env, start_new_session=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        tees.append(_tee(children[name], log_dir / f"{name}.log"))
        print(f"laminar run: started {name} pid={children[name].pid}", file=sys.stderr, flush=True)
    (run_dir / "pids.json").write_text(json.dumps({k: p.pid for k, p in children.items()}))
    from laminar.progress import Progress

    every = cfg.logging.progress_every_s
    # the nodes' logs share the terminal (_tee): one line per tick, not a redrawn line
    progress = (
        Progress(run_dir, cfg.mode, time.time(), every, cfg=cfg, overwrite=False)
        if every > 0
        else None
    )

    code = EXIT_OK
    trainer_finished = False
    try:
        while True:
            sig = stop_requested["sig"]
            if sig is not None:
                print(
                    f"laminar run: signal {signal.Signals(sig).name}, stopping all nodes",
                    file=sys.stderr,
                )
                code = 128 + sig
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
                code = EXIT_FAILED
                break
            if (
                trainer_done
                and all(rc == 0 for k, rc in ended.items() if k.startswith("trainer"))
                and all(k in ended for k in children if k.startswith("trainer"))
            ):
                print("laminar run: trainer finished; stopping the other nodes", file=sys.stderr)
                trainer_finished = True
                break
            if progress is not None:
                progress.tick()  # the live progress line (laminar/progress.py)
            time.sleep(0.2)  # polling child processes; no network wait here
    finally:
        unclean = _stop_children(children, cfg.transport.stop_timeout_s + 5)
        for t in tees:
            t.join(timeout=5.0)  # the children are gone: their pipes end
        _remove_ipc_dir(cfg)
        if unclean and trainer_finished:
            print("laminar run: the run itself completed (final checkpoint written); exit 0",
                  file=sys.stderr)  # fmt: skip
        elif unclean and code == EXIT_OK:
            code = EXIT_FAILED
        if progress is not None:
            progress.tick(final=True)
    return code


def _stop_children(children: dict[str, subprocess.Popen[bytes]], timeout: float) -> int:
    alive = {k: p for k, p in children.items() if p.poll() is None}
    for p in alive.values():
        try:
            p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    code = EXIT_OK
    for k, p in alive.items():
        try:
            rc = p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(
                f"laminar run: {k} (pid {p.pid}) did not stop in time; killing it", file=sys.stderr
            )
            p.kill()
            p.wait()
            code = EXIT_FAILED
            continue
        if rc not in (0, -signal.SIGTERM):
            print(
                f"laminar run: {k} (pid {p.pid}) exited with code {rc} while stopping",
                file=sys.stderr,
            )
            code = EXIT_FAILED
    return code


def _tee(proc: subprocess.Popen[bytes], log_path: Path) -> threading.Thread:
    """Copy a child's output to this process's stderr and to run_dir/logs/<node>.log (made at
    its first line: a node that says nothing leaves no file)."""
    assert proc.stdout is not None
    src = proc.stdout

    def pump() -> None:
        log: BinaryIO | None = None
        try:
            for line in iter(src.readline, b""):
                if log is None:
                    log_path.parent.mkdir(parents=True, exist_ok=True)
                    log = open(log_path, "ab")  # held across the loop, closed below
                log.write(line)
                log.flush()
                try:
                    sys.stderr.write(line.decode("utf-8", "replace"))
                    sys.stderr.flush()
                except (OSError, ValueError):  # our stderr went away: the log file still gets it
                    pass
        finally:
            if log is not None:
                log.close()
            src.close()

    t = threading.Thread(target=pump, name=f"tee-{log_path.stem}", daemon=True)
    t.start()
    return t


def _remove_ipc_dir(cfg: LaminarConfig) -> None:
    """After every child stopped: remove the sockets they bound (a killed one leaves its file)
    and the ipc directory once empty. Only `<service>-<index>.sock` sockets go: ipc_dir may be shared."""
    if cfg.cluster.transport != "ipc":
        return
    root = Path(cfg.ipc_dir())
    if not root.is_dir():
        return
    for f in root.iterdir():
        with contextlib.suppress(OSError):
            if re.fullmatch(r"[a-z_]+-\d+\.sock", f.name) and stat.S_ISSOCK(f.lstat().st_mode):
                f.unlink()
    with contextlib.suppress(OSError):
        root.rmdir()  # fails (and stays) while anything else is in it


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
            "last_beat_s": e.last_beat_s, "warnings": list(s.extra.get("warnings", [])) if s else [],
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
    for e in reply.nodes:  # e.g. the buffer's stall warning (laminar/buffer/health.py)
        for w in e.status.extra.get("warnings", []) if e.status else []:
            print(f"WARNING {e.node_id}: {w}")
    return 0
