"""A rollout's pull from its host's relay (the subscriber end of the relay mode, relay.py).

    puller = WeightPuller(links, wiring, relay_index=cfg.rollout.relay_index)
    await puller.start()                     # spawns its WeightsReady listener
    await puller.wait_version(v, timeout=30)
    async with await puller.pull() as w:     # pins the version at the relay
        for name, t in w.named_tensors():    # zero-copy views into /dev/shm
            param[name].copy_(t)

It takes explicit dependencies: RelayLinks (endpoints, timeouts), and the wiring (a zmq
context and SocketOptions, this end's node id, a logger and a supervised `spawn` for its
subscription listener).

Pull: PullRequest pins a version at the relay (released by `release()`, by
`close()`, or by the relay when this client dies) and names its segment. The puller
maps it read-only and shared, and keeps the mapping for the next pull of the same
slot (slots are reused), so tensors are zero-copy views whose page tables are
already warm: a rollout's load costs about one memcpy. The views are read-only (a
rollout copies them into its engine); `WeightPuller(..., writable=True)` maps each
pull privately (copy-on-write) instead, at the cost of page faults on first touch.

Layout and checksums: laminar/weights/layout.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import mmap
import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from laminar.protocol.relay import (
    LatestReply,
    LatestRequest,
    PullReply,
    PullRequest,
    ReleaseRequest,
    WeightLayout,
    WeightsReady,
)
from laminar.transport.client import RpcClient
from laminar.transport.sockets import RemoteError, TransportError, Wiring
from laminar.transport.streams import Subscriber
from laminar.weights.channel import RelayLinks, WeightsUnavailable
from laminar.weights.layout import checksum_buffer, tensor_spans, validate_layout
from laminar.weights.relay_end import RelayEnd
from laminar.weights.segment import map_segment

_ids = itertools.count()


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


class WeightPuller(RelayEnd):
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
