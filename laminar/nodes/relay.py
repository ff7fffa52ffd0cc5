"""Relay node (skeleton): per-host weight cache and chain hop come later.

Run: laminar node --role relay --config configs/skeleton.yaml
"""

from __future__ import annotations

from laminar.node import Node


class RelayNode(Node):
    role = "relay"

    async def setup(self) -> None:
        self.srv = self.server(self.cfg.bind_endpoint("relay", self.index))
        await self.srv.start()
