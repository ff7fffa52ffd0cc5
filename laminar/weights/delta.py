"""Sparse element deltas of one weight chunk: only the words whose bits changed travel.

Numpy only (relays never import torch). The relays use it (laminar/relay/): the master
encodes each chunk of a new version against its previous version, every hop forwards
the same encoded bytes, every receiver rebuilds the chunk on top of its own copy of the
base version and checks the master's crc32 of the *full* chunk.

    words = chunk_words(layout, chunk_bytes)           # word size per chunk (bytes: 1/2/4/8)
    blob = encode_delta(new, base, word)               # None: the full chunk is no larger
    k = apply_delta(out, base, blob)                   # out = base with the changed words set

"Changed" means bit-different: a chunk is compared as unsigned integers of the smallest
element size of the tensors it overlaps (bf16 as uint16, fp32 as uint32), so -0.0 vs
0.0 or two NaN payloads count as changes and the rebuilt chunk is bitwise the sender's.

A blob is a 12-byte header (encoding, word size, words in the chunk, changed words)
and then either the changed positions or a bitmask of all positions (one bit per word),
followed by the changed words' new values. Positions are uint16 offsets inside blocks of
65536 words, after one uint32 count per block (so a 4 MiB chunk pays 2 bytes per changed
position, not 4). The encoder picks whichever is smaller; when even that is not smaller
than the chunk itself it returns None and the chunk goes whole.

Sizes with n words of w bytes, k of them changed, b = ⌈n/65536⌉ blocks:
    indices  12 + 4b + k·(2 + w)       bitmask  12 + ⌈n/8⌉ + k·w       full  n·w
so indices win below about k/n = 1/16 and the bitmask above it; at the ~2% of bf16 words
that change per RL step, a version costs ~4.5% of its size on each link.

Delta mode (relay.delta) between relays (the second half of this module):

    master (commit of v):  for each chunk i: crc32 of v[i], delta_i = encode(v[i], base[i])
                           (base = its previous complete version b, pinned while it encodes)
    downstream ──FetchChunk(v, i, base_version=b')──► upstream
    upstream:   b' == the base its deltas are against and delta_i exists
                    ──► WeightChunk(base_version=b, data=delta_i)   (indices or bitmask + values)
                otherwise ──► WeightChunk(data=the full chunk)      (the requester missed b)
    downstream: out = b[i] with the changed words set; check the master's crc32 of the full
                chunk; keep delta_i to forward it unchanged to its own downstream

The master encodes once; every hop forwards the same bytes. Checksums stay on the rebuilt
full version: a bad delta (or a base that is not what the sender thought) fails the crc32,
is counted, and the chunk is fetched again whole. A relay whose current version is not the
base (it missed a version, or just started) asks with base_version=-1 and gets full chunks.
Rollouts always read the full rebuilt version from their relay's shared memory.
"""

from __future__ import annotations

import struct

import numpy as np

from laminar.message import ProtocolError
from laminar.protocol.relay import WeightLayout
from laminar.weights.layout import ITEMSIZE, chunk_digest, chunk_range, n_chunks, tensor_spans
from laminar.weights.segment import VersionState

INDICES, BITMASK = 1, 2
HEADER = struct.Struct("<BBxxII")  # encoding, word bytes, words in chunk, changed words
WORD_DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}
MAX_WORD = 8
BLOCK_BITS = 16  # positions are uint16 inside blocks of 65536 words


def chunk_words(layout: WeightLayout, chunk_bytes: int) -> np.ndarray:
    """Word size per chunk: the smallest element size among the tensors it overlaps (capped
    at 8, lowered until it divides the chunk's start and end), 8 for pure padding."""
    total = layout.total_bytes
    n = n_chunks(total, chunk_bytes)
    words = np.full(n, MAX_WORD, dtype=np.uint8)
    for _name, dtype, _shape, off, nbytes in tensor_spans(layout):
        if nbytes == 0:
            continue
        lo, hi = off // chunk_bytes, (off + nbytes - 1) // chunk_bytes
        words[lo : hi + 1] = np.minimum(words[lo : hi + 1], min(ITEMSIZE[dtype], MAX_WORD))
    for i in range(n):
        start, end = chunk_range(i, chunk_bytes, total)
        w = int(words[i])
        while w > 1 and (start % w or end % w):
            w //= 2
        words[i] = w
    return words


def n_blocks(n_words: int) -> int:
    return max(1, -(-n_words >> BLOCK_BITS))


def encoded_sizes(n_words: int, changed: int, word: int) -> dict[int, int]:
    """Bytes of each encoding (INDICES, BITMASK) and of the full chunk (key 0)."""
    return {
        INDICES: HEADER.size + 4 * n_blocks(n_words) + changed * (2 + word),
        BITMASK: HEADER.size + -(-n_words // 8) + changed * word,
        0: n_words * word,
    }


def choose_encoding(n_words: int, changed: int, word: int) -> int:
    """INDICES, BITMASK, or 0 (send the full chunk): the smallest; ties go to the simpler."""
    sizes = encoded_sizes(n_words, changed, word)
    return min((0, INDICES, BITMASK), key=lambda e: sizes[e])


def _words(buf: np.ndarray | memoryview | bytes, word: int) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8).view(WORD_DTYPES[word])


def encode_delta(
    new: np.ndarray | memoryview, base: np.ndarray | memoryview, word: int
) -> np.ndarray | None:
    """The delta taking `base` to `new` (same length, a multiple of `word`), or None when the
    full chunk is no larger than any encoding."""
    if len(new) != len(base) or len(new) % word:
        raise ValueError(f"chunk of {len(new)} bytes vs base of {len(base)}, word {word}")
    a, b = _words(new, word), _words(base, word)
    diff = a != b
    n, k = len(a), int(np.count_nonzero(diff))
    enc = choose_encoding(n, k, word)
    if enc == 0:
        return None
    head = np.frombuffer(HEADER.pack(enc, word, n, k), dtype=np.uint8)
    idx = np.flatnonzero(diff)  # gathering by position is ~10x faster than by boolean mask
    vals = a[idx]
    if enc == INDICES:
        counts = np.bincount(idx >> BLOCK_BITS, minlength=n_blocks(n)).astype("<u4")
        low = (idx & ((1 << BLOCK_BITS) - 1)).astype("<u2")
        parts = [head, counts.view(np.uint8), low.view(np.uint8), vals.view(np.uint8)]
    else:
        parts = [head, np.packbits(diff, bitorder="little"), vals.view(np.uint8)]
    return np.concatenate(parts)


def delta_header(blob: np.ndarray | memoryview | bytes) -> tuple[int, int, int, int]:
    """(encoding, word, n_words, changed) of a blob; ProtocolError when it cannot be one."""
    if len(blob) < HEADER.size:
        raise ProtocolError(f"delta of {len(blob)} bytes is shorter than its header")
    enc, word, n, k = HEADER.unpack_from(
        np.frombuffer(blob, dtype=np.uint8)[: HEADER.size].tobytes()
    )
    if enc not in (INDICES, BITMASK) or word not in WORD_DTYPES or k > n:
        raise ProtocolError(f"bad delta header: encoding {enc}, word {word}, {k} of {n} changed")
    if len(blob) != encoded_sizes(n, k, word)[enc]:
        raise ProtocolError(
            f"delta of {len(blob)} bytes, header says {encoded_sizes(n, k, word)[enc]}"
        )
    return enc, word, n, k


def apply_delta(
    out: np.ndarray, base: np.ndarray | memoryview, blob: np.ndarray | memoryview | bytes
) -> int:
    """Write base + delta into `out` (a writable uint8 array of the chunk's length); returns
    the number of changed words. A malformed blob raises ProtocolError (out is then garbage:
    the caller's crc32 check rejects it anyway)."""
    enc, word, n, k = delta_header(blob)
    if n * word != len(out) or len(base) != len(out):
        raise ProtocolError(f"delta for {n}x{word} bytes, chunk has {len(out)}")
    out[:] = np.frombuffer(base, dtype=np.uint8)
    if k == 0:
        return 0
    body = np.frombuffer(blob, dtype=np.uint8)[HEADER.size :]
    dst = out.view(WORD_DTYPES[word])
    vals = body[len(body) - k * word :].view(WORD_DTYPES[word])
    if enc == INDICES:
        nb = n_blocks(n)
        counts = body[: 4 * nb].view("<u4")
        if int(counts.sum(dtype=np.int64)) != k:
            raise ProtocolError(f"delta block counts add up to {int(counts.sum())}, not {k}")
        low = body[4 * nb : 4 * nb + 2 * k].view("<u2")
        idx = np.repeat(np.arange(nb, dtype=np.int64) << BLOCK_BITS, counts) + low
        if int(idx.max()) >= n:
            raise ProtocolError(f"delta index {int(idx.max())} outside a chunk of {n} words")
        dst[idx] = vals
    else:
        mask = np.unpackbits(body[: -(-n // 8)], count=n, bitorder="little").view(bool)
        idx = np.flatnonzero(mask)  # on bool: ~8x faster than on the uint8 bits
        if len(idx) != k:
            raise ProtocolError(f"delta bitmask marks {len(idx)} words, not {k}")
        dst[idx] = vals
    return k


# ---- delta mode: a relay's versions, encoded against the previous one ------------------

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
