"""Rollout node (skeleton): connects to the buffer and its host's relay.

Run: laminar node --role rollout --config configs/skeleton.yaml
"""

from __future__ import annotations

from laminar.node import Node


class RolloutNode(Node):
    role = "rollout"

    async def setup(self) -> None:
        timeout = self.cfg.transport.startup_timeout_s
        self.buffer = self.client(self.cfg.endpoint("buffer"))
        await self.buffer.connect(timeout=timeout)
        self.relay = self.client(self.cfg.endpoint("relay", self.cfg.rollout.relay_index))
        await self.relay.connect(timeout=timeout)
