"""laminar/envs: tool-call parsing, turn templates (no drift), ToolEnv, the loader, replay,
adapters.

.venv/bin/python -m pytest -q tests/test_envs.py
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from typing import Any

import pytest

from laminar.config import EnvConfig
from laminar.envs.base import Environment, StepContext, StepResult, ToolResult
from laminar.envs.loader import EnvSpecError, load_env
from laminar.envs.replay import Segment, replay, split_segments
from laminar.envs.template import TurnTemplate
from laminar.envs.tool_env import ToolEnv
from laminar.envs.toolcall import format_tool_response, parse_tool_calls, tool_message
from laminar.models.tiny import char_tokenizer

ALPHABET = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    " \n+-*/=?#<>_{}[]():,.\"'!%&|^~;@$`\\"
)


def _base(cid: str) -> str:
    """A call id without its digest of (name, arguments): uid#t<turn>#c<k>."""
    return "#".join(cid.split("#")[:3])


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# ---- parser ---------------------------------------------------------------------------------


def test_parse_one_and_two_calls() -> None:
    calls, errors = parse_tool_calls("let me see " + call("calculator", expression="47*86"))
    assert errors == [] and [(c.index, c.name, c.arguments) for c in calls] == [
        (0, "calculator", {"expression": "47*86"})
    ]
    text = call("calculator", expression="1+2") + " and " + call("python", code="print(3)")
    calls, errors = parse_tool_calls(text)
    assert errors == [] and [(c.index, c.name) for c in calls] == [(0, "calculator"), (1, "python")]
    assert parse_tool_calls("#4042") == ([], [])


def test_parse_variants_and_errors() -> None:
    text = (
        '<tool_call>{"name": "calculator", "parameters": {"expression": "2*3"}}</tool_call>'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>'
        '<tool_call>{"name": "noargs"}</tool_call>'
        # the last one's stop string was stripped
        '<tool_call>{"name": "calculator", "arguments": {"expression": "9"}}'
    )
    calls, errors = parse_tool_calls(text)
    assert [(c.index, c.name, c.arguments) for c in calls] == [
        (0, "calculator", {"expression": "2*3"}),
        (1, "python", {"code": "1"}),
        (5, "noargs", {}),
        (6, "calculator", {"expression": "9"}),
    ]
    assert [e.index for e in errors] == [2, 3, 4]
    assert "not valid JSON" in errors[0].message
    assert 'no "name"' in errors[1].message
    assert "must be a JSON object" in errors[2].message


def test_tool_messages_format() -> None:
    ok = ToolResult("u#t0#c0", "calculator", ok=True, output="4042")
    bad = ToolResult("u#t0#c1", "python", ok=False, error="boom", error_kind="crash")
    assert tool_message(ok) == "4042" and tool_message(bad) == "error: boom"
    assert tool_message("not JSON") == "error: not JSON"
    assert format_tool_response(["a", "b"]) == (
        "<tool_response>a</tool_response>\n<tool_response>b</tool_response>"
    )


# ---- templates ------------------------------------------------------------------------------

CHATML = (
    r"{%- for m in messages -%}"
    r"{%- if m.role == 'tool' -%}"
    r"{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    r"{{ '<|im_start|>user' }}{%- endif -%}"
    r"{{ '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    r"{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    r"{{ '<|im_end|>\n' }}{%- endif -%}"
    r"{%- else -%}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif -%}"
    r"{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def chat_tokenizer() -> Any:
    """A hand-made HF tokenizer with a ChatML-style chat template (tool role like Qwen2.5)."""
    tok = char_tokenizer(ALPHABET)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def enc(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_chat_template_renders_as_expected() -> None:
    tok = chat_tokenizer()
    text = tok.apply_chat_template(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "A"},
            {"role": "tool", "content": "1"},
            {"role": "tool", "content": "2"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("sampled_eot", [False, True])
@pytest.mark.parametrize(
    "role,obs", [("tool", ["4042"]), ("tool", ["1", "error: x"]), ("user", ["are you sure?"])]
)
def test_chat_template_no_drift(sampled_eot: bool, role: str, obs: list[str]) -> None:
    """prompt + model ids + observation ids + model ids == the template's whole conversation."""
    tok = chat_tokenizer()
    tt = TurnTemplate(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tt.turn_end == "<|im_end|>\n" and tt.eot_ids == [im_end]
    user = {"role": "user", "content": "47*86=?"}
    a1, a2 = call("calculator", expression="47*86"), "#4042"
    prompt = enc(tok, tok.apply_chat_template([user], tokenize=False, add_generation_prompt=True))
    model1 = enc(tok, a1) + ([im_end] if sampled_eot else [])  # EOS, or the stop string
    assert tt.ended_with_eot(model1) == sampled_eot
    assert tt.ends_turn(model1, ToolEnv.stop)
    env_ids = tt.observation_ids(obs, role, after_eot=tt.ended_with_eot(model1))
    model2 = enc(tok, a2) + [im_end]
    conv = [user, {"role": "assistant", "content": a1}]
    conv += [{"role": role, "content": o} for o in obs] + [{"role": "assistant", "content": a2}]
    whole = enc(tok, tok.apply_chat_template(conv, tokenize=False))
    ours = prompt + model1 + env_ids + model2
    assert ours == whole[: len(ours)] and tok.decode(whole[len(ours) :]) == "\n"
    assert tt.decode(model1) == a1  # the environment reads the model's text, specials skipped
    if not sampled_eot:
        assert tok.decode(env_ids).startswith("<|im_end|>")


def test_chat_template_with_system_message() -> None:
    tok = chat_tokenizer()
    tt = TurnTemplate(tok, system="you may call tools")
    assert tok.decode(tt.observation_ids("5", "tool", after_eot=True)) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_plain_template_tiny_tokenizer() -> None:
    tok = char_tokenizer(ALPHABET)
    assert not tok.chat_template
    tt = TurnTemplate(tok)
    assert tt.turn_end == "" and tt.eot_ids == []
    ids = tt.observation_ids(["4042"], "tool")
    assert tok.decode(ids) == "\n<tool_response>4042</tool_response>\n"
    assert ids == enc(tok, "\n<tool_response>4042</tool_response>\n")
    assert tt.observation_text(["1", "2"], "tool") == (
        "\n<tool_response>1</tool_response>\n<tool_response>2</tool_response>\n"
    )
    assert tt.observation_text("again?", "user") == "\nagain?\n"
    # the default demo alphabet has no '<' '_': those characters become <unk>
    small = char_tokenizer()
    unk = small.convert_tokens_to_ids("<unk>")
    assert unk in TurnTemplate(small).observation_ids("7", "tool")
    # turn ends: the stop string or EOS
    assert tt.ends_turn(enc(tok, call("calculator", expression="1")), ToolEnv.stop)
    assert tt.ends_turn(enc(tok, "#5") + [tok.eos_token_id])
    assert not tt.ends_turn(enc(tok, "<tool_call>{"), ToolEnv.stop)


def test_no_tokenizer_is_bytes() -> None:
    tt = TurnTemplate(None)
    ids = tt.observation_ids("ok", "tool")
    assert bytes(ids) == b"\n<tool_response>ok</tool_response>\n"
    assert tt.decode(ids) == "\n<tool_response>ok</tool_response>\n"


# ---- ToolEnv --------------------------------------------------------------------------------


class FakeTools:
    """A ToolClient with a cache by call id: each id runs once; a repeat is answered cached."""

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.cache: dict[str, ToolResult] = {}
        self.gate: dict[str, asyncio.Event] = {}

    async def call(
        self, call_id: str, name: str, arguments: dict[str, Any], timeout_s: float = 0.0
    ) -> ToolResult:
        if call_id in self.cache:
            r = self.cache[call_id]
            return ToolResult(r.call_id, r.name, r.ok, r.output, r.error, r.error_kind, 0.0, True)
        gate = self.gate.get(_base(call_id))
        if gate is not None:  # holds this call until a later one releases it
            await asyncio.wait_for(gate.wait(), 5)
        self.runs.append(call_id)
        if name == "calculator":
            try:
                res = ToolResult(call_id, name, ok=True, output=str(eval(arguments["expression"])))
            except Exception as exc:
                res = ToolResult(call_id, name, ok=False, error=str(exc), error_kind="bad_call")
        else:
            res = ToolResult(call_id, name, ok=True, output=f"ran {arguments}")
        self.cache[call_id] = res
        for ev in self.gate.values():
            ev.set()
        return res


def ctx(tools: Any, turn: int = 0, so_far: int = 0, max_calls: int = 8) -> StepContext:
    return StepContext(
        uid="g/0",
        turn=turn,
        tools=tools,
        tool_calls_so_far=so_far,
        max_tool_calls=max_calls,
        timeout_s=5.0,
    )


async def test_tool_env_answer_ends_episode() -> None:
    env = ToolEnv(tools=["calculator"])
    state = env.reset({}, "1+2=?")
    res = await env.step(state, ctx(FakeTools()), "#3")
    assert res.done and res.tool_results == [] and state["answer"] == "#3" and state["turns"] == 1


async def test_tool_env_runs_calls_in_order() -> None:
    env, tools = ToolEnv(tools=["calculator", "python"]), FakeTools()
    tools.gate["g/0#t2#c0"] = asyncio.Event()  # the first call finishes after the second
    state = env.reset({}, "")
    text = call("calculator", expression="6*7") + call("python", code="x") + "<tool_call>{bad"
    res = await env.step(state, ctx(tools, turn=2), text)
    assert not res.done and res.role == "tool"
    assert [_base(c) for c in tools.runs] == [
        "g/0#t2#c1",
        "g/0#t2#c0",
    ]  # ran concurrently, finished out of order
    assert [_base(r.call_id) for r in res.tool_results] == ["g/0#t2#c0", "g/0#t2#c1", "g/0#t2#c2"]
    assert res.observation is not None
    assert res.observation[:2] == ["42", "ran {'code': 'x'}"]
    assert res.observation[2].startswith("error: tool call is not valid JSON")
    assert res.tool_results[2].error_kind == "bad_call"
    assert state["tool_calls"] == 3 and state["history"][0]["turn"] == 2


async def test_tool_env_limit_unknown_and_unavailable() -> None:
    env, tools = ToolEnv(tools=["calculator"]), FakeTools()
    state = env.reset({}, "")
    text = call("calculator", expression="1") + call("calculator", expression="2") + call("sh", c=1)
    res = await env.step(state, ctx(tools, so_far=7, max_calls=8), text)
    assert [_base(c) for c in tools.runs] == ["g/0#t0#c0"] and len(res.tool_results) == 1
    assert res.observation == ["1"] + ["error: tool call limit reached (max_tool_calls=8)"] * 2
    res = await env.step(state, ctx(tools, turn=1), call("sh", c=1))
    assert res.tool_results[0].error_kind == "unknown_tool"
    assert isinstance(res.observation, list) and "unknown tool 'sh'" in res.observation[0]
    res = await env.step(state, ctx(None, turn=2), call("calculator", expression="1"))
    assert not res.done and res.tool_results[0].error_kind == "unavailable"
    assert res.observation == ["error: tools are not available (no tools node)"]
    assert "calculator" in env.system_prompt() and "<tool_call>" in env.system_prompt()


# ---- loader ---------------------------------------------------------------------------------


def test_load_env(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_env(EnvConfig()) is None
    env = load_env(EnvConfig(fn="laminar.envs.tool_env:ToolEnv", kwargs={"tools": ["calculator"]}))
    assert isinstance(env, ToolEnv) and env.tools == ("calculator",)
    (tmp_path / "my_envs.py").write_text(
        textwrap.dedent("""\
        from laminar.envs.tool_env import ToolEnv
        def make(n=1):
            return ToolEnv(tools=["calculator"] * n)
        def not_env():
            return 3
        class Plain:
            pass
        VALUE = 1
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(load_env(EnvConfig(fn="my_envs:make", kwargs={"n": 2})), ToolEnv)
    bad = {
        "my_envs": "must look like",
        "nope_mod_xyz:Env": "cannot import module",
        "my_envs:Missing": "has no 'Missing'",
        "my_envs:Plain": "does not subclass",
        "my_envs:not_env": "not an Environment",
        "my_envs:VALUE": "not a class or function",
    }
    for spec, why in bad.items():
        with pytest.raises(EnvSpecError, match=why):
            load_env(EnvConfig(fn=spec))
    with pytest.raises(EnvSpecError, match="does not accept env.kwargs"):
        load_env(EnvConfig(fn="my_envs:make", kwargs={"m": 2}))


# ---- replay ---------------------------------------------------------------------------------


def test_split_segments() -> None:
    assert split_segments([], None) == []
    assert split_segments([5, 6], None) == [Segment("model", 0, 2)]
    segs = split_segments([1, 2, 3, 4, 5, 6], [1, 1, 0, 0, 0, 1])
    assert segs == [Segment("model", 0, 2), Segment("env", 2, 5), Segment("model", 5, 6)]
    with pytest.raises(ValueError, match="loss mask"):
        split_segments([1, 2], [1])


async def record_episode(
    env: Environment, tt: TurnTemplate, tools: FakeTools, turns: list[list[int]]
) -> tuple[Any, list[int], list[int]]:
    """Drive an episode the way a rollout does: model ids, step, observation ids (mask 0)."""
    state = env.reset({"answer": "4046"}, "47*86+4=?")
    ids: list[int] = []
    mask: list[int] = []
    so_far = 0
    for turn, model_ids in enumerate(turns):
        ids += model_ids
        mask += [1] * len(model_ids)
        if turn == len(turns) - 1:
            break
        res: StepResult = await env.step(state, ctx(tools, turn, so_far), tt.decode(model_ids))
        so_far += len(res.tool_results)
        obs = tt.observation_ids(res.observation or [], res.role, tt.ended_with_eot(model_ids))
        ids += obs
        mask += [0] * len(obs)
    return state, ids, mask


async def test_replay_rebuilds_state_from_cache() -> None:
    tok = char_tokenizer(ALPHABET)
    tt, env, tools = TurnTemplate(tok), ToolEnv(tools=["calculator"]), FakeTools()
    turns = [
        enc(tok, call("calculator", expression="47*86")),
        enc(tok, call("calculator", expression="4042+4")),
        enc(tok, "#40"),
    ]
    state, ids, mask = await record_episode(env, tt, tools, turns)
    assert [_base(c) for c in tools.runs] == ["g/0#t0#c0", "g/0#t1#c0"]

    def ctx_for(turn: int, so_far: int) -> StepContext:
        return ctx(tools, turn, so_far)

    rep = await replay(env, {"answer": "4046"}, "47*86+4=?", ids, mask, tt, ctx_for)
    assert [_base(c) for c in tools.runs] == [
        "g/0#t0#c0",
        "g/0#t1#c0",
    ]  # nothing ran twice: the cache answered
    assert rep.state == state and rep.turns_done == 2 and rep.tool_calls == 2
    assert rep.mismatches == 0 and not rep.last_turn_complete  # "#40": cut mid-turn
    assert [(_base(r.call_id), r.turn, r.cached) for r in rep.tool_records] == [
        ("g/0#t0#c0", 0, True),
        ("g/0#t1#c0", 1, True),
    ]
    # the last model run ended its turn (stop string): its step must still run
    done_turns = turns[:2]
    _, ids2, mask2 = await record_episode(env, tt, FakeTools(), done_turns)
    rep2 = await replay(env, {}, "", ids2, mask2, tt, ctx_for)
    assert rep2.last_turn_complete and rep2.turns_done == 1
    # a tampered env token is a mismatch; the state is still rebuilt
    env_at = mask.index(0) + 5
    ids[env_at] = tok.convert_tokens_to_ids("9")
    rep3 = await replay(env, {}, "", ids, mask, tt, ctx_for)
    assert rep3.mismatches == 1 and rep3.state == state


async def test_replay_with_chat_template_and_eot() -> None:
    tok = chat_tokenizer()
    tt, env, tools = TurnTemplate(tok), ToolEnv(tools=["calculator"]), FakeTools()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = [enc(tok, call("calculator", expression="3*3")) + [im_end], enc(tok, "#9") + [im_end]]
    state, ids, mask = await record_episode(env, tt, tools, turns)
    rep = await replay(env, {}, "", ids, mask, tt, lambda t, n: ctx(tools, t, n))
    assert rep.mismatches == 0 and rep.state == state and rep.last_turn_complete


# ---- reasoning-gym adapter ------------------------------------------------------------------


def test_reasoning_gym_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from laminar.envs.adapters import reasoning_gym as adapter

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if not installed
    adapter._generator.cache_clear()
    with pytest.raises(adapter.ReasoningGymMissing, match="pip install reasoning-gym"):
        adapter.write_dataset("leg_counting", tmp_path / "rg.jsonl", size=2)
    with pytest.raises(adapter.ReasoningGymMissing, match="pip install reasoning-gym"):
        adapter.reward("q", "<answer>1</answer>", answer="1", rg_dataset="leg_counting")
    assert adapter.reward("q", "1") is None  # not a reasoning-gym row: not applicable


def test_reasoning_gym_dataset_and_reward(tmp_path: Any) -> None:
    pytest.importorskip("reasoning_gym")
    from laminar.envs.adapters import reasoning_gym as adapter

    adapter._generator.cache_clear()
    path = adapter.write_dataset("basic_arithmetic", tmp_path / "rg.jsonl", size=4, seed=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4 and len({r["uid"] for r in rows}) == 4
    for row in rows:
        assert row["prompt"].startswith(row["question"]) and "<answer>" in row["prompt"]
        extra = {k: v for k, v in row.items() if k not in ("prompt", "uid")}
        good = f"thinking... <answer>{row['answer']}</answer>"
        assert adapter.reward(row["prompt"], good, **extra) == 1.0
        assert adapter.reward(row["prompt"], "<answer>nonsense</answer>", **extra) == 0.0
        assert adapter.reward(row["prompt"], "no tags", **extra) == 0.0


# ---- the docs' bring-your-own example (docs/environments.md, linked from the README) -------


async def test_docs_environment_example() -> None:
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / "docs/environments.md"
    code = doc.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    ns: dict[str, Any] = {}
    exec(compile(code, "docs/environments.md", "exec"), ns)
    env = ns["GuessEnv"](max_guesses=3)
    state = env.reset({"answer": "7"}, "guess 0..9")
    steps = [
        await env.step(state, ctx(None, t), text)
        for t, text in enumerate(["hmm", "<guess>3</guess>", "<guess>7</guess>"])
    ]
    assert [(s.observation, s.done) for s in steps] == [
        ("Write <guess>N</guess>.", False),
        ("higher", False),
        (None, True),
    ]
    assert await env.score(state, ctx(None)) == 1.0


def test_chat_template_without_tool_role() -> None:
    tok = chat_tokenizer()
    tok.chat_template = (
        r"{%- for m in messages -%}"
        r"{%- if m.role not in ['system', 'user', 'assistant'] -%}"
        r"{{ raise_exception('roles must be system, user or assistant') }}{%- endif -%}"
        r"{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
        r"{%- endfor -%}"
        r"{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
    )
    tt = TurnTemplate(tok)
    assert tt.tool_as_user
    assert tt.observation_text(["1", "2"], "tool", after_eot=True) == (
        "\n<|im_start|>user\n<tool_response>1</tool_response>\n"
        "<tool_response>2</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
