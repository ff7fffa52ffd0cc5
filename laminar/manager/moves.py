"""One repack round on a live cluster: plan from the rollouts' statuses, run the moves.

    repacker = Repacker(srv, placer, cfg.manager.repack, metrics, log, max_inflight=n)
    entry = await repacker.round(trainer_version)   # {} when nothing moved, else the round's record

    statuses (NodeStatus.rollout: per-trajectory KV) ──► rollout_loads() ──► plan_repack (repack.py)
    each move: ExportRequest ──► source ──partials──► placer.place(prefer=dest) ──Import──► dest
    each emptied source, after its moves (several in turn when manager.repack.split_sources
    spread it): RefreshRequest ──► the source     (new weights, then new prompts)

The moves of one round run concurrently, at most manager.repack.max_concurrent_moves at once,
so a round costs about one export + one import round trip. A slow or dead rollout makes one
move fail (logged, counted); every RPC has a deadline.

Planning view: the statuses rollouts send with every beat and, in laminar mode, push as soon
as they change (rollout.status_push), so a round plans on what holds now; a plan on a view
half a beat old found a third of its sources' trajectories already finished (and sent some
to destinations that had refreshed meanwhile). Each round records how old its view was
(repack_status_age_s), what it found missing (move_export_missing / move_export_empty) and
how long exports and imports took (move_export_s / move_place_s).

Claims are bounded (`max_inflight`: laminar/config.py inflight_per_rollout(), the most samples a
rollout can hold since the buffer never has more generating): a status claiming more in flight
is clamped to it, one listing more trajectories than that, or any count below 0, is left out of
the round, and KV use is taken within [0, 1]; each such status is counted once per rollout
(`status_claims_clamped`, `claims[node]`). An export answered with trajectories the move did not
ask for (or more than the bound) is cut to what was asked (`move_export_unasked`). So a
round's work is bounded by the config, whatever a rollout says about itself.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import structlog

from laminar.config import RepackConfig
from laminar.manager.placement import ORPHAN, Placer
from laminar.manager.repack import Move, RolloutLoad, TrajLoad, is_candidate, plan_repack
from laminar.metrics import Metrics
from laminar.protocol.core import NodeStatus
from laminar.protocol.rollout import ExportReply, ExportRequest, RefreshRequest
from laminar.transport.server import RpcServer
from laminar.transport.sockets import RemoteError, TransportError


class Repacker:
    def __init__(
        self,
        srv: RpcServer,
        placer: Placer,
        repack: RepackConfig,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        *,
        max_inflight: int,
    ):
        self.srv, self.placer, self.repack = srv, placer, repack
        self.metrics, self.log = metrics, log
        self.max_inflight = max_inflight
        """Most trajectories a rollout can hold (a claim above it is clamped or left out)."""
        self.prev_kv: dict[str, float] = {}
        """KV use of each rollout at the previous round: rising KV means it is not draining."""
        self.claims: Counter[str] = Counter()
        """Rollout id -> statuses of it whose claims were clamped or left out."""
        self.moving: Counter[str] = Counter()
        """Source rollout id -> its moves under way. From the export on, the samples are in no
        rollout's status and (until the placer has them) in nobody's hands: the reconciliation
        leaves such a rollout alone."""
        self._judged: dict[str, object] = {}
        """Rollout id -> the status last judged (each status is counted once; the object, as a freed
        status's id() is reused)."""

    def _claim_problem(self, s: NodeStatus) -> str:
        """What is out of bounds in a status ("" when nothing): the counts and KV it claims."""
        cap = self.max_inflight
        tokens = s.rollout.traj_tokens if s.rollout is not None else {}
        if len(tokens) > cap or min(s.inflight, s.running, s.waiting) < 0:
            return "refused"
        if s.inflight > cap or s.running > cap or not 0.0 <= s.kv_use <= 1.0:
            return "clamped"
        return ""

    def rollout_loads(self) -> list[RolloutLoad]:
        loads = []
        cap_n = self.max_inflight
        for p in self.placer.live():
            s = p.status
            if s is None or s.version < 0 or not self.placer.usable(p):
                continue
            problem = self._claim_problem(s)
            if problem and self._judged.get(p.node_id) is not s:
                self._judged[p.node_id] = s
                self.claims[p.node_id] += 1
                self.metrics.count(f"status_claims_{problem}")
                self.log.warning(
                    "status_claim_out_of_bounds",
                    peer=p.node_id,
                    action=problem,
                    inflight=s.inflight,
                    running=s.running,
                    bound=cap_n,
                )
            if problem == "refused":
                continue  # planned on nothing it says until a status within bounds
            kv_use = min(1.0, max(0.0, s.kv_use)) if math.isfinite(s.kv_use) else 1.0
            inflight = min(s.inflight, cap_n)
            prev = self.prev_kv.get(p.node_id)
            self.prev_kv[p.node_id] = kv_use
            load = RolloutLoad(
                node_id=p.node_id,
                version=s.version,
                kv_use=kv_use,
                kv_rising=prev is not None and kv_use > prev + 1e-9,
                running=min(s.running, cap_n),
                waiting=s.waiting,
                draining=self._draining(s),
            )
            # only a candidate's trajectories are planned on: most rollouts decode a full batch
            # most of the time, and listing their ~B trajectories each round was most of a round
            if is_candidate(load, self.repack.c_max, self.placer.bound_b):
                load = replace(load, trajectories=self._traj_loads(s, kv_use, inflight))
            loads.append(load)
        return loads

    @staticmethod
    def _traj_loads(s: NodeStatus, kv_use: float, inflight: int) -> tuple[TrajLoad, ...]:
        """The rollout's in-flight trajectories with their share of its KV cache."""
        if s.rollout is not None and s.rollout.traj_tokens:
            cap = float(s.rollout.kv_capacity_tokens) or 1.0  # 0: capacity unknown
            return tuple(
                TrajLoad(u, min(1.0, max(0.0, t / cap)))
                for u, t in sorted(s.rollout.traj_tokens.items())
            )
        # no per-trajectory report: split the rollout's KV evenly over what it runs
        n = max(1, inflight)
        return tuple(TrajLoad(f"*{i}", kv_use / n) for i in range(inflight))

    def _draining(self, s: NodeStatus) -> bool | None:
        """The rollout's own word that it drains (manager.repack.candidates = draining)."""
        if self.repack.candidates != "draining" or s.rollout is None:
            return None
        return s.rollout.target_version > s.version

    async def round(self, trainer_version: int) -> dict[str, Any]:
        """Plan one round from the latest statuses and run its moves concurrently; returns the
        round's record ({"moves": 0} when the plan was empty)."""
        t0 = time.monotonic()
        loads = self.rollout_loads()
        c_max, bound = self.repack.c_max, self.placer.bound_b
        plan = plan_repack(loads, c_max, bound, split=self.repack.split_sources)
        self.metrics.count("repack_rounds")
        self.metrics.count("repack_candidates", sum(is_candidate(r, c_max, bound) for r in loads))
        self.metrics.count(
            "repack_rising", sum(r.kv_rising and 0 < r.running < bound for r in loads)
        )
        if not plan:
            return {"moves": 0}
        now_wall = time.time()
        by_id = {p.node_id: p for p in self.placer.live()}
        for (
            mv
        ) in plan.moves:  # how old the view each move was planned on is (source and destination)
            for node in (mv.source, mv.dest):
                s = by_id[node].status if node in by_id else None
                if s is not None and s.rollout is not None:
                    self.metrics.add("repack_status_age_s", now_wall - s.rollout.measured_at)
        emptied = set(plan.emptied)
        # concurrent (a round costs about one move's round trips), bounded (a round of a thousand
        # rollouts does not put hundreds of exports on the wire at once)
        slots = asyncio.Semaphore(self.repack.max_concurrent_moves)

        by_source: dict[str, list[Move]] = {}  # a split source: its moves in turn, then a refresh
        for mv in plan.moves:
            by_source.setdefault(mv.source, []).append(mv)

        async def bounded(mvs: list[Move]) -> dict[str, int]:
            async with slots:
                return await self.move_parts(mvs, mvs[0].source in emptied, trainer_version)

        results = await asyncio.gather(*(bounded(mvs) for mvs in by_source.values()))
        moved = sum(r["moved"] for r in results)
        overhead_s = round(time.monotonic() - t0, 4)
        entry = {
            "t": time.time(),
            "moves": len(plan.moves),
            "trajectories": moved,
            "emptied": list(plan.emptied),
            "failed": sum(r["failed"] for r in results),
            "elsewhere": sum(r["elsewhere"] for r in results),
            "orphaned": sum(r["orphaned"] for r in results),
            "overhead_s": overhead_s,
            "sources": [m.source for m in plan.moves],
            "dests": [m.dest for m in plan.moves],
        }
        self.metrics.add("repack_overhead_s", overhead_s)
        self.metrics.count("repack_trajectories", moved)
        return entry

    async def move(self, mv: Move, refresh: bool, trainer_version: int) -> dict[str, int]:
        """One move: export everything listed on the source, import it on the destination (or the
        next rollout of that version), then send the emptied source to refresh its weights."""
        return await self.move_parts([mv], refresh, trainer_version)

    async def move_parts(
        self, mvs: list[Move], refresh: bool, trainer_version: int
    ) -> dict[str, int]:
        """The moves of one source (several when the plan split it), one after another: each
        exports its share naming its own destination (where the share's agents look first) and
        places it there; once all are placed the emptied source refreshes its weights (a refresh
        between two would load new weights under trajectories still to be exported)."""
        out = {"moved": 0, "failed": 0, "elsewhere": 0, "orphaned": 0}
        source = mvs[0].source
        self.moving[source] += 1
        try:
            for mv in mvs:
                for k, v in (await self._export_place(mv, trainer_version)).items():
                    out[k] += v
        finally:
            self.moving[source] -= 1
            if self.moving[source] <= 0:
                del self.moving[source]
        if refresh:  # the source holds nothing now: new weights, then new prompts
            try:
                await self.srv.request(
                    mvs[0].source,
                    RefreshRequest(min_version=trainer_version),
                    timeout=self.placer.request_timeout_s,
                )
            except (TransportError, RemoteError) as exc:
                self.log.warning("refresh_failed", rollout=mvs[0].source, error=str(exc))
        return out

    async def _export_place(self, mv: Move, trainer_version: int) -> dict[str, int]:
        """Export what the move lists on its source; import it on its destination (or the next
        rollout of that version)."""
        out = {"moved": 0, "failed": 0, "elsewhere": 0, "orphaned": 0}
        uids = [] if any(t.startswith("*") for t in mv.traj_ids) else list(mv.traj_ids)
        timeout = self.placer.request_timeout_s
        t0 = time.monotonic()
        try:
            ask = ExportRequest(uids=uids, dest=mv.dest)  # dest: where the agents look first
            exp = await self.srv.request(mv.source, ask, timeout=timeout)
        except (TransportError, RemoteError) as exc:
            out["failed"] = 1
            self.metrics.count("repack_export_failed")
            self.log.warning("repack_move_failed", source=mv.source, dest=mv.dest, error=str(exc))
            return out
        if not isinstance(exp, ExportReply):
            out["failed"] = 1
            return out
        t1 = time.monotonic()
        self.metrics.add("move_export_s", t1 - t0)
        self.metrics.count("move_export_missing", len(exp.missing))
        if not exp.partials:
            self.metrics.count("move_export_empty")
        if uids or len(exp.partials) > self.max_inflight:  # only what the move asked for
            asked = set(uids)
            kept = [p for p in exp.partials if not asked or p.uid in asked][: self.max_inflight]
            if len(kept) < len(exp.partials):
                self.metrics.count("move_export_unasked", len(exp.partials) - len(kept))
                exp.partials = kept
        if exp.partials:
            placed = await self.placer.place(
                exp.partials, trainer_version, prefer=mv.dest, source=mv.source
            )
            self.metrics.add("move_place_s", time.monotonic() - t1)
            out["moved"] = len(exp.partials)
            out["elsewhere"] = sum(n for node, n in placed.items() if node not in (mv.dest, ORPHAN))
            out["orphaned"] = placed.get(ORPHAN, 0)
        return out
