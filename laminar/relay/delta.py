"""Delta mode (relay.delta): a chunk equal to the requester's copy travels as a marker, not bytes.

    downstream ──FetchChunk(v, i, have_digest=digest of chunk i in its current version)──► upstream
    upstream: digest_v[i] == have_digest (64 bits) ──► WeightChunk(unchanged=True, data=b"")
    downstream: copies chunk i from its current version, checks the crc32, marks it present

The master computes a 64-bit digest per chunk in delta mode (crc32 | adler32 << 32) and
every hop forwards those digests, so "unchanged" is decided on the master's hashes of
both versions, never on 32 bits alone. It pays off only when whole chunks stay equal:
frozen layers, LoRA, embeddings of unseen tokens. A full fine-tuning step with Adam
changes every parameter, so every chunk differs and delta mode only adds the adler32
pass at the master (bench/weights.py measures both cases).
"""

from __future__ import annotations

from laminar.relay.shm import VersionState


def base_digest(
    enabled: bool, base: VersionState | None, incoming: VersionState, index: int, end: int
) -> int:
    """The digest to send with a fetch: chunk `index` of our current version, or -1 (no delta)."""
    if not enabled or base is None or base.chunk_bytes != incoming.chunk_bytes or index >= base.n:
        return -1
    if base.buf.size < end or not base.have[index]:
        return -1
    return int(base.digests[index])


def is_unchanged(enabled: bool, have_digest: int, digest: int) -> bool:
    """Upstream side: may chunk `digest` go as an 'unchanged' marker to a requester that has `have_digest`?"""
    return enabled and have_digest >= 0 and have_digest == digest and digest >> 32 != 0
