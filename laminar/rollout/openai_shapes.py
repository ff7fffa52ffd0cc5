"""The agent endpoint's wire shapes: OpenAI request bodies in, typed turns out, and back.

    request body ──parse_chat / parse_completion──► ChatCall / TextCall (a ChatTurn / TextTurn for
                                                    the driver, whether to list logprobs, and
                                                    whether to stream: openai_stream.py)
                 ──check_model──► ApiError 404 unless `model` is the served name (when checked)
    TurnResult ──chat_completion / text_completion──► chat.completion / text_completion body
                                                      (usage, logprobs)
    EpisodeUnknown / EpisodeMoved / CallRefused ──api_error──► ApiError: status, headers and the
                                                               OpenAI error body

Pure functions and types: no I/O, no episode state. The HTTP server is openai_api.py; the
driver's turn types are agent_turns.py. What is not supported is refused by name: n > 1,
top_logprobs, legacy functions, several prompts per completion, echo / suffix / best_of.
`tool_choice` (required, a named function) and `response_format` (json_object, json_schema)
become typed Constraints on the ChatTurn: the driver enforces them through an engine that can
(Engine.structured) or refuses them naming the field and the engine.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from laminar.agents import MOVED_TO
from laminar.rollout.agent_turns import (
    CallRefused,
    ChatTurn,
    Constraint,
    EpisodeClaim,
    EpisodeMoved,
    EpisodeUnknown,
    Refusal,
    Sampling,
    TextTurn,
    TurnResult,
)

INVALID = "invalid_request_error"
"""The OpenAI error type of a bad request."""


class ApiError(Exception):
    """An HTTP error in the OpenAI error shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        kind: str = INVALID,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind
        self.headers = headers or {}
        """Extra response headers (a moved episode's `Laminar-Moved-To`)."""
        self.param = param
        """The request field at fault, when one is."""

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return {"error": err}


def bad_request(message: str, code: str = "invalid_request", param: str | None = None) -> ApiError:
    return ApiError(400, message, code, param=param)


# A refused call's (status, code, type).
_REFUSALS: dict[Refusal, tuple[int, str, str]] = {
    Refusal.IN_FLIGHT: (409, "call_in_flight", INVALID),
    Refusal.MAX_CALLS: (400, "max_calls_exceeded", INVALID),
    Refusal.TOO_LONG: (400, "context_length_exceeded", INVALID),
    Refusal.BAD_MESSAGES: (400, "invalid_messages", INVALID),
    Refusal.ENDED: (409, "episode_closed", INVALID),
    Refusal.TIME_UP: (504, "timeout", "server_error"),
    Refusal.NOT_CLOSABLE: (409, "closed", INVALID),
    Refusal.BAD_CLAIM_KEY: (401, "invalid_api_key", INVALID),
    Refusal.BAD_REWARD: (400, "invalid_reward", INVALID),
    Refusal.PROMPT_MISMATCH: (400, "prompt_mismatch", INVALID),
    Refusal.TEXT_TOO_LONG: (400, "context_length_exceeded", INVALID),
    Refusal.PREEMPTED: (409, "episode_preempted", INVALID),
    Refusal.UNSUPPORTED: (400, "unsupported_parameter", INVALID),
}


def api_error(exc: EpisodeUnknown | EpisodeMoved | CallRefused) -> ApiError:
    """The driver's refusal as the endpoint answers it."""
    if isinstance(exc, EpisodeUnknown):
        return ApiError(
            401,
            "unknown or closed episode: the API key is not a live episode token",
            "invalid_api_key",
            "authentication_error",
        )
    if isinstance(exc, EpisodeMoved):
        dest = exc.dest
        return ApiError(
            421,
            "this episode moved to another rollout: repeat the call on the one that holds it "
            f"({'likely ' + dest + '; ' if dest else ''}run_dir/agents/endpoints lists them)",
            "episode_moved",
            headers={MOVED_TO: dest} if dest else None,
        )
    status, code, kind = _REFUSALS[exc.reason]
    return ApiError(status, str(exc), code, kind, param=exc.param)


# ---- requests ------------------------------------------------------------------------------
_REFUSED = {
    "n": "n > 1 is not supported: one call is one sample of its episode",
    "top_logprobs": "top_logprobs is not supported (logprobs: true gives each token's)",
    "functions": "legacy `functions` is not supported: use `tools`",
}


@dataclass(frozen=True)
class Streaming:
    """A call's `stream: true` and its `stream_options`."""

    include_usage: bool = False
    """A last chunk carries the usage."""


@dataclass(frozen=True)
class ChatCall:
    """A checked /v1/chat/completions body."""

    turn: ChatTurn
    logprobs: bool
    """List each sampled token's logprob in the reply."""
    stream: Streaming | None = None
    """Answer as server-sent chunks (openai_stream.py)."""


@dataclass(frozen=True)
class TextCall:
    """A checked /v1/completions body."""

    turn: TextTurn
    logprobs: bool
    """List each sampled token's logprob in the reply."""
    stream: Streaming | None = None
    """Answer as server-sent chunks (openai_stream.py)."""


def _num(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise bad_request(f"`{key}` must be a number", "invalid_value")
    if not lo <= v <= hi:
        raise bad_request(f"`{key}` must be in [{lo}, {hi}]", "invalid_value")
    return float(v)


def parse_params(body: dict[str, Any]) -> tuple[Sampling, bool]:
    """The sampling knobs of a call, checked, and whether it asks for logprobs."""
    allowed: dict[str, tuple[Any, ...]] = {
        "n": (None, 1),
        "top_logprobs": (None, 0),
        "functions": (None,),
    }
    for key, why in _REFUSED.items():
        v = body.get(key)
        if isinstance(v, bool) or v not in allowed[key]:
            raise bad_request(why, "unsupported_parameter")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None and (
        isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt < 1 << 31
    ):
        raise bad_request("`max_tokens` must be a positive integer below 2**31", "invalid_value")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = tuple(stop)
    else:
        raise bad_request("`stop` must be a string or a list of at most 4 strings", "invalid_value")
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool | int):
        raise bad_request("`logprobs` must be a boolean", "invalid_value")
    sampling = Sampling(
        max_tokens=mt,
        temperature=_num(body, "temperature", 0.0, 2.0),
        top_p=_num(body, "top_p", 0.0, 1.0),
        stop=tuple(s for s in stops if s),
    )
    return sampling, bool(lp)


def parse_stream(body: dict[str, Any]) -> Streaming | None:
    """`stream` and `stream_options` (None: an unstreamed call; options without `stream: true`
    are ignored, as clients that set them always send them)."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean", "invalid_value")
    if not stream:
        return None
    opts = body.get("stream_options")
    if opts is None:
        return Streaming()
    usage = opts.get("include_usage") if isinstance(opts, dict) else None
    if not isinstance(opts, dict) or not isinstance(usage, bool | None):
        raise bad_request(
            "`stream_options` must be an object; its `include_usage` a boolean", "invalid_value"
        )
    return Streaming(include_usage=bool(usage))


def parse_chat(body: dict[str, Any]) -> ChatCall:
    """A /v1/chat/completions body: messages, tools, tool_choice and the sampling knobs."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("`messages` must be a non-empty list", "invalid_messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("`tools` must be a list", "invalid_value")
    sampling, logprobs = parse_params(body)
    tools_on = bool(tools) and body.get("tool_choice") != "none"
    constraints = (*_response_format(body), *_tool_choice(body, tools or []))
    turn = ChatTurn(msgs, tools if tools_on else None, sampling, constraints)
    return ChatCall(turn, logprobs, parse_stream(body))


def _response_format(body: dict[str, Any]) -> tuple[Constraint, ...]:
    """`response_format`: text (none), json_object, or json_schema with its schema."""
    rf = body.get("response_format")
    if rf is None:
        return ()
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return ()
    if kind == "json_object":
        return (Constraint("response_format", "json_object"),)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "`response_format.json_schema.schema` must be a JSON schema object",
                "invalid_value",
                "response_format",
            )
        return (Constraint("response_format", "json_schema", schema=json.dumps(schema)),)
    raise bad_request(
        "`response_format.type` must be text, json_object or json_schema",
        "invalid_value",
        "response_format",
    )


def _tool_choice(body: dict[str, Any], tools: list[Any]) -> tuple[Constraint, ...]:
    """`tool_choice`: auto / none (no constraint), required, or one named function."""
    tc = body.get("tool_choice")
    if tc is None or tc in ("auto", "none"):
        return ()
    if tc == "required":
        if not tools:
            raise bad_request(
                "tool_choice `required` needs `tools`", "invalid_value", "tool_choice"
            )
        return (Constraint("tool_choice", "required"),)
    fn = tc.get("function") if isinstance(tc, dict) and tc.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request(
            '`tool_choice` must be "auto", "none", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "invalid_value",
            "tool_choice",
        )
    return (Constraint("tool_choice", "function", name=name),)


def check_model(body: dict[str, Any], served: str) -> None:
    """A call's `model`, when it names one, is the one this endpoint serves (agent.model_name,
    else the run's name): OpenAI's 404 otherwise."""
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(
            404,
            f"The model `{str(model)[:200]}` does not exist: this endpoint serves `{served}` "
            "(GET /v1/models; agent.check_model_name)",
            "model_not_found",
        )


def parse_completion(body: dict[str, Any]) -> TextCall:
    """A /v1/completions body: one prompt string and the sampling knobs."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("`prompt` must be one non-empty string", "invalid_value")
    for key in ("echo", "suffix", "best_of"):
        if body.get(key) not in (None, False, 1):
            raise bad_request(f"`{key}` is not supported", "unsupported_parameter")
    sampling, logprobs = parse_params(body)
    return TextCall(TextTurn(prompt, sampling), logprobs, parse_stream(body))


def parse_close(body: dict[str, Any]) -> tuple[Any, str | None]:
    """A /laminar/v1/episodes/close body: (the reward, the agent's error or None)."""
    error = body.get("error")
    return body.get("reward"), str(error)[:2000] if error else None


# ---- replies -------------------------------------------------------------------------------
TokenText = Callable[[int], str]
"""One token id as text, special tokens included (ChatRenderer.token_text)."""


def usage(turn: TurnResult) -> dict[str, int]:
    completion = len(turn.ids)
    return {
        "prompt_tokens": turn.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": turn.prompt_tokens + completion,
    }


def finish_reason(turn: TurnResult) -> str:
    return "length" if turn.reason == "length" else "stop"


def chat_completion(
    turn: TurnResult, call: ChatCall, model: str, token_text: TokenText
) -> dict[str, Any]:
    """The chat.completion body of a chat turn."""
    logprobs = None
    if call.logprobs:
        content = []
        for i, lp in zip(turn.ids.tolist(), turn.logprobs.tolist(), strict=True):
            tok = token_text(i)
            content.append(
                {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
            )
        logprobs = {"content": content}
    return {
        "id": f"chatcmpl-{turn.turn_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": turn.message,
                "finish_reason": "tool_calls" if turn.tool_called else finish_reason(turn),
                "logprobs": logprobs,
            }
        ],
        "usage": usage(turn),
    }


def text_completion(
    turn: TurnResult, call: TextCall, model: str, token_text: TokenText
) -> dict[str, Any]:
    """The text_completion body of a text turn."""
    lp = None
    if call.logprobs:
        toks = [token_text(int(i)) for i in turn.ids]
        lp = {
            "tokens": toks,
            "token_logprobs": [float(x) for x in turn.logprobs],
            "top_logprobs": None,
            "text_offset": list(np.cumsum([0] + [len(t) for t in toks[:-1]]).tolist()),
        }
    return {
        "id": f"cmpl-{turn.turn_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "text": turn.text, "finish_reason": finish_reason(turn), "logprobs": lp}
        ],
        "usage": usage(turn),
    }


def model_list(model: str) -> dict[str, Any]:
    """The /v1/models body: the one model this rollout serves."""
    entry = {"id": model, "object": "model", "created": 0, "owned_by": "laminar"}
    return {"object": "list", "data": [entry]}


def claim_body(claim: EpisodeClaim) -> dict[str, Any]:
    """A /laminar/v1/episodes/claim reply: the episode's token and what its agent runs on."""
    return {
        "episode": claim.token,
        "row": claim.row,
        "base_url": claim.base_url,
        "timeout_s": claim.timeout_s,
    }
