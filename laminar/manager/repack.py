"""Dynamic repack planner: best-fit trajectory consolidation (Laminar paper, Algorithm 1).

    rollout stats (KV use, rising?, running, waiting, in-flight trajectories)
        ──► plan_repack(rollouts, c_max, bound_b)      pure function, no I/O
        ──► RepackPlan(moves=(source -> dest, traj ids, version), emptied=(sources))
    manager: for each move, export on the source and import on the destination (same version);
             every emptied source refreshes to the newest weights and takes new prompts.

The manager calls it every `manager.repack.interval_s` (5 s) and right after each trainer
update; bench/simulate.py calls the same function. Rules:

- Rollouts are grouped by weight version; a trajectory never changes version.
- Candidates (`is_candidate`): 0 < running < B, nothing waiting, KV use below C_max, and
  draining its long tail: by the rollout's own word where it gives it (`draining`: it takes no
  more prompts at this version, rollout/versions.py), else by KV use that is not rising. The
  rollout's word suits any B: a tail of two or three long sequences still grows its KV.
- Candidates are visited in ascending KV use (ties: node_id). A visited candidate that is not
  yet emptied and has received nothing this round is a source: ALL its trajectories go to the
  one destination - another candidate of the same version, not emptied - that ends up most
  densely packed (highest KV after the move; ties: node_id) while its KV stays <= C_max and its
  running count <= B.
- All or nothing: a source whose trajectories fit on no single destination stays as it is.
  Splitting one source over several destinations could release a few more sources in rare
  cases, but it multiplies transfers and partial groups; the paper moves whole sources too.
- A rollout that received work is never a source in the same round (the paper's pseudo-code
  allows it, which would move trajectories twice in one round); an emptied rollout is never
  a destination (it is about to refresh its weights).

The goal is to minimise the number of rollouts still holding work. Cost: O(|S|^2) per version.
Tests: .venv/bin/python -m pytest tests/test_repack.py -q
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Move", "RepackPlan", "RolloutLoad", "TrajLoad", "is_candidate", "plan_repack"]


@dataclass(frozen=True)
class TrajLoad:
    traj_id: str
    kv: float
    """Fraction of its rollout's KV cache this trajectory occupies."""


@dataclass(frozen=True)
class RolloutLoad:
    """One rollout as the manager sees it (from its latest stats report)."""

    node_id: str
    version: int
    kv_use: float
    """KV-cache use in [0, 1]."""
    kv_rising: bool
    """KV use grew since the previous report."""
    running: int
    """Sequences decoding."""
    waiting: int
    """Requests queued in the engine."""
    trajectories: tuple[TrajLoad, ...] = ()
    """In-flight trajectories with their KV footprint (only needed for candidates)."""
    draining: bool | None = None
    """The rollout takes no more prompts at this version (its status: target_version > version);
    None: not reported (then KV that is not rising stands for it)."""


@dataclass(frozen=True)
class Move:
    source: str
    dest: str
    traj_ids: tuple[str, ...]
    version: int


@dataclass(frozen=True)
class RepackPlan:
    moves: tuple[Move, ...] = ()
    emptied: tuple[str, ...] = ()
    """Sources fully drained by the plan: they refresh their weights and take new prompts."""

    def __bool__(self) -> bool:
        return bool(self.moves)


def is_candidate(r: RolloutLoad, c_max: float, bound_b: int) -> bool:
    """Is this rollout draining its tail, so it may give or take trajectories this round?"""
    draining = r.draining if r.draining is not None else not r.kv_rising
    return 0 < r.running < bound_b and r.waiting == 0 and r.kv_use < c_max and draining


def _check(rollouts: Sequence[RolloutLoad], c_max: float, bound_b: int) -> None:
    if not 0 < c_max <= 1:
        raise ValueError(f"c_max must be in (0, 1], got {c_max}")
    if bound_b < 1:
        raise ValueError(f"bound_b must be >= 1, got {bound_b}")
    seen: set[str] = set()
    for r in rollouts:
        if r.node_id in seen:
            raise ValueError(f"rollout {r.node_id!r} appears twice in one repack round")
        seen.add(r.node_id)


def _plan_version(
    cands: list[RolloutLoad], c_max: float, bound_b: int
) -> tuple[list[Move], list[str]]:
    cands = sorted(cands, key=lambda r: (r.kv_use, r.node_id))
    kv = {r.node_id: r.kv_use for r in cands}  # projected load after this round's moves
    n = {r.node_id: r.running for r in cands}
    received: set[str] = set()
    emptied: set[str] = set()
    moves: list[Move] = []
    for s in cands:
        if s.node_id in received or not s.trajectories:
            continue  # got work this round, or its report lists nothing we could move
        # The moved load is what the trajectories hold; the count is at least `running`, so a
        # report that lists fewer trajectories than it runs never overfills a destination.
        s_kv = sum(t.kv for t in s.trajectories)
        s_n = max(s.running, len(s.trajectories))
        best: RolloutLoad | None = None
        for d in cands:
            if d is s or d.node_id in emptied:
                continue
            if kv[d.node_id] + s_kv > c_max or n[d.node_id] + s_n > bound_b:
                continue
            if best is None or (-kv[d.node_id], d.node_id) < (-kv[best.node_id], best.node_id):
                best = d
        if best is None:
            continue  # all or nothing: nothing partial is moved
        kv[best.node_id] += s_kv
        n[best.node_id] += s_n
        received.add(best.node_id)
        emptied.add(s.node_id)
        ids = tuple(t.traj_id for t in s.trajectories)
        moves.append(Move(source=s.node_id, dest=best.node_id, traj_ids=ids, version=s.version))
    return moves, [m.source for m in moves]


def plan_repack(rollouts: Sequence[RolloutLoad], c_max: float, bound_b: int) -> RepackPlan:
    """Best-fit consolidation of draining rollouts, per weight version (see module docstring).

    Deterministic: the same loads give the same plan whatever their order in `rollouts`.
    """
    _check(rollouts, c_max, bound_b)
    by_version: dict[int, list[RolloutLoad]] = {}
    for r in rollouts:
        if is_candidate(r, c_max, bound_b):
            by_version.setdefault(r.version, []).append(r)
    moves: list[Move] = []
    emptied: list[str] = []
    for version in sorted(by_version):
        m, e = _plan_version(by_version[version], c_max, bound_b)
        moves += m
        emptied += e
    return RepackPlan(moves=tuple(moves), emptied=tuple(emptied))
