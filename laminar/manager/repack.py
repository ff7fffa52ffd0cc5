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
- All or nothing: a source is emptied or left as it is. Its trajectories go to one destination
  where one fits them all (fewest transfers; the paper moves whole sources). With `split`
  (manager.repack.split_sources) a source no single destination fits is spread instead: each
  trajectory, largest first, to the densest destination it fits, if every one of them fits
  somewhere - one move per destination. At a small B a draining tail of two or three long
  sequences rarely fits beside another whole tail, but its sequences fit one by one
  (bench/README.md, issue 44: decode utilisation 0.82 -> 0.84 in the simulator at B = 8).
  Only reports that name their trajectories split (placeholders "*i" export as a whole).
- A rollout that received work is never a source in the same round (the paper's pseudo-code
  allows it, which would move trajectories twice in one round); an emptied rollout is never
  a destination (it is about to refresh its weights).

The goal is to minimise the number of rollouts still holding work. Cost: O(|S|^2) per version
(O(|S|^2 B) with split).
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
    """One source's trajectories for one destination; a split source has a move per
    destination."""


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


def _densest(
    cands: list[RolloutLoad],
    s: RolloutLoad,
    emptied: set[str],
    kv: dict[str, float],
    n: dict[str, int],
    add_kv: float,
    add_n: int,
    c_max: float,
    bound_b: int,
) -> RolloutLoad | None:
    """The destination that ends up most densely packed taking (add_kv, add_n) within C_max and
    B (ties: node_id); None if none fits."""
    best: RolloutLoad | None = None
    for d in cands:
        if d is s or d.node_id in emptied:
            continue
        if kv[d.node_id] + add_kv > c_max or n[d.node_id] + add_n > bound_b:
            continue
        if best is None or (-kv[d.node_id], d.node_id) < (-kv[best.node_id], best.node_id):
            best = d
    return best


def _spread(
    cands: list[RolloutLoad],
    s: RolloutLoad,
    emptied: set[str],
    kv: dict[str, float],
    n: dict[str, int],
    c_max: float,
    bound_b: int,
) -> dict[str, list[str]] | None:
    """Each of the source's trajectories, largest first (ties: id), to the densest destination
    it fits; {dest: traj ids} if all fit (kv, n updated), else None (kv, n untouched)."""
    if s.running > len(s.trajectories) or any(t.traj_id.startswith("*") for t in s.trajectories):
        return None  # the report does not name everything it runs: only a whole export empties it
    kv2, n2 = dict(kv), dict(n)
    out: dict[str, list[str]] = {}
    for t in sorted(s.trajectories, key=lambda t: (-t.kv, t.traj_id)):
        d = _densest(cands, s, emptied, kv2, n2, t.kv, 1, c_max, bound_b)
        if d is None:
            return None
        kv2[d.node_id] += t.kv
        n2[d.node_id] += 1
        out.setdefault(d.node_id, []).append(t.traj_id)
    kv.update(kv2)
    n.update(n2)
    return out


def _plan_version(
    cands: list[RolloutLoad], c_max: float, bound_b: int, split: bool = False
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
        best = _densest(cands, s, emptied, kv, n, s_kv, s_n, c_max, bound_b)
        if best is not None:
            kv[best.node_id] += s_kv
            n[best.node_id] += s_n
            ids = tuple(t.traj_id for t in s.trajectories)
            parts = {best.node_id: list(ids)}
        elif split and (spread := _spread(cands, s, emptied, kv, n, c_max, bound_b)) is not None:
            parts = spread
        else:
            continue  # all or nothing: nothing partial is moved
        received.update(parts)
        emptied.add(s.node_id)
        for dest, tids in parts.items():
            moves.append(Move(source=s.node_id, dest=dest, traj_ids=tuple(tids), version=s.version))
    return moves, list(dict.fromkeys(m.source for m in moves))


def plan_repack(
    rollouts: Sequence[RolloutLoad], c_max: float, bound_b: int, *, split: bool = False
) -> RepackPlan:
    """Best-fit consolidation of draining rollouts, per weight version (see module docstring);
    `split`: a source no single destination takes may be spread over several.

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
        m, e = _plan_version(by_version[version], c_max, bound_b, split)
        moves += m
        emptied += e
    return RepackPlan(moves=tuple(moves), emptied=tuple(emptied))
