"""A colocated rollout's half of the device time-share (cluster.placement=colocated).

    manager ──SleepRequest──► [share.sleep()]  feeder paused (no new prompts), queued groups
                                               retracted (held for the next version), in-flight
                                               trajectories finish and are delivered as usual,
                                               engine.sleep(): KV freed, weights to host memory
                                               (rollout_weights=drop: weights freed, no copy)
    manager ──WakeRequest(v)──► [share.wake(v)] engine.wake_up(), version v loaded on the device
                                               (dir / cuda_ipc: a local handoff), feeder resumed
                                               (after a drop the load is required, even of the
                                               version it served before: gate.forget())

In-flight trajectories are finished, not exported, at a sleep. Colocated runs are sync or
one_step: in sync nothing is in flight when the trainer's batch is complete (admission starts no
group past it), and in one_step only the next batch's groups are. Exporting those to the partial
pool would strand them: they were started at version v, and after the wake this rollout serves
v + 1, on which an import of a v trajectory is refused (one version per trajectory), so they
would be regenerated from scratch. Finishing them costs the trainer their tail and keeps every
token; the exactly-once journal sees an ordinary delivery.

While asleep an ImportRequest is refused (code "asleep"; the manager places the partials again
later) and the status says `asleep`. The part never sees the node: it takes the feeder, table,
gate and engine the node built.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from laminar.engines.base import Engine
from laminar.metrics import Metrics
from laminar.protocol.rollout import SleepReply, WakeReply
from laminar.rollout.deliver import Deliverer
from laminar.rollout.feeder import PromptFeeder
from laminar.rollout.sequences import SequenceTable
from laminar.rollout.versions import VersionGate

_DRAIN_POLL_S = 0.02
"""How often a drain looks at the table: sequences finish in the engine's event loop, which no
event here reports one by one (a poll with a deadline, off any hot path)."""


class SleepTimeout(TimeoutError):
    """In-flight trajectories did not finish within cluster.colocate.sleep_timeout_s."""


class DeviceShare:
    def __init__(
        self,
        *,
        engine: Engine,
        table: SequenceTable,
        gate: VersionGate,
        feeder: PromptFeeder,
        deliverer: Deliverer,
        wake: asyncio.Event,
        keep_weights: bool,
        sleep_timeout_s: float,
        wake_timeout_s: float,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ):
        self.engine, self.table, self.gate, self.feeder = engine, table, gate, feeder
        self.deliverer = deliverer
        self.wake_event = wake
        self.keep_weights = keep_weights
        """cluster.colocate.rollout_weights=offload; False (drop): freed at the sleep, the
        version loaded again at the wake."""
        self.sleep_timeout_s, self.wake_timeout_s = sleep_timeout_s, wake_timeout_s
        self.metrics, self.log = metrics, log
        self.asleep = False
        self._lock = asyncio.Lock()
        """One sleep or wake at a time (a manager retry must not interleave with the first)."""

    async def sleep(self) -> SleepReply:
        async with self._lock:
            if self.asleep:
                return SleepReply(drain_s=0.0, sleep_s=0.0)
            t0 = time.monotonic()
            self.feeder.paused = True
            before = self.table_finished()
            try:
                await self.feeder.retract_queued()
                deadline = t0 + self.sleep_timeout_s
                while self.table.seqs:
                    if time.monotonic() > deadline:
                        raise SleepTimeout(
                            f"{len(self.table.seqs)} trajectories still in flight after "
                            f"{self.sleep_timeout_s:g} s (cluster.colocate.sleep_timeout_s)"
                        )
                    await asyncio.sleep(_DRAIN_POLL_S)
                drain_s = time.monotonic() - t0
                async with self.gate.lock:  # no import or load between the drain and the sleep
                    slept = await self.engine.sleep(keep_weights=self.keep_weights)
            except BaseException:
                self.feeder.paused = False  # not asleep: go on generating
                self.wake_event.set()
                raise
            self.asleep = True
            self.metrics.add("colocate_drain_s", drain_s)
            self.metrics.add("colocate_sleep_s", slept.seconds)
            self.metrics.count("colocate_sleeps")
            finished = self.table_finished() - before
            self.log.info(
                "colocate_asleep",
                drain_s=round(drain_s, 4),
                sleep_s=round(slept.seconds, 4),
                weight_bytes=slept.weight_bytes,
                dropped_bytes=slept.dropped_bytes,
                kv_bytes=slept.kv_bytes,
                finished=finished,
            )
            return SleepReply(
                drain_s=drain_s,
                sleep_s=slept.seconds,
                weight_bytes=slept.weight_bytes,
                kv_bytes=slept.kv_bytes,
                finished=finished,
            )

    async def wake(self, min_version: int) -> WakeReply:
        async with self._lock:
            woke_s = handoff_s = 0.0
            weight_bytes = kv_bytes = 0
            if self.asleep:
                woke = await self.engine.wake_up()
                woke_s, weight_bytes, kv_bytes = woke.seconds, woke.weight_bytes, woke.kv_bytes
                self.asleep = False
                if woke.needs_load:  # dropped: the version it served must be loaded again too
                    self.gate.forget()
            t0 = time.monotonic()
            try:
                await self._load(min_version)
            finally:
                handoff_s = time.monotonic() - t0
                self.feeder.paused = False
                self.wake_event.set()
            self.metrics.add("colocate_wake_s", woke_s)
            self.metrics.add("colocate_handoff_s", handoff_s)
            self.metrics.count("colocate_wakes")
            self.log.info(
                "colocate_awake",
                version=self.gate.version,
                wake_s=round(woke_s, 4),
                handoff_s=round(handoff_s, 4),
                weight_bytes=weight_bytes,
            )
            return WakeReply(
                version=self.gate.version,
                wake_s=woke_s,
                handoff_s=handoff_s,
                weight_bytes=weight_bytes,
                kv_bytes=kv_bytes,
            )

    async def _load(self, min_version: int) -> None:
        """The trainer's new version into the engine, before any prompt runs (nothing is in
        flight: the rollout drained before it slept)."""
        deadline = time.monotonic() + self.wake_timeout_s
        self.gate.require(min_version)
        while self.gate.latest() < min_version:
            left = deadline - time.monotonic()
            if left <= 0:
                self.metrics.count("colocate_version_missing")
                self.log.warning(
                    "colocate_version_missing", want=min_version, have=self.gate.latest()
                )
                return  # the feeder loads it once it appears (the buffer requires it anyway)
            await self.gate.source.wait_newer(self.gate.latest(), timeout=min(left, 1.0))
        if self.gate.loadable() < 0:
            return
        async with self.gate.lock:
            if not self.table.seqs:
                await self.gate.load()

    def table_finished(self) -> int:
        return self.deliverer.finished_count
