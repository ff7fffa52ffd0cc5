"""The agent endpoint's request shapes: tool_choice and response_format become typed constraints.

    .venv/bin/python -m pytest tests/test_openai_shapes.py -q

Pure functions (laminar/rollout/openai_shapes.py): what a call asks beyond sampling is parsed
into Constraint values the driver enforces or refuses by engine (tests/test_agents.py runs that
through the endpoint); a malformed value is a 400 naming the field.
"""

from __future__ import annotations

import json

import pytest

from laminar.rollout.agent_turns import Constraint
from laminar.rollout.openai_shapes import ApiError, parse_chat

MSGS = [{"role": "user", "content": "2+2=?"}]
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]


def constraints(**body) -> tuple[Constraint, ...]:
    return parse_chat({"messages": MSGS, **body}).turn.constraints


def test_auto_none_and_text_ask_for_nothing():
    assert constraints() == ()
    assert constraints(tools=TOOLS, tool_choice="auto") == ()
    assert constraints(tools=TOOLS, tool_choice="none") == ()
    assert parse_chat({"messages": MSGS, "tools": TOOLS, "tool_choice": "none"}).turn.tools is None
    assert constraints(response_format={"type": "text"}) == ()


def test_required_named_and_json_formats_become_constraints():
    assert constraints(tools=TOOLS, tool_choice="required") == (
        Constraint("tool_choice", "required"),
    )
    named = {"type": "function", "function": {"name": "calculator"}}
    assert constraints(tools=TOOLS, tool_choice=named) == (
        Constraint("tool_choice", "function", name="calculator"),
    )
    assert constraints(response_format={"type": "json_object"}) == (
        Constraint("response_format", "json_object"),
    )
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    (c,) = constraints(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    assert c.field == "response_format" and c.kind == "json_schema"
    assert json.loads(c.schema) == schema


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
    ],
)
def test_malformed_choices_are_a_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as err:
        parse_chat({"messages": MSGS, **body})
    e = err.value
    assert e.status == 400 and e.code == "invalid_value" and e.body()["error"]["param"] == param
