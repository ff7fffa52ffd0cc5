"""Exactly-once consumption: which buffer batches the weights hold, and telling the buffer.

    ledger = CommitLedger(buffer_client, "step", run_dir, stopping=stopping, backoff_s=backoff_s,
                          metrics=metrics, log=log)
    ledger.restore(meta["frontier"])                  # resume: commits the checkpoint still owed
    ledger.consumed(step, version, batch_id, uids, excluded)  # run_dir/consumed.jsonl (fsync'ed)
    ledger.record(batch_id, step, version)            # the step is in the weights: a commit is owed
    await ledger.flush()                              # BatchCommit each, oldest first, until acked
    meta["frontier"] = ledger.frontier()              # what a checkpoint stores

A batch the buffer served is "in flight" until the trainer commits it; the first
BatchRequest after a (re)start carries restart=True and the buffer puts in-flight batches
back at the queue front (laminar/trainer/feed.py). So a trainer killed after consuming a
batch but before committing it gets that batch again after resume.
  commit=step (default): commit right after the optimizer step and the weight push.
      A crash rolls the weights back to the last checkpoint; batches committed after
      it are not re-served: their updates are lost (at most checkpoint_every steps),
      but no batch is ever trained into the same weights twice.
  commit=checkpoint (`gated`): commits wait until a checkpoint holding the step is on
      disk; the checkpoint records them (the frontier) and a restarted trainer commits
      them before asking for data. A crash then loses nothing and duplicates nothing.
The node flushes before any restart=True request (checkpointing first when gated), so
every step already in the weights is committed before in-flight batches are re-queued.

Versions stay monotonic across crashes: `VersionMark` (run_dir/trainer_version.json)
keeps the highest version published; a trainer resumed from an older checkpoint
re-publishes its restored weights as the next version, so no version number names two
weight sets.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import structlog

from laminar.metrics import Metrics
from laminar.protocol.buffer import BatchCommit, CommitAck
from laminar.trainer.logger import append_jsonl
from laminar.transport.client import RpcClient
from laminar.transport.sockets import RemoteError, TransportError


@dataclass(frozen=True)
class Owed:
    """A consumed batch whose commit the buffer has not acknowledged yet."""

    batch_id: str
    step: int
    version: int


class CommitLedger:
    def __init__(
        self,
        buffer: RpcClient,
        mode: Literal["step", "checkpoint"],
        run_dir: Path,
        *,
        stopping: asyncio.Event,
        backoff_s: float,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ):
        self.buffer = buffer
        self.gated = mode == "checkpoint"
        """Commits wait for a checkpoint holding their step."""
        self.audit = run_dir / "consumed.jsonl"
        self.stopping = stopping
        self.backoff_s = backoff_s
        self.metrics = metrics
        self.log = log
        self.owed: list[Owed] = []

    def restore(self, frontier: dict[str, Any]) -> None:
        self.owed = [Owed(**c) for c in frontier.get("uncommitted", [])]

    def frontier(self) -> dict[str, Any]:
        return {"uncommitted": [asdict(c) for c in self.owed]}

    def consumed(
        self, step: int, version: int, batch_id: str, uids: list[str], excluded: list[str]
    ) -> None:
        """The audit line of a trained step (a restarted trainer re-logs the steps after its
        checkpoint): `uids` trained on, `excluded` served in the batch but not trained on (no
        reward, a bad one, a group left with one member), so every served uid is accounted for."""
        append_jsonl(
            self.audit,
            {
                "step": step,
                "version": version,
                "batch_id": batch_id,
                "uids": uids,
                "excluded": excluded,
            },
        )

    def record(self, batch_id: str, step: int, version: int) -> None:
        """`step` (which consumed batch_id) is in the weights: its commit is owed from now on."""
        self.owed.append(Owed(batch_id, step, version))

    async def flush(self) -> bool:
        """Commit every owed batch, oldest first, retrying until acknowledged; False if it
        stopped early because the node is stopping (the rest stay owed: the stop checkpoint
        records them)."""
        while self.owed:
            c = self.owed[0]
            try:
                ack = await self.buffer.request(
                    BatchCommit(batch_id=c.batch_id, step=c.step, version=c.version)
                )
                # not ok: the buffer re-queued it (a restart raced the commit); it is served again
                if isinstance(ack, CommitAck) and not ack.ok:
                    self.metrics.count("commit_rejected")
                    self.log.error("commit_rejected", batch_id=c.batch_id, reason=ack.reason)
            # refused (unknown batch / already committed): nothing to retry
            except RemoteError as exc:
                self.metrics.count("commit_refused")
                self.log.warning("commit_refused", batch_id=c.batch_id, error=str(exc))
            except TransportError as exc:
                self.metrics.count("commit_retries")
                self.log.warning("commit_retry", batch_id=c.batch_id, error=str(exc))
                if self.stopping.is_set():
                    return False
                await pause(self.stopping, self.backoff_s)
                continue
            self.owed.pop(0)
        return True


class VersionMark:
    """run_dir/trainer_version.json: the highest version ever published from this run_dir."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "trainer_version.json"

    def read(self) -> int:
        """-1 when no version was published yet."""
        try:
            return int(json.loads(self.path.read_text())["version"])
        except (OSError, ValueError, KeyError):
            return -1

    def write(self, version: int, step: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": version, "step": step}))
        os.replace(tmp, self.path)


async def pause(stopping: asyncio.Event, seconds: float) -> None:
    """Wait `seconds` or until `stopping` is set (a retry backoff)."""
    try:
        await asyncio.wait_for(stopping.wait(), seconds)
    except TimeoutError:
        pass
