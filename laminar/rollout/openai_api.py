"""The rollout's OpenAI-compatible HTTP endpoint (aiohttp, in the rollout node's event loop).

    POST /v1/chat/completions     messages, tools, tool_choice, temperature, top_p, max_tokens /
                                  max_completion_tokens, stop, logprobs  -> chat.completion
    POST /v1/completions          prompt (one string), the same knobs     -> text_completion
    GET  /v1/models               the one model this rollout serves
    POST /laminar/v1/episodes/claim?wait_s=S   agents elsewhere take an episode (docs/agents.md)
    POST /laminar/v1/episodes/close            ... and end it with a reward

One call goes down and back up:

    handler ──openai_shapes.parse_chat(body)──► ChatCall ──driver.turn(token, ChatTurn)──► engine
    response ◄──openai_shapes.chat_completion(TurnResult)──┘

Every /v1 call carries an episode token as its API key (`Authorization: Bearer <token>`); the
driver (laminar/rollout/agents.py) issued it (or imported it with a moved episode's partial) and
knows the episode, its version and its tokens. A moved episode's calls answer 421 here, with a
`Laminar-Moved-To: <node id>` header naming the rollout it was exported to when that is known.
Bad input and the driver's refusals are answered in the OpenAI error shape ({"error": {message,
type, param, code}}, openai_shapes.py) with a 4xx status, counted (`agent_http_error_<code>`),
and the endpoint goes on serving. What is not supported is refused by name: stream, n > 1,
top_logprobs, several prompts per completion.

Why aiohttp: a mature asyncio HTTP server (keep-alive, request size limits, graceful
shutdown) that runs as a few tasks in the loop the node already has, so a call's handler awaits
the engine's tokens directly and heartbeats keep flowing (no thread, no second loop, no ASGI
server process). The handlers do no blocking work but tokenizing a call's new messages.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from aiohttp import web

from laminar.metrics import Metrics
from laminar.rollout.agent_turns import CallRefused, EpisodeMoved, EpisodeUnknown
from laminar.rollout.agents import AgentDriver
from laminar.rollout.openai_shapes import (
    ApiError,
    TokenText,
    api_error,
    bad_request,
    chat_completion,
    claim_body,
    model_list,
    parse_chat,
    parse_close,
    parse_completion,
    text_completion,
)

MAX_BODY = 32 << 20
"""Largest request body (a long conversation with tool outputs)."""


def _token(request: web.Request) -> str:
    auth = request.headers.get("Authorization", "")
    if not auth.startswith("Bearer ") or not auth[7:].strip():
        raise ApiError(
            401,
            "no API key: send the episode token as `Authorization: Bearer <token>`",
            "invalid_api_key",
            "authentication_error",
        )
    return auth[7:].strip()


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", "invalid_json")
    return body


class OpenAIEndpoint:
    """The aiohttp app around an AgentDriver; `start()` binds, `close()` stops."""

    def __init__(
        self,
        driver: AgentDriver,
        *,
        model_name: str,
        token_text: TokenText,
        host: str,
        port: int,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ):
        self.driver, self.host, self.port = driver, host, port
        self.model_name, self.token_text = model_name, token_text
        self.metrics, self.log = metrics, log
        self.app = web.Application(client_max_size=MAX_BODY, middlewares=[self._errors])
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._completions),
                web.get("/v1/models", self._models),
                web.post("/laminar/v1/episodes/claim", self._claim),
                web.post("/laminar/v1/episodes/close", self._close),
            ]
        )
        self._runner: web.AppRunner | None = None
        self.url = ""
        """http://host:port once started."""

    async def start(self) -> str:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        addrs = self._runner.addresses  # the bound (host, port): port 0 picks a free one
        port = addrs[0][1] if addrs else self.port
        self.url = f"http://{self.host}:{port}"
        self.log.info("agent_endpoint", url=self.url)
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except (ApiError, EpisodeUnknown, EpisodeMoved, CallRefused) as exc:
            err = exc if isinstance(exc, ApiError) else api_error(exc)
            self.metrics.count(f"agent_http_error_{err.code}")
            return web.json_response(err.body(), status=err.status, headers=err.headers)
        except web.HTTPException as exc:  # aiohttp's own: unknown path, body too large ...
            self.metrics.count(f"agent_http_error_{exc.status}")
            err = ApiError(exc.status, exc.reason, f"http_{exc.status}")
            return web.json_response(err.body(), status=exc.status)
        except Exception as exc:  # a bug here: the caller gets a 500 and this node goes on
            self.metrics.count("agent_http_error_internal")
            self.log.exception("agent_endpoint_error", path=request.path)
            err = ApiError(500, f"internal error: {type(exc).__name__}", "internal", "server_error")
            return web.json_response(err.body(), status=500)

    async def _chat(self, request: web.Request) -> web.Response:
        token = _token(request)
        call = parse_chat(await _json(request))
        turn = await self.driver.turn(token, call.turn)
        return web.json_response(chat_completion(turn, call, self.model_name, self.token_text))

    async def _completions(self, request: web.Request) -> web.Response:
        token = _token(request)
        call = parse_completion(await _json(request))
        turn = await self.driver.turn(token, call.turn)
        return web.json_response(text_completion(turn, call, self.model_name, self.token_text))

    async def _models(self, request: web.Request) -> web.Response:
        self.driver.authorize(_token(request))
        return web.json_response(model_list(self.model_name))

    async def _claim(self, request: web.Request) -> web.Response:
        key = _token(request)
        try:
            wait_s = min(30.0, max(0.0, float(request.query.get("wait_s", "10"))))
        except ValueError:
            raise bad_request("`wait_s` must be a number", "invalid_value") from None
        try:
            got = await self.driver.claim(key, wait_s)
        except CallRefused:
            # counted here and once more by _errors (as the driver and _errors each did before
            # the shapes left the driver)
            self.metrics.count("agent_http_error_invalid_api_key")
            raise
        if got is None:
            return web.Response(status=204)
        return web.json_response(claim_body(got))

    async def _close(self, request: web.Request) -> web.Response:
        token = _token(request)
        reward, error = parse_close(await _json(request))
        self.driver.close_episode(token, reward, error)
        return web.json_response({"ok": True})
