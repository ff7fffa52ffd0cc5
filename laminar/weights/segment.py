"""The shared-memory segment of a weight version: every end that maps it, in one place.

    segment files in /dev/shm ──mmap──► relay (WeightStore: creates and writes them)
                                   ├──► trainer (WriterMap: writes a staged version in place)
                                   └──► rollouts (map_segment: shared read-only views, or
                                                   private copy-on-write ones)

    store = WeightStore(seg_dir, "laminar-demo-relay0", spare_slots=1, max_slots=4)
    vs = store.begin(version, layout, chunk_bytes, source="upstream")   # takes a free slot
    vs.buf[s:e] = chunk; store.mark(vs, i, digest)                      # chunk i is present
    store.complete(vs, checksum)       # newest complete version; older unpinned ones are freed
    store.pin(peer, v) / store.unpin(peer, v) / store.unpin_peer(peer)   # reader refcounts

A segment holds one version laid out flat (laminar/weights/layout.py: offsets, chunks,
checksums); its size and path travel in StageReply / PullReply, and the reader checks the
inode so a cached mapping never points at a recreated file.

Double buffering: a version is written into its own slot, never into the slot of a
version that is complete, so receiving v+1 never tears v while rollouts read it. A
complete version is freed once a newer one is complete and no reader pins it; the
freed slot is kept as a spare (reused without new page faults) up to `spare_slots`.

Each slot is a file in /dev/shm with a unique name, so a reader's cached mapping can
never silently point at a recreated file. Space is reserved with posix_fallocate: a
full /dev/shm is a clean error here instead of a SIGBUS on a later write.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import mmap
import os
import secrets
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laminar.protocol.relay import WeightLayout
from laminar.weights.layout import n_chunks

MIN_SEGMENT = 4096


def default_shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


# ---- the ends: the trainer writes a staged version, a rollout reads one ----------------


class WriterMap:
    """A writable shared mapping of a relay segment (the trainer side), cached by path."""

    def __init__(self, path: str, size: int):
        import torch

        fd = os.open(path, os.O_RDWR)
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, size, flags=flags)
            self.inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        self.path, self.size = path, size
        self.tensor: Any = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.cuda_registered = False

    def close(self) -> None:
        if self.cuda_registered:  # unregister before the pages go away (laminar/weights/gpu.py)
            from laminar.weights.gpu import unpin_host_tensor

            unpin_host_tensor(self.tensor)
            self.cuda_registered = False
        self.tensor = None
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()


def map_segment(path: str, size: int, writable: bool) -> tuple[mmap.mmap, int]:
    """Read-only shared mapping (cacheable: it can never hold private stale pages), or a fresh
    private copy-on-write mapping when the caller wants writable tensors."""
    fd = os.open(path, os.O_RDONLY)
    try:
        inode = os.fstat(fd).st_ino
        if writable:
            return mmap.mmap(
                fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            ), inode
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ), inode
    finally:
        os.close(fd)


# ---- the relay's store -----------------------------------------------------------------


class OutOfSlots(RuntimeError):
    """Every slot holds a version that a reader pins; no room for another version."""


class Segment:
    """One shared-memory file, mapped read-write by its creator."""

    def __init__(self, path: str, size: int, mm: mmap.mmap, inode: int):
        self.path, self.size, self.mm, self.inode = path, size, mm, inode
        self.buf = np.frombuffer(mm, dtype=np.uint8, count=size)

    @classmethod
    def create(cls, path: str, size: int) -> Segment:
        size = max(size, MIN_SEGMENT)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.unlink(path)
                raise OutOfSlots(
                    f"cannot reserve {size} bytes in {os.path.dirname(path)}: {exc.strerror}"
                ) from None
            # no MAP_POPULATE: page tables fill as chunks land (measured: populating costs as
            # much as faulting, and a trainer-written slot is only ever read here)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        return cls(path, size, mm, inode)

    def close(self) -> None:
        self.buf = None  # type: ignore[assignment]
        with contextlib.suppress(
            BufferError, ValueError
        ):  # a view still exported: GC unmaps it later
            self.mm.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.close()


@dataclass(eq=False)
class Slot:
    seg: Segment
    serial: int


@dataclass(eq=False)
class VersionState:
    """One version in a slot: complete, or being staged / received chunk by chunk."""

    version: int
    layout: WeightLayout
    chunk_bytes: int
    slot: Slot
    source: str
    n: int = 0
    have: np.ndarray = field(init=False)
    digests: np.ndarray = field(init=False)
    checksum: str = ""
    expected_checksum: str = ""
    """The version checksum announced by the sender (from the last chunk), checked at completion."""
    staging: bool = False
    """A trainer is still writing it: not offered downstream, not pullable."""
    complete: bool = False
    abandoned: bool = False
    have_count: int = 0
    delta_base: int = -1
    """Delta mode: the version the deltas below are against (-1: none kept)."""
    deltas: dict[int, np.ndarray] = field(default_factory=dict)
    """Delta mode: chunk index -> its encoded delta against delta_base (what a hop forwards)."""
    waiters: dict[int, list[asyncio.Future]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.n = n_chunks(self.layout.total_bytes, self.chunk_bytes)
        self.have = np.zeros(self.n, dtype=bool)
        self.digests = np.zeros(self.n, dtype=np.uint64)

    @property
    def buf(self) -> np.ndarray:
        return self.slot.seg.buf

    @property
    def crcs(self) -> np.ndarray:
        return (self.digests & np.uint64(0xFFFFFFFF)).astype(np.uint32)


class WeightStore:
    def __init__(self, seg_dir: str, base_name: str, spare_slots: int = 1, max_slots: int = 4):
        self.seg_dir, self.base_name = seg_dir, base_name
        self.spare_slots, self.max_slots = spare_slots, max_slots
        self.versions: dict[int, VersionState] = {}
        self.current: VersionState | None = None
        self.pins: dict[int, Counter[str]] = {}
        self._free: list[Slot] = []
        self._serial = itertools.count()
        self.slots_created = 0
        self._creating = 0
        self.remove_stale()

    # ---- slots -------------------------------------------------------------------------
    def remove_stale(self) -> int:
        """Unlink segments a previous (killed) process of this relay left behind."""
        n = 0
        prefix = self.base_name + "-"
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.seg_dir):
                if name.startswith(prefix):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.seg_dir, name))
                        n += 1
        return n

    def _slot_count(self) -> int:
        return len(self._free) + len({id(v.slot) for v in self.versions.values()})

    async def _acquire(self, size: int) -> Slot:
        fits = [s for s in self._free if s.seg.size >= size]
        if fits:
            slot = min(fits, key=lambda s: s.seg.size)
            self._free.remove(slot)
            return slot
        while (
            self._free and self._slot_count() + self._creating >= self.max_slots
        ):  # small spares make room
            self._free.pop().seg.unlink()
        if self._slot_count() + self._creating >= self.max_slots:
            pinned = {v: sum(c.values()) for v, c in self.pins.items() if c}
            raise OutOfSlots(
                f"all {self.max_slots} slots in use (pinned versions: {pinned}); raise "
                "relay.max_slots"
            )
        serial = next(self._serial)
        path = os.path.join(self.seg_dir, f"{self.base_name}-{serial}-{secrets.token_hex(4)}")
        self._creating += 1
        # reserving and mapping a large file takes a while: keep the event loop (heartbeats) free
        try:
            seg = await asyncio.to_thread(Segment.create, path, size)
        finally:
            self._creating -= 1
        self.slots_created += 1
        return Slot(seg, serial)

    def _free_slot(self, slot: Slot) -> None:
        if any(v.slot is slot for v in self.versions.values()):
            return
        self._free.append(slot)
        while len(self._free) > self.spare_slots:
            self._free.pop(0).seg.unlink()

    # ---- versions ----------------------------------------------------------------------
    async def begin(
        self,
        version: int,
        layout: WeightLayout,
        chunk_bytes: int,
        source: str,
        staging: bool = False,
    ) -> VersionState:
        if version in self.versions:
            raise ValueError(f"version {version} already present")
        slot = await self._acquire(layout.total_bytes)
        if version in self.versions:  # raced with another begin while the slot was created
            self._free_slot(slot)
            raise ValueError(f"version {version} already present")
        vs = VersionState(version, layout, chunk_bytes, slot, source, staging=staging)
        self.versions[version] = vs
        return vs

    def mark(self, vs: VersionState, index: int, digest: int) -> None:
        if not vs.have[index]:
            vs.have[index] = True
            vs.have_count += 1
        vs.digests[index] = digest
        for fut in vs.waiters.pop(index, ()):
            if not fut.done():
                fut.set_result(True)

    async def wait_chunk(self, vs: VersionState, index: int, timeout: float) -> bool:
        """True once chunk `index` is present; False on timeout or if the version was abandoned."""
        if vs.have[index]:
            return True
        if vs.abandoned:
            return False
        fut = asyncio.get_running_loop().create_future()
        vs.waiters.setdefault(index, []).append(fut)
        try:
            return bool(await asyncio.wait_for(fut, timeout))
        except TimeoutError:
            return False

    def complete(self, vs: VersionState, checksum: str) -> None:
        vs.checksum, vs.complete = checksum, True
        vs.done.set()
        if self.current is None or vs.version > self.current.version:
            self.current = vs
        self.retire()

    def abandon(self, vs: VersionState) -> None:
        vs.abandoned = True
        for futs in vs.waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_result(False)
        vs.waiters.clear()
        vs.done.set()
        if self.versions.get(vs.version) is vs and not self.pins.get(vs.version):
            del self.versions[vs.version]
            self._free_slot(vs.slot)

    def retire(self) -> None:
        """Free complete versions older than the current one that nobody pins."""
        cur = self.current.version if self.current else -1
        for v, vs in list(self.versions.items()):
            if v < cur and (vs.complete or vs.abandoned) and not self.pins.get(v):
                del self.versions[v]
                self._free_slot(vs.slot)

    def newest_incoming(self) -> VersionState | None:
        cur = self.current.version if self.current else -1
        live = [
            vs
            for vs in self.versions.values()
            if not (vs.complete or vs.abandoned or vs.staging) and vs.version > cur
        ]
        return max(live, key=lambda vs: vs.version) if live else None

    def newest(self) -> VersionState | None:
        """Newest version this relay has or is receiving (what it offers downstream)."""
        inc = self.newest_incoming()
        return inc if inc is not None else self.current

    # ---- reader pins -------------------------------------------------------------------
    def pin(self, peer: str, version: int) -> None:
        self.pins.setdefault(version, Counter())[peer] += 1

    def unpin(self, peer: str, version: int) -> bool:
        c = self.pins.get(version)
        if not c or not c[peer]:
            return False
        c[peer] -= 1
        if not c[peer]:
            del c[peer]
        if not c:
            del self.pins[version]
        self.retire()
        return True

    def unpin_peer(self, peer: str) -> int:
        n = 0
        for v in list(self.pins):
            n += self.pins[v].pop(peer, 0)
            if not self.pins[v]:
                del self.pins[v]
        if n:
            self.retire()
        return n

    def pinned(self) -> int:
        return sum(sum(c.values()) for c in self.pins.values())

    def reset(self, keep_spare: bool = True) -> None:
        for v, vs in list(self.versions.items()):
            if not self.pins.get(v) and (vs.complete or vs.abandoned):
                del self.versions[v]
                self._free_slot(vs.slot)
        if self.current is not None and self.current.version not in self.versions:
            self.current = None
        if not keep_spare:
            while self._free:
                self._free.pop().seg.unlink()

    def close(self) -> None:
        for vs in self.versions.values():
            vs.slot.seg.unlink()
        for slot in self._free:
            slot.seg.unlink()
        self.versions.clear()
        self._free.clear()
        self.current = None
