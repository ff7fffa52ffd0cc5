"""`laminar run`: every node of the config on this host, as child processes, supervised.

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
  * a run that cannot train (samples keep failing or being refused and none became trainable
    for cluster.no_progress_timeout_s once prompts were served; laminar/launch/no_progress.py,
    from the buffer's figures): the top reasons with their counts, the nodes are stopped, exit 1;
  * Ctrl-C / SIGTERM: an ordered stop (trainer first: it checkpoints and commits while the
    buffer and relays are still up; then rollouts flush their outboxes; then buffer and
    tools, relays, manager), each stage SIGKILLed after its stop budget; exit 128 + the
    signal (130, 143).
The ipc directory (cluster.transport=ipc) is made 0700 and must be ours; on the way out its
sockets and the directory go (laminar/launch/ipc_dir.py).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from laminar.config import (
    ROLES,
    LaminarConfig,
    Role,
    config_warnings,
    load_config,
    write_resolved,
)
from laminar.launch.ipc_dir import prepare_ipc_dir, remove_ipc_dir
from laminar.supervise import EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:  # the children's supervisor and the watch load inside run_main
    from laminar.children import ChildSpec
    from laminar.launch.no_progress import NoProgressWatch


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
            gone = f"deleted the previous run in {prior.run_dir} ({prior.why})"
            say(f"laminar run: --overwrite: {gone}")
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


def _plan_fits(cfg: LaminarConfig) -> bool:
    """The memory plan of a config whose processes use this host's GPUs (laminar/plan): False,
    with the table and a line naming process, figure and setting, when one does not fit."""
    from laminar.plan.command import check_before_start
    from laminar.plan.memory import format_plan, refusal

    plan = check_before_start(cfg, None)
    if plan is None or plan.fits:
        return True
    print(format_plan(plan), file=sys.stderr)
    print(
        f"laminar run: refusing to start: {refusal(plan)} (--skip-plan starts anyway)",
        file=sys.stderr,
        flush=True,
    )
    return False


def _no_progress_watch(cfg: LaminarConfig) -> NoProgressWatch | None:
    """The watch that stops a run that cannot train (None: cluster.no_progress_timeout_s off).
    Called before anything is written into the run directory: an unfinished run there resumes."""
    from laminar.launch.no_progress import NoProgressWatch
    from laminar.rundir import inspect_run

    timeout = cfg.cluster.no_progress_timeout_s
    if not timeout:
        return None
    return NoProgressWatch(timeout, resumed=inspect_run(cfg).state == "unfinished")


def _judge(cfg: LaminarConfig, watch: NoProgressWatch | None) -> str | None:
    """The watch's verdict from the buffer's latest figures, when a look is due; a buffer that
    does not answer (starting, restarting, on another host out of reach) is no verdict."""
    if watch is None or not watch.due():
        return None
    from laminar.launch.status import fetch_buffer_stats
    from laminar.transport.sockets import TransportError

    try:
        stats = fetch_buffer_stats(cfg, timeout=1.0)
    except TransportError:
        return None
    return watch.observe(stats)


def run_main(
    config: str | None,
    overrides: list[str],
    resume: bool = False,
    overwrite: bool = False,
    skip_plan: bool = False,
) -> int:
    cfg = load_config(config, overrides)
    from laminar.preflight import check_inputs

    check_inputs(cfg, _started_roles(cfg))  # model, data, reward: one line each, nothing started
    if not skip_plan and not _plan_fits(cfg):
        return EXIT_FAILED
    from laminar.trainer.logger import require_wandb

    # logging.wandb without wandb installed: refuse before any node starts
    require_wandb(cfg.logging)
    if not _prepare_run_dir(cfg, resume, overwrite):
        return EXIT_OK
    watch = _no_progress_watch(cfg)
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
    from laminar.launch.status import fetch_status
    from laminar.progress import Progress

    every = cfg.logging.progress_every_s
    # the nodes' logs share the terminal (children._tee): one line per tick, not a redrawn line
    progress = (
        Progress(
            run_dir,
            cfg.mode,
            time.time(),
            every,
            total_steps=cfg.trainer.total_steps,
            status=functools.partial(fetch_status, cfg, timeout=0.5),
            overwrite=False,
        )
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
            try:
                verdict = _judge(cfg, watch)
            except Exception as exc:  # noqa: BLE001 - e.g. no key to ask the buffer with
                say_off = f"cannot ask the buffer ({type(exc).__name__}: {exc})"
                print(f"laminar run: the no-progress watch is off: {say_off}", file=sys.stderr)
                watch = verdict = None
            if verdict is not None:
                print(f"laminar run: {verdict}\nlaminar run: stopping all nodes", file=sys.stderr)
                code = EXIT_FAILED
                break
            if progress is not None:
                progress.tick()  # the live progress line (laminar/progress.py)
            time.sleep(0.2)  # polling child processes; no network wait here
    except BaseException:
        kids.kill_all()  # the launcher itself failed: leave nothing running behind it
        raise
    finally:
        clean = kids.stop()
        remove_ipc_dir(cfg)
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
