"""Laminar: asynchronous RL post-training with trajectory-level asynchrony.

`import laminar` is cheap (no torch, no zmq). Import names from where they are defined:

    from laminar.config import LaminarConfig, load_config
    from laminar.cluster import LocalCluster      # the embedded API (pulls in zmq)
"""

from __future__ import annotations

__version__ = "0.1.0"
