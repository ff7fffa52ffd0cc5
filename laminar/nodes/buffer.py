"""Buffer node (skeleton): prompt pool, partial pool, experience buffer, journal come later.

Run: laminar node --role buffer --config configs/skeleton.yaml
"""

from __future__ import annotations

from laminar.node import Node


class BufferNode(Node):
    role = "buffer"

    async def setup(self) -> None:
        self.srv = self.server(self.cfg.bind_endpoint("buffer"))
        await self.srv.start()
