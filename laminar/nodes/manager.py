"""Manager node: membership and liveness of every node (skeleton; repack/recovery come later).

    every node ──Hello/Heartbeat(NodeStatus)──► manager (ROUTER at cfg.endpoint("manager"))
    laminar status ──StatusRequest──► manager ──StatusReply──► table

Run: laminar node --role manager --config configs/skeleton.yaml
"""

from __future__ import annotations

import time

from laminar.node import Node
from laminar.protocol.core import NodeStatus
from laminar.protocol.manager import NodeEntry, StatusReply, StatusRequest
from laminar.transport.sockets import Peer


class ManagerNode(Node):
    role = "manager"
    registers_with_manager = False

    async def setup(self) -> None:
        self.srv = self.server(self.cfg.bind_endpoint("manager"), on_peer_dead=self._on_dead, on_peer_join=self._on_join)
        self.srv.on(StatusRequest, self._on_status)
        await self.srv.start()

    def _on_join(self, peer: Peer) -> None:
        self.metrics.count("joins")

    def _on_dead(self, peer: Peer) -> None:
        self.metrics.count("deaths")
        self.log.warning("node_dead", peer=peer.node_id, peer_role=peer.role)

    def members(self) -> list[NodeEntry]:
        now = time.monotonic()
        return [
            NodeEntry(
                node_id=p.node_id,
                role=p.role,
                alive=p.alive,
                last_beat_s=round(now - p.last_seen, 3),
                status=p.status,
                pid=int(p.info.get("pid", 0)) if isinstance(p.info.get("pid", 0), int) else 0,
            )
            for p in self.srv.peers.values()
            if p.role != "cli"
        ]

    async def _on_status(self, peer: Peer, msg: StatusRequest) -> StatusReply:
        return StatusReply(nodes=self.members(), mode=self.cfg.mode)

    def status(self) -> NodeStatus:
        return NodeStatus(node_id=self.node_id, role=self.role, extra={"members": len(self.srv.peers)})
