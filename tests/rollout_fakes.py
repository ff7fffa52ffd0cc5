"""Fakes for the rollout tests: a minimal buffer server and a harness around it.

The engine is tests/fake_engine.py's FakeEngine; `expected_response(uid)` is what it
generates for a single-turn trajectory, so one exported, then resumed elsewhere, must come
out identical to one that ran uninterrupted: the tests compare them token for token.

`harness(cfg, items)` runs a real ManagerNode and a FakeBuffer over inproc and adds
RolloutNodes on demand (`await h.add_rollout(engine)`).

FakeBuffer speaks the buffer protocol (laminar/protocol/buffer.py) on an RpcServer:
serves PromptItems from a list, keeps the partial pool (header restarts a record),
stores Trajectories deduplicated by uid (acking duplicates) and counts every
arrival, so "nothing lost, nothing twice" can be asserted. It owns images like the real
buffer: its prompts' images and those rollouts put (ImagePut), served by digest (ImageFetch),
with the bytes of each direction counted. Its state lives in a
FakeBufferState that survives stop()/start(), like a journaled buffer restarted on
the same run dir.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fake_engine import FakeEngine, fake_length, fake_token

from laminar.config import config_from_dict
from laminar.protocol.buffer import (
    Deliveries,
    DeliveryAcks,
    ImageBlobs,
    ImageFetch,
    ImagePut,
    ImagePutReply,
    PromptReply,
    PromptRequest,
    TrajectoryAbandoned,
    TrajectoryAck,
)
from laminar.protocol.data import PartialBatch, PartialChunk, PromptItem, Trajectory
from laminar.rollout.node import RolloutNode
from laminar.transport.server import RpcServer
from laminar.transport.sockets import new_context
from laminar.wiring.common import socket_options
from laminar.wiring.nodes import build_node


def a_trajectory(uid: str = "g/0", **over: Any) -> Trajectory:
    """A small finished Trajectory of rollout-0 (sample index from the uid), fields overridden by
    `over`: what an outbox is given."""
    t = Trajectory(
        uid=uid,
        group_id=uid.split("/")[0],
        prompt_uid="p",
        sample_index=int(uid.split("/")[1]),
        prompt_ids=np.array([1, 5], np.int32),
        response_ids=np.array([6, 2], np.int32),
        logprobs=np.zeros(2, np.float32),
        version=0,
        rollout_id="rollout-0",
    )
    for k, v in over.items():
        setattr(t, k, v)
    return t


def expected_response(uid: str, base: int = 8, span: int = 40) -> list[int]:
    return [fake_token(uid, i) for i in range(fake_length(uid, base, span))]


def make_items(count: int, n: int, prefix: str = "p") -> list[PromptItem]:
    return [
        PromptItem(
            uid=f"{prefix}{k}",
            group_id=f"{prefix}{k}@0",
            prompt_ids=np.arange(1, 6, dtype=np.int32) + k,
            n=n,
            prompt=f"prompt {k}",
            row={"answer": str(k)},
        )
        for k in range(count)
    ]


@dataclass
class FakeBufferState:
    prompts: list[PromptItem]
    min_version: int = -1
    stored: dict[str, Trajectory] = field(default_factory=dict)
    arrivals: Counter = field(default_factory=Counter)
    partials: dict[str, dict[str, Any]] = field(default_factory=dict)
    abandoned: dict[str, TrajectoryAbandoned] = field(default_factory=dict)
    requests: list[PromptRequest] = field(default_factory=list)
    last_reply: dict[str, tuple[str, list[PromptItem]]] = field(default_factory=dict)
    stall_next_reply_s: float = 0.0
    """Serve the next request, then answer only after this long (the rollout times out and
    retries)."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    images: dict[str, bytes] = field(default_factory=dict)
    """The images it owns by digest: its prompts' (filled from `prompts`) and those put."""
    puts: list[ImagePut] = field(default_factory=list)
    fetched: list[str] = field(default_factory=list)
    """Every digest served by ImageFetch, in order."""
    deliveries: int = 0
    """Deliveries messages received (each several trajectories or abandons)."""

    def __post_init__(self) -> None:
        for it in self.prompts:
            self.images.update(zip(it.image_digests, it.images, strict=True))


class FakeBuffer:
    def __init__(self, ctx: Any, endpoint: str, state: FakeBufferState, opts: Any):
        self.ctx, self.endpoint, self.state, self.opts = ctx, endpoint, state, opts
        self.srv: RpcServer | None = None

    async def start(self) -> None:
        srv = RpcServer(self.ctx, self.endpoint, "buffer-0", "buffer", self.opts)
        srv.on(PromptRequest, self._prompts)
        srv.on(PartialChunk, self._chunk)
        srv.on(PartialBatch, self._batch)
        srv.on(Trajectory, self._trajectory)
        srv.on(TrajectoryAbandoned, self._abandoned)
        srv.on(Deliveries, self._deliveries)
        srv.on(ImagePut, self._image_put)
        srv.on(ImageFetch, self._image_fetch)
        await srv.start()
        self.srv = srv

    async def stop(self) -> None:
        if self.srv is not None:
            await self.srv.close()
            self.srv = None

    async def _prompts(self, peer: Any, msg: PromptRequest) -> PromptReply:
        st = self.state
        st.requests.append(msg)
        last = st.last_reply.get(msg.rollout_id)
        if (
            msg.request_id and last is not None and last[0] == msg.request_id
        ):  # a retry: same groups
            return PromptReply(items=last[1])
        if msg.version < st.min_version:
            return PromptReply(
                retry_after_s=0.05, reason="need_version", min_version=st.min_version
            )
        items, st.prompts = st.prompts[: msg.max_groups], st.prompts[msg.max_groups :]
        st.last_reply[msg.rollout_id] = (msg.request_id, items)
        if items and st.stall_next_reply_s:
            stall, st.stall_next_reply_s = st.stall_next_reply_s, 0.0
            await asyncio.sleep(stall)  # the reply the rollout gives up on
        return PromptReply(
            items=items, retry_after_s=0.0 if items else 0.05, reason="" if items else "empty"
        )

    def _chunk(self, peer: Any, msg: PartialChunk) -> None:
        self._entry(msg.uid, msg.offset, msg.token_ids, msg.header, msg.rollout_id)

    def _batch(self, peer: Any, msg: PartialBatch) -> None:
        """What the rollouts send: entry i is a chunk of uids[i] (see laminar/protocol/data.py)."""
        heads = dict(
            zip([] if msg.header_at is None else msg.header_at.tolist(), msg.headers, strict=True)
        )
        lo = 0
        for i, (uid, off, n) in enumerate(
            zip(msg.uids, msg.offsets.tolist(), msg.lengths.tolist(), strict=True)
        ):
            self._entry(uid, off, msg.token_ids[lo : lo + n], heads.get(i), msg.rollout_id)
            lo += n

    def _entry(self, uid: str, offset: int, token_ids: Any, header: Any, rollout_id: str) -> None:
        rec = self.state.partials.get(uid)
        if header is not None:
            rec = self.state.partials[uid] = {"header": header, "ids": [], "owner": rollout_id}
        if rec is None or offset != len(rec["ids"]):
            rec = self.state.partials.setdefault(
                uid, {"header": None, "ids": [], "owner": rollout_id}
            )
            rec["gap"] = True
            return
        rec["ids"].extend(int(t) for t in token_ids)

    def _trajectory(self, peer: Any, msg: Trajectory) -> TrajectoryAck:
        st = self.state
        st.arrivals[msg.uid] += 1
        st.stored.setdefault(msg.uid, msg)
        st.partials.pop(msg.uid, None)
        st.changed.set()
        return TrajectoryAck()

    def _image_put(self, peer: Any, msg: ImagePut) -> ImagePutReply:
        from laminar.vision.images import digest_of

        self.state.puts.append(msg)
        ok = [d for d, b in zip(msg.digests, msg.data, strict=True) if digest_of(b) == d]
        bad = [d for d in msg.digests if d not in ok]
        self.state.images.update(
            (d, b) for d, b in zip(msg.digests, msg.data, strict=True) if d in ok
        )
        return ImagePutReply(stored=ok, refused=bad, reason="digest mismatch" if bad else "")

    def _image_fetch(self, peer: Any, msg: ImageFetch) -> ImageBlobs:
        have = [d for d in msg.digests if d in self.state.images]
        self.state.fetched += have
        return ImageBlobs(
            digests=have,
            data=[self.state.images[d] for d in have],
            missing=[d for d in msg.digests if d not in self.state.images],
        )

    def _abandoned(self, peer: Any, msg: TrajectoryAbandoned) -> TrajectoryAck:
        self.state.abandoned[msg.uid] = msg
        self.state.changed.set()
        return TrajectoryAck()

    def _deliveries(self, peer: Any, msg: Deliveries) -> DeliveryAcks:
        self.state.deliveries += 1
        acks = [self._trajectory(peer, t) for t in msg.trajectories]
        return DeliveryAcks(acks=acks + [self._abandoned(peer, a) for a in msg.abandoned])


# ---- harness: manager + fake buffer + rollouts over inproc -------------------------------

_names = itertools.count()


def make_cfg(run_dir: Path, **over: Any):
    data: dict[str, Any] = {
        "name": f"rt{os.getpid()}x{next(_names)}",
        "run_dir": str(run_dir),
        "cluster": {"transport": "inproc"},
        # death after 1 s of silence: 2 cores shared with other test processes must not fake deaths
        "transport": {
            "heartbeat_interval_s": 0.1,
            "heartbeat_liveness": 10,
            "handshake_timeout_s": 2.0,
            "request_timeout_s": 1.0,
            "startup_timeout_s": 15.0,
            "stop_timeout_s": 5.0,
            "reconnect_backoff_s": 0.02,
            "reconnect_backoff_max_s": 0.1,
        },
        # the tests send repack commands themselves; the manager's own repack would race them
        "manager": {"repack": {"enabled": False}},
        "rollout": {
            "engine": "sim",
            "credits": 2,
            "partial_chunk_tokens": 8,
            "weights": "dir",
            "prompt_retry_s": 0.05,
        },
    }
    for key, value in over.items():
        section, _, field = key.partition("__")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    return config_from_dict(data)


class Harness:
    def __init__(self, cfg: Any, items: list):
        self.cfg = cfg
        self.ctx = new_context()
        self.state = FakeBufferState(prompts=list(items))
        opts = socket_options(cfg)
        self.buffer = FakeBuffer(self.ctx, cfg.endpoint("buffer"), self.state, opts)
        self.manager = build_node(cfg, "manager", ctx=self.ctx)
        self.rollouts: list[RolloutNode] = []
        self.tasks: list[asyncio.Task] = []
        self.nodes: list[Any] = []

    async def start_node(self, node: Any) -> Any:
        task = asyncio.create_task(node.run())
        self.tasks.append(task)
        self.nodes.append(node)
        if isinstance(node, RolloutNode) and node not in self.rollouts:
            self.rollouts.append(node)
        ready = asyncio.create_task(node.ready.wait())
        await asyncio.wait({ready, task}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        assert node.ready.is_set(), f"{node.node_id} not ready"
        return node

    async def add_rollout(
        self, engine: FakeEngine | None = None, index: int | None = None
    ) -> RolloutNode:
        idx = len(self.rollouts) if index is None else index
        node = build_node(self.cfg, "rollout", idx, ctx=self.ctx, engine=engine or FakeEngine())
        return await self.start_node(node)

    async def wait_stored(self, uids: set[str], timeout: float) -> None:
        async def done() -> None:
            while not uids <= set(self.state.stored):
                self.state.changed.clear()
                await self.state.changed.wait()

        try:
            await asyncio.wait_for(done(), timeout)
        except TimeoutError:
            missing = sorted(uids - set(self.state.stored))
            raise AssertionError(
                f"{len(missing)} trajectories never arrived, e.g. {missing[:5]}"
            ) from None
        self.check()

    def check_arrivals(self) -> None:
        """Stored once each; any extra arrival must be an outbox resend (an ack that came too
        late)."""
        extra = sum(c - 1 for c in self.state.arrivals.values())
        resends = sum(r.outbox.stats["retries"] for r in self.rollouts)
        assert extra <= resends, f"{extra} duplicate arrivals but only {resends} resends"
        assert set(self.state.arrivals) == set(self.state.stored)

    def check(self) -> None:
        for t in self.tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()

    async def close(self) -> None:
        for node in reversed(self.nodes):
            node.request_stop("test over")
        results = await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), 20)
        await self.buffer.stop()
        self.ctx.destroy(linger=0)
        for r in results:
            if isinstance(r, BaseException):
                raise r


@asynccontextmanager
async def harness(cfg: Any, items: list) -> AsyncIterator[Harness]:
    h = Harness(cfg, items)
    await h.buffer.start()
    await h.start_node(h.manager)
    try:
        yield h
    finally:
        await h.close()


def uids_of(items: list) -> set[str]:
    return {f"{it.group_id}/{i}" for it in items for i in range(it.n)}


def write_weights(run_dir: Path, version: int) -> None:
    from safetensors.numpy import save_file

    d = run_dir / "weights"
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".v{version}.tmp"
    save_file({"w": np.full((4,), float(version), np.float32)}, str(tmp))
    os.replace(tmp, d / f"v{version}.safetensors")  # the trainer's atomic handoff


async def wait_for(cond: Any, timeout: float, what: str) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)  # poll of a condition with no event of its own, under a deadline
