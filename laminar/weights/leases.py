"""Reader leases: a version's buffer is freed only when every reader released it or its lease
expired. Explicit, in a key-value store both ends reach, never torch's per-share counter (with
one handle shared by N readers, the first reader's release could free a buffer the others still
read, silently serving wrong weights).

    board = LeaseBoard(kv)                             # kv: DictKV (one process) or StoreKV
    # exporter (trainer)
    bufs = VersionBuffers(board, keep=1)
    bufs.add(version, flat)                            # offered from now on
    freed = bufs.collect()                             # versions it dropped (no live lease left)
    # reader (rollout process)
    if board.acquire(version, "rollout-3", ttl_s=30):  # False: withdrawn, read a newer one
        ...copy...                                     # board.renew(...) if it takes long
        board.release(version, "rollout-3")

Protocol (Dekker-style, on a linearizable store): the reader writes its lease, then checks that
the version is still offered; the exporter withdraws the offer, then reads the leases. Whoever
comes second sees the other's write, so a buffer is never freed under a reader that got True.
A lease holds an absolute expiry (time.time() + ttl): readers and exporter share a clock because
CUDA IPC only works within one host. A reader killed with -9 holds nothing past its expiry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class KV(Protocol):
    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> str | None: ...

    def delete(self, key: str) -> None: ...

    def append(self, key: str, value: str) -> None: ...


@dataclass
class DictKV:
    """KV in one process (tests, and an exporter whose readers share its process)."""

    data: dict[str, str] = field(default_factory=dict)

    def set(self, key: str, value: str) -> None:
        self.data[key] = value

    def get(self, key: str) -> str | None:
        return self.data.get(key)

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def append(self, key: str, value: str) -> None:
        self.data[key] = self.data.get(key, "") + value


class StoreKV:
    """KV over a torch.distributed Store (the TCPStore the trainer hosts for a run's GPU weight
    paths: laminar/weights/group.py, cuda_ipc.py)."""

    def __init__(self, store: Any):
        self.store = store

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> str | None:
        # Store.get blocks until the key exists: ask first
        if not self.store.check([key]):
            return None
        return bytes(self.store.get(key)).decode()

    def delete(self, key: str) -> None:
        self.store.delete_key(key)

    def append(self, key: str, value: str) -> None:
        self.store.append(key, value)


class LeaseBoard:
    """Offers and reader leases of versions, in a KV both ends reach."""

    def __init__(self, kv: KV, clock: Callable[[], float] = time.time):
        self.kv, self.clock = kv, clock

    # exporter
    def offer(self, version: int) -> None:
        self.kv.set(f"offered/{version}", "1")

    def withdraw(self, version: int) -> None:
        self.kv.set(f"offered/{version}", "0")

    def live_readers(self, version: int) -> list[str]:
        """Readers whose lease on `version` has not expired."""
        names = (self.kv.get(f"readers/{version}") or "").split(",")
        now = self.clock()
        live = []
        for name in dict.fromkeys(n for n in names if n):
            expiry = self.kv.get(f"lease/{version}/{name}")
            if expiry is not None and float(expiry) > now:
                live.append(name)
        return live

    def forget(self, version: int) -> None:
        """Drop a freed version's keys (its readers' stale leases included)."""
        names = (self.kv.get(f"readers/{version}") or "").split(",")
        for name in dict.fromkeys(n for n in names if n):
            self.kv.delete(f"lease/{version}/{name}")
        self.kv.delete(f"readers/{version}")
        self.kv.delete(f"offered/{version}")

    # reader
    def acquire(self, version: int, reader: str, ttl_s: float) -> bool:
        """Lease `version` for `ttl_s`; False when it was withdrawn (its buffer may be gone)."""
        self.kv.set(f"lease/{version}/{reader}", repr(self.clock() + ttl_s))
        self.kv.append(f"readers/{version}", reader + ",")
        if self.kv.get(f"offered/{version}") != "1":
            self.kv.delete(f"lease/{version}/{reader}")
            return False
        return True

    def renew(self, version: int, reader: str, ttl_s: float) -> None:
        self.kv.set(f"lease/{version}/{reader}", repr(self.clock() + ttl_s))

    def release(self, version: int, reader: str) -> None:
        self.kv.delete(f"lease/{version}/{reader}")


class VersionBuffers:
    """The exporter's buffers by version: the newest `keep` stay offered; an older one is
    withdrawn, then freed once no reader holds a live lease on it."""

    def __init__(self, board: LeaseBoard, keep: int = 1):
        if keep < 1:
            raise ValueError("keep must be >= 1 (the newest version stays offered)")
        self.board, self.keep = board, keep
        self.buffers: dict[int, Any] = {}
        self.withdrawn: set[int] = set()

    def add(self, version: int, buffer: Any) -> list[int]:
        """Offer `version`; returns the versions freed by the collection that follows."""
        self.buffers[version] = buffer
        self.board.offer(version)
        return self.collect()

    def collect(self) -> list[int]:
        """Withdraw every version but the newest `keep`; free the withdrawn ones nobody holds."""
        for v in sorted(self.buffers)[: -self.keep]:
            if v not in self.withdrawn:
                self.board.withdraw(v)
                self.withdrawn.add(v)
        freed = []
        for v in sorted(self.withdrawn):
            if not self.board.live_readers(v):
                self.buffers.pop(v, None)
                self.withdrawn.discard(v)
                self.board.forget(v)
                freed.append(v)
        return freed

    def held(self) -> list[int]:
        """Versions whose buffers are still allocated."""
        return sorted(self.buffers)

    def clear(self) -> None:
        for v in list(self.buffers):
            self.board.withdraw(v)
        self.buffers.clear()
        self.withdrawn.clear()
