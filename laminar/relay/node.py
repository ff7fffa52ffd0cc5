"""Relay node: one per host; the newest weights in shared memory, and one hop of the chain.

    trainer ──Stage/Commit (memcpy into /dev/shm)──► master relay            control: relay-k
                                                       │ VersionOffer, FetchChunk/WeightChunk
                                                       ▼                   data:    relay_data-k
                                         relay 1 ──► relay 2 ──► …         (laminar/relay/fetch.py,
                                                                            serve.py)
    every relay ──WeightsReady (PUB)──► its rollouts  pub:     relay_pub-k
    rollout ──Pull/Release──► relay  (pins a version; the rollout maps its segment read-only)

What blocks what: the trainer waits only for its own memcpy and the commit reply; the
master then computes chunk digests in a thread and serves chunks as they are ready;
every other relay fetches from its upstream with a window of requests in flight and
serves its own downstream from the same buffer as chunks land. Rollouts never wait
for the chain: they pull the newest complete version of their own relay.

Failure handling: a reader that dies is unpinned (peer death on the control socket);
a relay that dies is cut out by its downstream, which resumes from the next live
predecessor; if the master dies, the first relay with no live predecessor becomes
master and the trainer finds it (WeightPusher asks the relays; the manager may also
send ChainUpdate / tell the trainer). A relay that is not the master answers a
trainer's StageRequest with NotMaster(master=i) and the pusher follows it, so a
chain order changed by the manager never strands the trainer on a follower.

Parts, wired here and never calling back: the store (laminar/weights/segment.py) holds the
versions; the chain view (relay/view.py: order, epoch, head election); one hop of the chain in
two halves: the ChainFollower (relay/fetch.py) fetches from upstream into the store and has the
ChunkService (relay/serve.py) offer the version downstream as it begins to arrive, the
ChunkService answers the downstream's OfferRequest / FetchChunk on the data socket, and the
follower's VersionComplete events become WeightsReady for the rollouts (`_chain_events`).
One hop's call path goes down: node → follower → store / chunk service; the node only turns
completed versions into WeightsReady. Layout, checksums and deltas come from laminar/weights/.

Run: laminar node --role relay --index 0 --config configs/skeleton.yaml
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time

from laminar.message import ProtocolError
from laminar.node import Node
from laminar.protocol.core import NodeStatus
from laminar.protocol.relay import (
    ChainInfo,
    ChainInfoRequest,
    ChainUpdate,
    CommitReply,
    CommitRequest,
    FetchChunk,
    LatestReply,
    LatestRequest,
    NotMaster,
    OfferRequest,
    PullReply,
    PullRequest,
    PushChunk,
    RelayReset,
    RelayStatus,
    ReleaseRequest,
    StageReply,
    StageRequest,
    WeightsReady,
)
from laminar.relay.fetch import ChainFollower
from laminar.relay.serve import ChunkService
from laminar.relay.settings import RelayNodeSettings
from laminar.relay.view import ChainView
from laminar.transport.session import Ack, ErrorReply
from laminar.transport.sockets import Context, Peer, TransportError
from laminar.transport.streams import Publisher
from laminar.weights.delta import DELTA_PIN, delta_base, digest_and_encode, words_for
from laminar.weights.layout import validate_layout, version_checksum
from laminar.weights.segment import OutOfSlots, VersionState, WeightStore, default_shm_dir

DIGEST_BATCH = 8  # chunks hashed per thread hop: keeps the loop responsive, the overhead small


class RelayNode(Node):
    role = "relay"

    def __init__(self, settings: RelayNodeSettings, ctx: Context | None = None):
        super().__init__(settings.node, ctx)
        self.settings = settings

    def _endpoint(self, service: str, index: int) -> str:
        """A relay's endpoint by service (relay | relay_data) and index: what the chain dials."""
        s = self.settings
        return (s.controls if service == "relay" else s.data)[index]

    async def setup(self) -> None:
        s, rc = self.settings, self.settings.relay
        self.store = WeightStore(
            rc.shm_dir or default_shm_dir(),
            s.shm_name,
            spare_slots=rc.spare_slots,
            max_slots=rc.max_slots,
        )
        self._staging: dict[int, tuple[str, VersionState, float]] = {}
        self._tokens = itertools.count(1)
        self._host = socket.gethostname()

        self.srv = self.server(
            s.bind,
            max_message_bytes=s.max_message_bytes,
            on_peer_dead=self._on_peer_dead,
        )
        for msg_type, handler in (
            (StageRequest, self._on_stage),
            (PushChunk, self._on_push_chunk),
            (CommitRequest, self._on_commit),
            (PullRequest, self._on_pull),
            (ReleaseRequest, self._on_release),
            (LatestRequest, self._on_latest),
            (ChainUpdate, self._on_chain_update),
            (ChainInfoRequest, self._on_chain_info),
            (RelayReset, self._on_reset),
        ):
            self.srv.on(msg_type, handler)
        self.data = self.server(
            s.bind_data,
            max_message_bytes=s.data_max_message_bytes,
        )
        self.view = ChainView(
            rc,
            n_relays=len(s.controls),
            index=self.index,
            endpoint=self._endpoint,
            log=self.log,
            metrics=self.metrics,
        )
        self.chunks = ChunkService(
            self.store,
            self.data,
            self.node_id,
            self.metrics,
            chunk_wait_s=rc.chunk_wait_s,
            delta=rc.delta,
            link_bytes_per_s=rc.link_bytes_per_s,
        )
        self.follower = ChainFollower(
            rc,
            self.view,
            store=self.store,
            chunks=self.chunks,
            ctx=self.ctx,
            opts=self.opts,
            node_id=self.node_id,
            log=self.log,
            metrics=self.metrics,
            spawn=self.spawn,
        )
        self.data.on(OfferRequest, self.chunks.offer)
        self.data.on(FetchChunk, self.chunks.fetch)
        self.data.on(ChainInfoRequest, self._on_chain_info)
        self.pub = Publisher(
            self.ctx,
            s.bind_pub,
            self.node_id,
            self.opts,
            spawn=self.spawn,  # its READY-barrier watcher: a death stops the relay
            members=lambda: {p.node_id for p in self.srv.peers.values() if p.alive},  # HELLO'd only
        )
        await self.srv.start()
        await self.data.start()
        await self.pub.start()

    async def main(self) -> None:
        self.spawn(self.follower.run(), "chain")
        self.spawn(self._chain_events(), "chain-events")
        interval = self.settings.transport.heartbeat_interval_s
        while True:  # housekeeping: readers that left without releasing, abandoned staging
            await asyncio.sleep(interval * 2)  # a timer
            for peer in {p for c in self.store.pins.values() for p in c}:
                if peer not in self.srv.peers and peer != DELTA_PIN:
                    self.log.info("reader_gone", peer=peer, released=self.store.unpin_peer(peer))
            deadline = time.monotonic() - 10 * self.settings.transport.request_timeout_s
            for token, (_peer, _vs, t0) in list(self._staging.items()):
                if t0 < deadline:
                    self._drop_staging(token, "stage timeout")

    async def teardown(self) -> None:
        await self.follower.close()
        await self.pub.close()
        self.store.close()

    def status(self) -> NodeStatus:
        cur, inc = self.store.current, self.store.newest_incoming()
        upstream = self.follower.upstream
        relay = RelayStatus(
            master=self.view.master,
            upstream=-1 if upstream is None else upstream,
            epoch=self.view.epoch,
            incoming=inc.version if inc else -1,
            pinned=self.store.pinned(),
        )
        return NodeStatus(
            node_id=self.node_id, role=self.role, version=cur.version if cur else -1, relay=relay
        )

    # ---- what the chain follower reports ---------------------------------------------------
    async def _chain_events(self) -> None:
        while True:
            ev = await self.follower.events.get()  # VersionComplete
            await self._version_ready(ev.vs)

    async def _version_ready(self, vs: VersionState) -> None:
        self.log.info(
            "version_ready",
            version=vs.version,
            checksum=vs.checksum,
            source=vs.source,
            mb=vs.layout.total_bytes >> 20,
        )
        self.metrics.count("versions_ready")
        ready = WeightsReady(
            version=vs.version,
            checksum=vs.checksum,
            layout=vs.layout,
            relay=self.node_id,
            chunk_bytes=vs.chunk_bytes,
        )
        await self.pub.publish("weights", ready)

    # ---- trainer handoff -------------------------------------------------------------------
    async def _on_stage(self, peer: Peer, msg: StageRequest) -> StageReply | NotMaster | ErrorReply:
        validate_layout(msg.layout)
        newest = self.store.newest()
        if newest is not None and msg.version <= newest.version:
            return ErrorReply(
                code="stale_version", message=f"version {msg.version} <= newest {newest.version}"
            )
        for token, (owner, _vs, _t) in list(self._staging.items()):
            if owner == peer.node_id:
                self._drop_staging(token, "restaged")
        master = self.view.named_master()
        if not msg.takeover and master not in (self.index, -1):
            return NotMaster(master=master)
        self.follower.become_head(
            f"trainer {peer.node_id} pushes here (takeover={msg.takeover})", catch_up=False
        )
        try:
            vs = await self.store.begin(
                msg.version,
                msg.layout,
                self.settings.relay.chunk_bytes,
                source="trainer",
                staging=True,
            )
        except OutOfSlots as exc:
            return ErrorReply(code="out_of_slots", message=str(exc))
        except ValueError as exc:
            return ErrorReply(code="stale_version", message=str(exc))
        token = next(self._tokens)
        self._staging[token] = (peer.node_id, vs, time.monotonic())
        seg = vs.slot.seg
        return StageReply(
            token=token,
            segment=seg.path,
            size=seg.size,
            host=self._host,
            inode=seg.inode,
            chunk_bytes=vs.chunk_bytes,
        )

    def _staged(self, peer: Peer, version: int, token: int) -> VersionState:
        entry = self._staging.get(token)
        if entry is None or entry[0] != peer.node_id or entry[1].version != version:
            raise ProtocolError(
                f"no staging of version {version} with token {token} for {peer.node_id}"
            )
        return entry[1]

    async def _on_push_chunk(self, peer: Peer, msg: PushChunk) -> Ack:
        vs = self._staged(peer, msg.version, msg.token)
        end = msg.offset + len(msg.data)
        if msg.offset < 0 or end > vs.layout.total_bytes:
            raise ProtocolError(
                f"chunk [{msg.offset}, {end}) outside version of {vs.layout.total_bytes} bytes"
            )
        vs.buf[msg.offset : end] = msg.data
        return Ack()

    async def _on_commit(self, peer: Peer, msg: CommitRequest) -> CommitReply:
        vs = self._staged(peer, msg.version, msg.token)
        del self._staging[msg.token]
        vs.staging = False
        self.metrics.count("versions_pushed")
        self.spawn(self._digest_pass(vs), f"digest-v{vs.version}")
        await self.chunks.offer_downstream(vs)
        return CommitReply(version=vs.version, master=self.index)

    def _drop_staging(self, token: int, why: str) -> None:
        _peer, vs, _t = self._staging.pop(token)
        self.log.warning("staging_dropped", version=vs.version, why=why)
        self.store.abandon(vs)

    async def _digest_pass(self, vs: VersionState) -> None:
        """Chunk digests (and in delta mode the deltas against the previous version,
        laminar/weights/delta.py) of a version the trainer handed off; each chunk becomes
        servable once hashed."""
        t0 = time.monotonic()
        cb = vs.chunk_bytes
        base = self.store.current
        base_v = delta_base(self.settings.relay.delta, base, vs)
        words = None
        if base is not None and base_v >= 0:
            vs.delta_base = base_v
            self.store.pin(DELTA_PIN, base_v)  # its slot must not be reused while we compare
            words = words_for(vs)
        try:
            for lo in range(0, vs.n, DIGEST_BATCH):
                if vs.abandoned:
                    return
                hi = min(vs.n, lo + DIGEST_BATCH)
                done = await asyncio.to_thread(
                    digest_and_encode, vs, base if words is not None else None, words, lo, hi
                )
                for i, (d, blob) in zip(range(lo, hi), done, strict=True):
                    vs.digests[i] = d
                    if blob is not None:
                        vs.deltas[i] = blob
                        self.metrics.count("delta_bytes_encoded", len(blob))
                    if i == vs.n - 1:  # the last chunk carries the version checksum downstream
                        vs.expected_checksum = version_checksum(vs.layout, cb, vs.crcs)
                    self.store.mark(vs, i, d)
        finally:
            if words is not None:
                self.store.unpin(DELTA_PIN, base_v)
        self.store.complete(vs, vs.expected_checksum)
        self.metrics.add("digest_s", time.monotonic() - t0)
        await self._version_ready(vs)

    # ---- readers ---------------------------------------------------------------------------
    async def _on_pull(self, peer: Peer, msg: PullRequest) -> PullReply | ErrorReply:
        vs = self.store.current if msg.version < 0 else self.store.versions.get(msg.version)
        if vs is None or not vs.complete:
            have = self.store.current.version if self.store.current else -1
            return ErrorReply(
                code="no_version",
                message=f"{self.node_id} has no version {msg.version} (newest {have})",
            )
        self.store.pin(peer.node_id, vs.version)
        seg = vs.slot.seg
        return PullReply(
            version=vs.version,
            checksum=vs.checksum,
            segment=seg.path,
            size=seg.size,
            layout=vs.layout,
            chunk_bytes=vs.chunk_bytes,
        )

    async def _on_release(self, peer: Peer, msg: ReleaseRequest) -> Ack:
        return Ack(ok=self.store.unpin(peer.node_id, msg.version))

    async def _on_latest(self, peer: Peer, msg: LatestRequest) -> LatestReply | ErrorReply:
        if msg.subscriber:
            try:
                await self.pub.wait_for(
                    {msg.subscriber}, timeout=self.settings.transport.handshake_timeout_s
                )
            except TransportError as exc:
                return ErrorReply(code="not_subscribed", message=str(exc))
        cur = self.store.current
        return LatestReply(version=cur.version, checksum=cur.checksum) if cur else LatestReply()

    def _on_peer_dead(self, peer: Peer) -> None:
        n = self.store.unpin_peer(peer.node_id)
        if n:
            self.log.info("reader_dead", peer=peer.node_id, released=n)
        for token, (owner, _vs, _t) in list(self._staging.items()):
            if owner == peer.node_id:
                self._drop_staging(token, f"{owner} died")

    # ---- chain control ---------------------------------------------------------------------
    async def _on_chain_update(self, peer: Peer, msg: ChainUpdate) -> Ack | ErrorReply:
        if msg.epoch < self.view.manager_epoch:
            return ErrorReply(
                code="stale_epoch", message=f"epoch {msg.epoch} < {self.view.manager_epoch}"
            )
        self.follower.set_order(msg.epoch, msg.order, msg.data_endpoints, from_manager=True)
        return Ack()

    async def _on_chain_info(self, peer: Peer, msg: ChainInfoRequest) -> ChainInfo:
        return self.follower.info()

    async def _on_reset(self, peer: Peer, msg: RelayReset) -> Ack:
        self.store.reset(keep_spare=msg.keep_spare)
        return Ack()
