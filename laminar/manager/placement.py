"""Placing partial trajectories on live rollouts: repack moves, recovery, orphans.

    placer = Placer(srv, bound_b, request_timeout_s, metrics, log, buffer=connect_buffer)
    placed = await placer.place(partials, trainer_version, prefer="rollout-3", source="rollout-1")
    #  {node_id or ORPHAN: count}
    await placer.place(placer.take_orphans(), trainer_version)   # the recovery loop, every second

Each trajectory keeps one policy version: partials go to a live rollout of their own version.
The manager's view of versions comes from heartbeats and may be a beat old: a destination
that refreshed meanwhile answers version_mismatch, is marked stale until its next status,
and the partials try the next rollout of that version (at most PLACE_TRIES in all, the
source last). Only when no live rollout holds the version does a trajectory restart from
its prompt at another version, on the least loaded rollout of the newest (the source last
again; its generated tokens are lost), never at an older version than its own; partials that
nobody took are kept as orphans and placed again by the recovery loop.

Before partials are imported on a rollout, the buffer is told (SamplesPlaced): it takes those
samples' tokens and trajectories from that rollout alone from then on (laminar/buffer/owners.py).
When the buffer cannot be told, nothing is imported (the partials stay orphans and are placed
again), so a placed sample is never refused from its new rollout.

Mode partial (`continue_newer`): a trajectory may continue under a newer version than its own
(AReaL's partial rollout), so a partial goes to a live rollout at its newest token's version or
later (the same version first, then the newest), and keeps every token it has.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable

import numpy as np
import structlog

from laminar.metrics import Metrics
from laminar.protocol.buffer import SamplesPlaced
from laminar.protocol.data import PartialTrajectory, newest_version
from laminar.protocol.rollout import VERSION_MISMATCH, ImportReply, ImportRequest
from laminar.transport.client import RpcClient
from laminar.transport.server import RpcServer
from laminar.transport.sockets import Peer, RemoteError, TransportError


class _BufferAway(Exception):
    """The buffer could not be told of a placement: nothing is imported."""


PLACE_TRIES = 4
"""Rollouts one batch of partials is offered to before it restarts from the prompt elsewhere."""
ORPHAN = "<orphan>"
"""The key in `place()`'s answer for partials nobody took (kept as orphans)."""


class Placer:
    def __init__(
        self,
        srv: RpcServer,
        bound_b: int,
        request_timeout_s: float,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        *,
        buffer: Callable[[], Awaitable[RpcClient]] | None = None,
        continue_newer: bool = False,
    ):
        self.srv = srv
        self.continue_newer = continue_newer
        """Mode partial: a rollout at a newer version may continue a partial (see above)."""
        self.buffer = buffer
        """The buffer's client, connected (None: placements are not announced, e.g. tests of
        placement alone)."""
        self.bound_b = bound_b
        """Running sequences a rollout takes (manager.repack.bound_b, else rollout.max_running)."""
        self.request_timeout_s = request_timeout_s
        self.metrics, self.log = metrics, log
        self.orphans: list[PartialTrajectory] = []
        self._placing: Counter[str] = Counter()
        """uid -> place() calls under way with it (held(): the reconciliation leaves these)."""
        self.stale: dict[str, object] = {}
        """rollout id -> the status it had when it answered version_mismatch: skipped until a new
        one. The object itself, not its id(): a freed status's id() is reused by the next one."""

    def live(self) -> list[Peer]:
        return [p for p in self.srv.peers.values() if p.alive and p.role == "rollout"]

    def usable(self, p: Peer) -> bool:
        """A rollout whose last status is not known to be stale (it answered version_mismatch)."""
        return p.status is not None and self.stale.get(p.node_id) is not p.status

    def held(self) -> set[str]:
        """uids in the placer's hands: being placed now, or orphans waiting for a home. The
        buffer may name any rollout as their holder meanwhile (the last one announced), and none
        runs them: the reconciliation (reconcile.py) must not take them for stranded."""
        return set(self._placing) | {p.uid for p in self.orphans}

    def take_orphans(self) -> list[PartialTrajectory]:
        orphans, self.orphans = self.orphans, []
        return orphans

    def _candidates(
        self, version: int, trainer_version: int, prefer: str | None, source: str | None
    ) -> list[Peer]:
        """Live rollouts that may hold `version` now, best first: the preferred one, then those
        decoding (a rollout with work cannot have changed version: it refreshes only when empty),
        emptiest first; idle ones only when the version is the newest (an idle rollout behind it
        refreshes at once); the source of a move last (it may not have refreshed yet)."""
        live = [(p, p.status) for p in self.live() if p.status is not None]
        newest = max((s.version for _, s in live), default=-1)
        bound = self.bound_b
        ranked: list[tuple[tuple[object, ...], Peer]] = []
        for p, s in live:
            if not self.usable(p) or p.node_id == source:
                continue
            if self.continue_newer:  # same version first, then the newest; any at or past it
                if s.version < version:
                    continue
                key = (p.node_id != prefer, s.version != version, -s.version, s.running >= bound)
                ranked.append(((*key, s.kv_use, p.node_id), p))
                continue
            if s.version != version:
                continue
            if p.node_id != prefer and s.running == 0 and version < max(newest, trainer_version):
                continue
            ranked.append(((p.node_id != prefer, s.running >= bound, s.kv_use, p.node_id), p))
        out = [p for _, p in sorted(ranked, key=lambda r: r[0])]
        if source is not None and source in self.srv.peers and self.srv.peers[source].alive:
            out.append(self.srv.peers[source])
        return out[:PLACE_TRIES]

    async def _announce(self, dest: str, items: list[PartialTrajectory]) -> None:
        """Tell the buffer these samples now come from `dest`; raises _BufferAway when it could
        not be told."""
        if self.buffer is None:
            return
        uids = [f"{p.group_id}/{p.sample_index}" for p in items]
        msg = SamplesPlaced(dest=dest, uids=uids)
        try:
            buf = await self.buffer()
            await buf.request(msg, timeout=self.request_timeout_s, retries=1)
        except (TransportError, RemoteError) as exc:
            self.metrics.count("placement_unannounced")
            self.log.warning("placement_unannounced", dest=dest, error=str(exc))
            raise _BufferAway from exc

    async def _import(self, peer: Peer, items: list[PartialTrajectory]) -> bool:
        await self._announce(peer.node_id, items)
        try:
            rep = await self.srv.request(
                peer.node_id,
                ImportRequest(partials=items),
                timeout=self.request_timeout_s,
            )
        except RemoteError as exc:
            if (
                exc.code == VERSION_MISMATCH
            ):  # refreshed since its last beat: skip it until the next one
                self.stale[peer.node_id] = peer.status
                self.metrics.count("import_version_mismatch")
            else:
                self.log.warning("import_failed", dest=peer.node_id, error=str(exc))
            return False
        except TransportError as exc:
            self.log.warning("import_failed", dest=peer.node_id, error=str(exc))
            return False
        return isinstance(rep, ImportReply)

    async def place(
        self,
        partials: list[PartialTrajectory],
        trainer_version: int,
        prefer: str | None = None,
        source: str | None = None,
    ) -> dict[str, int]:
        """Import partials onto live rollouts of their own version (prefer `prefer`, `source` last);
        when none takes them, restart them from the prompt on a rollout of the newest version;
        what still finds no home becomes an orphan. Returns how many went where ({node_id or ORPHAN:
        count})."""
        uids = [p.uid for p in partials]
        self._placing.update(uids)
        try:
            return await self._place(partials, trainer_version, prefer, source)
        finally:
            self._placing.subtract(uids)
            for u in uids:
                if self._placing[u] <= 0:
                    del self._placing[u]

    async def _place(
        self,
        partials: list[PartialTrajectory],
        trainer_version: int,
        prefer: str | None,
        source: str | None,
    ) -> dict[str, int]:
        by_version: dict[int, list[PartialTrajectory]] = defaultdict(list)
        for p in partials:
            by_version[newest_version(p) if self.continue_newer else p.version].append(p)
        placed: dict[str, int] = defaultdict(int)
        for version, items in by_version.items():
            dest = None
            try:
                for peer in self._candidates(version, trainer_version, prefer, source):
                    if await self._import(peer, items):
                        dest = peer.node_id
                        break
                if dest is None:
                    dest = await self._restart_elsewhere(items, source)
            except _BufferAway:  # imported nowhere: kept, placed again once the buffer answers
                dest = None
            if dest is None:
                self.orphans.extend(items)
                dest = ORPHAN
            placed[dest] += len(items)
        return dict(placed)

    async def _restart_elsewhere(
        self, items: list[PartialTrajectory], source: str | None
    ) -> str | None:
        """No live rollout holds their version: start them over, from the prompt, on the least
        loaded rollout of the newest version, the source of a move last among those (their
        generated tokens are lost). Never on a rollout older than their own version: that one
        (a rollout just restarted, still on its first weights) loads the newest before long, and
        they are imported there whole (kept as orphans meanwhile), where a restart would make
        them staler (mode sync drops them)."""
        floor = max(p.version for p in items)
        live = [
            (p, p.status)
            for p in self.live()
            if p.status is not None and self.usable(p) and p.status.version >= floor
        ]
        live.sort(
            key=lambda ps: (
                -ps[1].version,
                ps[0].node_id == source,
                ps[1].running,
                ps[1].kv_use,
                ps[0].node_id,
            )
        )
        for peer, status in live[:PLACE_TRIES]:
            if await self._import(peer, [restart(p, status.version) for p in items]):
                self.metrics.count("restarted_from_prompt", len(items))
                self.log.info(
                    "restarted_from_prompt",
                    dest=peer.node_id,
                    count=len(items),
                    lost_tokens=int(sum(len(p.response_ids) for p in items)),
                )
                return peer.node_id
        return None


def restart(p: PartialTrajectory, version: int) -> PartialTrajectory:
    """The same trajectory from its prompt, at `version`: every generated token dropped."""
    return PartialTrajectory(
        uid=p.uid,
        group_id=p.group_id,
        prompt_uid=p.prompt_uid,
        sample_index=p.sample_index,
        prompt_ids=p.prompt_ids,
        response_ids=np.zeros(0, np.int32),
        logprobs=np.zeros(0, np.float32),
        version=version,
        n=p.n,
        prompt=p.prompt,
        row=p.row,
        rollout_id=p.rollout_id,
        resumed=p.resumed + 1,
        t_start=p.t_start,
        image_digests=p.image_digests,
    )
