"""What every bench records about the code it measured: the commit and whether the tree was dirty.

from benchinfo import git_state      # bench/ is the script's directory, so on sys.path
info = {**git_state(), ...}
"""

from __future__ import annotations

import subprocess
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
