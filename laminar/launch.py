"""Process-level entry points behind the CLI: one node, a whole host, status.

`laminar run [--resume | --overwrite]` first checks the inputs of every role it will
start (laminar/preflight.py: model.path, data.train/eval, reward.fn, env.fn) and what the
run directory holds (laminar/rundir.py): a finished run is refused unless --resume (nothing
left to train: exit 0) or --overwrite (deleted, started over); an unfinished one resumes and
says so. Both failures exit 2 before anything starts. Then it writes the resolved config into
the run directory, starts one child process per node (`python -m laminar node ...`, each in
its own session so the launcher alone decides who gets signals; its output is copied to
run_dir/logs/<node>.log and to this terminal), and supervises them (laminar/children.py):
  * the trainer exiting 0 means the job is done: the rest are stopped, exit 0 (a node that
    had to be killed on the way out is reported, the exit stays 0: the run completed);
  * any other exit (a crash, kill -9, or a node stopping by itself) is reported with the
    node's name, pid and code, and that node is restarted after a backoff while the rest
    keep running; more than cluster.restart.max_restarts deaths of one node within
    cluster.restart.window_s end the job: the rest are stopped, exit 1 naming the node.
    Restarts are counted in run_dir/supervisor.json, which `laminar status` shows;
  * Ctrl-C / SIGTERM: an ordered stop (trainer first: it checkpoints and commits while the
    buffer and relays are still up; then rollouts flush their outboxes; then buffer and
    tools, relays, manager), each stage SIGKILLed after its stop budget; exit 128 + the
    signal (130, 143).
The ipc directory (cluster.transport=ipc) is made 0700 and must be ours; on the way out its
sockets and the directory go.

`laminar node` runs one node (or `--count` of them sharing one zmq context) with
`run_nodes`; `laminar status` asks the manager with a one-off RpcClient.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import re
import signal
import stat
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from laminar.config import (
    ROLES,
    ConfigError,
    LaminarConfig,
    Role,
    config_warnings,
    load_config,
    write_resolved,
)

if TYPE_CHECKING:  # the node runtime (zmq) loads inside the commands that need it
    from laminar.children import ChildSpec
    from laminar.node import Node
    from laminar.protocol.manager import StatusReply

EXIT_OK = 0
"""The trainer finished (total_steps, or the data ran out), or there was nothing left to train."""
EXIT_FAILED = 1
"""A node crashed or stopped by itself before the trainer finished, or would not stop."""
EXIT_USAGE = 2
"""Nothing started: a config error, a missing input, or a run directory that needs a choice."""
# stopped by a signal: 128 + its number (130 for Ctrl-C, 143 for SIGTERM), as shells report it


def setup_process(cfg: LaminarConfig) -> None:
    """What every node process sets before its nodes start: logging, the garbage collector."""
    from laminar.logs import configure_logging

    configure_logging(cfg.logging.level, cfg.logging.json_logs)
    if cfg.cluster.gc_threshold is not None:  # a process of its own: its collector is ours to set
        gc.set_threshold(*cfg.cluster.gc_threshold)


AUTOGROUP = Path("/proc/self/autogroup")


def autogroup_nice(autogroup: Path = AUTOGROUP) -> int | None:
    """The niceness of this process's autogroup ("/autogroup-123 nice 0"), or None where there is
    none: a kernel without autogroup scheduling has no file, and a process still in the root group
    (a session never started by setsid, such as PID 1's) reads it empty."""
    try:
        return int(autogroup.read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def lower_priority(cfg: LaminarConfig, role: Role, autogroup: Path = AUTOGROUP) -> None:
    """Add cluster.nice[role] to the niceness of every thread of this process, and to its autogroup's
    when it leads its own session (never to a shell session a node was started from by hand)."""
    n = cfg.cluster.nice.get(role, 0)
    if not n:
        return
    # on Linux niceness is per thread (new ones inherit their maker's)
    tasks = Path("/proc/self/task")
    for tid in [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [0]:
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + n))
    if os.getsid(0) != os.getpid():
        return
    group = autogroup_nice(autogroup)
    if group is None:
        logging.getLogger(__name__).info("cluster.nice: no autogroup at %s, left as is", autogroup)
        return
    try:
        autogroup.write_text(str(min(19, group + n)))
    except OSError as exc:
        logging.getLogger(__name__).info("cluster.nice: autogroup left as is (%s)", exc)


def _heavy_imports(cfg: LaminarConfig, role: Role) -> list[str]:
    """The slow imports a role will make during setup (torch ~1.2 CPU-s; transformers' model code
    ~2.1 more, only where the model cannot load module-free, models/decoder_lm.py): a torch rollout
    imports them only after the buffer answered, so started early they overlap the wait for the
    buffer instead of following it."""
    if role != "rollout" or cfg.rollout.engine != "torch":
        return []
    if cfg.rollout.torch_forward != "hf":
        # module-free start; a model the lean forward cannot run imports transformers later
        return ["torch", "safetensors.torch", "tokenizers"]
    return ["torch", "transformers.modeling_utils", "transformers.tokenization_utils_fast"]


def _prefetch_imports(modules: list[str]) -> None:
    """Import `modules` on a daemon thread. Python's per-module import locks make a later import of
    the same module in the node wait for this one to finish, never run it twice; an error here is
    ignored (the node's own import raises it where it belongs)."""
    import importlib
    import threading

    from laminar.models.tiny import IMPORT_LOCK

    def run() -> None:
        for name in modules:
            lock = IMPORT_LOCK if name.split(".")[0] == "transformers" else contextlib.nullcontext()
            try:
                with lock:
                    importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the node's own import reports it
                return

    if modules:
        threading.Thread(target=run, name="prefetch-imports", daemon=True).start()


def use_uvloop() -> None:
    """uvloop's event loop for the next asyncio.run (every node process runs on it)."""
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
    setup_process(cfg)
    prepare_ipc_dir(cfg)
    from laminar.node import NodeFailed, node_class, run_nodes
    from laminar.supervise import EXIT_PERMANENT, PermanentFailure, detached_spawn
    from laminar.transport.sockets import new_context

    cls = node_class(role)
    # after the node's own light imports (numpy, zmq): the thread only ever waits on torch's
    _prefetch_imports(_heavy_imports(cfg, role))

    async def amain() -> None:
        # several nodes in one process (emulated scale) share one zmq context: one I/O thread, not N
        ctx = new_context() if count > 1 else None
        nodes = [cls(cfg, index=i, ctx=ctx) for i in range(index, index + count)]
        parent = os.environ.get("LAMINAR_PARENT_PID")
        watcher = (
            detached_spawn(_watch_parent(nodes, int(parent)), "watch-parent") if parent else None
        )

        async def yield_once_ready() -> None:
            # not before: every role's start is on the way to the first step (the trainer waits for
            # the rollouts' first batch), and a rollout that yields while starting only delays it
            await asyncio.gather(*(n.ready.wait() for n in nodes))
            lower_priority(cfg, role)

        renice = detached_spawn(yield_once_ready(), "nice") if cfg.cluster.nice.get(role) else None
        try:
            await run_nodes(nodes)
        finally:
            for task in (watcher, renice):
                if task:
                    task.cancel()
            if ctx is not None:
                ctx.destroy(linger=0)

    use_uvloop()
    try:
        asyncio.run(amain())
    except NodeFailed as exc:
        print(f"laminar node {role}-{index}: FAILED: {exc} ({exc.__cause__!r})", file=sys.stderr)
        return EXIT_PERMANENT if isinstance(exc.__cause__, PermanentFailure) else EXIT_FAILED
    return 0


def _node_specs(cfg: LaminarConfig, config_path: Path) -> list[ChildSpec]:
    from laminar.children import ChildSpec

    specs = []
    for role in ROLES:
        n = cfg.cluster.roles.get(role, 0)
        per = cfg.cluster.rollouts_per_process if role == "rollout" else 1
        for start in range(0, n, per):
            count = min(per, n - start)
            name = f"{role}-{start}" if count == 1 else f"{role}-{start}..{start + count - 1}"
            cmd = [
                sys.executable,
                "-m",
                "laminar",
                "node",
                "--role",
                role,
                "--index",
                str(start),
                "--count",
                str(count),
                "--config",
                str(config_path),
            ]
            ids = [f"{role}-{i}" for i in range(start, start + count)]
            specs.append(ChildSpec(name, role, ids, cmd))
    return specs


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
        say(
            f"laminar run: {prior.run_dir} is already finished ({prior.why}); nothing to train. "
            f"Raise trainer.total_steps above {prior.step} to train further."
        )
        return False
    if prior.state == "unfinished":
        say(
            f"laminar run: resuming the unfinished run in {prior.run_dir} ({prior.why}); "
            "--overwrite starts over instead"
        )
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
    prepare_ipc_dir(cfg)  # before any child binds a socket in it
    print(f"laminar run: {cfg.name} mode={cfg.mode} run_dir={run_dir}", file=sys.stderr, flush=True)
    for warning in config_warnings(cfg):
        print(f"laminar run: config warning: {warning}", file=sys.stderr, flush=True)
    env = dict(os.environ, LAMINAR_PARENT_PID=str(os.getpid()), PYTHONUNBUFFERED="1")
    if cfg.cluster.threads_per_process:
        n = str(cfg.cluster.threads_per_process)
        env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n)
    from laminar.children import Children, Finished, GivingUp

    kids = Children(
        _node_specs(cfg, cfg_path),
        env,
        run_dir,
        cfg.cluster.restart,
        stop_timeout_s=cfg.transport.stop_timeout_s + 5,
    )
    stop_requested: dict[str, int | None] = {"sig": None}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop_requested["sig"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    from laminar.progress import Progress

    every = cfg.logging.progress_every_s
    # the nodes' logs share the terminal (children._tee): one line per tick, not a redrawn line
    progress = (
        Progress(run_dir, cfg.mode, time.time(), every, cfg=cfg, overwrite=False)
        if every > 0
        else None
    )

    code = EXIT_OK
    trainer_finished = False
    try:
        kids.start_all()
        while True:
            sig = stop_requested["sig"]
            if sig is not None:
                print(
                    f"laminar run: signal {signal.Signals(sig).name}, stopping all nodes "
                    "(trainer first, then rollouts, buffer, relays, manager)",
                    file=sys.stderr,
                )
                code = 128 + sig
                break
            end = kids.poll()
            if isinstance(end, GivingUp):
                code = EXIT_FAILED
                break
            if isinstance(end, Finished):
                print("laminar run: trainer finished; stopping the other nodes", file=sys.stderr)
                trainer_finished = True
                break
            if progress is not None:
                progress.tick()  # the live progress line (laminar/progress.py)
            time.sleep(0.2)  # polling child processes; no network wait here
    except BaseException:
        kids.kill_all()  # the launcher itself failed: leave nothing running behind it
        raise
    finally:
        clean = kids.stop()
        _remove_ipc_dir(cfg)
        if not clean and trainer_finished:
            print(
                "laminar run: the run itself completed (final checkpoint written); exit 0",
                file=sys.stderr,
            )
        elif not clean and code == EXIT_OK:
            code = EXIT_FAILED
        if progress is not None:
            progress.tick(final=True)
    return code


def prepare_ipc_dir(cfg: LaminarConfig) -> None:
    """Make the ipc directory private (0700) before any socket is bound in it; refuse one
    that another user owns or that is not a plain directory (IpcDirError, exit 2)."""
    if cfg.cluster.transport != "ipc":
        return
    root = Path(cfg.ipc_dir())
    root.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    st = root.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise IpcDirError(
            f"ipc directory {root} is not a directory (a symlink or a file); "
            "remove it or set cluster.ipc_dir"
        )
    if st.st_uid != os.getuid():
        raise IpcDirError(
            f"ipc directory {root} is owned by uid {st.st_uid}, not by you "
            f"(uid {os.getuid()}); set cluster.ipc_dir to a directory of your own"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        root.chmod(0o700)  # ours but open to others (an older laminar made it): close it


class IpcDirError(ConfigError):
    """The ipc directory is not ours to use (reported like a config error: exit 2)."""


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
        cli = RpcClient(
            ctx,
            cfg.endpoint("manager"),
            f"status-{os.getpid()}",
            "cli",
            SocketOptions.from_config(cfg, security_from_config(cfg)),
        )
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
    restarts = restarts_by_node(cfg)
    rows = []
    for e in sorted(reply.nodes, key=lambda e: (e.role, e.node_id)):
        s = e.status
        rows.append(
            {
                "node": e.node_id,
                "role": e.role,
                "alive": e.alive,
                "pid": e.pid,
                "version": s.version if s else -1,
                "kv_use": round(s.kv_use, 3) if s else 0.0,
                "inflight": s.inflight if s else 0,
                "staleness": s.staleness if s else 0.0,
                "last_beat_s": e.last_beat_s,
                "warnings": list(s.extra.get("warnings", [])) if s else [],
                "restarts": restarts.get(e.node_id, 0),
            }
        )
    if as_json:
        print(
            json.dumps(
                {
                    "mode": reply.mode,
                    "trainer_version": reply.trainer_version,
                    "nodes": rows,
                    "restarts": sum(restarts.values()),
                },
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
        "restarts",
    ]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) if rows else len(c) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    for e in reply.nodes:  # e.g. the buffer's stall warning (laminar/buffer/health.py)
        for w in e.status.extra.get("warnings", []) if e.status else []:
            print(f"WARNING {e.node_id}: {w}")
    return 0


def restarts_by_node(cfg: LaminarConfig) -> dict[str, int]:
    """Restarts per node id, from the launcher's run_dir/supervisor.json (none without one:
    nodes started by hand or by host_daemons.sh, whose restarts are in its own output)."""
    path = cfg.resolved_run_dir() / "supervisor.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {nid: int(v["restarts"]) for v in state["nodes"].values() for nid in v["node_ids"]}
