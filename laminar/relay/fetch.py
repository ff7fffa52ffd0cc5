"""The downstream half of a hop: each relay pulls a version's chunks from its upstream.

    follower = ChainFollower(cfg.relay, view, store=store, chunks=chunks, ctx=ctx, opts=opts,
                             node_id=node_id, log=log, metrics=metrics, spawn=spawn)
    spawn(follower.run(), "chain")              # the follow loop
    ev = await follower.events.get()            # VersionComplete(vs): announce it to the rollouts
    follower.set_order(epoch, order, endpoints, from_manager=True)  # a ChainUpdate
    follower.become_head(why)                   # a trainer pushes here

The follower chooses a live upstream from the chain view (view.py), writes fetched chunks into
the store, has the version offered to this relay's own downstream as soon as it begins to arrive
(ChunkService.offer_downstream, serve.py: that is what pipelines the chain), and reports a
version that arrived whole on its event queue; relay/node.py publishes WeightsReady for its
rollouts. A change of the view that moves the upstream goes through the follower (set_order,
become_head), which drops its upstream and wakes its loop. It never sees the node.

Each relay keeps `relay.window` fetches in flight to its upstream. An upstream answers a
fetch for a chunk it has not received yet as soon as that chunk arrives, so chunk i
moves down hop k while chunk i+1 moves down hop k-1: hops overlap and a version
reaches the end of a p-relay chain in about (p + k - 2) chunk times, not p × k.
Pulling (rather than pushing) makes the hard cases simple:

* corruption: every chunk carries the master's crc32; a mismatch is counted and the
  chunk fetched again (from the upstream, then from the master after
  `relay.corrupt_retries` failures). The version checksum (layout + all crc32s)
  arrives with the last chunk and is checked at every hop.
* a dead upstream (missed heartbeats, or a failed fetch): the relay probes its
  predecessors in the chain order, nearest first, and resumes the missing chunks of
  the same version from the first live one. No relay has to know who was cut out.
* a dead master: the first relay that finds no live predecessor becomes the head
  (the lowest live index in the order); a partial version nobody can finish is
  abandoned. The trainer finds the new master itself (WeightPusher asks the relays,
  laminar/weights/pusher.py) or the manager tells it (WeightPusher.set_master).
* a newer version overtakes an older one: an upstream that freed version v answers
  "gone"; the downstream drops v and fetches the newest.
* delta mode (relay.delta, laminar/weights/delta.py): a fetch names the version this relay holds;
  the chunk may come back as the changed elements against it, rebuilt here on that copy
  and checked on the crc32 of the full chunk (a bad one is fetched again whole).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from structlog.typing import FilteringBoundLogger

from laminar.config import RelayConfig
from laminar.message import ProtocolError
from laminar.metrics import Metrics
from laminar.protocol.relay import (
    ChainInfo,
    ChainInfoRequest,
    FetchChunk,
    OfferRequest,
    VersionOffer,
    WeightChunk,
)
from laminar.relay.serve import ChunkService
from laminar.relay.view import ChainView
from laminar.supervise import Spawn
from laminar.transport.client import RpcClient
from laminar.transport.sockets import (
    Context,
    PeerDead,
    RemoteError,
    RequestTimeout,
    SocketOptions,
    TransportError,
)
from laminar.weights.delta import DELTA_PIN, apply_delta, delta_base
from laminar.weights.layout import (
    chunk_digest,
    chunk_range,
    crc_of,
    validate_layout,
    version_checksum,
)
from laminar.weights.segment import VersionState, WeightStore

CATCH_UP_EVERY_S = 0.5


class UpstreamLost(Exception):
    """The upstream stopped answering; pick another one."""


class VersionGone(Exception):
    """The upstream no longer has (or will never finish) the version being fetched.

    `permanent`: the version itself is bad (corrupt at the master, checksum mismatch, bad
    layout): never fetch it again. Otherwise it was only superseded or abandoned upstream."""

    def __init__(self, version: int, why: str, permanent: bool = False):
        super().__init__(f"version {version}: {why}")
        self.version, self.permanent = version, permanent


@dataclass(frozen=True)
class VersionComplete:
    """A version arrived whole and verified: announce it to the rollouts."""

    vs: VersionState


class ChainFollower:
    """The downstream half of a relay: choose a live upstream and copy its newest version."""

    def __init__(
        self,
        rc: RelayConfig,
        view: ChainView,
        *,
        store: WeightStore,
        chunks: ChunkService,
        ctx: Context,
        opts: SocketOptions,
        node_id: str,
        log: FilteringBoundLogger,
        metrics: Metrics,
        spawn: Spawn,
    ):
        self.rc, self.view, self.index, self.store = rc, view, view.index, store
        self.chunks = chunks
        """This relay's upstream half: offers what begins to arrive to its own downstream."""
        self.ctx, self.opts, self.node_id = ctx, opts, node_id
        self.log, self.metrics, self.spawn = log, metrics, spawn
        self.events: asyncio.Queue[VersionComplete] = asyncio.Queue()
        """What the relay must act on, in order (the follower never calls into it)."""
        self.upstream: int | None = None
        self.client: RpcClient | None = None
        self._master_client: tuple[int, RpcClient] | None = None
        self.offer: VersionOffer | None = None
        self.changed = asyncio.Event()
        self._upstream_dead = False
        self._ever_connected = False
        self._generation = 0
        self._given_up: set[int] = set()
        self.state = "starting"
        self._grace_until = time.monotonic() + self.rc.upstream_grace_s

    # ---- changes of the view that move the upstream ----------------------------------------
    def set_order(
        self, epoch: int, order: list[int], endpoints: dict[str, str], from_manager: bool
    ) -> None:
        self.view.set_order(epoch, order, endpoints, from_manager)
        self._drop_upstream()
        self.changed.set()

    def become_head(self, why: str, catch_up: bool = True) -> None:
        if self.view.become_head(why, catch_up):
            self._drop_upstream()
            self.changed.set()

    def info(self) -> ChainInfo:
        store = self.store
        cur, inc = store.current, store.newest_incoming()
        view = self.view
        return ChainInfo(
            index=self.index,
            epoch=view.epoch,
            order=view.order,
            master=view.master,
            upstream=-1 if self.upstream is None else self.upstream,
            version=cur.version if cur else -1,
            checksum=cur.checksum if cur else "",
            incoming_version=inc.version if inc else -1,
            incoming_have=inc.have_count if inc else 0,
            incoming_chunks=inc.n if inc else 0,
            counters=dict(self.metrics.counters),
            state=f"{self.state}; offer={self.offer.version if self.offer else None}",
        )

    # ---- connections ---------------------------------------------------------------------
    def _drop_upstream(self) -> None:
        self._generation += 1
        client, self.client, self.upstream, self.offer = self.client, None, None, None
        if client is not None:  # may be called from a sync path (set_order): close it aside
            self.spawn(client.close(), "close-upstream")

    def _on_upstream_dead(self) -> None:  # called from the client's heartbeat task: only flag it
        self._upstream_dead = True
        self.changed.set()

    def _on_offer(self, _peer: Any, msg: VersionOffer) -> None:
        if msg.version >= 0 and (self.offer is None or msg.version > self.offer.version):
            self.offer = msg
            self.changed.set()

    async def _probe(
        self, idx: int, on_dead: Callable[[], Any] | None = None, timeout: float | None = None
    ) -> RpcClient | None:
        cli = RpcClient(
            self.ctx,
            self.view.data_endpoint(idx),
            self.node_id,
            "relay",
            self.opts,
            on_server_dead=on_dead,
            spawn=self.spawn,
        )
        cli.on(VersionOffer, self._on_offer)
        try:
            await cli.connect(timeout=timeout or self.rc.probe_timeout_s)
            return cli
        except (TransportError, OSError) as exc:
            self.log.info("relay_unreachable", relay=idx, error=str(exc))
            await cli.close()
            return None

    async def _choose_upstream(self) -> bool:
        """Connect to the nearest live predecessor; become head if there is none.

        Until it first had an upstream (and for at most relay.upstream_grace_s), a relay
        waits for its immediate predecessor instead of skipping it: at start-up a relay
        that is not up yet is not dead, and skipping it would split the chain."""
        view = self.view
        pos = view.order.index(self.index)
        preds = [i for i in reversed(view.order[:pos]) if i not in view.dead]
        if preds and not self._ever_connected and time.monotonic() < self._grace_until:
            preds = preds[:1]
        gen = self._generation
        for idx in preds:
            cli = await self._probe(idx, self._on_upstream_dead)
            if gen != self._generation:  # the order changed while we probed: start over
                if cli is not None:
                    await cli.close()
                return False
            if cli is None and not self._ever_connected and time.monotonic() < self._grace_until:
                await asyncio.sleep(
                    self.rc.probe_timeout_s / 4
                )  # start-up: the predecessor is coming
                return False
            if cli is None:
                view.dead.add(idx)
                self.metrics.count("relays_cut_out")
                self.log.warning("relay_cut_out", relay=idx)
                continue
            self.client, self.upstream, self._upstream_dead = cli, idx, False
            self._ever_connected = True
            self.log.info("upstream", relay=idx, epoch=view.epoch)
            return True
        # Electing itself splits the chain if a predecessor was only slow: ask them all once
        # more, with a longer deadline, before taking over as master.
        for idx in reversed(view.order[: view.order.index(self.index)]):
            cli = await self._probe(
                idx, self._on_upstream_dead, timeout=3 * self.rc.probe_timeout_s
            )
            if gen != self._generation:
                if cli is not None:
                    await cli.close()
                return False
            if cli is not None:
                view.dead.discard(idx)
                self.client, self.upstream, self._upstream_dead = cli, idx, False
                self.log.info("upstream", relay=idx, epoch=view.epoch, second_chance=True)
                return True
        self.become_head("no live predecessor")
        return False

    async def join(self) -> None:
        """At start: adopt a newer chain view from a live relay (e.g. a new master was elected)."""

        n_relays = self.view.n_relays
        infos = await asyncio.gather(
            *(
                self._chain_info(self.view.control_endpoint(i))
                for i in range(n_relays)
                if i != self.index
            )
        )
        best = max(
            (i for i in infos if i is not None and i.epoch > 0), key=lambda i: i.epoch, default=None
        )
        if best is not None and self.view.manager_epoch < 0:
            self.view.adopt(best)

    async def _chain_info(self, endpoint: str) -> ChainInfo | None:
        """One relay's view of the chain (None: it did not answer within probe_timeout_s)."""
        timeout = self.rc.probe_timeout_s
        cli = RpcClient(self.ctx, endpoint, self.node_id, "relay", self.opts, spawn=self.spawn)
        try:
            await cli.connect(timeout=timeout)
            info = await cli.request(ChainInfoRequest(), timeout=timeout, retries=0)
            return info if isinstance(info, ChainInfo) else None
        except (TransportError, OSError):
            return None
        finally:
            await cli.close()

    # ---- the follow loop -----------------------------------------------------------------
    async def run(self) -> None:
        store = self.store
        view = self.view
        if view.n_relays > 1:
            await self.join()
        while True:
            self.changed.clear()
            if self.index not in view.order or view.head:
                self._drop_upstream()
                inc = store.newest_incoming()
                if view.head and inc is not None and inc.source == "upstream":
                    self.log.warning(
                        "version_abandoned", version=inc.version, why="no upstream can finish it"
                    )
                    store.abandon(inc)
                if view.head and time.monotonic() < view.catch_up_until:
                    # a push may still land on the previous head (its ChainUpdate in flight):
                    # look for newer versions in the chain for a while after taking over
                    self.state = "catching up"
                    await self._catch_up()
                    self._drop_upstream()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.changed.wait(), CATCH_UP_EVERY_S)
                    continue
                self.state = "head or not in chain"
                await self.changed.wait()
                continue
            if self.client is None or self._upstream_dead:
                if self._upstream_dead and self.upstream is not None:
                    # not cut out yet: _choose_upstream probes it first (it may only have been slow)
                    self.log.warning("upstream_silent", relay=self.upstream)
                self._drop_upstream()
                self.state = "choosing upstream"
                if not await self._choose_upstream():
                    continue
            try:
                assert self.client is not None  # _choose_upstream returned True
                if self.offer is None:
                    self.state = "asking offer"
                    reply = await self.client.request(
                        OfferRequest(), timeout=self.rc.probe_timeout_s * 4, retries=0
                    )
                    if isinstance(reply, VersionOffer):
                        self._on_offer(None, reply)
                newest = store.newest()
                if (
                    self.offer is not None
                    and self.offer.version > (newest.version if newest else -1)
                    and self.offer.version not in self._given_up
                ):
                    self.state = "fetching"
                    await self._fetch(self.offer)
                    continue
                if (
                    newest is not None
                    and not newest.complete
                    and self.offer
                    and newest.version == self.offer.version
                ):
                    self.state = "resuming"
                    await self._fetch(self.offer)  # resume a version after an upstream change
                    continue
            except (UpstreamLost, RequestTimeout, PeerDead) as exc:
                self.log.warning("upstream_lost", relay=self.upstream, error=str(exc))
                self._upstream_dead = True
                continue
            except VersionGone as exc:
                self.log.info("version_gone", error=str(exc), permanent=exc.permanent)
                if exc.permanent:  # never fetch it again; a newer version will come
                    self._given_up.add(exc.version)
                if self.offer is not None and self.offer.version <= exc.version:
                    self.offer = None  # ask the upstream what it has now
                continue
            self.state = "idle: newest offered already here"
            await self.changed.wait()

    async def _catch_up(self) -> None:
        """A relay made head (by the manager or an election) that is behind a relay of its chain
        fetches that newer version once, so the chain does not serve an old version from its head
        until the trainer's next push."""
        newest = self.store.newest()
        mine = newest.version if newest else -1
        timeout = self.rc.probe_timeout_s

        infos = await asyncio.gather(
            *(
                self._chain_info(self.view.data_endpoint(i))
                for i in self.view.order
                if i != self.index
            )
        )
        newer = [i for i in infos if i is not None and i.version > mine]
        if not newer:
            return
        best = max(newer, key=lambda i: i.version)
        cli = await self._probe(best.index)
        if cli is None:
            return
        self.client, self.upstream = cli, best.index
        self.log.info("catch_up", source=best.index, version=best.version, had=mine)
        try:
            offer = await cli.request(OfferRequest(), timeout=timeout * 4, retries=0)
            if isinstance(offer, VersionOffer) and offer.version > mine:
                await self._fetch(offer)
                self.metrics.count("caught_up")
        except (UpstreamLost, VersionGone, RequestTimeout, PeerDead, RemoteError) as exc:
            self.log.warning("catch_up_failed", source=best.index, error=str(exc))

    async def _fetch(self, offer: VersionOffer) -> None:
        store = self.store
        if offer.layout is None or not 4096 <= offer.chunk_bytes <= 1 << 30:
            raise VersionGone(
                offer.version, "offer without layout or with a bad chunk size", permanent=True
            )
        try:
            validate_layout(offer.layout)
        except ProtocolError as exc:
            self.metrics.count("bad_offers")
            raise VersionGone(offer.version, f"bad layout: {exc}", permanent=True) from None
        vs = store.versions.get(offer.version)
        if vs is None:
            inc = store.newest_incoming()
            if inc is not None and inc.source == "upstream":
                store.abandon(inc)  # a newer version overtakes the one in flight
            try:
                vs = await store.begin(
                    offer.version, offer.layout, offer.chunk_bytes, source="upstream"
                )
            except ValueError as exc:  # the trainer staged this very version here meanwhile
                raise VersionGone(offer.version, str(exc)) from None
            await self.chunks.offer_downstream(vs)  # while it still arrives: pipelining
        t0 = time.monotonic()
        base = store.current
        base_v = delta_base(self.rc.delta, base, vs)
        if base_v >= 0:
            if vs.delta_base < 0 and not vs.deltas:
                vs.delta_base = base_v  # the deltas we keep to forward are against this version
            store.pin(DELTA_PIN, base_v)  # rebuilt chunks read it: keep its slot
        missing = deque(i for i in range(vs.n) if not vs.have[i])
        # the fetch window: child tasks of this call, awaited and cancelled below (not background)
        workers = [
            asyncio.create_task(self._worker(vs, missing, base if base_v >= 0 else None))
            for _ in range(min(self.rc.window, len(missing)) or 1)
        ]
        try:
            await asyncio.gather(*workers)
        except VersionGone:
            store.abandon(vs)
            raise
        finally:
            for w in workers:
                w.cancel()
            for w in workers:
                with contextlib.suppress(BaseException):
                    await w
            if base_v >= 0:
                store.unpin(DELTA_PIN, base_v)
        if vs.abandoned:
            raise VersionGone(vs.version, "abandoned")
        checksum = version_checksum(vs.layout, vs.chunk_bytes, vs.crcs)
        if vs.expected_checksum and checksum != vs.expected_checksum:
            self.metrics.count("version_checksum_mismatch")
            self.log.error(
                "version_checksum_mismatch",
                version=vs.version,
                got=checksum,
                want=vs.expected_checksum,
            )
            store.abandon(vs)
            raise VersionGone(vs.version, "version checksum mismatch", permanent=True)
        store.complete(vs, checksum)
        self.metrics.add("receive_s", time.monotonic() - t0)
        self.events.put_nowait(VersionComplete(vs))

    async def _worker(
        self, vs: VersionState, missing: deque[int], base: VersionState | None
    ) -> None:
        while missing and not vs.abandoned:
            i = missing.popleft()
            try:
                await self._fetch_chunk(vs, i, base)
            except BaseException:
                missing.appendleft(i)
                raise

    async def _master_cli(self) -> RpcClient | None:
        m = self.view.master
        if m == self.upstream or m == self.index:
            return self.client
        if self._master_client is not None and self._master_client[0] == m:
            return self._master_client[1]
        if self._master_client is not None:
            await self._master_client[1].close()
        cli = await self._probe(m)
        self._master_client = (m, cli) if cli is not None else None
        return cli or self.client

    async def _fetch_chunk(self, vs: VersionState, i: int, base: VersionState | None) -> None:
        """Fetch chunk i whole, or as a delta rebuilt on `base` (laminar/weights/delta.py);
        verify its crc32."""
        store = self.store
        start, end = chunk_range(i, vs.chunk_bytes, vs.layout.total_bytes)
        base_v = base.version if base is not None else -1
        corrupt = 0
        while True:
            src = self.client if corrupt < self.rc.corrupt_retries else await self._master_cli()
            if src is None:
                raise UpstreamLost("no upstream")
            try:
                msg = await src.request(
                    FetchChunk(vs.version, i, base_v if corrupt == 0 else -1),
                    timeout=self.rc.fetch_timeout_s,
                    retries=0,
                )
            except RemoteError as exc:
                if exc.code == "not_yet":
                    continue
                if exc.code == "gone":
                    raise VersionGone(vs.version, str(exc)) from None
                raise UpstreamLost(str(exc)) from None
            except (RequestTimeout, PeerDead) as exc:
                if src is self.client:
                    raise UpstreamLost(str(exc)) from None
                corrupt = 0  # the master is unreachable: back to the upstream
                continue
            if (
                not isinstance(msg, WeightChunk)
                or msg.version != vs.version
                or msg.index != i
                or msg.offset != start
            ):
                self.metrics.count("bad_chunks")
                raise UpstreamLost(
                    f"unexpected reply {type(msg).__name__} to FetchChunk({vs.version}, {i})"
                )
            self.metrics.count("bytes_received", len(msg.data))
            ok = True
            if msg.base_version >= 0:  # a delta: rebuild the chunk in place on our base
                data = vs.buf[start:end]
                try:
                    if base is None or msg.base_version != base_v:
                        raise ProtocolError(f"delta against {msg.base_version}, we hold {base_v}")
                    # off the loop: heartbeats keep flowing while a dense delta is applied
                    changed = await asyncio.to_thread(
                        apply_delta, data, base.buf[start:end], msg.data
                    )
                except ProtocolError as exc:
                    self.metrics.count("bad_deltas")
                    self.log.warning("bad_delta", version=vs.version, index=i, error=str(exc))
                    ok = False
                else:
                    self.metrics.count("chunks_delta")
                    self.metrics.count("delta_words_changed", changed)
                    if changed == 0:
                        self.metrics.count("chunks_unchanged")
            else:
                data = msg.data
            if not ok or len(data) != end - start or chunk_digest(data) != crc_of(msg.digest):
                corrupt += 1
                self.metrics.count("chunks_corrupt")
                if corrupt > 2 * self.rc.corrupt_retries + 2:  # the master's own copy is bad too
                    raise VersionGone(
                        vs.version, f"chunk {i} corrupt {corrupt} times", permanent=True
                    )
                self.log.warning(
                    "chunk_corrupt",
                    version=vs.version,
                    index=i,
                    attempt=corrupt,
                    source=src.server_id,
                )
                continue
            if msg.base_version < 0:
                vs.buf[start:end] = data
            elif msg.base_version == vs.delta_base:
                vs.deltas[i] = msg.data  # forwarded as is to our own downstream
            if msg.version_checksum:
                vs.expected_checksum = msg.version_checksum
            store.mark(vs, i, msg.digest)
            return

    async def close(self) -> None:
        self._drop_upstream()
        if self._master_client is not None:
            await self._master_client[1].close()
            self._master_client = None
