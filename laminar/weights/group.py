"""The weight broadcast group: the trainer broadcasts each version to the rollouts in one
collective (NCCL on GPUs, gloo on CPU: the same code, tested here on gloo), the global-broadcast
baseline of verl and LlamaRL that the relay tier is measured against.

    # trainer: hosts the group's store, broadcasts from its own thread
    caster = GroupBroadcaster(settings, log)
    caster.start()
    done = caster.submit(version, layout, flat)     # concurrent Future: Delivery when finished
    caster.close()
    # rollout
    member = GroupMember(settings, "rollout-1", device="cpu", on_weights=fn, log=log)
    member.start()                                  # fn(FlatWeights) from its thread per version
    member.in_group                                 # False: dropped or not yet in: use the relay
    member.close()

Control plane: a c10d TCPStore the trainer hosts (no default process group, so a trainer
running FSDP keeps its own). Members beat (`beat/<id>` counters). The trainer's thread keeps a
generation: the members whose beat moved within `bound_s`; when that set changes it withdraws
the old group and builds generation g+1 (`gen`, `gen/<g>` = members) as a fresh ProcessGroup
of its own (PrefixStore "gen<g>"), so a dead or added member never needs a trainer restart.
Each version: the announcement (NcclAnnounce, our codec) goes into the store under
`gen<g>/ann/<seq>`, then one broadcast of the flat buffer. No checksum pass precedes it (it
would hold the trainer): what each rollout's engine serves is attested after the load instead.
A member waits on the store, never inside a collective, so an idle member does not time out,
and a collective lasts at most `bound_s`: a member that is dead (kill -9: the trainer's send
fails at once) or busy (its receive never posted) fails the broadcast, is dropped from the next
generation (and benched for `bound_s` if it beats but never joins), and falls back to the relay
path; the version is sent again to the survivors. The trainer itself waits for a broadcast at
most `bound_s` (laminar/weights/nccl.py): that is the bound on its stall.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from laminar.protocol.relay import NcclAnnounce, WeightLayout
from laminar.transport.codec import decode, encode
from laminar.weights.gpu import FlatWeights, flat_checksum

Log = structlog.typing.FilteringBoundLogger


@dataclass(frozen=True)
class GroupSettings:
    """The broadcast group of a run, the same at both ends (laminar/wiring/common.py
    `weights_group` builds it from rollout.weights_group, whose fields hold the defaults)."""

    host: str
    """Where the trainer's store listens (the trainer's host)."""
    port: int
    backend: str
    """nccl (GPUs) | gloo (CPU)."""
    members: tuple[str, ...]
    """Node ids that may join (rollout-0 ... rollout-{n-1})."""
    bound_s: float
    """A broadcast, a group build and the trainer's wait for either last at most this."""
    beat_s: float
    """A member's beat interval; silent for bound_s = out of the next generation."""
    connect_timeout_s: float
    """A member waits this long for the trainer's store at start (the trainer may start later)."""


@dataclass
class Delivery:
    """How one version's broadcast went."""

    version: int
    members: tuple[str, ...] = ()
    """Who received it through the group."""
    seconds: float = 0.0
    attempts: int = 0
    superseded: bool = False
    """A newer version was submitted before this one went out (it never will)."""
    error: str = ""


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def local_address(peer_host: str) -> str:
    """The address this host uses to reach `peer_host` (what gloo binds: the machine's hostname
    may resolve to nothing reachable)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, 9))  # no packet leaves: connect on UDP only picks the route
        return str(s.getsockname()[0])


def new_group(
    store: Any,
    gen: int,
    rank: int,
    size: int,
    settings: GroupSettings,
    address: str,
    build_s: float | None = None,
) -> Any:
    """A fresh ProcessGroup for generation `gen` (its own store prefix; no default group). Its
    build waits `build_s` (default bound_s) for every rank; its collectives last bound_s."""
    import torch.distributed as dist

    store = dist.PrefixStore(f"gen{gen}", store)
    store.set_timeout(_timeout(build_s or settings.bound_s))

    prefix = store
    if settings.backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        opts._timeout = _timeout(settings.bound_s)
        return dist.ProcessGroupGloo(prefix, rank, size, opts)
    nccl_opts = dist.ProcessGroupNCCL.Options()
    nccl_opts._timeout = _timeout(settings.bound_s)
    return dist.ProcessGroupNCCL(prefix, rank, size, nccl_opts)


def destroy_group(pg: Any) -> None:
    """Drop a generation's group; NCCL communicators are aborted (a peer may be dead)."""
    if pg is None:
        return
    for name in ("abort", "shutdown"):  # torch's API varies by version and backend
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
                return
            except RuntimeError:
                continue


def broadcast(pg: Any, flat: Any, bound_s: float) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = _timeout(bound_s)
    pg.broadcast([flat], opts).wait()


def _announce_bytes(msg: NcclAnnounce) -> bytes:
    return b"".join(bytes(f) for f in encode(msg))


def _read_announce(raw: bytes) -> NcclAnnounce:
    msg = decode([raw[:1], raw[1:]])  # type byte + msgpack header (no array frames)
    if not isinstance(msg, NcclAnnounce):
        raise TypeError(f"expected NcclAnnounce, got {type(msg).__name__}")
    return msg


# ---- trainer -------------------------------------------------------------------------------


@dataclass
class _Pending:
    version: int
    layout: WeightLayout
    flat: Any
    future: concurrent.futures.Future[Delivery]


class GroupBroadcaster:
    """Rank 0: hosts the store, keeps the generation current, broadcasts from its thread."""

    def __init__(
        self, settings: GroupSettings, log: Log, clock: Callable[[], float] = time.monotonic
    ):
        self.s, self.log, self.clock = settings, log, clock
        self.store: Any = None
        self.gen = 0
        self.members: tuple[str, ...] = ()
        self.pg: Any = None
        self.seq = 0
        self._beats: dict[str, int] = {}
        self._seen: dict[str, float] = {}
        self._benched: dict[str, float] = {}
        self._pending: _Pending | None = None
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.rebuilds = 0
        self.failures = 0
        self.dropped: list[str] = []
        """Members a failed broadcast or build dropped, oldest first (status, tests)."""

    def start(self) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore(
            self.s.host,
            self.s.port,
            is_master=True,
            wait_for_workers=False,
            timeout=_timeout(self.s.bound_s),
        )
        self.store.set("gen", "0")
        self._thread = threading.Thread(target=self._run, name="weights-group", daemon=True)
        self._thread.start()

    def submit(
        self, version: int, layout: WeightLayout, flat: Any
    ) -> concurrent.futures.Future[Delivery]:
        """Queue `version` (replacing one still waiting, which resolves as superseded)."""
        fut: concurrent.futures.Future[Delivery] = concurrent.futures.Future()
        with self._cv:
            if self._pending is not None:
                self._pending.future.set_result(Delivery(self._pending.version, superseded=True))
            self._pending = _Pending(version, layout, flat, fut)
            self._cv.notify()
        return fut

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=self.s.bound_s * 2 + 5)
        destroy_group(self.pg)
        self.pg = None
        if self._pending is not None:
            self._pending.future.set_result(Delivery(self._pending.version, error="closed"))
            self._pending = None

    # the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._stop and self._pending is None:
                    self._cv.wait(timeout=self.s.beat_s)
                if self._stop:
                    return
                job, self._pending = self._pending, None
            alive = self._alive()
            if alive != self.members or (self.pg is None and alive):
                self._rebuild()
            if job is not None:
                job.future.set_result(self._deliver(job))

    def _alive(self) -> tuple[str, ...]:
        now = self.clock()
        for m in self.s.members:
            n = int(self.store.add(f"beat/{m}", 0))
            if n != self._beats.get(m):
                self._beats[m] = n
                if n:
                    self._seen[m] = now
        return tuple(
            m
            for m in self.s.members
            if now - self._seen.get(m, -1e18) < self.s.bound_s and self._benched.get(m, 0) <= now
        )

    def _rebuild(self) -> None:
        """A new generation of the live members; once more without those that never joined."""
        for attempt in range(2):
            # the second build waits longer: a member may still be stuck for bound_s in the
            # first one's rendezvous before it sees the new generation
            self._build(self._alive(), self.s.bound_s * (1 + 2 * attempt))
            if self.pg is not None or not self._alive():
                return

    def _build(self, alive: tuple[str, ...], build_s: float) -> None:
        destroy_group(self.pg)
        self.pg, self.members = None, ()
        self.gen += 1
        self.seq = 0
        self.rebuilds += 1
        gen = self.gen
        self.store.set(f"gen/{gen}", ",".join(alive))
        self.store.set("gen", str(gen))
        if not alive:
            self.log.info("weights_group_empty", generation=gen)
            return
        t0 = self.clock()
        try:
            self.pg = new_group(self.store, gen, 0, len(alive) + 1, self.s, self.s.host, build_s)
            self.members = alive
            self.log.info(
                "weights_group_built",
                generation=gen,
                members=list(alive),
                seconds=round(self.clock() - t0, 3),
            )
        except RuntimeError as exc:  # someone never joined within bound_s: bench it, try again
            joined = [m for m in alive if self.store.check([f"gen{gen}/joined/{m}"])]
            missing = [m for m in alive if m not in joined]
            for m in missing:
                self._benched[m] = self.clock() + self.s.bound_s
                self.dropped.append(m)
            self.log.warning(
                "weights_group_build_failed",
                generation=gen,
                missing=missing,
                error=f"{type(exc).__name__}: {str(exc)[:200]}",
            )

    def _deliver(self, job: _Pending) -> Delivery:
        t0 = self.clock()
        out = Delivery(job.version)
        # no checksum pass before the broadcast (the trainer waits for it): attestation checks
        # end to end what each rollout's engine serves (docs/DESIGN.md, "Attested versions")
        header = _announce_bytes(NcclAnnounce(version=job.version, checksum="", layout=job.layout))
        for attempt in range(2):  # the survivors of a failed broadcast get it again, once
            out.attempts = attempt + 1
            if self.pg is None:
                self._rebuild()
            if self.pg is None:
                out.error = "no members"
                break
            self.store.set(f"gen{self.gen}/ann/{self.seq}", header)
            self.seq += 1
            try:
                broadcast(self.pg, job.flat, self.s.bound_s)
                out.members, out.error = self.members, ""
                break
            except RuntimeError as exc:
                self.failures += 1
                out.error = f"{type(exc).__name__}: {str(exc)[:200]}"
                self.log.warning(
                    "weights_broadcast_failed",
                    version=job.version,
                    generation=self.gen,
                    error=out.error,
                )
                # gloo does not say which peer failed: the rebuild finds out (a dead or busy
                # member never joins the next generation and is benched for bound_s)
                destroy_group(self.pg)
                self.pg, self.members = None, ()
        out.seconds = self.clock() - t0
        return out


# ---- rollout -------------------------------------------------------------------------------


class GroupMember:
    """A rollout's end: beats, joins each generation that lists it, receives versions."""

    def __init__(
        self,
        settings: GroupSettings,
        node_id: str,
        device: Any,
        on_weights: Callable[[FlatWeights], None],
        log: Log,
    ):
        self.s, self.node_id, self.device = settings, node_id, device
        self.on_weights, self.log = on_weights, log
        self.store: Any = None
        self.in_group = False
        self.out_since = time.monotonic()
        """When this member last left (or, before it ever joined, started)."""
        self.received = 0
        self.bad_checksums = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pg: Any = None

    def start(self) -> None:
        for target, name in ((self._beat, "beat"), (self._run, "recv")):
            t = threading.Thread(target=target, name=f"weights-group-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.s.bound_s + 5)
        destroy_group(self._pg)
        self._pg = None

    def _connect(self) -> bool:
        import torch.distributed as dist

        deadline = time.monotonic() + self.s.connect_timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:  # a plain connect first: c10d logs every failed try of its own at length
                socket.create_connection((self.s.host, self.s.port), timeout=1.0).close()
                self.store = dist.TCPStore(
                    self.s.host,
                    self.s.port,
                    is_master=False,
                    timeout=_timeout(min(self.s.bound_s, 5.0)),
                )
                return True
            except (RuntimeError, OSError):  # the trainer's store is not up yet
                self._stop.wait(self.s.beat_s)
        return False

    def _beat(self) -> None:
        while self.store is None and not self._stop.is_set():
            self._stop.wait(0.05)  # _run connects
        while not self._stop.is_set():
            try:
                self.store.add(f"beat/{self.node_id}", 1)
            except (RuntimeError, OSError):  # the trainer restarting: beat again later
                pass
            self._stop.wait(self.s.beat_s)

    def _leave(self) -> None:
        destroy_group(self._pg)
        self._pg = None
        if self.in_group:
            self.in_group = False
            self.out_since = time.monotonic()

    def _run(self) -> None:
        if not self._connect():
            self.log.error("weights_group_unreachable", host=self.s.host, port=self.s.port)
            return
        seen = 0
        while not self._stop.is_set():
            try:
                gen = int(self.store.get("gen")) if self.store.check(["gen"]) else 0
                if gen <= seen:
                    self._stop.wait(self.s.beat_s / 2)
                    continue
                seen = gen
                members = bytes(self.store.get(f"gen/{gen}")).decode().split(",")
                self._leave()
                if self.node_id not in members:
                    continue
                self.store.set(f"gen{gen}/joined/{self.node_id}", "1")
                rank = members.index(self.node_id) + 1
                address = local_address(self.s.host)
                self._pg = new_group(self.store, gen, rank, len(members) + 1, self.s, address)
                self.in_group = True
                self.log.info("weights_group_joined", generation=gen, rank=rank)
                self._receive(gen)
            except (RuntimeError, OSError, TypeError, ValueError) as exc:
                self.log.warning(
                    "weights_group_left", generation=seen, error=f"{type(exc).__name__}: {exc}"
                )
            self._leave()

    def _receive(self, gen: int) -> None:
        """Versions of generation `gen` until a newer generation exists (or a collective fails:
        raises)."""
        import torch

        seq = 0
        while not self._stop.is_set():
            key = f"gen{gen}/ann/{seq}"
            if not self.store.check([key]):
                if int(self.store.get("gen")) > gen:
                    return
                self._stop.wait(0.02)  # the store has no notification: poll the announcement
                continue
            ann = _read_announce(bytes(self.store.get(key)))
            seq += 1
            flat = torch.empty(ann.layout.total_bytes, dtype=torch.uint8, device=self.device)
            broadcast(self._pg, flat, self.s.bound_s)
            if ann.checksum and flat_checksum(flat) != ann.checksum:
                self.bad_checksums += 1
                self.log.error("weights_group_bad_checksum", version=ann.version)
                continue
            self.received += 1
            self.on_weights(FlatWeights(ann.version, ann.checksum, ann.layout, flat))
