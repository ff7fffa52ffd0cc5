"""PUB/SUB with a READY barrier and PUSH/PULL streams (asyncio ZeroMQ), on sockets.py's basics.

    pub = Publisher(ctx, endpoint, node_id, opts, spawn=node.spawn); await pub.start()
    await pub.wait_for({"rollout-0"}, timeout=5)      # exact: no sleeping for slow joiners
    await pub.publish("weights", WeightsReady(...))
    sub = Subscriber(ctx, endpoint, "rollout-0", ["weights"]); sub.start()
    topic, msg = await sub.recv(timeout=5)
    push = PushStream(ctx, endpoint, opts=opts); await push.send(msg)   # bounded HWM: back-pressure
    msg = await PullStream(ctx, endpoint, bind=True).recv(timeout=5)

Malformed frames are counted in `stats` and skipped; they never stop a reader. The
publisher's subscription watcher is its one background task; it starts through `spawn`
(a node's supervised spawn), so its death stops the node loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection
from typing import Any

import zmq
import zmq.asyncio

from laminar.message import Message, ProtocolError
from laminar.supervise import Spawn, detached_spawn
from laminar.transport.codec import decode, encode
from laminar.transport.sockets import (
    RequestTimeout,
    SocketOptions,
    SocketStats,
    attach,
    send_within,
)

# ---- PUB/SUB with a READY barrier ------------------------------------------------------

_READY_PREFIX = b"\x00ready/"


class Publisher:
    """XPUB that knows which subscribers are attached: `await pub.wait_for({"rollout-0"})`.

    Each Subscriber also subscribes to `\\x00ready/<node_id>`; XPUB sees that
    subscription arrive, and from then on every message published reaches that
    subscriber. So the barrier is exact, with no sleeping for slow joiners.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        node_id: str,
        opts: SocketOptions | None = None,
        spawn: Spawn = detached_spawn,
        members: Callable[[], Collection[str]] | None = None,
    ):
        self.ctx, self.endpoint, self.node_id = ctx, endpoint, node_id
        self.opts = opts or SocketOptions()
        self.subscribers: set[str] = set()
        """Every `ready/<id>` subscription seen, members or not (`ready` filters)."""
        self._members = members
        self._changed = asyncio.Condition()
        self._spawn = spawn
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[Any] | None = None
        self.stats = SocketStats()

    async def start(self) -> None:
        sock = self.ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        sock.setsockopt(zmq.SNDHWM, self.opts.sndhwm)
        attach(sock, self.endpoint, True, self.opts)
        self._sock = sock
        self._task = self._spawn(self._watch(sock), "xpub-watch")

    @property
    def tasks(self) -> list[asyncio.Task[Any]]:
        return [self._task] if self._task else []

    async def _watch(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frame = await sock.recv()
            if len(frame) > 1 and frame[1:].startswith(_READY_PREFIX):
                sub_id = frame[1 + len(_READY_PREFIX) :].decode(errors="replace")
                async with self._changed:
                    if frame[0] == 1:
                        self.subscribers.add(sub_id)
                    else:
                        self.subscribers.discard(sub_id)
                    self._changed.notify_all()

    @property
    def ready(self) -> set[str]:
        """Attached subscribers that are members (`members()`: e.g. peers that said HELLO) by
        their id or its node part (`rollout-0.w3`: one of rollout-0's subscribers); a
        `ready/<id>` subscription from anyone else never satisfies the barrier."""
        if self._members is None:
            return set(self.subscribers)
        members = set(self._members())
        return {s for s in self.subscribers if s in members or s.partition(".")[0] in members}

    async def wait_for(self, node_ids: set[str] | int, timeout: float) -> None:
        """Block until these subscribers (or this many) are attached and members, or raise
        RequestTimeout."""

        def ok() -> bool:
            if isinstance(node_ids, int):
                return len(self.ready) >= node_ids
            return set(node_ids) <= self.ready

        deadline = asyncio.get_running_loop().time() + timeout
        recheck = self.opts.heartbeat_interval_s  # membership changes without notifying us
        async with self._changed:
            while not ok():
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise RequestTimeout(
                        f"subscribers {node_ids} not ready in {timeout}s "
                        f"(members ready: {sorted(self.ready)}, all: {sorted(self.subscribers)})"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(left, recheck))

    async def publish(self, topic: str, msg: Message) -> None:
        assert self._sock is not None
        await self._sock.send_multipart([topic.encode(), *encode(msg)], copy=False)
        self.stats.sent += 1

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


class Subscriber:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        node_id: str,
        topics: list[str],
        opts: SocketOptions | None = None,
    ):
        self.ctx, self.endpoint, self.node_id, self.topics = ctx, endpoint, node_id, topics
        self.opts = opts or SocketOptions()
        self.stats = SocketStats()
        self._sock: zmq.asyncio.Socket | None = None

    def start(self) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.opts.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.opts.limits.max_message_bytes)
        for t in self.topics:
            sock.setsockopt(zmq.SUBSCRIBE, t.encode())
        sock.setsockopt(zmq.SUBSCRIBE, _READY_PREFIX + self.node_id.encode())
        attach(sock, self.endpoint, False, self.opts)
        self._sock = sock

    async def recv(self, timeout: float | None = None) -> tuple[str, Message]:
        """Next valid message; malformed ones are counted and skipped."""
        assert self._sock is not None
        while True:
            frames = await asyncio.wait_for(self._sock.recv_multipart(copy=False), timeout)
            if len(frames) < 3:
                self.stats.bad_frames += 1
                continue
            try:
                msg = decode(frames[1:], self.opts.limits)
            except ProtocolError as exc:
                self.stats.bad_frames += 1
                self.stats.last_error = str(exc)
                continue
            self.stats.received += 1
            return frames[0].bytes.decode(errors="replace"), msg

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


# ---- PUSH/PULL streams -------------------------------------------------------------


class PushStream:
    """PUSH with a bounded high-water mark: send() waits when the peer is slow (back-pressure)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        bind: bool = False,
        opts: SocketOptions | None = None,
    ):
        self.opts = opts or SocketOptions()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.opts.sndhwm)
        attach(sock, endpoint, bind, self.opts)
        self._sock = sock
        self.stats = SocketStats()

    async def send(self, msg: Message, timeout: float | None = None) -> None:
        """Queue one message; waits while the HWM is full, raising TimeoutError (SendTimeout) after
        `timeout`."""
        await send_within(self._sock, encode(msg), timeout)
        self.stats.sent += 1

    def close(self) -> None:
        self._sock.close(linger=0)


class PullStream:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        bind: bool = True,
        opts: SocketOptions | None = None,
    ):
        self.opts = opts or SocketOptions()
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.opts.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.opts.limits.max_message_bytes)
        attach(sock, endpoint, bind, self.opts)
        self._sock = sock
        self.stats = SocketStats()

    async def recv(self, timeout: float | None = None) -> Message:
        """Next valid message; malformed ones are counted and skipped."""
        while True:
            fut: asyncio.Future[list[zmq.Frame]] = self._sock.recv_multipart(copy=False)  # type: ignore[assignment]
            # a message already queued resolves at once: skip wait_for's timer bookkeeping
            frames = fut.result() if fut.done() else await asyncio.wait_for(fut, timeout)
            try:
                msg = decode(frames, self.opts.limits)
            except ProtocolError as exc:
                self.stats.bad_frames += 1
                self.stats.last_error = str(exc)
                continue
            self.stats.received += 1
            return msg

    def close(self) -> None:
        self._sock.close(linger=0)
