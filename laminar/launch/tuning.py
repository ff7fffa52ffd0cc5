"""What every node process sets before (and as) its nodes start.

    setup_process(cfg)                     logging, the garbage collector's thresholds
    prefetch_imports(heavy_imports(cfg, role))   torch & co. on a thread while the node connects
    lower_priority(cfg, role)              cluster.nice, once the node is ready
    use_uvloop()                           the event loop of the next asyncio.run

Used by laminar/launch/node.py (and bench/ scripts that run nodes in-process).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from pathlib import Path

from laminar.config import LaminarConfig, Role


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
    """Add cluster.nice[role] to the niceness of every thread of this process, and to its
    autogroup's when it leads its own session (never to a shell session a node was started from
    by hand)."""
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


def heavy_imports(cfg: LaminarConfig, role: Role) -> list[str]:
    """The slow imports a role will make during setup (torch ~1.2 CPU-s; transformers' model code
    ~2.1 more, only where the model cannot load module-free, models/decoder_lm.py): a torch rollout
    imports them only after the buffer answered, so started early they overlap the wait for the
    buffer instead of following it."""
    if role != "rollout" or cfg.rollout.engine != "torch":
        return []
    # the GPU weight paths' group and store (laminar/weights/group.py)
    dist = ["torch.distributed"] if cfg.rollout.weights in ("nccl", "cuda_ipc") else []
    if cfg.rollout.torch_forward != "hf":
        # module-free start; a model the lean forward cannot run imports transformers later
        return ["torch", *dist, "safetensors.torch", "tokenizers"]
    return ["torch", *dist, "transformers.modeling_utils", "transformers.tokenization_utils_fast"]


def prefetch_imports(modules: list[str]) -> None:
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
