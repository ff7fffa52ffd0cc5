"""Black-box agents: a user's OpenAI-client loop trains through the rollout's endpoint.

    .venv/bin/python -m pytest tests/test_agents.py -q

In this process over inproc (LocalCluster): manager, buffer, a torch trainer on a tiny
character-level model, and one rollout whose engine writes scripted text (tests/agent_fakes.py)
or is the real torch engine. Agents run in agent worker processes (laminar/agents/worker.py)
and call the endpoint with the official `openai` client on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest

from laminar.agents.render import ChatRenderer
from laminar.cluster import LocalCluster
from laminar.config import config_from_dict
from laminar.models.prompt_tokenizer import load_prompt_tokenizer
from laminar.protocol.data import Trajectory
from laminar.tasks import tooluse
from tests.agent_fakes import ScriptEngine
from tests.sim_cluster import consumed, read_jsonl


def make_cfg(tmp: Path, model: Path, name: str, rows: int, **over: Any):
    data = tmp / "train.jsonl"
    tooluse.write_jsonl(tooluse.generate(rows, "train", seed=1), data)
    base: dict[str, Any] = {
        "name": name,
        "run_dir": str(tmp / "run"),
        "cluster": {
            "transport": "inproc",
            "roles": {"manager": 1, "buffer": 1, "trainer": 0, "rollout": 0},
        },
        "transport": {
            "heartbeat_interval_s": 0.1,
            "heartbeat_liveness": 20,
            "request_timeout_s": 2.0,
            "startup_timeout_s": 30.0,
            "stop_timeout_s": 5.0,
            "reconnect_backoff_s": 0.02,
            "reconnect_backoff_max_s": 0.1,
        },
        "model": {"path": str(model)},
        "data": {"train": str(data), "epochs": 5, "shuffle": False},
        "reward": {"fn": "laminar.tasks.tooluse:reward", "workers": 0},
        "rollout": {
            "engine": "torch",
            "group_size": 2,
            "credits": 2,
            "weights": "dir",
            "prompt_retry_s": 0.05,
            "sampling": {"max_tokens": 160, "temperature": 1.0},
        },
        "buffer": {"retry_after_s": 0.05},
        "agent": {"fn": "tests.agent_fakes:tool_agent", "workers": 2, "episode_timeout_s": 30},
    }
    for k, v in over.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return config_from_dict(base)


async def wait_for(cond: Any, timeout: float, what: str, cluster: LocalCluster) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        cluster.check()
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)  # poll of a condition with no event of its own, under a deadline


async def manager_sees(cluster: LocalCluster, rollout: str) -> None:
    """Until the manager has a status of the rollout holding weights (version 0), placement
    cannot choose it."""
    peers = cluster.node("manager-0").srv.peers

    def seen() -> bool:
        status = peers[rollout].status if rollout in peers else None
        return status is not None and status.version >= 0

    await wait_for(seen, 30, f"the manager's status of {rollout} with weights", cluster)


def capture(rollout: Any) -> list[Trajectory]:
    """Every trajectory the rollout delivers (scored), as it hands it to its outbox."""
    got: list[Trajectory] = []
    orig = rollout.outbox.put

    def put(msg: Any) -> None:
        if isinstance(msg, Trajectory):
            got.append(msg)
        orig(msg)

    rollout.outbox.put = put
    return got


def runs(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((int(mask[start]), start, i))
            start = i
    return out


@pytest.fixture
def agent_files(tmp_path, monkeypatch):
    files = {
        "AGENT_TEST_EFFECTS": tmp_path / "effects.jsonl",
        "AGENT_TEST_CALLS": tmp_path / "calls.jsonl",
    }
    for k, v in files.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.setenv("AGENT_TEST_DIR", str(tmp_path))
    return files


async def test_tool_agent_through_the_openai_client_trains_ten_steps(tmp_path, tiny, agent_files):
    cfg = make_cfg(
        tmp_path,
        tiny,
        "agent-train",
        rows=40,
        cluster={"roles": {"manager": 1, "buffer": 1, "trainer": 1, "rollout": 0}},
        trainer={"total_steps": 10, "batch_groups": 2, "lr": 1e-3, "warmup_steps": 0},
    )
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    engine = ScriptEngine(tok)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=engine)
        trajs = capture(rollout)
        await cluster.wait_trainer(timeout=120)
        metrics = dict(rollout.metrics.counters)
    steps = read_jsonl(cfg.resolved_run_dir() / "metrics.jsonl")
    assert len([m for m in steps if "step" in m]) >= 10
    # the policy moved: some step had advantages (rewards differ within groups) and a gradient
    assert any(m.get("grad_norm", 0.0) > 0 for m in steps), steps[-1]
    assert rollout.gate.version >= 1 or any(t.version >= 1 for t in trajs)  # new weights came
    used = [u for step in consumed(cfg) for u in step["uids"]]
    assert len(used) >= 10 * 2 * 2
    assert len(set(used)) == len(used)  # nothing trained twice
    render = ChatRenderer(tok)
    by_uid = {}
    for t in trajs:
        assert t.uid not in by_uid, "a sample delivered twice"
        by_uid[t.uid] = t
        prompt = tok.decode(t.prompt_ids.tolist(), skip_special_tokens=True)
        assert t.prompt_ids.tolist() == render.first_ids(
            [{"role": "user", "content": t.prompt}], None
        )
        assert prompt == t.prompt
        mask = t.loss_mask
        assert mask is not None and len(mask) == len(t.response_ids) == len(t.logprobs)
        segs = runs(mask)
        model_runs = [s for s in segs if s[0] == 1]
        for turn, (_, a, b) in enumerate(model_runs):
            ids, lps = engine.emitted[(t.uid, turn)]
            assert t.response_ids[a:b].tolist() == ids  # the exact sampled tokens
            assert np.allclose(t.logprobs[a:b], lps)  # their behaviour logprobs
        for _, a, b in [s for s in segs if s[0] == 0]:
            assert np.all(t.logprobs[a:b] == 0.0)
            text = tok.decode(t.response_ids[a:b].tolist(), skip_special_tokens=True)
            expr = tooluse.expression(t.prompt)
            assert text == tooluse.tool_response_text(str(tooluse.answer_of(expr + "=?")))
        hard = "*" in t.prompt
        assert len(model_runs) == (2 if hard else 1) and t.turns == len(model_runs)
        assert t.reward in (0.0, 1.0)
    # what the client got back is what was trained: tokens and logprobs of each call
    calls = read_jsonl(agent_files["AGENT_TEST_CALLS"])
    assert calls
    for c in calls:
        uid = c["id"].removeprefix("chatcmpl-").rsplit("-", 2)[0]
        if uid not in by_uid:
            continue  # still in flight when the trainer stopped
        turn = int(c["id"].rsplit("-", 1)[1])  # the episode's turn
        ids, lps = engine.emitted[(uid, turn)]
        assert "".join(c["tokens"]) == tok.decode(ids, skip_special_tokens=False)
        assert np.allclose(c["logprobs"][: len(ids)], lps[: len(c["logprobs"])])
        assert c["finish"] == ("tool_calls" if "</tool_call>" in "".join(c["tokens"]) else "stop")
    # the side-effecting tool ran once per call id
    effects = Counter(e["call_id"] for e in read_jsonl(agent_files["AGENT_TEST_EFFECTS"]))
    assert effects and max(effects.values()) == 1
    tool_calls = sum(1 for t in trajs if "*" in t.prompt)
    assert len(effects) >= tool_calls
    # the tool-call stop string went to the engine with the calls that declared tools
    assert all("</tool_call>" in r.params.stop for r in engine.submitted)
    assert metrics.get("agent_calls", 0) >= len(trajs)
    assert not any(k.startswith("agent_failure") for k in metrics), metrics


SYSTEM = "You are a careful calculator. Call the tool for products."
WRAP = "New task:\n"
FRAMED = {"system": SYSTEM, "wrap": WRAP}
"""tool_agent's kwargs for an agent as frameworks write it (its own system message and task
wrapper)."""


def assert_framed_prompts(trajs: Any, render: ChatRenderer) -> None:
    """Each sample's prompt is what tool_agent's first call with FRAMED rendered."""
    from laminar.demo.tooldemo.agent import TOOLS

    for t in trajs:
        first = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": WRAP + t.prompt},
        ]
        assert t.prompt_ids.tolist() == render.first_ids(first, TOOLS), t.uid


async def test_an_agent_with_a_system_prompt_and_a_task_wrapper_trains(
    tmp_path, tiny, agent_files, caplog, capsys
):
    """Issue 47: an agent as frameworks write it (a system message, the task wrapped in its own
    words) trains: its first call's rendering is the sample's prompt, the buffer binds the sample
    to its row by identity and refuses nothing, the trainer steps, and what it trains is exactly
    what the endpoint returned (tokens and logprobs). Its tool calls are counted
    (episode/tool_calls), and the agent counters reach metrics.jsonl."""

    cfg = make_cfg(
        tmp_path,
        tiny,
        "agent-system",
        rows=24,
        cluster={"roles": {"manager": 1, "buffer": 1, "trainer": 1, "rollout": 0}},
        trainer={"total_steps": 4, "batch_groups": 2, "lr": 1e-3, "warmup_steps": 0},
        agent={"kwargs": FRAMED},
    )
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    engine = ScriptEngine(tok)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=engine)
        trajs = capture(rollout)
        await cluster.wait_trainer(timeout=120)
        buffer = cluster.node("buffer-0")
        refused = buffer.refusals.figures()
        acked = rollout.outbox.stats["acked"]
    assert not refused, refused  # no prompt_mismatch: 0 of what the old rule refused
    steps = [m for m in read_jsonl(cfg.resolved_run_dir() / "metrics.jsonl") if "step" in m]
    assert len(steps) >= 4
    assert any(m.get("grad_norm", 0.0) > 0 for m in steps), steps[-1]
    used = {u for step in consumed(cfg) for u in step["uids"]}
    assert len(used) >= 4 * 2 * 2 and acked >= len(used)
    render = ChatRenderer(tok)
    by_uid = {t.uid: t for t in trajs}
    assert len(by_uid) == len(trajs)
    assert_framed_prompts(trajs, render)  # what the agent rendered
    for t in trajs:
        text = tok.decode(t.prompt_ids.tolist(), skip_special_tokens=True)
        assert SYSTEM in text and WRAP + t.prompt in text
        segs = runs(t.loss_mask)
        model_runs = [s for s in segs if s[0] == 1]
        for turn, (_, a, b) in enumerate(model_runs):
            ids, lps = engine.emitted[(t.uid, turn)]
            assert t.response_ids[a:b].tolist() == ids
            assert np.allclose(t.logprobs[a:b], lps)
        hard = "*" in t.prompt
        assert len(t.tool_calls) == (1 if hard else 0), t.tool_calls
        assert all(c.name == "calculator" and c.turn == 0 for c in t.tool_calls)
    # the trained samples' tokens are what the client got back, call by call
    calls = read_jsonl(agent_files["AGENT_TEST_CALLS"])
    checked = 0
    for c in calls:
        uid = c["id"].removeprefix("chatcmpl-").rsplit("-", 2)[0]
        if uid not in used:
            continue
        t, turn = by_uid[uid], int(c["id"].rsplit("-", 1)[1])
        a, b = [(a, b) for v, a, b in runs(t.loss_mask) if v == 1][turn]
        trained = t.response_ids[a:b].tolist()
        assert "".join(c["tokens"]) == tok.decode(trained, skip_special_tokens=False)
        assert np.allclose(c["logprobs"], t.logprobs[a:b])
        checked += 1
    assert checked >= len(used)
    # tool calls counted for agent episodes, and the endpoint's counters in metrics.jsonl
    assert any(m.get("episode/tool_calls", 0.0) > 0 for m in steps), steps[-1]
    assert any(m.get("reward_by_tool_calls/1") is not None for m in steps)
    assert any(m.get("agent/agent_calls", 0) > 0 for m in steps), steps[-1]
    # the run ended normally: nothing logged as an error, no rollout declared dead (the nodes'
    # structlog lines are printed; aiohttp's and asyncio's go to logging)
    errors = [r.getMessage()[:300] for r in caplog.records if r.levelno >= logging.ERROR]
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    errors += [x[:300] for x in lines if '"level": "error"' in x or "[error" in x]
    assert not errors, errors
    assert not [x for x in lines if "node_dead" in x]
    assert any("stopped" in x for x in lines)  # (the lines are there to be read)


async def test_bad_requests_get_openai_errors_and_the_endpoint_keeps_serving(
    tmp_path, tiny, monkeypatch
):
    """An agent elsewhere claims an episode (remote protocol), then bad calls, then good ones."""
    monkeypatch.setenv("LAMINAR_AGENT_KEY", "secret-key")
    cfg = make_cfg(tmp_path, tiny, "agent-errors", rows=4, agent={"fn": None, "remote": True})
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=ScriptEngine(tok))
        base = rollout.endpoint.url
        async with aiohttp.ClientSession() as http:
            bad_key = {"Authorization": "Bearer nope"}
            r = await http.post(f"{base}/laminar/v1/episodes/claim?wait_s=5", headers=bad_key)
            assert r.status == 401
            key = {"Authorization": "Bearer secret-key"}
            r = await http.post(f"{base}/laminar/v1/episodes/claim?wait_s=10", headers=key)
            assert r.status == 200, await r.text()
            ep = await r.json()
            auth = {"Authorization": f"Bearer {ep['episode']}"}
            url = f"{base}/v1/chat/completions"
            msgs = [{"role": "user", "content": ep["row"]["prompt"]}]
            cases = [
                (b"{not json", auth, 400, "invalid_json"),
                (json.dumps({"messages": msgs}).encode(), bad_key, 401, "invalid_api_key"),
                (json.dumps({"messages": "hi"}).encode(), auth, 400, "invalid_messages"),
                (
                    json.dumps({"messages": msgs, "stream": "yes"}).encode(),
                    auth,
                    400,
                    "invalid_value",
                ),
                (
                    json.dumps({"messages": msgs, "n": 3}).encode(),
                    auth,
                    400,
                    "unsupported_parameter",
                ),
                (
                    json.dumps({"messages": msgs, "temperature": "hot"}).encode(),
                    auth,
                    400,
                    "invalid_value",
                ),
                (
                    json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(),
                    auth,
                    400,
                    "invalid_messages",
                ),
                (
                    json.dumps({"messages": [{"role": "user", "content": "9" * 600}]}).encode(),
                    auth,
                    400,
                    "context_length_exceeded",
                ),
            ]
            for body, headers, status, code in cases:
                r = await http.post(url, data=body, headers=headers)
                assert r.status == status, (code, await r.text())
                err = (await r.json())["error"]
                assert err["code"] == code and err["message"] and "type" in err
            r = await http.get(f"{base}/v1/models", headers=auth)
            assert (await r.json())["data"][0]["owned_by"] == "laminar"
            # the episode is fine: the official client drives it to the end
            client = openai.AsyncOpenAI(
                base_url=ep["base_url"], api_key=ep["episode"], max_retries=0
            )
            tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
            first = client.chat.completions.create(model="m", messages=msgs, tools=tools)
            second = client.chat.completions.create(model="m", messages=msgs, tools=tools)
            got = await asyncio.gather(first, second, return_exceptions=True)
            conflicts = [g for g in got if isinstance(g, openai.ConflictError)]
            assert len(conflicts) == 1  # one call of an episode at a time
            r1 = next(g for g in got if not isinstance(g, BaseException))
            r = await http.post(
                f"{base}/laminar/v1/episodes/close", json={"reward": 1.0}, headers=auth
            )
            assert r.status == 200
            with pytest.raises(openai.AuthenticationError):  # closed: its token is dead
                await client.chat.completions.create(model="m", messages=msgs)
            await client.close()
            # /v1/completions: a prompt that extends the episode's text adds only its new part
            r = await http.post(f"{base}/laminar/v1/episodes/claim?wait_s=10", headers=key)
            ep2 = await r.json()
            c2 = openai.AsyncOpenAI(base_url=ep2["base_url"], api_key=ep2["episode"], max_retries=0)
            p1 = ep2["row"]["prompt"]
            out1 = await c2.completions.create(model="m", prompt=p1, logprobs=1)
            text1 = out1.choices[0].text
            assert out1.choices[0].logprobs.tokens and len(out1.choices[0].logprobs.tokens) >= 1
            out2 = await c2.completions.create(model="m", prompt=p1 + text1 + "\n1+1=?")
            assert out2.usage.prompt_tokens > out1.usage.prompt_tokens
            await c2.close()
            auth2 = {"Authorization": f"Bearer {ep2['episode']}"}
            r = await http.post(
                f"{base}/laminar/v1/episodes/close", json={"reward": 0.0}, headers=auth2
            )
            assert r.status == 200
        assert r1.choices[0].message.content is not None or r1.choices[0].message.tool_calls
        counters = rollout.metrics.counters
        assert counters.get("agent_history_rewrites", 0) == 0  # both episodes extended their text
        for code in (
            "invalid_json",
            "invalid_api_key",
            "invalid_messages",
            "unsupported_parameter",
            "call_in_flight",
        ):
            assert counters.get(f"agent_http_error_{code}", 0) >= 1, (code, counters)


async def test_tool_choice_required_and_response_format_are_refused_naming_the_engine(
    tmp_path, tiny, monkeypatch
):
    """Issue 47: the torch engine cannot constrain decoding, so tool_choice "required" / a named
    function and response_format json_object / json_schema are refused with a 400 naming the
    field and the engine (never silently ignored), counted under `unsupported`; the episode is
    untouched and tool_choice "auto" / "none" keep working (the official client)."""
    monkeypatch.setenv("LAMINAR_AGENT_KEY", "secret-key")
    cfg = make_cfg(
        tmp_path,
        tiny,
        "agent-constraints",
        rows=1,
        rollout={"sampling": {"max_tokens": 12, "temperature": 1.0}},
        agent={"fn": None, "remote": True},
    )
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    schema = {"name": "answer", "schema": {"type": "object"}}
    asks: list[tuple[dict[str, Any], str]] = [
        ({"tools": tools, "tool_choice": "required"}, "tool_choice"),
        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "calculator"}}},
         "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": schema}}, "response_format"),
    ]  # fmt: skip
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0)  # the real torch engine on the tiny model
        base = rollout.endpoint.url
        key = {"Authorization": "Bearer secret-key"}
        clients = []
        async with aiohttp.ClientSession() as http:
            for choice in ("auto", "none"):
                r = await http.post(f"{base}/laminar/v1/episodes/claim?wait_s=10", headers=key)
                assert r.status == 200, await r.text()
                ep = await r.json()
                client = openai.AsyncOpenAI(
                    base_url=ep["base_url"], api_key=ep["episode"], max_retries=0
                )
                clients.append(client)
                msgs = [{"role": "user", "content": ep["row"]["prompt"]}]
                for kwargs, field in asks:
                    with pytest.raises(openai.BadRequestError) as err:
                        await client.chat.completions.create(model="m", messages=msgs, **kwargs)
                    e = err.value
                    assert e.code == "unsupported_parameter" and e.param == field, e.body
                    assert f"`{field}`" in e.message and "torch engine" in e.message, e.message
                # free text and the model's own choice of tools are served as before
                got = await client.chat.completions.create(
                    model="m", messages=msgs, tools=tools, tool_choice=choice
                )
                assert got.choices[0].finish_reason in ("stop", "length", "tool_calls")
                r = await http.post(
                    f"{base}/laminar/v1/episodes/close",
                    json={"reward": 1.0},
                    headers={"Authorization": f"Bearer {ep['episode']}"},
                )
                assert r.status == 200
        for client in clients:
            await client.close()
        figures = rollout.endpoint.figures()
    assert figures["unsupported"] == 2 * len(asks), figures
    assert figures["agent_http_error_unsupported_parameter"] == 2 * len(asks)
    assert figures["agent_calls"] == 2 and "agent_history_rewrites" not in figures


async def test_a_crashed_agent_worker_retries_its_episode_and_nothing_twice(
    tmp_path, tiny, agent_files
):
    cfg = make_cfg(
        tmp_path,
        tiny,
        "agent-crash",
        rows=3,
        data={"epochs": 1},
        agent={
            "fn": "tests.agent_fakes:crashing_agent",
            "workers": 2,
            "concurrency": 1,
            "retries": 1,
        },
    )
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=ScriptEngine(tok))
        trajs = capture(rollout)
        want = 3 * cfg.rollout.group_size
        await wait_for(lambda: len(trajs) == want, 90, f"{want} trajectories", cluster)
        counters = dict(rollout.metrics.counters)
    assert len({t.uid for t in trajs}) == want  # each sample delivered once
    assert counters["agent_failure_worker_died"] == want  # each episode's first attempt died
    assert counters["agent_retries"] == want
    assert all(t.reward in (0.0, 1.0) and t.finish_reason == "stop" for t in trajs)
    assert all(t.turns == 1 and t.loss_mask is not None and t.loss_mask.all() for t in trajs)


async def test_an_agent_raising_on_its_token_budget_ends_its_episode_truncated(
    tmp_path, tiny, agent_files
):
    """The endpoint refuses a call past the episode's token budget (400 context_length_exceeded)
    and the agent raises on it: the episode is delivered once, finish_reason "length", scored by
    reward.fn, not failed nor retried."""
    cfg = make_cfg(
        tmp_path,
        tiny,
        "agent-budget",
        rows=2,
        data={"epochs": 1},
        rollout={"sampling": {"max_tokens": 60, "temperature": 1.0}},
        agent={"fn": "tests.agent_fakes:endless_agent"},
    )
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=ScriptEngine(tok))
        trajs = capture(rollout)
        want = 2 * cfg.rollout.group_size
        await wait_for(lambda: len(trajs) == want, 60, f"{want} trajectories", cluster)
        counters = dict(rollout.metrics.counters)
    assert len({t.uid for t in trajs}) == want
    assert all(t.finish_reason == "length" and len(t.response_ids) >= 60 for t in trajs)
    assert all(t.reward in (0.0, 1.0) for t in trajs)  # reward.fn scored the transcript
    assert counters["agent_raised_truncated"] == want, counters
    assert counters["agent_http_error_context_length_exceeded"] == want
    assert not any(k.startswith("agent_failure") or k == "agent_retries" for k in counters)


async def test_rewritten_history_trains_the_last_consistent_run(tmp_path, tiny, agent_files):
    cfg = make_cfg(
        tmp_path,
        tiny,
        "agent-rewrite",
        rows=2,
        data={"epochs": 1},
        agent={"fn": "tests.agent_fakes:rewriting_agent"},
    )
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    engine = ScriptEngine(tok)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=engine)
        trajs = capture(rollout)
        want = 2 * cfg.rollout.group_size
        await wait_for(lambda: len(trajs) == want, 60, f"{want} trajectories", cluster)
        counters = dict(rollout.metrics.counters)
    assert counters["agent_history_rewrites"] == want
    assert counters["agent_rewrite_tokens_dropped"] > 0
    # the summary's run would have trained a prompt the buffer refuses: refused at the call
    assert counters["agent_http_error_prompt_mismatch"] == want
    refused = [c for c in read_jsonl(agent_files["AGENT_TEST_CALLS"]) if "refused" in c]
    assert refused == [{"refused": "prompt_mismatch"}] * want
    render = ChatRenderer(tok)
    for t in trajs:
        want_prompt = render.first_ids([{"role": "user", "content": t.prompt}], None)
        assert t.prompt_ids.tolist() == want_prompt  # the last run: from the served prompt
        assert t.turns == 1 and t.loss_mask.all() and t.reward == 0.5
        assert t.response_ids.tolist() == engine.emitted[(t.uid, 0)][0]


async def test_real_torch_engine_episode_matches_what_the_client_saw(tmp_path, tiny, agent_files):
    cfg = make_cfg(
        tmp_path,
        tiny,
        "agent-torch",
        rows=2,
        data={"epochs": 1},
        rollout={"sampling": {"max_tokens": 40, "temperature": 1.0}},
        agent={"fn": "tests.agent_fakes:tool_agent"},
    )
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0)
        trajs = capture(rollout)
        want = 2 * cfg.rollout.group_size
        await wait_for(lambda: len(trajs) == want, 90, f"{want} trajectories", cluster)
    calls = {c["id"]: c for c in read_jsonl(Path(os.environ["AGENT_TEST_CALLS"]))}
    tok = rollout.tokenizer
    for t in trajs:
        c = calls[f"chatcmpl-{t.uid}-0-0"]
        a, b = runs(t.loss_mask)[0][1:]
        assert runs(t.loss_mask)[0][0] == 1
        assert [tok.decode([i]) for i in t.response_ids[a:b].tolist()] == c[
            "tokens"
        ]  # specials too
        assert np.allclose(t.logprobs[a:b], c["logprobs"], atol=1e-6)
        assert (t.logprobs[a:b] < 0).all()


async def test_agents_lost_with_their_rollout_start_again_from_the_prompt_once(
    tmp_path, tiny, agent_files
):
    """rollout-0 dies with agent calls in flight and its agents cannot reach rollout-1 (its
    endpoint is not listed where their clients look): the manager recovers the episodes onto
    rollout-1 (same version, token and tokens kept), which waits agent.reconnect_timeout_s for
    their agents, then starts them again from the prompt; every sample once."""
    cfg = make_cfg(
        tmp_path,
        tiny,
        "agent-death",
        rows=4,
        data={"epochs": 1},
        rollout={"credits": 4},
        agent={
            "fn": "tests.agent_fakes:tool_agent",
            "workers": 4,
            "reconnect_timeout_s": 2.0,
            "kwargs": FRAMED,
        },
    )
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    async with LocalCluster(cfg) as cluster:
        r0 = await cluster.add("rollout", 0, engine=ScriptEngine(tok, hold=30.0, hold_at=1))
        in_flight = lambda: sum(1 for s in r0.table.seqs.values() if s.length) >= 2  # noqa: E731
        await wait_for(in_flight, 60, "calls in flight on rollout-0", cluster)
        r1 = await cluster.add("rollout", 1, engine=ScriptEngine(tok))
        (cfg.resolved_run_dir() / "agents" / "endpoints" / "rollout-1").unlink()
        trajs = capture(r1)
        await cluster.kill_node("rollout-0")
        buffer = cluster.node("buffer-0")
        want = 4 * cfg.rollout.group_size

        def stored() -> dict[str, Any]:
            return {t.uid: t for g in buffer.state.groups.values() for t in g.members.values()}

        await wait_for(lambda: len(stored()) == want, 90, f"{want} trajectories", cluster)
        counters = dict(r1.metrics.counters)
    done = stored()
    assert {(t.group_id, t.sample_index) for t in done.values()} == {
        (g.group_id, i) for g in buffer.state.groups.values() for i in range(g.n)
    }
    assert len(buffer.state.groups) == 4 and all(t.rollout_id == "rollout-1" for t in done.values())
    assert counters.get("agent_moved_in", 0) >= 2, counters
    assert counters.get("agent_failure_lost", 0) >= 2, counters
    assert not counters.get("agent_calls_resumed"), counters
    assert len({t.uid for t in trajs}) == len(trajs)  # each delivered once
    assert all(t.reward in (0.0, 1.0) for t in done.values())
    assert_framed_prompts(done.values(), ChatRenderer(tok))  # recovered, started again: taken


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
async def test_a_repack_move_mid_call_resumes_the_call_on_the_other_rollout(
    tmp_path, tiny, agent_files, stream
):
    """Repack moves rollout-0's agent episodes to rollout-1 while some agents' second calls are in
    flight with 2 tokens made: the call answers 421 on rollout-0, the agent's client repeats it on
    rollout-1, which continues the turn after the recorded tokens; the agent sees one normal
    answer. Every sample once; each trajectory holds the first call's tokens and the second's
    (rollout-0's 2, then rollout-1's) exactly as the engines made them; each tool call id ran
    once. The 421s name rollout-1 (`Laminar-Moved-To`), so the agents' clients ask it alone: a
    decoy endpoint listed first in run_dir/agents/endpoints (answering 401, as a rollout without
    the episode) is asked by fewer searches than there were (each search without the hint asks
    it in its first round). Streamed, the move ends the call's stream with an error event
    (`episode_moved`) after its first tokens; the agent repeats the call and gets the whole turn
    from rollout-1, the recorded tokens first."""
    from aiohttp import web

    from laminar.manager.repack import Move

    cfg = make_cfg(
        tmp_path,
        tiny,
        "agent-repack",
        rows=2,
        data={"epochs": 1},
        rollout={"credits": 2},
        agent={
            "fn": f"tests.agent_fakes:{'streaming_tool_agent' if stream else 'tool_agent'}",
            "workers": 1,
            "kwargs": FRAMED,
        },
    )
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    render = ChatRenderer(tok)
    e0 = ScriptEngine(tok, hold=60.0, hold_at=2, hold_turn=1)
    e1 = ScriptEngine(tok)
    async with LocalCluster(cfg) as cluster:
        r0 = await cluster.add("rollout", 0, engine=e0)
        r1 = await cluster.add("rollout", 1, engine=e1)
        trajs0, trajs1 = capture(r0), capture(r1)
        decoy_hits: list[str] = []

        async def decoy(request: web.Request) -> web.Response:
            decoy_hits.append(request.path)
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", decoy)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        endpoints = Path(r0.agents.s.endpoints_dir)
        (endpoints / "a-decoy").write_text(f"http://127.0.0.1:{runner.addresses[0][1]}/v1")
        await manager_sees(cluster, "rollout-1")  # else the move's one destination is its source

        def held() -> list[str]:
            return [
                s.uid
                for s in r0.table.seqs.values()
                if s.turn == 1 and not s.waiting and s.length - s.turn_start == 2
            ]

        await wait_for(lambda: len(held()) >= 1, 60, "a second call in flight", cluster)
        hard = set(held())
        moving = set(r0.table.seqs)
        mgr = cluster.node("manager-0")
        out = await mgr.repacker.move(
            Move("rollout-0", "rollout-1", ("*",), 0), refresh=False, trainer_version=0
        )
        assert out["moved"] == len(moving), out
        buffer = cluster.node("buffer-0")
        want = 2 * cfg.rollout.group_size

        def stored() -> dict[str, Any]:
            return {t.uid: t for g in buffer.state.groups.values() for t in g.members.values()}

        await wait_for(lambda: len(stored()) == want, 60, f"{want} trajectories", cluster)
        c0, c1 = dict(r0.metrics.counters), dict(r1.metrics.counters)
        await runner.cleanup()
    done = stored()
    assert len(trajs0) + len(trajs1) == want and len({t.uid for t in trajs0 + trajs1}) == want
    # every 421 named rollout-1; each was a search (a call in flight, or a later call or close
    # sent to rollout-0), and the hinted searches left the decoy (almost always) alone
    searches = c0.get("agent_http_error_episode_moved", 0)
    assert searches >= len(moving) and c0.get("agent_moved_hinted") == searches, c0
    assert len(decoy_hits) < searches, (decoy_hits, searches)
    assert {t.uid for t in trajs1} == moving and c0.get("agent_moved_out") == len(moving)
    assert c1.get("agent_moved_in") == len(moving) and c1.get("agent_calls_resumed", 0) >= len(hard)
    for c in (c0, c1):
        assert not any(k.startswith("agent_failure") or "mismatch" in k for k in c), c
    logged = read_jsonl(agent_files["AGENT_TEST_CALLS"])
    calls = {c["id"]: c for c in logged if "id" in c}
    if stream:  # each held call's stream was cut by the move once, and repeated
        assert sum("stream_cut" in c for c in logged) >= len(hard)
    for uid in hard:
        t = done[uid]
        model = [(a, b) for v, a, b in runs(t.loss_mask) if v == 1]
        assert len(model) == 2, runs(t.loss_mask)
        (a0, b0), (a1, b1) = model
        first, second = e0.emitted[(uid, 0)], e0.emitted[(uid, 1)]
        assert t.response_ids[a0:b0].tolist() == first[0]
        assert np.allclose(t.logprobs[a0:b0], first[1])
        assert len(second[0]) == 2  # made on rollout-0 before the move ...
        rest = e1.emitted[(uid, 1)]  # ... and the rest of the turn on rollout-1
        assert t.response_ids[a1:b1].tolist() == second[0] + rest[0]
        assert np.allclose(t.logprobs[a1:b1], second[1] + rest[1])
        # the agent's one answer to its second call is that whole turn
        got = calls[f"chatcmpl-{uid}-0-1"]
        assert got["tokens"] == [render.token_text(int(i)) for i in t.response_ids[a1:b1]]
        assert np.allclose(got["logprobs"], t.logprobs[a1:b1])
        assert t.rollout_id == "rollout-1" and t.reward in (0.0, 1.0)
    effects = Counter(e["call_id"] for e in read_jsonl(agent_files["AGENT_TEST_EFFECTS"]))
    assert effects and set(effects.values()) == {1}
    # the agent's own prompt moved with its episodes and the buffer took it; the tool call made
    # before the move is counted from the repeated call's messages
    assert_framed_prompts(done.values(), render)
    assert all(len(done[uid].tool_calls) == 1 for uid in hard)


async def test_moved_episodes_whose_version_is_gone_start_again_from_the_prompt_once(
    tmp_path, tiny, agent_files
):
    """No live rollout serves a moved episode's version (here: the export's partials are offered
    at an older version nobody holds now): the manager restarts them from their prompts on a
    rollout of the newest version (`restarted_from_prompt`), without their token, so their
    agents' repeated calls find no rollout holding them and fail after
    agent.reconnect_timeout_s; rollout-1 runs them again with its own agents
    (`agent_restarted_on_import`). Every sample once."""
    from laminar.protocol.rollout import ExportReply, ExportRequest

    cfg = make_cfg(
        tmp_path,
        tiny,
        "agent-version-gone",
        rows=2,
        data={"epochs": 1},
        rollout={"credits": 2},
        agent={
            "fn": "tests.agent_fakes:tool_agent",
            "workers": 1,
            "reconnect_timeout_s": 1.0,
            "kwargs": FRAMED,
        },
    )
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    async with LocalCluster(cfg) as cluster:
        r0 = await cluster.add("rollout", 0, engine=ScriptEngine(tok, hold=60.0, hold_at=1))
        r1 = await cluster.add("rollout", 1, engine=ScriptEngine(tok))
        trajs1 = capture(r1)
        await manager_sees(cluster, "rollout-1")
        calls = lambda: sum(1 for s in r0.table.seqs.values() if s.length)  # noqa: E731
        await wait_for(lambda: calls() == 4, 60, "every first call in flight", cluster)
        mgr = cluster.node("manager-0")
        exp = await mgr.srv.request("rollout-0", ExportRequest(uids=[]), timeout=5)
        assert isinstance(exp, ExportReply) and len(exp.partials) == 4
        for p in exp.partials:
            p.version -= 1  # a version no live rollout serves any more (older than theirs)
        placed = await mgr.placer.place(exp.partials, 0, source="rollout-0")
        assert placed == {"rollout-1": 4}, placed
        assert mgr.metrics.counters["restarted_from_prompt"] == 4
        buffer = cluster.node("buffer-0")

        def stored() -> dict[str, Any]:
            return {t.uid: t for g in buffer.state.groups.values() for t in g.members.values()}

        await wait_for(lambda: len(stored()) == 4, 60, "4 trajectories", cluster)
        # the old agents' calls (waiting on rollout-0) got 421, found no rollout holding their
        # episode and failed: their worker's episodes end (their results ignored by rollout-0)
        pool = r0.agents.pool
        assert pool is not None
        gone = lambda: not any(s.inflight for s in pool.slots)  # noqa: E731
        await wait_for(gone, 30, "rollout-0's agents giving up", cluster)
        c1 = dict(r1.metrics.counters)
    done = stored()
    assert len(trajs1) == 4 and {t.uid for t in trajs1} == set(done)
    assert c1.get("agent_restarted_on_import") == 4 and not c1.get("agent_moved_in"), c1
    assert all(t.rollout_id == "rollout-1" and t.reward in (0.0, 1.0) for t in done.values())
    effects = Counter(e["call_id"] for e in read_jsonl(agent_files["AGENT_TEST_EFFECTS"]))
    assert set(effects.values()) <= {1}
    assert_framed_prompts(done.values(), ChatRenderer(tok))


async def test_openai_agents_sdk_agent_trains_unchanged(tmp_path, tiny, agent_files):
    """A real agent framework from PyPI (the OpenAI Agents SDK) through the endpoint, offline."""
    pytest.importorskip("agents")
    cfg = make_cfg(
        tmp_path,
        tiny,
        "agent-sdk",
        rows=16,
        cluster={"roles": {"manager": 1, "buffer": 1, "trainer": 1, "rollout": 0}},
        trainer={"total_steps": 3, "batch_groups": 2, "lr": 1e-3, "warmup_steps": 0},
        agent={"fn": "laminar.demo.tooldemo.sdk_agent:run", "workers": 2},
    )
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    engine = ScriptEngine(tok)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=engine)
        trajs = capture(rollout)
        await cluster.wait_trainer(timeout=120)
        counters = dict(rollout.metrics.counters)
    assert len(read_jsonl(cfg.resolved_run_dir() / "consumed.jsonl")) == 3
    assert not any(k.startswith("agent_failure") for k in counters), counters
    hard = [t for t in trajs if "*" in t.prompt]
    assert hard and all(t.turns == 2 for t in hard)
    # the SDK's tool call, from the endpoint's answer, is counted (issue 47: episode/tool_calls)
    assert all([c.name for c in t.tool_calls] == ["calculator"] for t in hard)
    for t in trajs:
        model_runs = [r for r in runs(t.loss_mask) if r[0] == 1]
        for turn, (_, a, b) in enumerate(model_runs):
            assert t.response_ids[a:b].tolist() == engine.emitted[(t.uid, turn)][0]
        # the SDK ran the calculator and sent its result back: the transcript is the task's
        assert t.reward_info.get("format") == 1.0, t.completion


async def test_the_readme_agent_example_runs_as_written(tmp_path, tiny, monkeypatch):
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Bring your own agent", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    (tmp_path / "my_agent.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))  # the agent workers get this process's sys.path
    cfg = make_cfg(
        tmp_path, tiny, "agent-readme", rows=3, data={"epochs": 1}, agent={"fn": "my_agent:run"}
    )
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=ScriptEngine(tok))
        trajs = capture(rollout)
        want = 3 * cfg.rollout.group_size
        await wait_for(lambda: len(trajs) == want, 60, f"{want} trajectories", cluster)
    assert all(t.reward in (0.0, 1.0) and t.finish_reason == "stop" for t in trajs)
    assert {t.turns for t in trajs if "*" in t.prompt} <= {2}
    assert any(t.reward == 1.0 for t in trajs) and any(t.reward == 0.0 for t in trajs)


async def test_rollouts_of_one_process_share_one_agent_pool(tmp_path, tiny, agent_files):
    """agent.shared_workers: two rollouts in one process run their episodes on one pool of
    agent.workers processes; a rollout that stops leaves it serving the other; the last one
    closes it (its workers exit)."""
    cfg = make_cfg(
        tmp_path,
        tiny,
        "agent-shared",
        rows=8,
        agent={"workers": 2, "concurrency": 8, "shared_workers": True},
    )
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    async with LocalCluster(cfg) as cluster:
        r0 = await cluster.add("rollout", 0, engine=ScriptEngine(tok))
        r1 = await cluster.add("rollout", 1, engine=ScriptEngine(tok))
        trajs0, trajs1 = capture(r0), capture(r1)
        pool = r0.agents.pool
        assert pool is not None and r1.agents.pool is pool
        pids = pool.pids()
        assert len(pids) == 2
        await wait_for(lambda: trajs0 and trajs1, 60, "trajectories from both rollouts", cluster)
        await cluster.stop_node("rollout-0")
        assert pool.pids() == pids  # still rollout-1's
        before = len(trajs1)
        await wait_for(lambda: len(trajs1) > before, 60, "rollout-1 going on alone", cluster)
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # poll of process exits, under a deadline
    assert not [p for p in pids if _alive(p)], "the shared pool outlived its last rollout"
    assert all(t.reward in (0.0, 1.0) for t in trajs0 + trajs1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_agent_workers_leave_with_a_killed_rollout(tmp_path):
    """kill -9 of the process holding the agent pool, episodes in flight: its agent workers (own
    sessions) see their pipe close, finish their episodes (their calls' server died with it, and
    no endpoint directory was given: they fail at once) and exit; nothing is left running."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.agent_fakes"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]  # after the pool's hello
        assert len(pids) == 2
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # poll of process exits, under a deadline
    left = [p for p in pids if _alive(p)]
    for p in left:  # (only on failure) ours to stop
        os.kill(p, signal.SIGKILL)
    assert not left, f"agent workers outlived their rollout: {left}"
