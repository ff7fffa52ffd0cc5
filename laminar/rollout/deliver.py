"""Everything a rollout sends to the buffer: partial chunks, finished and abandoned trajectories.

    table.mark_dirty(uid) ──► [deliverer.stream()] ──PartialChunk (one-way, best-effort)──► buffer partial pool
    deliverer.finished(seq, reason) ──► spawn(reward) ──► outbox.put(Trajectory) ──(acked, resent)──► buffer
    deliverer.abandon(uid, group_id, why) ──────────────► outbox.put(TrajectoryAbandoned)

Partial chunks follow the contract in laminar/rollout/tracking.py; one sender at a time, or
a chunk could go out twice. A chunk that cannot be sent stays marked and goes again (the
final Trajectory is the acked copy, so nothing depends on chunks arriving). A finished
trajectory gets its reward (laminar/rewards/runner.py; sim engines without a reward
function: a deterministic coin from the uid, so groups have variance) in its own supervised
task, so a slow reward never holds up the engine's events, and a bug in it stops the node
loudly rather than losing the trajectory. The acked outbox (laminar/rollout/outbox.py)
delivers each one at least once; the buffer deduplicates by uid.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import TYPE_CHECKING, Any

import structlog

from laminar.metrics import Metrics
from laminar.protocol.buffer import TrajectoryAbandoned
from laminar.rollout.outbox import Outbox
from laminar.rollout.sequences import SequenceTable
from laminar.rollout.tracking import SeqState
from laminar.supervise import Spawn
from laminar.transport.client import RpcClient
from laminar.transport.weights_channel import WeightSubscriber

EnvScore = tuple[float | None, dict[str, Any]]
"""A multi-turn episode's reward as its environment gave it: (reward or None, info)."""

if TYPE_CHECKING:  # imported by the node only when a reward function is configured
    from laminar.rewards.runner import RewardRunner


class Deliverer:
    def __init__(self, rollout_id: str, buffer: RpcClient, outbox: Outbox, table: SequenceTable,
                 source: WeightSubscriber, rewards: RewardRunner | None, tokenizer: Any, spawn: Spawn,
                 metrics: Metrics, log: structlog.typing.FilteringBoundLogger):  # fmt: skip
        self.rollout_id = rollout_id
        self.buffer, self.outbox, self.table = buffer, outbox, table
        self.source, self.rewards = source, rewards
        self.tokenizer = tokenizer
        """A HF tokenizer (torch/vllm engines with a model), or None: completions stay empty."""
        self.spawn = spawn
        self.metrics, self.log = metrics, log
        self.finished_count = 0
        self._scoring: set[asyncio.Task[Any]] = set()
        self._flush_lock = asyncio.Lock()

    # ---- partial chunks --------------------------------------------------------------------
    async def stream(self) -> None:
        """The partial stream: sends whatever the table marked, whenever it marks something."""
        while True:
            await self.table.dirty.wait()
            self.table.dirty.clear()
            await self.flush_partials()

    async def flush_partials(self) -> None:
        async with self._flush_lock:  # one sender at a time, or a chunk could go out twice
            await self._flush()

    async def _flush(self) -> None:
        table = self.table
        for uid in list(table.unsent):
            seq = table.seqs.get(uid)
            table.unsent.discard(uid)
            if seq is None or (
                seq.length == seq.sent_upto
                and seq.sent_upto > 0
                and seq.awaiting_env == seq.sent_awaiting
            ):
                continue
            if not self.buffer.connected:
                table.unsent.add(uid)  # kept: resent from 0 on reconnect anyway
                continue
            msg, upto = seq.chunk(self.rollout_id)
            try:
                await asyncio.wait_for(self.buffer.send(msg), 1.0)
            except Exception as exc:  # best-effort stream: the final Trajectory is the acked copy
                self.metrics.count("partial_send_failed")
                self.log.debug("partial_send_failed", uid=uid, error=f"{type(exc).__name__}: {exc}")
                table.unsent.add(uid)
                return
            seq.sent_upto = max(seq.sent_upto, upto)
            seq.sent_awaiting = msg.awaiting_env
            self.metrics.count("partial_chunks")

    # ---- finished, abandoned ------------------------------------------------------------------
    def abandon(self, uid: str, group_id: str, reason: str) -> None:
        """Nobody will finish it (a bad prompt item, an engine abort): the buffer drops its group."""
        self.outbox.put(TrajectoryAbandoned(uid=uid, group_id=group_id, reason=reason))

    def finished(self, seq: SeqState, reason: str, env_score: EnvScore | None = None) -> None:
        """A trajectory the engine (or its episode) finished, already forgotten by the table: reward,
        then deliver. `env_score`: the environment scored it, (reward, info); None: reward.fn."""
        if reason == "abort":  # aborted by the engine itself: nobody will resume it
            self.metrics.count("engine_aborts")
            self.abandon(seq.uid, seq.group_id, "engine abort")
            return
        task = self.spawn(self._deliver(seq, reason, env_score), "reward")
        self._scoring.add(task)
        task.add_done_callback(self._scoring.discard)

    async def _deliver(self, seq: SeqState, reason: str, env_score: EnvScore | None) -> None:
        now = time.time()
        traj = seq.trajectory(reason, self.rollout_id, now)
        traj.staleness_at_finish = max(0, self.source.latest_version() - seq.version)
        if self.tokenizer is not None:
            traj.completion = self.tokenizer.decode(
                traj.response_ids.tolist(), skip_special_tokens=True
            )
        if env_score is not None:  # the episode's environment scored it (errors included)
            traj.reward, traj.reward_info = env_score[0], dict(env_score[1])
        elif reason == "error":
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
        self.finished_count += 1
        self.outbox.put(traj)

    async def drain(self, timeout: float) -> bool:
        """Stopping: every partial chunk out, every reward scored, the outbox acked (within
        `timeout`); True when the outbox emptied."""
        deadline = time.monotonic() + timeout
        self.table.mark_unsent()  # unfinished ones: the partial pool gets every token, for recovery elsewhere
        await self.flush_partials()
        if self._scoring:
            await asyncio.wait(set(self._scoring), timeout=max(0.0, deadline - time.monotonic()))
        return await self.outbox.flush(max(0.0, deadline - time.monotonic()))
