"""The rollout's OpenAI-compatible HTTP endpoint (aiohttp, in the rollout node's event loop).

    POST /v1/chat/completions     messages, tools, tool_choice, temperature, top_p, max_tokens /
                                  max_completion_tokens, stop, logprobs  -> chat.completion
    POST /v1/completions          prompt (one string), the same knobs     -> text_completion
    GET  /v1/models               the one model this rollout serves
    POST /laminar/v1/episodes/claim?wait_s=S   agents elsewhere take an episode (docs/agents.md)
    POST /laminar/v1/episodes/close            ... and end it with a reward

Every /v1 call carries an episode token as its API key (`Authorization: Bearer <token>`); the
driver (laminar/rollout/agents.py) issued it (or imported it with a moved episode's partial) and
knows the episode, its version and its tokens. A moved episode's calls answer 421 here, with a
`Laminar-Moved-To: <node id>` header naming the rollout it was exported to when that is known.
Bad input is answered in the OpenAI error shape ({"error": {message, type, param, code}}) with
a 4xx status, counted (`agent_http_error_<code>`), and the endpoint goes on serving. What is
not supported is refused by name: stream, n > 1, top_logprobs, several prompts per completion.

Why aiohttp: a mature asyncio HTTP server (keep-alive, request size limits, graceful
shutdown) that runs as a few tasks in the loop the node already has, so a call's handler awaits
the engine's tokens directly and heartbeats keep flowing (no thread, no second loop, no ASGI
server process). The handlers do no blocking work but tokenizing a call's new messages.
"""

from __future__ import annotations

import json
import math
from typing import Any

import structlog
from aiohttp import web

from laminar.metrics import Metrics
from laminar.rollout.agents import AgentDriver, ApiError, CallParams

MAX_BODY = 32 << 20
"""Largest request body (a long conversation with tool outputs)."""

_REFUSED = {
    "n": "n > 1 is not supported: one call is one sample of its episode",
    "stream": "stream is not supported",
    "top_logprobs": "top_logprobs is not supported (logprobs: true gives each token's)",
    "functions": "legacy `functions` is not supported: use `tools`",
}


def _bad(message: str, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code)


def _num(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _bad(f"`{key}` must be a number", "invalid_value")
    if not lo <= v <= hi:
        raise _bad(f"`{key}` must be in [{lo}, {hi}]", "invalid_value")
    return float(v)


def parse_params(body: dict[str, Any]) -> CallParams:
    """The sampling knobs of a call, checked."""
    allowed: dict[str, tuple[Any, ...]] = {
        "n": (None, 1),
        "stream": (None, False),
        "top_logprobs": (None, 0),
        "functions": (None,),
    }
    for key, why in _REFUSED.items():
        v = body.get(key)
        if isinstance(v, bool) and key != "stream" or v not in allowed[key]:
            raise _bad(why, "unsupported_parameter")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
        raise _bad("`max_tokens` must be a positive integer", "invalid_value")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = tuple(stop)
    else:
        raise _bad("`stop` must be a string or a list of at most 4 strings", "invalid_value")
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool | int):
        raise _bad("`logprobs` must be a boolean", "invalid_value")
    return CallParams(
        max_tokens=mt,
        temperature=_num(body, "temperature", 0.0, 2.0),
        top_p=_num(body, "top_p", 0.0, 1.0),
        stop=tuple(s for s in stops if s),
        logprobs=bool(lp),
    )


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
        raise _bad(f"the body is not JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object", "invalid_json")
    return body


class OpenAIEndpoint:
    """The aiohttp app around an AgentDriver; `start()` binds, `close()` stops."""

    def __init__(
        self,
        driver: AgentDriver,
        *,
        host: str,
        port: int,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ):
        self.driver, self.host, self.port = driver, host, port
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
        except ApiError as exc:
            self.metrics.count(f"agent_http_error_{exc.code}")
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
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
        body = await _json(request)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("`messages` must be a non-empty list", "invalid_messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise _bad("`tools` must be a list", "invalid_value")
        params = parse_params(body)
        return web.json_response(await self.driver.chat(token, body, params))

    async def _completions(self, request: web.Request) -> web.Response:
        token = _token(request)
        body = await _json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _bad("`prompt` must be one non-empty string", "invalid_value")
        for key in ("echo", "suffix", "best_of"):
            if body.get(key) not in (None, False, 1):
                raise _bad(f"`{key}` is not supported", "unsupported_parameter")
        params = parse_params(body)
        return web.json_response(await self.driver.completion(token, prompt, params))

    async def _models(self, request: web.Request) -> web.Response:
        self.driver._episode(_token(request))
        model = {
            "id": self.driver.s.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "laminar",
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _claim(self, request: web.Request) -> web.Response:
        key = _token(request)
        try:
            wait_s = min(30.0, max(0.0, float(request.query.get("wait_s", "10"))))
        except ValueError:
            raise _bad("`wait_s` must be a number", "invalid_value") from None
        got = await self.driver.claim(key, wait_s)
        if got is None:
            return web.Response(status=204)
        return web.json_response(got)

    async def _close(self, request: web.Request) -> web.Response:
        token = _token(request)
        self.driver.close_episode(token, await _json(request))
        return web.json_response({"ok": True})
