"""Laminar: asynchronous RL post-training with trajectory-level asynchrony.

Heavy modules load lazily: `import laminar` is cheap; `laminar.LocalCluster`
pulls in the node runtime (and zmq) on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LocalCluster":
        from laminar.cluster import LocalCluster

        return LocalCluster
    if name in ("load_config", "LaminarConfig"):
        from laminar import config

        return getattr(config, name)
    raise AttributeError(f"module 'laminar' has no attribute {name!r}")
