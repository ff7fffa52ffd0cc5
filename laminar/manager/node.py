"""Manager node: membership, dynamic repack, failure recovery, relay chain order.

    every node ──Hello / Heartbeat(NodeStatus)──► manager          membership + cluster state
    trainer ──VersionPublished──► manager ──► repack now            (and every repack.interval_s)
    trainer ──DeviceRequest / DeviceRelease──► manager ──Sleep/WakeRequest──► rollouts
                                          (cluster.placement=colocated: manager/colocate.py)
                                          ──RefreshRequest──► rollouts  (laminar, sim handoff)
    manager ──ExportRequest──► source rollout ──partials──► manager ──ImportRequest──► destination
    manager ──RefreshRequest──► emptied source               (pull newest weights, take new prompts)
    rollout dies / leaves / restarts ──► manager ──PartialsRequest(rollout_id)──► buffer
                                     ──partials──► healthy rollouts
    every reconcile_interval_s: manager ──HeldRequest──► buffer; samples no rollout status names
                                     ──PartialsRequest(uids)──► placed again  (reconcile.py)
    relay joins/dies ──► manager ──ChainUpdate(order)──► live relays
    relay falls behind its upstream ──► manager ──ChainUpdate(straggler last)   (chain_order.py)
    laminar status ──StatusRequest──► manager ──StatusReply──► table

The parts (laminar/manager/), each with typed dependencies (the server, the config, metrics,
a logger) and none of this node: Repacker (moves.py: one repack round, planned by the pure
repack.py from the rollouts' typed RolloutStatus and run as concurrent export/import moves),
Placer (placement.py: puts partials on a live rollout of their version, falls back, keeps
orphans), Reconciler (reconcile.py: samples the buffer puts on a live rollout that runs them
no more, e.g. a move's when the manager died between export and import), serving_rollouts
(serving.py: the live rollouts with an engine up, which its heartbeats carry to the buffer:
prompts go to these alone). This module holds membership
(joins, deaths, leaves, rejoins), the relay chain order and the timeline, and runs the loops.

What blocks what: the repack, recovery and reconciliation loops run as supervised tasks and
only wait on RPCs with deadlines; a slow or dead rollout makes one move fail (logged, counted)
and never stalls membership or heartbeats. Orphans (partials nobody took) are placed again every
second by the recovery loop.

Whose work needs recovering: a rollout declared dead (missed heartbeats), one that
left (Bye: a graceful stop leaves its unfinished trajectories in the partial pool),
and one that came back as a new incarnation (the server admitted a new process under its
id: `Peer.incarnation`) before its death was noticed. A reconnect of the same incarnation is
not a loss and is not recovered.

Run: laminar node --role manager --config configs/demo.yaml
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any, TextIO

from laminar.manager.chain_order import ChainPlanner
from laminar.manager.colocate import DeviceBroker
from laminar.manager.moves import Repacker
from laminar.manager.placement import ORPHAN, Placer
from laminar.manager.reconcile import Reconciler
from laminar.manager.serving import serving_rollouts
from laminar.manager.settings import ManagerNodeSettings
from laminar.node import Node
from laminar.protocol.buffer import PartialsReply, PartialsRequest
from laminar.protocol.core import NodeStatus, RefusalSummary
from laminar.protocol.manager import NodeEntry, StatusReply, StatusRequest
from laminar.protocol.relay import ChainInfo, ChainInfoRequest, ChainUpdate
from laminar.protocol.rollout import RefreshRequest
from laminar.protocol.trainer import (
    DeviceGrant,
    DeviceRelease,
    DeviceReleased,
    DeviceRequest,
    VersionPublished,
)
from laminar.transport.client import RpcClient
from laminar.transport.sockets import Context, Peer, RemoteError, TransportError

_SERVING_ROLES = ("buffer", "relay", "tools")
"""The roles besides the manager that run an RpcServer, so refuse what peers send."""
SUMMARY_AGE_S = 1.0
"""The heartbeat's summaries over every peer (refusals, the serving list) read each status as
last read if that was under this long ago (Peer.recent_status): at ~20 pushes a second per
rollout, reading the latest at each beat decoded most of them."""


class ManagerNode(Node):
    role = "manager"
    registers_with_manager = False

    def __init__(self, settings: ManagerNodeSettings, ctx: Context | None = None):
        super().__init__(settings.node, ctx)
        self.settings = settings

    async def setup(self) -> None:
        s = self.settings
        self.trainer_version = -1
        self.expected_digests: dict[int, str] = {}
        """The trainer's digest of each recent version (VersionPublished.digest): attestation."""
        self.repack_now = asyncio.Event()
        self.recovery_queue: asyncio.Queue[str] = asyncio.Queue()
        self.chain_epoch = 0
        self.chain_order: list[int] = []
        self.repack_log: list[dict[str, Any]] = []
        self.recovery_log: list[dict[str, Any]] = []
        self._timeline: TextIO | None = None
        # opened before anyone can join: no event is missed
        if s.timeline is not None:
            s.timeline.parent.mkdir(parents=True, exist_ok=True)
            self._timeline = open(s.timeline, "a", buffering=1)
            self.on_close(self._timeline.close)
        self.srv = self.server(
            s.bind,
            max_message_bytes=s.max_message_bytes,
            on_peer_dead=self._on_dead,
            on_peer_join=self._on_join,
        )
        self.srv.on(StatusRequest, self._on_status)
        self.srv.on(VersionPublished, self._on_version)
        self.broker: DeviceBroker | None = None
        if s.colocate is not None:
            self.broker = DeviceBroker(
                self.srv, s.colocate, spawn=self.spawn, metrics=self.metrics, log=self.log
            )
            self.srv.on(DeviceRequest, self._on_device_request)
            self.srv.on(DeviceRelease, self._on_device_release)
        timeout = s.transport.request_timeout_s
        self._buffer: RpcClient | None = None
        self._buffer_lock = asyncio.Lock()
        self.placer = Placer(
            self.srv,
            s.repack_bound_b,
            timeout,
            self.metrics,
            self.log,
            buffer=self._buffer_client,
            continue_newer=s.mode == "partial",
        )
        self.repacker = Repacker(
            self.srv,
            self.placer,
            s.manager.repack,
            self.metrics,
            self.log,
            max_inflight=s.inflight_per_rollout,
        )
        self.reconciler = Reconciler(
            self.placer, self._buffer_client, timeout, self.metrics, self.log
        )
        self._recovering: set[str] = set()
        """Rollouts queued for recovery or being recovered (the reconciliation leaves them)."""
        self._relay_clients: dict[int, RpcClient] = {}
        self._chain_lock = asyncio.Lock()
        self.chain_planner = ChainPlanner(window=s.chain_window)
        self._incarnation: dict[str, int] = {}
        """rollout id -> the server's number of the incarnation last seen (rejoin detection)."""
        self._rollouts_seen: set[str] = set()
        """Rollouts that were members since their last recovery (leave detection)."""
        self._deaths: dict[str, tuple[int, float]] = {}
        """node id -> (times declared dead, monotonic time of the last): `laminar status` keeps
        showing it after the node is heard from again or comes back as a new incarnation."""
        await self.srv.start()

    async def main(self) -> None:
        self.spawn(self._recovery_loop(), "recovery")
        s = self.settings
        if s.timeline is not None:
            self.spawn(self._timeline_loop(), "timeline")
        if s.mode == "laminar" and s.manager.repack.enabled:
            self.spawn(self._repack_loop(), "repack")
        if s.manager.reconcile_interval_s > 0:
            self.spawn(self._reconcile_loop(), "reconcile")
        if len(s.relays) > 2:  # a straggler needs someone behind it
            self.spawn(self._straggler_loop(), "chain-stragglers")
        await self.stopping.wait()

    # ---- membership ---------------------------------------------------------------------
    def _live(self, role: str) -> list[Peer]:
        return [p for p in self.srv.peers.values() if p.alive and p.role == role]

    def _on_join(self, peer: Peer) -> None:
        self.metrics.count("joins")
        if peer.role == "rollout":
            inc = peer.incarnation
            old = self._incarnation.get(peer.node_id)
            self._incarnation[peer.node_id] = inc
            rejoin = old is not None
            if rejoin and old != inc and peer.node_id in self._rollouts_seen:
                # restarted before its death was noticed: the old incarnation's work is orphaned
                self.metrics.count("restarts_unnoticed")
                self._queue_recovery(peer.node_id, "restarted")
            self._rollouts_seen.add(peer.node_id)
            self.placer.stale.pop(peer.node_id, None)
            self._event("join", node=peer.node_id, role=peer.role, rejoin=rejoin)
            if rejoin:
                self.metrics.count("rejoins")
                self.log.info("rollout_rejoined", peer=peer.node_id, new_incarnation=old != inc)
            if self.broker is not None:
                self.broker.rollout_joined(peer.node_id)
        else:
            self._event("join", node=peer.node_id, role=peer.role)
            if peer.role == "trainer" and self.broker is not None:
                self._trainer_gone()  # a new trainer process holds nothing yet
        if peer.role == "relay":
            self._schedule_chain()

    def _on_dead(self, peer: Peer) -> None:
        self.metrics.count("deaths")
        deaths, _ = self._deaths.get(peer.node_id, (0, 0.0))
        self._deaths[peer.node_id] = (deaths + 1, time.monotonic())
        self.log.warning("node_dead", peer=peer.node_id, peer_role=peer.role)
        self._event("dead", node=peer.node_id, role=peer.role)
        if peer.role == "rollout":
            self._queue_recovery(peer.node_id, "dead")
        elif peer.role == "trainer" and self.broker is not None:
            self._trainer_gone()
        elif peer.role == "relay":
            self._schedule_chain()

    def _queue_recovery(self, rollout_id: str, why: str) -> None:
        self._rollouts_seen.discard(rollout_id)
        self._recovering.add(rollout_id)
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
        # declared dead, then heard from again (a long stall): a member again
        for p in self._live("rollout"):
            self._rollouts_seen.add(p.node_id)

    def members(self) -> list[NodeEntry]:
        now = time.monotonic()
        out = []
        for p in self.srv.peers.values():
            if p.role == "cli":
                continue
            status = p.status
            if (
                status is not None
                and p.role == "rollout"
                and self.trainer_version >= 0
                and status.version >= 0
            ):
                status.staleness = float(self.trainer_version - status.version)
            deaths, last_death = self._deaths.get(p.node_id, (0, 0.0))
            out.append(
                NodeEntry(
                    node_id=p.node_id,
                    role=p.role,
                    alive=p.alive,
                    last_beat_s=round(now - p.last_seen, 3),
                    status=status,
                    pid=p.pid,
                    deaths=deaths,
                    last_death_s=round(now - last_death, 3) if deaths else -1.0,
                )
            )
        return out

    async def _on_status(self, peer: Peer, msg: StatusRequest) -> StatusReply:
        me = NodeEntry(
            node_id=self.node_id,
            role=self.role,
            alive=True,
            last_beat_s=0.0,
            status=NodeStatus(
                node_id=self.node_id,
                role=self.role,
                version=self.trainer_version,
                refusals=self.refusal_summary(),
            ),
            pid=os.getpid(),
        )
        return StatusReply(
            nodes=[me, *self.members()],
            trainer_version=self.trainer_version,
            mode=self.settings.mode,
        )

    async def _on_version(self, peer: Peer, msg: VersionPublished) -> None:
        if msg.digest:  # the rollouts compare their served digest with it (manager heartbeats)
            self.expected_digests[msg.version] = msg.digest
            for old in sorted(self.expected_digests)[:-16]:
                del self.expected_digests[old]
        if msg.version > self.trainer_version:
            self.trainer_version = msg.version
            self._event("version", version=msg.version, handoff=msg.handoff, stall_s=msg.stall_s)
            if msg.handoff == "sim" and self.settings.mode in ("laminar", "partial"):
                # no relay tier carries this version (sim trainer, no relays): say it exists, so the
                # rollouts pull it when idle as they would from a relay (one-way, best-effort)
                await self.srv.broadcast(RefreshRequest(min_version=msg.version), role="rollout")
            # the paper repacks right after each update: free rollouts for the new version
            self.repack_now.set()

    def _trainer_gone(self) -> None:
        assert self.broker is not None
        if self.broker.trainer_gone():  # it held the device: its rollouts are woken
            self._event("colocate_trainer_gone", version=self.broker.version)

    async def _on_device_request(self, peer: Peer, msg: DeviceRequest) -> DeviceGrant:
        assert self.broker is not None
        self._event("colocate_sleep", version=msg.version)
        grant = await self.broker.acquire(msg.version)
        self._event("colocate_asleep", version=msg.version, rollouts=grant.rollouts)
        return grant

    async def _on_device_release(self, peer: Peer, msg: DeviceRelease) -> DeviceReleased:
        assert self.broker is not None
        out = await self.broker.release(msg.version)
        self._event("colocate_awake", version=msg.version, rollouts=out.rollouts)
        return out

    def status(self) -> NodeStatus:
        return NodeStatus(
            node_id=self.node_id,
            role=self.role,
            version=self.trainer_version,
            extra={
                "members": len(self.srv.peers),
                "repacks": len(self.repack_log),
                "recoveries": len(self.recovery_log),
                "orphans": len(self.placer.orphans),
                "claims_clamped": sum(self.repacker.claims.values()),
            },
            cluster_refusals=self.cluster_refusals(),
            serving=serving_rollouts(
                self.srv.peers.values(), self.settings.most_running, SUMMARY_AGE_S
            ),
            expected_digests=dict(self.expected_digests),
        )

    def cluster_refusals(self) -> RefusalSummary:
        """Every serving node's refusals summed, as their last heartbeats said, and the manager's
        own (a restarted node's counts start again from 0). Only the roles that run servers
        refuse anything: a rollout or trainer reporting refusals is not summed; the rollouts'
        agent endpoints are, each read at most SUMMARY_AGE_S ago (a serving node sends a status
        a heartbeat, a rollout up to 20 a second)."""
        total = RefusalSummary()
        beats: list[RefusalSummary | None] = [self.refusal_summary()]
        for p in self.srv.peers.values():
            if p.role in _SERVING_ROLES:
                status = p.status
                beats.append(None if status is None else status.refusals)
            elif p.role == "rollout":  # no other role's status is read
                status = p.recent_status(SUMMARY_AGE_S)
                agent = status.rollout.agent if status is not None and status.rollout else {}
                for reason, k in agent.items():
                    total.agent[reason] = total.agent.get(reason, 0) + k
        for r in beats:
            if r is not None:
                total.unauthorized += r.unauthorized
                total.bad += r.bad
                total.refused_hellos += r.refused_hellos
                total.refused_ids += r.refused_ids
                total.refused_trajectories += r.refused_trajectories
        return total

    # ---- timeline (report.png's utilisation panel, bench idle fractions) -------------------
    def _event(self, kind: str, **fields: Any) -> None:
        if self._timeline is not None and not self._timeline.closed:  # (closed while stopping)
            self._timeline.write(
                json.dumps({"t": round(time.time(), 3), "event": kind, **fields}) + "\n"
            )

    async def _timeline_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.manager.timeline_interval_s)  # a sampling timer
            for p in self._live("rollout"):
                s = p.status
                if s is not None:
                    self._event(
                        "rollout",
                        node=p.node_id,
                        version=s.version,
                        running=s.running,
                        waiting=s.waiting,
                        kv=round(s.kv_use, 4),
                        inflight=s.inflight,
                    )
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
        order = self.chain_planner.order([_index(p.node_id) for p in relays])
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
                    cli = self._relay_clients[idx] = self.client(self.settings.relays[idx])
                if not cli.connected:
                    await cli.connect(timeout=self.settings.transport.handshake_timeout_s)
                await cli.request(msg, timeout=self.settings.transport.request_timeout_s, retries=1)
            except (TransportError, RemoteError) as exc:
                self.log.warning("chain_update_failed", relay=idx, error=str(exc))

    async def _straggler_loop(self) -> None:
        # sample the chain only while a version is moving (some relay reports one incoming)
        while True:
            await asyncio.sleep(
                self.settings.transport.heartbeat_interval_s / 2
            )  # a sampling timer
            moving = [
                p
                for p in self._live("relay")
                if p.status is not None
                and p.status.relay is not None
                and p.status.relay.incoming > p.status.version
            ]
            if not moving or len(self.chain_order) < 3:
                continue
            infos: dict[int, tuple[int, int, int, int]] = {}
            async with self._chain_lock:
                order = list(self.chain_order)
                for idx in order:
                    cli = self._relay_clients.get(idx)
                    if cli is None or not cli.connected:
                        continue
                    try:
                        info = await cli.request(ChainInfoRequest(), timeout=1.0, retries=0)
                    except (TransportError, RemoteError):
                        continue
                    if isinstance(info, ChainInfo):
                        infos[idx] = (
                            info.version,
                            info.incoming_version,
                            info.incoming_have,
                            info.incoming_chunks,
                        )
            if self.chain_planner.observe(order, infos, time.monotonic()):
                self.log.warning(
                    "chain_stragglers", slow=sorted(self.chain_planner.slow), order=order
                )
                self.metrics.count("chain_reorders")
                self._schedule_chain()

    # ---- repack ---------------------------------------------------------------------------
    async def _repack_loop(self) -> None:
        # rounds start every interval_s (a slow round does not stretch the period) and right
        # after each trainer update (repack_now), when draining rollouts are worth freeing most
        interval = self.settings.manager.repack.interval_s
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
        """One round (laminar/manager/moves.py), recorded in repack_log and the timeline."""
        entry = await self.repacker.round(self.trainer_version)
        if not entry["moves"]:
            return entry
        sources, dests = entry.pop("sources"), entry.pop("dests")
        self.repack_log.append(entry)
        self._event(
            "repack",
            moves=entry["moves"],
            trajectories=entry["trajectories"],
            emptied=entry["emptied"],
            sources=sources,
            dests=dests,
        )
        self.log.info("repack", **{k: v for k, v in entry.items() if k != "t"})
        return entry

    # ---- failure recovery -----------------------------------------------------------------
    async def _buffer_client(self) -> RpcClient:
        async with self._buffer_lock:  # recovery and placements ask for it concurrently
            if self._buffer is None:
                self._buffer = self.client(self.settings.buffer)
                await self._buffer.connect(timeout=self.settings.transport.startup_timeout_s)
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
            if self.placer.orphans and self.placer.live():
                # what still finds no home is back in placer.orphans
                await self.placer.place(self.placer.take_orphans(), self.trainer_version)

    async def recover(self, rollout_id: str) -> None:
        t0 = time.monotonic()
        try:
            buf = await self._buffer_client()
            reply = await buf.request(
                PartialsRequest(rollout_id=rollout_id),
                timeout=self.settings.transport.request_timeout_s,
            )
        except (TransportError, RemoteError) as exc:
            self.log.warning("recovery_partials_failed", rollout=rollout_id, error=str(exc))
            self.recovery_queue.put_nowait(rollout_id)  # the buffer may be restarting: try again
            await asyncio.sleep(1.0)  # retry backoff
            return
        assert isinstance(reply, PartialsReply)
        self._recovering.discard(rollout_id)
        # a rollout that rejoined under the same id may be running some of these already: the
        # buffer keeps the first finished copy of a uid, so a duplicate costs work, never data
        placed = (
            await self.placer.place(reply.partials, self.trainer_version) if reply.partials else {}
        )
        orphaned = placed.get(ORPHAN, 0)
        entry = {
            "t": time.time(),
            "rollout": rollout_id,
            "trajectories": len(reply.partials),
            "tokens": int(sum(len(p.response_ids) for p in reply.partials)),
            "orphans": orphaned,
            "placed": {k: v for k, v in placed.items() if k != ORPHAN},
            "seconds": round(time.monotonic() - t0, 4),
        }
        self.recovery_log.append(entry)
        self._event(
            "recovery", rollout=rollout_id, trajectories=len(reply.partials), orphans=orphaned
        )
        self.log.info("rollout_recovered", **{k: v for k, v in entry.items() if k != "t"})

    async def _reconcile_loop(self) -> None:
        every = self.settings.manager.reconcile_interval_s
        while True:
            await asyncio.sleep(every)  # the round's period
            entry = await self.reconciler.round(
                self.trainer_version, lambda: self._recovering | set(self.repacker.moving)
            )
            if entry.get("stranded"):
                self._event("reconciled", **entry)


def _index(node_id: str) -> int:
    try:
        return int(node_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 1 << 30
