"""Streamed calls (`stream: true`) through the official openai client.

    .venv/bin/python -m pytest tests/test_agent_stream.py -q

Remote episodes (claimed over HTTP, as agents elsewhere do) on one rollout in this process
(LocalCluster, inproc): the real torch engine on the tiny model, greedy, where a streamed and an
unstreamed call of the same prompt must agree; the scripted engine (tests/agent_fakes.py) where
the turn's text is known (a tool call) or held mid-turn (a client that leaves, an episode that
ends under a stream).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest

from laminar.agents.render import ChatRenderer
from laminar.cluster import LocalCluster
from laminar.demo.tooldemo.agent import TOOLS
from laminar.models.prompt_tokenizer import load_prompt_tokenizer
from tests.agent_fakes import ScriptEngine
from tests.test_agents import capture, make_cfg, wait_for

KEY = "stream-key"


def _cfg(tmp_path: Any, tiny: Any, name: str, **over: Any) -> Any:
    return make_cfg(tmp_path, tiny, name, agent={"fn": None, "remote": True}, **over)


async def _claim(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    r = await http.post(
        f"{base}/laminar/v1/episodes/claim?wait_s=10", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status == 200, await r.text()
    return await r.json()


async def _close(http: aiohttp.ClientSession, base: str, token: str, reward: float) -> None:
    r = await http.post(
        f"{base}/laminar/v1/episodes/close",
        json={"reward": reward},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status == 200, await r.text()


def _client(ep: dict[str, Any]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=ep["base_url"], api_key=ep["episode"], max_retries=0)


def _uid(completion_id: str) -> str:
    """chatcmpl-<sample uid>-<attempt>-<turn> -> the sample uid."""
    return completion_id.split("-", 1)[1].rsplit("-", 2)[0]


async def test_a_streamed_call_is_the_unstreamed_one_token_for_token(tmp_path, tiny, monkeypatch):
    """Greedy on the torch engine, three episodes of one prompt: unstreamed, streamed with
    logprobs and usage, and streamed bare agree on text, tokens and logprobs; the trained sample
    of a streamed one is exactly the streamed tokens and logprobs; usage comes last."""
    monkeypatch.setenv("LAMINAR_AGENT_KEY", KEY)
    cfg = _cfg(
        tmp_path,
        tiny,
        "stream-greedy",
        rows=1,
        rollout={"sampling": {"max_tokens": 40, "temperature": 0.0}, "group_size": 3},
    )
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0)
        trajs = capture(rollout)
        base = rollout.endpoint.url
        async with aiohttp.ClientSession() as http:
            eps = [await _claim(http, base) for _ in range(3)]
            assert len({e["row"]["prompt"] for e in eps}) == 1
            msgs = [{"role": "user", "content": eps[0]["row"]["prompt"]}]
            clients = [_client(e) for e in eps]

            plain = await clients[0].chat.completions.create(
                model="m", messages=msgs, logprobs=True
            )
            want_text = plain.choices[0].message.content
            want_toks = [t.token for t in plain.choices[0].logprobs.content]
            want_lps = [t.logprob for t in plain.choices[0].logprobs.content]
            assert want_toks, "the greedy turn is empty"

            stream = await clients[1].chat.completions.create(
                model="m",
                messages=msgs,
                logprobs=True,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == len(want_toks)
            assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
            body = [c.choices[0] for c in chunks if c.choices]
            assert [ch.finish_reason for ch in body][-1] == plain.choices[0].finish_reason
            assert all(ch.finish_reason is None for ch in body[:-1])
            assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
            text = "".join(ch.delta.content or "" for ch in body)
            toks = [t.token for ch in body if ch.logprobs for t in ch.logprobs.content]
            lps = [t.logprob for ch in body if ch.logprobs for t in ch.logprobs.content]
            assert len([ch for ch in body if ch.logprobs]) > 1  # token by token, not at the end
            assert text == want_text and toks == want_toks
            assert np.allclose(lps, want_lps, atol=1e-5)

            bare = await clients[2].chat.completions.create(model="m", messages=msgs, stream=True)
            bare_chunks = [c async for c in bare]
            assert all(c.choices and c.choices[0].logprobs is None for c in bare_chunks)
            assert "".join(c.choices[0].delta.content or "" for c in bare_chunks) == want_text

            for e in eps:
                await _close(http, base, e["episode"], 0.5)
            for c in clients:
                await c.close()
        await wait_for(lambda: len(trajs) >= 3, 30, "3 trajectories", cluster)
        counters = dict(rollout.metrics.counters)
    by_uid = {t.uid: t for t in trajs}
    t = by_uid[_uid(chunks[0].id)]
    assert t.loss_mask.all()
    assert t.logprobs.tolist() == np.asarray(lps, np.float32).tolist()  # exactly
    assert [rollout.tokenizer.decode([i]) for i in t.response_ids.tolist()] == want_toks
    assert counters.get("agent_streamed_calls") == 2


async def test_tool_call_deltas_assemble_to_the_unstreamed_tool_call(tmp_path, tiny, monkeypatch):
    """A turn that calls a tool, through the client's `stream()` helper: no content streams out
    of the call's text; the tool call comes as deltas (index, id, name, then arguments) that
    assemble (by hand and by the helper) to the message an unstreamed call returns; then
    /v1/completions streams text chunks with their logprobs."""
    monkeypatch.setenv("LAMINAR_AGENT_KEY", KEY)
    cfg = _cfg(tmp_path, tiny, "stream-tools", rows=8)
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    engine = ScriptEngine(tok)
    render = ChatRenderer(tok)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=engine)
        base = rollout.endpoint.url
        async with aiohttp.ClientSession() as http:
            ep = await _claim(http, base)
            while "*" not in ep["row"]["prompt"]:  # a hard prompt: its first turn calls a tool
                await _close(http, base, ep["episode"], 0.0)
                ep = await _claim(http, base)
            client = _client(ep)
            msgs = [{"role": "user", "content": ep["row"]["prompt"]}]
            async with client.chat.completions.stream(
                model="m", messages=msgs, tools=TOOLS, logprobs=True
            ) as helper:  # the client's own assembly
                chunks = [ev.chunk async for ev in helper if ev.type == "chunk"]
                final = (await helper.get_final_completion()).choices[0].message
            body = [c.choices[0] for c in chunks if c.choices]
            assert body[-1].finish_reason == "tool_calls"
            content = "".join(ch.delta.content or "" for ch in body)
            calls: dict[int, dict[str, Any]] = {}
            for ch in body:
                for d in ch.delta.tool_calls or []:
                    c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                    c["id"] += d.id or ""
                    if d.function is not None:
                        c["name"] += d.function.name or ""
                        c["arguments"] += d.function.arguments or ""
            uid, turn = _uid(chunks[0].id), int(chunks[0].id.rsplit("-", 1)[1])
            ids, lps = engine.emitted[(uid, 0)]
            want, called = render.assistant_message(render.decode(ids), True, uid, turn)
            assert called and content == (want["content"] or "")
            assert [
                {"id": c["id"], "name": c["name"], "arguments": c["arguments"]}
                for _, c in sorted(calls.items())
            ] == [
                {
                    "id": w["id"],
                    "name": w["function"]["name"],
                    "arguments": w["function"]["arguments"],
                }
                for w in want["tool_calls"]
            ]
            assert [
                (c.id, c.function.name, c.function.arguments) for c in final.tool_calls or []
            ] == [
                (w["id"], w["function"]["name"], w["function"]["arguments"])
                for w in want["tool_calls"]
            ]
            streamed_lps = [t.logprob for ch in body if ch.logprobs for t in ch.logprobs.content]
            assert streamed_lps == np.asarray(lps, np.float32).tolist()
            # the same episode goes on: the tool's answer, then an unstreamed call
            assistant = {
                "role": "assistant",
                "content": content or None,
                "tool_calls": [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for _, c in sorted(calls.items())
                ],
            }
            msgs += [assistant, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "42"}]
            r2 = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
            assert r2.choices[0].message.content and r2.usage.prompt_tokens > 0
            await _close(http, base, ep["episode"], 1.0)
            await client.close()
            # /v1/completions: text chunks, each with its tokens' logprobs
            ep2 = await _claim(http, base)
            c2 = _client(ep2)
            s2 = await c2.completions.create(
                model="m",
                prompt=ep2["row"]["prompt"],
                logprobs=1,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts = [c async for c in s2]
            text = "".join(p.choices[0].text for p in parts if p.choices)
            toks = [
                t
                for p in parts
                if p.choices and p.choices[0].logprobs
                for t in p.choices[0].logprobs.tokens
            ]
            uid2 = _uid(parts[0].id)
            ids2, _ = engine.emitted[(uid2, 0)]
            assert text == render.decode(ids2) and len(toks) == len(ids2)
            assert parts[-1].usage.completion_tokens == len(ids2)
            await _close(http, base, ep2["episode"], 0.0)
            await c2.close()


async def test_a_client_leaving_mid_stream_leaves_the_episode_whole(
    tmp_path, tiny, monkeypatch, caplog
):
    """A client reads the first chunk and goes away while the model is mid-turn: counted, no
    ERROR; the turn runs to its end and the episode goes on (a repeated call starts a new run
    from the served prompt) and is delivered. An episode closed under a live stream ends that
    stream with an error event the client raises on. A refusal before the stream is JSON."""
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("LAMINAR_AGENT_KEY", KEY)
    cfg = _cfg(tmp_path, tiny, "stream-leave", rows=8)
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    engine = ScriptEngine(tok, hold=1.0, hold_at=1, hold_turn=0)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=engine)
        trajs = capture(rollout)
        base = rollout.endpoint.url
        async with aiohttp.ClientSession() as http:
            ep = await _claim(http, base)
            client = _client(ep)
            msgs = [{"role": "user", "content": ep["row"]["prompt"]}]
            with pytest.raises(openai.BadRequestError):  # before the stream: a JSON 400
                await client.chat.completions.create(
                    model="m", messages=[{"role": "robot", "content": "x"}], stream=True
                )
            stream = await client.chat.completions.create(model="m", messages=msgs, stream=True)
            first = await stream.__anext__()
            assert first.choices[0].delta.role == "assistant"
            await stream.close()  # gone mid-turn (the engine holds the turn's 2nd token)
            figures = rollout.endpoint.figures
            await wait_for(
                lambda: figures().get("stream_disconnected") == 1, 30, "the disconnect", cluster
            )
            again = await client.chat.completions.create(model="m", messages=msgs)
            assert again.choices[0].message.content is not None
            await _close(http, base, ep["episode"], 1.0)
            await client.close()
            # an episode closed while its call streams: the stream ends in an error event
            ep2 = await _claim(http, base)
            c2 = _client(ep2)
            s2 = await c2.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": ep2["row"]["prompt"]}],
                stream=True,
            )
            await s2.__anext__()
            await _close(http, base, ep2["episode"], 0.0)
            with pytest.raises(openai.APIError) as err:
                async for _ in s2:
                    pass
            assert "ended" in str(err.value)
            await c2.close()
        await wait_for(lambda: len(trajs) >= 2, 30, "2 trajectories", cluster)
        counters = dict(rollout.metrics.counters)
    t = next(t for t in trajs if t.uid == _uid(again.id))
    assert t.response_ids.tolist() == engine.emitted[(t.uid, 0)][0]  # the repeated call's run
    assert counters.get("agent_stream_disconnects") == 1
    assert counters.get("agent_history_rewrites") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [
        r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
    ]
    assert json.dumps(figures())  # the status carries it


async def test_langchain_astream_through_the_episode_client(tmp_path, tiny, monkeypatch):
    """A framework's own streaming (LangChain's `astream`, which asks for usage too) on the
    episode's client: the pieces join to the text the engine sampled."""
    lc = pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed (the `frameworks` extra)"
    )
    monkeypatch.setenv("LAMINAR_AGENT_KEY", KEY)
    cfg = _cfg(tmp_path, tiny, "stream-langchain", rows=8)
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    engine = ScriptEngine(tok)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=engine)
        base = rollout.endpoint.url
        async with aiohttp.ClientSession() as http:
            ep = await _claim(http, base)
            client = _client(ep)
            model = lc.ChatOpenAI(
                model="policy",
                async_client=client.chat.completions,
                root_async_client=client,
                api_key=client.api_key,
                base_url=str(client.base_url),
                max_retries=0,
                stream_usage=True,
            )
            pieces = [p async for p in model.astream([("user", ep["row"]["prompt"])])]
            await _close(http, base, ep["episode"], 0.0)
            await client.close()
    assert len(engine.emitted) == 1  # the one episode called
    text = "".join(str(p.content) for p in pieces)
    ids, _ = next(iter(engine.emitted.values()))
    assert text == ChatRenderer(tok).decode(ids) and len(pieces) > 2
    usage = [p.usage_metadata for p in pieces if p.usage_metadata]
    assert usage and usage[-1]["output_tokens"] == len(ids)
