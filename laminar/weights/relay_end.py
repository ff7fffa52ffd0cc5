"""What both ends of the relay mode keep: the relays' links and this end's wiring.

class WeightPusher(RelayEnd): ...   # pusher.py (trainer)
class WeightPuller(RelayEnd): ...   # puller.py (rollout)
"""

from __future__ import annotations

from laminar.transport.sockets import Wiring
from laminar.weights.channel import RelayLinks


class RelayEnd:
    """What both ends keep of their settings and wiring."""

    def __init__(self, links: RelayLinks, wiring: Wiring):
        self.links = links
        self.ctx, self.opts, self.node_id, self.role = (
            wiring.ctx,
            wiring.opts,
            wiring.node_id,
            wiring.role,
        )
        self.log, self.spawn = wiring.log, wiring.spawn
