"""The trajectories a rollout has in flight, grouped by GRPO group, and moving them in and out.

    table = SequenceTable(engine, params, notify=(wake, status_changed), metrics=...)
    table.start_group(item, version)        # n fresh samples -> engine.submit    (prompt feeder)
    seq = table.on_event(ev)                # tokens appended to their sequence   (engine events)
    table.forget(uid)                       # finished: its credit is free again
    partials, missing = await table.export(uids, rollout_id)   # abort in the engine, hand them over
    accepted, duplicate = table.resume(partials)               # imported partials -> engine.submit
    items = await table.retract(max_seqs)  # a newer version is wanted: take back groups not started
    table.mark_dirty(uid)                  # tokens for the partial stream (unsent, dirty)
    table.set_waiting(seq, True)           # multi-turn: out of the engine while its env step runs
    table.park(seq) / table.unpark(version)  # agents: a preempted sample waits for the next version
    states = await table.interrupt()       # mode partial, an update: all out of the engine
    table.continue_at(states, version)     # ... and back in, under the version just loaded

A group holds one credit until each of its samples here finished or left (export). uids
that finished here lately are remembered (bounded), so a retried import never generates a
trajectory twice. Every change of the set of sequences sets the `notify` events (the feeder
waits for a free credit or for idleness; the status push sends the new view to the manager).
Idle gaps are measured here: after an export emptied the table, the gap until work comes
back is the repack refill latency (`refill_after_export_s`), else `idle_gap_s`.

Retraction (rollout.retract_unstarted): a rollout holds more groups than its decode bound B
(rollout.credits x group_size > max_running), so the engine keeps a queue and a slot freed by
one finished sequence is taken by a queued one within the same decode step. Once a newer
version is wanted the rollout drains; the groups none of whose samples has made a token yet are
then taken back (`retract`: aborted in the engine, forgotten here, their PromptItems returned)
and started again once the new version is loaded, so the queue never drains at the old
version (every trajectory still runs at one version, a group never straddles two). A group
of which one sample did start stays, whole, at the old version.

Interrupt (mode partial, `interrupts=True`: AReaL's partial rollout): at a weight update the
rollout takes every sequence out of the engine (`interrupt`: aborted, kept here with every
token), loads the new version, and puts them back (`continue_at`): generation continues after
their tokens (the engine fills the KV prefix again) under the new version. A sequence's tokens
so far keep their version and logprobs; where the new version took over is recorded
(SeqState.runs, at the engine's own count of tokens, since the abort's last tokens may still be
on their way as events). Imports may then be of an older version too: they continue at this
rollout's (`resume(..., at_version=)`). Multi-turn episodes waiting on their environment are
not in the engine: their next turn goes in at whatever version the engine runs then.

Multi-turn (`multi_turn=True`: the rollout has an environment, laminar/rollout/episodes.py
drives it): a sequence between model turns is `waiting` (no engine sequence, its env step runs
in `seq.step_task`). It stays in the table (so weights never load under it: one version per
trajectory) but its group may stop counting as busy (`busy_groups`, see the feeder). Export
hands waiting ones over too: their step task is cancelled and the partial says
`awaiting_env` when the model turn was complete (the importer runs that step; its tool calls
hit the tools node's cache). Imported partials are not submitted here: they are admitted as
waiting and the episode driver rebuilds their environment state by replay first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import structlog

from laminar.engines.base import Engine, GenRequest, PartialState, SamplingParams, TokenEvent
from laminar.metrics import Metrics
from laminar.protocol.data import PartialTrajectory, PromptItem
from laminar.rollout.tracking import GroupState, SeqState
from laminar.vision.images import ImageLimits
from laminar.vision.store import ImageCache

RECENT = 8192
"""How many finished uids a rollout remembers, so a retried ImportRequest never generates one
twice."""


class SequenceTable:
    def __init__(
        self,
        engine: Engine,
        params: SamplingParams,
        notify: Sequence[asyncio.Event],
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        multi_turn: bool = False,
        interrupts: bool = False,
        images: ImageCache | None = None,
    ):
        self.engine, self.params = engine, params
        self.images = images if images is not None else ImageCache(ImageLimits())
        """The images of the prompts running here, by digest (checked; vision-language models)."""
        self.on_start: Callable[[list[SeqState]], None] | None = None
        """Set when a driver starts fresh samples itself (black-box agents: laminar/rollout/
        agents.py): `start_group` hands it the new sequences instead of submitting them."""
        self.on_unpark: Callable[[list[SeqState]], None] | None = None
        """Black-box agents: parked (preempted) samples, now at the version just loaded, go back
        to the driver (`unpark`)."""
        self.multi_turn = multi_turn
        """The rollout has an environment: sequences carry loss masks, imports wait for a replay."""
        self.interrupts = interrupts
        """Mode partial: trajectories continue across versions (interrupt, continue_at; imports
        of an older version continue at this rollout's)."""
        self.interrupting = False
        """Between `interrupt` and `continue_at`: the engine's version is changing."""
        self._deferred: list[tuple[SeqState, SamplingParams]] = []
        """Multi-turn turns submitted meanwhile (`submit_turn`): they go in at the new version."""
        self.notify = tuple(notify)
        self.metrics, self.log = metrics, log
        self.seqs: dict[str, SeqState] = {}
        self.groups: dict[str, GroupState] = {}
        self._recent: dict[str, None] = {}
        """uids that finished here lately (insertion-ordered, bounded)."""
        self.unsent: set[str] = set()
        """uids with tokens (or a header) the partial pool has not got yet; the deliverer streams
        them."""
        self.dirty = asyncio.Event()
        """Set by `mark_dirty`: the partial stream has something to send."""
        self._empty = asyncio.Event()
        self._empty.set()
        self._idle_since: float | None = None
        self._exported_empty = False
        self._retract_aborts: dict[str, int] = {}
        """uid -> abort events still to come from `retract` (not a sequence's end)."""

    def __len__(self) -> int:
        return len(self.seqs)

    def _changed(self) -> None:
        if self.seqs:
            self._empty.clear()
        else:
            self._empty.set()
        for evt in self.notify:
            evt.set()

    def _busy(self) -> None:
        """Work arrived: how long the engine sat idle (after an export: the repack refill
        latency)."""
        if self._idle_since is not None:
            gap = time.monotonic() - self._idle_since
            self.metrics.add("refill_after_export_s" if self._exported_empty else "idle_gap_s", gap)
            self._idle_since, self._exported_empty = None, False

    def idle_for(self) -> float | None:
        """Seconds since the table last emptied (None: busy)."""
        return None if self._idle_since is None else time.monotonic() - self._idle_since

    # ---- in ---------------------------------------------------------------------------
    def images_of(self, seq: SeqState) -> tuple[bytes, ...]:
        """A sequence's images from the cache (an import fetched missing ones first)."""
        return tuple(self.images.get(d) for d in seq.image_digests)

    def start_group(self, item: PromptItem, version: int) -> bool:
        """Start n samples of a prompt at `version`; False if the group runs here already (a retried
        request served it twice). The caller rejects malformed items (see `is_valid`)."""
        if item.group_id in self.groups:
            self.metrics.count("duplicate_prompt_item")
            return False
        self._busy()
        now = time.time()
        group = GroupState(item.group_id, item=item, started=time.monotonic())
        for i in range(item.n):
            seq = SeqState.from_item(item, i, version, now, self.multi_turn)
            self.seqs[seq.uid] = seq
            group.open.add(seq.uid)
        self.groups[item.group_id] = group
        if self.on_start is not None:
            self.on_start([self.seqs[u] for u in sorted(group.open)])
            self._changed()
            return True
        self.engine.submit(
            GenRequest(
                item.group_id,
                np.asarray(item.prompt_ids, np.int32),
                self.params,
                n=item.n,
                version=version,
                images=tuple(item.images),
            )
        )
        self._changed()
        return True

    def resume(
        self, partials: Iterable[PartialTrajectory], at_version: int | None = None
    ) -> tuple[list[str], list[str]]:
        """Resume imported partials (already checked to be at the engine's version; mode partial:
        at or below `at_version`, and they continue at it). Returns (accepted, duplicate): uids
        running or recently finished here are left alone. Multi-turn: accepted ones are admitted
        `waiting`, not submitted; the episode driver adopts them."""
        accepted, duplicate = [], []
        now = time.time()
        for p in partials:
            if p.uid in self.seqs or p.uid in self._recent:
                duplicate.append(p.uid)
                continue
            self._busy()
            seq = SeqState.from_partial(p, now, self.multi_turn)
            if at_version is not None:
                seq.continue_at(at_version)
            self.seqs[seq.uid] = seq
            self.groups.setdefault(seq.group_id, GroupState(seq.group_id)).open.add(seq.uid)
            if self.multi_turn:
                seq.waiting = True  # the episode driver replays its environment, then resumes it
            else:
                state = PartialState(
                    seq.uid,
                    seq.prompt_ids,
                    seq.ids.copy(),
                    seq.logprobs.copy(),
                    seq.current_version,
                    images=self.images_of(seq),
                )
                self.engine.submit(GenRequest.resume(state, self.params))
            # header + every token so far: the partial pool now knows it runs here
            self.mark_dirty(seq.uid)
            accepted.append(seq.uid)
        if accepted:
            self._changed()
        return accepted, duplicate

    def on_event(self, ev: TokenEvent) -> SeqState | None:
        """Append an engine event's tokens to its sequence; None when it is not ours (exported)."""
        if ev.finished and ev.finish_reason == "abort" and ev.seq_id in self._retract_aborts:
            # a retraction's abort: the sequence went back into the engine, or was taken back
            # and may run here again (same uid) at the next version; either way not its end
            left = self._retract_aborts.pop(ev.seq_id) - 1
            if left:
                self._retract_aborts[ev.seq_id] = left
            return None
        seq = self.seqs.get(ev.seq_id)
        if seq is None:  # exported (its abort event) or never ours
            self.metrics.count("stray_events")
            return None
        expected = seq.version_at(seq.length) if len(ev.token_ids) else seq.current_version
        if ev.version != expected:
            self.metrics.count("version_mismatch_events")
            self.log.error(
                "event_version_mismatch",
                uid=seq.uid,
                seq_version=expected,
                ev_version=ev.version,
            )
        if len(ev.token_ids):
            seq.append(ev.token_ids, ev.logprobs, time.time())
        if ev.routes is not None and not seq.add_routes(ev.route_start, ev.routes):
            self.metrics.count("routes_gap")
        return seq

    # ---- out --------------------------------------------------------------------------
    def forget(self, uid: str, finished: bool = True) -> None:
        seq = self.seqs.pop(uid, None)
        self.unsent.discard(uid)
        if seq is None:
            return
        # a retried import of a finished one must not generate it twice (an exported one may come
        # back)
        if finished:
            self._recent[uid] = None
            if len(self._recent) > RECENT:
                del self._recent[next(iter(self._recent))]
        group = self.groups.get(seq.group_id)
        if group is not None:
            group.open.discard(uid)
            if not group.open:
                del self.groups[seq.group_id]
        if not self.seqs and self._idle_since is None:
            self._idle_since = time.monotonic()
        self._changed()

    async def export(
        self, uids: list[str], rollout_id: str
    ) -> tuple[list[PartialTrajectory], list[str]]:
        """Abort these trajectories (empty: all) in the engine and hand back each with every token
        so far, forgetting them here. Returns (partials, requested uids not exported)."""
        uids = uids or list(self.seqs)
        here = [u for u in uids if u in self.seqs and not self.seqs[u].exporting]
        partials: list[PartialTrajectory] = []
        # waiting episodes (between turns, or replaying): no engine sequence; their step stops here
        # and the importer runs it again (its tool calls answered from the tools node's cache)
        for u in [u for u in here if self.seqs[u].waiting]:
            waiting = self.seqs[u]
            if waiting.step_task is not None:
                waiting.step_task.cancel()
                waiting.step_task = None
            partials.append(
                waiting.partial(waiting.ids.copy(), waiting.logprobs.copy(), rollout_id)
            )
            self.metrics.count("exported_waiting")
            self.forget(u, finished=False)
        here = [u for u in here if u in self.seqs]
        for u in here:
            self.seqs[u].exporting = True
        states = await self.engine.abort(here) if here else []
        by_id = {p.seq_id: p for p in states}
        for u in here:
            seq = self.seqs.get(u)
            p = by_id.get(u)
            if seq is None:  # finished (final event handled) while the abort was on its way
                continue
            if p is None and seq.waiting:
                # its turn ended while the abort was on its way: it went to an env step, which saw
                # it exporting and stood down, so it leaves as a waiting episode (the importer runs
                # that step; tool calls are answered from the tools node's cache)
                if seq.step_task is not None:
                    seq.step_task.cancel()
                    seq.step_task = None
                partials.append(seq.partial(seq.ids.copy(), seq.logprobs.copy(), rollout_id))
                self.metrics.count("exported_waiting")
                self.forget(u, finished=False)
                continue
            if p is None:
                # finished inside the engine before the abort: its queued final event completes it
                # here
                seq.exporting = False
                continue
            partials.append(seq.partial(p.output_ids, p.logprobs, rollout_id))
            self.forget(u, finished=False)
        if partials and not self.seqs:
            self._exported_empty = True
            self.metrics.count("emptied_by_export")
        exported = {p.uid for p in partials}
        return partials, [u for u in uids if u not in exported]

    async def retract(self, max_seqs: int) -> list[PromptItem]:
        """Take back the youngest groups none of whose samples has made a token (single-turn
        groups started here, at most `max_seqs` sequences: the engine's queue), for a start at a
        newer version. Returns their PromptItems, in the order they were started. A sample that
        turns out to have started (tokens came back with the abort) goes straight back into the
        engine with its group's others, at the same version, and that group stays."""
        if self.multi_turn or max_seqs <= 0:
            return []
        picked: list[GroupState] = []
        n = 0
        for g in sorted(self.groups.values(), key=lambda g: g.started, reverse=True):
            seqs = [self.seqs[u] for u in g.open if u in self.seqs]
            if (
                g.item is None
                or len(seqs) != g.item.n
                or n + len(seqs) > max_seqs
                or any(q.length or q.exporting for q in seqs)
            ):
                continue
            picked.append(g)
            n += len(seqs)
        if not picked:
            return []
        uids = [u for g in picked for u in sorted(g.open)]
        for u in uids:
            self.seqs[u].exporting = True  # an export or the event loop leaves them to us meanwhile
        states = {p.seq_id: p for p in await self.engine.abort(uids)}
        for u in states:
            self._retract_aborts[u] = self._retract_aborts.get(u, 0) + 1
        items: list[PromptItem] = []
        for g in picked:
            members = [u for u in sorted(g.open) if u in self.seqs]
            mine = [states.get(u) for u in members]
            if len(members) == len(g.open) and all(
                p is not None and not len(p.output_ids) for p in mine
            ):
                for u in members:
                    self.forget(u, finished=False)
                assert g.item is not None
                items.append(g.item)
                continue
            # one of them started (or finished meanwhile): the group stays at this version, whole
            for u, p in zip(members, mine, strict=True):
                seq = self.seqs[u]
                seq.exporting = False
                if p is None:
                    # finished in the engine before the abort: its final event completes it
                    continue
                self.engine.submit(GenRequest.resume(p, self.params))
            self.metrics.count("retract_kept_group")
        if items:
            self.metrics.count("retracted_groups", len(items))
        return items[::-1]

    async def interrupt(self) -> list[PartialState]:
        """Mode partial, an update is due: take every sequence in the engine out (aborted), keeping
        it here with its tokens; `continue_at` puts them back once the new version is loaded. Their
        abort events are not their end (ignored as a retraction's are)."""
        uids = [u for u, q in self.seqs.items() if not q.waiting and not q.exporting]
        self.interrupting = True  # a turn submitted from here on waits for the new version
        if not uids:
            return []
        for u in uids:
            self.seqs[u].exporting = True  # an export leaves them to us meanwhile
        states = await self.engine.abort(uids)
        for p in states:
            self._retract_aborts[p.seq_id] = self._retract_aborts.get(p.seq_id, 0) + 1
        for u in uids:
            if u in self.seqs:
                self.seqs[u].exporting = False
        self.metrics.count("interrupted", len(states))
        return states

    def continue_at(self, states: list[PartialState], version: int) -> None:
        """Put interrupted sequences back into the engine, generating under `version` from the
        engine's count of their tokens on (their last tokens may still be on their way as events:
        those keep the version that sampled them)."""
        for p in states:
            seq = self.seqs.get(p.seq_id)
            if seq is None:
                continue  # finished in the engine before the abort: its final event completed it
            seq.continue_at(version, at=len(p.output_ids))
            p.version = version
            req = GenRequest.resume(p, p.params or self.params)  # a model turn keeps its own caps
            if self.multi_turn:
                req.turn, req.turn_start = seq.turn, seq.turn_start
            self.engine.submit(req)
        self.interrupting = False
        deferred, self._deferred = self._deferred, []
        for seq, params in deferred:
            if seq.uid in self.seqs:
                self.submit_turn(seq, params)

    def submit_turn(self, seq: SeqState, params: SamplingParams) -> None:
        """Multi-turn: the sequence's next model turn into the engine, after every token it holds
        (mode partial: at the engine's version, held back while an interrupt swaps it)."""
        if self.interrupting:
            self._deferred.append((seq, params))
            return
        if self.interrupts:
            seq.continue_at(self.engine.version)
        req = GenRequest(
            seq.uid,
            seq.prompt_ids,
            params,
            n=1,
            version=seq.current_version,
            resume_ids=seq.ids.copy(),
            resume_logprobs=seq.logprobs.copy(),
            single=True,
            turn=seq.turn,
            turn_start=seq.turn_start,
            images=self.images_of(seq),
        )
        self.engine.submit(req)

    async def wait_empty(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
        except TimeoutError:
            return False
        return True

    # ---- parked samples (black-box agents preempted for a weight load) ----------------------
    def holds_weights(self) -> bool:
        """Something here must finish at the loaded version before another loads: any sequence
        but a parked one (it has no tokens, and starts again at whatever version comes next)."""
        return any(not q.parked for q in self.seqs.values())

    def park(self, seq: SeqState) -> None:
        """A waiting sample with no tokens gives up its version: it stays here (its group keeps
        its place) but no longer holds the weights."""
        assert seq.waiting and seq.length == 0, "only an empty, waiting sample can be parked"
        seq.parked = True
        self._changed()  # the feeder may load now

    def unpark(self, version: int) -> None:
        """A version was loaded: parked samples start again at it (the driver relaunches them;
        their partial record restarts with a header at this version)."""
        seqs = [q for q in self.seqs.values() if q.parked]
        if not seqs:
            return
        for q in seqs:
            q.parked, q.version, q.sent_upto = False, version, 0
            self.mark_dirty(q.uid)
        if self.on_unpark is not None:
            self.on_unpark(seqs)
        self._changed()

    # ---- what the partial pool has not got yet --------------------------------------------
    def set_waiting(self, seq: SeqState, waiting: bool) -> None:
        """Multi-turn: the sequence left the engine for an env step (True) or went back (False)."""
        seq.waiting = waiting
        if not waiting:
            seq.step_task = None
        self._changed()  # a group whose open samples all wait frees its credit (the feeder)

    def busy_groups(self) -> int:
        """Groups with a sample in the engine (or about to be): what credits count. A group whose
        open samples all wait on their environment does not (see laminar/rollout/feeder.py)."""
        if not self.multi_turn:
            return len(self.groups)
        seqs = self.seqs
        return sum(
            1 for g in self.groups.values() if any(not seqs[u].waiting for u in g.open if u in seqs)
        )

    def mark_dirty(self, uid: str) -> None:
        self.unsent.add(uid)
        self.dirty.set()

    def restream_all(self) -> None:
        """A (re)connected buffer may have lost the partial records: restream each from offset 0."""
        for seq in self.seqs.values():
            seq.sent_upto = 0
            self.unsent.add(seq.uid)
        self.dirty.set()

    def mark_unsent(self) -> None:
        """Stopping: every sequence with tokens (or a header) the pool has not got is sent once
        more."""
        for seq in self.seqs.values():
            if (
                seq.length > seq.sent_upto
                or seq.sent_upto == 0
                or seq.awaiting_env != seq.sent_awaiting
            ):
                self.unsent.add(seq.uid)

    def kv_tokens(self) -> dict[str, int]:
        """uid -> tokens it holds in the KV cache (prompt + generated): what repack moves."""
        return {u: len(q.prompt_ids) + q.length for u, q in self.seqs.items()}


def is_valid(item: PromptItem) -> bool:
    return item.n >= 1 and len(item.prompt_ids) > 0
