"""Manager node: membership, dynamic repack, failure recovery, relay chain order.

    every node ──Hello / Heartbeat(NodeStatus)──► manager          membership + cluster state
    trainer ──VersionPublished──► manager ──► repack now            (and every repack.interval_s)
                                          ──RefreshRequest──► rollouts   (laminar, no relay tier: sim handoff)
    manager ──ExportRequest──► source rollout ──partials──► manager ──ImportRequest──► destination
    manager ──RefreshRequest──► emptied source                      (pull newest weights, take new prompts)
    rollout dies / leaves / restarts ──► manager ──PartialsRequest(rollout_id)──► buffer ──partials──► healthy rollouts
    relay joins/dies ──► manager ──ChainUpdate(order)──► live relays
    laminar status ──StatusRequest──► manager ──StatusReply──► table

What blocks what: the repack and recovery loops run as supervised tasks and only
wait on RPCs with deadlines; a slow or dead rollout makes one move fail (logged,
counted) and never stalls membership or heartbeats. The moves of one repack round
run concurrently, at most manager.repack.max_concurrent_moves at once (each: export on
its source, import on its destination, refresh the emptied source), so a round costs
about one export + one import round trip.

Planning view: the statuses rollouts send with every beat and, in laminar mode, push as
soon as they change (rollout.status_push), so a round plans on what holds now; a plan on a
view half a beat old found a third of its sources' trajectories already finished (and sent
some to destinations that had refreshed meanwhile). Each round logs how old its view was
(repack_status_age_s), what it found missing (move_export_missing / move_export_empty) and
how long exports and imports took (move_export_s / move_place_s).

Each trajectory keeps one policy version: moves go between rollouts of the same
version. The manager's view of versions comes from heartbeats and may be a beat
old: a destination that refreshed meanwhile answers version_mismatch, is marked
stale until its next heartbeat, and the partials try the next rollout of that
version (at most PLACE_TRIES in all, the source last). Only when no live rollout
holds the version does a trajectory restart from its prompt at another version;
partials that nobody took are kept as orphans and placed again every second.

Whose work needs recovering: a rollout declared dead (missed heartbeats), one that
left (Bye: a graceful stop leaves its unfinished trajectories in the partial pool),
and one that came back as a new incarnation (pid/start time changed) before its
death was noticed. A reconnect of the same incarnation is not a loss and is not
recovered.

Run: laminar node --role manager --config configs/demo.yaml
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from typing import Any

from laminar.manager.repack import Move, RolloutLoad, TrajLoad, is_candidate, plan_repack
from laminar.node import Node
from laminar.protocol.buffer import PartialsReply, PartialsRequest
from laminar.protocol.core import NodeStatus
from laminar.protocol.data import PartialTrajectory
from laminar.protocol.manager import NodeEntry, StatusReply, StatusRequest
from laminar.protocol.relay import ChainUpdate
from laminar.protocol.rollout import (
    VERSION_MISMATCH,
    ExportReply,
    ExportRequest,
    ImportReply,
    ImportRequest,
    RefreshRequest,
)
from laminar.protocol.trainer import VersionPublished
from laminar.transport.sockets import Peer, RemoteError, TransportError

PLACE_TRIES = 4
"""Rollouts one batch of partials is offered to before it restarts from the prompt elsewhere."""
_ORPHAN = "<orphan>"


class ManagerNode(Node):
    role = "manager"
    registers_with_manager = False

    async def setup(self) -> None:
        self.trainer_version = -1
        self.prev_kv: dict[str, float] = {}
        self.repack_now = asyncio.Event()
        self.recovery_queue: asyncio.Queue[str] = asyncio.Queue()
        self.orphans: list[PartialTrajectory] = []
        self.chain_epoch = 0
        self.chain_order: list[int] = []
        self.repack_log: list[dict[str, Any]] = []
        self.recovery_log: list[dict[str, Any]] = []
        self._timeline = None
        if self.cfg.manager.timeline_interval_s > 0:  # open before anyone can join: no event is missed
            path = self.cfg.resolved_run_dir() / "timeline.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._timeline = open(path, "a", buffering=1)
            self.on_close(self._timeline.close)
        self.srv = self.server(self.cfg.bind_endpoint("manager"), on_peer_dead=self._on_dead, on_peer_join=self._on_join)
        self.srv.on(StatusRequest, self._on_status)
        self.srv.on(VersionPublished, self._on_version)
        await self.srv.start()
        self._buffer = None
        self._relay_clients: dict[int, Any] = {}
        self._chain_lock = asyncio.Lock()
        self._incarnation: dict[str, tuple[Any, Any]] = {}
        """rollout id -> (pid, start time) of the incarnation last seen (rejoin detection)."""
        self._rollouts_seen: set[str] = set()
        """Rollouts that were members since their last recovery (leave detection)."""
        self._stale: dict[str, int] = {}
        """rollout id -> id() of the status it had when it answered version_mismatch: skipped until a new beat."""

    async def main(self) -> None:
        self.spawn(self._recovery_loop(), "recovery")
        if self.cfg.manager.timeline_interval_s > 0:
            self.spawn(self._timeline_loop(), "timeline")
        if self.cfg.mode == "laminar" and self.cfg.manager.repack.enabled:
            self.spawn(self._repack_loop(), "repack")
        await self.stopping.wait()

    # ---- membership ---------------------------------------------------------------------
    def _live(self, role: str) -> list[Peer]:
        return [p for p in self.srv.peers.values() if p.alive and p.role == role]

    def _on_join(self, peer: Peer) -> None:
        self.metrics.count("joins")
        if peer.role == "rollout":
            inc = (peer.info.get("pid"), peer.info.get("started"))
            old = self._incarnation.get(peer.node_id)
            self._incarnation[peer.node_id] = inc
            rejoin = old is not None
            if rejoin and old != inc and peer.node_id in self._rollouts_seen:
                # restarted before its death was noticed: the old incarnation's work is orphaned
                self.metrics.count("restarts_unnoticed")
                self._queue_recovery(peer.node_id, "restarted")
            self._rollouts_seen.add(peer.node_id)
            self._stale.pop(peer.node_id, None)
            self._event("join", node=peer.node_id, role=peer.role, rejoin=rejoin)
            if rejoin:
                self.metrics.count("rejoins")
                self.log.info("rollout_rejoined", peer=peer.node_id, new_incarnation=old != inc)
        else:
            self._event("join", node=peer.node_id, role=peer.role)
        if peer.role == "relay":
            self._schedule_chain()

    def _on_dead(self, peer: Peer) -> None:
        self.metrics.count("deaths")
        self.log.warning("node_dead", peer=peer.node_id, peer_role=peer.role)
        self._event("dead", node=peer.node_id, role=peer.role)
        if peer.role == "rollout":
            self._queue_recovery(peer.node_id, "dead")
        elif peer.role == "relay":
            self._schedule_chain()

    def _queue_recovery(self, rollout_id: str, why: str) -> None:
        self._rollouts_seen.discard(rollout_id)
        self.recovery_queue.put_nowait(rollout_id)
        self.log.info("recovery_queued", rollout=rollout_id, reason=why)

    def _check_leaves(self) -> None:
        """Rollouts that said Bye are gone from the server's peers without a death: recover them too
        (a graceful stop leaves what it could not finish in the partial pool for exactly this)."""
        for node_id in list(self._rollouts_seen):
            if node_id not in self.srv.peers:
                self.metrics.count("leaves")
                self._event("left", node=node_id, role="rollout")
                self._queue_recovery(node_id, "left")
        for p in self._live("rollout"):  # declared dead, then heard from again (a long stall): a member again
            self._rollouts_seen.add(p.node_id)

    def members(self) -> list[NodeEntry]:
        now = time.monotonic()
        out = []
        for p in self.srv.peers.values():
            if p.role == "cli":
                continue
            status = p.status
            if status is not None and p.role == "rollout" and self.trainer_version >= 0 and status.version >= 0:
                status.staleness = float(self.trainer_version - status.version)
            pid = p.info.get("pid", 0)
            out.append(NodeEntry(node_id=p.node_id, role=p.role, alive=p.alive, last_beat_s=round(now - p.last_seen, 3),
                                 status=status, pid=pid if isinstance(pid, int) else 0))  # fmt: skip
        return out

    async def _on_status(self, peer: Peer, msg: StatusRequest) -> StatusReply:
        return StatusReply(nodes=self.members(), trainer_version=self.trainer_version, mode=self.cfg.mode)

    async def _on_version(self, peer: Peer, msg: VersionPublished) -> None:
        if msg.version > self.trainer_version:
            self.trainer_version = msg.version
            self._event("version", version=msg.version, handoff=msg.handoff, stall_s=msg.stall_s)
            if msg.handoff == "sim" and self.cfg.mode == "laminar":
                # no relay tier carries this version (sim trainer, no relays): say it exists, so the
                # rollouts pull it when idle as they would from a relay (one-way, best-effort)
                await self.srv.broadcast(RefreshRequest(min_version=msg.version), role="rollout")
            self.repack_now.set()  # the paper repacks right after each update: free rollouts for the new version

    def status(self) -> NodeStatus:
        return NodeStatus(node_id=self.node_id, role=self.role, version=self.trainer_version,
                          extra={"members": len(self.srv.peers), "repacks": len(self.repack_log),
                                 "recoveries": len(self.recovery_log), "orphans": len(self.orphans)})  # fmt: skip

    # ---- timeline (report.png's utilisation panel, bench idle fractions) -------------------
    def _event(self, kind: str, **fields: Any) -> None:
        if self._timeline is not None and not self._timeline.closed:  # (closed while stopping)
            self._timeline.write(json.dumps({"t": round(time.time(), 3), "event": kind, **fields}) + "\n")

    async def _timeline_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.manager.timeline_interval_s)  # a sampling timer
            for p in self._live("rollout"):
                s = p.status
                if s is not None:
                    self._event("rollout", node=p.node_id, version=s.version, running=s.running,
                                waiting=s.waiting, kv=round(s.kv_use, 4), inflight=s.inflight)  # fmt: skip
            self._event("trainer", version=self.trainer_version)

    # ---- relay chain ----------------------------------------------------------------------
    def _schedule_chain(self) -> None:
        self.spawn(self._update_chain(), "chain-update")

    async def _update_chain(self) -> None:
        async with self._chain_lock:
            await self._update_chain_locked()

    async def _update_chain_locked(self) -> None:
        relays = sorted(self._live("relay"), key=lambda p: _index(p.node_id))
        # lowest live index first: the same rule the relays use to elect a master among themselves
        # and the trainer's default push target, so the head never depends on registration order
        order = [_index(p.node_id) for p in relays]
        if order == self.chain_order:
            return
        self.chain_epoch += 1
        self.chain_order = order
        self.log.info("chain_update", epoch=self.chain_epoch, order=order)
        msg = ChainUpdate(epoch=self.chain_epoch, order=order)
        for idx in order:
            try:
                cli = self._relay_clients.get(idx)
                if cli is None:  # relays serve ChainUpdate on their own ROUTER
                    cli = self._relay_clients[idx] = self.client(self.cfg.endpoint("relay", idx))
                if not cli.connected:
                    await cli.connect(timeout=self.cfg.transport.handshake_timeout_s)
                await cli.request(msg, timeout=self.cfg.transport.request_timeout_s, retries=1)
            except (TransportError, RemoteError) as exc:
                self.log.warning("chain_update_failed", relay=idx, error=str(exc))

    # ---- repack ---------------------------------------------------------------------------
    def _usable(self, p: Peer) -> bool:
        """A live rollout whose last status is not known to be stale (it answered version_mismatch)."""
        return p.status is not None and self._stale.get(p.node_id) != id(p.status)

    def rollout_loads(self) -> list[RolloutLoad]:
        loads = []
        for p in self._live("rollout"):
            s = p.status
            if s is None or s.version < 0 or not self._usable(p):
                continue
            prev = self.prev_kv.get(p.node_id)
            self.prev_kv[p.node_id] = s.kv_use
            trajs = s.extra.get("trajs")
            if isinstance(trajs, dict) and trajs:
                cap = float(s.extra.get("kv_capacity_tokens") or 0) or 1.0
                tl = tuple(TrajLoad(str(u), float(t) / cap) for u, t in sorted(trajs.items()))
            else:  # no per-trajectory report: split the rollout's KV evenly over what it runs
                n = max(1, s.inflight)
                tl = tuple(TrajLoad(f"*{i}", s.kv_use / n) for i in range(s.inflight))
            loads.append(RolloutLoad(node_id=p.node_id, version=s.version, kv_use=s.kv_use,
                                     kv_rising=prev is not None and s.kv_use > prev + 1e-9,
                                     running=s.running, waiting=s.waiting, trajectories=tl))  # fmt: skip
        return loads

    async def _repack_loop(self) -> None:
        # rounds start every interval_s (a slow round does not stretch the period) and right
        # after each trainer update (repack_now), when draining rollouts are worth freeing most
        interval = self.cfg.manager.repack.interval_s
        due = time.monotonic() + interval
        while True:
            try:
                await asyncio.wait_for(self.repack_now.wait(), max(0.0, due - time.monotonic()))
            except TimeoutError:
                pass
            if time.monotonic() >= due or self.repack_now.is_set():
                due = time.monotonic() + interval
            self.repack_now.clear()
            await self.repack_once()

    async def repack_once(self) -> dict[str, Any]:
        """Plan one round from the latest heartbeats and run its moves concurrently."""
        t0 = time.monotonic()
        loads = self.rollout_loads()
        c_max, bound = self.cfg.manager.repack.c_max, self.cfg.repack_bound_b()
        plan = plan_repack(loads, c_max, bound)
        self.metrics.count("repack_rounds")
        self.metrics.count("repack_candidates", sum(is_candidate(r, c_max, bound) for r in loads))
        self.metrics.count("repack_rising", sum(r.kv_rising and 0 < r.running < bound for r in loads))
        if not plan:
            return {"moves": 0}
        now_wall = time.time()
        by_id = {p.node_id: p for p in self._live("rollout")}
        for mv in plan.moves:  # how old the view each move was planned on is (source and destination)
            for node in (mv.source, mv.dest):
                s = by_id[node].status if node in by_id else None
                if s is not None and isinstance(s.extra.get("t"), float):
                    self.metrics.add("repack_status_age_s", now_wall - s.extra["t"])
        emptied = set(plan.emptied)
        # concurrent (a round costs about one move's round trips), bounded (a round of a thousand
        # rollouts does not put hundreds of exports on the wire at once)
        slots = asyncio.Semaphore(self.cfg.manager.repack.max_concurrent_moves)

        async def bounded(mv: Move) -> dict[str, int]:
            async with slots:
                return await self._move(mv, mv.source in emptied)

        results = await asyncio.gather(*(bounded(mv) for mv in plan.moves))
        moved = sum(r["moved"] for r in results)
        entry = {"t": time.time(), "moves": len(plan.moves), "trajectories": moved, "emptied": list(plan.emptied),
                 "failed": sum(r["failed"] for r in results), "elsewhere": sum(r["elsewhere"] for r in results),
                 "orphaned": sum(r["orphaned"] for r in results), "overhead_s": round(time.monotonic() - t0, 4)}  # fmt: skip
        self.repack_log.append(entry)
        self._event("repack", moves=entry["moves"], trajectories=moved, emptied=list(plan.emptied),
                    sources=[m.source for m in plan.moves], dests=[m.dest for m in plan.moves])  # fmt: skip
        self.metrics.add("repack_overhead_s", entry["overhead_s"])
        self.metrics.count("repack_trajectories", moved)
        self.log.info("repack", **{k: v for k, v in entry.items() if k != "t"})
        return entry

    async def _move(self, mv: Move, refresh: bool) -> dict[str, int]:
        """One move: export everything listed on the source, import it on the destination (or the
        next rollout of that version), then send the emptied source to refresh its weights."""
        out = {"moved": 0, "failed": 0, "elsewhere": 0, "orphaned": 0}
        uids = [] if any(t.startswith("*") for t in mv.traj_ids) else list(mv.traj_ids)
        timeout = self.cfg.transport.request_timeout_s
        t0 = time.monotonic()
        try:
            exp = await self.srv.request(mv.source, ExportRequest(uids=uids), timeout=timeout)
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
        if exp.partials:
            placed = await self._place(exp.partials, prefer=mv.dest, source=mv.source)
            self.metrics.add("move_place_s", time.monotonic() - t1)
            out["moved"] = len(exp.partials)
            out["elsewhere"] = sum(n for node, n in placed.items() if node not in (mv.dest, _ORPHAN))
            out["orphaned"] = placed.get(_ORPHAN, 0)
        if refresh:  # the source holds nothing now: new weights, then new prompts
            try:
                await self.srv.request(mv.source, RefreshRequest(min_version=self.trainer_version), timeout=timeout)
            except (TransportError, RemoteError) as exc:
                self.log.warning("refresh_failed", rollout=mv.source, error=str(exc))
        return out

    # ---- placing partial trajectories (repack moves, recovery, orphans) -----------------------
    def _candidates(self, version: int, prefer: str | None, source: str | None) -> list[Peer]:
        """Live rollouts that may hold `version` now, best first: the preferred one, then those
        decoding (a rollout with work cannot have changed version: it refreshes only when empty),
        emptiest first; idle ones only when the version is the newest (an idle rollout behind it
        refreshes at once); the source of a move last (it may not have refreshed yet)."""
        newest = max((p.status.version for p in self._live("rollout") if p.status is not None), default=-1)
        out = []
        for p in self._live("rollout"):
            if not self._usable(p) or p.status.version != version or p.node_id == source:
                continue
            if p.node_id != prefer and p.status.running == 0 and version < max(newest, self.trainer_version):
                continue
            out.append(p)
        out.sort(key=lambda p: (p.node_id != prefer, p.status.running >= self.cfg.repack_bound_b(),
                                p.status.kv_use, p.node_id))  # fmt: skip
        if source is not None and source in self.srv.peers and self.srv.peers[source].alive:
            out.append(self.srv.peers[source])
        return out[:PLACE_TRIES]

    async def _import(self, peer: Peer, items: list[PartialTrajectory]) -> bool:
        try:
            rep = await self.srv.request(peer.node_id, ImportRequest(partials=items),
                                         timeout=self.cfg.transport.request_timeout_s)  # fmt: skip
        except RemoteError as exc:
            if exc.code == VERSION_MISMATCH:  # refreshed since its last beat: skip it until the next one
                self._stale[peer.node_id] = id(peer.status)
                self.metrics.count("import_version_mismatch")
            else:
                self.log.warning("import_failed", dest=peer.node_id, error=str(exc))
            return False
        except TransportError as exc:
            self.log.warning("import_failed", dest=peer.node_id, error=str(exc))
            return False
        return isinstance(rep, ImportReply)

    async def _place(self, partials: list[PartialTrajectory], prefer: str | None = None,
                     source: str | None = None) -> dict[str, int]:  # fmt: skip
        """Import partials onto live rollouts of their own version (prefer `prefer`, `source` last);
        when none takes them, restart them from the prompt on a rollout of the newest version;
        what still finds no home becomes an orphan (placed again every second).
        Returns how many went where ({node_id or _ORPHAN: count})."""
        by_version: dict[int, list[PartialTrajectory]] = defaultdict(list)
        for p in partials:
            by_version[p.version].append(p)
        placed: dict[str, int] = defaultdict(int)
        for version, items in by_version.items():
            dest = None
            for peer in self._candidates(version, prefer, source):
                if await self._import(peer, items):
                    dest = peer.node_id
                    break
            if dest is None:
                dest = await self._restart_elsewhere(items)
            if dest is None:
                self.orphans.extend(items)
                dest = _ORPHAN
            placed[dest] += len(items)
        return dict(placed)

    async def _restart_elsewhere(self, items: list[PartialTrajectory]) -> str | None:
        """No live rollout holds their version: start them over, from the prompt, on the least
        loaded rollout of the newest version (their generated tokens are lost)."""
        peers = sorted((p for p in self._live("rollout") if self._usable(p)),
                       key=lambda p: (-p.status.version, p.status.running, p.status.kv_use, p.node_id))  # fmt: skip
        for peer in peers[:PLACE_TRIES]:
            if await self._import(peer, [_restart(p, peer.status.version) for p in items]):
                self.metrics.count("restarted_from_prompt", len(items))
                self.log.info("restarted_from_prompt", dest=peer.node_id, count=len(items),
                              lost_tokens=int(sum(len(p.response_ids) for p in items)))  # fmt: skip
                return peer.node_id
        return None

    # ---- failure recovery -----------------------------------------------------------------
    async def _buffer_client(self):
        if self._buffer is None:
            self._buffer = self.client(self.cfg.endpoint("buffer"))
            await self._buffer.connect(timeout=self.cfg.transport.startup_timeout_s)
        return self._buffer

    async def _recovery_loop(self) -> None:
        while True:
            try:
                dead = await asyncio.wait_for(self.recovery_queue.get(), 1.0)
            except TimeoutError:
                dead = None
            if dead is not None:
                await self.recover(dead)
            self._check_leaves()
            if self.orphans and self._live("rollout"):
                orphans, self.orphans = self.orphans, []
                await self._place(orphans)  # what still finds no home is back in self.orphans

    async def recover(self, rollout_id: str) -> None:
        t0 = time.monotonic()
        try:
            buf = await self._buffer_client()
            reply = await buf.request(PartialsRequest(rollout_id=rollout_id), timeout=self.cfg.transport.request_timeout_s)
        except (TransportError, RemoteError) as exc:
            self.log.warning("recovery_partials_failed", rollout=rollout_id, error=str(exc))
            self.recovery_queue.put_nowait(rollout_id)  # the buffer may be restarting: try again
            await asyncio.sleep(1.0)  # retry backoff
            return
        assert isinstance(reply, PartialsReply)
        # a rollout that rejoined under the same id may be running some of these already: the
        # buffer keeps the first finished copy of a uid, so a duplicate costs work, never data
        placed = await self._place(reply.partials) if reply.partials else {}
        orphaned = placed.get(_ORPHAN, 0)
        entry = {"t": time.time(), "rollout": rollout_id, "trajectories": len(reply.partials),
                 "tokens": int(sum(len(p.response_ids) for p in reply.partials)), "orphans": orphaned,
                 "placed": {k: v for k, v in placed.items() if k != _ORPHAN},
                 "seconds": round(time.monotonic() - t0, 4)}  # fmt: skip
        self.recovery_log.append(entry)
        self._event("recovery", rollout=rollout_id, trajectories=len(reply.partials), orphans=orphaned)
        self.log.info("rollout_recovered", **{k: v for k, v in entry.items() if k != "t"})


def _index(node_id: str) -> int:
    try:
        return int(node_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 1 << 30


def _restart(p: PartialTrajectory, version: int) -> PartialTrajectory:
    import numpy as np

    return PartialTrajectory(uid=p.uid, group_id=p.group_id, prompt_uid=p.prompt_uid, sample_index=p.sample_index,
                             prompt_ids=p.prompt_ids, response_ids=np.zeros(0, np.int32),
                             logprobs=np.zeros(0, np.float32), version=version, n=p.n, prompt=p.prompt, row=p.row,
                             rollout_id=p.rollout_id, resumed=p.resumed + 1, t_start=p.t_start)  # fmt: skip
