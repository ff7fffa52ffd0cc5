"""What every bench records about the code it measured: the commit and whether the tree was dirty,
and how fast the box ran a fixed piece of Python meanwhile.

from benchinfo import git_state      # bench/ is the script's directory, so on sys.path
info = {**git_state(), ...}
ms = cpu_probe_ms()                  # the same code's CPU time: moves only with the box
"""

from __future__ import annotations

import statistics
import subprocess
import time
from pathlib import Path


def git(*args: str) -> str:
    """`git ARGS` in this checkout, stdout stripped; "" where git is missing or slow."""
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def git_state() -> dict[str, object]:
    """{"git_commit": HEAD, "git_dirty": tracked files changed}."""
    return {
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def _probe_work() -> int:
    d = {f"k{i}": i * 3 for i in range(20_000)}
    order = sorted(d.items(), key=lambda kv: -kv[1])
    return sum(v for _, v in order[::7]) + len("".join(k for k, _ in order[:2_000]))


def cpu_probe_ms(rounds: int = 7) -> float:
    """The median thread CPU time, in ms, of a fixed piece of pure Python (a dict of 20,000
    string keys, a sort, a join: the interpreter's paths, as a node's handlers run them). The
    code never changes, so where two runs of a bench read it differently, the box charged the
    same work differently (a busy host core, a throttled clock): compare their other CPU figures
    in that light. Thread CPU, not wall time: time the VM was not running is not in it."""
    times = []
    for _ in range(rounds):
        t0 = time.thread_time()
        _probe_work()
        times.append(time.thread_time() - t0)
    return round(statistics.median(times) * 1e3, 2)
