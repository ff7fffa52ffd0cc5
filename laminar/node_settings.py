"""What every node's base receives (laminar/node.py's Node), built by the wiring
(laminar/wiring/common.py `node_settings`). A leaf beside the node base, so a role's settings
(laminar/<role>/settings.py) name it without importing the node.
"""

from __future__ import annotations

from dataclasses import dataclass

from laminar.transport.sockets import SocketOptions


@dataclass(frozen=True)
class NodeSettings:
    """What the Node base reads (laminar/wiring/common.py `node_settings` builds it)."""

    index: int
    node_id: str
    socket: SocketOptions
    """Heartbeats, deadlines, limits and CURVE keys of every socket the node opens."""
    manager: str
    """The manager's endpoint, which the node dials to register."""
    startup_timeout_s: float
    """transport.startup_timeout_s: how long registration waits for the manager."""
    stop_timeout_s: float
    """transport.stop_timeout_s: the bound of drain() and of teardown()."""
    plaintext_warning: str | None = None
    """The startup warning of tcp endpoints without CURVE (None: nothing to say)."""
