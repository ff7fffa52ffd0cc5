"""Held-out evaluation of multi-turn tool use outside the cluster: the torch engine, an
environment and an in-process tool client, episode by episode, all episodes batched.

    env = ToolEnv(tools=["calculator"])
    res = evaluate_tool_model(path_or_model, rows, env, DirectToolClient(), verify)
    res["accuracy"], res["tool_rate"], res["hard"]["tool_rate"], res["completions"] ...

One episode, as the rollout runs it (token in, token out):

    prompt ids ─► engine (stop at env.stop or EOS) ─► model tokens (mask 1)
        ─► env.step(state, ctx, decoded model turn) ─► observation tokens from the turn
           template (laminar/envs/template.py), appended (mask 0) ─► engine continues after
           resume_ids = every response token so far ─► ... until done / limits
    completion = decoded response (model + environment tokens) ─► env.score or the verifier

Greedy by default (temperature 0), so the before/after figures are not sampling noise.
Tools run in process (`DirectToolClient`: the tools node's built-in functions, called
directly): the demo's only tool is the calculator, plain arithmetic on a parsed AST, and
a snapshot curve runs thousands of calls, each of which would cost a sandbox round trip.
The RL run itself calls them through the tools node and its sandbox.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from laminar.config import EnvLimits
from laminar.demo.evaluate import prompt_ids
from laminar.engines.base import GenRequest, SamplingParams
from laminar.envs.base import Environment, StepContext, ToolClient, ToolResult
from laminar.envs.template import TurnTemplate


class DirectToolClient:
    """ToolClient that calls the tools node's built-in functions in this process (trusted
    arithmetic only: no sandbox, no cache; a call id is never repeated within one eval)."""

    def __init__(self, names: Sequence[str] = ("calculator",)):
        from laminar.tools.builtin import BUILTINS

        unknown = [n for n in names if n not in BUILTINS]
        if unknown:
            raise ValueError(
                f"DirectToolClient: no built-in tool {unknown} (have {sorted(BUILTINS)})"
            )
        self.fns: dict[str, Callable[..., str]] = {n: BUILTINS[n][0] for n in names}

    async def call(
        self, call_id: str, name: str, arguments: dict[str, Any], timeout_s: float = 0.0
    ) -> ToolResult:
        fn = self.fns.get(name)
        if fn is None:
            return ToolResult(
                call_id, name, False, error=f"unknown tool {name!r}", error_kind="unknown_tool"
            )
        t0 = time.perf_counter()
        try:
            out = fn(**arguments)
        except Exception as exc:  # the tool's error is the model's observation
            return ToolResult(
                call_id,
                name,
                False,
                error=f"{type(exc).__name__}: {exc}",
                error_kind="error",
                seconds=time.perf_counter() - t0,
            )
        return ToolResult(call_id, name, True, output=str(out), seconds=time.perf_counter() - t0)


@dataclass
class Episode:
    completion: str
    """The decoded response, environment tokens included (what the reward sees)."""
    response_ids: list[int]
    loss_mask: list[int]
    """1 = model token, 0 = environment token."""
    turns: int
    tool_calls: int
    tool_errors: int
    finish: str
    """stop | length | turns | timeout | error"""
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


async def run_episode(
    engine: Any,
    tok: Any,
    env: Environment,
    tools: ToolClient | None,
    row: dict[str, Any],
    uid: str,
    params: SamplingParams,
    limits: EnvLimits,
    template: TurnTemplate,
) -> Episode:
    """One episode to its end; `params` are the engine's SamplingParams (max_tokens caps the
    whole response, model and environment tokens together)."""
    prompt = str(row["prompt"])
    ids = prompt_ids(tok, prompt)
    cap = int(limits.max_total_tokens or params.max_tokens)
    params = replace(params, stop=tuple(env.stop), max_tokens=cap)
    state = env.reset(row, prompt)
    resp: list[int] = []
    mask: list[int] = []
    calls = errors = 0
    finish, turn = "turns", 0
    for turn in range(limits.max_turns):
        turn_params = params
        if limits.max_turn_tokens:
            turn_params = replace(params, max_tokens=min(cap, len(resp) + limits.max_turn_tokens))
        req = GenRequest(
            f"{uid}.t{turn}",
            ids,
            turn_params,
            version=0,
            single=True,
            turn=turn,
            turn_start=len(resp),
            resume_ids=np.asarray(resp, np.int32),
            resume_logprobs=np.zeros(len(resp), np.float32),
        )
        out = await engine.generate_all(req, timeout=limits.episode_timeout_s)
        new, _, reason = out[req.req_id]
        resp += new.tolist()
        mask += [1] * len(new)
        if reason != "stop":  # length / error / abort: the episode ends here
            finish = reason
            break
        ctx = StepContext(
            uid=uid,
            turn=turn,
            tools=tools,
            tool_calls_so_far=calls,
            max_tool_calls=limits.max_tool_calls,
            timeout_s=limits.turn_timeout_s,
        )
        text = template.decode(new.tolist())
        try:
            res = await asyncio.wait_for(env.step(state, ctx, text), limits.turn_timeout_s)
        except TimeoutError:
            finish = "timeout"
            break
        calls += len(res.tool_results)
        errors += sum(not r.ok for r in res.tool_results)
        if res.done:
            finish = "stop"
            break
        if res.observation_ids is not None:
            obs = list(res.observation_ids)
        else:
            after_eot = template.ended_with_eot(new.tolist())
            obs = template.observation_ids(res.observation or "", res.role, after_eot=after_eot)
        obs = obs[: max(0, cap - len(resp))]
        resp += obs
        mask += [0] * len(obs)
        if len(resp) >= cap:
            finish = "length"
            break
    completion = tok.decode(resp, skip_special_tokens=True)
    ep = Episode(completion, resp, mask, turn + 1, calls, errors, finish)
    ctx = StepContext(uid=uid, turn=turn, tools=tools, tool_calls_so_far=calls)
    scored = await env.score(state, ctx)
    if isinstance(scored, dict):
        ep.info = dict(scored)
        ep.reward = scored.get("reward")
    elif scored is not None:
        ep.reward = float(scored)
    return ep


async def run_episodes(
    model: Any,
    tok: Any,
    rows: Sequence[dict[str, Any]],
    env: Environment,
    tools: ToolClient | None,
    limits: EnvLimits,
    *,
    temperature: float = 0.0,
    max_tokens: int = 192,
    max_running: int = 64,
    seed: int | None = None,
) -> list[Episode]:
    """Every row's episode, concurrently on one torch engine (continuous batching)."""
    from laminar.engines.torch_engine import TorchEngine

    engine = TorchEngine(model, tok, max_running=max_running)
    template = TurnTemplate(tok)
    await engine.start()
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    try:
        return list(
            await asyncio.gather(
                *[
                    run_episode(engine, tok, env, tools, r, f"eval{i}", params, limits, template)
                    for i, r in enumerate(rows)
                ]
            )
        )
    finally:
        await engine.close()


def summarize_episodes(
    rows: Sequence[dict[str, Any]],
    episodes: Sequence[Episode],
    verify: Callable[[str, Any], float],
) -> dict[str, Any]:
    """Accuracy (the verifier on the completion, env.score's reward where it gave one) and
    tool-call rate (share of episodes with at least one call), overall and per row kind."""
    scores = [
        float(e.reward) if e.reward is not None else float(verify(e.completion, r["answer"]))
        for r, e in zip(rows, episodes, strict=True)
    ]

    def part(idx: list[int]) -> dict[str, Any]:
        n = max(1, len(idx))
        return {
            "prompts": len(idx),
            "accuracy": sum(scores[i] for i in idx) / n,
            "tool_rate": sum(episodes[i].tool_calls > 0 for i in idx) / n,
            "tool_calls_mean": sum(episodes[i].tool_calls for i in idx) / n,
        }

    out: dict[str, Any] = part(list(range(len(rows))))
    for kind in sorted({str(r.get("kind", "")) for r in rows} - {""}):
        out[kind] = part([i for i, r in enumerate(rows) if r.get("kind") == kind])
    out["mean_len"] = statistics.fmean(len(e.response_ids) for e in episodes) if episodes else 0.0
    out["tool_errors"] = sum(e.tool_errors for e in episodes)
    out["finish"] = {k: sum(e.finish == k for e in episodes) for k in {e.finish for e in episodes}}
    out["completions"] = [e.completion for e in episodes]
    out["samples"] = [
        {"prompt": r["prompt"], "completion": e.completion, "answer": r["answer"], "score": s}
        for r, e, s in list(zip(rows, episodes, scores, strict=True))[:8]
    ]
    return out


def evaluate_tool_model(
    model_or_path: Any,
    rows: Sequence[dict[str, Any]],
    env: Environment,
    tools: ToolClient | None,
    verify: Callable[[str, Any], float],
    limits: EnvLimits | None = None,
    tokenizer: Any = None,
    **kw: Any,
) -> dict[str, Any]:
    """Run the episodes of `rows` (own event loop) and summarize them; see summarize_episodes."""
    import torch

    from laminar.models.tiny import open_model

    model, tokenizer = open_model(model_or_path, tokenizer)
    with torch.inference_mode():
        eps = asyncio.run(
            run_episodes(model, tokenizer, rows, env, tools, limits or EnvLimits(), **kw)
        )
    return summarize_episodes(rows, eps, verify)
