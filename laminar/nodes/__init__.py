"""One module per node role. Classes are imported lazily so `laminar --help` stays fast."""

from __future__ import annotations

import importlib

NODE_CLASSES = {
    "manager": "laminar.nodes.manager:ManagerNode",
    "buffer": "laminar.nodes.buffer:BufferNode",
    "relay": "laminar.nodes.relay:RelayNode",
    "trainer": "laminar.nodes.trainer:TrainerNode",
    "rollout": "laminar.nodes.rollout:RolloutNode",
}


def node_class(role: str):
    try:
        path = NODE_CLASSES[role]
    except KeyError:
        raise ValueError(f"unknown role {role!r}; use one of {sorted(NODE_CLASSES)}") from None
    mod, _, name = path.partition(":")
    return getattr(importlib.import_module(mod), name)
