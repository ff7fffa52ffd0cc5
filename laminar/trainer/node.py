"""Trainer node: pulls whole-group batches from the buffer, takes one optimizer step per
batch, publishes every new version, commits what it consumed, checkpoints.

    laminar node --role trainer --config FILE                       (one process)
    torchrun --nproc_per_node N -m laminar node --role trainer ...  (FSDP2; rank 0 talks)

    buffer ──BatchReply──► feed.ask ──► trainer.prepare / .step / .export   (worker thread)
                                          │ ranks 1..N-1 run each collective too (follower.py)
                                          ▼
            version += 1 ─► commits.consumed (consumed.jsonl) ─► commits.record (a commit is owed)
                          ─► handoff (relay tier | safetensors dir | announce): the export streamed
                             into the relay's slot tensor by tensor as it gathers (publish_streamed)
                          ─► version mark, snapshot (each snapshot_every), VersionPublished
                             ─► manager
                          ─► commits.flush: BatchCommit ─► buffer  (commit=step; commit=checkpoint:
                             after the checkpoint that holds the step)
                          ─► metrics.jsonl / completions.jsonl / tb / wandb
                          ─► every eval_every steps: greedy validation on data.eval (evaluation.py)
                          ─► every checkpoint_every steps: checkpoint (sharded + checkpoint_async:
                             the step loop goes on once it is staged; it lands in the background,
                             then its gated commits go out)

Colocated placement (cluster.placement=colocated, docs/colocated.md): the trainer drives the
device time-share. Its state waits in host memory while the rollout generates; once a batch is
complete it asks the manager for the device (DeviceRequest: the rollout drains and sleeps), brings
its state back, steps, publishes (and checkpoints / validates when due, while it holds the device),
offloads, and gives the device back (DeviceRelease: the rollout wakes and loads the version).

Parts (none sees this node): protocol.py (the `Trainer` protocol: TorchTrainer or SimTrainer,
chosen once by factory.py), feed.py (BatchRequest long-poll, restart flag), evaluation.py,
logger.py, commits.py (exactly-once: owed commits, frontier, version mark), snapshots.py,
follower.py (ranks > 0), and the weights channel's publisher (laminar/weights/channel.py).

What blocks: the step compute (off the event loop, so heartbeats flow) and the
handoff (`publish` returns once the weights are handed off). What does not: the
rollouts, which keep generating on older versions meanwhile. Every network wait has
a deadline; an empty reply is asked again; the loop checks `stopping` between steps.
Before a request that re-queues in-flight batches (restart), every step already in the
weights is committed (checkpointing first in commit=checkpoint mode). A trainer resumed
from a checkpoint older than the last published version re-publishes its weights as the
next version (see commits.py), so no version number names two weight sets.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from laminar.config import LoraConfig
from laminar.node import NODE_STATUS, Node
from laminar.protocol.buffer import (
    AuditSummary,
    BatchReply,
    BufferStats,
    BufferStatsRequest,
    ImageBlobs,
    ImageFetch,
)
from laminar.protocol.core import NodeStatus
from laminar.protocol.data import Trajectory
from laminar.protocol.trainer import VersionPublished
from laminar.supervise import PermanentFailure
from laminar.trainer.attest import AttestBook
from laminar.trainer.commits import CommitLedger, VersionMark
from laminar.trainer.factory import open_trainer
from laminar.trainer.feed import BatchFeed
from laminar.trainer.protocol import PendingSave, Trainer
from laminar.trainer.settings import TrainerNodeSettings
from laminar.trainer.snapshots import Snapshots
from laminar.transport.client import RpcClient
from laminar.transport.sockets import Context, RemoteError, TransportError
from laminar.vision.images import BadImage
from laminar.vision.store import ImageCache
from laminar.weights.digest import weights_digest

if TYPE_CHECKING:
    import torch

    from laminar.protocol.relay import WeightLayout
    from laminar.trainer.dist import DistContext
    from laminar.trainer.evaluation import Evaluator
    from laminar.trainer.logger import MetricsLogger
    from laminar.weights.channel import Published, WeightPublisher
    from laminar.weights.sink import VersionSink

T = TypeVar("T")


def audit_metrics(a: AuditSummary | None) -> dict[str, float]:
    """The buffer's per-length audit as audit/* keys (nothing before its first)."""
    if a is None:
        return {}

    def num(x: float | None) -> float:
        return math.nan if x is None else x

    return {
        "audit/long_vs_short": num(a.long_vs_short),
        "audit/long_kept": num(a.long_kept),
        "audit/short_kept": num(a.short_kept),
        "audit/long_token_share_generated": num(a.long_token_share_generated),
        "audit/long_token_share_trained": num(a.long_token_share_trained),
        "audit/long_min_tokens": float(a.long_min_tokens),
        "audit/dropped": float(a.dropped),
    }


def _expected_digest(items: list[tuple[str, Any]], lora: LoraConfig | None) -> str:
    """The digest a rollout's engine must serve for this version ("" for none: sim rollouts).
    LoRA: of the adapter as engines multiply by it (models/lora.py served_factors)."""
    if not items:
        return ""
    if lora is not None:  # imports torch: not for the sim trainer
        from laminar.models.lora import served_factors

        items = served_factors(items, lora)
    return weights_digest(items)


_STATUS_COLOCATE = (
    "colocate/sleep_s",
    "colocate/wake_s",
    "colocate/handoff_s",
    "colocate/drain_s",
    "colocate/trainer_offload_s",
    "colocate/trainer_onload_s",
    "colocate/trainer_offload_bytes",
    "colocate/rollout_offload_bytes",
)
"""The colocate/* keys the trainer's status carries (the rest are in metrics.jsonl)."""


class NothingTrained(PermanentFailure):  # a restart would fail the same way
    """The data ran out before a single step was trained (e.g. every reward failed): the run
    failed, and the node exits non-zero with the buffer's reason (`laminar run` exits 1)."""


class TrainerNode(Node):
    role = "trainer"
    # rank 0 only (set up in setup(): the other ranks are not on the cluster network)
    buffer: RpcClient
    feed: BatchFeed
    commits: CommitLedger

    def __init__(self, settings: TrainerNodeSettings, ctx: Context | None = None):
        super().__init__(settings.node, ctx)
        self.settings = settings
        self.rank = settings.rank
        self.registers_with_manager = self.rank == 0  # only rank 0 is on the cluster network
        self.run_dir = settings.run_dir
        self.step = 0
        self.version = 0
        self.trainer: Trainer | None = None
        self.dist: DistContext | None = None
        self.handoff: WeightPublisher | None = None
        self.logger: MetricsLogger | None = None
        self.evaluator: Evaluator | None = None
        self._evaluated_step = -1
        self.mark = VersionMark(self.run_dir)
        self.snapshots = Snapshots(self.run_dir, settings.train.trainer.snapshot_every)
        self._step_lock = asyncio.Lock()
        self._republish = False
        self._last_ckpt_step = 0  # step 0 is the initial model: nothing to checkpoint
        self._durable_step = 0
        """The newest checkpoint on disk (a checkpoint in flight is not)."""
        self._landing: asyncio.Task[None] | None = None
        self._checkpoint_metrics: dict[str, float] = {}
        self._followers_done = asyncio.Event()
        self.last: dict[str, float] = {}
        self.attest = AttestBook()

    @property
    def exhausted(self) -> bool:
        """The buffer said no data will ever come (data.epochs done): finish like total_steps."""
        return self.rank == 0 and self.feed.exhausted

    # ---- lifecycle -------------------------------------------------------------------------
    async def setup(self) -> None:
        # torch takes seconds to import: on the worker thread, so nodes sharing this loop keep
        # beating
        s = self.settings
        opened = await self.compute(open_trainer, s.train, self.run_dir)
        self.trainer, self.dist = opened.trainer, opened.dist
        if self.rank != 0:
            return
        from laminar.trainer.logger import MetricsLogger, wandb_init_kwargs
        from laminar.weights.factory import open_publisher

        tc = s.train.trainer
        self.buffer = self.client(s.buffer)
        self.feed = BatchFeed(
            self.buffer,
            tc,
            s.transport,
            trainer_id=self.node_id,
            stopping=self.stopping,
            metrics=self.metrics,
            log=self.log,
        )
        self.commits = CommitLedger(
            self.buffer,
            tc.commit,
            self.run_dir,
            stopping=self.stopping,
            backoff_s=s.transport.reconnect_backoff_max_s,
            metrics=self.metrics,
            log=self.log,
        )
        if opened.meta is not None:
            self._resume(opened.meta, opened.checkpoint)
        # tensorboard/wandb imports take a while: off the loop, before any socket needs heartbeats
        wandb = wandb_init_kwargs(s.logging, s.run_name, s.run_config)
        self.logger = await self.compute(MetricsLogger, self.run_dir, wandb, log=self.log)
        from laminar.trainer.evaluation import open_evaluator

        self.evaluator = await self.compute(open_evaluator, s.eval, self.log)
        if self.evaluator is not None:
            await self.evaluator.start()
        await self.buffer.connect(timeout=s.transport.startup_timeout_s)
        self.handoff = open_publisher(s.channel, self.wiring())
        await self.handoff.start()

    def _resume(self, meta: dict[str, Any], ckpt: Path | None) -> None:
        self.step = int(meta["step"])
        self.version = int(meta["version"])
        self._last_ckpt_step = self._durable_step = self.step
        self.commits.restore(meta.get("frontier", {}))
        published = self.mark.read()
        if published > self.version:  # versions after the checkpoint were published, then lost
            self.version = published
            self._republish = True
        self.log.info(
            "resumed",
            checkpoint=str(ckpt),
            step=self.step,
            version=self.version,
            uncommitted=len(self.commits.owed),
        )

    async def main(self) -> None:
        assert self.trainer is not None and self.dist is not None
        if self.rank != 0:
            from laminar.trainer.follower import follow

            await self.compute(
                follow,
                self.trainer,
                self.dist,
                self.run_dir,
                self.settings.train.trainer.keep_checkpoints,
            )
            self._followers_done.set()
            self.request_stop("rank 0 said stop")
            return
        total = self.settings.train.trainer.total_steps
        if self._republish:
            self.version += 1
            await self._publish(await self.compute(self.trainer.export))
        if self.evaluator is not None and self.step == 0:
            await self._validate()  # the starting point of the eval curve
        if self.settings.colocate is not None:  # the rollout generates first: give it the device
            await self._offload()
        while self.step < total and not self.stopping.is_set():
            reply = await self._next_batch()
            if reply is None:
                break
            async with self._step_lock:
                if self.stopping.is_set():
                    break  # not trained, not committed: the buffer serves it again after a restart
                await self._train_on(reply)
            colocated = self.settings.colocate is not None  # (both done in the device window)
            if (
                not colocated
                and self.evaluator is not None
                and self.evaluator.due(self.step, total)
            ):
                await self._validate()
            every = self.settings.train.trainer.checkpoint_every
            if not colocated and every and self.step % every == 0:
                async with self._step_lock:
                    await self._checkpoint("periodic")
        if self.step >= total or self.exhausted:
            async with self._step_lock:
                await self._checkpoint("final")
            why = "data exhausted" if self.step < total else "total_steps"
            if self.step == 0:
                raise NothingTrained(await self._why_nothing_trained())
            self.request_stop(f"done: {self.step} steps ({why})")
        elif self.stopping.is_set():
            # a stop that came during the last step: main may end before the node gets to
            # drain(), which would then be skipped; the second of the two is a no-op
            async with self._step_lock:
                await self._checkpoint("stop")

    async def _why_nothing_trained(self) -> str:
        """The buffer's view of why no group ever became trainable (its warnings and drop
        counts)."""
        text = "trained 0 steps: the data ran out and no group was ever trainable"
        try:
            reply = await self.buffer.request(BufferStatsRequest(), timeout=5.0, retries=1)
        except Exception as exc:  # noqa: BLE001 - the failure stands without the buffer's detail
            return f"{text} (buffer stats unavailable: {type(exc).__name__})"
        if not isinstance(reply, BufferStats):
            return f"{text} (the buffer answered {type(reply).__name__}, not BufferStats)"
        counts = reply.counts
        dropped = ", ".join(
            f"{k.removeprefix('dropped_')}: {v}"
            for k, v in sorted(counts.items())
            if k.startswith("dropped_") and v
        )
        stored, unusable = counts.get("trajectories", 0), counts.get("unusable", 0)
        text += (
            f"; {stored} trajectories stored, {unusable} without a usable reward, "
            f"{counts.get('groups_dropped', 0)} groups dropped ({dropped or 'none'})"
        )
        if reply.warnings:
            text += "; buffer: " + " | ".join(f"{k}: {v}" for k, v in reply.warnings.items())
        self.log.error("nothing_trained", reason=text)
        return text

    async def drain(self) -> None:
        if self.rank != 0:
            await self._followers_done.wait()  # rank 0 drives the last collectives and the stop
            return
        async with self._step_lock:  # an in-flight step (and its commit) finishes first
            await self._checkpoint("stop")

    async def teardown(self) -> None:
        if self.handoff is not None:
            await self.handoff.close()
        if self.evaluator is not None:
            await self.evaluator.close()
        if self.logger is not None:
            self.logger.close()
        if self.trainer is not None:
            await self.compute(self.trainer.close)

    def status(self) -> NodeStatus:
        extra: dict[str, Any] = {"step": self.step, "engine": self.settings.train.trainer.engine}
        for k in ("tokens_per_s", "step_s", "reward", "loss"):
            if k in self.last:
                extra[k] = self.last[k]
        for k in _STATUS_COLOCATE:  # colocated: the last cycle (`laminar status` COLOCATE line)
            if k in self.last:
                extra[k] = round(self.last[k], 4)
        return NodeStatus(
            node_id=self.node_id,
            role=self.role,
            version=self.version,
            staleness=self.last.get("staleness", 0.0),
            extra=extra,
        )

    # ---- the step ------------------------------------------------------------------------
    async def _next_batch(self) -> BatchReply | None:
        while not self.stopping.is_set():
            if self.feed.restart and self.commits.owed:
                await self._commit_before_restart()
            reply = await self.feed.ask(self.version)
            if reply is not None:
                return reply
            if self.feed.exhausted:
                return None
        return None

    async def _batch_images(self, trajs: list[Trajectory]) -> dict[str, bytes] | None:
        """The images of a batch's prompts, fetched from their owner (the buffer) by digest and
        checked against it (docs/vision.md); one that fails drops its trajectories
        ("image_missing"). None: a text batch."""
        need = list(dict.fromkeys(d for t in trajs for d in t.image_digests))
        if not need:
            return None
        cache = ImageCache(self.settings.image_limits, max_images=len(need))
        try:
            reply = await self.buffer.request(ImageFetch(digests=need))
        except (TransportError, RemoteError, TimeoutError) as exc:
            self.log.warning("batch_images_failed", count=len(need), error=str(exc))
            return {}
        if not isinstance(reply, ImageBlobs):
            return {}
        for d, data in zip(reply.digests, reply.data, strict=True):
            try:
                cache.add_fetched([d], [data])
            except BadImage as exc:
                self.metrics.count("bad_images")
                self.log.warning("bad_batch_image", digest=d, error=str(exc))
        return {d: cache.get(d) for d in need if not cache.missing([d])}

    async def _train_on(self, reply: BatchReply) -> None:
        from laminar.algo.metrics import staleness_histogram
        from laminar.trainer.batch import token_staleness
        from laminar.trainer.logger import sample_completions

        assert self.trainer is not None and self.logger is not None
        t0 = time.perf_counter()
        attested, rejected = await self.attest.check(reply.trajectories)
        if rejected:
            self.metrics.count("attest_excluded", len(rejected))
            self.log.warning(
                "attest_excluded",
                batch_id=reply.batch_id,
                trajectories=len(rejected),
                rollouts=sorted({r for r, _ in self.attest.mismatched}),
            )
        batch = self.trainer.prepare(attested, await self._batch_images(attested))
        for reason, n in batch.dropped.items():
            self.metrics.count(f"dropped_{reason}", n)
        if batch.dropped:
            self.log.warning("dropped_trajectories", batch_id=reply.batch_id, **dict(batch.dropped))
        if batch.n_seqs == 0:  # nothing trainable: consume it so it is not served forever
            if rejected:
                self.commits.consumed(
                    self.step, self.version, reply.batch_id, [], rejected, rejected
                )
            self.commits.record(reply.batch_id, self.step, self.version)
            if not self.commits.gated:
                await self.commits.flush()
            return
        staleness = [self.version - s.version for s in batch.samples]
        cycle: dict[str, float] = {}
        if self.settings.colocate is not None:
            cycle = await self._take_device()
        metrics = await self.compute(self.trainer.step, batch)
        # streamed into the handoff as it gathers, unless this version is snapshotted (the
        # snapshot needs it whole) or the trainer cannot name its shapes before exporting
        streamed = not self.snapshots.due(self.version + 1)
        layout = await self.compute(self.trainer.stream_layout) if streamed else None
        weights: dict[str, torch.Tensor] | None = None
        export_s = 0.0
        if layout is None:
            t_export = time.perf_counter()
            weights = await self.compute(self.trainer.export)
            export_s = time.perf_counter() - t_export
        self.step += 1
        self.version += 1
        trained = [s.uid for s in batch.samples]
        kept = set(trained)
        excluded = [t.uid for t in batch.source if t.uid not in kept] + rejected
        self.commits.consumed(self.step, self.version, reply.batch_id, trained, excluded, rejected)
        self.commits.record(reply.batch_id, self.step, self.version)
        t_publish = time.perf_counter()
        if weights is not None:
            push_s, push_bytes = await self._publish(weights)
        else:
            assert layout is not None
            export_s, push_s, push_bytes = await self._publish_streamed(layout)
        # what the step loop waited for the version: the export, the handoff, the attestation
        # digest, a snapshot when due, the announcement (NaN: the version was not published)
        published_s = time.perf_counter() - t_publish
        stall_s = (export_s if weights is not None else 0.0) + published_s
        if not math.isfinite(push_s):
            stall_s = math.nan
        if self.settings.colocate is not None:
            cycle.update(await self._give_device())
        if not self.commits.gated:
            await self.commits.flush()
        step_s = time.perf_counter() - t0
        metrics.update(
            {
                "version": self.version,
                "step_s": step_s,
                "push_s": push_s,
                "push_bytes": push_bytes,
                "export_s": export_s,
                "weights_stall_s": stall_s,
                "tokens_per_s": metrics["tokens_total"] / max(metrics["compute_s"], 1e-9),
                "staleness": sum(staleness) / len(staleness),
                "staleness_max": max(staleness),
                "dropped": float(sum(batch.dropped.values())),
                "attest/excluded": len(rejected),
                "attest/excluded_total": self.attest.excluded,
                "attest/mismatched_rollouts": len(self.attest.mismatched),
            }
        )
        metrics.update(staleness_histogram(staleness))
        metrics.update(token_staleness(self.version - 1, batch.samples))
        metrics.update(
            {
                "buffer/version": reply.version,
                "buffer/groups": len(reply.group_ids),
                "buffer/trajectories": len(reply.trajectories),
                "buffer/requeued_groups": reply.requeued_groups,
                "buffer/partial_groups": reply.partial_groups,
            }
        )
        metrics.update(self._refusal_metrics())
        metrics.update(self._checkpoint_metrics)
        self._checkpoint_metrics = {}
        metrics.update(audit_metrics(reply.audit))
        metrics.update(cycle)
        self.last = metrics
        if self.step % self.settings.train.trainer.log_every == 0:
            self.logger.log(self.step, metrics)
        self.logger.log_completions(
            self.step,
            sample_completions(
                reply.trajectories,
                self.settings.train.trainer.completions_per_step,
                self.step,
                self.version,
            ),
        )
        self.log.info(
            "step",
            step=self.step,
            version=self.version,
            loss=round(metrics.get("loss", math.nan), 5),
            reward=round(metrics["reward"], 4),
            step_s=round(step_s, 3),
        )

    # ---- colocated placement: the device time-share ------------------------------------------
    async def _take_device(self) -> dict[str, float]:
        """The rollout sleeps (the manager asks it: drained, KV freed, weights to host), then the
        trainer's state comes back on the device. Returns the colocate/* metrics so far."""
        from laminar.protocol.trainer import DeviceGrant, DeviceRequest

        assert self.manager is not None and self.trainer is not None
        cc = self.settings.colocate
        assert cc is not None
        t0 = time.perf_counter()
        out: dict[str, float] = {}
        try:
            grant = await self.manager.request(
                DeviceRequest(version=self.version), timeout=cc.sleep_timeout_s + 30.0, retries=0
            )
        except (TransportError, RemoteError) as exc:  # the manager restarts: train anyway
            self.metrics.count("colocate_sleep_failed")
            self.log.warning("colocate_sleep_failed", error=str(exc))
            grant = None
        if isinstance(grant, DeviceGrant):
            out.update(
                {
                    "colocate/drain_s": grant.drain_s,
                    "colocate/sleep_s": grant.sleep_s,
                    "colocate/rollout_offload_bytes": float(grant.weight_bytes),
                    "colocate/kv_freed_bytes": float(grant.kv_bytes),
                    "colocate/rollouts_asleep": float(grant.rollouts),
                    "colocate/sleep_failed": float(len(grant.failed)),
                }
            )
        out["colocate/acquire_s"] = time.perf_counter() - t0
        back = await self.compute(self.trainer.onload)
        out["colocate/trainer_onload_s"] = back.seconds
        out["colocate/trainer_onload_bytes"] = float(back.nbytes)
        return out

    async def _give_device(self) -> dict[str, float]:
        """After the publish: validation and the periodic checkpoint when due (they need the
        state on the device), offload, then the rollout wakes and loads the new version."""
        from laminar.protocol.trainer import DeviceRelease, DeviceReleased

        assert self.manager is not None
        cc = self.settings.colocate
        assert cc is not None
        tc = self.settings.train.trainer
        if self.evaluator is not None and self.evaluator.due(self.step, tc.total_steps):
            await self._validate()
        if tc.checkpoint_every and self.step % tc.checkpoint_every == 0:
            await self._checkpoint("periodic")
        out = await self._offload()
        t0 = time.perf_counter()
        try:
            woke = await self.manager.request(
                DeviceRelease(version=self.version), timeout=cc.wake_timeout_s + 30.0, retries=0
            )
        except (TransportError, RemoteError) as exc:
            self.metrics.count("colocate_wake_failed")
            self.log.warning("colocate_wake_failed", error=str(exc))
            woke = None
        if isinstance(woke, DeviceReleased):
            out.update(
                {
                    "colocate/wake_s": woke.wake_s,
                    "colocate/handoff_s": woke.handoff_s,
                    "colocate/rollout_onload_bytes": float(woke.weight_bytes),
                    "colocate/rollouts_awake": float(woke.rollouts),
                    "colocate/wake_failed": float(len(woke.failed)),
                }
            )
        out["colocate/release_s"] = time.perf_counter() - t0
        return out

    async def _offload(self) -> dict[str, float]:
        assert self.trainer is not None
        cc = self.settings.colocate
        assert cc is not None
        moved = await self.compute(self.trainer.offload, cc.offload_params, cc.offload_optimizer)
        self.log.debug("trainer_offloaded", bytes=moved.nbytes, s=round(moved.seconds, 4))
        return {
            "colocate/trainer_offload_s": moved.seconds,
            "colocate/trainer_offload_bytes": float(moved.nbytes),
        }

    async def _validate(self) -> None:
        """Greedy eval of the weights just trained on data.eval (evaluation.py); once per step."""
        assert self.evaluator is not None and self.trainer is not None and self.logger is not None
        if self._evaluated_step == self.step:
            return
        self._evaluated_step = self.step
        weights = await self.compute(self.trainer.export)
        metrics, samples = await self.evaluator.run(weights, self.step)
        self.logger.log(self.step, metrics)
        self.logger.log_completions(self.step, samples)
        self.log.info(
            "eval",
            step=self.step,
            accuracy=round(metrics["eval/accuracy"], 4),
            n=int(metrics["eval/n"]),
            seconds=round(metrics["eval/seconds"], 2),
        )

    def _refusal_metrics(self) -> dict[str, float]:
        """The cluster's refused and bad messages and refused trajectories, as the manager's last
        heartbeat summed them (nothing before its first): no request of its own."""
        if self.manager is None:
            return {}
        status = NODE_STATUS.unpack(self.manager.server_status)
        r = status.cluster_refusals if status is not None else None
        if r is None:
            return {}
        return {
            "security/unauthorized": r.unauthorized,
            "security/bad_messages": r.bad,
            "security/refused_hellos": r.refused_hellos,
            "security/refused_ids": r.refused_ids,
            "buffer/refused_trajectories": r.refused_trajectories,
            **{f"agent/{reason}": k for reason, k in sorted(r.agent.items())},
        }

    # ---- publishing, committing, checkpointing ----------------------------------------------
    async def _publish(self, weights: dict[str, torch.Tensor]) -> tuple[float, int]:
        """Hand the version off and announce it; (stall seconds, bytes), NaN stall if it failed."""
        assert self.handoff is not None and self.manager is not None
        # the digest rollouts must serve at this version: beside the handoff, not after it (sim
        # rollouts serve no tensors: nothing to attest)
        items = list(weights.items()) if self.settings.attest else []
        digest = asyncio.ensure_future(
            asyncio.to_thread(_expected_digest, items, self.settings.train.model.lora)
        )
        self.attest.expect(self.version, digest)
        try:
            pub = await self._unless_stopping(
                self.handoff.publish(self.version, self.step, weights)
            )
        except (TransportError, RuntimeError, OSError) as exc:
            # no relay reachable (or the disk is full): rollouts keep the last version they have;
            # the next step pushes again. Training must not stop for it.
            self.metrics.count("publish_failed")
            self.log.error(
                "publish_failed", version=self.version, error=f"{type(exc).__name__}: {exc}"
            )
            return math.nan, 0
        self.mark.write(self.version, self.step)
        if self.snapshots.due(self.version):
            meta = None
            if self.settings.train.model.lora is not None:  # imports torch: not for the sim trainer
                from laminar.models.lora import snapshot_metadata

                meta = snapshot_metadata(self.settings.train.model.lora)
            await self.compute(self.snapshots.save, self.version, self.step, weights, meta)
        await self._announce(pub, await digest)
        return pub.stall_s, pub.num_bytes

    async def _publish_streamed(self, layout: WeightLayout) -> tuple[float, float, int]:
        """Export the version into the handoff tensor by tensor (the relay: into its slot while
        the next tensor gathers; laminar/weights/sink.py) and announce it; (export seconds, the
        rest of the trainer's stall, bytes), NaN stall if it failed (nothing was published: the
        relay commits only a whole version)."""
        from laminar.weights.factory import publish_streamed

        assert self.handoff is not None and self.trainer is not None
        trainer = self.trainer
        digest: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.attest.expect(self.version, digest)
        export_s = math.nan

        async def produce(sink: VersionSink) -> None:
            nonlocal export_s
            t = time.perf_counter()
            await self.compute(trainer.export_into, sink)
            export_s = time.perf_counter() - t

        t0 = time.perf_counter()
        handoff = publish_streamed(
            self.handoff,
            self.version,
            self.step,
            layout,
            produce,
            digest=self.settings.attest,
        )
        try:
            pub, digest_hex = await self._unless_stopping(handoff)
        except (TransportError, RuntimeError, OSError) as exc:
            digest.set_result("")
            self.metrics.count("publish_failed")
            self.log.error(
                "publish_failed", version=self.version, error=f"{type(exc).__name__}: {exc}"
            )
            return export_s, math.nan, 0
        stall = time.perf_counter() - t0
        digest.set_result(digest_hex)
        self.mark.write(self.version, self.step)
        await self._announce(pub, digest_hex)
        return export_s, stall - export_s, pub.num_bytes

    async def _announce(self, pub: Published, digest: str) -> None:
        """VersionPublished to the manager (a lost one: it learns the version from heartbeats)."""
        assert self.manager is not None
        msg = VersionPublished(
            trainer_id=self.node_id,
            version=self.version,
            step=self.step,
            uri=pub.uri,
            handoff=pub.handoff,
            num_bytes=pub.num_bytes,
            stall_s=pub.stall_s,
            digest=digest,
        )
        try:
            await self.manager.send(msg)
        except TransportError as exc:  # the manager learns the version from heartbeats too
            self.metrics.count("version_announce_failed")
            self.log.warning("version_announce_failed", error=str(exc))

    async def _unless_stopping(self, publish: Coroutine[Any, Any, T]) -> T:
        """A stop must not wait on a relay that is gone: once stopping, a pending publish gets a
        short grace, then is abandoned like a failed one (the stop checkpoint holds the step;
        rollouts keep the version they have)."""
        # both tasks are awaited or cancelled here, never left behind
        push = asyncio.ensure_future(publish)
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({push, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not push.done():
                await asyncio.wait({push}, timeout=self.settings.transport.stop_timeout_s / 4)
            if not push.done():
                push.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await push
                raise TransportError("publish abandoned: the node is stopping")
            return push.result()
        finally:
            stop.cancel()
            if not push.done():  # we are being cancelled ourselves
                push.cancel()

    async def _commit_before_restart(self) -> None:
        if self.commits.gated and self._last_ckpt_step < self.step:
            await self._checkpoint("before_restart")  # commits what it holds
        await self._landed()
        await self.commits.flush(self._durable_step if self.commits.gated else None)

    async def _checkpoint(self, reason: str) -> None:
        """Periodic checkpoints may land in the background (trainer.checkpoint_async): training
        goes on meanwhile, and what the checkpoint holds counts (meta.json on disk, gated commits
        sent) only once it has landed. Every other reason waits for it, and for the one before."""
        if self.rank != 0:
            return
        if self.step != self._last_ckpt_step:
            assert self.trainer is not None
            t0 = time.perf_counter()
            tc = self.settings.train.trainer
            meta = {
                "version": self.version,
                "frontier": self.commits.frontier(),
                "reason": reason,
                "engine": tc.engine,
            }
            pending = await self.compute(
                self.trainer.save, self.run_dir, self.step, meta, tc.keep_checkpoints
            )
            stall = time.perf_counter() - t0
            self._last_ckpt_step = self.step
            if pending.waited_s > 0.0:
                self.metrics.count("checkpoint_waits")
            land = self._land(self._landing, pending, reason, t0, stall)
            self._landing = self.spawn(land, "checkpoint-land")
        if reason != "periodic":
            await self._landed()

    async def _landed(self) -> None:
        """Wait for the checkpoint in flight (if any) to land and its commits to go out."""
        if self._landing is not None:
            await asyncio.shield(self._landing)

    async def _land(
        self,
        previous: asyncio.Task[None] | None,
        pending: PendingSave,
        reason: str,
        t0: float,
        stall: float,
    ) -> None:
        if previous is not None:  # its commits go out first, and only once
            await asyncio.shield(previous)
        path = await asyncio.to_thread(pending.wait)  # every rank's shards durable, then meta.json
        self._durable_step = max(self._durable_step, pending.step)
        seconds = time.perf_counter() - t0
        self.log.info(
            "checkpoint",
            path=str(path),
            step=pending.step,
            reason=reason,
            seconds=round(seconds, 3),
            stall_s=round(stall, 3),
        )
        # on the next step's line (one line per step; the last checkpoint's are in the log only)
        self._checkpoint_metrics = {
            "checkpoint_stall_s": stall,
            "checkpoint_s": seconds,
            "checkpoint_wait_previous_s": pending.waited_s,
        }
        if self.commits.gated:
            await self.commits.flush(pending.step)
