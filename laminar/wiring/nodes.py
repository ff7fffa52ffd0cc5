"""A node of a role, built from the config: its settings from the role's wiring module, then
its class from the role's package, both imported on first use (`laminar node --role X` imports
only role X).

    node = build_node(cfg, "rollout", 1, ctx=ctx, engine=FakeEngine())   # kw: the node's own
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from laminar.config import ROLES, LaminarConfig, Role
from laminar.node import Node
from laminar.transport.sockets import Context


def build_node(
    cfg: LaminarConfig,
    role: Role,
    index: int = 0,
    *,
    ctx: Context | None = None,
    node_id: str | None = None,
    **kw: Any,
) -> Node:
    """`laminar.<role>.node.<Role>Node` of `laminar.wiring.<role>.<role>_node_settings(cfg)`;
    `kw` goes to the node's constructor (test doubles: an engine, an env...)."""
    wiring, module = role_modules(role)
    settings = getattr(wiring, f"{role}_node_settings")(cfg, index, node_id)
    cls: Callable[..., Node] = getattr(module, f"{role.capitalize()}Node")
    return cls(settings, ctx=ctx, **kw)


def role_modules(role: Role) -> tuple[ModuleType, ModuleType]:
    """`laminar.wiring.<role>` and `laminar.<role>.node`, imported on first use."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; use one of {list(ROLES)}")
    return (
        importlib.import_module(f"laminar.wiring.{role}"),
        importlib.import_module(f"laminar.{role}.node"),
    )
