"""The manager's straggler rule (laminar/manager/chain_order.py), on sampled chain progress.

.venv/bin/python -m pytest tests/test_chain_order.py -q
"""

from __future__ import annotations

from laminar.manager.chain_order import ChainPlanner

N = 64  # chunks of the version being broadcast


def sample(have: dict[int, int], v: int = 5) -> dict[int, tuple[int, int, int, int]]:
    """Relay -> (complete version, incoming version, chunks held, chunk count)."""
    return {i: (v, -1, 0, N) if h == N else (v - 1, v, h, N) for i, h in have.items()}


def test_a_relay_behind_its_own_upstream_moves_last_and_the_ones_behind_it_do_not():
    p = ChainPlanner(window=4)
    assert p.order([0, 1, 2, 3]) == [0, 1, 2, 3]
    # relay 2's link is slow: it trails relay 1 by far; relay 3 trails relay 2 by a window
    assert not p.observe([0, 1, 2, 3], sample({0: N, 1: 30, 2: 20, 3: 17}), now=0.0)
    assert p.observe([0, 1, 2, 3], sample({0: N, 1: 60, 2: 22, 3: 19}), now=1.0)
    assert p.slow == {2}
    assert p.order([0, 1, 2, 3]) == [0, 1, 3, 2]


def test_the_heads_successor_is_judged_by_its_rate_against_the_best_seen():
    p = ChainPlanner(window=4)
    # a healthy version teaches the planner a fast rate (30 chunks/s); nobody is blamed
    p.observe([0, 1, 2, 3], sample({0: N, 1: 10, 2: 7, 3: 4}, v=1), now=0.0)
    assert not p.observe([0, 1, 2, 3], sample({0: N, 1: 40, 2: 37, 3: 33}, v=1), now=1.0)
    assert p.best_rate >= 30
    # then relay 1's link degrades: 3 chunks/s, and 2, 3 crawl right behind it (not blamed)
    p.observe([0, 1, 2, 3], sample({0: N, 1: 2, 2: 1, 3: 0}, v=2), now=10.0)
    assert p.observe([0, 1, 2, 3], sample({0: N, 1: 5, 2: 4, 3: 3}, v=2), now=11.0)
    assert p.slow == {1}
    assert p.order([0, 1, 2, 3]) == [0, 2, 3, 1]


def test_a_relay_that_keeps_pace_again_moves_back():
    p = ChainPlanner(window=4)
    p.observe([0, 1, 2, 3], sample({0: N, 1: 40, 2: 5, 3: 3}), now=0.0)
    assert p.slow == {2}
    order = p.order([0, 1, 2, 3])
    p.observe(order, sample({0: N, 1: 50, 3: 47, 2: 44}, v=6), now=5.0)  # keeps pace at the tail
    p.observe(order, sample({0: N, 1: 2, 3: 1, 2: 0}, v=7), now=9.0)
    assert not p.slow and p.order([0, 1, 2, 3]) == [0, 1, 2, 3]


def test_small_versions_and_missing_samples_are_ignored():
    p = ChainPlanner(window=4)
    assert not p.observe([0, 1, 2], {0: (3, -1, 0, 0), 1: (2, 3, 0, 4), 2: (2, 3, 0, 4)}, 0.0)
    assert not p.observe([0, 1, 2], sample({0: N, 2: 0}), 1.0)  # relay 1 did not answer
    assert p.order([]) == [] and p.order([5]) == [5]
