"""The agent endpoint under hostile and careless agents (issue 45): no crash, no stall, every
refusal answered and counted.

    .venv/bin/python -m pytest tests/test_agent_hostile.py -q

The wire and the outbox alone first (a reward component past 64 bits, a message the codec
cannot encode, a sample the buffer refuses); then, in this process over inproc (LocalCluster,
tests/test_agents.py's setup), one rollout whose engine writes scripted text
(tests/agent_fakes.py) probed through its HTTP endpoint as an outsider and as an agent holding
one episode's token; and one rollout training while a third of its samples are refused by
the buffer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter
from typing import Any

import aiohttp
import pytest

from laminar.agents.render import ChatRenderer
from laminar.cluster import LocalCluster
from laminar.models.prompt_tokenizer import load_prompt_tokenizer
from laminar.protocol.buffer import TrajectoryAbandoned, TrajectoryAck
from laminar.protocol.data import Trajectory
from laminar.protocol.manager import StatusReply
from laminar.rewards.runner import normalize_reward
from laminar.rollout.outbox import Outbox
from laminar.transport import codec
from tests.agent_fakes import ScriptEngine
from tests.rollout_fakes import a_trajectory
from tests.sim_cluster import read_jsonl
from tests.test_agents import capture, make_cfg, wait_for

KEY = "secret-key"


# ---- the wire and the outbox --------------------------------------------------------------
def test_reward_components_travel_as_int64_float_or_text():
    reward, info = normalize_reward({"reward": 1, "big": 2**64, "neg": -(2**70), "ok": 7, "f": 0.5})
    assert reward == 1.0
    assert info == {"big": str(2**64), "neg": str(-(2**70)), "ok": 7, "f": 0.5}
    assert info["big"] == "18446744073709551616"
    codec.encode(a_trajectory(reward=reward, reward_info=info))  # the wire carries it
    with pytest.raises(ValueError):  # a reward past the float range is refused, not a crash
        normalize_reward(10**400)
    assert normalize_reward({"reward": 0.0, "s": "\ud800"})[1] == {"s": "?"}


class _Buffer:
    """An RpcClient stand-in: encodes each request as the real one does, answers `answer`."""

    def __init__(self, answer: Any):
        self.answer, self.sent = answer, []

    async def request(self, msg: Any, timeout: float, retries: int) -> Any:
        codec.encode(msg)  # what RpcClient does first: raises what the wire cannot carry
        self.sent.append(msg)
        return self.answer(msg)


async def _drain(outbox: Outbox) -> None:
    task = asyncio.create_task(outbox.run())
    try:
        assert await outbox.flush(timeout=5.0)
    finally:
        task.cancel()


async def test_the_outbox_drops_what_it_cannot_encode_and_abandons_its_member():
    """A message the codec refuses (an integer past 64 bits slipped into reward_info) is
    counted and dropped, the sender goes on, and the sample's member is abandoned (its group
    completes). Before: OverflowError killed the outbox and the rollout with it."""
    import structlog

    buf = _Buffer(lambda m: TrajectoryAck())
    outbox = Outbox(buf, structlog.get_logger(), concurrency=1)  # type: ignore[arg-type]
    outbox.put(a_trajectory("g/0", reward=1.0, reward_info={"big": 2**64}))
    outbox.put(a_trajectory("g/1", reward=1.0))
    await _drain(outbox)
    assert outbox.stats["unencodable"] == 1 and outbox.stats["abandoned"] == 1
    kinds = Counter(type(m).__name__ for m in buf.sent)
    assert kinds == {"Trajectory": 1, "TrajectoryAbandoned": 1}
    abandon = next(m for m in buf.sent if isinstance(m, TrajectoryAbandoned))
    assert (abandon.uid, abandon.group_id, abandon.reason) == ("g/0", "g", "unencodable")


async def test_a_sample_the_buffer_refuses_is_abandoned_so_its_group_completes():
    """Refused as never takeable (reward_range ...): the outbox abandons the member; refused as
    another rollout's (not_owner): it abandons nothing, the owner finishes it."""
    import structlog

    def answer(m: Any) -> TrajectoryAck:
        if isinstance(m, Trajectory):
            return TrajectoryAck(refused="reward_range" if m.uid == "g/0" else "not_owner")
        return TrajectoryAck()

    buf = _Buffer(answer)
    outbox = Outbox(buf, structlog.get_logger(), concurrency=1)  # type: ignore[arg-type]
    outbox.put(a_trajectory("g/0", reward=11.0))
    outbox.put(a_trajectory("g/1", reward=1.0))
    await _drain(outbox)
    assert outbox.stats["refused"] == 2 and outbox.stats["abandoned"] == 1
    abandons = [m for m in buf.sent if isinstance(m, TrajectoryAbandoned)]
    assert [(a.uid, a.reason) for a in abandons] == [("g/0", "refused_reward_range")]


# ---- the endpoint ---------------------------------------------------------------------------
def _cfg(tmp_path: Any, tiny: Any, name: str, **agent: Any) -> Any:
    return make_cfg(
        tmp_path,
        tiny,
        name,
        rows=8,
        agent={"fn": None, "remote": True, **agent},
    )


async def _claim(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    r = await http.post(
        f"{base}/laminar/v1/episodes/claim?wait_s=10", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status == 200, await r.text()
    return await r.json()


async def _post(
    http: aiohttp.ClientSession, url: str, token: str, body: bytes
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    async with http.post(url, data=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def test_hostile_bodies_get_4xx_and_are_counted(tmp_path, tiny, monkeypatch, caplog):
    """Each probe of the issue that a body carries: a 4xx in the OpenAI error shape, counted by
    reason, never a 500; the episode and the rollout go on (its typed `<eos>` stays text). With
    agent.check_model_name an unknown `model` is OpenAI's 404."""
    monkeypatch.setenv("LAMINAR_AGENT_KEY", KEY)
    cfg = _cfg(tmp_path, tiny, "hostile-bodies", check_model_name=True)
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=ScriptEngine(tok))
        trajs = capture(rollout)
        base = rollout.endpoint.url
        chat, close = f"{base}/v1/chat/completions", f"{base}/laminar/v1/episodes/close"
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            # the token before the body: malformed JSON with a fake token is a 401
            assert (await _post(http, chat, "lmn-fake", b"{not json"))[0] == 401
            # a non-ASCII claim key (as a client sends it: latin-1 bytes) is a wrong key
            r = await http.post(
                f"{base}/laminar/v1/episodes/claim?wait_s=0",
                headers={"Authorization": "Bearer cl\u00e9"},
            )
            assert r.status == 401
            ep = await _claim(http, base)
            token, prompt = ep["episode"], ep["row"]["prompt"]
            user = {"role": "user", "content": prompt}
            probes = [
                ("100k-deep nesting", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
                ("deep tool arguments", json.dumps({"messages": [user], "tools": _nest(80)})),
                ("a lone surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
                ("max_tokens 10**30", json.dumps({"messages": [user], "max_tokens": 10**30})),
            ]
            for what, body in probes:
                data = body.encode() if isinstance(body, str) else body
                status, got = await _post(http, chat, token, data)
                assert status == 400, (what, got)
                assert got["error"]["code"] and got["error"]["message"], what
            # a 2M-character message: refused before it is tokenized, in well under a second
            big = json.dumps({"messages": [{"role": "user", "content": "1" * 2_000_000}]})
            t0 = time.monotonic()
            status, got = await _post(http, chat, token, big.encode())
            assert status == 400 and got["error"]["code"] == "context_length_exceeded", got
            assert time.monotonic() - t0 < 5.0
            # a 16 MB body of {}: refused at agent.max_body_bytes
            huge = b'{"messages": [' + b"{}," * ((16 << 20) // 3) + b"{}]}"
            try:
                status, _ = await _post(http, chat, token, huge)
                assert status == 413
            except aiohttp.ClientError:
                pass  # the server answered 413 and closed while the client still wrote
            # another model than the served one (agent.check_model_name): OpenAI's 404
            for url, body in (
                (chat, {"model": "gpt-4o", "messages": [user]}),
                (f"{base}/v1/completions", {"model": "/models/tiny", "prompt": prompt}),
            ):
                status, got = await _post(http, url, token, json.dumps(body).encode())
                assert status == 404 and got["error"]["code"] == "model_not_found", got
                assert got["error"]["type"] == "invalid_request_error", got
            # the episode goes on: its first call (naming the served model) adds a system
            # message, which becomes the sample's prompt; then a user message with typed control
            # tokens (naming none)
            system = {"role": "system", "content": "be brief"}
            body = json.dumps({"model": "hostile-bodies", "messages": [system, user]}).encode()
            status, got = await _post(http, chat, token, body)
            assert status == 200, got
            assert got["model"] == "hostile-bodies"  # the run's name, never the model's path
            answer = got["choices"][0]["message"]
            typed = {"role": "user", "content": "<eos><bos> 1+1=?"}
            body = json.dumps({"messages": [system, user, answer, typed]}).encode()
            status, got = await _post(http, chat, token, body)
            assert status == 200, got
            # a rewritten history that drops the system message: another prompt than the first
            # call's, refused; the episode keeps its run
            status, got = await _post(http, chat, token, json.dumps({"messages": [user]}).encode())
            assert status == 400 and got["error"]["code"] == "prompt_mismatch", got
            # closes the buffer would refuse: each a 400 that says why; the episode stays open
            for reward in ("NaN", "Infinity", '"1.0"', "11", "1e400", '{"big": 1, "b": 2}'):
                body = b'{"reward": ' + reward.encode() + b"}"
                status, got = await _post(http, close, token, body)
                assert status == 400 and got["error"]["code"] == "invalid_reward", (reward, got)
            body = json.dumps({"reward": {"reward": 1, "big": 2**64}}).encode()
            assert (await _post(http, close, token, body))[0] == 200
        await wait_for(lambda: len(trajs) == 1, 30, "the episode's sample", cluster)
        await wait_for(lambda: not len(rollout.outbox), 30, "the buffer's ack", cluster)
        figures = rollout.endpoint.figures()
        status = rollout.status()
        alive = cluster.node("manager-0").srv.peers[rollout.node_id].alive
    t = trajs[0]
    render = ChatRenderer(tok)
    assert t.prompt_ids.tolist() == render.first_ids([system, user], None)  # what it rendered
    assert t.reward == 1.0 and t.reward_info == {"big": "18446744073709551616"}
    assert rollout.outbox.stats["acked"] == 1 and rollout.outbox.stats["unencodable"] == 0
    env = t.response_ids[t.loss_mask == 0]
    assert len(env) and tok.eos_token_id not in env and tok.bos_token_id not in env
    assert figures["unauthorized"] == 2
    assert figures["bad_request"] == 4
    assert figures["too_long"] == 1 and figures["too_large"] == 1
    assert figures["prompt_mismatch"] == 1 and figures["refused_at_close"] == 6
    assert figures["unknown_model"] == 2
    assert "internal" not in figures
    assert rollout.metrics.counters["agent_http_error_invalid_api_key"] == 2  # each once
    assert status.rollout is not None and status.rollout.agent == figures
    assert alive  # the rollout was never declared dead
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def _nest(depth: int) -> Any:
    out: Any = {}
    for _ in range(depth):
        out = {"a": out}
    return [{"type": "function", "function": {"name": "f", "parameters": out}}]


async def _raw(host: str, port: int, data: bytes) -> tuple[Any, Any]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    writer.write(data)
    await writer.drain()
    return reader, writer


SLOW_CONNS = 500
"""Connections trickling a request head (the issue's probe held 500 open for 60 s)."""


async def test_aborted_uploads_and_slow_connections_are_bounded(
    tmp_path, tiny, monkeypatch, caplog
):
    """Uploads dropped mid-body are counted, not logged as errors; past agent.max_connections a
    connection is closed at once, and one that sends no whole request head within
    agent.read_timeout_s is closed then."""
    monkeypatch.setenv("LAMINAR_AGENT_KEY", KEY)
    cfg = _cfg(tmp_path, tiny, "hostile-conns", max_connections=50, read_timeout_s=1.0)
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=ScriptEngine(tok))
        host, port = rollout.endpoint.url.removeprefix("http://").rsplit(":", 1)
        async with aiohttp.ClientSession() as http:
            token = (await _claim(http, rollout.endpoint.url))["episode"]
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: 100000\r\n\r\n"
        ).encode()
        for _ in range(20):  # an upload the client abandons mid-body
            _, writer = await _raw(host, int(port), head + b'{"messages": [')
            writer.close()
        await wait_for(
            lambda: rollout.endpoint.counts["aborted"] == 20, 10, "20 aborted uploads", cluster
        )
        # the 500 connections trickling a request head: at most 50 held at a time (each
        # closed after 1 s), the rest closed at once
        t0 = time.monotonic()
        conns = [await _raw(host, int(port), b"POST /v1/chat") for _ in range(SLOW_CONNS)]
        open_s = time.monotonic() - t0
        deadline = 10.0
        t0 = time.monotonic()
        closed = await asyncio.gather(
            *(asyncio.wait_for(reader.read(), deadline) for reader, _ in conns)
        )
        held_s = time.monotonic() - t0
        for _, writer in conns:
            writer.close()
        counts = dict(rollout.endpoint.counts)
        errors = {k: v for k, v in rollout.metrics.counters.items() if "internal" in k}
    assert all(c == b"" for c in closed)  # every one closed by the server (EOF)
    assert held_s < deadline
    # a held one frees its slot after 1 s: at most 50 held per second of opening
    assert counts["connections_refused"] >= SLOW_CONNS - 50 * (1 + math.ceil(open_s))
    assert counts["read_timeout"] >= 1
    assert counts["connections_refused"] + counts["read_timeout"] >= SLOW_CONNS
    assert counts["aborted"] == 20 and not errors
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # aiohttp's own too


async def test_an_idle_claimed_episode_expires_and_is_counted_where_users_look(
    tmp_path, tiny, monkeypatch, capsys
):
    """A claimed episode whose agent goes silent ends after agent.idle_timeout_s (its token is
    dead, its attempt counted), not after episode_timeout_s; the counters reach the manager and
    `laminar status --json` and its text."""
    monkeypatch.setenv("LAMINAR_AGENT_KEY", KEY)
    cfg = _cfg(tmp_path, tiny, "hostile-idle", idle_timeout_s=1.0, episode_timeout_s=120)
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=ScriptEngine(tok))
        base = rollout.endpoint.url
        async with aiohttp.ClientSession() as http:
            ep = await _claim(http, base)
            user = {"role": "user", "content": ep["row"]["prompt"]}
            body = json.dumps({"messages": [user]}).encode()
            chat = f"{base}/v1/chat/completions"
            assert (await _post(http, chat, ep["episode"], body))[0] == 200
            t0 = time.monotonic()
            await wait_for(
                lambda: rollout.agents.counts["idle_expired"] >= 1, 10, "the idle expiry", cluster
            )
            idle_s = time.monotonic() - t0
            assert (await _post(http, chat, ep["episode"], body))[0] == 401  # its token is dead
        peers = cluster.node("manager-0").srv.peers

        def manager_has_it() -> bool:
            s = peers[rollout.node_id].status
            return s is not None and s.rollout is not None and "idle_expired" in s.rollout.agent

        await wait_for(manager_has_it, 10, "the rollout's status at the manager", cluster)
        manager = cluster.node("manager-0")
        totals = manager.cluster_refusals().agent
        reply = StatusReply(nodes=manager.members(), trainer_version=0, mode="laminar")
        metrics = dict(rollout.metrics.counters)
    assert idle_s < 10 and metrics.get("agent_failure_idle", 0) >= 1
    assert totals["idle_expired"] >= 1 and totals["agent_failures"] >= 1
    import laminar.launch.status as status_cli

    monkeypatch.setattr(status_cli, "fetch_status", lambda cfg, timeout: reply)
    monkeypatch.setattr("laminar.logs.configure_logging", lambda *a, **k: None)  # keep ours
    capsys.readouterr()  # the cluster's log lines so far
    assert status_cli.status_main(None, [], as_json=True, timeout=1.0) == 0
    rows = {r["node"]: r for r in json.loads(capsys.readouterr().out)["nodes"]}
    row = rows[rollout.node_id]
    assert row["alive"] and row["deaths"] == 0 and row["agent"]["idle_expired"] >= 1
    # the endpoint's activity counters too (docs/agents.md "Counters"), not only its refusals
    assert row["agent"]["agent_calls"] == 1 and row["agent"]["agent_failure_idle"] >= 1
    assert status_cli.status_main(None, [], as_json=False, timeout=1.0) == 0
    assert f"AGENT {rollout.node_id}: " in capsys.readouterr().out


# ---- training goes on ---------------------------------------------------------------------
async def _honest(http: aiohttp.ClientSession, rollout: Any, served: list[tuple[str, int]]) -> None:
    """An honest remote agent: claims episodes one by one, makes one call, closes with reward 1
    (None when its call was refused); records (prompt, version) of each answered call."""
    base = rollout.endpoint.url
    chat, close = f"{base}/v1/chat/completions", f"{base}/laminar/v1/episodes/close"
    while True:
        r = await http.post(
            f"{base}/laminar/v1/episodes/claim?wait_s=2",
            headers={"Authorization": f"Bearer {KEY}"},
        )
        if r.status != 200:  # none waiting within wait_s
            continue
        ep = await r.json()
        user = {"role": "user", "content": ep["row"]["prompt"]}
        body = json.dumps({"messages": [user]}).encode()
        status, _ = await _post(http, chat, ep["episode"], body)
        if status == 200:
            served.append((ep["row"]["prompt"], rollout.gate.version))
        body = json.dumps({"reward": 1.0 if status == 200 else None}).encode()
        await _post(http, close, ep["episode"], body)


def _training_cfg(tmp_path: Any, tiny: Any, name: str, steps: int, **agent: Any) -> Any:
    return make_cfg(
        tmp_path,
        tiny,
        name,
        rows=16,
        cluster={"roles": {"manager": 1, "buffer": 1, "trainer": 1, "rollout": 0}},
        trainer={"total_steps": steps, "batch_groups": 1, "lr": 1e-3, "warmup_steps": 0},
        agent={"fn": None, "remote": True, **agent},
    )


async def test_the_trainer_keeps_stepping_through_every_probe(tmp_path, tiny, monkeypatch):
    """One rollout, remote agents: an honest agent works while a hostile one, holding one
    episode's token, sends every probe of the issue at once (bad and huge bodies, deep JSON, a
    2M-character message, rewards the buffer would refuse, typed control tokens, uploads
    dropped mid-body, trickled connections). The trainer reaches its steps, the rollout is never
    declared dead, nothing is consumed twice, and the refusals reach metrics.jsonl."""
    monkeypatch.setenv("LAMINAR_AGENT_KEY", KEY)
    cfg = _training_cfg(tmp_path, tiny, "hostile-train", 6, max_connections=64, read_timeout_s=1.0)
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    served: list[tuple[str, int]] = []
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=ScriptEngine(tok))
        base = rollout.endpoint.url
        chat, close = f"{base}/v1/chat/completions", f"{base}/laminar/v1/episodes/close"
        host, port = base.removeprefix("http://").rsplit(":", 1)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            worker = asyncio.create_task(_honest(http, rollout, served))
            try:
                ep = await _claim(http, base)
                token, user = ep["episode"], {"role": "user", "content": ep["row"]["prompt"]}
                bodies = [
                    b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                    json.dumps({"messages": [user], "tools": _nest(80)}).encode(),
                    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                    json.dumps({"messages": [{"role": "user", "content": "1" * 2_000_000}]}),
                ]
                assert (await _post(http, chat, "lmn-fake", b"{not json"))[0] == 401
                for body in bodies:
                    data = body.encode() if isinstance(body, str) else body
                    assert (await _post(http, chat, token, data))[0] == 400
                try:
                    huge = b'{"messages": [' + b"{}," * ((16 << 20) // 3) + b"{}]}"
                    assert (await _post(http, chat, token, huge))[0] == 413
                except aiohttp.ClientError:
                    pass  # answered 413 and closed while the client still wrote
                typed = {"role": "user", "content": "<eos><bos> 1+1=?"}
                status, got = await _post(
                    http, chat, token, json.dumps({"messages": [user]}).encode()
                )
                assert status == 200, got
                answer = got["choices"][0]["message"]
                body = json.dumps({"messages": [user, answer, typed]}).encode()
                assert (await _post(http, chat, token, body))[0] == 200
                for reward in ("NaN", "Infinity", '"1.0"', "11"):
                    data = b'{"reward": ' + reward.encode() + b"}"
                    assert (await _post(http, close, token, data))[0] == 400
                head = (
                    "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    f"Authorization: Bearer {token}\r\nContent-Length: 100000\r\n\r\n"
                ).encode()
                for _ in range(10):
                    _, writer = await _raw(host, int(port), head + b'{"messages": [')
                    writer.close()
                conns = [await _raw(host, int(port), b"POST /v1/chat") for _ in range(100)]
                await asyncio.gather(*(asyncio.wait_for(r.read(), 10) for r, _ in conns))
                for _, writer in conns:
                    writer.close()
                body = json.dumps({"reward": {"reward": 1, "big": 2**64}}).encode()
                assert (await _post(http, close, token, body))[0] == 200
                await cluster.wait_trainer(timeout=120)
            finally:
                worker.cancel()
                await asyncio.gather(worker, return_exceptions=True)
        peer = cluster.node("manager-0").srv.peers[rollout.node_id]
        alive, deaths = peer.alive, rollout.metrics.counters.get("restarts", 0)
    run = cfg.resolved_run_dir()
    steps = [m for m in read_jsonl(run / "metrics.jsonl") if "step" in m]
    assert len(steps) >= 6 and alive and not deaths
    uids = [u for rec in read_jsonl(run / "consumed.jsonl") for u in rec["uids"]]
    assert uids and len(uids) == len(set(uids))  # nothing consumed twice
    seen: Counter[str] = Counter()
    for m in steps:
        for k, v in m.items():
            if k.startswith("agent/"):
                seen[k] = max(seen[k], v)
    for reason in ("unauthorized", "bad_request", "too_long", "too_large", "refused_at_close"):
        assert seen[f"agent/{reason}"] >= 1, (reason, dict(seen))
    assert seen["agent/aborted"] >= 1 or seen["agent/read_timeout"] >= 1, dict(seen)


async def test_one_rollout_keeps_training_when_the_buffer_refuses_samples(tmp_path, tiny):
    """A third of the prompts score 11, past reward.max_value: the buffer refuses those samples.
    With one rollout their groups used to stay open for good (the lease re-serves only to
    another rollout) and training stopped; now the outbox abandons each refused member, its
    group completes, and the trainer keeps stepping. The endpoint's counters reach
    metrics.jsonl (`agent/<reason>`)."""
    cfg = make_cfg(
        tmp_path,
        tiny,
        "hostile-refused",
        rows=40,
        cluster={"roles": {"manager": 1, "buffer": 1, "trainer": 1, "rollout": 0}},
        trainer={"total_steps": 8, "batch_groups": 2, "lr": 1e-3, "warmup_steps": 0},
        # a long run in small: what stuck groups hold fills the buffer's capacity within 8 steps
        buffer={"capacity": 12},
        reward={"fn": "tests.agent_fakes:out_of_range_reward", "workers": 0},
        agent={"fn": "tests.agent_fakes:scored_by_reward_fn_agent"},
    )
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=ScriptEngine(tok))
        async with aiohttp.ClientSession() as http:  # an outsider knocks: counted
            r = await http.get(f"{rollout.endpoint.url}/v1/models")
            assert r.status == 401
        await cluster.wait_trainer(timeout=60)  # ~5 s; before: stuck for good
        stats = dict(rollout.outbox.stats)
    steps = [m for m in read_jsonl(cfg.resolved_run_dir() / "metrics.jsonl") if "step" in m]
    assert len(steps) >= 8
    assert stats["refused"] >= 2 and stats["abandoned"] == stats["refused"]
    assert any(m.get("buffer/refused_trajectories", 0) >= 1 for m in steps)
    assert any(m.get("agent/unauthorized", 0) >= 1 for m in steps)
    assert all(math.isfinite(m.get("loss", 0.0)) for m in steps)


async def test_a_silent_claimed_episode_does_not_hold_the_weights(tmp_path, tiny, monkeypatch):
    """One rollout, remote agents: a hostile agent claims an episode and never calls it while
    an honest agent works the rest. The rollout wants each new version; once nothing but the
    silent episode holds the loaded one, it is preempted after agent.preempt_idle_s (not the
    120 s idle timeout): the weights load, training goes on, the silent token answers 409
    episode_preempted, and the episode is offered again at the new version and trained."""
    monkeypatch.setenv("LAMINAR_AGENT_KEY", KEY)
    cfg = _training_cfg(
        tmp_path,
        tiny,
        "hostile-silent",
        6,
        preempt_idle_s=0.5,
        idle_timeout_s=120,
        episode_timeout_s=300,
    )
    tok = load_prompt_tokenizer(tiny, chat_template=True)
    served: list[tuple[str, int]] = []  # (prompt, version) of every honest episode

    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0, engine=ScriptEngine(tok))
        base = rollout.endpoint.url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            silent = await _claim(http, base)  # claimed, then never a call
            worker = asyncio.create_task(_honest(http, rollout, served))
            try:
                await cluster.wait_trainer(timeout=90)  # stuck until idle_timeout_s before
            finally:
                worker.cancel()
                await asyncio.gather(worker, return_exceptions=True)
            chat = f"{base}/v1/chat/completions"
            user = {"role": "user", "content": silent["row"]["prompt"]}
            status, err = await _post(
                http, chat, silent["episode"], json.dumps({"messages": [user]}).encode()
            )
        counts = dict(rollout.agents.counts)
        metrics = dict(rollout.metrics.counters)
        version = rollout.gate.version
    assert status == 409 and err["error"]["code"] == "episode_preempted", err
    assert counts["episodes_preempted"] >= 1 and metrics["agent_preempted"] >= 1
    assert counts.get("idle_expired", 0) == 0 and metrics.get("agent_failures", 0) == 0
    assert version >= 1
    # the preempted prompt came back and an honest agent ran it at a later version
    again = [v for p, v in served if p == silent["row"]["prompt"]]
    assert again and max(again) >= 1
    steps = [m for m in read_jsonl(cfg.resolved_run_dir() / "metrics.jsonl") if "step" in m]
    assert len(steps) >= 6
