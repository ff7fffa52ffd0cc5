"""What a relay node receives (laminar/wiring/relay.py builds it from the config).

node = RelayNode(relay_node_settings(cfg, 0))
"""

from __future__ import annotations

from dataclasses import dataclass

from laminar.config import RelayConfig, TransportConfig
from laminar.node_settings import NodeSettings


@dataclass(frozen=True)
class RelayNodeSettings:
    node: NodeSettings
    relay: RelayConfig
    transport: TransportConfig
    shm_name: str
    """The name of this relay's shared-memory store (unique per run and relay index)."""
    controls: tuple[str, ...]
    """Every relay's control endpoint, by index (relay-0 .. relay-{n-1})."""
    data: tuple[str, ...]
    """Every relay's data endpoint (chunks between relays), by index."""
    bind: str
    """Where this relay binds its control socket."""
    bind_data: str
    bind_pub: str
    """Where it publishes WeightsReady to its rollouts."""
    max_message_bytes: int
    """Inbound limit of the control socket (one weight chunk plus its header)."""
    data_max_message_bytes: int
