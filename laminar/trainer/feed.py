"""Asking the buffer for the next batch: one long-poll BatchRequest per `ask`.

    feed = BatchFeed(buffer_client, cfg.trainer, cfg.transport, trainer_id=..., stopping=...,
                     metrics=metrics, log=log)
    reply = await feed.ask(version)     # a BatchReply with trajectories, or None: ask again
    feed.restart                        # the next request re-queues what is in flight
    feed.exhausted                      # the buffer said no data will ever come (epochs done)

The first request after a (re)start, and the first after a lost reply (a timeout: the
reply may have carried a batch), carries restart=True, so the buffer puts the batches it
served but never saw committed back at the queue front. Before such a request the node
commits everything its weights already hold (laminar/trainer/commits.py). Every wait has
a deadline: the long-poll plus the request timeout; errors back off and ask again.
"""

from __future__ import annotations

import asyncio

import structlog

from laminar.config import TrainerConfig, TransportConfig
from laminar.metrics import Metrics
from laminar.protocol.buffer import BatchReply, BatchRequest
from laminar.trainer.commits import pause
from laminar.transport.client import RpcClient
from laminar.transport.sockets import RemoteError, RequestTimeout, TransportError


class BatchFeed:
    def __init__(
        self,
        buffer: RpcClient,
        tc: TrainerConfig,
        transport: TransportConfig,
        *,
        trainer_id: str,
        stopping: asyncio.Event,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ):
        self.buffer = buffer
        self.tc, self.transport = tc, transport
        self.trainer_id = trainer_id
        self.stopping = stopping
        self.metrics = metrics
        self.log = log
        self.restart = True
        self.exhausted = False

    async def ask(self, version: int) -> BatchReply | None:
        """One request; a batch with trajectories, or None (nothing yet, an error, or exhausted)."""
        tc, t = self.tc, self.transport
        req = BatchRequest(
            trainer_id=self.trainer_id,
            groups=tc.batch_groups,
            trainer_version=version,
            wait_s=tc.batch_wait_s,
            restart=self.restart,
        )
        try:
            reply = await self.buffer.request(
                req, timeout=tc.batch_wait_s + t.request_timeout_s, retries=0
            )
        except RequestTimeout:
            # the reply (maybe a batch) may be lost: the next request re-queues whatever is in
            # flight
            self.metrics.count("batch_request_timeouts")
            self.restart = True
            return None
        except (RemoteError, TransportError) as exc:
            self.metrics.count("batch_request_errors")
            self.log.warning("batch_request_failed", error=str(exc))
            await pause(self.stopping, min(5.0, t.reconnect_backoff_max_s))
            return None
        if not isinstance(reply, BatchReply):
            self.metrics.count("bad_batch_replies")
            self.log.warning("bad_batch_reply", got=type(reply).__name__)
            return None
        self.restart = False
        if reply.trajectories:
            return reply
        if reply.exhausted:  # data epochs done and nothing left in the buffer
            self.exhausted = True
        return None
