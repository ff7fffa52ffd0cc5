"""Tool calls as chat models write them, and tool results as they read them.

    calls, errors = parse_tool_calls(model_text)     # ParsedCall(index, name, arguments) in order
    bodies = tool_messages(items)           # one tool-role message body per call
    text = format_tool_response(bodies)     # the plain rendering: <tool_response>..</tool_response>

The format is the Hermes / Qwen one that chat models are trained on:

    <tool_call>{"name": "calculator", "arguments": {"expression": "47*86"}}</tool_call>

One or more blocks per turn. Accepted as well: "parameters" for the arguments key,
arguments given as a JSON string that holds an object, and no arguments at all ({}).
A last block without its closing tag is parsed too (an engine that strips its stop
string from the text hands over `<tool_call>{...}` alone).

Anything wrong with a block (malformed JSON, no name, arguments that are not an
object) becomes a `ParseError` at the block's position, which the environment turns
into an error observation: bad input from the model never raises. Text outside the
blocks is ignored.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from laminar.envs.base import ToolResult

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


@dataclass(frozen=True)
class ParsedCall:
    index: int
    """Position of the block among this turn's <tool_call> blocks (0-based)."""
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParseError:
    index: int
    """Position of the bad block among this turn's <tool_call> blocks."""
    message: str


def _blocks(text: str) -> list[str]:
    out: list[str] = []
    pos = 0
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        if end < 0:  # the last block, its closing tag stripped (or never written)
            out.append(text[body_start:])
            break
        out.append(text[body_start:end])
        pos = end + len(CALL_CLOSE)
    return out


def _parse_block(index: int, body: str) -> ParsedCall | ParseError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ParseError(index, f"tool call is not valid JSON ({exc.msg} at char {exc.pos})")
    if not isinstance(obj, dict):
        return ParseError(index, f"tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ParseError(index, 'tool call has no "name" (a non-empty string)')
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ParseError(
                index, f"tool call {name!r}: arguments string is not JSON ({exc.msg})"
            )
    if not isinstance(args, dict):
        return ParseError(
            index, f"tool call {name!r}: arguments must be a JSON object, got {type(args).__name__}"
        )
    return ParsedCall(index, name.strip(), args)


def parse_tool_calls(text: str) -> tuple[list[ParsedCall], list[ParseError]]:
    """Every <tool_call> block of one model turn: the good ones and the bad ones, in order."""
    calls: list[ParsedCall] = []
    errors: list[ParseError] = []
    for i, body in enumerate(_blocks(text)):
        item = _parse_block(i, body.strip())
        (calls if isinstance(item, ParsedCall) else errors).append(item)  # type: ignore[arg-type]
    return calls, errors


def tool_message(item: ToolResult | str) -> str:
    """The body of one tool-role message: a result's output, or "error: ..." (a str is an error)."""
    if isinstance(item, str):
        return f"error: {item}"
    if item.ok:
        return item.output
    why = item.error or item.error_kind or "tool call failed"
    return f"{item.output}\nerror: {why}" if item.output else f"error: {why}"


def tool_messages(items: Sequence[ToolResult | str]) -> list[str]:
    return [tool_message(x) for x in items]


def format_tool_response(bodies: Sequence[str]) -> str:
    """The plain rendering of one tool turn (no chat template): one <tool_response> block per
    call."""
    return "\n".join(f"{RESPONSE_OPEN}{b}{RESPONSE_CLOSE}" for b in bodies)
