"""Trainer node: pulls whole-group batches from the buffer, takes one optimizer step per
batch, publishes every new version, commits what it consumed, checkpoints.

    laminar node --role trainer --config FILE                       (one process)
    torchrun --nproc_per_node N -m laminar node --role trainer ...  (FSDP2; rank 0 talks)

    buffer ──BatchReply──► rank 0 ──RankCommand(step, batch)──► ranks 1..N-1 (torch.distributed)
                             │ compute (worker thread): advantages, loss, backward, AdamW
                             ▼
            version += 1 ─► handoff.publish (relay tier | safetensors file | sim)
                          ─► VersionPublished ─► manager
                          ─► BatchCommit(batch_id, step, version) ─► buffer
                          ─► metrics.jsonl / tb / wandb, consumed.jsonl ─► every N steps: checkpoint

What blocks: the step compute (off the event loop, so heartbeats flow) and the
handoff (`publish` returns once the weights are handed off). What does not: the
rollouts, which keep generating on older versions meanwhile. Every network wait has
a deadline; an empty reply is asked again; the loop checks `stopping` between steps.

Exactly-once. A batch the buffer served is "in flight" until the trainer commits it;
the first BatchRequest after a (re)start carries restart=True and the buffer puts
in-flight batches back at the queue front. So a trainer killed after consuming a batch
but before committing it gets that batch again after resume.
  commit=step (default): commit right after the optimizer step and the weight push.
      A crash rolls the weights back to the last checkpoint; batches committed after
      it are not re-served: their updates are lost (at most checkpoint_every steps),
      but no batch is ever trained into the same weights twice.
  commit=checkpoint: commits are held until a checkpoint containing the step is on
      disk; the checkpoint records them (the frontier) and a restarted trainer commits
      them before asking for data. A crash then loses nothing and duplicates nothing.
Before any restart=True request (start, or after a lost reply) every step already in
the weights is committed first (checkpointing first in commit=checkpoint mode).
Versions stay monotonic across crashes: run_dir/trainer_version.json keeps the highest
version published; a trainer resumed from an older checkpoint re-publishes its
restored weights as the next version, so no version number names two weight sets.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

from laminar.node import Node
from laminar.protocol.buffer import BatchCommit, BatchReply, BatchRequest
from laminar.protocol.core import NodeStatus
from laminar.protocol.trainer import RankCommand, VersionPublished
from laminar.transport.sockets import RemoteError, RequestTimeout, TransportError


class TrainerNode(Node):
    role = "trainer"

    def __init__(self, cfg, index: int = 0, ctx: Any = None, node_id: str | None = None):
        rank = 0
        if cfg.trainer.engine == "torch":  # dist imports torch: seconds the sim trainer need not block here
            from laminar.trainer.dist import env_rank

            rank = env_rank()[0]
        super().__init__(
            cfg,
            index,
            ctx,
            node_id or (f"trainer-{index}" if rank == 0 else f"trainer-{index}-rank{rank}"),
        )
        self.rank = rank
        self.registers_with_manager = rank == 0  # only rank 0 is on the cluster network
        self.run_dir = Path(cfg.resolved_run_dir())
        self.step = 0
        self.version = 0
        self.policy = None
        self.sim = None
        self.dist = None
        self.handoff = None
        self.logger = None
        self._restart = True
        self._uncommitted: list[dict[str, Any]] = []
        self._step_lock = asyncio.Lock()
        self._resumed_from: Path | None = None
        self._meta: dict[str, Any] | None = None
        self._republish = False
        self._last_ckpt_step = 0  # step 0 is the initial model: nothing to checkpoint
        self._followers_done = asyncio.Event()
        self.last: dict[str, float] = {}
        self.exhausted = False
        """The buffer said no data will ever come (data.epochs done): finish like total_steps."""

    # ---- lifecycle -------------------------------------------------------------------------
    async def setup(self) -> None:
        # torch takes seconds to import: in a worker thread, so nodes sharing this loop keep beating
        await asyncio.to_thread(importlib.import_module, "laminar.trainer.dist")
        from laminar.trainer import checkpoint as ck
        from laminar.trainer.dist import DistContext

        tc = self.cfg.trainer
        ckpt = None
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ck.remove_partial(self.run_dir)
            ckpt = ck.resolve_resume(tc.resume, self.run_dir)
        if tc.engine == "sim":
            from laminar.trainer.sim import SimTrainer

            self.dist, self.sim = DistContext(), SimTrainer(self.cfg)
        else:
            ckpt = await self.compute(self._init_policy, ckpt)
        if ckpt is not None and self.rank == 0:
            meta, _ = ck.read_checkpoint(ckpt) if self.sim is not None else (self._meta, None)
            self._restore_counters(meta, ckpt)
        if self.rank != 0:
            return
        from laminar.trainer.handoff import make_handoff
        from laminar.trainer.logger import MetricsLogger

        # tensorboard/wandb imports take a while: off the loop, before any socket needs heartbeats
        self.logger = await self.compute(MetricsLogger, self.run_dir, self.cfg, log=self.log)
        self.buffer = self.client(self.cfg.endpoint("buffer"))
        await self.buffer.connect(timeout=self.cfg.transport.startup_timeout_s)
        self.handoff = make_handoff(self)
        await self.handoff.start()

    def _init_policy(self, ckpt: Path | None) -> Path | None:
        """Worker thread: process group, the resume path agreed by all ranks, model + optimizer."""
        from laminar.trainer import checkpoint as ck
        from laminar.trainer.dist import broadcast_message, init_distributed
        from laminar.trainer.policy import Policy

        self.dist = init_distributed(self.cfg.model.device)
        if self.dist.enabled:
            cmd = broadcast_message(
                self.dist,
                RankCommand(kind="init", path=str(ckpt or "")) if self.dist.is_main else None,
            )
            ckpt = Path(cmd.path) if cmd.path else None
        model_path = str(ckpt / "model") if ckpt is not None else self.cfg.model.path
        if not model_path:
            raise ValueError("the torch trainer needs model.path (a local HF model directory)")
        self.policy = Policy(self.cfg, model_path, self.dist)
        self._meta = ck.load_policy_state(self.policy, ckpt) if ckpt is not None else None
        return ckpt

    def _restore_counters(self, meta: dict[str, Any], ckpt: Path) -> None:
        self._resumed_from = ckpt
        self.step = int(meta["step"])
        self.version = int(meta["version"])
        self._last_ckpt_step = self.step
        self._uncommitted = list(meta.get("frontier", {}).get("uncommitted", []))
        published = self._read_version_mark()
        if published > self.version:  # versions after the checkpoint were published, then lost
            self.version = published
            self._republish = True
        self.log.info(
            "resumed",
            checkpoint=str(ckpt),
            step=self.step,
            version=self.version,
            uncommitted=len(self._uncommitted),
        )

    async def main(self) -> None:
        if self.rank != 0:
            await self.compute(self._follow)
            self._followers_done.set()
            self.request_stop("rank 0 said stop")
            return
        total = self.cfg.trainer.total_steps
        if self._republish:
            self.version += 1
            await self._publish(await self._export())
        while self.step < total and not self.stopping.is_set():
            reply = await self._next_batch()
            if reply is None:
                break
            async with self._step_lock:
                if self.stopping.is_set():
                    break  # not trained, not committed: the buffer serves it again after a restart
                await self._train_on(reply)
            every = self.cfg.trainer.checkpoint_every
            if every and self.step % every == 0:
                async with self._step_lock:
                    await self._checkpoint("periodic")
        if self.step >= total or self.exhausted:
            async with self._step_lock:
                await self._checkpoint("final")
            why = "data exhausted" if self.step < total else "total_steps"
            self.request_stop(f"done: {self.step} steps ({why})")

    async def drain(self) -> None:
        if self.rank != 0:
            await self._followers_done.wait()  # rank 0 drives the last collectives and the stop
            return
        async with self._step_lock:  # an in-flight step (and its commit) finishes first
            await self._checkpoint("stop")

    async def teardown(self) -> None:
        if self.rank == 0 and self.dist is not None and self.dist.enabled:
            from laminar.trainer.dist import broadcast_message

            await self.compute(broadcast_message, self.dist, RankCommand(kind="stop"))
        if self.handoff is not None:
            await self.handoff.close()
        if self.logger is not None:
            self.logger.close()
        if self.dist is not None and self.dist.enabled:
            from laminar.trainer.dist import destroy

            await self.compute(destroy, self.dist)

    def status(self) -> NodeStatus:
        extra = {"step": self.step, "engine": self.cfg.trainer.engine}
        for k in ("tokens_per_s", "step_s", "reward", "loss"):
            if k in self.last:
                extra[k] = self.last[k]
        return NodeStatus(
            node_id=self.node_id,
            role=self.role,
            version=self.version,
            staleness=self.last.get("staleness", 0.0),
            extra=extra,
        )

    # ---- the step ------------------------------------------------------------------------
    async def _next_batch(self) -> BatchReply | None:
        tc, t = self.cfg.trainer, self.cfg.transport
        while not self.stopping.is_set():
            if self._restart and self._uncommitted:
                await self._flush_commits(before_restart=True)
            req = BatchRequest(trainer_id=self.node_id, groups=tc.batch_groups, trainer_version=self.version,
                               wait_s=tc.batch_wait_s, restart=self._restart)  # fmt: skip
            try:
                reply = await self.buffer.request(
                    req, timeout=tc.batch_wait_s + t.request_timeout_s, retries=0
                )
            except RequestTimeout:
                # the reply (maybe a batch) may be lost: the next request re-queues whatever is in flight
                self.metrics.count("batch_request_timeouts")
                self._restart = True
                continue
            except (RemoteError, TransportError) as exc:
                self.metrics.count("batch_request_errors")
                self.log.warning("batch_request_failed", error=str(exc))
                await self._pause(min(5.0, t.reconnect_backoff_max_s))
                continue
            if not isinstance(reply, BatchReply):
                self.metrics.count("bad_batch_replies")
                self.log.warning("bad_batch_reply", got=type(reply).__name__)
                continue
            self._restart = False
            if reply.trajectories:
                return reply
            if (
                reply.info.get("exhausted") is True
            ):  # data epochs done and nothing left in the buffer
                self.exhausted = True
                return None
        return None

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds` or until asked to stop (a retry backoff)."""
        try:
            await asyncio.wait_for(self.stopping.wait(), seconds)
        except TimeoutError:
            pass

    async def _train_on(self, reply: BatchReply) -> None:
        from laminar.algo.metrics import staleness_histogram
        from laminar.trainer.batch import TrainBatch
        from laminar.trainer.logger import append_jsonl

        t0 = time.perf_counter()
        p = self.policy
        batch = TrainBatch.build(
            reply.trajectories, p.vocab_size if p else None, p.max_len if p else None
        )
        for reason, n in batch.dropped.items():
            self.metrics.count(f"dropped_{reason}", n)
        if batch.dropped:
            self.log.warning("dropped_trajectories", batch_id=reply.batch_id, **dict(batch.dropped))
        if batch.n_seqs == 0:  # nothing trainable: consume it so it is not served forever
            self._uncommitted.append(
                {"batch_id": reply.batch_id, "step": self.step, "version": self.version}
            )
            if self.cfg.trainer.commit == "step":
                await self._flush_commits()
            return
        staleness = [self.version - s.version for s in batch.samples]
        if self.sim is not None:
            metrics = await self.sim.train_step(batch)
            weights = self._sim_blob()
        else:
            metrics, weights = await self.compute(self._step_compute, reply.trajectories, batch)
        self.step += 1
        self.version += 1
        record = {"step": self.step, "version": self.version, "batch_id": reply.batch_id,
                  "uids": [s.uid for s in batch.samples]}  # fmt: skip
        append_jsonl(self.run_dir / "consumed.jsonl", record)
        self._fault("crash_before_commit")
        pub = await self._publish(weights)
        self._uncommitted.append(
            {"batch_id": reply.batch_id, "step": self.step, "version": self.version}
        )
        if self.cfg.trainer.commit == "step":
            await self._flush_commits()
        step_s = time.perf_counter() - t0
        metrics.update({
            "version": self.version, "step_s": step_s, "push_s": pub.stall_s, "push_bytes": pub.num_bytes,
            "tokens_per_s": metrics["tokens_total"] / max(metrics["compute_s"], 1e-9),
            "staleness": sum(staleness) / len(staleness), "staleness_max": max(staleness),
            "dropped": float(sum(batch.dropped.values())),
        })  # fmt: skip
        metrics.update(staleness_histogram(staleness))
        metrics.update(
            {f"buffer/{k}": v for k, v in reply.info.items() if isinstance(v, int | float)}
        )
        self.last = metrics
        if self.step % self.cfg.trainer.log_every == 0:
            self.logger.log(self.step, metrics)
        self.log.info("step", step=self.step, version=self.version, loss=round(metrics.get("loss", float("nan")), 5),
                      reward=round(metrics["reward"], 4), step_s=round(step_s, 3))  # fmt: skip

    def _step_compute(self, trajectories, batch) -> tuple[dict[str, float], dict[str, Any]]:
        """Worker thread, rank 0: send the batch to the other ranks, train, gather the weights."""
        from laminar.trainer.dist import broadcast_message

        if self.dist.enabled:
            broadcast_message(
                self.dist,
                RankCommand(
                    kind="step", step=self.step, version=self.version, trajectories=trajectories
                ),
            )
        metrics = self.policy.train_step(batch)
        return metrics, self.policy.export_weights(self.cfg.model.dtype)

    def _follow(self) -> None:
        """Worker thread, ranks > 0: mirror rank 0's collectives until it says stop."""
        from laminar.trainer import checkpoint as ck
        from laminar.trainer.batch import TrainBatch
        from laminar.trainer.dist import broadcast_message

        while True:
            cmd = broadcast_message(self.dist, None)
            if cmd.kind == "step":
                self.policy.train_step(
                    TrainBatch.build(cmd.trajectories, self.policy.vocab_size, self.policy.max_len)
                )
                self.policy.export_weights(self.cfg.model.dtype)
            elif cmd.kind == "export":
                self.policy.export_weights(self.cfg.model.dtype)
            elif cmd.kind == "checkpoint":
                ck.save_policy(
                    self.policy, self.run_dir, cmd.step, {}
                )  # gathers only; rank 0 writes
            elif cmd.kind == "stop":
                return

    async def _export(self) -> dict[str, Any] | None:
        if self.sim is not None:
            return self._sim_blob()

        def run():
            from laminar.trainer.dist import broadcast_message

            if self.dist.enabled:
                broadcast_message(self.dist, RankCommand(kind="export"))
            return self.policy.export_weights(self.cfg.model.dtype)

        return await self.compute(run)

    def _sim_blob(self) -> dict[str, Any] | None:
        if self.handoff is None or self.handoff.kind != "relay":
            return None
        import torch

        n = int(self.cfg.extra.get("sim_weight_bytes", 4096))
        return {
            "sim.weight": torch.full((max(1, n // 4),), float(self.version), dtype=torch.float32)
        }

    # ---- publishing, committing, checkpointing ----------------------------------------------
    def _snapshot(self, version: int, step: int, weights: dict[str, Any]) -> None:
        """Model-only weights + wall time, so held-out accuracy can be plotted after the run
        without evaluating inside it (evaluation would steal the run's CPU and skew its timing)."""
        import json
        import time

        from safetensors.torch import save_file

        out = Path(self.cfg.resolved_run_dir()) / "snapshots"
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".v{version}.tmp"
        save_file({k: v.detach().to("cpu").contiguous() for k, v in weights.items()}, str(tmp))
        os.replace(tmp, out / f"v{version}.safetensors")
        with open(out / "index.jsonl", "a") as f:
            f.write(json.dumps({"version": version, "step": step, "time": time.time()}) + "\n")

    async def _publish(self, weights: dict[str, Any] | None):
        from laminar.trainer.handoff import Published

        try:
            pub = await self.handoff.publish(self.version, self.step, weights)
        except (TransportError, RuntimeError, OSError) as exc:
            # no relay reachable (or the disk is full): rollouts keep the last version they have;
            # the next step pushes again. Training must not stop for it.
            self.metrics.count("publish_failed")
            self.log.error(
                "publish_failed", version=self.version, error=f"{type(exc).__name__}: {exc}"
            )
            return Published(self.handoff.kind, stall_s=float("nan"))
        self._write_version_mark()
        every = self.cfg.trainer.snapshot_every
        if every and weights is not None and self.version % every == 0:
            await self.compute(self._snapshot, self.version, self.step, weights)
        msg = VersionPublished(trainer_id=self.node_id, version=self.version, step=self.step, uri=pub.uri,
                               handoff=pub.handoff, num_bytes=pub.num_bytes, stall_s=pub.stall_s)  # fmt: skip
        try:
            await self.manager.send(msg)
        except TransportError as exc:  # the manager learns the version from heartbeats too
            self.metrics.count("version_announce_failed")
            self.log.warning("version_announce_failed", error=str(exc))
        return pub

    async def _flush_commits(self, before_restart: bool = False) -> None:
        """Commit every consumed batch whose step is in the weights; retried until done or stopping."""
        if (
            before_restart
            and self.cfg.trainer.commit == "checkpoint"
            and self._last_ckpt_step < self.step
        ):
            await self._checkpoint("before_restart")
        while self._uncommitted:
            c = self._uncommitted[0]
            try:
                ack = await self.buffer.request(
                    BatchCommit(batch_id=c["batch_id"], step=c["step"], version=c["version"])
                )
                if (
                    getattr(ack, "ok", True) is False
                ):  # the buffer re-queued it: it will be served again
                    self.metrics.count("commit_rejected")
                    self.log.error(
                        "commit_rejected", batch_id=c["batch_id"], info=getattr(ack, "info", {})
                    )
            except (
                RemoteError
            ) as exc:  # the buffer refuses it (unknown / already committed): nothing to retry
                self.metrics.count("commit_refused")
                self.log.warning("commit_refused", batch_id=c["batch_id"], error=str(exc))
            except TransportError as exc:
                self.metrics.count("commit_retries")
                self.log.warning("commit_retry", batch_id=c["batch_id"], error=str(exc))
                if self.stopping.is_set():
                    return  # kept in _uncommitted; the stop checkpoint records it
                await self._pause(self.cfg.transport.reconnect_backoff_max_s)
                continue
            self._uncommitted.pop(0)

    async def _checkpoint(self, reason: str) -> None:
        if self.rank != 0 or self.step == self._last_ckpt_step:
            return
        from laminar.trainer import checkpoint as ck

        t0 = time.perf_counter()
        frontier = {"uncommitted": list(self._uncommitted)}
        meta = {
            "version": self.version,
            "frontier": frontier,
            "reason": reason,
            "engine": self.cfg.trainer.engine,
        }
        tc = self.cfg.trainer

        def run() -> Path:
            if self.sim is not None:
                return ck.write_checkpoint(
                    self.run_dir,
                    self.step,
                    None,
                    None,
                    {"rng": ck.rng_state()},
                    meta,
                    keep=tc.keep_checkpoints,
                )
            from laminar.trainer.dist import broadcast_message

            if self.dist.enabled:
                broadcast_message(self.dist, RankCommand(kind="checkpoint", step=self.step))
            src = self._resumed_from / "model" if self._resumed_from else self.cfg.model.path
            return ck.save_policy(
                self.policy, self.run_dir, self.step, meta, src, tc.keep_checkpoints
            )

        path = await self.compute(run)
        self._last_ckpt_step = self.step
        self.log.info(
            "checkpoint",
            path=str(path),
            step=self.step,
            reason=reason,
            seconds=round(time.perf_counter() - t0, 3),
        )
        if tc.commit == "checkpoint":
            await self._flush_commits()

    def _read_version_mark(self) -> int:
        try:
            return int(json.loads((self.run_dir / "trainer_version.json").read_text())["version"])
        except (OSError, ValueError, KeyError):
            return -1

    def _write_version_mark(self) -> None:
        path = self.run_dir / "trainer_version.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": self.version, "step": self.step}))
        os.replace(tmp, path)

    def _fault(self, point: str) -> None:
        """Fault injection for recovery tests: extra.fault = {point: step} kills the process there
        (exit code 17); with extra.fault.action=raise the node dies of an exception instead
        (in-process tests: no drain, no checkpoint, like a crash)."""
        fault = self.cfg.extra.get("fault") or {}
        if fault.get(point) == self.step:
            self.log.warning("fault_injected", point=point, step=self.step)
            if fault.get("action") == "raise":
                raise RuntimeError(f"fault injected at {point}, step {self.step}")
            os._exit(17)
