"""Acked delivery of finished trajectories from a rollout to the buffer.

    outbox = Outbox(buffer_client, log, concurrency=8, timeout_s=10, window_frac=0.02,
                    window_max_s=1.0)
    spawn(outbox.run(), "outbox")     # the node's supervised spawn
    outbox.put(trajectory)            # or TrajectoryAbandoned: anything with a .uid
    await outbox.flush(timeout=5.0)   # drain: True when everything was acked

Several at once (`window_frac` > 0): a finished trajectory waits up to window_frac of the mean
generation time of this rollout's recent trajectories (Trajectory.timings["gen_s"]; at most
`window_max_s`) for others, and whatever is ready by then goes as one Deliveries request (at
most MAX_ITEMS items, MAX_BYTES of arrays), each item acked on its own as if sent alone. The
buffer pays per message, so at 1024 GPUs this is what a trajectory costs it above its own
work (bench/control_plane.py); the wait it adds is a small fixed share of a trajectory's own
time, and none when the outbox is draining (flush). One collector gathers at a time, so a
window's samples share a message while up to `concurrency` messages are in flight. A sample
alone in its window goes as its own Trajectory / TrajectoryAbandoned. window_frac = 0: each goes
alone at once.

Each message is sent as a request and stays in the outbox until the buffer acks
it; a timeout, a dead or restarting buffer, or a transient error reply puts it
back after a doubling backoff (per sender, reset on success). Resending is safe
because the buffer deduplicates by uid and acks a duplicate as it acked the
original; the outbox also keys its entries by uid, so a message is in it at most
once. A buffer that rejects a message as malformed (code "protocol") will never
accept it: that one is logged, counted (`rejected`) and dropped instead of retried
forever. So is one the buffer acks as refused (TrajectoryAck.refused: a sample it never served
to this rollout, or a reward or token id out of the configured range): counted (`refused`),
logged, never resent. Order is not preserved and need not be: each trajectory stands alone.
A Deliveries the buffer rejects or that cannot be encoded as a whole (a malformed item:
ErrorReply "protocol"; an item past what the wire carries) is not dropped: each of its items
is sent alone next, so only the bad one meets the fate above. A transport failure puts all its
items back.

No group is left open by a sample that cannot be taken: a trajectory the buffer refuses as
never takeable from its owner (`ABANDON_ON`: reward or token ids out of range, too long, another
prompt than served), that it rejects as malformed, or that cannot even be encoded (an integer
past 64 bits, a lone surrogate: counted `unencodable`, logged, never sent) is followed by a
TrajectoryAbandoned for its uid (counted `abandoned`), so its group completes with it as a
failed member. A refusal that says the sample is not this rollout's (not_owner, not_served)
abandons nothing: its owner finishes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from laminar.message import Message
from laminar.protocol.buffer import (
    DELIVERIES_MAX_ITEMS,
    Deliveries,
    DeliveryAcks,
    Refusal,
    TrajectoryAbandoned,
    TrajectoryAck,
)
from laminar.protocol.data import Trajectory
from laminar.transport.client import RpcClient
from laminar.transport.sockets import RemoteError, TransportError

__all__ = ["Outbox"]

_PERMANENT = frozenset({"protocol"})
"""ErrorReply codes that mean "this message can never be accepted"."""

ABANDON_ON: frozenset[Refusal] = frozenset(
    {"reward_range", "token_range", "too_long", "prompt_mismatch"}
)
"""Refusals of a rollout's own sample: it will never be taken, so its member is abandoned."""

_UNENCODABLE = (TypeError, ValueError, OverflowError)
"""What encoding a message raises for a value the wire cannot carry (msgspec: OverflowError for
an integer past 64 bits, UnicodeEncodeError for a lone surrogate, TypeError for a foreign type)."""


MAX_ITEMS = 64
"""Samples one Deliveries carries at most (the buffer takes up to DELIVERIES_MAX_ITEMS)."""
MAX_BYTES = 16 << 20
"""Array bytes one Deliveries carries at most (under the buffer socket's message limit)."""
_GEN_S_WEIGHT = 1 / 32
"""Weight of the newest trajectory in the running mean of generation times (~the last 32)."""

assert MAX_ITEMS <= DELIVERIES_MAX_ITEMS


class Outbox:
    def __init__(
        self,
        client: RpcClient,
        log: structlog.typing.FilteringBoundLogger,
        concurrency: int = 8,
        timeout_s: float = 10.0,
        backoff_s: float = 0.05,
        backoff_max_s: float = 2.0,
        *,
        window_frac: float = 0.0,
        window_max_s: float = 1.0,
    ):
        self.client, self.log = client, log
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.window_frac, self.window_max_s = window_frac, window_max_s
        self.pending: dict[str, Message] = {}
        self._ready: asyncio.Queue[str] = asyncio.Queue()
        self._empty = asyncio.Event()
        self._empty.set()
        self._hurry = asyncio.Event()
        """Set while flushing: no sample waits for a window."""
        self._collecting = asyncio.Lock()
        """One collector at a time, so a window's samples share one message."""
        self._put_at: dict[str, float] = {}
        """uid -> when it was put (its window counts from then)."""
        self._alone: set[str] = set()
        """Samples whose Deliveries failed as a whole: each is sent alone next."""
        self.gen_s_mean: float | None = None
        """Running mean of the generation time of the trajectories put (None before the first)."""
        self.stats: dict[str, int] = dict(
            put=0,
            acked=0,
            retries=0,
            rejected=0,
            refused=0,
            duplicates_put=0,
            unencodable=0,
            abandoned=0,
            messages=0,
            split=0,
        )
        self.oldest_since: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def oldest_age_s(self) -> float:
        """How long the oldest unacked message has waited, since its trajectory finished (0 when
        empty): a buffer outage shows here."""
        return time.monotonic() - min(self.oldest_since.values()) if self.oldest_since else 0.0

    def put(self, msg: Message) -> None:
        uid = msg.uid  # type: ignore[attr-defined]
        if uid in self.pending:
            self.stats["duplicates_put"] += 1
            return
        now = time.monotonic()
        self.pending[uid] = msg
        self.oldest_since[uid] = self._put_at[uid] = now
        self.stats["put"] += 1
        if isinstance(msg, Trajectory):
            gen_s = msg.timings.get("gen_s")
            if isinstance(gen_s, int | float) and gen_s >= 0:
                mean = self.gen_s_mean
                self.gen_s_mean = (
                    float(gen_s) if mean is None else mean + _GEN_S_WEIGHT * (gen_s - mean)
                )
        self._empty.clear()
        self._ready.put_nowait(uid)

    def backdate(self, uid: str, since: float) -> None:
        """Count the wait of `uid`'s message (oldest_age_s) from `since` (time.monotonic()),
        when its trajectory finished: its reward's time included."""
        if uid in self.oldest_since:
            self.oldest_since[uid] = min(self.oldest_since[uid], since)

    async def run(self) -> None:
        """The senders; run under the node's supervision (they only end by cancellation)."""
        await asyncio.gather(*(self._sender() for _ in range(self.concurrency)))

    def window_s(self) -> float:
        """How long a sample waits for others to share its message (0: it goes at once)."""
        if self.window_frac <= 0 or self.gen_s_mean is None:
            return 0.0
        return min(self.window_max_s, self.window_frac * self.gen_s_mean)

    async def _sender(self) -> None:
        backoff = self.backoff_s
        while True:
            async with self._collecting:
                uids = await self._collect()
            if len(uids) > 1:
                backoff = await self._send_many(uids, backoff)
            elif uids:
                backoff = await self._send_one(uids[0], backoff)

    async def _collect(self) -> list[str]:
        """The next ready sample and, with a window, whatever else is ready when it closes."""
        uid = await self._ready.get()
        if uid not in self.pending:
            return []
        if self.window_frac <= 0 or uid in self._alone:
            return [uid]
        wait = self._put_at.get(uid, 0.0) + self.window_s() - time.monotonic()
        if wait > 0 and not self._hurry.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._hurry.wait(), wait)
        uids, seen, later = [uid], {uid}, []
        size = _nbytes(self.pending[uid])
        while len(uids) < MAX_ITEMS and not self._ready.empty():
            nxt = self._ready.get_nowait()
            msg = self.pending.get(nxt)
            if msg is None or nxt in seen:
                continue
            seen.add(nxt)
            if nxt in self._alone or size + _nbytes(msg) > MAX_BYTES:
                later.append(nxt)
                continue
            size += _nbytes(msg)
            uids.append(nxt)
        for nxt in later:  # the next collector takes them
            self._ready.put_nowait(nxt)
        return uids

    async def _send_one(self, uid: str, backoff: float) -> float:
        msg = self.pending.get(uid)
        if msg is None:
            return backoff
        self.stats["messages"] += 1
        try:
            reply = await self.client.request(msg, timeout=self.timeout_s, retries=0)
        except _UNENCODABLE as exc:  # it can never be sent: dropped, never the sender
            self.stats["unencodable"] += 1
            self.log.error("outbox_unencodable", uid=uid, error=f"{type(exc).__name__}: {exc}")
            self._done(uid)
            self._abandon(msg, "unencodable")
            return backoff
        except RemoteError as exc:
            if exc.code in _PERMANENT:
                self._settle(uid, msg, TrajectoryAck(rejected=str(exc)))
                return backoff
            return await self._retry([uid], backoff, str(exc))
        except TransportError as exc:  # timeout, buffer dead or restarting, not connected
            return await self._retry([uid], backoff, str(exc))
        self._settle(uid, msg, reply if isinstance(reply, TrajectoryAck) else TrajectoryAck())
        return self.backoff_s

    async def _send_many(self, uids: list[str], backoff: float) -> float:
        msgs = {uid: self.pending[uid] for uid in uids if uid in self.pending}
        trajs = [m for m in msgs.values() if isinstance(m, Trajectory)]
        abandons = [m for m in msgs.values() if not isinstance(m, Trajectory)]
        order = [m.uid for m in trajs] + [m.uid for m in abandons]  # type: ignore[attr-defined]
        self.stats["messages"] += 1
        why = ""
        try:
            reply = await self.client.request(
                Deliveries(trajectories=trajs, abandoned=abandons),  # type: ignore[arg-type]
                timeout=self.timeout_s,
                retries=0,
            )
        except _UNENCODABLE as exc:
            why = f"{type(exc).__name__}: {exc}"
        except RemoteError as exc:
            if exc.code not in _PERMANENT:
                return await self._retry(order, backoff, str(exc))
            why = str(exc)
        except TransportError as exc:
            return await self._retry(order, backoff, str(exc))
        else:
            if isinstance(reply, DeliveryAcks) and len(reply.acks) == len(order):
                for uid, ack in zip(order, reply.acks, strict=True):
                    self._settle(uid, msgs[uid], ack)
                return self.backoff_s
            why = f"a {type(reply).__name__} of {len(getattr(reply, 'acks', []))} for {len(order)}"
        # the message as a whole could not be taken: each item alone, so only a bad one fails
        self.stats["split"] += 1
        self.log.warning("outbox_split", items=len(order), error=why)
        self._alone.update(order)
        for uid in order:
            self._ready.put_nowait(uid)
        return backoff

    def _settle(self, uid: str, msg: Message, ack: TrajectoryAck) -> None:
        """The buffer's answer for one sample: acked, refused or rejected, never sent again."""
        self._done(uid)
        if ack.rejected:
            self.stats["rejected"] += 1
            self.log.error("trajectory_rejected", uid=uid, error=ack.rejected)
            self._abandon(msg, "rejected")
            return
        if ack.refused:
            self.stats["refused"] += 1
            self.log.error("trajectory_refused", uid=uid, reason=ack.refused)
            if ack.refused in ABANDON_ON:
                self._abandon(msg, f"refused_{ack.refused}")
            return
        self.stats["acked"] += 1

    def _abandon(self, msg: Message, reason: str) -> None:
        """A trajectory that will never be taken: its member is abandoned, so its group
        completes (nothing else that cannot be sent is followed up)."""
        if isinstance(msg, Trajectory):
            self.stats["abandoned"] += 1
            self.put(TrajectoryAbandoned(uid=msg.uid, group_id=msg.group_id, reason=reason))

    async def _retry(self, uids: list[str], backoff: float, why: str) -> float:
        self.stats["retries"] += 1
        if self.stats["retries"] % 50 == 1:
            self.log.warning("outbox_retry", uid=uids[0], pending=len(self.pending), error=why)
        await asyncio.sleep(backoff)  # retry backoff while the buffer is away
        for uid in uids:
            self._ready.put_nowait(uid)
        return min(backoff * 2, self.backoff_max_s)

    def _done(self, uid: str) -> None:
        self.pending.pop(uid, None)
        self.oldest_since.pop(uid, None)
        self._put_at.pop(uid, None)
        self._alone.discard(uid)
        if not self.pending:
            self._empty.set()

    async def flush(self, timeout: float) -> bool:
        """Wait until every message was acked (or dropped as rejected), none waiting for a
        window meanwhile; False on timeout."""
        self._hurry.set()
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
        except TimeoutError:
            return False
        finally:
            self._hurry.clear()
        return True


def _nbytes(msg: Message) -> int:
    """A sample's array bytes (what dominates its size on the wire)."""
    if not isinstance(msg, Trajectory):
        return 64
    return 512 + sum(
        a.nbytes
        for a in (msg.prompt_ids, msg.response_ids, msg.logprobs, msg.loss_mask)
        if a is not None
    )
