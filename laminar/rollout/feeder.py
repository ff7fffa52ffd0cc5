"""The prompt feeder: asks the buffer for prompt groups when there is room, and loads new
weights in between (the only place a rollout's version changes).

    buffer ──PromptReply(items)──► [feeder.run()] ──table.start_group──► engine
                                     │ credits = groups in hand (rollout.credits)
                                     └─ gate.load() only when the table is empty

What blocks and what unblocks the loop:
  * no free credit                                       -> a group finishing or being exported
  * a newer version is wanted (gate.target() > version)  -> stop asking for prompts, let every
    in-flight trajectory finish, load, then ask again (black-box agents: an episode whose
    agent sits silent meanwhile is preempted and starts again at the new version, `on_drain`).
    So every trajectory is generated on one version and a GRPO group never straddles two.
    With rollout.refill_versions = K (mode laminar) a busy rollout wants the newest only once
    it is K versions ahead: until then it refills at its version, as the paper's rollout
    finishes its batch before it pulls; an idle one loads the newest at once.
  * a PromptRequest whose reply never came                -> the same request (same request_id)
    is retried before anything else: the buffer may have served and journaled it, and gives
    the same groups back rather than losing them.
  * the buffer has nothing (retry_after_s) or is down     -> a timer / reconnect backoff

Credits and multi-turn episodes: a group holds a credit while one of its samples is in the
engine. A group whose open samples all wait on their environment (a tool call, a replay)
holds none, so the engine takes other work meanwhile; a hard cap of 2 x credits on the
groups in hand (waiting or not) bounds the environment work and memory one rollout piles
up. Waiting episodes still count as in flight for weights: a load waits for them (one
version per trajectory; see laminar/rollout/episodes.py).

Mode partial (SequenceTable.interrupts): a newer version does not wait for a drain. Every
sequence in the engine is interrupted, the version loaded, and the sequences put back under it
(`interrupt`, under the gate's lock so no import or prompt start slips in between): AReaL's
partial rollout. `interrupt_on_update` does it as soon as the version is loadable, also while
this loop waits on a prompt reply (the update reaches every rollout at once, not after a
round trip); groups that arrive meanwhile start once it is done, at the new version.

Queue and retraction: with rollout.refill_slots (credits per sequence) a rollout asks for a
group whenever its unfinished sequences leave room for one within refill_slots; set above the
decode bound B the engine keeps the extra samples queued, and a slot one finished sequence
frees is taken from that queue in the same decode step (per-group credits give the same queue
with credits x group_size > B, but a credit comes back only when a whole group finished).
Once a newer version is wanted (the drain), the groups that never started are taken back
(rollout.retract_unstarted, SequenceTable.retract) and held for the new version: they start
first once it is loaded, so the queue never runs at the old one.

Refill: an idle rollout that has a newer version to load asks the buffer for prompts (for
that version) while the load runs, so a drained or repack-emptied rollout is back to work
after the longer of the two round trips, not their sum; the groups start once it is loaded.
Groups served for a version whose load then failed are held (`held`) until it is loaded.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import structlog

from laminar.config import RolloutConfig
from laminar.metrics import Metrics
from laminar.protocol.buffer import PromptReply, PromptRequest
from laminar.protocol.data import PromptItem
from laminar.rollout.deliver import Deliverer
from laminar.rollout.sequences import SequenceTable, is_valid
from laminar.rollout.versions import VersionGate
from laminar.supervise import Spawn
from laminar.transport.client import RpcClient
from laminar.transport.sockets import RemoteError, TransportError
from laminar.vision.images import BadImage


class PromptFeeder:
    def __init__(
        self,
        rollout_id: str,
        cfg: RolloutConfig,
        *,
        backoff_max_s: float,
        buffer: RpcClient,
        gate: VersionGate,
        table: SequenceTable,
        deliverer: Deliverer,
        wake: asyncio.Event,
        spawn: Spawn,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ):
        self.rollout_id, self.cfg, self.backoff_max_s = rollout_id, cfg, backoff_max_s
        self.buffer, self.gate, self.table, self.deliverer = buffer, gate, table, deliverer
        self.wake = wake
        """Set by whatever the loop may be waiting on: a credit freed, a new version, a refresh
        asked."""
        self.spawn = spawn
        self.metrics, self.log = metrics, log
        self.held: list[PromptItem] = []
        self._held_version = -1
        """Prompt groups served for a version not loaded yet (its load failed): started once it
        is."""
        self.loading = False
        self.on_drain: Callable[[], None] | None = None
        """Called while a drain waits on in-flight work (black-box agents: the driver preempts
        episodes only a silent agent holds, agent.preempt_idle_s)."""
        """A weight load runs (bench/cluster_run.py's breakdown samples it)."""
        self.paused = False
        """Colocated placement: the rollout sleeps (or is going to): ask for no prompts and load
        nothing (laminar/rollout/colocate.py)."""
        self._stop = asyncio.Event()
        self._requests = 0
        self._incarnation = uuid.uuid4().hex[:8]
        """Makes request ids unique across restarts of this rollout id."""

    def free_credits(self) -> int:
        slots = self.cfg.refill_slots
        if slots is not None:  # per sequence: room for whole groups among the unfinished ones
            held = sum(item.n for item in self.held)
            open_seqs = len(self.table.seqs) - self._waiting_seqs() + held
            free = max(0, slots - open_seqs) // self.cfg.group_size
            if self.table.multi_turn:
                free = min(free, 2 * self.cfg.credits - len(self.table.groups) - len(self.held))
            return free
        busy = self.cfg.credits - self.table.busy_groups() - len(self.held)
        cap = 2 * self.cfg.credits - len(self.table.groups) - len(self.held)
        return min(busy, cap)

    def _waiting_seqs(self) -> int:
        """Multi-turn: episodes waiting on their environment hold no decode slot (bounded by the
        2 x credits cap on groups in hand instead, see the module docstring)."""
        if not self.table.multi_turn:
            return 0
        return sum(1 for q in self.table.seqs.values() if q.waiting)

    def stop(self) -> None:
        """No more prompts (stopping): the loop ends at its next turn, timers are cut short."""
        self._stop.set()
        self.wake.set()

    async def run(self) -> None:
        backoff = self.cfg.prompt_retry_s
        unanswered: PromptRequest | None = None
        while not self._stop.is_set():
            load: asyncio.Task[bool] | None = None
            # a request that may have been served is retried as is, before any weight load
            if unanswered is None and self.paused:
                await self._wait(1.0)  # until the wake (it sets `wake`)
                continue
            if unanswered is None:
                self._start_held()
                free = self.free_credits()
                declared = self.gate.version
                holding = self.table.holds_weights()
                if self.gate.behind(idle=not holding):
                    nxt = self.gate.loadable()
                    if self.table.interrupts and self.table.seqs and nxt >= 0:
                        # mode partial: no drain, the in-flight ones continue under the new version
                        await self.interrupt()
                        continue
                    if not holding and nxt >= 0 and free > 0:
                        # idle and a newer version is there: ask for the prompts to run on it while
                        # it loads, so a refill (a drained or repack-emptied rollout) waits for the
                        # longer of the two round trips, not their sum; they start once it is loaded
                        # (the load takes the newest there is: never older than the version asked
                        # for)
                        load = self.spawn(self._load_then_start_held(), "weights-load")
                        declared = nxt
                    else:
                        if holding and self.cfg.retract_unstarted:
                            await self._retract()
                        if holding and self.on_drain is not None:
                            self.on_drain()  # agents: preempt episodes only a silent agent holds
                        if not self.table.holds_weights() and nxt >= 0 and await self.refresh():
                            continue
                        # until in-flight work drains, or the wanted version appears
                        await self._wait(1.0)
                        continue
                else:
                    self.gate.settle()
                    if free <= 0:
                        await self._wait(1.0)
                        continue
                    if self.gate.latest() > declared:  # rollout.refill_versions at work
                        self.metrics.count("refill_behind_newest")
                self._requests += 1
                unanswered = PromptRequest(
                    rollout_id=self.rollout_id,
                    max_groups=free,
                    version=declared,
                    request_id=f"{self._incarnation}-{self._requests}",
                )
            t_req, idle = time.monotonic(), not self.table.seqs
            idle_s = self.table.idle_for()
            if idle and idle_s is not None and load is not None:
                self.metrics.add("refill_wake_s", idle_s)  # idle -> asking again
            failed: Exception | None = None
            try:
                reply = await self.buffer.request(unanswered, retries=0)
            except (TransportError, RemoteError) as exc:
                failed = exc
            if load is not None:
                await load  # the weights first: the groups must start on them
            if failed is not None:
                # the buffer may have served (and journaled) it before the reply was lost: the retry
                # carries the same request_id, so it gets those groups back instead of new ones
                self.metrics.count("prompt_request_failed")
                self.log.debug("prompt_request_failed", error=str(failed))
                await self._sleep(backoff)
                backoff = min(2 * backoff, self.backoff_max_s * 4)
                continue
            declared, unanswered = unanswered.version, None
            backoff = self.cfg.prompt_retry_s
            if idle:
                self.metrics.add("prompt_rtt_idle_s", time.monotonic() - t_req)
            if not isinstance(reply, PromptReply):
                self.metrics.count("bad_prompt_reply")
                self.log.warning("bad_prompt_reply", got=type(reply).__name__)
                await self._sleep(backoff)
                continue
            self.gate.require(reply.min_version)
            items = list(reply.items)
            if self.table.interrupts and items:
                async with self.gate.lock:  # not while an interrupt swaps the version under them
                    if self.gate.version >= declared:
                        for item in items:
                            self._start(item)
                        items = []
            if self.gate.version >= declared:
                for item in items:
                    self._start(item)
            elif items:
                # served for a version whose load failed (or an import slipped in first): they wait
                # for it (never run below the version they were asked for), and it is now required
                self.metrics.count("prompts_deferred", len(items))
                self.held.extend(items)
                self._held_version = max(self._held_version, declared)
                self.gate.require(declared)
            if not reply.items and reply.min_version <= self.gate.version:
                await self._sleep(reply.retry_after_s or backoff)

    async def refresh(self) -> bool:
        """Load the newest weights now that nothing is in flight; False if none is loadable yet."""
        if self.gate.loadable() < 0:
            return False
        async with self.gate.lock:  # an import cannot slip in between the idle check and the load
            if self.table.holds_weights():
                return False
            self.loading = True
            try:
                loaded = await self.gate.load()
            finally:
                self.loading = False
            if loaded:
                self.table.unpark(self.gate.version)
            return loaded

    async def interrupt(self) -> bool:
        """Mode partial: take every sequence out of the engine, load the newest version, and put
        them back to continue under it (under the previous version if the load failed)."""
        async with self.gate.lock:  # no import between the interrupt and the resubmission
            if self.gate.loadable() < 0:
                return False
            self.loading = True
            t0 = time.monotonic()
            try:
                states = await self.table.interrupt()
                loaded = await self.gate.load()
                self.table.continue_at(states, self.gate.version)
            finally:
                self.loading = False
            self.metrics.add("interrupt_s", time.monotonic() - t0)
            return loaded

    async def interrupt_on_update(self, new_version: asyncio.Event) -> None:
        """Mode partial: interrupt as soon as a newer version is loadable (`new_version` is set
        by the gate's watch), not when this loop next comes round."""
        while True:
            await new_version.wait()
            new_version.clear()
            if self.table.seqs and self.gate.behind() and self.gate.loadable() >= 0:
                await self.interrupt()
                self.wake.set()

    async def _load_then_start_held(self) -> bool:
        loaded = await self.refresh()
        self._start_held()  # held ones: at once, not after the prompt reply
        return loaded

    async def retract_queued(self) -> None:
        """Colocated sleep: take back the groups that never started (held for the next
        version, like a drain's)."""
        if self.cfg.retract_unstarted and self.table.seqs:
            await self._retract()

    async def _retract(self) -> None:
        """Draining for a newer version: take back the queued groups that never started; they are
        held for the next version (`held`), and start first once it is loaded."""
        queued = self.table.engine.stats().waiting
        if queued <= 0:
            return
        items = await self.table.retract(queued)
        if items:
            self.held.extend(items)
            self._held_version = max(self._held_version, self.gate.version + 1)

    def _start_held(self) -> None:
        """Start the groups held for a version once this rollout runs it (or a newer one)."""
        # (or once no newer version is wanted any more: a RefreshRequest's soft wait ran out)
        if self.held and (self.gate.version >= self._held_version or not self.gate.behind()):
            items, self.held = self.held, []
            for item in items:
                self._start(item)

    def _start(self, item: PromptItem) -> None:
        if not is_valid(item):
            self.metrics.count("bad_prompt_item")
            self.log.warning(
                "bad_prompt_item", group_id=item.group_id, n=item.n, prompt_len=len(item.prompt_ids)
            )
            for i in range(max(item.n, 0)):
                self.deliverer.abandon(f"{item.group_id}/{i}", item.group_id, "bad prompt item")
            return
        if item.image_digests:  # checked once per group: digests, bounds, decodable
            try:
                self.table.images.add_item(item.image_digests, item.images)
            except BadImage as exc:
                self.metrics.count("bad_images")
                self.log.warning("bad_prompt_images", group_id=item.group_id, error=str(exc))
                for i in range(max(item.n, 0)):
                    self.deliverer.abandon(f"{item.group_id}/{i}", item.group_id, "bad image")
                return
        self.table.start_group(item, self.gate.version)

    async def _wait(self, timeout: float) -> None:
        """Until something the loop waits on changed (or `timeout`, a safety net)."""
        self.wake.clear()
        try:
            await asyncio.wait_for(self.wake.wait(), timeout)
        except TimeoutError:
            pass

    async def _sleep(self, seconds: float) -> None:
        """A timer (buffer said retry later / backoff) that a stop cuts short."""
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            pass
