"""Relay nodes run inside the test process over ipc, so a test can look at their state.

    relays = InprocRelays(zctx)
    nodes = await relays.start(cfg)      # cfg.cluster.roles.relay of them, each ready
    ...
    await relays.stop()                  # every node started, stopped and awaited

They skip registration with a manager (there is none); tests/test_weights.py and
tests/test_weights_delta.py build their configs and use it from their fixtures.
"""

from __future__ import annotations

import asyncio

import zmq.asyncio

from laminar.config import LaminarConfig
from laminar.relay.node import RelayNode
from laminar.wiring.relay import relay_node_settings


class InprocRelay(RelayNode):
    registers_with_manager = False


class InprocRelays:
    def __init__(self, zctx: zmq.asyncio.Context):
        self.zctx = zctx
        self.nodes: list[InprocRelay] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self, cfg: LaminarConfig) -> list[InprocRelay]:
        nodes = []
        for i in range(cfg.cluster.roles["relay"]):
            node = InprocRelay(relay_node_settings(cfg, i), ctx=self.zctx)
            self.nodes.append(node)
            nodes.append(node)
            self.tasks.append(asyncio.create_task(node.run()))
            await node.wait_ready(10)
        return nodes

    async def stop(self) -> None:
        for node in self.nodes:
            node.request_stop("test done")
        await asyncio.gather(*self.tasks, return_exceptions=True)
