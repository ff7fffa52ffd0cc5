"""Metrics as typed partials (sum, count, max, min), reduced in one place.

m = Metrics()
m.add("reward", 1.0); m.add("reward", 0.0)
snap = m.snapshot()                 # {"reward": Partial(sum=1, count=2, max=1, min=0)}
reduce_partials([snap_a, snap_b])   # the only place partials are merged
means(snap)                         # {"reward": 0.5}; NaN samples are skipped, not averaged in
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class Partial:
    sum: float = 0.0
    count: int = 0
    max: float = -math.inf
    min: float = math.inf

    def add(self, value: float, weight: int = 1) -> None:
        value = float(value)
        if math.isnan(value):
            return
        self.sum += value * weight
        self.count += weight
        self.max = max(self.max, value)
        self.min = min(self.min, value)

    def merge(self, other: Partial) -> None:
        self.sum += other.sum
        self.count += other.count
        self.max = max(self.max, other.max)
        self.min = min(self.min, other.min)

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    def as_dict(self) -> dict[str, float]:
        return {"sum": self.sum, "count": self.count, "max": self.max, "min": self.min}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Partial:
        return cls(float(d["sum"]), int(d["count"]), float(d["max"]), float(d["min"]))


class Metrics:
    """Per-node accumulator; snapshot() hands partials over and resets."""

    def __init__(self) -> None:
        self._parts: dict[str, Partial] = {}
        self.counters: dict[str, int] = {}

    def add(self, name: str, value: float, weight: int = 1) -> None:
        part = self._parts.get(name)
        if part is None:
            part = self._parts[name] = Partial()
        part.add(value, weight)

    def count(self, name: str, n: int = 1) -> None:
        """Monotonic counters (bad messages, retries ...), never reset."""
        self.counters[name] = self.counters.get(name, 0) + n

    def snapshot(self, reset: bool = True) -> dict[str, Partial]:
        parts = self._parts
        if reset:
            self._parts = {}
        else:
            parts = {k: Partial(**v.__dict__) for k, v in parts.items()}
        return parts


def reduce_partials(snapshots: list[dict[str, Partial]]) -> dict[str, Partial]:
    out: dict[str, Partial] = {}
    for snap in snapshots:
        for name, part in snap.items():
            out.setdefault(name, Partial()).merge(part)
    return out


def means(parts: dict[str, Partial]) -> dict[str, float]:
    return {k: v.mean for k, v in parts.items() if v.count}


def nanmean(values) -> float:
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return sum(vals) / len(vals) if vals else math.nan
