"""A relay's settings from the config.

node = RelayNode(relay_node_settings(cfg, 0))
"""

from __future__ import annotations

from laminar.config import LaminarConfig
from laminar.relay.settings import RelayNodeSettings
from laminar.wiring.common import node_settings, socket_max_message_bytes


def relay_node_settings(
    cfg: LaminarConfig, index: int = 0, node_id: str | None = None
) -> RelayNodeSettings:
    """What relay-`index` receives: the endpoints of every relay the chain may reach."""
    n = max(cfg.cluster.roles.get("relay", 1), index + 1)
    return RelayNodeSettings(
        node=node_settings(cfg, "relay", index, node_id),
        relay=cfg.relay,
        transport=cfg.transport,
        shm_name=f"{cfg.relay.shm_prefix}-{cfg.name}-relay{index}",
        controls=tuple(cfg.endpoint("relay", i) for i in range(n)),
        data=tuple(cfg.endpoint("relay_data", i) for i in range(n)),
        bind=cfg.bind_endpoint("relay", index),
        bind_data=cfg.bind_endpoint("relay_data", index),
        bind_pub=cfg.bind_endpoint("relay_pub", index),
        max_message_bytes=socket_max_message_bytes(cfg, "relay"),
        data_max_message_bytes=socket_max_message_bytes(cfg, "relay_data"),
    )
