"""Torch engine: continuous batching of an HF causal LM on CPU or CUDA with its own KV cache.

    engine = TorchEngine.from_config(cfg.rollout, cfg.model)  # or TorchEngine(model, tokenizer)
    await engine.start()
    req = GenRequest("g1", prompt_ids, SamplingParams(max_tokens=64), n=4)
    async for ev in engine.generate(req):
        ...

Dataflow (one asyncio task, the step loop; the forward runs in a one-thread executor
so the event loop keeps serving sockets and heartbeats):

    submit() ──► waiting (FIFO) ──admit──► running rows 0..R-1 ──step──► TokenEvent per sequence
                     ▲   (blocks for its      │ finish / abort: blocks freed, last row moves in
                     │    tokens, or it waits) │
                     └──── preempted (no free block, or weights reloaded: recompute) ◄┘

Each step is one packed forward over the paged KV cache (kv_cache.py; the layers run as
lean_forward.py's plain tensor ops for Llama-family models, else as the HF model's own
forward, `rollout.torch_forward`): a one-token decode query for every
running sequence plus the whole prompt (+ resumed tokens) of each sequence that
joins this step, up to `max_prefill_tokens`. Sampling (sampling.py) runs on the
logits of the last position of each, so every emitted token carries its exact
logprob.

Memory: the cache is a pool of `rollout.kv_capacity_tokens` positions in blocks of 16
(default max_running x max_model_len, the most the rows could ever hold). A sequence is admitted
only when the pool has blocks for its prompt (+ resumed tokens) and the token it samples; the
head of the queue waits for blocks otherwise (FIFO, like vLLM). When a running sequence needs a
block and none is free, the newest running sequence is preempted (vLLM's default, recompute): its
blocks are freed and it goes back to the head of the queue with its tokens, to be prefilled again
when blocks free up (counted in `preemptions`). Recompute rather than swapping to host memory:
the engine already re-prefills sequences after a weight load and on resume from another rollout,
so this adds no second path, and a rollout's prefill is cheap next to the decode it saves. A
sequence that alone outgrows the whole pool ends with finish_reason "length" (counted in
`kv_truncated`, logged): set kv_capacity_tokens >= max_model_len where that must not happen.

A lock serialises steps with abort() and load_weights(), so both take
effect between two decode steps. With model.lora a version is an adapter: it is merged into a
pristine copy of the base weights (models/lora.py MergedAdapter), all of it or, when it does not
fit (WeightsRejected), none of it, and the engine keeps serving and labelling its previous version.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from laminar.config import LoraConfig, ModelConfig, RolloutConfig
from laminar.engines.base import (
    Engine,
    EngineStats,
    GenRequest,
    PartialState,
    SamplingParams,
    SleepStats,
    TokenEvent,
)
from laminar.engines.kv_cache import BLOCK_TOKENS, PagedKVCache, StepLayout, use_paged_attention
from laminar.engines.lean_forward import lean_decoder
from laminar.engines.sampling import sample, sequence_key, uniform
from laminar.models.decoder_ops import text_config
from laminar.models.lora import MergedAdapter
from laminar.models.moe import MoeShape, RouteTap
from laminar.models.offload import HostStash, device_bytes
from laminar.models.rejected import WeightsRejected
from laminar.supervise import Spawn, detached_spawn

log = logging.getLogger(__name__)
_NO_I = np.zeros(0, np.int32)
_NO_F = np.zeros(0, np.float32)


@dataclass(eq=False)
class _Seq:
    seq_id: str
    prompt: list[int]
    params: SamplingParams
    version: int
    key: int
    out: list[int] = field(default_factory=list)
    """Response so far, resumed tokens included."""
    lps: list[float] = field(default_factory=list)
    slot: int = -1
    """Its row (block table) in the cache while running, else -1."""
    kv_len: int = 0
    """Positions of this sequence in the cache (prompt + out[:-1] while decoding)."""
    order: int = 0


@dataclass
class _Batch:
    decode: list[_Seq]
    prefill: list[_Seq]
    ids: torch.Tensor
    pos: torch.Tensor
    keep: torch.Tensor
    layout: StepLayout
    temperature: torch.Tensor
    top_p: torch.Tensor
    uniforms: torch.Tensor
    plain: bool
    """Every row samples at temperature 1, top_p 1 (sampling.sample's fast path)."""


class TorchEngine(Engine):
    name = "torch"

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        max_running: int = 32,
        max_model_len: int | None = None,
        kv_capacity_tokens: int | None = None,
        max_prefill_tokens: int = 4096,
        eos_token_ids: Iterable[int] | None = None,
        recompute_on_load: bool = True,
        forward: str = "auto",
        lora: LoraConfig | None = None,
        block_tokens: int = BLOCK_TOKENS,
        record_routes: bool = True,
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_running = max_running
        cfg = text_config(model)
        # an HF config (not ours) may lack the field
        self.max_model_len = int(
            max_model_len or getattr(cfg, "max_position_embeddings", None) or 2048
        )
        self.max_prefill_tokens = max_prefill_tokens
        self.recompute_on_load = recompute_on_load
        self.loaded_names: list[str] = []
        """The tensors the last load_weights set (what served_weights reads back)."""
        self.eos = set(eos_token_ids) if eos_token_ids is not None else _eos_ids(model, tokenizer)
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.cache = PagedKVCache.for_model(
            model,
            capacity_tokens=int(kv_capacity_tokens or max_running * self.max_model_len),
            rows=max_running,
            max_len=self.max_model_len,
            block_tokens=block_tokens,
        )
        self.capacity = self.cache.capacity
        """KV positions the pool holds (kv_capacity_tokens rounded up to whole blocks)."""
        self.adapter = MergedAdapter(model, lora) if lora is not None else None
        """model.lora: a version is an adapter, merged into a pristine copy of the base."""
        self.lean = lean_decoder(model, self.max_model_len, forward)
        if self.lean is None:  # HF's forward, with the paged attention plugged in
            use_paged_attention(model)
        moe = MoeShape.of(model)
        self.routes: RouteTap | None = None
        """MoE models (model.moe.routing_replay): each step's top-k expert ids per token and MoE
        layer, handed out on the TokenEvents (the lean forward returns them; HF's forward has
        forward hooks on its routers)."""
        if moe is not None and record_routes:
            self.routes = RouteTap(moe, None if self.lean is not None else model)
        self._running: list[_Seq] = []  # index == slot
        self._waiting: deque[_Seq] = deque()
        self._seqs: dict[str, _Seq] = {}
        self._order = itertools.count()
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._pool: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self.error: BaseException | None = None
        self.tokens_generated = 0
        self.steps = 0
        self.rejected = 0
        """Requests refused at submit (bad ids, too long, ...): each got a finish_reason="error"
        event."""
        self.preemptions = 0
        """Running sequences sent back to waiting because no KV block was free (recomputed)."""
        self.kv_truncated = 0
        """Sequences ended with "length" because they alone outgrew the whole KV pool."""
        self._stash = HostStash()
        """Colocated placement: the weights while asleep (sleep / wake_up)."""
        self._dropped: list[tuple[torch.Tensor, tuple[int, ...]]] = []
        """A sleep that dropped the weights: each weight and its shape (no values kept)."""
        self._unloaded: set[int] = set()
        """After waking from a drop: the weights no load has given values yet, by storage address
        (state_dict() hands out other tensor objects over the same storage)."""

    @classmethod
    def from_config(
        cls,
        r: RolloutConfig,
        mc: ModelConfig,
        model: Any = None,
        tokenizer: Any = None,
        **kw: Any,
    ) -> TorchEngine:
        """Engine for the rollout section; loads model.path unless a model is passed."""
        from laminar.models.decoder_lm import load_model
        from laminar.models.prompt_tokenizer import load_prompt_tokenizer

        if model is None:
            if not mc.path:
                raise ValueError(
                    "rollout.engine=torch needs model.path (a local HF model directory)"
                )
            model = load_model(
                mc.path,
                mc.dtype,
                mc.device,
                module_free=r.torch_forward != "hf",
                max_len=r.max_model_len,
            )
            # decode only (stop strings): no template to render
            tokenizer = tokenizer or load_prompt_tokenizer(mc.path, chat_template=False)
        opts: dict[str, Any] = dict(
            max_running=r.max_running,
            max_model_len=r.max_model_len,
            kv_capacity_tokens=r.kv_capacity_tokens,
            max_prefill_tokens=r.max_prefill_tokens,
            forward=r.torch_forward,
            lora=mc.lora,
            record_routes=mc.moe.routing_replay,
        )
        opts.update(kw)
        return cls(model, tokenizer, **opts)

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self, spawn: Spawn = detached_spawn) -> None:
        if self._task is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-engine")
            self._task = spawn(self._loop(), "torch-engine-steps")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- requests ----------------------------------------------------------------------
    def submit(self, req: GenRequest) -> None:
        if self.error is not None:
            raise RuntimeError(f"torch engine failed earlier: {self.error!r}")
        if self._unloaded or self._dropped:  # it would sample from uninitialised memory
            raise RuntimeError(
                "torch engine: its weights were dropped at a sleep and no whole version has "
                "been loaded since (cluster.colocate.rollout_weights=drop)"
            )
        prompt = np.asarray(req.prompt_ids).astype(np.int64).tolist()
        resumed = np.asarray(req.resume_ids).astype(np.int64).tolist()
        resumed_lps = np.asarray(req.resume_logprobs, np.float64).tolist()
        if len(resumed_lps) != len(resumed):
            resumed_lps = (resumed_lps + [float("nan")] * len(resumed))[: len(resumed)]
        for sid in req.seq_ids():
            s = _Seq(
                sid,
                prompt,
                req.params,
                req.version,
                sequence_key(req.params.seed, sid),
                list(resumed),
                list(resumed_lps),
                order=next(self._order),
            )
            problem = self._reject_reason(s)
            if problem is not None:
                log.warning("torch engine rejected %s: %s", sid, problem)
                self.rejected += 1
                self._emit(TokenEvent(sid, _NO_I, _NO_F, "error", self.version))
            elif len(s.out) >= s.params.max_tokens:  # resumed at its cap: nothing left to generate
                self._emit(TokenEvent(sid, _NO_I, _NO_F, "length", self.version))
            else:
                self._seqs[sid] = s
                self._waiting.append(s)
        self._wake.set()

    def _reject_reason(self, s: _Seq) -> str | None:
        if s.seq_id in self._seqs:
            return "duplicate sequence id"
        if not s.prompt:
            return "empty prompt"
        if min(s.prompt + s.out) < 0 or max(s.prompt + s.out) >= self.vocab_size:
            return f"token ids outside the vocabulary [0, {self.vocab_size})"
        total = len(s.prompt) + len(s.out)
        if total >= self.max_model_len or total + 1 > self.capacity:
            return (
                f"prompt + resumed tokens ({total}) do not fit max_model_len {self.max_model_len} "
                "/ KV capacity"
            )
        if s.params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer"
        return None

    async def abort(self, seq_ids: Iterable[str]) -> list[PartialState]:
        async with self._lock:  # between two steps
            out = []
            for sid in seq_ids:
                s = self._seqs.pop(sid, None)
                if s is None:
                    continue
                if s.slot >= 0:
                    self._leave(s)
                else:
                    self._waiting.remove(s)
                out.append(
                    PartialState(
                        sid,
                        np.asarray(s.prompt, np.int32),
                        np.asarray(s.out, np.int32),
                        np.asarray(s.lps, np.float32),
                        s.version,
                        s.params,
                    )
                )
                self._emit(TokenEvent(sid, _NO_I, _NO_F, "abort", s.version))
            return out

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        items = list(named_tensors)
        async with self._lock:  # between two steps
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self._pool, self._copy_weights, items
                )
            except WeightsRejected as exc:  # nothing applied: the previous version still serves
                exc.version = version
                raise
            self.version = version
            if self.recompute_on_load and self._running:
                # KV computed by the old weights is stale: recompute it (like vLLM keep +
                # clear_cache).
                for s in sorted(self._running, key=lambda q: q.order, reverse=True):
                    self._preempt(s)
        self._wake.set()

    def _copy_weights(self, items: list[tuple[str, Any]]) -> None:
        if self.adapter is not None:
            self.adapter.apply(items)
            if self.lean is not None:
                self.lean.refresh()
            return
        state = self.model.state_dict()
        staged = []
        for name, value in items:  # validate everything before touching any parameter
            if name not in state:
                raise KeyError(
                    f"load_weights: unknown tensor {name!r} (names follow model.state_dict())"
                )
            t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
            if tuple(t.shape) != tuple(state[name].shape):
                raise ValueError(
                    f"load_weights: {name} has shape {tuple(t.shape)}, model has "
                    f"{tuple(state[name].shape)}"
                )
            staged.append((state[name], t))
        with torch.no_grad():
            for dst, src in staged:
                dst.copy_(src.to(dtype=dst.dtype, device=dst.device))
        if self._unloaded:  # waking from a drop: this version must have covered every weight
            self._unloaded -= {dst.data_ptr() for dst, _ in staged}
            if self._unloaded:
                params = self.model.named_parameters()
                missing = [n for n, p in params if p.data_ptr() in self._unloaded]
                raise RuntimeError(
                    f"torch engine: the version loaded after a drop left {len(missing)} weights "
                    f"without values (e.g. {missing[:3]}): rollout_weights=drop needs whole "
                    "versions"
                )
        self.loaded_names = [name for name, _ in items]
        if self.lean is not None:
            self.lean.refresh()

    # ---- colocated placement: sleep / wake ----------------------------------------------
    @property
    def asleep(self) -> bool:
        return self._stash.offloaded or bool(self._dropped)

    async def sleep(self, keep_weights: bool = True) -> SleepStats:
        """Free the KV pool and the lean forward's fused copies, and move every weight to host
        memory (models/offload.py; pinned on CUDA), or free them outright (keep_weights=False:
        the wake allocates them empty and a whole version must be loaded before a prompt runs):
        while asleep the engine holds no device tensor but the small RoPE tables. Between two
        steps, with nothing in flight."""
        async with self._lock:
            if self._running or self._waiting:
                raise RuntimeError(
                    f"torch engine: sleep with {len(self._running) + len(self._waiting)} sequences "
                    "in flight (the rollout drains first)"
                )
            if self.asleep:
                return SleepStats(0.0)
            release = self._offload if keep_weights else self._drop
            return await asyncio.get_running_loop().run_in_executor(self._pool, release)

    async def wake_up(self) -> SleepStats:
        async with self._lock:
            if not self.asleep:
                return SleepStats(0.0)
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._onload)

    def _offload(self) -> SleepStats:
        t0 = time.perf_counter()
        kv = self.cache.free()
        if self.lean is not None:
            self.lean.release()
        tensors = list(self.model.parameters())
        if self.adapter is not None:  # the pristine base it merges each version into
            tensors += list(self.adapter.pristine.values())
        moved = self._stash.offload(tensors)
        return SleepStats(time.perf_counter() - t0, moved.nbytes, kv)

    def _drop(self) -> SleepStats:
        if self.adapter is not None:  # config validation refuses it; a direct caller learns why
            raise RuntimeError("torch engine: a LoRA engine keeps its base: sleep with weights")
        t0 = time.perf_counter()
        kv = self.cache.free()
        if self.lean is not None:
            self.lean.release()
        nbytes, seen = 0, set()
        for t in self.model.parameters():
            if id(t) in seen or t.numel() == 0:
                continue
            seen.add(id(t))
            nbytes += t.numel() * t.element_size()
            self._dropped.append((t, tuple(t.shape)))
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return SleepStats(time.perf_counter() - t0, 0, kv, dropped_bytes=nbytes)

    def _onload(self) -> SleepStats:
        t0 = time.perf_counter()
        if self._dropped:  # storage again, no values: load_weights must give every one
            nbytes = 0
            for t, shape in self._dropped:
                t.data = torch.empty(shape, dtype=t.dtype, device=t.device)
                nbytes += t.numel() * t.element_size()
            self._unloaded = {t.data_ptr() for t, _ in self._dropped}
            self._dropped = []
            kv = self.cache.allocate()
            return SleepStats(time.perf_counter() - t0, 0, kv, needs_load=True)
        back = self._stash.restore()
        kv = self.cache.allocate()
        if self.lean is not None:
            self.lean.refresh()
        return SleepStats(time.perf_counter() - t0, back.nbytes, kv)

    def device_bytes(self) -> dict[str, int]:
        """What this engine holds on its device now, by kind (tests and bench/colocate.py)."""
        fused = self.lean.nbytes() if self.lean is not None else 0
        return {
            "weights": device_bytes(self.model.parameters()),
            "kv": self.cache.nbytes,
            "fused": fused,
            "host": self._stash.nbytes,
        }

    def served_weights(self) -> list[tuple[str, Any]] | None:
        if self.adapter is not None:  # model.lora: the factors merged into the weights
            return self.adapter.served
        if not self.loaded_names:
            return None
        state = self.model.state_dict()
        # the lean forward multiplies by fused copies of q/k/v and gate/up: read those back
        fused = self.lean.fused_views() if self.lean is not None else {}
        return [
            (n, fused.get(state[n].data_ptr(), state[n])) for n in self.loaded_names if n in state
        ]

    def stats(self) -> EngineStats:
        return EngineStats(
            1.0 - self.cache.free_blocks / self.cache.blocks,  # blocks taken, as vLLM reports
            len(self._running),
            len(self._waiting),
            self.version,
            self.tokens_generated,
            self.preemptions,
        )

    # ---- step loop ---------------------------------------------------------------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                batch = self._schedule()
                if batch is not None:
                    try:
                        result = await loop.run_in_executor(self._pool, self._compute, batch)
                    except Exception as exc:
                        self._fail_all(exc)
                        raise
                    self._commit(batch, *result)
            # No yield here: the next forward starts at once and the consumers of this step's
            # events run while it computes. abort()/load_weights() queue on the lock, which
            # asyncio hands over in FIFO order, so they still get in between two steps.

    def _schedule(self) -> _Batch | None:
        self._grow_running()
        decode = list(self._running)  # row order: row i is slot i
        prefill: list[Any] = []
        budget = self.max_prefill_tokens
        while self._waiting and len(self._running) < self.max_running:
            s = self._waiting[0]
            need = len(s.prompt) + len(s.out)
            if need + 1 > self.capacity:  # preempted after it grew past the whole pool alone
                self._waiting.popleft()
                self._seqs.pop(s.seq_id, None)
                self.kv_truncated += 1
                log.warning(
                    "torch engine: %s ends at %d tokens: it outgrew the whole KV pool (%d "
                    "positions, rollout.kv_capacity_tokens)",
                    s.seq_id,
                    need,
                    self.capacity,
                )
                self._emit(TokenEvent(s.seq_id, _NO_I, _NO_F, "length", self.version))
                continue
            if prefill and need > budget:
                break
            # blocks for its tokens and the one it samples now, or the queue waits for them
            if not self.cache.reserve(len(self._running), need + 1):
                break
            self._waiting.popleft()
            s.slot = len(self._running)
            self._running.append(s)
            prefill.append(s)
            budget -= need
        if not decode and not prefill:
            return None
        ids = [s.out[-1] for s in decode]
        pos = [s.kv_len for s in decode]
        keep = list(range(len(decode)))
        segments = []
        for s in prefill:
            toks = s.prompt + s.out
            segments.append((s.slot, 0, len(toks)))
            ids.extend(toks)
            pos.extend(range(len(toks)))
            keep.append(len(ids) - 1)
        rows = decode + prefill
        dev = self.device
        layout = self.cache.step_layout(pos[: len(decode)], segments)
        return _Batch(
            decode,
            prefill,
            torch.tensor([ids], dtype=torch.long, device=dev),
            torch.tensor([pos], dtype=torch.long, device=dev),
            torch.tensor(keep, dtype=torch.long, device=dev),
            layout,
            torch.tensor([s.params.temperature for s in rows], dtype=torch.float32, device=dev),
            torch.tensor([s.params.top_p for s in rows], dtype=torch.float32, device=dev),
            torch.tensor(
                [uniform(s.key, len(s.out)) for s in rows], dtype=torch.float64, device=dev
            ),
            all(s.params.temperature == 1.0 and s.params.top_p >= 1.0 for s in rows),
        )

    def _compute(self, b: _Batch) -> tuple[list[int], list[float], np.ndarray | None]:
        """Worker thread: one packed forward + sampling (+ the step's routes, MoE)."""
        tap = self.routes
        with torch.inference_mode(), self.cache.step(b.layout):
            if tap is not None:
                tap.begin()
            if self.lean is not None:
                logits = self.lean(
                    b.ids[0], b.pos[0], b.keep, self.cache, None if tap is None else tap.layers
                )
            else:
                logits = self.model(
                    input_ids=b.ids, position_ids=b.pos, use_cache=False, logits_to_keep=b.keep
                ).logits[0]
            tokens, lps = sample(logits, b.temperature, b.top_p, b.uniforms, plain=b.plain)
            routes = None if tap is None else tap.end()
        return tokens.tolist(), lps.tolist(), routes

    def _commit(
        self, b: _Batch, tokens: list[int], lps: list[float], routes: np.ndarray | None = None
    ) -> None:
        self.steps += 1
        done = []
        # the step's packed tokens: one per decode row, then each prefill's prompt + resumed ones
        at = len(b.decode)
        for i, (s, tok, lp) in enumerate(zip(b.decode + b.prefill, tokens, lps, strict=True)):
            fed = len(s.prompt) + len(s.out)  # positions in the cache once this step ran
            if routes is None:
                step_routes, route_start = None, 0
            elif i < len(b.decode):
                step_routes, route_start = routes[i : i + 1], fed - 1
            else:
                step_routes, route_start = routes[at : at + fed], 0
                at += fed
            s.kv_len = fed  # everything but the token sampled now
            s.out.append(tok)
            s.lps.append(lp)
            s.version = self.version
            self.tokens_generated += 1
            reason = self._finish_reason(s, tok)
            self._emit(
                TokenEvent(
                    s.seq_id,
                    np.array([tok], np.int32),
                    np.array([lp], np.float32),
                    reason,
                    self.version,
                    step_routes,
                    route_start,
                )
            )
            if reason is not None:
                done.append(s)
        for s in done:
            self._seqs.pop(s.seq_id, None)
            self._leave(s)

    def _finish_reason(self, s: _Seq, tok: int) -> str | None:
        p = s.params
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if p.stop and self._hit_stop_string(s):
            return "stop"
        if len(s.out) >= p.max_tokens or len(s.prompt) + len(s.out) >= self.max_model_len:
            return "length"
        return None

    def _hit_stop_string(self, s: _Seq) -> bool:
        # A window of tokens long enough for the longest stop string (each token decodes to >= 1
        # char except specials); stops spanning the resume boundary are found too.
        window = max(len(x) for x in s.params.stop) + 4
        text = self.tokenizer.decode(s.out[-window:], skip_special_tokens=True)
        return any(x in text for x in s.params.stop)

    # ---- rows and blocks ---------------------------------------------------------------
    def _grow_running(self) -> None:
        """Every running sequence gets a block for the token it writes this step where it needs
        one; when none is free the newest running sequence is preempted (it may be the one
        growing). Oldest first, so a victim is never one already grown."""
        for s in sorted(self._running, key=lambda q: q.order):
            while s.slot >= 0 and not self.cache.reserve(s.slot, s.kv_len + 1):
                self.preemptions += 1
                self._preempt(max(self._running, key=lambda q: q.order))

    def _leave(self, s: _Seq) -> None:
        """Free s's blocks and row; the last running sequence's block table moves into the row so
        rows stay 0..R-1."""
        self.cache.release(s.slot)
        last = self._running.pop()
        if last is not s:
            self.cache.move(last.slot, s.slot)
            last.slot = s.slot
            self._running[s.slot] = last
        s.slot, s.kv_len = -1, 0

    def _preempt(self, s: _Seq) -> None:
        self._leave(s)
        self._waiting.appendleft(s)

    def _fail_all(self, exc: BaseException) -> None:
        self.error = exc
        log.error("torch engine step failed: %r", exc)
        for s in list(self._seqs.values()):
            self._emit(TokenEvent(s.seq_id, _NO_I, _NO_F, "error", self.version))
        self._seqs.clear()
        for s in self._running:
            self.cache.release(s.slot)
        self._running.clear()
        self._waiting.clear()


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        val = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(val, int):
            ids.add(val)
        elif isinstance(val, (list, tuple)):
            ids.update(int(v) for v in val)
    return ids
