"""What a tools node receives (laminar/wiring/tools.py builds it from the config).

node = ToolsNode(tools_node_settings(cfg, 0))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from laminar.config import ToolsConfig
from laminar.node_settings import NodeSettings


@dataclass(frozen=True)
class ToolsNodeSettings:
    node: NodeSettings
    tools: ToolsConfig
    journal: Path | None
    """Where this node journals its calls (None: tools.journal is off)."""
    bind: str
    max_message_bytes: int
