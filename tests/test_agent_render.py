"""Chat messages to an episode's tokens (laminar/agents/render.py): the chat-template path with
tools, the plain path of the tiny tokenizer, tool calls parsed back, what counts as the same
message.

    .venv/bin/python -m pytest tests/test_agent_render.py -q
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from laminar.agents.render import BadMessages, ChatRenderer, canonical
from laminar.models.tiny import char_tokenizer
from laminar.tasks import tooluse
from tests.test_envs import ALPHABET, CHATML

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
WITH_TOOLS = (
    r"{%- if tools -%}{{ '<|im_start|>system\nTools: ' + (tools | tojson) + '<|im_end|>\n' }}"
    r"{%- endif -%}" + CHATML
)


def chat_tokenizer() -> Any:
    tok = char_tokenizer(ALPHABET + "|_")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = WITH_TOOLS
    return tok


def enc(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_chat_template_renders_tools_and_the_delta_drifts_nothing() -> None:
    tok = chat_tokenizer()
    r = ChatRenderer(tok)
    assert r.chat and r.stop_strings(True) == ()
    user = {"role": "user", "content": "47*86=?"}
    first = r.first_ids([user], TOOLS)
    assert "Tools: " in tok.decode(first) and "calculator" in tok.decode(first)
    call_text = tooluse.tool_call_text("47*86")
    model = enc(tok, call_text) + r.turns.eot_ids  # the model sampled its end of turn
    msg, called = r.assistant_message(tok.decode(model, skip_special_tokens=True), True, "u", 0)
    assert called and msg["content"] is None
    (tc,) = msg["tool_calls"]
    assert tc["function"]["name"] == "calculator"
    assert json.loads(tc["function"]["arguments"]) == {"expression": "47*86"}
    tool = {"role": "tool", "tool_call_id": tc["id"], "content": "4042"}
    delta = r.delta_ids([tool], after_eot=True)
    # what the template writes for the whole conversation, with the model's text as its turn
    whole = tok.apply_chat_template(
        [user, {"role": "assistant", "content": call_text}, tool],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert first + model + delta == enc(tok, whole)
    # the model cut at a stop string (no end of turn sampled): the delta writes it
    assert r.delta_ids([tool], after_eot=False)[: len(r.turns.eot_ids)] == r.turns.eot_ids


def test_plain_format_matches_the_tool_env_transcript() -> None:
    tok = char_tokenizer(tooluse.ALPHABET)
    r = ChatRenderer(tok)
    assert not r.chat and r.stop_strings(True) == ("</tool_call>",)
    first = r.first_ids([{"role": "user", "content": "47*86=?"}], TOOLS)
    assert first == [tok.bos_token_id] + enc(tok, "47*86=?")  # what the buffer serves
    delta = r.delta_ids([{"role": "tool", "content": "4042"}], after_eot=False)
    assert tok.decode(delta) == tooluse.tool_response_text("4042")
    # a run of each role, in order (UTF-8 bytes as ids without a tokenizer: the char tokenizer
    # has no token for "\n\n")
    raw = ChatRenderer(None)
    two = raw.delta_ids(
        [{"role": "tool", "content": "1"}, {"role": "user", "content": "go"}], False
    )
    assert bytes(two).decode() == "\n<tool_response>1</tool_response>\n" + "\ngo\n"


def test_the_same_message_whatever_the_client_echoes() -> None:
    ours = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        ],
    }
    echoed = {
        "role": "assistant",
        "content": "",
        "refusal": None,
        "tool_calls": [{"id": "y", "function": {"name": "f", "arguments": '{"a":1}'}}],
    }
    assert canonical(ours) == canonical(echoed)
    other = {**echoed, "tool_calls": [{"function": {"name": "f", "arguments": '{"a":2}'}}]}
    assert canonical(ours) != canonical(other)
    for bad in ({"content": "x"}, {"role": "robot"}, {"role": "user", "content": 3}, "hi"):
        with pytest.raises(BadMessages):
            canonical(bad)
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    assert canonical(parts) == canonical({"role": "user", "content": "ab"})
