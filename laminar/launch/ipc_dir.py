"""The ipc directory (cluster.transport=ipc): private before any socket is bound, gone after.

prepare_ipc_dir(cfg)    0700 and ours, or IpcDirError (exit 2)
remove_ipc_dir(cfg)     after every child stopped: its sockets, then the directory if empty
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from pathlib import Path

from laminar.config import ConfigError, LaminarConfig


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


def remove_ipc_dir(cfg: LaminarConfig) -> None:
    """After every child stopped: remove the sockets they bound (a killed one leaves its file)
    and the ipc directory once empty. Only `<service>-<index>.sock` sockets go: ipc_dir may be
    shared."""
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
