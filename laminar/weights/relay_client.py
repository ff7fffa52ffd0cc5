"""Relay variant of the weights channel: the trainer's push to the master relay and a
rollout's pull from its host's relay (laminar/weights/channel.py picks the variant).

    trainer:  pusher = WeightPusher(links, wiring)  # links: laminar/wiring/common.py relay_links
              await pusher.start()
              stall_s = await pusher.push(version, model.state_dict())  # returns after the handoff
    rollout:  puller = WeightPuller(links, wiring, relay_index=cfg.rollout.relay_index)
              await puller.start()                     # spawns its WeightsReady listener
              await puller.wait_version(v, timeout=30)
              async with await puller.pull() as w:     # pins the version at the relay
                  for name, t in w.named_tensors():    # zero-copy views into /dev/shm
                      param[name].copy_(t)

Both take explicit dependencies: RelayLinks (endpoints, timeouts, chunking), a zmq
context and SocketOptions, this end's node id, a logger and a supervised `spawn` for the
background tasks they start (the puller's subscription listener, closing a replaced client).

Push, same host (the common case): StageRequest → the master relay reserves a slot and
answers with its /dev/shm path → the pusher copies every tensor into it (one memcpy,
CUDA tensors copied device-to-host straight into shared memory) → CommitRequest →
the trainer resumes. The chain broadcast runs afterwards inside the relays, so the
stall does not grow with the number of relays or rollouts. When the relay's segment
is not visible (trainer on another host) the pusher streams PushChunk messages instead.

Master failover: a relay that is not the master answers NotMaster(master=i) and the
pusher follows it. If the master does not answer, the pusher asks every relay for its
chain view (ChainInfo) and pushes to the master named by the newest view when that
relay is alive, else to the lowest live index; that relay becomes master. The manager
can also call `set_master(endpoint)` (e.g. after its own chain rebuild).

Pull: PullRequest pins a version at the relay (released by `release()`, by
`close()`, or by the relay when this client dies) and names its segment. The puller
maps it read-only and shared, and keeps the mapping for the next pull of the same
slot (slots are reused), so tensors are zero-copy views whose page tables are
already warm: a rollout's load costs about one memcpy. The views are read-only (a
rollout copies them into its engine); `WeightPuller(..., writable=True)` maps each
pull privately (copy-on-write) instead, at the cost of page faults on first touch.

Layout and checksums: laminar/weights/layout.py. GPU variants (CUDA IPC,
NCCL): laminar/weights/gpu.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import mmap
import os
import socket
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from laminar.protocol.relay import (
    ChainInfo,
    ChainInfoRequest,
    CommitRequest,
    LatestReply,
    LatestRequest,
    NotMaster,
    PullReply,
    PullRequest,
    PushChunk,
    ReleaseRequest,
    StageReply,
    StageRequest,
    WeightLayout,
    WeightsReady,
)
from laminar.transport.client import RpcClient
from laminar.transport.sockets import (
    PeerDead,
    RemoteError,
    RequestTimeout,
    TransportError,
    Wiring,
)
from laminar.transport.streams import Subscriber
from laminar.weights.layout import (
    NamedTensors,
    checksum_buffer,
    chunk_range,
    layout_of,
    n_chunks,
    named_list,
    tensor_spans,
    validate_layout,
)
from laminar.weights.segment import WriterMap, map_segment
from laminar.weights.sink import FlatSink, VersionSink, bytes_of

_ids = itertools.count()
MAX_REDIRECTS = 4  # NotMaster hops followed per push before giving up
T = TypeVar("T")


class WeightsUnavailable(RuntimeError):
    """No weights to move right now (no live relay, no such version, a file vanished): retry
    later."""


def write_flat(dst: Any, items: list[tuple[str, Any]], layout: WeightLayout) -> None:
    """Copy tensors into a flat uint8 torch buffer at their layout offsets; zero the padding.

    CPU tensors go through numpy (measured ~2x faster than torch's uint8 copy_ here);
    CUDA tensors are copied device-to-host by torch."""
    flat = dst.numpy()
    pos = 0
    for (_name, t), off in zip(items, layout.offsets, strict=True):
        if off > pos:
            flat[pos:off] = 0
        src = bytes_of(t)
        n = src.numel()
        if n:
            if src.device.type == "cpu":
                np.copyto(flat[off : off + n], src.numpy())
            else:
                dst[off : off + n].copy_(src)
        pos = off + n
    if layout.total_bytes > pos:
        flat[pos : layout.total_bytes] = 0


@dataclass(frozen=True)
class RelayLinks:
    """What the trainer's and a rollout's ends need to reach the relays (built from the
    config by laminar/wiring/common.py `relay_links`)."""

    control: tuple[str, ...]
    """Relay i's control endpoint (Stage/Commit/Pull/ChainInfo), for every relay index."""
    pub: tuple[str, ...]
    """Relay i's WeightsReady publisher."""
    startup_timeout_s: float
    request_timeout_s: float
    probe_timeout_s: float
    """A relay that does not answer a probe within this is taken for dead (failover)."""
    chunk_bytes: int
    """Chunk size of a streamed push when the relay did not name one."""
    window: int
    """Chunks of a streamed push in flight."""

    def relay(self, index: int) -> str:
        if not 0 <= index < len(self.control):
            raise WeightsUnavailable(f"relay {index} is not one of the {len(self.control)}")
        return self.control[index]


class _End:
    """What both ends keep of their settings and wiring."""

    def __init__(self, links: RelayLinks, wiring: Wiring):
        self.links = links
        self.ctx, self.opts, self.node_id, self.role = (
            wiring.ctx,
            wiring.opts,
            wiring.node_id,
            wiring.role,
        )
        self.log, self.spawn = wiring.log, wiring.spawn


class WeightPusher(_End):
    """Trainer side: hand each new version to the master relay and return at once."""

    def __init__(
        self,
        links: RelayLinks,
        wiring: Wiring,
        *,
        master_endpoint: str | None = None,
    ):
        super().__init__(links, wiring)
        self.endpoint = master_endpoint or links.relay(0)
        self.client: RpcClient | None = None
        self._maps: dict[str, WriterMap] = {}
        self.last_stall_s = float("nan")
        self.pushes = 0
        self.failovers = 0
        self.mode = ""
        self._takeover = False
        self.timings: dict[str, float] = {}

    def _new_client(self, endpoint: str) -> RpcClient:
        return RpcClient(self.ctx, endpoint, self.node_id, self.role, self.opts, spawn=self.spawn)

    async def start(self) -> None:
        self.client = self._new_client(self.endpoint)
        try:
            await self.client.connect(timeout=self.links.startup_timeout_s)
        except TransportError:
            await self._failover()

    def set_master(self, endpoint: str) -> None:
        """The manager names a new master; the next push goes there."""
        if endpoint != self.endpoint:
            self.endpoint = endpoint
            old, self.client = self.client, None
            if old is not None:  # a request may still be unwinding on it: close it aside
                self.spawn(old.close(), "close-old-master")

    async def _failover(self) -> None:
        """Find the master: the one the newest live chain view names, else the lowest live relay."""
        n_relays = len(self.links.control)
        timeout = self.links.probe_timeout_s

        async def ask(i: int) -> tuple[int, ChainInfo | None]:
            cli = self._new_client(self.links.relay(i))
            try:
                await cli.connect(timeout=timeout)
                info = await cli.request(ChainInfoRequest(), timeout=timeout, retries=0)
                return i, info if isinstance(info, ChainInfo) else None
            except TransportError:
                return i, None
            finally:
                await cli.close()

        live = {
            i: info
            for i, info in await asyncio.gather(*(ask(i) for i in range(n_relays)))
            if info is not None
        }
        if not live:
            raise WeightsUnavailable(f"no live relay among {n_relays}")
        newest = max(live.values(), key=lambda info: info.epoch)
        master = newest.master if newest.master in live else min(live)
        self.failovers += 1
        self.log.warning("relay_master_failover", old=self.endpoint, master=master)
        self.set_master(self.links.relay(master))

    async def _master_alive(self) -> bool:
        """A busy master is not a dead one: re-handshake on a fresh socket before failing over."""
        old, self.client = self.client, None
        if old is not None:
            await old.close()
        cli = self._new_client(self.endpoint)
        try:
            await cli.connect(timeout=max(self.links.probe_timeout_s, self.opts.dead_after_s))
        except TransportError:
            await cli.close()
            return False
        self.client = cli
        return True

    async def _client(self) -> RpcClient:
        if self.client is None:
            self.client = self._new_client(self.endpoint)
            await self.client.connect(timeout=self.links.probe_timeout_s * 4)
        return self.client

    async def push(self, version: int, named_tensors: NamedTensors) -> float:
        """Hand `version` to the master relay; returns the trainer's stall in seconds."""
        t0 = time.perf_counter()
        items = named_list(named_tensors)
        layout = layout_of(items)

        async def fill_and_commit(cli: RpcClient, reply: StageReply) -> float:
            t1 = time.perf_counter()
            if self._same_host(reply):
                self.mode = "shm"
                await asyncio.to_thread(self._copy_into, reply, items, layout)
            else:
                self.mode = "stream"
                await self._stream(cli, reply, items, layout, version)
            t2 = time.perf_counter()
            commit = CommitRequest(version=version, token=reply.token)
            await cli.request(commit, timeout=self.links.request_timeout_s, retries=0)
            self.timings = {
                "stage_s": t1 - t0,
                "copy_s": t2 - t1,
                "commit_s": time.perf_counter() - t2,
            }
            self.pushes += 1
            self._takeover = False
            self.last_stall_s = time.perf_counter() - t0
            return self.last_stall_s

        return await self._at_master(version, layout, "push", fill_and_commit)

    def _same_host(self, reply: StageReply) -> bool:
        if not reply.segment or reply.host != socket.gethostname():
            return False
        try:
            return os.stat(reply.segment).st_ino == reply.inode
        except OSError:
            return False

    def _copy_into(
        self, reply: StageReply, items: list[tuple[str, Any]], layout: WeightLayout
    ) -> None:
        cuda = any(t.device.type == "cuda" for _, t in items)
        write_flat(self._writer_map(reply, cuda).tensor, items, layout)

    def _writer_map(self, reply: StageReply, cuda: bool) -> WriterMap:
        """The staged slot's segment, mapped writable (cached: slots are reused); `cuda`: pinned
        for device-to-host copies."""
        for path in [p for p in self._maps if not os.path.exists(p)]:  # the relay freed that slot
            self._maps.pop(path).close()
        m = self._maps.get(reply.segment)
        if m is None or m.size != reply.size or m.inode != reply.inode:
            if m is not None:
                m.close()
            m = self._maps[reply.segment] = WriterMap(reply.segment, reply.size)
        if cuda and not m.cuda_registered:
            from laminar.weights.gpu import pin_host_tensor

            m.cuda_registered = pin_host_tensor(m.tensor)  # pinned: faster device-to-host copies
        return m

    async def push_stream(
        self,
        version: int,
        layout: WeightLayout,
        produce: Callable[[VersionSink], Awaitable[None]],
        *,
        digest: bool,
    ) -> tuple[float, str]:
        """Stream `version` into the master relay while the trainer exports it: stage its layout,
        `produce(sink)` puts each tensor as it is gathered and the sink writes it into the staged
        slot meanwhile (laminar/weights/sink.py), commit once every tensor is written. Returns
        (the trainer's stall in seconds, the version's weights_digest; "" unless `digest`).

        A failure of `produce` or of a write (or a cancellation) commits nothing: the relay never
        offers the version, and drops the staging at the next StageRequest. Only staging is
        retried (with failover, as `push`); once tensors were produced there is no second try."""
        import torch

        t0 = time.perf_counter()
        cli, reply = await self._stage(version, layout)
        t1 = time.perf_counter()
        timeout = self.links.request_timeout_s
        if self._same_host(reply):
            self.mode = "shm"
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            dst = self._writer_map(reply, cuda).tensor
        else:  # another host: the whole version into a local buffer, then sent in chunks
            self.mode = "stream"
            dst = torch.empty(layout.total_bytes, dtype=torch.uint8)
        sink = FlatSink(dst, layout, digest=digest)
        try:
            await produce(sink)
            digest_hex = await asyncio.to_thread(sink.finish, self.links.startup_timeout_s)
        except BaseException:
            sink.close()
            raise
        if self.mode == "stream":
            await self._send(cli, reply, dst, layout, version)
        t2 = time.perf_counter()
        await cli.request(CommitRequest(version=version, token=reply.token), timeout=timeout)
        self.timings = {"stage_s": t1 - t0, "copy_s": t2 - t1, "commit_s": time.perf_counter() - t2}
        self.pushes += 1
        self._takeover = False
        self.last_stall_s = time.perf_counter() - t0
        return self.last_stall_s, digest_hex

    async def _stage(self, version: int, layout: WeightLayout) -> tuple[RpcClient, StageReply]:
        """A StageReply from the master relay (following NotMaster, failing over as `push`)."""

        async def staged(cli: RpcClient, reply: StageReply) -> tuple[RpcClient, StageReply]:
            return cli, reply

        return await self._at_master(version, layout, "staging", staged)

    async def _at_master(
        self,
        version: int,
        layout: WeightLayout,
        what: str,
        then: Callable[[RpcClient, StageReply], Awaitable[T]],
    ) -> T:
        """Stage `version` at the master relay (following NotMaster), then `then(cli, reply)`; a
        timeout, a dead peer or a retryable RemoteError in either retries the whole attempt, up
        to 3 failures, failing over to a new master when this one is dead."""
        timeout = self.links.request_timeout_s
        last: Exception | None = None
        failures = redirects = 0
        while True:
            try:
                cli = await self._client()
                stage = StageRequest(version=version, layout=layout, takeover=self._takeover)
                reply = await cli.request(stage, timeout=timeout, retries=0)
                if isinstance(reply, NotMaster):  # the relay names the master: push there
                    if redirects >= MAX_REDIRECTS:
                        raise WeightsUnavailable(
                            f"push of version {version}: still redirected after {redirects} hops"
                        )
                    redirects += 1
                    self.set_master(self.links.relay(reply.master))
                    continue
                if not isinstance(reply, StageReply):
                    raise WeightsUnavailable(
                        f"unexpected reply {type(reply).__name__} to StageRequest"
                    )
                return await then(cli, reply)
            except RemoteError as exc:
                if exc.code in ("stale_version", "protocol", "out_of_slots"):
                    raise
                last = exc
            except (RequestTimeout, PeerDead) as exc:
                last = exc
            failures += 1
            if failures >= 3:
                raise WeightsUnavailable(f"{what} of version {version} failed: {last}")
            self.log.warning(
                "push_failed", version=version, endpoint=self.endpoint, error=str(last)
            )
            if not await self._master_alive():
                await self._failover()
                self._takeover = True

    async def _stream(
        self,
        cli: RpcClient,
        reply: StageReply,
        items: list[tuple[str, Any]],
        layout: WeightLayout,
        version: int,
    ) -> None:
        """Remote trainer: send the flat buffer in chunks, a few requests in flight."""
        import torch

        flat = torch.empty(layout.total_bytes, dtype=torch.uint8)
        await asyncio.to_thread(write_flat, flat, items, layout)
        await self._send(cli, reply, flat, layout, version)

    async def _send(
        self, cli: RpcClient, reply: StageReply, flat: Any, layout: WeightLayout, version: int
    ) -> None:
        cb = reply.chunk_bytes or self.links.chunk_bytes
        arr = flat.numpy()
        pending = list(range(n_chunks(layout.total_bytes, cb)))
        timeout = self.links.request_timeout_s

        async def sender() -> None:
            while pending:
                s, e = chunk_range(pending.pop(0), cb, layout.total_bytes)
                msg = PushChunk(version=version, token=reply.token, offset=s, data=arr[s:e])
                await cli.request(msg, timeout=timeout, retries=0)

        await asyncio.gather(*(sender() for _ in range(self.links.window)))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
        for m in self._maps.values():
            m.close()
        self._maps.clear()


class PulledWeights:
    """One pinned version; `named_tensors()` are zero-copy views valid until `release()`."""

    def __init__(self, puller: WeightPuller | None, reply: PullReply, mm: mmap.mmap):
        self._puller, self._mm = puller, mm
        self.version, self.checksum = reply.version, reply.checksum
        self.layout, self.chunk_bytes, self.segment = reply.layout, reply.chunk_bytes, reply.segment
        self.nbytes = reply.layout.total_bytes
        self.released = False

    def buffer(self) -> np.ndarray:
        """The whole version as a flat uint8 array (zero-copy)."""
        return np.frombuffer(self._mm, dtype=np.uint8, count=self.nbytes)

    def named_tensors(self) -> Iterator[tuple[str, Any]]:
        """(name, tensor) views into shared memory, without copies. Unless the puller was made
        with writable=True they are READ-ONLY: copy from them (engine.load_weights does);
        writing into one crashes the process (SIGSEGV) instead of corrupting the relay."""
        import torch

        for name, dtype, shape, off, nbytes in tensor_spans(self.layout):
            tdtype = getattr(torch, dtype)
            if nbytes == 0:
                yield name, torch.empty(shape, dtype=tdtype)
                continue
            with warnings.catch_warnings():  # read-only buffer: torch warns once; documented above
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=off)
            yield name, raw.view(tdtype).reshape(shape)

    def verify(self) -> bool:
        """Recompute the checksum from the bytes read (what a reader checks against tearing)."""
        return checksum_buffer(self.layout, self.chunk_bytes, self.buffer()) == self.checksum

    async def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self._puller is not None:
            await self._puller._release(self)

    async def __aenter__(self) -> PulledWeights:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()


class WeightPuller(_End):
    """Rollout side: follow WeightsReady of the local relay and pull versions on demand."""

    def __init__(
        self,
        links: RelayLinks,
        wiring: Wiring,
        *,
        relay_index: int = 0,
        writable: bool = False,
    ):
        super().__init__(links, wiring)
        self.relay_index, self.writable = relay_index, writable
        self._maps: dict[str, tuple[mmap.mmap, int, int]] = {}  # path -> (mapping, size, inode)
        self.latest_version = -1
        self.latest_checksum = ""
        self.latest_layout: WeightLayout | None = None
        self._cond = asyncio.Condition()
        self._sub_id = f"{wiring.node_id}.w{next(_ids)}"
        self.client: RpcClient | None = None
        self.sub: Subscriber | None = None
        self._task: asyncio.Task | None = None
        self._held: list[PulledWeights] = []

    async def start(self) -> None:
        links = self.links
        self.client = RpcClient(
            self.ctx,
            links.relay(self.relay_index),
            self.node_id,
            self.role,
            self.opts,
            spawn=self.spawn,
        )
        await self.client.connect(timeout=links.startup_timeout_s)
        self.sub = Subscriber(
            self.ctx,
            links.pub[self.relay_index],
            self._sub_id,
            ["weights"],
            self.opts,
        )
        self.sub.start()
        self._task = self.spawn(self._listen(), "weights-sub")
        # the relay answers once our subscription is live: nothing announced after this is missed
        reply = await self.client.request(
            LatestRequest(subscriber=self._sub_id), timeout=links.startup_timeout_s
        )
        if isinstance(reply, LatestReply):
            await self._update(reply.version, reply.checksum, None)

    async def _listen(self) -> None:
        assert self.sub is not None
        while True:
            _topic, msg = await self.sub.recv()
            if isinstance(msg, WeightsReady):
                await self._update(msg.version, msg.checksum, msg.layout)

    async def _update(self, version: int, checksum: str, layout: WeightLayout | None) -> None:
        async with self._cond:
            if version > self.latest_version:
                self.latest_version, self.latest_checksum = version, checksum
                self.latest_layout = layout or self.latest_layout
                self._cond.notify_all()

    async def wait_version(self, min_version: int, timeout: float) -> int:
        """Wait until the relay announced a version >= min_version; returns it (TimeoutError
        otherwise)."""
        async with self._cond:
            await asyncio.wait_for(
                self._cond.wait_for(lambda: self.latest_version >= min_version), timeout
            )
            return self.latest_version

    async def pull(self, version: int | None = None) -> PulledWeights:
        """Pin a version at the relay (newest when None) and map it; release it when done."""
        assert self.client is not None, "call start() first"
        try:
            reply = await self.client.request(
                PullRequest(version=-1 if version is None else version)
            )
        except RemoteError as exc:
            raise WeightsUnavailable(str(exc)) from None
        if not isinstance(reply, PullReply):
            raise WeightsUnavailable(f"unexpected reply {type(reply).__name__}")
        try:
            validate_layout(reply.layout)
            if reply.layout.total_bytes > reply.size:
                raise WeightsUnavailable("segment smaller than its layout")
            mm = self._map(reply.segment, reply.size)
        except Exception:
            with contextlib.suppress(TransportError):
                await self.client.request(ReleaseRequest(version=reply.version))
            raise
        w = PulledWeights(self, reply, mm)
        self._held.append(w)
        await self._update(reply.version, reply.checksum, reply.layout)
        return w

    def _map(self, path: str, size: int) -> mmap.mmap:
        for p in [p for p in self._maps if not os.path.exists(p)]:  # the relay freed that slot
            self._maps.pop(p)  # unmapped once no tensor view of it is left
        if self.writable:
            return map_segment(path, size, True)[0]
        hit = self._maps.get(path)
        if hit is not None and hit[1] == size and hit[2] == os.stat(path).st_ino:
            return hit[0]  # warm page tables: a pull costs what a memcpy does
        mm, inode = map_segment(path, size, False)
        self._maps[path] = (mm, size, inode)
        return mm

    async def _release(self, w: PulledWeights) -> None:
        with contextlib.suppress(ValueError):
            self._held.remove(w)
        if self.client is not None:
            with contextlib.suppress(TransportError):
                await self.client.request(ReleaseRequest(version=w.version), retries=0)

    async def close(self) -> None:
        for w in list(self._held):
            await w.release()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.sub is not None:
            self.sub.close()
        if self.client is not None:
            await self.client.close()
        self._maps.clear()
