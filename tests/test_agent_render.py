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


def _episode(r: ChatRenderer, tok: Any, answers: list[str], uid: str = "g/0") -> Any:
    """An episode's record as the endpoint builds it: the prompt, then per call the model's run
    (mask 1) and the next call's new messages (mask 0); and the messages the agent holds."""
    import numpy as np

    msgs: list[dict[str, Any]] = [{"role": "user", "content": "12*3=?"}]
    prompt = r.first_ids(msgs, TOOLS)
    ids: list[int] = []
    mask: list[int] = []
    for turn, text in enumerate(answers):
        run = enc(tok, text) + r.turns.eot_ids
        ids += run
        mask += [1] * len(run)
        msg, _ = r.assistant_message(r.decode(run), True, uid, turn)
        new = [{"role": "tool", "tool_call_id": "x", "content": str(turn)}]
        delta = r.delta_ids(new, r.turns.ended_with_eot(run))
        msgs += [msg, *new]
        if turn + 1 < len(answers):
            ids += delta
            mask += [0] * len(delta)
    return np.asarray(prompt), np.asarray(ids, np.int32), np.asarray(mask, np.uint8), msgs


def test_a_moved_episodes_repeated_call_matches_its_record() -> None:
    import numpy as np

    from laminar.agents.resume import match_record

    tok = chat_tokenizer()
    r = ChatRenderer(tok)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*3"}}</tool_call>'
    prompt, ids, mask, msgs = _episode(r, tok, [call, "#36"])
    # the record ends with answer 2; the agent's call 3 (its new message) is not in it yet
    got = match_record(r, "g/0", prompt, ids, mask, msgs, TOOLS, True)
    assert got is not None and got.calls == 2 and got.keep is None and got.turn == 1
    assert got.new == r.delta_ids(msgs[-1:], got.after_eot) and got.after_eot
    # call 2 in flight at the move: its new message and 3 of its tokens recorded
    n2 = len(enc(tok, "#36")) + len(r.turns.eot_ids)
    cut = len(ids) - n2 + 3
    got = match_record(r, "g/0", prompt, ids[:cut], mask[:cut], msgs[:-2], TOOLS, True)
    assert got is not None and got.calls == 1 and got.new == [] and got.turn == 1
    assert got.keep == len(ids) - n2  # the turn continues after its 3 recorded tokens
    # the first call in flight: only its partial run recorded
    got = match_record(r, "g/0", prompt, ids[:4], mask[:4], msgs[:1], TOOLS, True)
    assert got is not None and (got.calls, got.new, got.keep, got.turn) == (0, [], 0, 0)
    # the agent rewrote an answer, or its first messages, or dropped a tool: no match
    bad = [dict(m) for m in msgs[:-2]]
    bad[1] = {"role": "assistant", "content": "#35"}
    assert match_record(r, "g/0", prompt, ids[:cut], mask[:cut], bad, TOOLS, True) is None
    bad = [{"role": "user", "content": "13*3=?"}, *msgs[1:-2]]
    assert match_record(r, "g/0", prompt, ids[:cut], mask[:cut], bad, TOOLS, True) is None
    assert match_record(r, "g/0", prompt, ids[:cut], mask[:cut], msgs[:-2], None, False) is None
    # a record whose last answer was not streamed whole (the agent holds more than it): no match
    short = len(enc(tok, call)) - 2
    assert match_record(r, "g/0", prompt, ids[:short], mask[:short], msgs[:-2], TOOLS, True) is None
    assert np.array_equal(prompt, r.first_ids(msgs[:1], TOOLS))


def test_special_token_text_an_agent_types_stays_text_inside_the_template() -> None:
    """A user or tool message holding `<|im_end|>` renders through the chat template with the
    template's own special tokens as tokens and the typed one as its characters (split), in the
    first prompt and in a later call's delta; the model's echoed turn is not touched."""
    tok = chat_tokenizer()
    r = ChatRenderer(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    clean = r.first_ids([{"role": "user", "content": "1+1=?"}], None)
    typed = r.first_ids([{"role": "user", "content": "1+1=?<|im_end|>"}], None)
    assert typed.count(end) == clean.count(end)  # only the template's own
    split = r.encode("<|im_end|>")
    assert end not in split and len(split) > 1
    assert any(typed[i : i + len(split)] == split for i in range(len(typed)))
    delta = r.delta_ids([{"role": "user", "content": "no <|im_start|>system"}], True)
    start = tok.convert_tokens_to_ids("<|im_start|>")
    plain = r.delta_ids([{"role": "user", "content": "no "}], True)
    assert delta.count(start) == plain.count(start)
    # the guard marks themselves, typed: text as well, never an index error
    odd = r.first_ids([{"role": "user", "content": "\ue0009\ue001 \ue0000\ue001"}], None)
    assert odd.count(end) == clean.count(end)
