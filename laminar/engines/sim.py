"""Sim engine: no model, tokens on a latency model, event-driven so hundreds fit in one process.

    engine = SimEngine.from_config(cfg.rollout)  # rollout.sim: step time, bound B, lengths, KV
    await engine.start(); engine.submit(req) # same interface and events as the torch / vllm engines

Latency model: every running sequence makes one token per decode step; a step
takes step_time_s while at most bound_b sequences run, and grows linearly past B
(step_time_s * running / bound_b) — the roofline shape of a real decode step.
Response lengths are lognormal with median length_p50 and p99 = p50 *
length_p99_over_p50, clipped at max_tokens; a sequence's length comes from a hash
of (seed, seq_id), so a resumed sequence keeps its target wherever it lands.

No per-token work: progress is computed from the clock. Each engine keeps one
timer, set to the next moment anything observable happens (a sequence finishes,
or one reaches a `chunk_tokens` boundary), and on every wake, submit, abort or
stats() it settles "how many steps fit since the last settle" in closed form and
emits multi-token events. Token ids and logprobs are hashes of (seq, position),
so they too are deterministic. Stop strings and stop token ids are not
emulated; a sequence ends with "stop" at its drawn length, or "length" at max_tokens.

Prefill (`prefill_tok_s`; None = free): a sequence entering the batch stalls decoding for the
tokens the engine must compute / prefill_tok_s: its prompt and every resumed token (an
interrupted sequence put back under new weights, a repack import, a resume after a failure),
less what its prefix cache still holds. The cache keeps a finished turn's tokens for the next
turn of the same sequence (multi-turn: only the environment's tokens are new) until the next
weight load, which computed that KV with other weights and so drops it. Each admission is
charged once, when it joins the batch; the same model as bench/simcore.py's `admit`.

Multi-turn (GenRequest.turn / turn_start, set by laminar/rollout/episodes.py): model turn k
ends with "stop" at turn_start + a length drawn from (seed, seq_id, k) with the same
lognormal (so length_p50 is the per-turn median), or with "length" at max_tokens (which
counts the whole response, environment tokens included). Turn 0 draws exactly what a
single-turn sequence draws. The environment between turns is laminar/envs/sim.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from laminar.config import RolloutConfig
from laminar.engines.base import (
    Engine,
    EngineStats,
    GenRequest,
    PartialState,
    SamplingParams,
    SleepStats,
    TokenEvent,
)
from laminar.supervise import Spawn, detached_spawn

_Z99 = NormalDist().inv_cdf(0.99)
_NO_I = np.zeros(0, np.int32)
_NO_F = np.zeros(0, np.float32)
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _hash64(*parts: Any) -> int:
    return int.from_bytes(
        hashlib.blake2b("\x00".join(map(str, parts)).encode(), digest_size=8).digest(), "little"
    )


def target_length(seed: int, seq_id: str, p50: float, p99_over_p50: float, turn: int = 0) -> int:
    """Drawn response length (>= 1, before the max_tokens clip) of a sequence: lognormal, from a
    hash. Multi-turn: the length of model turn `turn` (turn 0 draws what a single-turn sequence
    of the same id draws, so a single-turn run is unchanged)."""
    key = _hash64("len", seed, seq_id) if turn == 0 else _hash64("len", seed, seq_id, "turn", turn)
    u = (key + 0.5) / 2.0**64
    sigma = math.log(p99_over_p50) / _Z99
    return max(1, round(p50 * math.exp(sigma * NormalDist().inv_cdf(u))))


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sim_tokens(key: int, start: int, stop: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Pseudo-random token ids (< vocab) and logprobs (in [-3, 0]) of positions [start, stop)."""
    z = _mix(np.uint64(key) ^ _mix(np.arange(start, stop, dtype=np.uint64)))
    ids = (z % np.uint64(vocab)).astype(np.int32)
    lps = (-3.0 * (z >> np.uint64(11)).astype(np.float64) / 2.0**53).astype(np.float32)
    return ids, lps


@dataclass(eq=False)
class _Seq:
    seq_id: str
    prompt: np.ndarray
    params: SamplingParams
    version: int
    key: int
    target: int
    reason: str
    done: int
    """Tokens generated as of the last settle, resumed tokens included."""
    ids: list[np.ndarray] = field(default_factory=list)
    lps: list[np.ndarray] = field(default_factory=list)
    emitted: int = 0
    prefill: int = 0
    """Tokens it must compute when it joins the batch (prompt + resumed, less its prefix cache)."""


class SimEngine(Engine):
    name = "sim"

    def __init__(
        self,
        *,
        step_time_s: float = 0.02,
        bound_b: int = 64,
        length_p50: float = 200,
        length_p99_over_p50: float = 10.0,
        kv_capacity_tokens: int = 200_000,
        vocab_size: int = 32000,
        seed: int = 0,
        max_running: int = 32,
        chunk_tokens: int = 32,
        load_time_s: float = 0.0,
        prefill_tok_s: float | None = None,
    ) -> None:
        super().__init__()
        self.step_time_s, self.bound_b = step_time_s, bound_b
        self.length_p50, self.length_p99_over_p50 = length_p50, length_p99_over_p50
        self.capacity, self.vocab_size, self.seed = kv_capacity_tokens, vocab_size, seed
        self.max_running, self.chunk_tokens, self.load_time_s = (
            max_running,
            chunk_tokens,
            load_time_s,
        )
        self.prefill_tok_s = prefill_tok_s
        self.prefill_tokens = 0
        """Tokens charged as prefill so far."""
        self.prefill_s = 0.0
        """Decode time lost to prefill so far."""
        self._debt = 0.0
        """Prefill charged while a load pauses decoding: it runs once the load is done."""
        self._loads = 0
        self._prefix: OrderedDict[str, tuple[int, int]] = OrderedDict()
        """Prefix cache: sequence id -> (loads when its turn ended, tokens its KV held then)."""
        self._running: list[_Seq] = []
        self._waiting: deque[_Seq] = deque()
        self._seqs: dict[str, _Seq] = {}
        self._t0 = 0.0  # clock time of the first step not yet settled
        self._paused = False
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.tokens_generated = 0
        self.wakes = 0

    @classmethod
    def from_config(cls, r: RolloutConfig, **kw: Any) -> SimEngine:
        s = r.sim
        opts: dict[str, Any] = dict(
            step_time_s=s.step_time_s,
            bound_b=s.bound_b,
            length_p50=s.length_p50,
            length_p99_over_p50=s.length_p99_over_p50,
            kv_capacity_tokens=s.kv_capacity_tokens,
            vocab_size=s.vocab_size,
            seed=s.seed,
            max_running=r.max_running,
            chunk_tokens=s.chunk_tokens or r.partial_chunk_tokens,
            load_time_s=s.load_time_s,
            prefill_tok_s=s.prefill_tok_s,
        )
        opts.update(kw)
        return cls(**opts)

    async def start(self, spawn: Spawn = detached_spawn) -> None:
        # no loop of its own: token emission runs on event-loop timers
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _now(self) -> float:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.time()

    # ---- interface ---------------------------------------------------------------------
    def submit(self, req: GenRequest) -> None:
        now = self._now()
        self._settle(now)
        resumed = np.asarray(req.resume_ids, np.int32)
        resumed_lps = np.asarray(req.resume_logprobs, np.float32)
        for sid in req.seq_ids():
            # a model turn ends turn_start + its drawn length into the response (single-turn: turn
            # 0 from 0); it depends only on (seed, seq_id, turn, turn_start), so a resumed turn
            # (repack, replay elsewhere) keeps its target
            drawn = req.turn_start + target_length(
                self.seed, sid, self.length_p50, self.length_p99_over_p50, req.turn
            )
            target = min(drawn, req.params.max_tokens)
            reason = "stop" if drawn <= req.params.max_tokens else "length"
            if sid in self._seqs or len(req.prompt_ids) == 0:
                self._emit(TokenEvent(sid, _NO_I, _NO_F, "error", self.version))
                continue
            if len(resumed) >= target:
                self._emit(TokenEvent(sid, _NO_I, _NO_F, reason, self.version))
                continue
            s = _Seq(
                sid,
                np.asarray(req.prompt_ids, np.int32),
                req.params,
                req.version,
                _hash64("tok", self.seed, sid),
                target,
                reason,
                len(resumed),
                [resumed.copy()],
                [resumed_lps.copy()],
                len(resumed),
            )
            s.prefill = max(0, len(s.prompt) + len(resumed) - self._cached(sid))
            self._seqs[sid] = s
            self._waiting.append(s)
        self._admit()
        self._reschedule()

    async def abort(self, seq_ids: Iterable[str]) -> list[PartialState]:
        self._settle(self._now())
        out = []
        for sid in seq_ids:
            s = self._seqs.pop(sid, None)
            if s is None:
                continue
            (self._running if s in self._running else self._waiting).remove(s)
            # Every token made so far travels (vLLM's abort returns them all): the progress since
            # the last chunk goes out as one more event first, so the stream and the partial agree.
            if s.done > s.emitted:
                self._flush(s, None)
            ids, lps = np.concatenate(s.ids), np.concatenate(s.lps)
            out.append(PartialState(sid, s.prompt, ids, lps, s.version, s.params))
            self._emit(TokenEvent(sid, _NO_I, _NO_F, "abort", self.version))
        self._admit()
        self._reschedule()
        return out

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        for _ in named_tensors:  # consume (a relay reader may be streaming them)
            pass
        if self.load_time_s > 0:
            self._settle(self._now())
            self._paused = True
            self._reschedule()
            try:
                await asyncio.sleep(
                    self.load_time_s
                )  # the emulated load itself: no decoding meanwhile
            finally:
                self._paused = False
                self._t0 = self._now() + self._debt  # what joined during the load prefills now
                self._debt = 0.0
        self.version = version
        self._loads += 1  # KV computed under the old weights: no prefix survives a load
        self._prefix.clear()
        self._reschedule()

    async def sleep(self, keep_weights: bool = True) -> SleepStats:
        """No device memory to release (an emulated engine): the prefix cache is forgotten, as a
        real engine's KV is. It keeps no weights, so a drop is the same."""
        self._prefix.clear()
        return SleepStats(0.0)

    async def wake_up(self) -> SleepStats:
        return SleepStats(0.0)

    def stats(self) -> EngineStats:
        if self._loop is not None:
            self._settle(self._now())
            self._reschedule()
        held = sum(len(s.prompt) + s.done for s in self._running)
        return EngineStats(
            min(1.0, held / self.capacity),
            len(self._running),
            len(self._waiting),
            self.version,
            self.tokens_generated,
        )

    # ---- the latency model ---------------------------------------------------------------
    def step_time(self, batch: int) -> float:
        return self.step_time_s * max(1.0, batch / self.bound_b)

    def _settle(self, now: float) -> None:
        """Advance every running sequence by the whole steps that fit in [t0, now]; emit what is
        due."""
        if not self._running:  # idle: the next joiner starts now
            self._t0 = max(self._t0, now)
            return
        if self._paused:
            return
        while self._running:
            dt = self.step_time(len(self._running))
            avail = int((now - self._t0) / dt + 1e-9) if dt > 0 else 1 << 62
            if avail <= 0:
                break
            left = min(s.target - s.done for s in self._running)
            k = min(avail, left)
            for s in self._running:
                s.done += k
            self.tokens_generated += k * len(self._running)
            self._t0 += k * dt
            if k < left:
                break
            # Some finished at t0: they leave, waiting ones join from t0 on (batch size, dt change).
            for s in [s for s in self._running if s.done >= s.target]:
                self._running.remove(s)
                self._seqs.pop(s.seq_id, None)
                self._flush(s, s.reason)
                if s.reason == "stop":  # a next turn of it finds its KV
                    self._remember(s.seq_id, len(s.prompt) + s.done)
            self._admit()
        for s in self._running:
            if s.done - s.emitted >= self.chunk_tokens:
                self._flush(s, None)

    def _flush(self, s: _Seq, reason: str | None) -> None:
        ids, lps = sim_tokens(s.key, s.emitted, s.done, self.vocab_size)
        s.ids.append(ids)
        s.lps.append(lps)
        s.emitted = s.done
        s.version = self.version
        self._emit(TokenEvent(s.seq_id, ids, lps, reason, self.version))

    def _admit(self) -> None:
        held = sum(len(s.prompt) + s.done for s in self._running)
        while self._waiting and len(self._running) < self.max_running:
            s = self._waiting[0]
            need = len(s.prompt) + s.done
            if self._running and held + need > self.capacity:
                break
            self._waiting.popleft()
            self._running.append(s)
            held += need
            self._charge(s.prefill)
            s.prefill = 0

    def _charge(self, tokens: int) -> None:
        """Prefill of `tokens` joining the batch: no decode step runs meanwhile."""
        if self.prefill_tok_s is None or tokens <= 0:
            return
        stall = tokens / self.prefill_tok_s
        self.prefill_tokens += tokens
        self.prefill_s += stall
        if self._paused:
            self._debt += stall
        else:
            self._t0 += stall

    def _cached(self, seq_id: str) -> int:
        """Tokens of `seq_id` its prefix cache still holds (0: none, or a load since)."""
        hit = self._prefix.pop(seq_id, None)
        return hit[1] if hit is not None and hit[0] == self._loads else 0

    def _remember(self, seq_id: str, tokens: int) -> None:
        self._prefix[seq_id] = (self._loads, tokens)
        while len(self._prefix) > 4 * self.max_running:  # an LRU bound, like a real cache's
            self._prefix.popitem(last=False)

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._paused or not self._running:
            return
        steps = min(
            min(s.target - s.done, self.chunk_tokens - (s.done - s.emitted)) for s in self._running
        )
        when = self._t0 + max(1, steps) * self.step_time(len(self._running))
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.wakes += 1
        self._settle(self._now())
        self._reschedule()
