"""Delta mode (relay.delta): only the elements that changed since the last version travel.

    master (commit of v):   for each chunk i: crc32 of v[i], delta_i = encode(v[i], base[i])
                            (base = its previous complete version b, pinned while it encodes)
    downstream ──FetchChunk(v, i, base_version=b')──► upstream
    upstream:   b' == the base its deltas are against and delta_i exists
                    ──► WeightChunk(base_version=b, data=delta_i)       (indices or bitmask + values)
                otherwise ──► WeightChunk(data=the full chunk)          (the requester missed b)
    downstream: out = b[i] with the changed words set; check the master's crc32 of the full
                chunk; keep delta_i to forward it unchanged to its own downstream

The master encodes once; every hop forwards the same bytes, so a version whose elements
are 98% bit-identical costs each link a few percent of its size (the encoding choice and
the sizes: laminar/transport/weights_delta.py). Checksums stay on the rebuilt full
version: a bad delta (or a base that is not what the sender thought) fails the crc32,
is counted, and the chunk is fetched again whole. A relay whose current version is not
the base (it missed a version, or just started) asks with base_version=-1 and gets full
chunks. Rollouts always read the full rebuilt version from their relay's shared memory.
"""

from __future__ import annotations

import numpy as np

from laminar.relay.shm import VersionState
from laminar.transport.weight_layout import chunk_digest, chunk_range
from laminar.transport.weights_delta import chunk_words, encode_delta

MAX_DELTA_FRAC = 0.5
"""A delta larger than this fraction of its chunk is not kept: the chunk goes whole. Kept deltas
live in the relay's heap next to the version, so this bounds that memory to half a model
size per version, and a delta this dense saves little on the wire."""

DELTA_PIN = "_delta"
"""The pin owner that keeps a base version alive while a version is encoded or rebuilt on it."""


def delta_base(enabled: bool, base: VersionState | None, incoming: VersionState) -> int:
    """The version to rebuild `incoming` on: our newest complete one, if it has the same
    layout and chunking and is older; -1 when there is none (ask for full chunks)."""
    if (
        not enabled
        or base is None
        or not base.complete
        or base.abandoned
        or base.version >= incoming.version
        or base.chunk_bytes != incoming.chunk_bytes
        or base.layout != incoming.layout
    ):
        return -1
    return base.version


def digest_and_encode(
    vs: VersionState, base: VersionState | None, words: np.ndarray | None, lo: int, hi: int
) -> list[tuple[int, np.ndarray | None]]:
    """(crc32, delta against base or None) of chunks [lo, hi) of a version the trainer handed
    off (runs in a thread; numpy releases the GIL for the compares)."""
    total, cb = vs.layout.total_bytes, vs.chunk_bytes
    out = []
    for i in range(lo, hi):
        s, e = chunk_range(i, cb, total)
        data = vs.buf[s:e]
        blob = None
        if base is not None and words is not None:
            blob = encode_delta(data, base.buf[s:e], int(words[i]))
            if blob is not None and len(blob) > MAX_DELTA_FRAC * (e - s):
                blob = None
        out.append((chunk_digest(data), blob))
    return out


def words_for(vs: VersionState) -> np.ndarray:
    return chunk_words(vs.layout, vs.chunk_bytes)
