"""The one engine interface every rollout backend implements (torch, vllm, sim).

    engine = make_engine(cfg.rollout, cfg.model)  # laminar.engines.factory.make_engine
    await engine.start()
    engine.submit(GenRequest("g1", prompt_ids, SamplingParams(max_tokens=64), n=4, version=3))
    async for ev in engine.events():            # TokenEvents of every sequence, in step order
        ...                                     # ev.seq_id == "g1/0" .. "g1/3"
    partials = await engine.abort(["g1/2"])     # PartialState: prompt + generated tokens + logprobs
    engine.submit(GenRequest.resume(partials[0], params))   # on another engine, same version
    await engine.load_weights(named_tensors, version=4)     # applied between decode steps
    engine.stats()                               # EngineStats(kv_use, running, waiting, version)
    slept = await engine.sleep()                 # colocated: device memory freed (SleepStats)
    slept = await engine.sleep(keep_weights=False)  # ... the weights too, no host copy
    woke = await engine.wake_up()                # back on the device, same version

Everything is per sequence: a request with n samples becomes n sequences
"<req_id>/<i>" (n == 1 keeps "<req_id>" unchanged only when `seq_ids` says so, see
GenRequest.seq_ids). Events may carry several tokens at once (the sim engine
emits in chunks so hundreds of engines fit in one process). Each token's logprob
is the sampled token's log-probability under the exact sampling distribution
(after temperature and top-p), so the trainer can use it as the behaviour policy.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laminar.config import SamplingConfig
from laminar.supervise import Spawn, detached_spawn
from laminar.weights.digest import weights_digest

_EMPTY_I = np.zeros(0, np.int32)
_EMPTY_F = np.zeros(0, np.float32)


@dataclass(frozen=True)
class Structured:
    """Constrained decoding of one request: its text must be JSON (an engine whose
    `Engine.structured` lists the kind enforces it; the others are never handed one)."""

    kind: str
    """json_object (any JSON object) | json_schema (one matching `schema`)."""
    schema: str = ""
    """json_schema: the JSON schema, as JSON text (hashable, as SamplingParams is)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    """Cap on response tokens, counting resumed tokens."""
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    """Besides the model's EOS."""
    seed: int | None = None
    """Seeded sampling is deterministic per (seed, sequence id, token index), also across resume."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks with fixed lengths); stop_token_ids still stop."""
    structured: Structured | None = None
    """Constrain the text (an agent call's response_format); only for an engine whose
    `structured` lists its kind."""

    @classmethod
    def from_config(cls, s: SamplingConfig, **kw: Any) -> SamplingParams:
        return cls(
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=s.max_tokens,
            stop=tuple(s.stop),
            **kw,
        )


@dataclass
class GenRequest:
    req_id: str
    prompt_ids: np.ndarray
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    version: int = 0
    resume_ids: np.ndarray = field(default_factory=lambda: _EMPTY_I)
    """Tokens already generated elsewhere (repack / recovery); generation continues after them."""
    resume_logprobs: np.ndarray = field(default_factory=lambda: _EMPTY_F)
    single: bool = False
    """n == 1 and the sequence id is req_id itself (used for resumed trajectories)."""
    turn: int = 0
    """Multi-turn episodes: index of the model turn this request generates (0: the first)."""
    turn_start: int = 0
    """Multi-turn: index in the response (resume_ids) where this model turn began; the sim engine
    draws each turn's length from (seq_id, turn) and ends the turn with "stop"."""
    images: tuple[bytes, ...] = ()
    """Vision-language models: the prompt's encoded images in placeholder order (checked against
    their digests by whoever handed them over; engines/vlm_engine.py)."""

    def seq_ids(self) -> list[str]:
        if self.single:
            return [self.req_id]
        return [f"{self.req_id}/{i}" for i in range(self.n)]

    @classmethod
    def resume(cls, p: PartialState, params: SamplingParams) -> GenRequest:
        return cls(
            p.seq_id,
            p.prompt_ids,
            params,
            1,
            p.version,
            p.output_ids,
            p.logprobs,
            single=True,
            images=p.images,
        )


@dataclass
class TokenEvent:
    seq_id: str
    token_ids: np.ndarray
    """New tokens since the last event of this sequence (int32)."""
    logprobs: np.ndarray
    """Behaviour logprob of each new token (float32)."""
    finish_reason: str | None = None
    """None while running; stop | length | abort | error when this is the sequence's last event."""
    version: int = 0
    routes: np.ndarray | None = None
    """MoE engines that record routes: the top-k expert ids (n, moe_layers, k) of the positions
    route_start .. route_start + n of prompt + response that this step ran through the model (a
    prefill: all of them; a decode step: the token sampled before); None: nothing recorded."""
    route_start: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PartialState:
    """A sequence taken out of an engine (abort): enough to resume it anywhere at the same
    version."""

    seq_id: str
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    logprobs: np.ndarray
    version: int
    params: SamplingParams | None = None
    images: tuple[bytes, ...] = ()
    """The prompt's encoded images (vision-language models), as GenRequest.images."""


@dataclass
class EngineStats:
    kv_use: float
    """Fraction of KV-cache capacity in use, in [0, 1]."""
    running: int
    waiting: int
    version: int
    tokens_generated: int = 0
    preemptions: int = 0
    """Running sequences sent back to waiting for lack of KV cache (recomputed later), so far."""


@dataclass(frozen=True)
class SleepStats:
    """One sleep or wake of an engine (colocated placement, docs/colocated.md)."""

    seconds: float
    weight_bytes: int = 0
    """Weight bytes moved to host memory (sleep) or back to the device (wake); 0: none moved or
    the engine cannot say (vLLM's allocator does it in its workers)."""
    kv_bytes: int = 0
    """KV-cache bytes freed (sleep) or allocated again (wake)."""
    dropped_bytes: int = 0
    """Weight bytes freed with no host copy (a sleep with keep_weights=False)."""
    needs_load: bool = False
    """A wake after a drop: the weights are allocated but hold no values; a whole version must
    be loaded before any prompt runs."""


class Engine(ABC):
    """Base: event routing. Implementations call `self._emit(ev)` from their step loop."""

    name = "engine"
    capacity: int = 0
    """KV-cache capacity in tokens (0: unknown)."""
    max_running: int = 0
    """Sequences it decodes at once (0: unknown; the rollout then reports rollout.max_running)."""
    structured: frozenset[str] = frozenset()
    """The Structured kinds it enforces (SamplingParams.structured); an agent call asking for
    another is refused at the endpoint, naming the engine."""

    def __init__(self) -> None:
        self.version = 0
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._streams: dict[str, asyncio.Queue[TokenEvent]] = {}

    # ---- implementations provide -------------------------------------------------
    @abstractmethod
    async def start(self, spawn: Spawn = detached_spawn) -> None:
        """Get ready to serve; a background loop the engine needs starts through `spawn`
        (a rollout passes its node's, so a dying engine loop stops the node loudly).

        Start-up may take long (vLLM: spawn a process, load, warm up), but it must never block
        the caller's event loop: blocking work goes to a thread (asyncio.to_thread). The rollout
        runs start() as a background task under rollout.engine_start_timeout_s, beating and
        reporting starting_engine meanwhile, and cancels it (then calls close()) when it stops
        or the deadline passes: close() must also work on an engine whose start was cut short,
        and must leave no engine process behind (laminar/engines/lifeline.py covers kill -9)."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def submit(self, req: GenRequest) -> None:
        """Queue a request (non-blocking); its sequences join the running batch between steps."""

    @abstractmethod
    async def abort(self, seq_ids: Iterable[str]) -> list[PartialState]:
        """Stop these sequences (running or waiting) and return their partial state.

        Unknown or already finished ids are skipped. Aborted sequences emit no more events
        except one final event with finish_reason="abort" (and no tokens)."""

    @abstractmethod
    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Replace the model weights between decode steps; returns once applied."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    async def sleep(self, keep_weights: bool = True) -> SleepStats:
        """Colocated placement: release the device for the trainer. Only called with nothing in
        flight (the rollout drains first); the KV cache is dropped and the weights go to host
        memory (keep_weights) or are freed outright (the wake then needs a load of a whole
        version: cluster.colocate.rollout_weights=drop). Engines without a device (sim) do
        nothing."""
        raise NotImplementedError(f"the {self.name} engine has no sleep mode")

    async def wake_up(self) -> SleepStats:
        """Undo sleep(): weights back on the device, a fresh KV cache; serves the same version
        (a load_weights of the new one follows)."""
        raise NotImplementedError(f"the {self.name} engine has no sleep mode")

    def served_weights(self) -> list[tuple[str, Any]] | None:
        """The tensors this engine serves, under the names the last load_weights gave, read back
        from the engine itself (not from what was loaded): what attestation digests. None: this
        engine cannot say (sim), and its versions go unattested."""
        return None

    async def served_digest(self) -> str | None:
        """The digest (laminar/weights/digest.py) of what this engine serves now, read back from
        the engine: what the rollout's gate attests after each load. By default served_weights()
        digested on a worker thread; an engine whose tensors live elsewhere (vLLM's workers)
        folds them there. None: not attested."""
        served = self.served_weights()
        if served is None:
            return None
        return await asyncio.to_thread(weights_digest, served)

    # ---- shared ------------------------------------------------------------------
    def _emit(self, ev: TokenEvent) -> None:
        q = self._streams.get(ev.seq_id)
        (q if q is not None else self._events).put_nowait(ev)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Events of every sequence not consumed through generate()."""
        while True:
            yield await self._events.get()

    async def next_event(self, timeout: float | None = None) -> TokenEvent:
        return await asyncio.wait_for(self._events.get(), timeout)

    async def generate(
        self, req: GenRequest, timeout: float | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Submit and stream this request's events until all its sequences finish."""
        ids = req.seq_ids()
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        for s in ids:
            self._streams[s] = q
        try:
            self.submit(req)
            pending = set(ids)
            while pending:
                try:
                    ev = await asyncio.wait_for(q.get(), timeout)
                except TimeoutError:
                    raise TimeoutError(
                        f"{req.req_id}: no engine output within {timeout}s"
                    ) from None
                if ev.finished:
                    pending.discard(ev.seq_id)
                yield ev
        finally:
            for s in ids:
                self._streams.pop(s, None)

    async def generate_all(
        self, req: GenRequest, timeout: float | None = None
    ) -> dict[str, tuple[np.ndarray, np.ndarray, str]]:
        """Convenience: run a request to completion -> {seq_id: (token_ids, logprobs,
        finish_reason)}."""
        toks: dict[str, list[np.ndarray]] = {s: [] for s in req.seq_ids()}
        lps: dict[str, list[np.ndarray]] = {s: [] for s in req.seq_ids()}
        reasons: dict[str, str] = {}
        async for ev in self.generate(req, timeout):
            toks[ev.seq_id].append(ev.token_ids)
            lps[ev.seq_id].append(ev.logprobs)
            if ev.finished:
                reasons[ev.seq_id] = ev.finish_reason or ""
        return {
            s: (
                np.concatenate(toks[s]).astype(np.int32) if toks[s] else _EMPTY_I.copy(),
                np.concatenate(lps[s]).astype(np.float32) if lps[s] else _EMPTY_F.copy(),
                reasons[s],
            )
            for s in toks
        }
