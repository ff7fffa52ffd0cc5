"""The upstream half of a hop: what this relay gives its downstream relays.

    chunks = ChunkService(store, data, node_id, metrics, chunk_wait_s=rc.chunk_wait_s,
                          delta=rc.delta, link_bytes_per_s=rc.link_bytes_per_s)
    data.on(OfferRequest, chunks.offer)         # the newest version here
    data.on(FetchChunk, chunks.fetch)           # one chunk (as a delta where the requester can)
    await chunks.offer_downstream(vs)           # a version begins to arrive or was pushed here

    master ◄─FetchChunk(v, i)── relay 1 ◄─FetchChunk(v, i)── relay 2 ◄── …
           ──WeightChunk(data)─►        ──WeightChunk(data)─►
    (data sockets: each relay's RpcServer at relay_data-k; the downstream is its client)

An upstream answers a fetch for a chunk it has not received yet as soon as that chunk arrives
(up to `chunk_wait_s`): that wait is what pipelines the chain. The downstream half, fetching,
is fetch.py; the relay node wires both onto its data socket.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from laminar.message import ProtocolError
from laminar.metrics import Metrics
from laminar.protocol.relay import FetchChunk, OfferRequest, VersionOffer, WeightChunk
from laminar.transport.server import RpcServer
from laminar.transport.session import ErrorReply
from laminar.transport.sockets import Peer
from laminar.weights.layout import chunk_range
from laminar.weights.segment import VersionState, WeightStore


def offer_of(vs: VersionState) -> VersionOffer:
    return VersionOffer(version=vs.version, layout=vs.layout, chunk_bytes=vs.chunk_bytes)


class Pacer:
    """Emulated link of `rate` bytes/s (bench/tests): a chunk is 'on the wire' n/rate seconds."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self.next_free = 0.0

    async def take(self, nbytes: int) -> None:
        if not self.rate:
            return
        now = time.monotonic()
        done = max(self.next_free, now) + nbytes / self.rate
        self.next_free = done
        await asyncio.sleep(done - now)  # emulated transmission time, not synchronisation


class ChunkService:
    """The upstream half of a hop: offers this relay's versions to its downstream relays (on the
    data socket) and answers their OfferRequest and FetchChunk from the store.

    A fetch for a chunk not received yet waits for it (up to `chunk_wait_s`): that wait is
    what pipelines the chain. In delta mode the chunk goes as its kept delta when the
    requester holds the base it was encoded against. Each downstream gets its own Pacer
    (an emulated link when `link_bytes_per_s` is set)."""

    def __init__(
        self,
        store: WeightStore,
        data: RpcServer[Any],
        node_id: str,
        metrics: Metrics,
        *,
        chunk_wait_s: float,
        delta: bool,
        link_bytes_per_s: float | None = None,
    ):
        self.store, self.node_id, self.metrics = store, node_id, metrics
        self.data = data
        """This relay's data socket (relay_data-k): its clients are the downstream relays."""
        self.chunk_wait_s, self.delta, self.link_bytes_per_s = chunk_wait_s, delta, link_bytes_per_s
        self._pacers: dict[str, Pacer] = {}

    async def offer_downstream(self, vs: VersionState) -> None:
        """Offer `vs` to the downstream relays now, complete or still arriving (pipelining)."""
        await self.data.broadcast(offer_of(vs), role="relay")

    async def offer(self, peer: Peer, msg: OfferRequest) -> VersionOffer:
        vs = self.store.newest()
        return offer_of(vs) if vs is not None else VersionOffer(version=-1)

    async def fetch(self, peer: Peer, msg: FetchChunk) -> WeightChunk | ErrorReply:
        vs = self.store.versions.get(msg.version)
        if vs is None or vs.abandoned or vs.staging:
            return ErrorReply(
                code="gone", message=f"{self.node_id} does not have version {msg.version}"
            )
        if not 0 <= msg.index < vs.n:
            raise ProtocolError(f"chunk index {msg.index} out of range [0, {vs.n})")
        if not await self.store.wait_chunk(vs, msg.index, self.chunk_wait_s):
            code = "gone" if vs.abandoned else "not_yet"
            return ErrorReply(
                code=code, message=f"chunk {msg.index} of version {msg.version} not here"
            )
        start, end = chunk_range(msg.index, vs.chunk_bytes, vs.layout.total_bytes)
        blob = None
        if self.delta and msg.base_version >= 0 and msg.base_version == vs.delta_base:
            blob = vs.deltas.get(msg.index)  # None: this chunk travels whole (delta not smaller)
        # zero-copy: the frame points into the shared-memory slot (or the kept delta)
        data = vs.buf[start:end] if blob is None else blob
        pacer = self._pacers.get(peer.node_id)
        if pacer is None:
            pacer = self._pacers[peer.node_id] = Pacer(self.link_bytes_per_s)
        await pacer.take(len(data))
        self.metrics.count("bytes_sent", len(data))
        if blob is not None:
            self.metrics.count("chunks_sent_delta")
        return WeightChunk(
            version=vs.version,
            index=msg.index,
            offset=start,
            digest=int(vs.digests[msg.index]),
            data=data,
            base_version=vs.delta_base if blob is not None else -1,
            version_checksum=vs.checksum or vs.expected_checksum,
        )
