"""Batch sampling orders (BufferConfig.sampling): which ready groups a batch prefers.

    order = resolve_sampler("fifo")                 # or "lifo", "random", "my.module:my_fn"
    keys = order(ready_groups, rng)                 # preference order of group ids

A sampler gets the ready groups (objects with group_id, version, ready_seq,
serial, rewards()) and a seeded random.Random, and returns them in preference order.
Groups put back by a trainer restart always come first, whatever the sampler,
so a restarted trainer sees its uncommitted batches again. With a staleness bound
the planner may still pull older groups forward (see admission.plan_batch).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from laminar.resolve import resolve_spec

__all__ = ["Sampler", "resolve_sampler", "BUILTIN_SAMPLERS"]

Sampler = Callable[[list[Any], random.Random], list[Any]]


def fifo(groups: list[Any], rng: random.Random) -> list[Any]:
    """Oldest completion first (the default)."""
    return sorted(groups, key=lambda g: g.ready_seq)


def lifo(groups: list[Any], rng: random.Random) -> list[Any]:
    """Newest completion first (freshest data; old groups may starve without a staleness bound)."""
    return sorted(groups, key=lambda g: -g.ready_seq)


def uniform(groups: list[Any], rng: random.Random) -> list[Any]:
    """Uniformly random among the ready groups."""
    out = sorted(groups, key=lambda g: g.ready_seq)
    rng.shuffle(out)
    return out


BUILTIN_SAMPLERS: dict[str, Sampler] = {"fifo": fifo, "lifo": lifo, "random": uniform}


def resolve_sampler(spec: str) -> Callable[[list[Any], random.Random], list[str]]:
    """The sampler named by the config, wrapped to return group ids with requeued groups first."""
    fn = BUILTIN_SAMPLERS.get(spec)
    if fn is None:
        fn = resolve_spec(
            spec, "buffer.sampling", "fifo | lifo | random | module:function", ValueError
        )

    def order(groups: list[Any], rng: random.Random) -> list[str]:
        front = sorted((g for g in groups if g.front), key=lambda g: g.ready_seq)
        rest = fn([g for g in groups if not g.front], rng)
        return [g.group_id for g in front] + [g.group_id for g in rest]

    return order
