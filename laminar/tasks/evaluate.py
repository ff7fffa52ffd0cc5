"""The held-out evaluator: greedy completions of a task's prompts, scored by the task
(laminar/tasks/base.py). One for the trainer's validation (laminar/trainer/evaluation.py) and
both demos (python -m laminar.demo, python -m laminar.demo.tooldemo).

    outcomes = await evaluate(model, tokenizer, task, Greedy(max_tokens=160))
    res = evaluate_model(path_or_model, rows, verify, episodes=None)  # the demos: blocking
    res["accuracy"], res["prompts"], res["hard"]["tool_rate"], res["completions"] ...

    task.prompts ─► single-turn: greedy_generate (laminar/engines/greedy.py) ─► decoded completion
                 ─► multi-turn (task.episodes): one episode each, all batched on one engine
                 ─► task.score(prompt, completion), or the environment's score of the episode
                 ─► [Outcome(prompt, completion, tokens, reward, episode)] ─► summarize_outcomes

Generation runs on a thread with its own event loop (asyncio.to_thread), so the caller's loop
keeps serving (the trainer's heartbeats); cancelling the caller ends it at the next poll.
Scoring runs on the caller's loop, where the task's scorer lives (the trainer's reward runner).

One episode, as the rollout runs it (token in, token out):

    prompt ids ─► engine (stop at env.stop or EOS) ─► model tokens (mask 1)
        ─► env.step(state, ctx, decoded model turn) ─► observation tokens from the turn
           template (laminar/envs/template.py), appended (mask 0) ─► engine continues after
           resume_ids = every response token so far ─► ... until done / limits
    completion = decoded response (model + environment tokens) ─► env.score or task.score

Greedy (temperature 0), so before/after figures are not sampling noise. The demos' tools run
in process (laminar/demo/tooldemo/direct_tools.py); the RL run calls them through the tools
node and its sandbox.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from laminar.engines.base import GenRequest, SamplingParams
from laminar.engines.greedy import Greedy, gather_or_cancel, greedy_engine, greedy_generate
from laminar.envs.base import StepContext
from laminar.envs.template import TurnTemplate
from laminar.tasks.base import Episodes, HeldOut, Task, VerifiedTask


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
    """The environment's score (None: it gave none; the task scores the completion)."""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    """One held-out prompt's greedy completion and its score."""

    prompt: HeldOut
    completion: str
    """The decoded response (environment tokens included)."""
    tokens: int
    """Response tokens (model and environment)."""
    reward: float | None
    """None: not scored (excluded)."""
    episode: Episode | None = None
    """Multi-turn: turns, tool calls, finish."""


async def run_episode(
    engine: Any,
    tok: Any,
    episodes: Episodes,
    prompt: HeldOut,
    uid: str,
    params: SamplingParams,
    template: TurnTemplate,
) -> Episode:
    """One episode to its end; `params` are the engine's SamplingParams (max_tokens caps the
    whole response, model and environment tokens together)."""
    env, tools, limits = episodes.env, episodes.tools, episodes.limits
    cap = int(limits.max_total_tokens or params.max_tokens)
    params = replace(params, stop=tuple(env.stop), max_tokens=cap)
    state = env.reset(prompt.row, prompt.prompt)
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
            prompt.ids,
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


async def _run_episodes(
    engine: Any,
    tok: Any,
    prompts: Sequence[HeldOut],
    episodes: Episodes,
    greedy: Greedy,
    cancel: threading.Event,
) -> list[Episode]:
    """Every prompt's episode, concurrently on one engine (continuous batching)."""
    template = TurnTemplate(tok)
    params = SamplingParams(temperature=0.0, max_tokens=greedy.max_tokens)
    await engine.start()
    try:
        runs = [
            run_episode(engine, tok, episodes, p, f"eval{i}", params, template)
            for i, p in enumerate(prompts)
        ]
        return await gather_or_cancel(runs, cancel)
    finally:
        await engine.close()


def _complete(
    model: Any, tok: Any, task: Task, greedy: Greedy, cancel: threading.Event
) -> list[tuple[str, int, Episode | None]]:
    """(completion, response tokens, episode) of every prompt. Blocking: its own event loop."""
    prompts = task.prompts
    if task.episodes is None:
        outs = greedy_generate(model, tok, [p.ids for p in prompts], greedy, cancel)
        return [(tok.decode(o.tolist(), skip_special_tokens=True), len(o), None) for o in outs]
    import torch

    engine = greedy_engine(model, tok, len(prompts), greedy)
    with torch.inference_mode():
        eps = asyncio.run(_run_episodes(engine, tok, prompts, task.episodes, greedy, cancel))
    return [(e.completion, len(e.response_ids), e) for e in eps]


async def evaluate(model: Any, tokenizer: Any, task: Task, greedy: Greedy) -> list[Outcome]:
    """Greedy completions (episodes, for a task with an environment) of the task's prompts,
    scored: the environment's score where it gave one, else the task's."""
    cancel = threading.Event()
    try:
        done = await asyncio.to_thread(_complete, model, tokenizer, task, greedy, cancel)
    except asyncio.CancelledError:
        cancel.set()  # the thread ends its generation at the next poll
        raise

    async def score(p: HeldOut, completion: str, ep: Episode | None) -> float | None:
        if ep is not None and ep.reward is not None:
            return float(ep.reward)
        return await task.score(p, completion)

    rewards = await asyncio.gather(
        *(score(p, c, e) for p, (c, _, e) in zip(task.prompts, done, strict=True))
    )
    return [
        Outcome(p, c, n, r, e) for p, (c, n, e), r in zip(task.prompts, done, rewards, strict=True)
    ]


def summarize_outcomes(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The demos' figures: accuracy (an unscored completion counts as wrong), overall and per row
    kind, the mean response length in tokens, the completions and the first 8 samples; for
    episodes also the tool-call rate (share with at least one call), calls per episode, tool
    errors and how the episodes finished."""
    scores = [o.reward or 0.0 for o in outcomes]
    eps = [o.episode for o in outcomes if o.episode is not None]
    multi_turn = len(eps) == len(outcomes) > 0

    def part(idx: list[int]) -> dict[str, Any]:
        n = max(1, len(idx))
        out: dict[str, Any] = {"prompts": len(idx), "accuracy": sum(scores[i] for i in idx) / n}
        if multi_turn:
            out["tool_rate"] = sum(eps[i].tool_calls > 0 for i in idx) / n
            out["tool_calls_mean"] = sum(eps[i].tool_calls for i in idx) / n
        return out

    rows = [o.prompt.row for o in outcomes]
    res = part(list(range(len(outcomes))))
    for kind in sorted({str(r.get("kind", "")) for r in rows} - {""}):
        res[kind] = part([i for i, r in enumerate(rows) if r.get("kind") == kind])
    res["mean_len"] = statistics.fmean(o.tokens for o in outcomes) if outcomes else 0.0
    if multi_turn:
        res["tool_errors"] = sum(e.tool_errors for e in eps)
        res["finish"] = {k: sum(e.finish == k for e in eps) for k in {e.finish for e in eps}}
    res["completions"] = [o.completion for o in outcomes]
    res["samples"] = [
        {
            "prompt": o.prompt.prompt,
            "completion": o.completion,
            "answer": o.prompt.row["answer"],
            "score": s,
        }
        for o, s in list(zip(outcomes, scores, strict=True))[:8]
    ]
    return res


def evaluate_model(
    model_or_path: Any,
    rows: Sequence[dict[str, Any]],
    verify: Callable[[str, Any], float],
    *,
    episodes: Episodes | None = None,
    max_tokens: int = 256,
    max_running: int = 64,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """The demos' held-out figures (summarize_outcomes) of a model (a path or a loaded model) on
    rows {"prompt", "answer", ["kind"]}, scored by `verify`; episodes where `episodes` is given.
    Blocking: runs its own event loop."""
    from laminar.models.tiny import open_model

    model, tokenizer = open_model(model_or_path, tokenizer)
    task = VerifiedTask.of_rows(rows, tokenizer, verify, episodes)
    greedy = Greedy(max_tokens=max_tokens, max_running=max_running)
    return summarize_outcomes(asyncio.run(evaluate(model, tokenizer, task, greedy)))
