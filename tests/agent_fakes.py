"""Fakes for the black-box agent tests: an engine that writes scripted text, and test agents.

ScriptEngine writes, per sequence and turn, the text a tool-using policy would write on the
tool demo's task (laminar/tasks/tooluse.py): a hard prompt's turn 0 is the calculator call,
turn 1 the answer; an easy prompt's turn 0 is the answer. Whether an answer is right depends
on a hash of the sequence id, so GRPO groups hold both outcomes. Every token it makes is
recorded with its logprob (`emitted[(uid, turn)]`), so a test can compare trajectories with
what the engine really sampled.

The agents run in agent worker processes (laminar/agents/worker.py): what they see is written
to files named by environment variables the test sets before the rollout starts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import zlib
from typing import Any

from laminar.engines.base import GenRequest
from laminar.tasks import tooluse
from tests.fake_engine import FakeEngine


def script(uid: str, prompt: str, turn: int) -> str:
    right = hashlib.sha256(uid.encode()).digest()[0] % 2 == 0  # (crc32's low bit is linear)
    task = re.search(r"\d\d[*+]\d+=\?", prompt)
    if task is None:
        return "#0"
    prompt = task.group(0)
    answer = tooluse.answer_of(prompt) + (0 if right else 1)
    if "*" in prompt and turn == 0:
        return tooluse.tool_call_text(tooluse.expression(prompt))
    return f"#{answer}"


class ScriptEngine(FakeEngine):
    name = "script"

    def __init__(
        self,
        tokenizer: Any,
        step_s: float = 0.002,
        hold: float = 0.0,
        hold_at: int = 0,
        hold_turn: int | None = None,
    ):
        super().__init__(step_s, turns=True)
        self.tok = tokenizer
        self.hold = hold
        """Seconds each turn's token `hold_at` is held back (a call in flight, for fault tests)."""
        self.hold_at, self.hold_turn = hold_at, hold_turn
        """... of turn `hold_turn` only (None: every turn)."""
        self.emitted: dict[tuple[str, int], tuple[list[int], list[float]]] = {}

    def submit(self, req: GenRequest) -> None:
        super().submit(req)
        prompt = self.tok.decode(req.prompt_ids.tolist(), skip_special_tokens=True)
        for sid in req.seq_ids():
            s = self.running[sid]
            ids = self.tok(script(sid, prompt, req.turn), add_special_tokens=False)["input_ids"]
            text = script(sid, prompt, req.turn)
            s["script"] = list(ids) + ([] if text.endswith("</tool_call>") else [2])  # <eos>
            s["end"] = s["start"] + len(s["script"])
            s["stop"] = tuple(req.params.stop)
            s["t0"] = asyncio.get_running_loop().time()
            self.emitted[(sid, req.turn)] = ([], [])  # a new run of the episode starts afresh

    def _token(self, sid: str, s: dict[str, Any]) -> tuple[int, float] | None:
        i = len(s["ids"])
        held = self.hold_turn is None or s["turn"] == self.hold_turn
        now = asyncio.get_running_loop().time()
        if held and i == s["start"] + self.hold_at and now - s["t0"] < self.hold:
            return None
        tok = int(s["script"][i - s["start"]])
        lp = -0.01 * (i + 1) - 0.001 * (zlib.crc32(sid.encode()) % 7)
        got = self.emitted.setdefault((sid, s["turn"]), ([], []))
        got[0].append(tok)
        got[1].append(lp)
        return tok, lp


def _log(var: str, record: dict[str, Any]) -> None:
    path = os.environ.get(var)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def effect(call_id: str, expression: str) -> str:
    """A side-effecting calculator: each run appends its call id (the test checks: once each)."""
    _log("AGENT_TEST_EFFECTS", {"call_id": call_id})
    return str(tooluse.answer_of(expression + "=?"))


async def tool_agent(row: dict[str, Any], client: Any, system: str = "", wrap: str = "") -> float:
    """The calculator agent through the official client; logs what each call returned. As agents
    are written: `system` adds a system message, `wrap` puts the task after the agent's own words
    (e.g. "New task:\n"), both in its first call (agent.kwargs)."""
    return await _tool_loop(row, lambda msgs, tools: _plain_call(client, msgs, tools), system, wrap)


async def streaming_tool_agent(
    row: dict[str, Any], client: Any, system: str = "", wrap: str = ""
) -> float:
    """The same agent with `stream=True`; a stream cut by its episode's move (an error event
    `episode_moved`) is repeated once, as a client that retries would (the client's failover
    finds the rollout holding the episode, which resumes the call)."""
    import openai

    async def call(msgs: list[Any], tools: Any) -> tuple[str, dict[str, Any], list, list, str]:
        for attempt in range(3):
            try:
                return await _streamed_call(client, msgs, tools)
            except openai.APIError as exc:
                if exc.code != "episode_moved" or attempt == 2:
                    raise
                _log("AGENT_TEST_CALLS", {"stream_cut": exc.code})
        raise AssertionError("unreachable")

    return await _tool_loop(row, call, system, wrap)


async def _plain_call(client: Any, msgs: list[Any], tools: Any) -> tuple[str, Any, list, list, str]:
    resp = await client.chat.completions.create(
        model="policy", messages=msgs, tools=tools, logprobs=True
    )
    ch = resp.choices[0]
    toks = [t.token for t in ch.logprobs.content]
    return resp.id, ch.message, toks, [t.logprob for t in ch.logprobs.content], ch.finish_reason


async def _streamed_call(
    client: Any, msgs: list[Any], tools: Any
) -> tuple[str, dict[str, Any], list, list, str]:
    stream = await client.chat.completions.create(
        model="policy", messages=msgs, tools=tools, logprobs=True, stream=True
    )
    cid, content, toks, lps, finish = "", "", [], [], ""
    calls: dict[int, dict[str, Any]] = {}
    async for chunk in stream:
        cid = chunk.id
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for t in ch.logprobs.content if ch.logprobs else []:
                toks.append(t.token)
                lps.append(t.logprob)
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(
                    d.index,
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                c["id"] += d.id or ""
                if d.function is not None:
                    c["function"]["name"] += d.function.name or ""
                    c["function"]["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    msg: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
    return cid, msg, toks, lps, finish


async def _tool_loop(row: dict[str, Any], call: Any, system: str = "", wrap: str = "") -> float:
    from laminar.demo.tooldemo.agent import TOOLS

    messages: list[Any] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": wrap + row["prompt"]})
    text = ""
    for _ in range(4):
        cid, msg, toks, lps, finish = await call(messages, TOOLS)
        _log("AGENT_TEST_CALLS", {"id": cid, "tokens": toks, "logprobs": lps, "finish": finish})
        messages.append(msg)
        tool_calls = msg.get("tool_calls") if isinstance(msg, dict) else msg.tool_calls
        if not tool_calls:
            text = (msg["content"] if isinstance(msg, dict) else msg.content) or ""
            break
        for tc in tool_calls:
            tc_id = tc["id"] if isinstance(tc, dict) else tc.id
            fn = tc["function"] if isinstance(tc, dict) else tc.function.model_dump()
            args = json.loads(fn["arguments"])
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": tc_id,
                    "content": effect(tc_id, args["expression"]),
                }
            )
    return float(text.strip() == f"#{row['answer']}")


async def crashing_agent(row: dict[str, Any], client: Any) -> float:
    """Calls once, then kills its own worker process on the first attempt of each episode."""
    resp = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}]
    )
    key = resp.id.rsplit("-", 2)[0]  # chatcmpl-<uid>: the episode, whatever the attempt
    marker = os.path.join(os.environ["AGENT_TEST_DIR"], key.replace("/", "_"))
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), 9)
    return 1.0 if zlib.crc32(resp.id.encode()) % 2 else 0.0


async def rewriting_agent(row: dict[str, Any], client: Any) -> float:
    """Two calls; then a rewrite that replaces the history with a summary, refused (400
    prompt_mismatch: the buffer trains a sample only with its served prompt); then one that
    starts again from the row's message: that last run is trained."""
    import openai

    msgs: list[Any] = [{"role": "user", "content": row["prompt"]}]
    r1 = await client.chat.completions.create(model="p", messages=msgs)
    msgs += [r1.choices[0].message, {"role": "user", "content": "again"}]
    await client.chat.completions.create(model="p", messages=msgs)
    summary = [{"role": "user", "content": "summary " + row["prompt"]}]
    try:
        await client.chat.completions.create(model="p", messages=summary)
    except openai.BadRequestError as exc:
        _log("AGENT_TEST_CALLS", {"refused": exc.code})
    r3 = await client.chat.completions.create(model="p", messages=msgs[:1])
    _log("AGENT_TEST_CALLS", {"id": r3.id, "text": r3.choices[0].message.content})
    return 0.5


async def endless_agent(row: dict[str, Any], client: Any) -> float:
    """Calls until the endpoint refuses (the episode's token budget), and raises as most agents
    would: the refusal propagates out of the agent."""
    messages: list[Any] = [{"role": "user", "content": str(row["prompt"])}]
    for k in range(1000):
        resp = await client.chat.completions.create(model="sim", messages=messages)
        messages += [resp.choices[0].message, {"role": "user", "content": f"again {k}"}]
    return 1.0


async def three_call_agent(row: dict[str, Any], client: Any) -> float:
    """Three calls, each adding a user message; logs each call's start and its answer (with this
    worker's pid and its rollout's, the parent) to AGENT_TEST_CALLS; a failed call too."""
    import time

    from laminar.agents.sim import episode_uid

    messages: list[Any] = [{"role": "user", "content": str(row["prompt"])}]
    uid, me = "", {"pid": os.getpid(), "ppid": os.getppid()}
    for k in range(3):
        t0 = time.time()
        _log("AGENT_TEST_CALLS", {"event": "start", "uid": uid, "k": k, "t": t0, **me})
        try:
            resp = await client.chat.completions.create(
                model="sim", messages=messages, logprobs=True
            )
        except Exception as exc:
            why = {"error": repr(exc), "t": time.time()}
            _log("AGENT_TEST_CALLS", {"event": "error", "uid": uid, "k": k, **why, **me})
            raise
        uid = episode_uid(resp.id)
        ch = resp.choices[0]
        lps = [t.logprob for t in ch.logprobs.content]
        end = {"event": "end", "uid": uid, "k": k, "t0": t0, "t": time.time(), "id": resp.id}
        end["logprobs"] = lps
        _log("AGENT_TEST_CALLS", {**end, **me})
        messages += [ch.message, {"role": "user", "content": f"go on {k}"}]
    return float(zlib.crc32(uid.encode()) % 2)


async def _hold_pool() -> None:
    """A stand-in rollout: an AgentPool with episodes in flight on an endpoint that never
    answers; prints the worker pids, then waits to be killed (tests/test_agents.py)."""
    import socket

    import structlog

    from laminar.rollout.agent_pool import AgentPool
    from laminar.supervise import detached_spawn

    pool = AgentPool(
        "tests.agent_fakes:tool_agent",
        workers=2,
        concurrency=2,
        hello_timeout_s=60,
        spawn=detached_spawn,
        log=structlog.get_logger(),
    )
    await pool.start()
    silent = socket.socket()  # accepts connections (the backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
    req = {"base_url": url, "api_key": "k", "row": {"prompt": "47*86=?"}, "timeout_s": 300}
    calls = [asyncio.ensure_future(pool.run(req, 300)) for _ in range(4)]
    print(" ".join(map(str, pool.pids())), flush=True)
    await asyncio.gather(*calls)


if __name__ == "__main__":
    asyncio.run(_hold_pool())


async def scored_by_reward_fn_agent(row: dict[str, Any], client: Any) -> None:
    """One call with the row's prompt; the reward is left to reward.fn (returns None)."""
    await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": row["prompt"]}]
    )


def out_of_range_reward(prompt: str, completion: str, **row: Any) -> Any:
    """tooluse's reward, but 11 (past reward.max_value 10) for about a third of the prompts:
    the buffer refuses those samples."""
    if zlib.crc32(prompt.encode()) % 3 == 0:
        return 11.0
    return tooluse.reward(prompt, completion, **row)
