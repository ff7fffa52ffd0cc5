"""Dynamic repack inside the simulator, as the manager node runs it (mixed into simcore.Sim).

    heartbeat (every status_age_s, per-rollout phase) ─┬─► r.status = (RolloutLoad, traj loads, t)
    push on change (status_push_min_s rate bound) ─────┘
    round (every repack_interval_s, and right after each trainer update)
        ──► laminar.manager.repack.plan_repack(statuses)      the real planner, on what it was told
        ──► export on the source (what still runs there; at most max_concurrent_moves at once)
                                                              ──► source refills / pulls weights
        ──► import repack_move_s later on the destination      same version? resume : next rollout
                                                               of that version : restart from prompt

Mechanisms of laminar/manager/node.py modelled here, each with a measured or configured input:
- The planner sees each rollout's last heartbeat (`status_age_s` = transport.heartbeat_interval_s),
  not its state now: a "draining" rollout may have finished, refreshed or taken new groups since.
  KV "rising" compares the status seen at this round with the one seen at the previous round
  (the same report twice counts as not rising), as `Repacker.rollout_loads`
  (laminar/manager/moves.py) does.
- With `status_push_min_s` > 0 (rollout.status_push in laminar mode with repack on, as
  `RolloutNode.main` spawns its push loop) a rollout also reports as soon as something the
  planner uses changed (a sequence finished, work came or left, weights loaded), at most once
  per status_push_min_s: a change inside that bound goes out when it ends, with the state then.
  So the view is about as old as the time since the last change, not half a beat (the
  simulator's `view_age_s` is the manager's repack_status_age_s, compared in bench/cluster.py).
- A move exports only the trajectories its plan listed that still run on the source; ones that
  finished meanwhile are missing, ones started since stay.
- Moved trajectories reach the destination `repack_move_s` later (the measured round overhead):
  they decode nowhere meanwhile, while the emptied source already takes new work.
- A destination whose version changed meanwhile (it drained and refreshed) rejects the import
  (version_mismatch); the partials go to another rollout of their version (busy, not full,
  emptiest first) or, with none left, restart from the prompt on the newest version's least
  loaded rollout, losing their tokens (`Placer.place` / `_restart_elsewhere` in
  laminar/manager/placement.py; their group keeps its version in the staleness figures).
- With `repack_period_restarts`, a round triggered by an update restarts the periodic timer.
- `max_concurrent_moves`: past the bound, the k-th wave of a round's moves exports
  k * repack_move_s after the round (a slot frees when an earlier move is done).

With status_age_s = repack_move_s = 0 (paper scale) the planner sees the exact state and moves
are instantaneous. Tests: .venv/bin/python -m pytest tests/test_simulate.py -q
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from laminar.manager.repack import RolloutLoad, TrajLoad, is_candidate

EV_REPACK, EV_BEAT, EV_ARRIVE, EV_PUSH, EV_EXPORT = 6, 7, 8, 12, 13


class _TrajView:
    """A status report's trajectories as of the report (ids, generated-token bases), turned into
    the planner's TrajLoad records only when a repack round reads that report."""

    __slots__ = ("ids", "bases", "pt", "prog", "cap")

    def __init__(
        self, ids: tuple[int, ...], bases: list[tuple[int, float]], pt: int, prog: float, cap: int
    ) -> None:
        self.ids, self.bases, self.pt, self.prog, self.cap = ids, bases, pt, prog, cap

    def loads(self) -> tuple[TrajLoad, ...]:
        pt, prog, cap = self.pt, self.prog, self.cap
        return tuple(
            TrajLoad(str(i), (pt + g0 + prog - sp) / cap)
            for i, (g0, sp) in zip(self.ids, self.bases, strict=True)
        )


_NO_TRAJS = _TrajView((), [], 0, 0.0, 1)


class RepackMixin:
    """Repack rounds, heartbeats and move arrivals of a Sim (uses its rollouts and helpers)."""

    prm: Any
    ro: list[Any]
    now: float
    rb: int

    def repack_start(self, seed: int) -> None:
        """Schedule the first periodic round and, with status reports, every rollout's first
        beat."""
        self.repack_gen = 0
        self.push(self.prm.repack_interval_s, EV_REPACK, 0)
        if self.prm.status_age_s > 0:
            phase = random.Random(seed * 7919 + 17)  # own stream: the length draws stay the same
            for r in self.ro:
                r.status = None
                self.push(phase.uniform(0.0, self.prm.status_age_s), EV_BEAT, r.idx)

    def pushes_status(self) -> bool:
        return bool(
            getattr(self, "do_repack", False)
            and self.prm.status_age_s > 0
            and self.prm.status_push_min_s > 0
        )

    def note_change(self, r: Any) -> None:
        """Something repack plans from changed on `r`: push its status now, or once the rate bound
        (status_push_min_s since the last push) allows; changes meanwhile go out together."""
        if not self.pushes_status():
            return
        if self.now >= r.push_next:
            self.send_status(r)
        elif not r.push_pending:
            r.push_pending = True
            self.push(r.push_next, EV_PUSH, r.idx)

    def send_status(self, r: Any) -> None:
        self.advance(r)
        r.status = self.report(r)
        r.push_next, r.push_pending = self.now + self.prm.status_push_min_s, False
        self.counts["status_pushes"] += 1

    def on_repack_event(self, kind: int, data: Any) -> None:
        if kind == EV_REPACK:
            if data == self.repack_gen:  # a stale timer (restarted by an update round) is ignored
                self.repack()
        elif kind == EV_BEAT:
            r = self.ro[data]
            self.advance(r)
            r.status = self.report(r)
            self.push(self.now + self.prm.status_age_s, EV_BEAT, data)
        elif kind == EV_PUSH:
            self.send_status(self.ro[data])
        elif kind == EV_ARRIVE:
            self.arrive(*data)
        elif kind == EV_EXPORT:
            self.export(*data)

    def report(self, r: Any) -> tuple[RolloutLoad, _TrajView, float]:
        """What a rollout's status says now: version, KV use, counts, per-trajectory KV, time."""
        cap = self.prm.kv_capacity_tokens
        use = self.kv(r) / cap
        load = RolloutLoad(str(r.idx), r.version, use, False, len(r.running), len(r.waiting))
        if r.waiting or not 0 < len(r.running) < self.rb or use >= self.prm.c_max:
            # never a candidate (is_candidate), so its trajectories are never read: the per-
            # trajectory list, most of the simulator's time at scale, is built only when it may be
            return load, _NO_TRAJS, self.now
        # each trajectory's KV as of now, as numbers; the planner's records are built only for
        # the report a repack round reads (a rollout reports many times per round)
        return (
            load,
            _TrajView(
                tuple(r.running),
                [(t.gen0, t.start_p) for t in r.running.values()],
                self.prm.prompt_tokens,
                r.prog,
                cap,
            ),
            self.now,
        )

    def repack(self, after_update: bool = False) -> None:
        if after_update and not self.prm.repack_period_restarts:
            pass  # fixed grid: the periodic timer keeps its phase
        else:
            self.repack_gen += 1
            self.push(self.now + self.prm.repack_interval_s, EV_REPACK, self.repack_gen)
        loads = []
        for r in self.ro:
            if self.prm.status_age_s > 0:
                if r.status is None:
                    continue  # not reported yet
                load, trajs, _ = r.status
            else:
                if r.pulling:
                    continue
                self.advance(r)
                load, trajs, _ = self.report(r)
            load = replace(load, kv_rising=load.kv_use > r.last_kv + 1e-12)
            if self.prm.repack_by_draining:
                load = replace(load, draining=self.draining(r))
            r.last_kv = load.kv_use
            if is_candidate(load, self.prm.c_max, self.rb):  # only candidates' trajectories matter
                load = replace(load, trajectories=trajs.loads())
            loads.append(load)
        plan = self.plan(loads)
        self.counts["repack_rounds"] += 1
        wave = self.prm.max_concurrent_moves or len(plan.moves) or 1
        for i, m in enumerate(plan.moves):
            for node in (m.source, m.dest):  # how old the view each move was planned on is
                st = self.ro[int(node)].status
                if st is not None and self.prm.status_age_s > 0:
                    self.view_age[0] += self.now - st[2]
                    self.view_age[1] += 1
            if i >= wave and self.prm.repack_move_s > 0:  # waits for a slot: an earlier move ends
                self.push(self.now + (i // wave) * self.prm.repack_move_s, EV_EXPORT, (m,))
            else:
                self.export(m)

    def export(self, m: Any) -> None:
        """One move: the source gives up what still runs of the listed trajectories; they reach the
        destination repack_move_s later."""
        src, dst = self.ro[int(m.source)], self.ro[int(m.dest)]
        self.advance(src)
        here = {**{t.id: t for t in src.waiting}, **src.running}
        moved = [here[int(tid)] for tid in m.traj_ids if int(tid) in here]
        for t in moved:  # export: abort on the source, every token so far travels
            if t.id in src.running:
                self.remove(src, t)
            else:
                src.waiting.remove(t)
            self.release(src, t)
        self.counts["moves"] += 1
        self.counts["moved_trajs"] += len(moved)
        self.counts["export_missing"] += len(m.traj_ids) - len(moved)
        self.counts["export_empty"] += not moved
        if moved:
            if self.prm.repack_move_s > 0:
                self.push(self.now + self.prm.repack_move_s, EV_ARRIVE, (dst.idx, m.version, moved))
            else:
                self.arrive(dst.idx, m.version, moved)
        self.admit(src)  # the source may still run trajectories started after its report
        self.refill(src)
        self.schedule(src)
        self.note_change(src)

    def arrive(self, dest: int, version: int, trajs: list[Any]) -> None:
        """Import on the planned destination, else another rollout of the version, else restart."""
        order = [self.ro[dest]]
        newest = max(r.version for r in self.ro)
        others = [
            r
            for r in self.ro
            if r.idx != dest
            and r.version == version
            and not r.pulling
            and (r.running or r.waiting or version >= newest)
        ]
        others.sort(key=lambda r: (len(r.running) >= self.rb, self.kv(r), r.idx))
        order += others[:3]  # PLACE_TRIES = 4 rollouts in all
        for i, r in enumerate(order):
            if r.version == version and not r.pulling:
                if i:
                    self.counts["import_elsewhere"] += len(trajs)
                break
            self.counts["import_rejected"] += len(trajs)
        else:  # nobody holds the version: start over from the prompt at the newest one
            live = [r for r in self.ro if not r.pulling] or self.ro
            r = min(live, key=lambda r: (-r.version, len(r.running), self.kv(r), r.idx))
            for t in trajs:
                t.restart()
            self.counts["restarted_from_prompt"] += len(trajs)
        self.advance(r)
        r.waiting.extend(trajs)
        for t in trajs:
            self.hold(r, t)
        if self.prm.repack_fixed_s:
            r.stall_until = max(r.stall_until, self.now) + self.prm.repack_fixed_s
        self.admit(r)
        self.schedule(r)
        self.note_change(r)
