"""The partial pool's storage: one in-flight trajectory's tokens (Record) and one sender's
stream of flush windows (SenderStream), the fast path of the batch fold.

    rec = Record(header)                 # its tokens so far as byte pieces
    stream.join(rec)                     # its next tokens stay in the sender's windows
    stream.take_many([rec, ...])         # back into their own pieces (a query, an entry that
                                         # changes the record): one pass over the stream
    stream.merge()                       # the windows as one, finished records' entries dropped

laminar/buffer/partials.py (PartialPool) decides what an entry may do; this module only keeps
what it took. Tests: .venv/bin/python -m pytest tests/test_partial_batch.py -q
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np

from laminar.protocol.data import PartialTrajectory

__all__ = ["HELD_SLACK", "PIECES", "ROUTE_PIECES", "SEGS_MAX", "Record", "Segment", "SenderStream"]


ROUTE_PIECES = 32
"""A record's route pieces are joined into one array past this many (bounded per-record lists)."""
PIECES = 64
"""A record's token pieces are joined into one past this many (see Record)."""


@dataclass(slots=True)
class Record:
    """One in-flight trajectory: its header and its tokens so far, copied out of the received
    batches as byte pieces (the batch's frame is let go with the message; a record pins
    nothing). Pieces, not one growing buffer: with ~16k records each growing by an entry at a
    time, a bytearray's 12.5% growth reallocates and copies the whole record every few entries
    (1.5 us an entry against 0.6 us, in a microbenchmark of that shape); past PIECES pieces
    they are joined into one (a copy of the record per PIECES entries)."""

    header: PartialTrajectory
    ids: list[bytes] = field(default_factory=list)
    """int32 token ids, native byte order, in pieces (b"".join + np.frombuffer read them)."""
    lps: list[bytes] = field(default_factory=list)
    """float32 logprobs, in the same pieces."""
    length: int = 0
    awaiting_env: bool = False
    """Multi-turn: as the latest entry reaching the record's end said (the resumer runs the env
    step)."""
    mask: bytearray | None = None
    """uint8 loss mask, once some entry carried one (the record is multi-turn; the tokens before
    it are model tokens); None: all model tokens."""
    tv: bytearray | None = None
    """int32 token versions, once some entry carried them (mode partial: the trajectory spans
    versions; the tokens before them are at the record's version); None: all at its version."""
    routes: list[tuple[np.ndarray, int, int]] = field(default_factory=list)
    """MoE: route pieces (array, lo, hi), copied out of the batches: positions 0 .. routes_n of
    prompt + response."""
    routes_n: int = 0
    stream: SenderStream | None = None
    """The sender's stream that holds the record's newest tokens (its length, version and flag
    live there, `length` and `awaiting_env` here are as of joining); None: all of it is here."""

    def add_routes(
        self, counts: Counter[str], arr: np.ndarray, start: int, lo: int, hi: int
    ) -> None:
        """Routes arr[lo:hi] of positions start ..: appended where they continue the prefix."""
        if hi <= lo:
            return
        if start > self.routes_n:
            counts["route_gaps"] += 1
            return
        if self.routes and self.routes[0][0].shape[1:] != arr.shape[1:]:
            counts["bad_routes"] += 1
            return
        lo += self.routes_n - start
        if hi > lo:
            piece = arr[lo:hi].copy()  # the record pins no received batch
            self.routes.append((piece, 0, len(piece)))
            self.routes_n += len(piece)
            if len(self.routes) > ROUTE_PIECES:
                self.routes = [(self.route_array(), 0, self.routes_n)]

    def route_array(self) -> np.ndarray:
        rs = self.routes
        if len(rs) == 1 and rs[0][1] == 0 and rs[0][2] == len(rs[0][0]):
            return rs[0][0]
        return np.concatenate([a[lo:hi] for a, lo, hi in rs])

    def add(
        self,
        ids: memoryview,
        logprobs: memoryview,
        mask: memoryview | None,
        lo: int,
        hi: int,
        tv: memoryview | None = None,
    ) -> None:
        """Tokens [lo, hi) of 1-D memoryviews (int32 ids, float32 logprobs, uint8 mask, int32
        versions) appended."""
        if hi <= lo:
            return
        self.append(ids, logprobs, lo, hi)
        self.add_mask(None if mask is None else mask[lo:hi], hi - lo)
        if tv is not None:
            if self.tv is None:
                self.tv = bytearray(np.full(self.length, self.header.version, np.int32).tobytes())
            self.tv += tv[lo:hi]
        elif self.tv is not None:
            self.tv += np.full(hi - lo, self.header.version, np.int32).tobytes()
        self.length += hi - lo

    def add_mask(self, piece: bytes | memoryview | None, n: int) -> None:
        """The loss mask of the next n tokens (None: model tokens), before `length` counts them:
        a record keeps no mask until some entry carries one."""
        if piece is not None:
            if self.mask is None:  # the record's tokens so far were model tokens
                self.mask = bytearray(b"\x01" * self.length)
            self.mask += piece
        elif self.mask is not None:
            self.mask += b"\x01" * n

    def append(self, ids: memoryview, logprobs: memoryview, lo: int, hi: int) -> None:
        """Ids and logprobs [lo, hi) as the next pieces (the length is the caller's)."""
        pieces = self.ids
        pieces.append(ids[lo:hi].tobytes())
        self.lps.append(logprobs[lo:hi].tobytes())
        if len(pieces) > PIECES:
            self.ids, self.lps = [b"".join(pieces)], [b"".join(self.lps)]

    def materialize(self) -> PartialTrajectory:
        h = self.header
        ids = np.frombuffer(b"".join(self.ids), np.int32).copy()
        lps = np.frombuffer(b"".join(self.lps), np.float32).copy()
        mask = None if self.mask is None else np.frombuffer(self.mask, np.uint8).copy()
        tv = None if self.tv is None else np.frombuffer(self.tv, np.int32).copy()
        if tv is not None and not (tv != h.version).any():
            tv = None  # one version after all (a batch's column covers every entry)
        routes = None
        if self.routes_n:  # a fresh array (lets go of the batches), cut to the tokens
            routes = self.route_array()[: len(h.prompt_ids) + len(ids)].copy()
            self.routes = [(routes, 0, len(routes))]
            self.routes_n = len(routes)
        return PartialTrajectory(
            uid=h.uid,
            group_id=h.group_id,
            prompt_uid=h.prompt_uid,
            sample_index=h.sample_index,
            prompt_ids=h.prompt_ids,
            response_ids=ids,
            logprobs=lps,
            version=h.version,
            n=h.n,
            prompt=h.prompt,
            row=h.row,
            rollout_id=h.rollout_id,
            resumed=h.resumed,
            t_start=h.t_start,
            loss_mask=mask,
            awaiting_env=self.awaiting_env,
            token_versions=tv,
            agent_token=h.agent_token,
            image_digests=h.image_digests,
            routes=routes,
        )


@dataclass(slots=True)
class Segment:
    """A stretch of one sender's stream: a flush window's token columns as received (or several
    windows merged), and per entry the stream slot that took it (-1: folded some other way)."""

    ids: bytes
    """int32 token ids, native byte order."""
    lps: bytes
    """float32 logprobs."""
    mask: bytes | None
    """uint8 loss mask (None: the entries carried none)."""
    slots: list[int] | np.ndarray
    """Per entry, its slot (a list while its batch is being folded)."""
    starts: list[int]
    """Per entry, the index of its first token in ids."""
    lens: list[int]
    masked: np.ndarray | None = None
    """Merged stretches only: which entries carried a mask (mask holds ones for the others)."""


class SenderStream:
    """One sender's records on the fast path: the batch fold checks an entry against its slot
    and appends the window's columns once, instead of copying every entry into its record."""

    __slots__ = ("live", "segs", "next_sid", "held", "tokens")

    def __init__(self) -> None:
        self.live: dict[str, list[Any]] = {}
        """uid -> [slot, length, version, group_id, awaiting_env, length when it joined] of each
        record in the stream."""
        self.segs: list[Segment] = []
        """The stream's stretches in arrival order."""
        self.next_sid = 0
        """Slots are never reused: an entry's slot names one record's stay in the stream."""
        self.held = 0
        """Tokens the stretches hold (of records in the stream, gone, or folded the other way)."""
        self.tokens = 0
        """Tokens of records in the stream held here."""

    def join(self, rec: Record) -> None:
        h = rec.header
        n = rec.length
        self.live[h.uid] = [self.next_sid, n, h.version, h.group_id, rec.awaiting_env, n]
        self.next_sid += 1
        rec.stream = self

    def needs_merge(self) -> bool:
        """Past the bound on stretches, or holding more than twice what its records need."""
        return len(self.segs) > SEGS_MAX or self.held > 2 * self.tokens + HELD_SLACK

    def take(self, rec: Record) -> None:
        """The record leaves the stream: its tokens here become its own pieces."""
        self.take_many([rec])

    def take_many(self, recs: list[Record]) -> None:
        """Records leave the stream (a dead rollout's: recovered) in one pass over its stretches."""
        by_sid: dict[int, tuple[Record, list[bytes], list[bytes]]] = {}
        for rec in recs:
            ent = self.live.pop(rec.header.uid)
            rec.stream = None
            self.tokens -= ent[1] - ent[5]
            rec.awaiting_env = bool(ent[4])
            by_sid[ent[0]] = (rec, [], [])
        sids = np.fromiter(by_sid, np.int64, len(by_sid))
        for seg in self.segs:
            sl = seg.slots
            at = (
                [i for i, s in enumerate(sl) if s in by_sid]
                if isinstance(sl, list)
                else np.flatnonzero(np.isin(sl, sids)).tolist()
            )
            for i in at:
                rec, ids, lps = by_sid[int(sl[i])]
                lo, n = seg.starts[i], seg.lens[i]
                ids.append(seg.ids[lo * 4 : (lo + n) * 4])
                lps.append(seg.lps[lo * 4 : (lo + n) * 4])
                m = seg.mask
                carried = m is not None and (seg.masked is None or seg.masked[i])
                rec.add_mask(m[lo : lo + n] if m is not None and carried else None, n)
                rec.length += n
        for rec, ids, lps in by_sid.values():
            if ids:
                rec.ids.append(b"".join(ids))
                rec.lps.append(b"".join(lps))
                if len(rec.ids) > PIECES:
                    rec.ids, rec.lps = [b"".join(rec.ids)], [b"".join(rec.lps)]

    def drop(self, uid: str) -> None:
        """A record of the stream finished or restarted: its entries here are garbage (dropped
        by the next merge; the whole stream's when it holds no record, see PartialPool.remove)."""
        ent = self.live.pop(uid, None)
        if ent is not None:
            self.tokens -= ent[1] - ent[5]

    def release(self) -> None:
        """Between batches: a stream that holds no record lets go of its stretches."""
        if not self.live:
            self.segs.clear()
            self.held = self.tokens = 0

    def merge(self) -> None:
        """Every stretch as one, without the entries of records no longer in the stream (bounds
        the stretches a take scans and what finished records leave behind)."""
        old = self.segs
        live = np.fromiter((e[0] for e in self.live.values()), np.int64, len(self.live))
        slots = np.concatenate([np.asarray(g.slots, np.int64) for g in old])
        lens = np.concatenate([np.asarray(g.lens, np.int64) for g in old])
        base = list(accumulate((len(g.ids) // 4 for g in old), initial=0))
        starts = np.concatenate(
            [np.asarray(g.starts, np.int64) + b for g, b in zip(old, base, strict=False)]
        )
        keep = np.isin(slots, live) & (lens > 0)
        kl = lens[keep]
        ends = np.cumsum(kl)
        idx = np.repeat(starts[keep] - (ends - kl), kl) + np.arange(int(ends[-1]) if len(kl) else 0)
        ids = np.frombuffer(b"".join(g.ids for g in old), np.int32)[idx]
        lps = np.frombuffer(b"".join(g.lps for g in old), np.float32)[idx]
        mask = masked = None
        if any(g.mask is not None for g in old):
            mask = np.concatenate(
                [
                    np.ones(len(g.ids) // 4, np.uint8)
                    if g.mask is None
                    else np.frombuffer(g.mask, np.uint8)
                    for g in old
                ]
            )[idx].tobytes()
            masked = np.concatenate(
                [
                    np.full(len(g.lens), g.mask is not None) if g.masked is None else g.masked
                    for g in old
                ]
            )[keep]
        merged = Segment(
            ids.tobytes(),
            lps.tobytes(),
            mask,
            slots[keep],
            (ends - kl).tolist(),
            kl.tolist(),
            masked,
        )
        self.segs = [merged] if len(kl) else []
        self.held = self.tokens = len(ids)


SEGS_MAX = 256
"""A stream merges its stretches into one past this many (what a record's take scans at most)."""
HELD_SLACK = 1 << 14
"""A stream merges once it holds more than twice its records' tokens plus this many: finished
records' entries cost at most about as much memory as the records in flight, and each merge
copies about as many tokens as finished since the last (amortized: one copy per token)."""
