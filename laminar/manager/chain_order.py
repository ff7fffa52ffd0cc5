"""Relay chain order that routes around a slow link (a straggler).

    planner = ChainPlanner(window=cfg.relay.window)
    order = planner.order(live_relay_indices)          # head first, slow relays last
    changed = planner.observe(order, {i: (version, incoming_version, incoming_have, chunks)}, now)

In a pipelined chain every relay runs at the speed of the slowest link above it: a relay on a
link 10x slower holds back every relay behind it. The manager samples the relays' progress
(ChainInfo) while a version moves down the chain, and blames a relay for its own link when

* it trails its upstream (not the head) by more than `max(2 * window, gap_frac * chunks)`
  chunks: a relay behind a slow upstream stays within a window of it and is not blamed; or
* it is the head's successor (the head holds the whole version at once, so every first hop
  trails it) and fetches at less than `1 / rate_factor` of the best rate any relay has shown.

A blamed relay moves to the tail, so the relays that were behind it take the version from a
fast relay and only the straggler waits for its link. One that keeps pace again (a whole
version without blame) moves back. The head stays the lowest live index: the trainer pushes
there. Limits: a slow link of the head itself cannot be routed around (another master would
be needed), and the head's successor is only judged once some relay has shown a fast rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChainPlanner:
    window: int
    """Chunk fetches each relay keeps in flight: a healthy relay trails its upstream by about
    this."""
    gap_frac: float = 0.25
    """A relay this fraction of a version behind its upstream (and > 2 windows) is slow."""
    rate_factor: float = 4.0
    """The head's successor is slow below best rate / this."""
    slow: set[int] = field(default_factory=set)
    best_rate: float = 0.0
    """Fastest chunks/s any receiving relay has shown between two samples (any version)."""
    _blamed: dict[int, bool] = field(default_factory=dict)
    _last: dict[int, tuple[float, int]] = field(default_factory=dict)
    _version: int = -1

    def order(self, live: list[int]) -> list[int]:
        """Head = lowest live index; then relays with healthy links (by index); slow ones last."""
        if not live:
            return []
        head, *rest = sorted(live)
        return [
            head,
            *(i for i in rest if i not in self.slow),
            *(i for i in rest if i in self.slow),
        ]

    def observe(
        self, order: list[int], infos: dict[int, tuple[int, int, int, int]], now: float
    ) -> bool:
        """One sample: per relay (complete version, incoming version, chunks of it held, its
        chunk count). Returns True when the set of slow relays changed (reorder the chain)."""
        if len(order) < 2 or not infos:
            return False
        v = max(max(c, inc) for c, inc, _, _ in infos.values())
        before = set(self.slow)
        if v != self._version:  # a new version: relays that went through the last one unblamed
            self.slow -= {i for i, b in self._blamed.items() if not b}
            self._version, self._blamed, self._last = v, {}, {}
        chunks = max((n for c, inc, _, n in infos.values() if inc == v), default=0)
        if not chunks:
            return self.slow != before

        def have(i: int) -> int | None:
            if i not in infos:
                return None
            c, inc, got, _ = infos[i]
            return chunks if c >= v else (got if inc == v else 0)

        rates: dict[int, float] = {}
        for i in infos:
            h = have(i)
            assert h is not None
            if i in self._last and 0 < self._last[i][1] < chunks and now > self._last[i][0]:
                rates[i] = (h - self._last[i][1]) / (now - self._last[i][0])
            self._last[i] = (now, h)
        limit = max(2 * self.window, int(self.gap_frac * chunks))
        for pos, (up, me) in enumerate(zip(order, order[1:], strict=False)):
            h_up, h_me = have(up), have(me)
            if h_up is None or h_me is None or h_me >= chunks:
                continue
            if pos == 0:  # the head's successor: judged by its rate, not its gap
                blamed = (
                    me in rates
                    and self.best_rate > 0
                    and rates[me] * self.rate_factor < self.best_rate
                )
            else:
                blamed = h_up - h_me > limit
            self._blamed[me] = self._blamed.get(me, False) or blamed
            if blamed:
                self.slow.add(me)
        if rates:
            self.best_rate = max(self.best_rate, max(rates.values()))
        return self.slow != before
