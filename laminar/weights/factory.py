"""Opening the weights channel: the end a role uses for the mode its settings name.

    pub = open_publisher(settings, node.wiring())   # trainer (settings: weights_channel(cfg))
    sub = open_subscriber(settings, node.wiring())  # rollout (its host's relay: relay_index)
    res, digest = await publish_streamed(pub, version, step, layout, produce, digest=True)

The interfaces are laminar/weights/channel.py; each mode is its own module (relay.py, dir.py,
announce.py, nccl.py, cuda_ipc.py). Only the trainer and rollout nodes import this module;
nothing in laminar/weights/ imports it back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from laminar.protocol.relay import WeightLayout
from laminar.transport.sockets import Wiring
from laminar.weights.announce import AnnouncePublisher, AnnounceSubscriber
from laminar.weights.channel import (
    ChannelSettings,
    Published,
    RelayLinks,
    WeightPublisher,
    WeightSubscriber,
)
from laminar.weights.cuda_ipc import CudaIpcPublisher, CudaIpcSubscriber
from laminar.weights.digest import weights_digest
from laminar.weights.dir import DirPublisher, DirSubscriber
from laminar.weights.group import GroupBroadcaster, GroupSettings
from laminar.weights.layout import tensor_spans
from laminar.weights.nccl import GroupPublisher, GroupSubscriber
from laminar.weights.puller import WeightPuller
from laminar.weights.pusher import WeightPusher
from laminar.weights.relay import RelayPublisher, RelaySubscriber
from laminar.weights.sink import DictSink, VersionSink


def _links(settings: ChannelSettings) -> RelayLinks:
    if settings.relay is None:
        raise ValueError("weights mode relay needs ChannelSettings.relay (the relays' endpoints)")
    return settings.relay


def _group(settings: ChannelSettings) -> GroupSettings:
    if settings.group is None:
        raise ValueError(f"weights mode {settings.mode} needs ChannelSettings.group")
    return settings.group


def open_publisher(settings: ChannelSettings, wiring: Wiring) -> WeightPublisher:
    """The trainer's end of the channel that `settings.mode` names."""
    if settings.mode in ("nccl", "cuda_ipc"):
        pusher = WeightPusher(settings.relay, wiring) if settings.relay is not None else None
        if settings.mode == "cuda_ipc":
            return CudaIpcPublisher(pusher, _group(settings), settings.device)
        caster = GroupBroadcaster(_group(settings), wiring.log)
        return GroupPublisher(pusher, caster, settings.device)
    if settings.mode == "relay":
        return RelayPublisher(WeightPusher(_links(settings), wiring))
    if settings.mode == "dir":
        return DirPublisher(settings.dir)
    return AnnouncePublisher()


def open_subscriber(settings: ChannelSettings, wiring: Wiring) -> WeightSubscriber:
    """A rollout's end of the channel that `settings.mode` names (its host's relay:
    `settings.relay_index`)."""
    if settings.mode in ("nccl", "cuda_ipc"):
        relay = None
        if settings.relay is not None:
            puller = WeightPuller(settings.relay, wiring, relay_index=settings.relay_index)
            relay = RelaySubscriber(puller)
        if settings.mode == "cuda_ipc":
            return CudaIpcSubscriber(
                relay, _group(settings), wiring.node_id, wiring.log, settings.lease_ttl_s
            )
        return GroupSubscriber(relay, _group(settings), wiring.node_id, settings.device, wiring.log)
    if settings.mode == "relay":
        puller = WeightPuller(_links(settings), wiring, relay_index=settings.relay_index)
        return RelaySubscriber(puller)
    if settings.mode == "dir":
        return DirSubscriber(settings.dir)
    return AnnounceSubscriber()


async def publish_streamed(
    pub: WeightPublisher,
    version: int,
    step: int,
    layout: WeightLayout,
    produce: Callable[[VersionSink], Awaitable[None]],
    *,
    digest: bool,
) -> tuple[Published, str]:
    """Hand `version` off as `produce(sink)` exports it tensor by tensor; (Published, the version's
    weights_digest, "" unless `digest`). The relay channel streams it into the staged slot while
    the next tensor gathers, and commits only a complete version (WeightPusher.push_stream); the
    other channels take the whole version, then publish it as `publish` does."""
    if isinstance(pub, RelayPublisher):
        stall, digest_hex = await pub.pusher.push_stream(version, layout, produce, digest=digest)
        nbytes = sum(span[4] for span in tensor_spans(layout))
        return Published(pub.kind, "", nbytes, stall), digest_hex
    sink = DictSink()
    await produce(sink)
    items = list(sink.tensors.items())
    hashing = asyncio.ensure_future(asyncio.to_thread(weights_digest, items)) if digest else None
    published = await pub.publish(version, step, sink.tensors)
    return published, (await hashing if hashing is not None else "")
