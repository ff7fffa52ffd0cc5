"""Acked delivery of finished trajectories from a rollout to the buffer.

    outbox = Outbox(buffer_client, log, concurrency=8, timeout_s=10)
    spawn(outbox.run(), "outbox")     # the node's supervised spawn
    outbox.put(trajectory)            # or TrajectoryAbandoned: anything with a .uid
    await outbox.flush(timeout=5.0)   # drain: True when everything was acked

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
import time

import structlog

from laminar.message import Message
from laminar.protocol.buffer import Refusal, TrajectoryAbandoned, TrajectoryAck
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


class Outbox:
    def __init__(
        self,
        client: RpcClient,
        log: structlog.typing.FilteringBoundLogger,
        concurrency: int = 8,
        timeout_s: float = 10.0,
        backoff_s: float = 0.05,
        backoff_max_s: float = 2.0,
    ):
        self.client, self.log = client, log
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.pending: dict[str, Message] = {}
        self._ready: asyncio.Queue[str] = asyncio.Queue()
        self._empty = asyncio.Event()
        self._empty.set()
        self.stats: dict[str, int] = dict(
            put=0,
            acked=0,
            retries=0,
            rejected=0,
            refused=0,
            duplicates_put=0,
            unencodable=0,
            abandoned=0,
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
        self.pending[uid] = msg
        self.oldest_since[uid] = time.monotonic()
        self.stats["put"] += 1
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

    async def _sender(self) -> None:
        backoff = self.backoff_s
        while True:
            uid = await self._ready.get()
            msg = self.pending.get(uid)
            if msg is None:
                continue
            try:
                reply = await self.client.request(msg, timeout=self.timeout_s, retries=0)
            except _UNENCODABLE as exc:  # it can never be sent: dropped, never the sender
                self.stats["unencodable"] += 1
                self.log.error("outbox_unencodable", uid=uid, error=f"{type(exc).__name__}: {exc}")
                self._done(uid)
                self._abandon(msg, "unencodable")
                continue
            except RemoteError as exc:
                if exc.code in _PERMANENT:
                    self.stats["rejected"] += 1
                    self.log.error("trajectory_rejected", uid=uid, error=str(exc))
                    self._done(uid)
                    self._abandon(msg, "rejected")
                    continue
                backoff = await self._retry(uid, backoff, str(exc))
                continue
            except TransportError as exc:  # timeout, buffer dead or restarting, not connected
                backoff = await self._retry(uid, backoff, str(exc))
                continue
            refused = reply.refused if isinstance(reply, TrajectoryAck) else ""
            if refused:
                self.stats["refused"] += 1
                self.log.error("trajectory_refused", uid=uid, reason=refused)
            else:
                self.stats["acked"] += 1
            self._done(uid)
            if refused in ABANDON_ON:
                self._abandon(msg, f"refused_{refused}")
            backoff = self.backoff_s

    def _abandon(self, msg: Message, reason: str) -> None:
        """A trajectory that will never be taken: its member is abandoned, so its group
        completes (nothing else that cannot be sent is followed up)."""
        if isinstance(msg, Trajectory):
            self.stats["abandoned"] += 1
            self.put(TrajectoryAbandoned(uid=msg.uid, group_id=msg.group_id, reason=reason))

    async def _retry(self, uid: str, backoff: float, why: str) -> float:
        self.stats["retries"] += 1
        if self.stats["retries"] % 50 == 1:
            self.log.warning("outbox_retry", uid=uid, pending=len(self.pending), error=why)
        await asyncio.sleep(backoff)  # retry backoff while the buffer is away
        self._ready.put_nowait(uid)
        return min(backoff * 2, self.backoff_max_s)

    def _done(self, uid: str) -> None:
        self.pending.pop(uid, None)
        self.oldest_since.pop(uid, None)
        if not self.pending:
            self._empty.set()

    async def flush(self, timeout: float) -> bool:
        """Wait until every message was acked (or dropped as rejected); False on timeout."""
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
        except TimeoutError:
            return False
        return True
