"""Repack planner (laminar.manager.repack): hand-built cases with known answers + invariants."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.manager.repack import RolloutLoad, TrajLoad, is_candidate, plan_repack

C_MAX, B = 0.9, 8


def ro(
    node_id: str,
    kv: float,
    running: int,
    *,
    version: int = 0,
    waiting: int = 0,
    rising: bool = False,
) -> RolloutLoad:
    """A rollout whose `running` trajectories share its KV use equally."""
    trajs = (
        tuple(TrajLoad(f"{node_id}/t{i}", kv / running) for i in range(running)) if running else ()
    )
    return RolloutLoad(node_id, version, kv, rising, running, waiting, trajs)


def holders_after(rollouts, plan) -> set[str]:
    """Rollouts still holding work once the plan is carried out."""
    return {r.node_id for r in rollouts if r.running > 0} - set(plan.emptied)


def check_invariants(rollouts, plan, c_max=C_MAX, bound_b=B) -> None:
    by_id = {r.node_id: r for r in rollouts}
    kv = {r.node_id: r.kv_use for r in rollouts}
    n = {r.node_id: r.running for r in rollouts}
    sources = [m.source for m in plan.moves]
    dests = {m.dest for m in plan.moves}
    assert len(sources) == len(set(sources)), "a rollout is a source twice"
    assert set(sources) == set(plan.emptied)
    assert not dests & set(sources), "a rollout both gave and received work"
    for m in plan.moves:
        src, dst = by_id[m.source], by_id[m.dest]
        assert is_candidate(src, c_max, bound_b) and is_candidate(dst, c_max, bound_b)
        assert src.version == dst.version == m.version, "versions mixed"
        assert set(m.traj_ids) == {t.traj_id for t in src.trajectories}, "partial move"
        kv[m.dest] += sum(t.kv for t in src.trajectories)
        n[m.dest] += src.running
    for d in dests:
        assert kv[d] <= c_max + 1e-9, f"{d} over C_max: {kv[d]}"
        assert n[d] <= bound_b, f"{d} over B: {n[d]}"


def brute_force_min_holders(cands: list[RolloutLoad], c_max=C_MAX, bound_b=B) -> int:
    """Optimum under the same rules (whole sources, one destination each, no chains)."""
    best = len(cands)
    for dest_mask in itertools.product([0, 1], repeat=len(cands)):
        dests = [c for c, d in zip(cands, dest_mask, strict=True) if d]
        srcs = [c for c, d in zip(cands, dest_mask, strict=True) if not d]
        if not dests and srcs:
            continue
        for assign in itertools.product(range(len(dests)), repeat=len(srcs)):
            kv = [d.kv_use for d in dests]
            n = [d.running for d in dests]
            for s, i in zip(srcs, assign, strict=True):
                kv[i] += s.kv_use
                n[i] += s.running
            if all(k <= c_max + 1e-9 for k in kv) and all(x <= bound_b for x in n):
                best = min(best, len(dests))
    return best


def test_small_tails_collapse_onto_one_rollout():
    rs = [ro(f"r{i}", 0.1, 1) for i in range(4)]
    plan = plan_repack(rs, C_MAX, B)
    check_invariants(rs, plan)
    assert holders_after(rs, plan) == {"r1"}  # ties on KV break by node_id: r0 goes to r1 first
    assert plan.emptied == ("r0", "r2", "r3")
    assert {m.dest for m in plan.moves} == {"r1"}


def test_kv_cap_forces_two_destinations():
    rs = [ro("a", 0.2, 1), ro("b", 0.3, 1), ro("c", 0.4, 1), ro("d", 0.5, 1)]
    plan = plan_repack(rs, C_MAX, B)
    check_invariants(rs, plan)
    # 1.4 of KV needs at least two rollouts; best fit: a -> d (0.7), b -> c (0.7)
    assert holders_after(rs, plan) == {"c", "d"}
    assert [(m.source, m.dest) for m in plan.moves] == [("a", "d"), ("b", "c")]


def test_bound_b_respected():
    rs = [ro(f"r{i}", 0.05, 5) for i in range(3)]  # 5 + 5 > B = 8
    plan = plan_repack(rs, C_MAX, B)
    assert not plan and plan.emptied == ()
    rs = [ro("x", 0.05, 4), ro("y", 0.05, 4), ro("z", 0.05, 4)]
    plan = plan_repack(rs, C_MAX, B)
    check_invariants(rs, plan)
    assert len(holders_after(rs, plan)) == 2  # 4 + 4 = B exactly is allowed; 12 needs two


def test_versions_never_mixed():
    rs = [
        ro("a0", 0.1, 1, version=0),
        ro("b0", 0.1, 1, version=0),
        ro("a1", 0.1, 1, version=1),
        ro("b1", 0.1, 1, version=1),
        ro("c2", 0.1, 1, version=2),
    ]
    plan = plan_repack(rs, C_MAX, B)
    check_invariants(rs, plan)
    assert holders_after(rs, plan) == {"b0", "b1", "c2"}  # a lone rollout of version 2 stays put
    assert all(m.version == int(m.source[-1]) == int(m.dest[-1]) for m in plan.moves)


def test_non_candidates_never_touched():
    rs = [
        ro("rising", 0.1, 1, rising=True),
        ro("waiting", 0.1, 1, waiting=3),
        ro("full_b", 0.1, B),
        ro("hot_kv", 0.95, 1),
        ro("idle", 0.0, 0),
        ro("t1", 0.2, 2),
        ro("t2", 0.3, 2),
    ]
    plan = plan_repack(rs, C_MAX, B)
    check_invariants(rs, plan)
    assert [(m.source, m.dest) for m in plan.moves] == [("t1", "t2")]


def test_all_or_nothing_source_stays():
    # s (0.5) fits on no destination (0.6 + 0.5 > 0.9), so it keeps its trajectories
    rs = [ro("s", 0.5, 2), ro("d", 0.6, 2)]
    plan = plan_repack(rs, C_MAX, B)
    assert not plan


def test_receiver_is_never_a_source():
    # a -> c (b cannot take a: 6 + 3 > B). The paper's pseudo-code would then visit c as a
    # source and move c's own trajectory to b, leaving a's behind on c; here c stays put.
    rs = [ro("a", 0.1, 3), ro("b", 0.2, 6), ro("c", 0.3, 1)]
    plan = plan_repack(rs, C_MAX, B)
    check_invariants(rs, plan)
    assert [(m.source, m.dest) for m in plan.moves] == [("a", "c")]
    assert plan.emptied == ("a",)


def test_deterministic_under_input_order():
    rng = random.Random(7)
    rs = [
        ro(
            f"n{i:02d}",
            round(rng.uniform(0.01, 0.5), 3),
            rng.randint(1, 4),
            version=rng.randint(0, 2),
        )
        for i in range(30)
    ]
    want = plan_repack(rs, C_MAX, B)
    for _ in range(5):
        rng.shuffle(rs)
        assert plan_repack(rs, C_MAX, B) == want


@pytest.mark.parametrize(
    "loads",
    [
        [(0.1, 1)] * 6,  # all fit in one
        [(0.45, 1), (0.45, 1), (0.45, 1), (0.45, 1)],  # pairs
        [(0.2, 2), (0.3, 3), (0.6, 1), (0.1, 4), (0.25, 2)],
        [(0.5, 1), (0.4, 1), (0.3, 1), (0.2, 1), (0.1, 1)],
        [(0.3, 7), (0.3, 1), (0.3, 1)],  # B decides, not KV
    ],
)
def test_matches_brute_force_optimum(loads):
    rs = [ro(f"r{i}", kv, n) for i, (kv, n) in enumerate(loads)]
    plan = plan_repack(rs, C_MAX, B)
    check_invariants(rs, plan)
    assert len(holders_after(rs, plan)) == brute_force_min_holders(rs)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="c_max"):
        plan_repack([], 0.0, B)
    with pytest.raises(ValueError, match="bound_b"):
        plan_repack([], C_MAX, 0)
    with pytest.raises(ValueError, match="twice"):
        plan_repack([ro("a", 0.1, 1), ro("a", 0.2, 1)], C_MAX, B)


rollout_st = st.tuples(
    st.floats(0.0, 1.0), st.integers(0, 10), st.integers(0, 2), st.integers(0, 2), st.booleans()
)


@settings(max_examples=200, deadline=None)
@given(st.lists(rollout_st, max_size=25))
def test_invariants_hold_on_random_loads(rows):
    rs = [
        ro(f"r{i:02d}", kv, n, version=v, waiting=w if w == 2 else 0, rising=rise and w == 1)
        for i, (kv, n, v, w, rise) in enumerate(rows)
    ]
    plan = plan_repack(rs, C_MAX, B)
    check_invariants(rs, plan)
    # never worse than doing nothing, and a second round on the result changes nothing it moved
    assert len(holders_after(rs, plan)) <= sum(r.running > 0 for r in rs)


def check_split_invariants(rollouts, plan, c_max=C_MAX, bound_b=B) -> None:
    """With split: every emptied source's trajectories all go somewhere, each exactly once, to
    candidates of its version that stay within C_max and B and gave nothing themselves."""
    by_id = {r.node_id: r for r in rollouts}
    kv = {r.node_id: r.kv_use for r in rollouts}
    n = {r.node_id: r.running for r in rollouts}
    sources = {m.source for m in plan.moves}
    dests = {m.dest for m in plan.moves}
    assert sources == set(plan.emptied) and len(plan.emptied) == len(set(plan.emptied))
    assert not dests & sources, "a rollout both gave and received work"
    for s in sources:
        moved = [t for m in plan.moves if m.source == s for t in m.traj_ids]
        assert sorted(moved) == sorted(t.traj_id for t in by_id[s].trajectories), "partial move"
    for m in plan.moves:
        src, dst = by_id[m.source], by_id[m.dest]
        assert is_candidate(src, c_max, bound_b) and is_candidate(dst, c_max, bound_b)
        assert src.version == dst.version == m.version, "versions mixed"
        size = {t.traj_id: t.kv for t in src.trajectories}
        kv[m.dest] += sum(size[t] for t in m.traj_ids)
        n[m.dest] += len(m.traj_ids)
    for d in dests:
        assert kv[d] <= c_max + 1e-9, f"{d} over C_max: {kv[d]}"
        assert n[d] <= bound_b, f"{d} over B: {n[d]}"


def test_split_spreads_a_tail_that_no_single_destination_takes():
    # s runs 3 (0.15 each); a and b have room for 2 and 1 sequences (B = 8), nobody for 3
    rs = [ro("s", 0.45, 3), ro("a", 0.5, 6), ro("b", 0.6, 7)]
    assert not plan_repack(rs, C_MAX, B)  # whole sources only: s stays
    plan = plan_repack(rs, C_MAX, B, split=True)
    check_split_invariants(rs, plan)
    assert plan.emptied == ("s",)
    # largest first to the densest that fits: b (0.6) takes one and is at B, a the other two
    assert {m.dest: len(m.traj_ids) for m in plan.moves} == {"a": 2, "b": 1}


def test_split_prefers_one_destination_when_one_fits():
    rs = [ro("s", 0.2, 2), ro("a", 0.3, 4), ro("b", 0.4, 5)]
    plan = plan_repack(rs, C_MAX, B, split=True)
    assert [(m.source, m.dest, len(m.traj_ids)) for m in plan.moves] == [("s", "b", 2)]


def test_split_is_all_or_nothing_per_source():
    # 3 sequences, room for only 2 in all (a: 1, b: 1): s keeps every one of them
    rs = [ro("s", 0.3, 3), ro("a", 0.35, 7), ro("b", 0.4, 7)]
    assert not plan_repack(rs, C_MAX, B, split=True)


def test_split_never_splits_a_report_without_trajectory_ids():
    # placeholders ("*i": the rollout did not name its trajectories) export as a whole
    anon = RolloutLoad("s", 0, 0.3, False, 3, 0, tuple(TrajLoad(f"*{i}", 0.1) for i in range(3)))
    rs = [anon, ro("a", 0.5, 6), ro("b", 0.6, 7)]
    assert "s" not in plan_repack(rs, C_MAX, B, split=True).emptied
    named = ro("s", 0.3, 3)  # the same tail, named: spread over a and b
    assert plan_repack([named, *rs[1:]], C_MAX, B, split=True).emptied == ("s",)


@settings(max_examples=200, deadline=None)
@given(st.lists(rollout_st, max_size=25))
def test_split_invariants_hold_on_random_loads(rows):
    rs = [
        ro(f"r{i:02d}", kv, n, version=v, waiting=w if w == 2 else 0, rising=rise and w == 1)
        for i, (kv, n, v, w, rise) in enumerate(rows)
    ]
    plan = plan_repack(rs, C_MAX, B, split=True)
    check_split_invariants(rs, plan)
    assert len(holders_after(rs, plan)) <= sum(r.running > 0 for r in rs)
