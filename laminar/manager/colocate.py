"""The manager's half of colocated placement: it passes the trainer's turns on the device to the
rollouts that share it (cluster.placement=colocated; docs/colocated.md).

    trainer ──DeviceRequest(v)──► [broker.acquire] ──SleepRequest──► every live rollout
                                                   ◄──SleepReply── (drained, engine asleep)
            ◄──DeviceGrant(slowest drain / sleep, bytes)──
    trainer steps, publishes v + 1, offloads
    trainer ──DeviceRelease(v+1)──► [broker.release] ──WakeRequest(v+1)──► every live rollout
                                                     ◄──WakeReply── (awake, v + 1 loaded)
            ◄──DeviceReleased(slowest wake / handoff, bytes)──

The trainer coordinates (it alone knows when its batch is complete and when its step is done);
the manager carries the commands because rollouts are its clients, not the trainer's, and
because it sees deaths: a trainer that dies or restarts while holding the device gets its
rollouts woken (`trainer_gone`), and a rollout that (re)joins while the trainer holds it is put to
sleep as soon as its heartbeats show its engine up (`rollout_joined`). A rollout that does not
answer is listed in `failed` and the cycle goes on: a dead process holds no device memory, and a
slow one is logged and counted.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from laminar.config import ColocateConfig
from laminar.metrics import Metrics
from laminar.protocol.rollout import SleepReply, SleepRequest, WakeReply, WakeRequest
from laminar.protocol.trainer import DeviceGrant, DeviceReleased
from laminar.supervise import Spawn
from laminar.transport.server import RpcServer
from laminar.transport.sockets import RemoteError, TransportError

_MARGIN_S = 5.0
"""Added to a rollout's own deadline: its reply still has to travel."""
_JOINER_POLL_S = 0.2
"""How often a joiner's heartbeat status is looked at for an engine up (no event says so)."""


class DeviceBroker:
    def __init__(
        self,
        srv: RpcServer,
        cfg: ColocateConfig,
        *,
        spawn: Spawn,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ):
        self.srv, self.cfg, self.spawn = srv, cfg, spawn
        self.metrics, self.log = metrics, log
        self.held = False
        """The trainer holds the device: the colocated rollouts sleep."""
        self.version = -1
        """The version of the last grant or release."""
        self._lock = asyncio.Lock()

    def _rollouts(self) -> list[str]:
        return sorted(p.node_id for p in self.srv.peers.values() if p.alive and p.role == "rollout")

    async def acquire(self, version: int) -> DeviceGrant:
        async with self._lock:
            self.held, self.version = True, version
            t0 = time.monotonic()
            names = self._rollouts()
            replies = await asyncio.gather(*(self._sleep(n, version) for n in names))
            ok = [r for r in replies if isinstance(r, SleepReply)]
            failed = [n for n, r in zip(names, replies, strict=True) if r is None]
            grant = DeviceGrant(
                rollouts=len(ok),
                drain_s=max((r.drain_s for r in ok), default=0.0),
                sleep_s=max((r.sleep_s for r in ok), default=0.0),
                weight_bytes=sum(r.weight_bytes for r in ok),
                kv_bytes=sum(r.kv_bytes for r in ok),
                failed=failed,
            )
            self.metrics.count("colocate_grants")
            self.log.info(
                "colocate_granted", version=version, s=round(time.monotonic() - t0, 4), **_f(grant)
            )
            return grant

    async def release(self, version: int) -> DeviceReleased:
        async with self._lock:
            self.held, self.version = False, version
            names = self._rollouts()
            replies = await asyncio.gather(*(self._wake(n, version) for n in names))
            ok = [r for r in replies if isinstance(r, WakeReply)]
            failed = [n for n, r in zip(names, replies, strict=True) if r is None]
            out = DeviceReleased(
                rollouts=len(ok),
                wake_s=max((r.wake_s for r in ok), default=0.0),
                handoff_s=max((r.handoff_s for r in ok), default=0.0),
                weight_bytes=sum(r.weight_bytes for r in ok),
                kv_bytes=sum(r.kv_bytes for r in ok),
                failed=failed,
            )
            self.metrics.count("colocate_releases")
            self.log.info("colocate_released", version=version, **_f(out))
            return out

    def trainer_gone(self) -> bool:
        """The trainer died or came back as a new process while holding the device: wake the
        rollouts (the new trainer asks again when its batch is complete). True: it held it."""
        if not self.held:
            return False
        self.log.warning("colocate_trainer_gone", version=self.version)
        self.metrics.count("colocate_trainer_gone")
        self.spawn(self.release(self.version), "colocate-release")
        return True

    def rollout_joined(self, node_id: str) -> None:
        """A rollout (re)joined while the trainer holds the device: it sleeps too, once its
        engine is up."""
        if self.held:
            self.spawn(self._sleep_joiner(node_id), "colocate-sleep-joiner")

    async def _sleep_joiner(self, node_id: str) -> None:
        """A (re)started rollout registers before its engine starts and answers no command until
        it has, so the sleep waits for its heartbeats to show an engine up; it gives up when the
        trainer gives the device back (the joiner is awake then anyway) or the rollout dies."""
        while self.held:
            peer = next((p for p in self.srv.peers.values() if p.node_id == node_id), None)
            if peer is None or not peer.alive:
                return
            st = peer.status
            if st is not None and st.rollout is not None and st.rollout.max_running > 0:
                async with self._lock:  # not between a release's wake and its reply
                    if self.held and not st.rollout.asleep:
                        self.log.info("colocate_sleep_joiner", rollout=node_id)
                        await self._sleep(node_id, self.version)
                return
            await asyncio.sleep(_JOINER_POLL_S)

    async def _sleep(self, node_id: str, version: int) -> SleepReply | None:
        reply = await self._ask(node_id, SleepRequest(version=version), self.cfg.sleep_timeout_s)
        if not isinstance(reply, SleepReply):
            self.metrics.count("colocate_sleep_failed")
            return None
        return reply

    async def _wake(self, node_id: str, version: int) -> WakeReply | None:
        reply = await self._ask(node_id, WakeRequest(min_version=version), self.cfg.wake_timeout_s)
        if not isinstance(reply, WakeReply):
            self.metrics.count("colocate_wake_failed")
            return None
        return reply

    async def _ask(self, node_id: str, msg: Any, timeout_s: float) -> Any:
        try:
            return await self.srv.request(node_id, msg, timeout=timeout_s + _MARGIN_S)
        except (TransportError, RemoteError) as exc:
            self.log.warning(
                "colocate_command_failed",
                rollout=node_id,
                command=type(msg).__name__,
                error=str(exc),
            )
            return None


def _f(m: DeviceGrant | DeviceReleased) -> dict[str, Any]:
    return {
        k: (round(v, 4) if isinstance(v, float) else v)
        for k, v in ((f, getattr(m, f)) for f in m.__struct_fields__)
    }
