"""Trainer node (skeleton): connects to the buffer and the master relay.

Run: laminar node --role trainer --config configs/skeleton.yaml
"""

from __future__ import annotations

from laminar.node import Node


class TrainerNode(Node):
    role = "trainer"

    async def setup(self) -> None:
        timeout = self.cfg.transport.startup_timeout_s
        self.buffer = self.client(self.cfg.endpoint("buffer"))
        await self.buffer.connect(timeout=timeout)
        self.relay = self.client(self.cfg.endpoint("relay", 0))
        await self.relay.connect(timeout=timeout)
