"""Partial-response pool: the tokens of every in-flight trajectory, so a dead rollout loses nothing.

    pool = PartialPool()
    pool.apply_batch(batch)                # PartialBatch from a rollout: one flush window (one-way)
    pool.apply(chunk)                      # PartialChunk: one entry (older rollouts, tests)
    pool.remove(uid)                       # the trajectory finished (or was abandoned)
    pool.query(rollout_id="rollout-3")     # PartialTrajectory of each trajectory it last reported

Contract with the rollouts (laminar.rollout.tracking): a trajectory's entries (a PartialChunk,
or one entry of a PartialBatch) cover the response in order, entry.offset is the index of its
first token, and the entry at offset 0 carries a header (a PartialTrajectory with prompt,
version, owner...). A header always (re)starts the record: a resumed trajectory or a rollout
whose buffer connection came back sends one again. The pool keeps a contiguous prefix:
  * offset == length: appended;
  * offset < length: the overlapping part is ignored (a resend), the rest appended;
  * offset > length: a gap (a lost entry) - counted, ignored until a header restarts it;
  * unknown uid without a header, or a version that differs from the record: counted, ignored.
The entries of one batch fold in entry order, exactly as that many chunks would.
From the network (`sender`, the authenticated peer; the pool built with Owners): a header is
taken only for a sample the sender may send (laminar/buffer/owners.py: its group's holder, or
the rollout the manager placed it on) with the prompt its group was served with (agent runs: the
group's row, the tokens its agent's first call rendered, at most max_prompt_tokens), and the
record is then the sender's alone; an entry for another rollout's record, a record longer than
max_response_tokens, a token id outside the vocabulary or a batch of more than max_entries is
refused (counted per peer by the node).
The pool lives in memory only: after a buffer restart it fills again from headers.

Cost (bench/control_plane.py): the buffer pays per message, so rollouts batch a flush window
per message. From an authenticated sender, a batch folds on that sender's stream: each record of
the sender's sits in a slot (its length, version, flag), an entry that continues its record at
its version is checked against the slot and nothing else, and the window's token columns are
kept once for all of its entries (no copy per entry; ~2x less fold CPU per batch in the buffer,
bench/README.md). Every other entry (a header, a gap, a resend, another sender's record, token
versions, routes) takes the per-entry path. For a record on the sender's stream a gap, a
duplicate, another version or an overlapping resend is decided from its slot (an overlap's new
tail stays in the window's columns); only an entry that must change the record itself (another
sender's, where owners are not checked; routes) takes its tokens out of the stream into its own
byte pieces, so no peer can make the buffer scan a stream per entry. A query (recovery, a repack
export) takes the records it reads out the same way, one pass over a stream for all of them. A
stream merges its stretches into one when they hold more than twice what its records need (a
finished record's entries are garbage until then) or past SEGS_MAX stretches. A record pins no
received frame either way: the columns are copied out of the message once per window. The
records and streams themselves live in laminar/buffer/partial_records.py.

Mode partial: a trajectory may span versions. Entries still carry the trajectory's version (its
oldest token's, checked against the record's) and, beside the tokens, the version that sampled
each one (`token_versions`, kept like the mask; a recovered record carries it, None when no
entry had one).

Multi-turn trajectories send each entry's slice of the loss mask (1 = model token,
0 = environment token). The pool keeps it next to the tokens; an entry without one is
all model tokens. A recovered record carries the mask, or None when no entry had one
(single-turn records stay exactly as they were). A mask whose length differs from its
tokens (chunk, batch or header), or with a value other than 0/1, makes the message bad input.

MoE policies (routes recorded, docs/moe.md): entries also carry the routes recorded since the
last one, by position of prompt + response (route_starts / route_lengths beside the tokens'
offsets / lengths). The record keeps a contiguous prefix of routes by the same rules as its
tokens, apart from them (routes lag the tokens by one position): a route entry at the record's
route end is appended, an overlap trimmed, a gap counted (`route_gaps`) and ignored until a
header restarts the record. Routes come only with an entry the record takes (appended or a
resend), never with a refused one. A recovered record carries them, cut to its tokens (None
when no entry had any), so the resumer keeps the routes its tokens were sampled with. Built
with the policy's MoeShape, the pool checks every batch's routes against it (layers, k, ids <
experts): routes that do not fit are dropped (refusal `bad_routes`, counted per peer), the
tokens kept.

Who holds a sample by these records (the manager's recovery and reconciliation questions):
laminar/buffer/holders.py.
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate

import numpy as np

from laminar.buffer.owners import Owners, ids_out_of_range
from laminar.buffer.partial_records import PIECES, Record, Segment, SenderStream
from laminar.models.moe import MoeShape
from laminar.protocol.data import PartialBatch, PartialChunk, PartialTrajectory

__all__ = ["PartialPool"]

_EMPTY_I = np.zeros(0, np.int32)
_EMPTY_F = np.zeros(0, np.float32)


def _i32(a: np.ndarray) -> np.ndarray:
    """`a` as contiguous int32 (what the wire carries already: no copy then)."""
    return a if a.dtype == np.int32 and a.flags.c_contiguous else np.ascontiguousarray(a, np.int32)


def _f32(a: np.ndarray) -> np.ndarray:
    return (
        a if a.dtype == np.float32 and a.flags.c_contiguous else np.ascontiguousarray(a, np.float32)
    )


def _u8(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.uint8 and a.flags.c_contiguous else np.ascontiguousarray(a, np.uint8)


def _bad_mask(mask: np.ndarray | None, n: int) -> bool:
    return mask is not None and (len(mask) != n or (n > 0 and int(mask.max()) > 1))


def _batch_problem(b: PartialBatch) -> str:
    """Why the batch is malformed as a whole ("" when it is not); checked before any entry folds."""
    k = len(b.uids)
    if not (len(b.versions) == len(b.offsets) == len(b.lengths) == len(b.awaiting_env) == k):
        return "columns of different lengths"
    if k and (int(b.lengths.min()) < 0 or int(b.offsets.min()) < 0):
        return "negative offset or length"
    n = len(b.token_ids)
    if len(b.logprobs) != n or int(b.lengths.sum()) != n:
        return "token arrays do not match the lengths"
    if _bad_mask(b.loss_mask, n):
        return "bad loss mask"
    if b.token_versions is not None and len(b.token_versions) != n:
        return "token_versions do not match the tokens"
    if b.routes is not None or b.route_starts is not None or b.route_lengths is not None:
        rs, rl = b.route_starts, b.route_lengths
        if b.routes is None or rs is None or rl is None or len(rs) != k or len(rl) != k:
            return "route columns do not match the entries"
        if k and (int(rs.min()) < 0 or int(rl.min()) < 0):
            return "negative route start or length"
        if int(rl.sum()) != len(b.routes):
            return "routes do not match their lengths"
    at = b.header_at
    if at is None:
        return "headers without header_at" if b.headers else ""
    if len(at) != len(b.headers):
        return "header_at does not match headers"
    if len(at) and (
        int(at.min()) < 0 or int(at.max()) >= k or (len(at) > 1 and int(np.diff(at).min()) <= 0)
    ):
        return "header_at out of range or not increasing"
    for j, h in zip(at.tolist(), b.headers, strict=True):
        if (
            h.uid != b.uids[j]
            or h.version != int(b.versions[j])
            or len(h.response_ids) != len(h.logprobs)
        ):
            return f"header {h.uid!r} does not match its entry"
        if _bad_mask(h.loss_mask, len(h.response_ids)):
            return "bad loss mask"
        if _bad_versions(h):
            return f"header {h.uid!r} has bad token_versions"
        if h.routes is not None and len(h.routes) > len(h.prompt_ids) + len(h.response_ids):
            return f"header {h.uid!r} has routes past its tokens"
    return ""


def _bad_versions(h: PartialTrajectory) -> bool:
    tv = h.token_versions
    return tv is not None and (
        len(tv) != len(h.response_ids) or (len(tv) > 0 and int(tv.min()) < h.version)
    )


def _views(
    ids: np.ndarray, lps: np.ndarray, mask: np.ndarray | None, tv: np.ndarray | None
) -> tuple[memoryview, memoryview, memoryview | None, memoryview | None]:
    """Memoryviews of a message's token columns in the record's types: slicing one costs a tenth
    of slicing an array, and a bytearray appends it without a temporary."""
    return (
        memoryview(_i32(ids).data),
        memoryview(_f32(lps).data),
        None if mask is None else memoryview(_u8(mask).data),
        None if tv is None else memoryview(_i32(tv).data),
    )


REFUSED = frozenset(
    {
        "not_owner",
        "not_served",
        "prompt_mismatch",
        "token_range",
        "too_long",
        "batch_too_big",
        "bad_routes",
    }
)
"""What apply/apply_batch answer for entries refused from their sender (counted per peer)."""


class PartialPool:
    def __init__(
        self,
        owners: Owners | None = None,
        *,
        vocab: int | None = None,
        max_response_tokens: int | None = None,
        max_prompt_tokens: int | None = None,
        max_entries: int | None = None,
        moe: MoeShape | None = None,
    ) -> None:
        self.records: dict[str, Record] = {}
        self.counts: Counter[str] = Counter()
        self.owners = owners
        """With owners, a sender (apply*'s `sender`) may start a record only for a sample it
        may send (laminar/buffer/owners.py) and add only to records it started."""
        self.vocab = vocab
        """Token ids must lie in [0, vocab) (None: not checked)."""
        self.max_response_tokens = max_response_tokens
        """No record grows past this many response tokens (None: not checked)."""
        self.max_prompt_tokens = max_prompt_tokens
        """No header's prompt is longer (agent runs; None: not checked)."""
        self.max_entries = max_entries
        """Entries one PartialBatch may carry (None: not checked)."""
        self.progressed: dict[str, None] = {}
        """The groups the last apply_batch made progress on (entries folded into records of the
        sender's), in order: the node renews their leases."""
        self.moe = moe
        """The policy's MoE shape: routes must fit it (None: dense, or not checked)."""
        self.streams: dict[str, SenderStream] = {}
        """Per authenticated sender, its records on the batch fold's fast path."""

    def _routes_refusal(self, routes: np.ndarray | None) -> bool:
        """Routes that do not fit the policy (their layers, k, expert ids)."""
        return (
            routes is not None
            and self.moe is not None
            and self.moe.check(routes, len(routes)) is not None
        )

    def _header_refusal(self, h: PartialTrajectory, sender: str) -> str:
        """Why `sender` may not (re)start the record of header `h` ("" when it may)."""
        if self.owners is None or not sender:
            return ""
        if h.uid != f"{h.group_id}/{h.sample_index}":
            return "not_owner"
        if h.group_id in self.owners.state.closed:
            return "late"  # its group was released meanwhile: nothing to keep (not a refusal)
        why = self.owners.refusal(h.group_id, h.sample_index, sender) or self.owners.prompt_refusal(
            h.group_id, h.prompt_uid, h.prompt_ids
        )
        if why is not None:
            return why
        if ids_out_of_range(h.prompt_ids, self.vocab) or ids_out_of_range(
            h.response_ids, self.vocab
        ):
            return "token_range"
        if self.max_response_tokens is not None and len(h.response_ids) > self.max_response_tokens:
            return "too_long"
        if self.max_prompt_tokens is not None and len(h.prompt_ids) > self.max_prompt_tokens:
            return "too_long"
        return ""

    def _entry_refusal(self, rec: Record | None, sender: str, offset: int, n: int) -> str:
        if not sender or rec is None:
            return ""
        if self.owners is not None and rec.header.rollout_id != sender:
            return "not_owner"
        if self.max_response_tokens is not None and offset + n > self.max_response_tokens:
            return "too_long"
        return ""

    def __len__(self) -> int:
        return len(self.records)

    @property
    def tokens(self) -> int:
        return sum(self.length(u) or 0 for u in self.records)

    def length(self, uid: str) -> int | None:
        """Response tokens the pool holds for uid (None: no record)."""
        rec = self.records.get(uid)
        if rec is None:
            return None
        return rec.length if rec.stream is None else rec.stream.live[uid][1]

    def _restart(self, h: PartialTrajectory, rollout_id: str, sender: str = "") -> None:
        """A (validated) header: a fresh record from it (its own tokens, if any, first)."""
        if sender:  # the authenticated sender owns the record, whatever the header says
            h.rollout_id = sender
        elif not h.rollout_id:
            h.rollout_id = rollout_id
        old = self.records.get(h.uid)
        if old is not None and old.stream is not None:
            old.stream.drop(h.uid)
            old.stream = None
        rec = Record(header=h)
        if len(h.response_ids):
            v_ids, v_lps, v_mask, v_tv = _views(
                h.response_ids, h.logprobs, h.loss_mask, h.token_versions
            )
            rec.add(v_ids, v_lps, v_mask, 0, len(h.response_ids), v_tv)
        if h.routes is not None and not self._routes_refusal(h.routes):
            rec.add_routes(self.counts, h.routes, 0, 0, len(h.routes))
        h.response_ids, h.logprobs, h.loss_mask, h.token_versions = _EMPTY_I, _EMPTY_F, None, None
        h.routes = None
        self.records[h.uid] = rec
        self.counts["headers"] += 1

    def _fold(
        self,
        uid: str,
        version: int,
        offset: int,
        ids: memoryview,
        lps: memoryview,
        mask: memoryview | None,
        lo: int,
        hi: int,
        awaiting: bool,
        rollout_id: str,
        tv: memoryview | None = None,
        route: tuple[np.ndarray, int, int, int] | None = None,
    ) -> str:
        """One entry (tokens ids[lo:hi], _views of the message's columns; `route`: its routes
        arr[lo:hi] of positions start .., as (arr, start, lo, hi)) into its record: the
        contiguous-prefix rules above."""
        rec = self.records.get(uid)
        if rec is None:
            self.counts["unknown"] += 1
            return "unknown"
        if rec.stream is not None and route is not None:
            rec.stream.take(rec)  # routes go to the record itself
        # a record on its sender's stream is read there: it is taken out only to append
        ent = None if rec.stream is None else rec.stream.live[uid]
        length = rec.length if ent is None else ent[1]
        if version != rec.header.version:
            self.counts["version_mismatch"] += 1
            return "bad"
        if offset > length:
            self.counts["gaps"] += 1
            return "gap"
        n = hi - lo
        skip = length - offset
        if offset + n >= length:  # the entry reaches the end: its flag holds
            if ent is None:
                rec.awaiting_env = awaiting
            else:
                ent[4] = awaiting
        if route is not None:  # a resend may still bring routes the record lacks
            rec.add_routes(self.counts, *route)
        if skip >= n:
            if n:
                self.counts["duplicates"] += 1
            return "duplicate"
        if skip:
            self.counts["overlaps"] += 1
        if rec.stream is not None:
            rec.stream.take(rec)
        rec.add(ids, lps, mask, lo + skip, hi, tv)
        if rollout_id and self.owners is None:
            rec.header.rollout_id = rollout_id
        self.counts["chunks"] += 1
        return "appended"

    def apply(self, c: PartialChunk, sender: str = "") -> str:
        """Fold one chunk in; returns what happened (appended | duplicate | gap | unknown | bad |
        late | a refusal in REFUSED). `sender`: the authenticated peer (checked against owners)."""
        n = len(c.token_ids)
        if n != len(c.logprobs) or c.offset < 0:
            self.counts["bad"] += 1
            return "bad"
        if sender and ids_out_of_range(c.token_ids, self.vocab):
            self.counts["refused"] += 1
            return "token_range"
        if _bad_mask(c.loss_mask, n):
            self.counts["bad_loss_mask"] += 1
            return "bad"
        if c.header is not None:
            h = c.header
            if h.uid != c.uid or len(h.response_ids) != len(h.logprobs) or h.version != c.version:
                self.counts["bad"] += 1
                return "bad"
            if _bad_mask(h.loss_mask, len(h.response_ids)):
                self.counts["bad_loss_mask"] += 1
                return "bad"
            if _bad_versions(h):
                self.counts["bad"] += 1
                return "bad"
            why = self._header_refusal(h, sender)
            if why:
                self.counts["refused" if why in REFUSED else why] += 1
                return why
            self._restart(h, c.rollout_id, sender)
        why = self._entry_refusal(self.records.get(c.uid), sender, c.offset, n)
        if why:
            self.counts["refused"] += 1
            return why
        routes, bad_routes = c.routes, self._routes_refusal(c.routes)
        if bad_routes:  # dropped; the tokens are still good
            self.counts["refused"] += 1
            routes = None
        res = self._fold(
            c.uid,
            c.version,
            c.offset,
            *_views(c.token_ids, c.logprobs, c.loss_mask, None)[:3],
            0,
            n,
            c.awaiting_env,
            c.rollout_id,
            route=None if routes is None else (routes, c.route_start, 0, len(routes)),
        )
        return "bad_routes" if bad_routes else res

    def apply_batch(self, b: PartialBatch, sender: str = "") -> Counter[str]:
        """Fold a rollout's flush window in, entry by entry in order (as that many chunks would);
        returns how many entries went each way other than appended (bad, batch_too_big,
        token_range: the whole batch). `sender`: the authenticated peer (checked against owners,
        and the size limits apply)."""
        progressed: dict[str, None] = {}
        self.progressed = progressed
        problem = _batch_problem(b)
        if problem:
            self.counts["bad_loss_mask" if problem == "bad loss mask" else "bad"] += 1
            return Counter(bad=1)
        if sender and self.max_entries is not None and len(b.uids) > self.max_entries:
            self.counts["refused"] += 1
            return Counter(batch_too_big=1)
        if sender and ids_out_of_range(b.token_ids, self.vocab):
            self.counts["refused"] += 1
            return Counter(token_range=1)
        # per entry, inline (the hot path): the record must be the sender's, and stay in length
        own = sender if sender and self.owners is not None else None
        longest = self.max_response_tokens if sender else None
        out: Counter[str] = Counter()
        routes = b.routes
        if self._routes_refusal(routes):  # dropped; the tokens are still good
            self.counts["refused"] += 1
            out["bad_routes"] += 1
            routes = None
        r_starts: list[int] = []
        r_lengths: list[int] = []
        if routes is not None and b.route_starts is not None and b.route_lengths is not None:
            r_starts, r_lengths = b.route_starts.tolist(), b.route_lengths.tolist()
        r_lo = 0
        rid = b.rollout_id
        ids, lps, mask, tvs = _views(b.token_ids, b.logprobs, b.loss_mask, b.token_versions)
        heads = (
            {} if b.header_at is None else dict(zip(b.header_at.tolist(), b.headers, strict=True))
        )
        records, plain = self.records, mask is None and tvs is None
        # without token versions (every mode but partial), the columns as bytes once: an entry's
        # piece is then one slice of them (a bytes object), not a memoryview slice and its tobytes
        inline = tvs is None
        idb = ids.tobytes() if inline else b""
        lpb = lps.tobytes() if inline else b""
        mkb = mask.tobytes() if inline and mask is not None else b""
        appended, lo = 0, 0
        # bounds as plain ints (no None checks per entry): any owner matches when not checked
        longest_n = longest if longest is not None else 1 << 62
        lens = b.lengths.tolist()
        # the sender's stream (the fast path): its records' entries are checked against their slots
        # and the window's columns appended once. Not for token versions or routes (per entry),
        # nor for a sender that claims another rollout's name (without owners the claim moves the
        # record: the per-entry path does that)
        stream = None
        if sender and inline and routes is None and (own is not None or rid == sender):
            stream = self.streams.get(sender)
            if stream is None:
                stream = self.streams[sender] = SenderStream()
            live = stream.live
            slots: list[int] = []
            seg = Segment(idb, lpb, mkb if mask is not None else None, slots, [], lens)
            seg.starts = list(accumulate(lens, initial=0))[:-1]
            stream.segs.append(seg)
        fast = fast_tokens = 0
        for i, (uid, ver, off, n, aw) in enumerate(
            zip(
                b.uids,
                b.versions.tolist(),
                b.offsets.tolist(),
                lens,
                b.awaiting_env.astype(bool).tolist(),
                strict=True,
            )
        ):
            hi = lo + n
            if stream is not None:
                ent = live.get(uid)
                if (
                    ent is not None
                    and off == ent[1]
                    and ver == ent[2]
                    and n
                    and off + n <= longest_n
                    and not (heads and i in heads)
                ):
                    # the hot path (~34,000 entries/s at 1x): the next tokens of a record of the
                    # sender's, at its version; the tokens stay in the window's columns
                    ent[1] = off + n
                    ent[4] = aw
                    slots.append(ent[0])
                    progressed[ent[3]] = None
                    fast += 1
                    fast_tokens += n
                    lo = hi
                    continue
                slots.append(-1)
            route = None
            if r_lengths:
                r_hi = r_lo + r_lengths[i]
                if r_hi > r_lo:
                    assert routes is not None
                    route = (routes, r_starts[i], r_lo, r_hi)
                r_lo = r_hi
            if heads and i in heads:
                why = self._header_refusal(heads[i], sender)
                if why:
                    out[why] += 1
                    lo = hi
                    continue
                self._restart(heads[i], rid, sender)
            rec = records.get(uid)
            if rec is None:
                res = self._fold(uid, ver, off, ids, lps, mask, lo, hi, aw, rid, tvs)
                out[res] += 1  # unknown: no record
                lo = hi
                continue
            h = rec.header
            if own is not None and h.rollout_id != own:
                out["not_owner"] += 1
            elif off + n > longest_n:
                out["too_long"] += 1
            elif (
                rec.stream is stream is not None
                and ver == h.version
                and off < (on := live[uid])[1] < off + n
            ):
                # a resend that overlaps the record's end, on the sender's stream: its new tail
                # stays there (the entry's span in the window shrinks to it), nothing is taken
                skip = on[1] - off
                seg.starts[i] += skip
                lens[i] = n - skip  # seg.lens
                on[1] = off + n
                on[4] = aw
                slots[-1] = on[0]
                self.counts["overlaps"] += 1
                progressed[on[3]] = None
                fast += 1
                fast_tokens += n - skip
            elif rec.stream is None and off == rec.length and ver == h.version and n:
                # the common case (the next tokens, same version): what _fold / add do, inline
                rec.awaiting_env = aw
                if inline and rec.tv is None:
                    pieces = rec.ids
                    pieces.append(idb[lo * 4 : hi * 4])
                    rec.lps.append(lpb[lo * 4 : hi * 4])
                    if len(pieces) > PIECES:
                        rec.ids, rec.lps = [b"".join(pieces)], [b"".join(rec.lps)]
                    if not plain or rec.mask is not None:
                        rec.add_mask(None if plain else mkb[lo:hi], n)
                    rec.length += n
                else:
                    rec.add(ids, lps, mask, lo, hi, tvs)
                if own is None and rid:
                    h.rollout_id = rid
                if route is not None:
                    rec.add_routes(self.counts, *route)
                progressed[h.group_id] = None
                appended += 1
            else:
                res = self._fold(uid, ver, off, ids, lps, mask, lo, hi, aw, rid, tvs, route)
                if res != "appended":
                    out[res] += 1
                if res in ("appended", "duplicate"):
                    progressed[uid.rpartition("/")[0]] = None
            if (
                stream is not None
                and rec.stream is None
                and h.rollout_id == sender
                and rec.tv is None
                and not rec.routes_n
                and records.get(uid) is rec
            ):
                stream.join(rec)  # its next entries take the fast path
            lo = hi
        if stream is not None:
            if fast:
                seg.slots = np.array(slots, np.int64)
                stream.held += len(idb) >> 2
                stream.tokens += fast_tokens
                if stream.needs_merge():
                    stream.merge()
            elif stream.segs and stream.segs[-1] is seg:
                stream.segs.pop()  # nothing of this window is held there
        appended += fast
        self.counts["chunks"] += appended
        self.counts["batches"] += 1
        return out

    def remove(self, uid: str) -> bool:
        rec = self.records.pop(uid, None)
        if rec is not None and rec.stream is not None:
            rec.stream.drop(uid)
            rec.stream.release()
        return rec is not None

    def query(self, rollout_id: str = "", uids: list[str] | None = None) -> list[PartialTrajectory]:
        """In-flight trajectories last reported by `rollout_id`, or those named by `uids`."""
        if uids:
            recs = [self.records[u] for u in uids if u in self.records]
        else:
            recs = [r for r in self.records.values() if r.header.rollout_id == rollout_id]
        held: dict[int, tuple[SenderStream, dict[int, Record]]] = {}
        for r in recs:  # a uid named twice is taken once
            if r.stream is not None:
                held.setdefault(id(r.stream), (r.stream, {}))[1][id(r)] = r
        for st, rs in held.values():
            st.take_many(list(rs.values()))  # one pass over each stream's stretches
            st.release()  # a dead rollout's stream: nothing is left to hold
        return [r.materialize() for r in recs]
