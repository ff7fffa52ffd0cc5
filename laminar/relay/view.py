"""The chain as one relay sees it: the order of the relays, its epoch, who heads it, which
predecessors were cut out, and the election of a new head.

    view = ChainView(cfg.relay, n_relays=n, index=i, endpoint=cfg.endpoint, log=log,
                     metrics=metrics)
    view.named_master()                         # where a trainer's push belongs
    view.set_order(epoch, order, endpoints, from_manager=True)   # a ChainUpdate
    view.become_head("no live predecessor")     # True: this relay heads the chain now
    view.adopt(info)                            # at start: a newer view a live relay holds

No I/O and no connections: the follower (fetch.py) probes relays and acts on the view; a change
that moves this relay's upstream goes through it (ChainFollower.set_order / become_head), which
drops its upstream and wakes its loop. The order comes from the manager (ChainUpdate) or
defaults to relay-0 → relay-1 → …; a dead master is replaced by the first relay that finds no
live predecessor (the lowest live index in the order).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from structlog.typing import FilteringBoundLogger

from laminar.config import RelayConfig
from laminar.message import ProtocolError
from laminar.metrics import Metrics
from laminar.protocol.relay import ChainInfo


class ChainView:
    """Order, epoch, head and dead relays of the chain, as relay `index` sees them."""

    def __init__(
        self,
        rc: RelayConfig,
        *,
        n_relays: int,
        index: int,
        endpoint: Callable[[str, int], str],
        log: FilteringBoundLogger,
        metrics: Metrics,
    ):
        self.rc, self.index, self.log, self.metrics = rc, index, log, metrics
        self.endpoint = endpoint
        """Address of a service by name and index (the cluster's endpoint map)."""
        self.n_relays = max(n_relays, index + 1)
        self.epoch = 0
        self.manager_epoch = -1
        self.order: list[int] = list(range(self.n_relays))
        self.endpoints: dict[int, str] = {}
        self.dead: set[int] = set()
        self.head = self.order[0] == self.index
        # until then a head looks for newer versions in its chain (also a (re)started head)
        self.catch_up_until = time.monotonic() + self.rc.catch_up_window_s if self.head else 0.0

    def data_endpoint(self, idx: int) -> str:
        return self.endpoints.get(idx) or self.endpoint("relay_data", idx)

    def control_endpoint(self, idx: int) -> str:
        return self.endpoint("relay", idx)

    @property
    def master(self) -> int:
        """The head as this relay sees it (-1 when it is not in the chain)."""
        return self.named_master() if self.index in self.order else -1

    def named_master(self) -> int:
        """The master to send a trainer to: this relay's head, or the first live relay of the
        order."""
        if self.head:
            return self.index
        live = [i for i in self.order if i not in self.dead]
        return live[0] if live else -1

    def set_order(
        self, epoch: int, order: list[int], endpoints: dict[str, str], from_manager: bool
    ) -> None:
        if len(set(order)) != len(order) or any(i < 0 for i in order):
            raise ProtocolError(f"chain order {order} must list distinct relay indices >= 0")
        if from_manager:
            self.manager_epoch = epoch
        self.epoch = max(self.epoch, epoch)
        self.order = list(order)
        self.endpoints = {int(k): v for k, v in endpoints.items()}
        self.dead.clear()
        was_head, self.head = self.head, bool(order) and order[0] == self.index
        if self.head and not was_head:
            self.catch_up_until = time.monotonic() + self.rc.catch_up_window_s
        self.log.info("chain_order", epoch=self.epoch, order=self.order, head=self.head)

    def become_head(self, why: str, catch_up: bool = True) -> bool:
        """Head the chain from now on (a new epoch, live relays after this one); False when it
        already did."""
        if self.head:
            return False
        self.head = True
        self.catch_up_until = time.monotonic() + self.rc.catch_up_window_s if catch_up else 0.0
        self.epoch += 1
        self.order = [self.index] + [
            i for i in self.order if i != self.index and i not in self.dead
        ]
        self.metrics.count("became_master")
        self.log.warning("became_master", why=why, epoch=self.epoch, order=self.order)
        return True

    def adopt(self, info: ChainInfo) -> None:
        """At start: take a live relay's newer view, joining its chain at the end."""
        order = [i for i in info.order if i != self.index] + [self.index]
        self.epoch, self.order, self.head = info.epoch, order, False
        self.log.info("joined_chain", epoch=self.epoch, order=order)
