"""Fakes for the rollout tests: a deterministic engine and a minimal buffer server.

FakeEngine implements laminar.engines.base.Engine: one token per sequence per step,
token i of trajectory uid is crc32(f"{uid}:{i}") % vocab, length crc32(uid) % span
+ base. So a trajectory exported, then resumed elsewhere, must come out identical
to one that ran uninterrupted: the tests compare them token for token.

FakeBuffer speaks the buffer protocol (laminar/protocol/buffer.py) on an RpcServer:
serves PromptItems from a list, keeps the partial pool (header restarts a record),
stores Trajectories deduplicated by uid (acking duplicates) and counts every
arrival, so "nothing lost, nothing twice" can be asserted. Its state lives in a
FakeBufferState that survives stop()/start(), like a journaled buffer restarted on
the same run dir.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laminar.engines.base import Engine, EngineStats, GenRequest, PartialState, TokenEvent
from laminar.protocol.buffer import PromptReply, PromptRequest, TrajectoryAbandoned
from laminar.protocol.core import Ack
from laminar.protocol.data import PartialChunk, PromptItem, Trajectory
from laminar.transport.sockets import RpcServer


def fake_token(uid: str, i: int, vocab: int = 50) -> int:
    return 4 + zlib.crc32(f"{uid}:{i}".encode()) % (vocab - 4)


def fake_length(uid: str, base: int = 8, span: int = 40) -> int:
    return base + zlib.crc32(uid.encode()) % span


class FakeEngine(Engine):
    name = "fake"

    def __init__(self, step_s: float = 0.002, base: int = 8, span: int = 40, hold: bool = False):
        super().__init__()
        self.step_s, self.base, self.span = step_s, base, span
        self.hold = hold
        """True: sequences never finish (export tests)."""
        self.running: dict[str, dict[str, Any]] = {}
        self.loads: list[int] = []
        self.submitted: list[GenRequest] = []
        self.tokens_generated = 0
        self.peak_groups = 0
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def submit(self, req: GenRequest) -> None:
        assert req.version == self.version, f"request at v{req.version} on an engine at v{self.version}"
        self.submitted.append(req)
        for sid in req.seq_ids():
            target = min(fake_length(sid, self.base, self.span), req.params.max_tokens)
            self.running[sid] = dict(prompt=np.asarray(req.prompt_ids, np.int32), ids=list(req.resume_ids),
                                     lps=list(req.resume_logprobs), target=target, version=req.version)  # fmt: skip

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)  # the emulated decode step
            self.peak_groups = max(self.peak_groups, len({sid.rsplit("/", 1)[0] for sid in self.running}))
            for sid, s in list(self.running.items()):
                i = len(s["ids"])
                if self.hold and i >= s["target"] - 1:
                    continue
                tok, lp = fake_token(sid, i), -0.01 * (i + 1)
                s["ids"].append(tok)
                s["lps"].append(lp)
                self.tokens_generated += 1
                done = len(s["ids"]) >= s["target"]
                if done:
                    del self.running[sid]
                self._emit(TokenEvent(sid, np.array([tok], np.int32), np.array([lp], np.float32),
                                      "length" if done else None, s["version"]))  # fmt: skip

    async def abort(self, seq_ids: Iterable[str]) -> list[PartialState]:
        out = []
        for sid in seq_ids:
            s = self.running.pop(sid, None)
            if s is None:
                continue
            out.append(PartialState(sid, s["prompt"], np.asarray(s["ids"], np.int32),
                                    np.asarray(s["lps"], np.float32), s["version"]))  # fmt: skip
            self._emit(TokenEvent(sid, np.zeros(0, np.int32), np.zeros(0, np.float32), "abort", s["version"]))
        return out

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        assert not self.running, "weights loaded while sequences were in flight"
        list(named_tensors)
        self.version = version
        self.loads.append(version)

    def stats(self) -> EngineStats:
        return EngineStats(min(1.0, len(self.running) / 64), len(self.running), 0, self.version, self.tokens_generated)


def expected_response(uid: str, base: int = 8, span: int = 40) -> list[int]:
    return [fake_token(uid, i) for i in range(fake_length(uid, base, span))]


def make_items(count: int, n: int, prefix: str = "p") -> list[PromptItem]:
    return [PromptItem(uid=f"{prefix}{k}", group_id=f"{prefix}{k}@0", prompt_ids=np.arange(1, 6, dtype=np.int32) + k,
                       n=n, prompt=f"prompt {k}", row={"answer": str(k)}) for k in range(count)]  # fmt: skip


@dataclass
class FakeBufferState:
    prompts: list[PromptItem]
    min_version: int = -1
    stored: dict[str, Trajectory] = field(default_factory=dict)
    arrivals: Counter = field(default_factory=Counter)
    partials: dict[str, dict[str, Any]] = field(default_factory=dict)
    abandoned: dict[str, TrajectoryAbandoned] = field(default_factory=dict)
    requests: list[PromptRequest] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class FakeBuffer:
    def __init__(self, ctx: Any, endpoint: str, state: FakeBufferState, opts: Any):
        self.ctx, self.endpoint, self.state, self.opts = ctx, endpoint, state, opts
        self.srv: RpcServer | None = None

    async def start(self) -> None:
        srv = RpcServer(self.ctx, self.endpoint, "buffer-0", "buffer", self.opts)
        srv.on(PromptRequest, self._prompts)
        srv.on(PartialChunk, self._chunk)
        srv.on(Trajectory, self._trajectory)
        srv.on(TrajectoryAbandoned, self._abandoned)
        await srv.start()
        self.srv = srv

    async def stop(self) -> None:
        if self.srv is not None:
            await self.srv.close()
            self.srv = None

    def _prompts(self, peer: Any, msg: PromptRequest) -> PromptReply:
        st = self.state
        st.requests.append(msg)
        if msg.version < st.min_version:
            return PromptReply(retry_after_s=0.05, reason="need_version", min_version=st.min_version)
        items, st.prompts = st.prompts[: msg.max_groups], st.prompts[msg.max_groups :]
        return PromptReply(items=items, retry_after_s=0.0 if items else 0.05, reason="" if items else "empty")

    def _chunk(self, peer: Any, msg: PartialChunk) -> None:
        rec = self.state.partials.get(msg.uid)
        if msg.header is not None:
            rec = self.state.partials[msg.uid] = {"header": msg.header, "ids": [], "owner": msg.rollout_id}
        if rec is None or msg.offset != len(rec["ids"]):
            rec = self.state.partials.setdefault(msg.uid, {"header": None, "ids": [], "owner": msg.rollout_id})
            rec["gap"] = True
            return
        rec["ids"].extend(int(t) for t in msg.token_ids)

    def _trajectory(self, peer: Any, msg: Trajectory) -> Ack:
        st = self.state
        st.arrivals[msg.uid] += 1
        st.stored.setdefault(msg.uid, msg)
        st.partials.pop(msg.uid, None)
        st.changed.set()
        return Ack()

    def _abandoned(self, peer: Any, msg: TrajectoryAbandoned) -> Ack:
        self.state.abandoned[msg.uid] = msg
        self.state.changed.set()
        return Ack()
