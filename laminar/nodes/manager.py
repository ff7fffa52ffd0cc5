"""Manager node: membership, dynamic repack, failure recovery, relay chain order.

    every node ──Hello / Heartbeat(NodeStatus)──► manager          membership + cluster state
    trainer ──VersionPublished──► manager ──► repack now            (and every repack.interval_s)
    manager ──ExportRequest──► source rollout ──partials──► manager ──ImportRequest──► destination
    manager ──RefreshRequest──► emptied source                      (pull newest weights, take new prompts)
    rollout dies ──► manager ──PartialsRequest(rollout_id)──► buffer ──partials──► healthy rollouts
    relay joins/dies ──► manager ──ChainUpdate(order)──► live relays
    laminar status ──StatusRequest──► manager ──StatusReply──► table

What blocks what: the repack and recovery loops run as supervised tasks and only
wait on RPCs with deadlines; a slow or dead rollout makes one move fail (logged,
counted) and never stalls membership or heartbeats. Each trajectory keeps one
policy version: moves go between rollouts of the same version, and recovery only
restarts a trajectory from its prompt (at another version) when no live rollout
holds its version.

Run: laminar node --role manager --config configs/demo.yaml
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from typing import Any

from laminar.manager.repack import RolloutLoad, TrajLoad, plan_repack
from laminar.node import Node
from laminar.protocol.buffer import PartialsReply, PartialsRequest
from laminar.protocol.core import NodeStatus
from laminar.protocol.data import PartialTrajectory
from laminar.protocol.manager import NodeEntry, StatusReply, StatusRequest
from laminar.protocol.relay import ChainUpdate
from laminar.protocol.rollout import ExportReply, ExportRequest, ImportReply, ImportRequest, RefreshRequest
from laminar.protocol.trainer import VersionPublished
from laminar.transport.sockets import Peer, RemoteError, TransportError

_EMPTY = None


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
        self.srv = self.server(self.cfg.bind_endpoint("manager"), on_peer_dead=self._on_dead, on_peer_join=self._on_join)
        self.srv.on(StatusRequest, self._on_status)
        self.srv.on(VersionPublished, self._on_version)
        await self.srv.start()
        self._buffer = None
        self._relay_clients: dict[int, Any] = {}
        self._timeline = None
        self._chain_lock = asyncio.Lock()

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
        if peer.role == "relay":
            self._schedule_chain()

    def _on_dead(self, peer: Peer) -> None:
        self.metrics.count("deaths")
        self.log.warning("node_dead", peer=peer.node_id, peer_role=peer.role)
        self._event("dead", node=peer.node_id, role=peer.role)
        if peer.role == "rollout":
            self.recovery_queue.put_nowait(peer.node_id)
        elif peer.role == "relay":
            self._schedule_chain()

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
            self.repack_now.set()  # the paper repacks right after each update: free rollouts for the new version

    def status(self) -> NodeStatus:
        return NodeStatus(node_id=self.node_id, role=self.role, version=self.trainer_version,
                          extra={"members": len(self.srv.peers), "repacks": len(self.repack_log),
                                 "recoveries": len(self.recovery_log), "orphans": len(self.orphans)})  # fmt: skip

    # ---- timeline (report.png's utilisation panel, bench idle fractions) -------------------
    def _event(self, kind: str, **fields: Any) -> None:
        if self._timeline is not None:
            self._timeline.write(json.dumps({"t": round(time.time(), 3), "event": kind, **fields}) + "\n")

    async def _timeline_loop(self) -> None:
        path = self.cfg.resolved_run_dir() / "timeline.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._timeline = open(path, "a", buffering=1)
        self.on_close(self._timeline.close)
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
        order = [_index(p.node_id) for p in relays]
        if self.chain_order and self.chain_order[0] in order:  # keep a live master: no needless failover
            order.remove(self.chain_order[0])
            order.insert(0, self.chain_order[0])
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
    def rollout_loads(self) -> list[RolloutLoad]:
        loads = []
        for p in self._live("rollout"):
            s = p.status
            if s is None or s.version < 0:
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
        interval = self.cfg.manager.repack.interval_s
        while True:
            try:
                await asyncio.wait_for(self.repack_now.wait(), interval)
            except TimeoutError:
                pass
            self.repack_now.clear()
            await self.repack_once()

    async def repack_once(self) -> dict[str, Any]:
        t0 = time.monotonic()
        plan = plan_repack(self.rollout_loads(), self.cfg.manager.repack.c_max, self.cfg.repack_bound_b())
        if not plan:
            return {"moves": 0}
        moved = failed = 0
        for mv in plan.moves:
            uids = [] if any(t.startswith("*") for t in mv.traj_ids) else list(mv.traj_ids)
            try:
                exp = await self.srv.request(mv.source, ExportRequest(uids=uids), timeout=self.cfg.transport.request_timeout_s)
                assert isinstance(exp, ExportReply)
                if exp.partials:
                    await self._place(exp.partials, prefer=mv.dest)
                moved += len(exp.partials)
            except (TransportError, RemoteError) as exc:
                failed += 1
                self.log.warning("repack_move_failed", source=mv.source, dest=mv.dest, error=str(exc))
        for src in plan.emptied:
            try:
                await self.srv.request(src, RefreshRequest(min_version=self.trainer_version), timeout=self.cfg.transport.request_timeout_s)
            except (TransportError, RemoteError) as exc:
                self.log.warning("refresh_failed", rollout=src, error=str(exc))
        entry = {"t": time.time(), "moves": len(plan.moves), "trajectories": moved, "emptied": list(plan.emptied),
                 "failed": failed, "overhead_s": round(time.monotonic() - t0, 4)}  # fmt: skip
        self.repack_log.append(entry)
        self._event("repack", moves=entry["moves"], trajectories=moved, emptied=list(plan.emptied),
                    sources=[m.source for m in plan.moves], dests=[m.dest for m in plan.moves])  # fmt: skip
        self.metrics.add("repack_overhead_s", entry["overhead_s"])
        self.metrics.count("repack_trajectories", moved)
        self.log.info("repack", **{k: v for k, v in entry.items() if k != "t"})
        return entry

    async def _place(self, partials: list[PartialTrajectory], prefer: str | None = None) -> list[PartialTrajectory]:
        """Import partials onto live rollouts of their version (prefer `prefer`); restart from the
        prompt on the least-loaded rollout when no live rollout holds the version. Returns leftovers."""
        by_version: dict[int, list[PartialTrajectory]] = defaultdict(list)
        for p in partials:
            by_version[p.version].append(p)
        leftovers: list[PartialTrajectory] = []
        rollouts = [p for p in self._live("rollout") if p.status is not None]
        for version, items in by_version.items():
            same = sorted((r for r in rollouts if r.status.version == version),
                          key=lambda r: (r.node_id != prefer, r.status.kv_use, r.node_id))  # fmt: skip
            if not same:
                # nobody holds that version any more: start over from the prompt on another version
                others = sorted(rollouts, key=lambda r: (r.status.kv_use, r.node_id))
                if not others:
                    leftovers.extend(items)
                    continue
                dest = others[0]
                items = [_restart(p, dest.status.version) for p in items]
                same = [dest]
                self.metrics.count("restarted_from_prompt", len(items))
            placed = False
            for dest in same:
                try:
                    rep = await self.srv.request(dest.node_id, ImportRequest(partials=items), timeout=self.cfg.transport.request_timeout_s)
                    assert isinstance(rep, ImportReply)
                    placed = True
                    break
                except (TransportError, RemoteError) as exc:
                    self.log.warning("import_failed", dest=dest.node_id, error=str(exc))
            if not placed:
                leftovers.extend(items)
        return leftovers

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
            if self.orphans and self._live("rollout"):
                orphans, self.orphans = self.orphans, []
                self.orphans.extend(await self._place(orphans))

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
        leftovers = await self._place(reply.partials) if reply.partials else []
        self.orphans.extend(leftovers)
        entry = {"t": time.time(), "rollout": rollout_id, "trajectories": len(reply.partials),
                 "tokens": int(sum(len(p.response_ids) for p in reply.partials)), "orphans": len(leftovers),
                 "seconds": round(time.monotonic() - t0, 4)}  # fmt: skip
        self.recovery_log.append(entry)
        self._event("recovery", rollout=rollout_id, trajectories=len(reply.partials), orphans=len(leftovers))
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
