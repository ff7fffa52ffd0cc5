"""The framework recipes of docs/agents.md (examples/agents/) run as written.

    .venv/bin/python -m pytest tests/test_agent_frameworks.py -q

Each example is the agent of a rollout in this process (LocalCluster, inproc) whose engine
writes the tool task's scripted text (tests/agent_fakes.py): a hard prompt's first turn calls
the calculator, the next answers. The framework's package comes from the `frameworks` extra
(or `agents-sdk`); without it the test is skipped, saying which.
"""

from __future__ import annotations

from typing import Any

import pytest

from laminar.cluster import LocalCluster
from laminar.models.prompt_tokenizer import load_prompt_tokenizer
from tests.agent_fakes import ScriptEngine
from tests.test_agents import capture, make_cfg, runs, wait_for


async def _trains(
    tmp_path: Any,
    tiny: Any,
    name: str,
    fn: str,
    long: bool = False,
    replays: bool = False,
    kwargs: dict[str, Any] | None = None,
) -> None:
    """Six episodes of the example's agent: each delivered, none failed; each hard prompt's
    calculator call was run and answered (two model turns, the tool's answer between them), and
    every model token trained is one the engine sampled. `long`: the framework's own prompts are
    thousands of (character) tokens. `replays`: the framework replays the model's turns in its
    own words, so each call is a history rewrite that keeps the first prompt: the trained run is
    the last call's, the replayed history its context (loss mask 0)."""
    over: dict[str, Any] = {"data": {"epochs": 1}}
    if long:
        over = {
            "data": {"epochs": 1, "max_prompt_tokens": 16384},
            "env": {"limits": {"max_total_tokens": 16384}},
        }
    cfg = make_cfg(tmp_path, tiny, name, rows=3, agent={"fn": fn, "kwargs": kwargs or {}}, **over)
    engine = ScriptEngine(load_prompt_tokenizer(tiny, chat_template=True))
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=engine)
        trajs = capture(rollout)
        want = 3 * cfg.rollout.group_size
        await wait_for(lambda: len(trajs) == want, 90, f"{want} trajectories", cluster)
        counters = dict(rollout.metrics.counters)
    assert not any(k.startswith("agent_failure") for k in counters), counters
    assert all(t.finish_reason == "stop" for t in trajs)
    hard = [t for t in trajs if "*" in t.prompt]
    assert hard and all(t.turns == 2 or (replays and t.turns > 2) for t in hard)
    for t in trajs:
        model_runs = [r for r in runs(t.loss_mask) if r[0] == 1]
        if replays:  # the trained run starts after the replayed history (its context)
            assert t not in hard or model_runs[0][1] > 0
        else:
            assert len(model_runs) == t.turns
        # the last model run is the last turn's, the one before it the turn before, ...
        for k, (_, a, b) in enumerate(reversed(model_runs)):
            assert t.response_ids[a:b].tolist() == engine.emitted[(t.uid, t.turns - 1 - k)][0]
    # the calculator ran and its answer went back: the transcript is the task's (a framework that
    # replays in its own words: its observation is in the trained run's context)
    if replays:
        assert all("Observation:" in t.completion for t in hard), [t.completion for t in hard]
    else:
        assert all(t.reward_info.get("format") == 1.0 for t in hard), [t.completion for t in hard]


async def test_the_langgraph_example_trains(tmp_path, tiny):
    pytest.importorskip("langgraph", reason="langgraph is not installed (the `frameworks` extra)")
    pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed (the `frameworks` extra)"
    )
    await _trains(tmp_path, tiny, "fw-langgraph", "examples.agents.langgraph_agent:run")


async def test_the_smolagents_example_trains(tmp_path, tiny):
    pytest.importorskip("smolagents", reason="smolagents is not installed (the `frameworks` extra)")
    await _trains(
        tmp_path, tiny, "fw-smolagents", "examples.agents.smolagents_agent:run", True, True
    )


async def test_the_openai_agents_sdk_example_trains(tmp_path, tiny):
    pytest.importorskip("agents", reason="openai-agents is not installed (the `agents-sdk` extra)")
    await _trains(
        tmp_path,
        tiny,
        "fw-agents-sdk",
        "laminar.demo.tooldemo.sdk_agent:run",
        kwargs={"instructions": "Answer with #<number>. Use the calculator for products."},
    )
