"""The agent client's transport follows a moved episode (laminar/agents/failover.py).

    .venv/bin/python -m pytest tests/test_agent_failover.py -q

Three local aiohttp servers stand in for rollouts: `old` answers 421 episode_moved (or is
closed: a dead rollout), `other` never held the episode (401), `new` holds it after a few
tries (401 until then, as a rollout the manager has not imported it on yet). The official
openai client, given the transport, sees one normal answer. With a `Laminar-Moved-To` hint on
the 421 the search asks the named rollout alone until a sweep is due.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from laminar.agents import MOVED_TO
from laminar.agents.failover import (
    FailoverTransport,
    blocking_client,
    close_episode,
    episode_client,
    http_client,
)

ANSWER = {
    "id": "chatcmpl-x",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


def _err(status: int, code: str, moved_to: str = "") -> web.Response:
    body = {"error": {"message": code, "type": "x", "param": None, "code": code}}
    return web.json_response(
        body, status=status, headers={MOVED_TO: moved_to} if moved_to else None
    )


class Rollout:
    def __init__(self, name: str, answer: Any):
        self.name, self.answer = name, answer
        self.seen: list[tuple[str, str, Any]] = []
        self.app = web.Application()
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self._handle),
                web.post("/laminar/v1/episodes/close", self._handle),
            ]
        )
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _handle(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self.seen.append((request.path, request.headers.get("Authorization", ""), body))
        return self.answer(self, request.path)

    async def start(self, registry: Path) -> None:
        self.runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        (registry / self.name).write_text(self.url + "/v1")

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def cluster(tmp_path):
    reg = tmp_path / "endpoints"
    reg.mkdir()
    roll: dict[str, Rollout] = {
        "old": Rollout("old", lambda r, path: _err(421, "episode_moved")),
        "other": Rollout("other", lambda r, path: _err(401, "invalid_api_key")),
        "new": Rollout(
            "new",
            lambda r, path: (
                _err(401, "invalid_api_key")
                if len(r.seen) < 3
                else web.json_response(ANSWER if path.startswith("/v1") else {"ok": True})
            ),
        ),
    }
    for r in roll.values():
        await r.start(reg)
    yield reg, roll
    for r in roll.values():
        await r.stop()


@pytest.mark.parametrize("how", ["moved", "died"])
async def test_a_call_on_a_moved_or_dead_rollout_is_answered_by_the_one_holding_it(cluster, how):
    reg, roll = cluster
    if how == "died":
        await roll["old"].stop()  # connection refused, as after a kill -9
    transport = FailoverTransport(roll["old"].url + "/v1", str(reg), reconnect_s=20.0)
    http = http_client(transport, 20.0)
    client = openai.AsyncOpenAI(
        base_url=roll["old"].url + "/v1", api_key="tok", max_retries=0, http_client=http
    )
    msgs = [{"role": "user", "content": "hello"}]
    resp = await client.chat.completions.create(model="m", messages=msgs)
    assert resp.choices[0].message.content == "hi" and transport.moves == 1
    got = roll["new"].seen[-1]
    assert got[0] == "/v1/chat/completions" and got[1] == "Bearer tok"
    assert got[2]["messages"] == msgs  # the same call, repeated unchanged
    assert roll["other"].seen  # asked, said 401, passed over
    # later calls and the close go straight to the rollout that holds the episode
    n_old = len(roll["old"].seen)
    await client.chat.completions.create(model="m", messages=msgs)
    why = await close_episode(http, roll["old"].url + "/v1", "tok", {"reward": 1.0})
    assert why == "" and len(roll["old"].seen) == n_old
    assert roll["new"].seen[-1][0] == "/laminar/v1/episodes/close"
    assert roll["new"].seen[-1][2] == {"reward": 1.0}
    await client.close()


async def test_no_rollout_holding_the_episode_fails_the_call_after_the_bound(cluster):
    reg, roll = cluster
    (reg / "new").unlink()  # only the one that moved it and one that never had it
    transport = FailoverTransport(roll["old"].url + "/v1", str(reg), reconnect_s=0.5)
    http = http_client(transport, 20.0)
    client = openai.AsyncOpenAI(
        base_url=roll["old"].url + "/v1", api_key="tok", max_retries=0, http_client=http
    )
    with pytest.raises(openai.APIConnectionError):
        await _ask(client)
    assert transport.lost and transport.moves == 0
    # the episode was started again elsewhere: the close fails at once, without a new search
    n = sum(len(r.seen) for r in roll.values())
    why = await close_episode(http, roll["old"].url + "/v1", "tok", {"reward": 1.0})
    assert "421" in why and sum(len(r.seen) for r in roll.values()) == n + 1
    await client.close()


def _client(roll: dict[str, Rollout], reg: Path, reconnect_s: float = 20.0):
    transport = FailoverTransport(roll["old"].url + "/v1", str(reg), reconnect_s=reconnect_s)
    client = openai.AsyncOpenAI(
        base_url=roll["old"].url + "/v1",
        api_key="tok",
        max_retries=0,
        http_client=http_client(transport, 20.0),
    )
    return transport, client


async def _ask(client: Any) -> Any:
    return await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}]
    )


def _answers_after(n: int):
    """401 (not imported yet) for the first `n` requests, then the answer."""
    return lambda r, path: (
        _err(401, "invalid_api_key") if len(r.seen) <= n else web.json_response(ANSWER)
    )


async def test_a_hinted_search_asks_only_the_named_rollout(cluster):
    """The 421 names `new`: the search asks it (401 once: the import has not landed) and
    finds the episode there without asking `other`, nor the rollout that moved it."""
    reg, roll = cluster
    roll["old"].answer = lambda r, path: _err(421, "episode_moved", moved_to="new")
    roll["new"].answer = _answers_after(1)
    transport, client = _client(roll, reg)
    msgs = [{"role": "user", "content": "hello"}]
    resp = await client.chat.completions.create(model="m", messages=msgs)
    assert resp.choices[0].message.content == "hi" and transport.moves == 1
    assert (transport.searches, transport.hinted, transport.probes) == (1, 1, 2)
    assert len(roll["new"].seen) == 2 and roll["new"].seen[-1][2]["messages"] == msgs
    assert not roll["other"].seen and len(roll["old"].seen) == 1
    await client.close()


async def test_a_wrong_hint_still_finds_the_episode_elsewhere(cluster):
    """The 421 names `other`, which keeps answering 401 (placement chose `new`): the sweeps
    find `new`; until then every round asked `other` alone."""
    reg, roll = cluster
    roll["old"].answer = lambda r, path: _err(421, "episode_moved", moved_to="other")
    roll["new"].answer = _answers_after(0)
    transport, client = _client(roll, reg)
    resp = await _ask(client)
    assert resp.choices[0].message.content == "hi" and transport.moves == 1
    assert len(roll["new"].seen) == 1  # found by the first sweep
    # rounds before the sweep asked the hint alone (at least 3 of them), the sweep asked it too
    assert len(roll["other"].seen) >= 4, roll["other"].seen
    assert transport.probes == len(roll["other"].seen) + 1  # old was last in the sweep: not asked
    await client.close()


async def test_an_episode_that_moved_twice_is_followed_by_the_newer_hint(cluster):
    """`old` names `other`, which moved it on too and names `new`: two probes."""
    reg, roll = cluster
    roll["old"].answer = lambda r, path: _err(421, "episode_moved", moved_to="other")
    roll["other"].answer = lambda r, path: _err(421, "episode_moved", moved_to="new")
    roll["new"].answer = _answers_after(0)
    transport, client = _client(roll, reg)
    resp = await _ask(client)
    assert resp.choices[0].message.content == "hi" and transport.probes == 2
    assert len(roll["other"].seen) == len(roll["new"].seen) == len(roll["old"].seen) == 1
    await client.close()


@pytest.mark.parametrize("hint", ["gone", "dead", "../new", "old"])
async def test_an_unusable_hint_searches_as_without_one(cluster, hint):
    """A hint naming no endpoint file (`gone`, or not a node id), the rollout that sent it, or
    a dead rollout (dropped after its one refused connection): every round asks every
    endpoint, as without a hint."""
    reg, roll = cluster
    roll["old"].answer = lambda r, path: _err(421, "episode_moved", moved_to=hint)
    if hint == "dead":
        dead = Rollout("dead", lambda r, path: web.json_response(ANSWER))
        await dead.start(reg)
        await dead.stop()
    transport, client = _client(roll, reg)
    resp = await _ask(client)
    assert resp.choices[0].message.content == "hi" and transport.moves == 1
    assert transport.hinted == (hint == "dead")
    # `new` answers its 3rd request: three rounds, each asking `new`, then `other` and `old`
    # (the one it came from, last) in the two rounds `new` did not answer; a dead hint costs
    # one round asking it alone, then its endpoint file is asked (refused) in each sweep
    assert len(roll["new"].seen) == 3 and len(roll["other"].seen) == 2
    assert len(roll["old"].seen) == 1 + 2
    assert transport.probes == 3 + 2 + 2 + (1 + 3 if hint == "dead" else 0)
    await client.close()


async def test_a_blocking_client_of_the_episode_follows_it_too(cluster):
    """A sync framework (smolagents) gets `blocking_client(client)`: its calls, from a thread,
    go through the episode's transport on the worker's loop, so a move is followed the same
    way; from the loop's own thread it refuses rather than deadlock."""
    reg, roll = cluster
    transport = FailoverTransport(roll["old"].url + "/v1", str(reg), reconnect_s=20.0)
    client = episode_client(roll["old"].url + "/v1", "tok", transport, http_client(transport, 20.0))
    sync = blocking_client(client)
    msgs = [{"role": "user", "content": "hello"}]
    resp = await asyncio.to_thread(sync.chat.completions.create, model="m", messages=msgs)
    assert resp.choices[0].message.content == "hi" and transport.moves == 1
    assert roll["new"].seen[-1][1:] == ("Bearer tok", {"model": "m", "messages": msgs})
    with pytest.raises(RuntimeError, match="wait on itself"):
        sync.chat.completions.create(model="m", messages=msgs)
    with pytest.raises(ValueError):
        blocking_client(openai.AsyncOpenAI(base_url="http://x/v1", api_key="k"))
    sync.close()
    await client.close()
