"""A tools node's settings from the config.

node = ToolsNode(tools_node_settings(cfg, 0))
"""

from __future__ import annotations

from laminar.config import LaminarConfig
from laminar.tools.settings import ToolsNodeSettings
from laminar.wiring.common import node_settings, socket_max_message_bytes


def tools_node_settings(
    cfg: LaminarConfig, index: int = 0, node_id: str | None = None
) -> ToolsNodeSettings:
    """What tools-`index` receives."""
    journal = cfg.resolved_run_dir() / "tools" / f"tools-{index}.journal"
    return ToolsNodeSettings(
        node=node_settings(cfg, "tools", index, node_id),
        tools=cfg.tools,
        journal=journal if cfg.tools.journal else None,
        bind=cfg.bind_endpoint("tools", index),
        max_message_bytes=socket_max_message_bytes(cfg, "tools"),
    )
