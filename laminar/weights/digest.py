"""Weights digest: one short hex string for a set of named tensors, computed where they live.

    d = weights_digest(model.state_dict().items())       # any device; CUDA tensors stay there
    d == weights_digest(exported.items())                # same bytes, same names -> same digest
    fold = tensor_fold(t)                                # (sum, weighted sum) of one tensor
    d == records_digest(fold_record(n, t) for n, t in items)   # folded elsewhere, hashed here

Attestation (docs/DESIGN.md, "Attested versions") compares the digest the trainer computes over
the tensors it exports with the digest a rollout computes over its engine's parameters after a
load; flat GPU buffers use it as their checksum too (laminar/weights/gpu.py), because it runs on
the device: no copy to the host, no single-threaded crc32 on the trainer's critical path.

How: every tensor's bytes are read as int16 words (a trailing odd byte as one more word) in
chunks of CHUNK_WORDS; each chunk, as rows of K words in float64, goes through one GEMV against
[1, w] (w: a fixed pseudo-random vector of K weights in 1..65521), giving per row the plain sum
and the position-weighted sum. Both are exact integers (a row's sums stay below 2^43, under
float64's 2^53; rows and chunks are added as int64 and Python ints), so the result is the same
on every device and in every reduction order. The plain sum changes with any change of a single
word; the weighted sum also catches swapped or shifted words (not swaps exactly K words apart).
The per-tensor pairs, with the names, dtypes and shapes, go through blake2b. Cost: one read of
the weights plus a float64 temporary of CHUNK_WORDS * 8 bytes; bench/weights.py measures it per
GB (bench/README.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

CHUNK_WORDS = 1 << 22
"""int16 words reduced at once (a 32 MiB float64 temporary on the tensor's device)."""
K = 4096
"""Length of the position-weight vector."""
_weights_cache: dict[str, Any] = {}


def _position_weights(device: Any) -> Any:
    """[K, 2] float64: the position weights and a column of ones (both sums in one GEMV)."""
    import torch

    key = str(device)
    w = _weights_cache.get(key)
    if w is None:
        i = torch.arange(K, dtype=torch.int64)
        pos = (i * 40503 + 12345) % 65521 + 1  # fixed, in 1..65521, never 0
        w = torch.stack([torch.ones(K, dtype=torch.int64), pos], 1).to(torch.float64).to(device)
        _weights_cache[key] = w
    return w


def tensor_fold(t: Any) -> tuple[int, int]:
    """(sum, position-weighted sum) of a tensor's bytes read as int16 words; exact integers."""
    import torch

    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    odd = raw.numel() % 2
    words = raw[: raw.numel() - odd].view(torch.int16)
    w = _position_weights(raw.device)
    s1 = s2 = 0
    for start in range(0, words.numel(), CHUNK_WORDS):
        c = words[start : start + CHUNK_WORDS]
        n = c.numel()
        full = n - n % K
        parts = []
        if full:
            # float64 is exact here: a row's sums stay below 2^15 * 2^16 * K = 2^43 < 2^53
            parts.append((c[:full].view(-1, K).to(torch.float64) @ w).to(torch.int64).sum(0))
        if n > full:
            parts.append((c[full:].to(torch.float64) @ w[: n - full]).to(torch.int64))
        total = torch.stack(parts).sum(0).tolist()
        s1 += int(total[0])
        s2 += int(total[1])
    if odd:
        last = int(raw[-1])
        s1 += last
        s2 += last * 7
    return s1, s2


FoldRecord = tuple[str, str, tuple[int, ...], int, int]
"""(name, dtype, shape, sum, weighted sum): one tensor as the digest sees it."""


def fold_record(name: str, t: Any) -> FoldRecord:
    """One tensor's record: what weights_digest hashes of it."""
    s1, s2 = tensor_fold(t)
    return name, str(t.dtype).removeprefix("torch."), tuple(int(d) for d in t.shape), s1, s2


def records_digest(records: Iterable[FoldRecord]) -> str:
    """The digest of tensors given as records (order-free: sorted by name). Lets an engine that
    holds its tensors in another process (vLLM's workers) fold them there and send only the
    records: the same digest as weights_digest over the same tensors."""
    h = hashlib.blake2b(digest_size=16)
    for name, dtype, shape, s1, s2 in sorted(records, key=lambda r: r[0]):
        h.update(f"{name}|{dtype}|{tuple(shape)}|{s1}|{s2};".encode())
    return h.hexdigest()


def weights_digest(named_tensors: Iterable[tuple[str, Any]]) -> str:
    """Digest of named tensors (order-free: sorted by name). A missing tensor, another dtype or
    shape, or any changed word changes it."""
    return records_digest(fold_record(name, t) for name, t in named_tensors)
