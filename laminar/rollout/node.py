"""Rollout node: one generation engine fed from the buffer's prompt pool.

    buffer ──PromptReply(items)──► [pull loop] ──GenRequest(n)──► engine ──TokenEvents──► [event loop]
       ▲                             │ credits = groups in hand                │ every partial_chunk_tokens
       │                             │ load weights only when idle             ▼
       │◄──────PartialChunk (one-way, best-effort)────────────────────── [partials loop]
       │◄──────Trajectory (request, acked, resent until acked) ◄── [outbox] ◄── reward runner ◄── finished
    relay / run_dir/weights ──► WeightSource ──► engine.load_weights   (between groups, never mid-trajectory)
    manager ──Export/Import/RefreshRequest──► handlers ; heartbeat NodeStatus(version, kv_use, running, ...)

What blocks and what unblocks the pull loop (the only place weights change):
  * no free credit (cfg.rollout.credits groups in hand)    -> a group finishing or being exported
  * a newer version is wanted (laminar mode: the source has one; other modes: the
    buffer's min_version or a manager RefreshRequest)      -> stop asking for prompts, let every
    in-flight trajectory finish, load, then ask again. So every trajectory is generated
    on one version and a GRPO group never straddles two.
    The buffer's min_version is hard (no prompts below it, however long it takes to
    appear); a RefreshRequest's min_version is waited for rollout.refresh_wait_s, then
    the newest version the source has is loaded instead of idling forever.
  * a PromptRequest whose reply never came                   -> the same request (same
    request_id) is retried before anything else: the buffer may have served and journaled
    it, and gives the same groups back rather than losing them.
  * the buffer has nothing (retry_after_s) or is down       -> a timer / reconnect backoff

Manager commands: ExportRequest aborts trajectories in the engine and hands back
their PartialTrajectory (every token so far), forgetting them here; ImportRequest
resumes partials of this rollout's exact version (else ErrorReply version_mismatch),
idempotently (uids running or recently finished here are reported as duplicate);
RefreshRequest (above); these handlers and the partial streaming live in
laminar/rollout/commands.py. Heartbeats carry engine stats plus per-trajectory KV tokens
(extra["trajs"]) so repack can choose what to move; in laminar mode with repack on, the
status is also pushed as soon as it changes (a sequence finished, work came or left, new
weights; at most every rollout.status_push_min_s), because a plan made on a view a beat old
moves trajectories that finished meanwhile onto rollouts that refilled meanwhile.

Refill: an idle rollout that has a newer version to load asks the buffer for prompts (for
that version) while the load runs, so a drained or repack-emptied rollout is back to work
after the longer of the two round trips, not their sum; groups start only once it is loaded.

Tokens of each trajectory stream to the buffer's partial pool (see
laminar/rollout/tracking.py for the chunk contract); a finished trajectory gets its
reward (laminar/rewards/runner.py; sim engines: a uid hash) and goes through the
acked outbox (laminar/rollout/outbox.py), so a buffer that is away for a while
loses nothing and, deduplicating by uid, gets nothing twice. Stopping: no more
prompts, in-flight work gets half the stop budget to finish, partial chunks are
flushed (what is left unfinished is in the partial pool for recovery), then the
outbox is flushed.

Run: laminar node --role rollout --config configs/skeleton.yaml [--index I]
"""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from typing import Any

import numpy as np

from laminar.engines.base import Engine, GenRequest, SamplingParams, TokenEvent
from laminar.node import Node
from laminar.protocol.buffer import PromptReply, PromptRequest, TrajectoryAbandoned
from laminar.protocol.core import NodeStatus
from laminar.protocol.data import PromptItem
from laminar.protocol.rollout import (
    ExportRequest,
    ImportRequest,
    RefreshRequest,
)
from laminar.rollout.commands import RolloutCommands
from laminar.rollout.outbox import Outbox
from laminar.rollout.tracking import GroupState, SeqState
from laminar.rollout.weights import WeightSource, WeightSourceError, make_weight_source
from laminar.transport.sockets import RemoteError, TransportError

_RECENT = 8192
"""How many finished uids a rollout remembers, so a retried ImportRequest never generates one twice."""


class RolloutNode(RolloutCommands, Node):
    role = "rollout"

    def __init__(self, cfg: Any, index: int = 0, ctx: Any = None, node_id: str | None = None,
                 engine: Engine | None = None, weight_source: WeightSource | None = None):  # fmt: skip
        super().__init__(cfg, index, ctx, node_id)
        self.engine: Engine | None = engine
        self.source: WeightSource | None = weight_source
        self.version = 0
        self.seqs: dict[str, SeqState] = {}
        self.groups: dict[str, GroupState] = {}
        self.required_version = 0
        """Lowest version new prompts may run at (buffer min_version / manager RefreshRequest)."""
        self.refresh_requested = False
        self._soft_min, self._soft_until = -1, 0.0
        """A manager RefreshRequest's min_version, waited for until _soft_until (then: newest there is)."""
        self.auto_refresh = cfg.rollout.refresh_when_idle and cfg.mode == "laminar"
        self.params = SamplingParams.from_config(cfg.rollout.sampling)
        self.tokenizer: Any = None
        self.rewards: Any = None
        self.finished = 0
        self._wake = asyncio.Event()
        self._dirty: set[str] = set()
        self._dirty_evt = asyncio.Event()
        self._status_evt = asyncio.Event()
        """Set when something repack plans from changed: the status push loop sends it to the manager."""
        self._load_lock = asyncio.Lock()
        self._flush_lock = asyncio.Lock()
        self._reward_tasks: set[asyncio.Task] = set()
        self._recent: dict[str, None] = {}
        """uids that finished here lately (insertion-ordered, bounded)."""
        self._draining = False
        self._requests = 0
        self._incarnation = uuid.uuid4().hex[:8]
        """Makes request ids unique across restarts of this rollout id."""
        self._deferred: list[PromptItem] = []
        self._deferred_version = -1
        """Prompt groups served for a version not loaded yet (its load failed): started once it is."""
        self._idle_since: float | None = None
        self._exported_empty = False
        """Idle since when (monotonic), and whether an export emptied it: the refill latency metrics."""

    # ---- lifecycle --------------------------------------------------------------------
    async def setup(self) -> None:
        cfg, t = self.cfg, self.cfg.transport
        # the reward first: a bad reward.fn fails the node at once, with the fix in the message
        if cfg.rollout.engine != "sim" or cfg.reward.sim == "fn":
            from laminar.rewards.runner import RewardRunner

            self.rewards = RewardRunner.from_config(cfg)
            await self.rewards.start()
            self.on_close(self.rewards.close)
        self.buffer = self.client(cfg.endpoint("buffer"), on_connect=self._on_buffer_connect)
        await self.buffer.connect(timeout=t.startup_timeout_s)
        self._supervise(self.buffer)
        self.outbox = Outbox(self.buffer, self.log, cfg.rollout.outbox_concurrency, t.request_timeout_s,
                             t.reconnect_backoff_s, t.reconnect_backoff_max_s)  # fmt: skip
        if self.engine is None:
            from laminar.engines import make_engine

            # loading a torch model blocks for seconds: off the loop, so sibling nodes keep beating
            build = (
                asyncio.to_thread(make_engine, cfg)
                if cfg.rollout.engine == "torch"
                else _now(make_engine, cfg)
            )
            self.engine = await build
        await self.engine.start()
        self.version = self.engine.version
        self.on_close(self.engine.close)
        if self.source is None:
            self.source = make_weight_source(self)
        await self.source.start()
        self.on_close(self.source.close)
        if cfg.rollout.engine != "sim" and cfg.model.path:
            from laminar.models.tiny import load_tokenizer

            self.tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model.path)

    async def _register(self) -> None:
        await super()._register()
        assert self.manager is not None
        self.manager.on(ExportRequest, self._on_export)
        self.manager.on(ImportRequest, self._on_import)
        self.manager.on(RefreshRequest, self._on_refresh)

    async def main(self) -> None:
        self.spawn(self._event_loop(), "events")
        self.spawn(self._partials_loop(), "partials")
        self.spawn(self.outbox.run(), "outbox")
        self.spawn(self._version_watch(), "versions")
        if self.cfg.rollout.status_push and self.cfg.mode == "laminar" and self.cfg.manager.repack.enabled:
            self.spawn(self._status_push_loop(), "status-push")  # only repack plans from a fresh view
        await self._pull_loop()
        await asyncio.Event().wait()  # stopping: drain() runs while main is still alive

    async def drain(self) -> None:
        self._draining = True
        self._wake.set()
        budget = self.cfg.transport.stop_timeout_s * 0.9
        deadline = time.monotonic() + budget
        await self._until(lambda: not self.seqs, budget / 2)
        # unfinished ones: the partial pool gets every token, for recovery elsewhere
        for seq in self.seqs.values():
            if seq.length > seq.sent_upto or seq.sent_upto == 0:
                self._dirty.add(seq.uid)
        await self._flush_partials()
        if self._reward_tasks:
            await asyncio.wait(
                set(self._reward_tasks), timeout=max(0.0, deadline - time.monotonic())
            )
        ok = await self.outbox.flush(max(0.0, deadline - time.monotonic()))
        self.log.info(
            "drained", unfinished=len(self.seqs), outbox_left=len(self.outbox), flushed=ok
        )

    async def teardown(self) -> None:
        for t in list(self._reward_tasks):  # only left when the drain budget ran out
            t.cancel()
        if self._reward_tasks:
            await asyncio.wait(set(self._reward_tasks), timeout=2.0)

    async def _until(self, cond: Any, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not cond() and time.monotonic() < end:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, end - time.monotonic()))
            except TimeoutError:
                pass

    def status(self) -> NodeStatus:
        st = self.engine.stats() if self.engine is not None else None
        box = getattr(self, "outbox", None)
        extra: dict[str, Any] = {
            "groups": len(self.groups), "held": len(self._deferred),
            "credits_free": self.cfg.rollout.credits - len(self.groups) - len(self._deferred),
            "outbox": len(box) if box else 0, "outbox_oldest_s": round(box.oldest_age_s(), 3) if box else 0.0,
            "finished": self.finished, "target_version": self._target_version(),
            "tokens": st.tokens_generated if st else 0,
            "reward_errors": self.rewards.stats["errors"] if self.rewards is not None else 0,
            # per-trajectory KV (tokens held) lets the manager's repack pick what to move
            "trajs": {u: len(q.prompt_ids) + q.length for u, q in self.seqs.items()},
            "kv_capacity_tokens": int(getattr(self.engine, "capacity", 0) or 0),
            "t": round(time.time(), 4),  # when this was measured: the manager knows how old its view is
        }  # fmt: skip
        return NodeStatus(node_id=self.node_id, role=self.role, version=self.version,
                          kv_use=st.kv_use if st else 0.0, running=st.running if st else 0,
                          waiting=st.waiting if st else 0, inflight=len(self.seqs), extra=extra)  # fmt: skip

    # ---- pull loop: prompts in, weights between groups ---------------------------------------
    def _target_version(self) -> int:
        """The version new prompts should run at: never below the buffer's min_version (hard), the
        source's newest when refreshing, a RefreshRequest's min_version while it is worth waiting for."""
        latest = self.source.latest_version() if self.source is not None else -1
        want = self.required_version
        if self.auto_refresh or self.refresh_requested:
            want = max(want, latest)
        if time.monotonic() < self._soft_until:
            want = max(want, self._soft_min)
        return want

    async def _pull_loop(self) -> None:
        backoff = self.cfg.rollout.prompt_retry_s
        unanswered: PromptRequest | None = None
        while not (self.stopping.is_set() or self._draining):
            load: asyncio.Future | None = None
            # a request that may have been served is retried as is, before any weight load
            if unanswered is None:
                self._start_deferred()
                free = self.cfg.rollout.credits - len(self.groups) - len(self._deferred)
                declared = self.version
                if self._target_version() > self.version:
                    nxt = self._loadable()
                    if not self.seqs and nxt >= 0 and free > 0:
                        # idle and a newer version is there: ask for the prompts to run on it while
                        # it loads, so a refill (a drained or repack-emptied rollout) waits for the
                        # longer of the two round trips, not their sum; they start once it is loaded
                        # (the load takes the newest there is: never older than the version asked for)
                        load = asyncio.ensure_future(self._refresh())
                        load.add_done_callback(lambda _: self._start_deferred())  # held ones: at once, not after the reply
                        declared = nxt
                    else:
                        if not self.seqs and nxt >= 0 and await self._refresh():
                            continue
                        await self._wait(1.0)  # in-flight work drains, or the wanted version appears
                        continue
                else:
                    self.refresh_requested = False
                    if free <= 0:
                        await self._wait(1.0)
                        continue
                self._requests += 1
                unanswered = PromptRequest(rollout_id=self.node_id, max_groups=free, version=declared,
                                           request_id=f"{self._incarnation}-{self._requests}")  # fmt: skip
            t_req, idle = time.monotonic(), not self.seqs
            if idle and self._idle_since is not None and load is not None:
                self.metrics.add("refill_wake_s", t_req - self._idle_since)  # idle -> asking again
            failed: Exception | None = None
            try:
                reply = await self.buffer.request(unanswered, retries=0)
            except (TransportError, RemoteError) as exc:
                failed = exc
            if load is not None:
                await load  # the weights first: the groups must start on them
            if failed is not None:
                # the buffer may have served (and journaled) it before the reply was lost: the retry carries
                # the same request_id, so it gets those groups back instead of new ones
                self.metrics.count("prompt_request_failed")
                self.log.debug("prompt_request_failed", error=str(failed))
                await self._sleep(backoff)
                backoff = min(2 * backoff, self.cfg.transport.reconnect_backoff_max_s * 4)
                continue
            declared, unanswered = unanswered.version, None
            backoff = self.cfg.rollout.prompt_retry_s
            if idle:
                self.metrics.add("prompt_rtt_idle_s", time.monotonic() - t_req)
            if not isinstance(reply, PromptReply):
                self.metrics.count("bad_prompt_reply")
                self.log.warning("bad_prompt_reply", got=type(reply).__name__)
                await self._sleep(backoff)
                continue
            if reply.min_version > self.required_version:
                self.required_version = reply.min_version
                assert self.source is not None
                self.source.announce(reply.min_version)
            if self.version >= declared:
                for item in reply.items:
                    self._start_group(item)
            elif reply.items:
                # served for a version whose load failed (or an import slipped in first): they wait
                # for it (never run below the version they were asked for), and it is now required
                self.metrics.count("prompts_deferred", len(reply.items))
                self._deferred.extend(reply.items)
                self._deferred_version = max(self._deferred_version, declared)
                self.required_version = max(self.required_version, declared)
            if not reply.items and reply.min_version <= self.version:
                await self._sleep(reply.retry_after_s or backoff)

    def _start_deferred(self) -> None:
        """Start the groups held for a version once this rollout runs it (or a newer one)."""
        if self._deferred and self.version >= self._deferred_version:
            items, self._deferred = self._deferred, []
            for item in items:
                self._start_group(item)

    def _loadable(self) -> int:
        """The version a refresh would load now (newer than ours and at least what is wanted), else -1."""
        assert self.source is not None
        available = self.source.latest_version()
        soft = self._soft_min if time.monotonic() < self._soft_until else -1
        if available <= self.version or available < max(self.required_version, soft):
            return -1
        return available

    async def _wait(self, timeout: float) -> None:
        """Until something the pull loop waits on changed (or `timeout`, a safety net)."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass

    async def _sleep(self, seconds: float) -> None:
        """A timer (buffer said retry later / backoff) that a stop cuts short."""
        try:
            await asyncio.wait_for(self.stopping.wait(), seconds)
        except TimeoutError:
            pass

    async def _refresh(self) -> bool:
        """Load the newest weights now that nothing is in flight; False if none is loadable yet."""
        assert self.source is not None and self.engine is not None
        if self._loadable() < 0:
            return False
        async with self._load_lock:  # an import cannot slip in between the idle check and the load
            if self.seqs:
                return False
            t0 = time.monotonic()
            old = self.version
            try:
                version = await self.source.load_into(self.engine)
            except WeightSourceError as exc:
                self.metrics.count("weight_load_failed")
                self.log.warning("weight_load_failed", error=str(exc))
                return False
            self.version = max(version, self.version)
        self._status_evt.set()
        self.metrics.add("weight_load_s", time.monotonic() - t0)
        self.log.info(
            "weights_loaded",
            version=self.version,
            previous=old,
            load_s=round(time.monotonic() - t0, 3),
        )
        if self.version >= self.required_version:
            self.refresh_requested = False
        return True

    async def _version_watch(self) -> None:
        """Wake the pull loop when the source gets a newer version (it may be waiting for one)."""
        assert self.source is not None
        seen = self.source.latest_version()
        while True:
            v = await self.source.wait_newer(seen, timeout=1.0)
            if v > seen:
                seen = v
                self._wake.set()

    def _start_group(self, item: PromptItem) -> None:
        assert self.engine is not None
        if item.group_id in self.groups:  # served twice (a retried request): already running here
            self.metrics.count("duplicate_prompt_item")
            return
        if item.n < 1 or len(item.prompt_ids) == 0:
            self.metrics.count("bad_prompt_item")
            self.log.warning(
                "bad_prompt_item", group_id=item.group_id, n=item.n, prompt_len=len(item.prompt_ids)
            )
            for i in range(max(item.n, 0)):
                self.outbox.put(TrajectoryAbandoned(uid=f"{item.group_id}/{i}", group_id=item.group_id,
                                                    reason="bad prompt item"))  # fmt: skip
            return
        self._note_busy()
        now = time.time()
        group = GroupState(item.group_id)
        for i in range(item.n):
            seq = SeqState.from_item(item, i, self.version, now)
            self.seqs[seq.uid] = seq
            group.open.add(seq.uid)
        self.groups[item.group_id] = group
        req = GenRequest(item.group_id, np.asarray(item.prompt_ids, np.int32), self.params, n=item.n,
                         version=self.version)  # fmt: skip
        self.engine.submit(req)

    # ---- engine events -> partial chunks, finished trajectories ---------------------------
    async def _event_loop(self) -> None:
        assert self.engine is not None
        chunk = self.cfg.rollout.partial_chunk_tokens
        async for ev in self.engine.events():
            seq = self.seqs.get(ev.seq_id)
            if seq is None:  # exported (its abort event) or never ours
                self.metrics.count("stray_events")
                continue
            if ev.version != seq.version:
                self.metrics.count("version_mismatch_events")
                self.log.error(
                    "event_version_mismatch",
                    uid=seq.uid,
                    seq_version=seq.version,
                    ev_version=ev.version,
                )
            if len(ev.token_ids):
                seq.append(ev.token_ids, ev.logprobs, time.time())
            if ev.finished:
                self._finished(seq, ev)
            elif seq.length - seq.sent_upto >= chunk:
                self._mark_dirty(seq.uid)

    def _finished(self, seq: SeqState, ev: TokenEvent) -> None:
        if seq.exporting and ev.finish_reason == "abort":
            return  # the export handler owns it now
        self._forget(seq.uid)
        if ev.finish_reason == "abort":  # aborted by the engine itself: nobody will resume it
            self.metrics.count("engine_aborts")
            self.outbox.put(
                TrajectoryAbandoned(uid=seq.uid, group_id=seq.group_id, reason="engine abort")
            )
            return
        task = asyncio.ensure_future(self._deliver(seq, ev.finish_reason or "stop"))
        self._reward_tasks.add(task)
        task.add_done_callback(self._reward_done)

    def _reward_done(self, task: asyncio.Task) -> None:
        self._reward_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # a bug here must stop the node loudly, not lose the trajectory silently
            self._task_done(task)

    def _forget(self, uid: str, finished: bool = True) -> None:
        seq = self.seqs.pop(uid, None)
        self._dirty.discard(uid)
        if seq is None:
            return
        if (
            finished
        ):  # a retried import of it must not generate it twice (an exported one may come back)
            self._recent[uid] = None
            if len(self._recent) > _RECENT:
                del self._recent[next(iter(self._recent))]
        group = self.groups.get(seq.group_id)
        if group is not None:
            group.open.discard(uid)
            if not group.open:
                del self.groups[seq.group_id]
        if not self.seqs and self._idle_since is None:
            self._idle_since = time.monotonic()
        self._wake.set()
        self._status_evt.set()

    def _note_busy(self) -> None:
        """Work arrived: how long the engine sat idle (after an export: the repack refill latency)."""
        if self._idle_since is not None:
            gap = time.monotonic() - self._idle_since
            self.metrics.add("refill_after_export_s" if self._exported_empty else "idle_gap_s", gap)
            self._idle_since, self._exported_empty = None, False
        self._status_evt.set()

    async def _status_push_loop(self) -> None:
        """Send the status as soon as it changed, not only on the next beat: repack plans from it, and a
        plan made on a view up to a beat old moves trajectories that have finished meanwhile onto
        rollouts that have refilled or refreshed meanwhile. At most one push per status_push_min_s;
        changes in between go out together. Best effort: the beat timer still carries it."""
        gap = self.cfg.rollout.status_push_min_s
        while True:
            await self._status_evt.wait()
            self._status_evt.clear()
            mgr = self.manager
            if mgr is not None and mgr.connected:  # (else: reconnecting; the handshake and beats carry it)
                try:
                    await mgr.beat()
                    self.metrics.count("status_pushed")
                except Exception as exc:  # best effort (a socket being replaced, a full pipe): the beat follows
                    self.metrics.count("status_push_failed")
                    self.log.debug("status_push_failed", error=str(exc))
            await asyncio.sleep(gap)  # the rate bound (a timer): what changes meanwhile goes in the next push

    async def _deliver(self, seq: SeqState, reason: str) -> None:
        now = time.time()
        traj = seq.trajectory(reason, self.node_id, now)
        latest = self.source.latest_version() if self.source is not None else -1
        traj.staleness_at_finish = max(0, latest - seq.version)
        if self.tokenizer is not None:
            traj.completion = self.tokenizer.decode(
                traj.response_ids.tolist(), skip_special_tokens=True
            )
        if reason == "error":
            # the engine could not run it (e.g. prompt too long): delivered, excluded from training
            self.metrics.count("engine_errors")
            traj.reward, traj.reward_info = None, {"error": "engine error", "error_kind": "engine"}
        elif self.rewards is not None:
            res = await self.rewards.score(traj.prompt, traj.completion, traj.row)
            traj.reward, traj.reward_info = res.reward, dict(res.info)
            traj.timings["reward_s"] = res.seconds
            if res.failed:
                self.metrics.count("reward_failed")
        else:  # sim engine, no text: a deterministic coin from the uid, so groups have variance
            traj.reward = float(zlib.crc32(seq.uid.encode()) & 1)
        if traj.reward is not None:
            self.metrics.add("reward", traj.reward)
        self.metrics.add("response_tokens", len(traj.response_ids))
        self.finished += 1
        self.outbox.put(traj)


async def _now(fn: Any, *args: Any) -> Any:
    return fn(*args)
