"""Which weight version a rollout runs, which one it loads next, and the load itself.

    gate = VersionGate(source, engine, auto_refresh=..., refresh_wait_s=..., notify=(evt,), ...)
    gate.require(reply.min_version)  # the buffer's min_version: hard, waited for however long
    gate.ask(refresh.min_version)    # a manager RefreshRequest: soft, waited for refresh_wait_s
    gate.target()                    # the version new prompts should run at
    gate.loadable()                  # the version a load would bring now (-1: none worth loading)
    async with gate.lock:            # held by whoever needs the version not to change (an import)
        await gate.load()            # newest from the source -> engine; the caller checked idleness
    await gate.watch(wake)           # sets `wake` whenever the source gets a newer version
    gate.attest(expected)            # the trainer's digests (manager status): a mismatch
                                     # quarantines this rollout until it reloaded

Attestation: after every load the gate reads the engine's parameters back and digests them
(laminar/weights/digest.py), before any prompt runs at the new version; every trajectory
carries that digest (the trainer drops one whose digest differs from the version's). When
the trainer's digest for the version arrives and differs, the rollout is quarantined: it
takes no new prompts (behind() is true), and once idle it loads again, the same version
included; the mismatch is counted (NodeStatus.attest_mismatches).

The gate never decides *when* to load: the prompt feeder (laminar/rollout/feeder.py) loads
only when no trajectory is in flight, so every trajectory runs on one version. The target:
never below the buffer's min_version; the source's newest when refreshing (laminar mode with
rollout.refresh_when_idle, or a RefreshRequest); in laminar mode with rollout.refill_versions = K,
a busy rollout keeps its version (and keeps taking prompts at it) until the newest is K ahead,
while an idle one takes the newest at once; a RefreshRequest's min_version while it is
worth waiting for (the relay chain may still be delivering it), after which the newest
version the source has is loaded instead of idling forever. A version the engine refuses
(WeightsRejected: a LoRA adapter that does not fit the model) is counted, logged as an error and
skipped: the engine keeps serving and labelling the version it had, and prompts served for the
refused one wait for a newer one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import structlog

from laminar.engines.base import Engine
from laminar.metrics import Metrics
from laminar.models.rejected import WeightsRejected
from laminar.weights.channel import WeightSubscriber, WeightsUnavailable


class VersionGate:
    def __init__(
        self,
        source: WeightSubscriber,
        engine: Engine,
        *,
        auto_refresh: bool,
        refill_versions: int = 0,
        refresh_wait_s: float,
        notify: Sequence[asyncio.Event],
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ):
        self.source, self.engine = source, engine
        self.notify = tuple(notify)
        """Set after each load (the status push: repack must see the new version at once)."""
        self.auto_refresh = auto_refresh
        """Laminar mode: load the source's newest whenever idle (other modes wait to be told)."""
        self.refill_versions = refill_versions
        """With auto_refresh: prompts still start at the loaded version while the newest is fewer
        than this many ahead (0: drain for anything newer)."""
        self.refresh_wait_s = refresh_wait_s
        self.metrics, self.log = metrics, log
        self.version = engine.version
        """The version loaded in the engine: every new trajectory runs at it."""
        self.required = 0
        """Lowest version new prompts may run at (the buffer's min_version, or a version prompts
        were served for)."""
        self.refresh_asked = False
        """A RefreshRequest asked for the newest version (cleared once at or past `required`)."""
        self._soft_min, self._soft_until = -1, 0.0
        """A RefreshRequest's min_version, waited for until _soft_until (then: the newest there
        is)."""
        self.rejected = -1
        """Newest version the engine refused (WeightsRejected): never offered again; prompts
        served for it wait for a newer one (feeder.py)."""
        self.lock = asyncio.Lock()
        """Held while the version may change; an import holds it so its version check stays true."""
        self.digests: dict[int, str] = {}
        """Digest of what the engine served after each recent load, by version."""
        self.quarantined = -1
        """A version whose served digest differed from the trainer's: reload it (-1: none)."""
        self.mismatches = 0
        """Loads whose served digest differed from the trainer's (NodeStatus.attest_mismatches)."""
        self._mismatched: set[int] = set()

    def latest(self) -> int:
        """Newest version the source offers (-1: none)."""
        return self.source.latest_version()

    def _soft(self) -> int:
        return self._soft_min if time.monotonic() < self._soft_until else -1

    def target(self, idle: bool = False) -> int:
        """The version new prompts should run at (`idle`: nothing is in flight here)."""
        want = self.required
        if self.refresh_asked:
            want = max(want, self.latest())
        elif self.auto_refresh:
            newest = self.latest()
            if idle or newest >= self.version + self.refill_versions:
                want = max(want, newest)
        return max(want, self._soft())

    def behind(self, idle: bool = False) -> bool:
        """Take no new prompts at the loaded version: drain (and load once nothing is in
        flight)."""
        return self.target(idle) > self.version or self.quarantined >= 0

    def digest(self, version: int) -> str:
        """The served digest at `version` ("" when not attested)."""
        return self.digests.get(version, "")

    def attest(self, expected: dict[int, str]) -> bool:
        """Compare the served digests of recent loads with the trainer's. Each mismatch is
        counted once; when it is the version running now, quarantine (reload once idle).
        Returns whether it quarantined now."""
        quarantine = False
        for version, have in self.digests.items():
            want = expected.get(version, "")
            if not want or want == have or version in self._mismatched:
                continue
            self._mismatched.add(version)
            self.mismatches += 1
            self.metrics.count("attest_mismatch")
            now = version == self.version and self.quarantined != version
            self.log.error(
                "weights_attest_mismatch",
                version=version,
                served=have,
                expected=want,
                action="quarantined: no new prompts, reload once idle" if now else "replaced",
            )
            if now:
                self.quarantined = version
                quarantine = True
        if quarantine:
            for evt in self.notify:
                evt.set()
        return quarantine

    def loadable(self) -> int:
        """The version a load would bring now (newer than ours and at least what is wanted), else
        -1."""
        available = self.latest()
        if self.quarantined >= 0 and available >= self.version:
            return available  # the same version again, or a newer one
        if available <= max(self.version, self.rejected) or available < max(
            self.required, self._soft()
        ):
            return -1
        return available

    def forget(self) -> None:
        """The engine lost its weights' values (a colocated sleep that dropped them): like a
        quarantined version, it is behind and the next load brings the newest, the version
        served now included."""
        self.quarantined = self.version

    def require(self, version: int) -> None:
        """New prompts must not run below `version` (hard: no deadline)."""
        if version > self.required:
            self.required = version
            self.source.announce(version)

    def ask(self, min_version: int) -> bool:
        """A manager RefreshRequest: load the newest (>= min_version, waited for refresh_wait_s)
        when idle. Returns whether a load is pending."""
        self.source.announce(min_version)
        if self.auto_refresh and self.refill_versions > 0:
            # the rollout's own rule decides (an idle one loads the newest at once, a busy one
            # within its refill budget finishes first): the request names a version, no more
            return self.behind()
        self._soft_min = max(self._soft_min, min_version)
        self._soft_until = time.monotonic() + self.refresh_wait_s
        self.refresh_asked = True
        return self.behind()

    def settle(self) -> None:
        """Nothing newer is wanted now: a past RefreshRequest is answered."""
        self.refresh_asked = False

    async def load(self) -> bool:
        """Load the source's newest version into the engine; False if it failed (retried later).
        The caller holds `lock` and has checked that nothing is in flight."""
        assert self.lock.locked()
        t0, old = time.monotonic(), self.version
        try:
            version = await self.source.load_into(self.engine)
        except WeightsUnavailable as exc:
            self.metrics.count("weight_load_failed")
            self.log.warning("weight_load_failed", error=str(exc))
            return False
        except WeightsRejected as exc:  # e.g. an adapter that fits no target: loud, never silent
            self.rejected = max(self.rejected, exc.version)
            self.metrics.count("weight_rejected")
            self.log.error(
                "weight_rejected", version=exc.version, serving=self.version, error=str(exc)
            )
            return False
        self.version = max(version, self.version)
        digest = await self.engine.served_digest()
        if digest is not None:  # read back from the engine, before any prompt runs at it
            self.digests[self.version] = digest
            self._mismatched.discard(self.version)  # a reload of it is checked afresh
            for old in sorted(self.digests)[:-8]:
                del self.digests[old]
        self.quarantined = -1
        for evt in self.notify:
            evt.set()
        load_s = time.monotonic() - t0
        self.metrics.add("weight_load_s", load_s)
        source = self.source.last_source or self.source.name
        self.metrics.count(f"weight_loads_{source}")
        self.log.info(
            "weights_loaded",
            version=self.version,
            previous=old,
            load_s=round(load_s, 3),
            source=source,
        )
        if self.version >= self.required:
            self.refresh_asked = False
        return True

    async def watch(self, wake: asyncio.Event) -> None:
        """Set `wake` whenever the source gets a newer version (the feeder may be waiting for
        one)."""
        seen = self.latest()
        while True:
            v = await self.source.wait_newer(seen, timeout=1.0)
            if v > seen:
                seen = v
                wake.set()
