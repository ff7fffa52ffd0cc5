"""VLM engine: a vision-language HF model (Qwen2-VL shapes) generating through HF's own forward,
with the prompt's images as pixel inputs.

    engine = VlmEngine.from_config(cfg.rollout, cfg.model)     # model.path has a vision_config
    await engine.start()
    req = GenRequest("g1", prompt_ids, SamplingParams(max_tokens=8), n=4, images=(png,))
    async for ev in engine.generate(req):
        ...

Dataflow (one asyncio task; each forward runs in a one-thread executor, so the event loop keeps
serving sockets and heartbeats):

    submit() ──► waiting groups (FIFO) ──► one group at a time: its n samples as n rows
                 prefill: input_ids (placeholders expanded) + pixel_values + image_grid_thw
                 decode:  one token per row per step over HF's DynamicCache
                 ──► TokenEvent per row per step (token, exact logprob)

Why one group at a time and not the torch engine's continuous batching over a paged cache:
Qwen2-VL's M-RoPE positions come from the prompt's image grid, and HF's model keeps the
position offset of the batch it last prefilled (`rope_deltas`) as its own state; the group's n
samples share one prompt and one image, so they batch exactly. The pixel inputs are made by the
model's own image processor from the encoded images, the same bytes on every rollout.

Sampling is the torch engine's (engines/sampling.py): the same seeded per-sequence draws and the
sampled token's logprob under the processed distribution. Abort and load_weights take effect
between two steps (a lock). A weight load while a group runs lets the group go on under the new
weights, its later tokens labelled with the new version (what mode partial allows; in the other
modes a rollout loads only when idle). Stop strings are checked on the decoded completion.

A request whose placeholder runs do not pair up with its images (a resumed response in which the
model sampled the placeholder token, which HF's forward would read as one more image slot) ends
in `error` at submit, counted in `rejected`: the engine never raises mid-prefill.
"""

from __future__ import annotations

import asyncio
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
    TokenEvent,
)
from laminar.engines.sampling import sample, sequence_key, uniform
from laminar.models.lora import MergedAdapter
from laminar.supervise import Spawn, detached_spawn
from laminar.vision.pixels import pixel_inputs

__all__ = ["VlmEngine"]


@dataclass
class _Row:
    seq_id: str
    prompt: np.ndarray
    """Prompt ids + resumed tokens: what the prefill reads."""
    resumed: int
    params: SamplingParams
    key: int
    version: int
    images: tuple[bytes, ...]
    out: list[int] = field(default_factory=list)
    """Every response token (resumed ones first)."""
    lps: list[float] = field(default_factory=list)
    done: bool = False


class VlmEngine(Engine):
    name = "vlm"

    def __init__(
        self,
        model: Any,
        processor: Any,
        *,
        max_running: int = 32,
        max_model_len: int = 1024,
        device: str = "cpu",
        lora: LoraConfig | None = None,
    ):
        super().__init__()
        self.model = model
        self.adapter = MergedAdapter(model, lora) if lora is not None else None
        """model.lora: a version is an adapter of the language model, merged into a pristine copy
        of its base weights (models/lora.py)."""
        self.processor = processor
        self.tok = processor.tokenizer
        self.image_token_id = int(processor.image_token_id)
        self.max_running = max_running
        self.max_model_len = max_model_len
        self.capacity = max_running * max_model_len
        self.device = device
        self.eos_token_id = self.tok.eos_token_id
        self.pad_token_id = self.tok.pad_token_id or 0
        self._waiting: deque[list[_Row]] = deque()
        self._running: list[_Row] = []
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.tokens_generated = 0
        self.rejected = 0
        """Requests ended in error at submit: image placeholder runs and images do not pair up."""
        self.loaded_names: list[str] = []
        """The tensor names the last load_weights gave: what attestation reads back."""

    @classmethod
    def from_config(cls, r: RolloutConfig, mc: ModelConfig, **kw: Any) -> VlmEngine:
        from laminar.models.tiny_vlm import load_processor, load_vlm

        if not mc.path:
            raise ValueError("a vision-language model needs model.path (a local HF directory)")
        model = load_vlm(mc.path, mc.dtype, mc.device)
        return cls(
            model,
            load_processor(mc.path),
            max_running=r.max_running,
            max_model_len=r.max_model_len or 1024,
            device=mc.device,
            lora=mc.lora,
            **kw,
        )

    # ---- Engine ---------------------------------------------------------------------
    async def start(self, spawn: Spawn = detached_spawn) -> None:
        if self._task is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="vlm-engine")
            self._task = spawn(self._loop(), "vlm-engine-steps")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def submit(self, req: GenRequest) -> None:
        prompt = np.concatenate(
            [np.asarray(req.prompt_ids, np.int64), np.asarray(req.resume_ids, np.int64)]
        )
        runs = placeholder_runs(prompt, self.image_token_id)
        if runs != len(req.images):  # a resumed response holding a sampled placeholder, or a
            # request whose images do not pair up: HF's forward would raise mid-prefill
            self.rejected += 1
            for sid in req.seq_ids():
                self._emit(TokenEvent(sid, _NO_I, _NO_F, "error", req.version))
            return
        rows = [
            _Row(
                seq_id=sid,
                prompt=prompt,
                resumed=len(req.resume_ids),
                params=req.params,
                key=sequence_key(req.params.seed, sid),
                version=req.version,
                images=tuple(req.images),
                out=[int(t) for t in req.resume_ids],
                lps=[float(x) for x in req.resume_logprobs],
            )
            for sid in req.seq_ids()
        ]
        self._waiting.append(rows)
        self._wake.set()

    async def abort(self, seq_ids: Iterable[str]) -> list[PartialState]:
        async with self._lock:  # between two steps
            return self._drop(set(seq_ids))

    def _drop(self, want: set[str]) -> list[PartialState]:
        """Abort `want` (under the lock): partial states out, one abort event each; a waiting
        group with nothing left leaves the queue."""
        out: list[PartialState] = []
        for rows in [*self._waiting, self._running]:
            for r in rows:
                if r.seq_id in want and not r.done:
                    r.done = True
                    out.append(self._partial(r))
                    self._emit(TokenEvent(r.seq_id, _NO_I, _NO_F, "abort", r.version))
        self._waiting = deque(g for g in self._waiting if not all(r.done for r in g))
        return out

    def _partial(self, r: _Row) -> PartialState:
        return PartialState(
            seq_id=r.seq_id,
            prompt_ids=r.prompt[: len(r.prompt) - r.resumed].astype(np.int32),
            output_ids=np.asarray(r.out, np.int32),
            logprobs=np.asarray(r.lps, np.float32),
            version=r.version,
            params=r.params,
            images=r.images,
        )

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        items = list(named_tensors)
        async with self._lock:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._copy, items)
            self.version = version

    def _copy(self, items: list[tuple[str, Any]]) -> None:
        if self.adapter is not None:
            self.adapter.apply(items)  # all of it or none (AdapterRejected)
            return
        state = self.model.state_dict()
        for name, _ in items:  # validate every name before touching any parameter
            if name not in state:
                raise KeyError(f"load_weights: unknown tensor {name!r} (model.state_dict() names)")
        with torch.no_grad():
            for name, value in items:
                state[name].copy_(torch.as_tensor(value))
        self.loaded_names = [n for n, _ in items]

    def served_weights(self) -> list[tuple[str, Any]] | None:
        """The loaded tensors read back from the model (None before any load: unattested)."""
        if self.adapter is not None:  # model.lora: the factors merged into the weights
            return self.adapter.served
        if not self.loaded_names:
            return None
        state = self.model.state_dict()
        return [(n, state[n]) for n in self.loaded_names]

    def stats(self) -> EngineStats:
        live = [r for r in self._running if not r.done]
        used = sum(len(r.prompt) + len(r.out) - r.resumed for r in live)
        return EngineStats(
            kv_use=min(1.0, used / max(1, self.capacity)),
            running=len(live),
            waiting=sum(len(g) for g in self._waiting),
            version=self.version,
            tokens_generated=self.tokens_generated,
        )

    # ---- the step loop --------------------------------------------------------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                if not self._waiting:  # an abort took the queue while this waited for the lock
                    continue
                rows = [r for r in self._waiting.popleft() if not r.done]
                if not rows:
                    continue
                self._running = rows
                cache, logits = await loop.run_in_executor(self._pool, self._prefill, rows)
                self._take(rows, logits)
            while not all(r.done for r in rows):
                async with self._lock:
                    if all(r.done for r in rows):  # aborted meanwhile
                        break
                    logits = await loop.run_in_executor(self._pool, self._decode, rows, cache)
                    self._take(rows, logits)
            self._running = []

    def _prefill(self, rows: list[_Row]) -> tuple[Any, torch.Tensor]:
        from transformers import DynamicCache

        n = len(rows)
        ids = torch.as_tensor(np.tile(rows[0].prompt, (n, 1)), device=self.device)
        kw: dict[str, Any] = {}
        if rows[0].images:
            px = pixel_inputs(self.processor, list(rows[0].images) * n)
            kw = {
                "pixel_values": px.pixel_values.to(self.device, self.model.dtype),
                "image_grid_thw": px.grid_thw.to(self.device),
                "mm_token_type_ids": (ids == self.image_token_id).long(),
            }
        cache = DynamicCache()
        with torch.no_grad():
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, **kw)
        return out.past_key_values, out.logits[:, -1]

    def _decode(self, rows: list[_Row], cache: Any) -> torch.Tensor:
        last = [r.out[-1] if r.out and not r.done else self.pad_token_id for r in rows]
        ids = torch.as_tensor(last, device=self.device)[:, None]
        with torch.no_grad():
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits[:, -1]

    def _take(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Sample one token per live row, emit it, and end the rows that are done."""
        live = [i for i, r in enumerate(rows) if not r.done]
        if not live:
            return
        sel = logits[live].float()
        ps = [rows[i].params for i in live]
        temperature = torch.tensor([p.temperature for p in ps], dtype=torch.float32)
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32)
        uniforms = torch.tensor(
            [uniform(rows[i].key, len(rows[i].out)) for i in live], dtype=torch.float64
        )
        tokens, lps = sample(sel, temperature, top_p, uniforms)
        for i, tok, lp in zip(live, tokens.tolist(), lps.tolist(), strict=True):
            r = rows[i]
            r.out.append(int(tok))
            r.lps.append(float(lp))
            self.tokens_generated += 1
            reason = self._finish(r, int(tok))
            if reason is not None:
                r.done = True
            self._emit(
                TokenEvent(
                    r.seq_id,
                    np.asarray([tok], np.int32),
                    np.asarray([lp], np.float32),
                    reason,
                    self.version,
                )
            )

    def _finish(self, r: _Row, tok: int) -> str | None:
        p = r.params
        if (not p.ignore_eos and tok == self.eos_token_id) or tok in p.stop_token_ids:
            return "stop"
        if p.stop:
            text = self.tok.decode(r.out[r.resumed :], skip_special_tokens=True)
            if any(s in text for s in p.stop):
                return "stop"
        if len(r.out) >= p.max_tokens or len(r.prompt) - r.resumed + len(r.out) >= (
            self.max_model_len
        ):
            return "length"
        return None


def placeholder_runs(ids: np.ndarray, image_token_id: int) -> int:
    """Runs of the image placeholder token: one per image when the ids are what the processor
    expanded (each image's run sits between <|vision_start|> and <|vision_end|>)."""
    hit = np.asarray(ids) == image_token_id
    if not hit.any():
        return 0
    return int(hit[0]) + int(np.count_nonzero(hit[1:] & ~hit[:-1]))


_NO_I = np.zeros(0, np.int32)
_NO_F = np.zeros(0, np.float32)
