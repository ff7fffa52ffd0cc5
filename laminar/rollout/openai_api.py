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
    stream: true ──driver.turn(token, ChatTurn, TurnStream) as a task; its tokens as the engine
    events bring them ──openai_stream.py──► text/event-stream chunks, then the TurnResult's end

Every /v1 call carries an episode token as its API key (`Authorization: Bearer <token>`); the
driver (laminar/rollout/agents.py) issued it (or imported it with a moved episode's partial) and
knows the episode, its version and its tokens. A moved episode's calls answer 421 here, with a
`Laminar-Moved-To: <node id>` header naming the rollout it was exported to when that is known.
Bad input and the driver's refusals are answered in the OpenAI error shape ({"error": {message,
type, param, code}}, openai_shapes.py) with a 4xx status, counted (`agent_http_error_<code>`, and
per reason in `figures()`, which rides the rollout's status: RolloutStatus.agent), and the
endpoint goes on serving. What is not supported is refused by name: n > 1, top_logprobs,
several prompts per completion, and a constraint the engine cannot enforce (tool_choice
required / a named function; response_format except on vLLM: 400 unsupported_parameter naming
the field and the engine, counted `unsupported`). With agent.check_model_name a call's `model`
must be the served name (what /v1/models lists): another is OpenAI's 404 `model_not_found`.

Hostile and careless agents (docs/agents.md "Limits and refusals"): a call's token (a claim's
key) is checked before its body is read, so a stranger costs no parsing; a body is read within
agent.read_timeout_s (408), capped at agent.max_body_bytes (413), parsed off the event loop when
large, and refused (400) when nested deeper than MAX_DEPTH or holding a lone surrogate; a
connection sends its first request's headers within agent.read_timeout_s or is closed; past
agent.max_connections open connections a new one is closed at once. A client that goes away
mid-body is counted (`aborted`), never logged as an error.

Why aiohttp: a mature asyncio HTTP server (keep-alive, request size limits, graceful
shutdown) that runs as a few tasks in the loop the node already has, so a call's handler awaits
the engine's tokens directly and heartbeats keep flowing (no thread, no second loop, no ASGI
server process). The handlers do no blocking work: a large body is parsed, and a call's large
new text tokenized (agents.py), in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError

from laminar.metrics import Metrics
from laminar.rollout.agent_turns import (
    CallRefused,
    ChatTurn,
    EpisodeMoved,
    EpisodeUnknown,
    TextTurn,
    TurnStream,
)
from laminar.rollout.agents import AgentDriver
from laminar.rollout.openai_shapes import (
    ApiError,
    Streaming,
    TokenText,
    api_error,
    bad_request,
    chat_completion,
    check_model,
    claim_body,
    model_list,
    parse_chat,
    parse_close,
    parse_completion,
    text_completion,
)
from laminar.rollout.openai_stream import DONE, ChatChunks, Decode, TextChunks, event

MAX_DEPTH = 64
"""Nesting depth of a request body's JSON (a conversation with tool arguments needs ~10); deeper
is refused before anything else reads it (Python's own recursion would fail far below 100k)."""

THREAD_BYTES = 256 << 10
"""A body larger than this is parsed and checked in a worker thread, off the event loop."""

ENDPOINT_COUNTERS = {
    "unauthorized": "no or a wrong episode token or claim key (401)",
    "bad_request": "malformed JSON, a bad field, too deep, a lone surrogate, unrenderable (400)",
    "too_large": "a body over agent.max_body_bytes (413)",
    "too_long": "new text over agent.max_text_chars, or past the context or token budget (400)",
    "prompt_mismatch": "a rewritten history whose prompt is not the episode's first call's (400)",
    "unknown_model": "a `model` other than the served one, with agent.check_model_name (404)",
    "unsupported": "a field the endpoint or this rollout's engine cannot honour: n > 1, "
    "top_logprobs, legacy functions, tool_choice required / a named function, response_format "
    "on the torch and sim engines (400 unsupported_parameter, naming the field and the engine)",
    "refused_at_close": "a close whose reward the buffer would refuse (400)",
    "read_timeout": "a body or first headers slower than agent.read_timeout_s (408 / closed)",
    "aborted": "the client went away mid-body",
    "connections_refused": "a connection past agent.max_connections (closed)",
    "conflict": "a call while another is in flight, or of an ended episode (409)",
    "moved": "a call of an episode exported to another rollout (421)",
    "preempted": "a call of an episode preempted for a weight load after agent.preempt_idle_s "
    "of silence (409)",
    "time_up": "a call that outlived agent.episode_timeout_s (504)",
    "internal": "a bug in the endpoint (500)",
    "stream_disconnected": "a streamed call's client went away before its end (the turn ran on)",
}
"""The endpoint's counters (`figures()`): refusals per reason, and streams whose client left;
with what each counts; the driver adds idle_expired, episodes_preempted, agent_failures and
agent_gave_up (AgentDriver.counts)."""

_BY_CODE = {
    "invalid_reward": "refused_at_close",
    "prompt_mismatch": "prompt_mismatch",
    "unsupported_parameter": "unsupported",
    "context_length_exceeded": "too_long",
    "incomplete_body": "aborted",
    "model_not_found": "unknown_model",
    "episode_preempted": "preempted",
}
_BY_STATUS = {
    401: "unauthorized",
    408: "read_timeout",
    409: "conflict",
    413: "too_large",
    421: "moved",
    500: "internal",
    504: "time_up",
}


@dataclass(frozen=True)
class EndpointLimits:
    """What one rollout's endpoint holds its clients to (agent.* settings)."""

    max_body_bytes: int = 4 << 20
    read_timeout_s: float = 30.0
    max_connections: int = 256
    check_model_name: bool = False
    """A call naming another `model` than the served one is refused (404 model_not_found)."""


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


def _parse(raw: bytes) -> dict[str, Any]:
    """A body as a JSON object, nested at most MAX_DEPTH deep, its strings valid UTF-8."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(f"the body nests deeper than {MAX_DEPTH}", "too_deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", "invalid_json")
    # only an escape or a non-ASCII byte can make a lone surrogate (json decodes bytes with
    # surrogatepass): the common ASCII body skips the per-string check
    texts = b"\\u" in raw or not raw.isascii()
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"the body nests deeper than {MAX_DEPTH}", "too_deep")
        items = ([*v.keys(), *v.values()] if texts else v.values()) if isinstance(v, dict) else v
        for x in items:
            if isinstance(x, dict | list):
                stack.append((x, depth + 1))
            elif texts and isinstance(x, str) and not x.isascii():
                try:
                    x.encode("utf-8")
                except UnicodeEncodeError:  # "\ud800": JSON allows it, no tokenizer does
                    raise bad_request(
                        "a string holds a lone surrogate: not text", "invalid_text"
                    ) from None
    return body


class OpenAIEndpoint:
    """The aiohttp app around an AgentDriver; `start()` binds, `close()` stops."""

    def __init__(
        self,
        driver: AgentDriver,
        *,
        model_name: str,
        token_text: TokenText,
        decode: Decode,
        host: str,
        port: int,
        limits: EndpointLimits | None = None,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ):
        self.driver, self.host, self.port = driver, host, port
        self.model_name, self.token_text, self.decode = model_name, token_text, decode
        self.limits = limits or EndpointLimits()
        self.metrics, self.log = metrics, log
        self.counts: Counter[str] = Counter()
        """Refusals per reason (ENDPOINT_COUNTERS)."""
        self.app = web.Application(
            client_max_size=self.limits.max_body_bytes, middlewares=[self._errors]
        )
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
        self._no_request_yet: set[int] = set()
        """ids of connections that have not sent a whole request head yet (each is closed at
        agent.read_timeout_s unless it did)."""
        self.url = ""
        """http://host:port once started."""

    def figures(self) -> dict[str, int]:
        """Refusals and agent failures per reason, and the rollout's `agent_*` counters (calls,
        input tokens, rewrites, retries, moves, `agent_http_error_<code>` ...: docs/agents.md
        "Counters"), since start (RolloutStatus.agent: `laminar status`, metrics.jsonl's
        `agent/<key>`)."""
        counters = {k: v for k, v in self.metrics.counters.items() if k.startswith("agent_")}
        return {k: v for k, v in {**counters, **(self.counts + self.driver.counts)}.items() if v}

    async def start(self) -> str:
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            handle_signals=False,
            keepalive_timeout=self.limits.read_timeout_s,
        )
        await self._runner.setup()
        self._guard(self._runner.server)
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        addrs = self._runner.addresses  # the bound (host, port): port 0 picks a free one
        port = addrs[0][1] if addrs else self.port
        self.url = f"http://{self.host}:{port}"
        self.log.info("agent_endpoint", url=self.url)
        return self.url

    def _guard(self, server: web.Server | None) -> None:
        """Cap the open connections and bound the wait for a request head. aiohttp has neither
        (its keepalive_timeout covers idle connections between requests only), so the server's
        connection_made hook, which every new connection calls, is wrapped here."""
        assert server is not None
        made = server.connection_made
        loop = asyncio.get_running_loop()
        cap, wait_s = self.limits.max_connections, self.limits.read_timeout_s

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            if len(server.connections) > cap:
                self.counts["connections_refused"] += 1
                # after the handler's task took its first step: closed before it, the task
                # finds its handler torn down and dies with an unretrieved AssertionError
                loop.call_soon(transport.close)
                return
            self._no_request_yet.add(id(handler))  # the timer below holds the handler: id stays
            loop.call_later(wait_s, self._expire, handler, transport)

        server.connection_made = connection_made  # type: ignore[method-assign]

    def _expire(self, handler: Any, transport: asyncio.Transport) -> None:
        if id(handler) in self._no_request_yet:
            self._no_request_yet.discard(id(handler))
            if not transport.is_closing():
                self.counts["read_timeout"] += 1
                transport.close()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _count(self, err: ApiError) -> None:
        self.metrics.count(f"agent_http_error_{err.code}")
        self.counts[_BY_CODE.get(err.code) or _BY_STATUS.get(err.status, "bad_request")] += 1

    def _refused(self, err: ApiError) -> web.Response:
        self._count(err)
        return web.json_response(err.body(), status=err.status, headers=err.headers)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self._no_request_yet.discard(id(request.protocol))
        try:
            return await handler(request)
        except (ApiError, EpisodeUnknown, EpisodeMoved, CallRefused) as exc:
            return self._refused(exc if isinstance(exc, ApiError) else api_error(exc))
        except web.HTTPException as exc:  # aiohttp's own: unknown path, body too large ...
            return self._refused(ApiError(exc.status, exc.reason, f"http_{exc.status}"))
        except Exception as exc:  # a bug here: the caller gets a 500 and this node goes on
            self.log.exception("agent_endpoint_error", path=request.path)
            err = ApiError(500, f"internal error: {type(exc).__name__}", "internal", "server_error")
            return self._refused(err)

    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            raw = await asyncio.wait_for(request.read(), self.limits.read_timeout_s)
        except TimeoutError:
            raise ApiError(
                408,
                f"the body did not arrive within {self.limits.read_timeout_s:g}s "
                "(agent.read_timeout_s)",
                "body_timeout",
            ) from None
        except (ConnectionError, ClientPayloadError, HttpProcessingError):
            # the client went away mid-body: nobody reads the answer; counted, not an error
            raise bad_request("the body ended early", "incomplete_body") from None
        if len(raw) > THREAD_BYTES:
            return await asyncio.to_thread(_parse, raw)
        return _parse(raw)

    def _checked(self, body: dict[str, Any]) -> dict[str, Any]:
        """A call's body, its `model` checked when agent.check_model_name says so."""
        if self.limits.check_model_name:
            check_model(body, self.model_name)
        return body

    def _authorized(self, request: web.Request) -> str:
        """The call's episode token, checked before its body is read."""
        token = _token(request)
        self.driver.authorize(token)
        return token

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        token = self._authorized(request)
        call = parse_chat(self._checked(await self._json(request)))
        if call.stream is not None:
            chunks = ChatChunks(
                self.model_name,
                self.decode,
                self.token_text,
                logprobs=call.logprobs,
                tools_on=call.turn.tools is not None,
            )
            return await self._streamed(request, token, call.turn, call.stream, chunks)
        turn = await self.driver.turn(token, call.turn)
        return web.json_response(chat_completion(turn, call, self.model_name, self.token_text))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        token = self._authorized(request)
        call = parse_completion(self._checked(await self._json(request)))
        if call.stream is not None:
            chunks = TextChunks(
                self.model_name, self.decode, self.token_text, logprobs=call.logprobs
            )
            return await self._streamed(request, token, call.turn, call.stream, chunks)
        turn = await self.driver.turn(token, call.turn)
        return web.json_response(text_completion(turn, call, self.model_name, self.token_text))

    async def _streamed(
        self,
        request: web.Request,
        token: str,
        turn: ChatTurn | TextTurn,
        opts: Streaming,
        chunks: ChatChunks | TextChunks,
    ) -> web.StreamResponse:
        """A streamed call: its refusals up to the first sampled token are the usual JSON
        errors (a moved episode's 421 included, so the client's failover still follows it);
        after that an error is an SSE event. A client that goes away mid-stream is counted; the
        turn runs to its end and is recorded as if answered (its episode stays consistent: a
        repeated call is matched against it like any other)."""
        stream = TurnStream()
        task = asyncio.ensure_future(self.driver.turn(token, turn, stream))
        try:
            await _first(task, stream)
            if task.done():
                task.result()  # a refusal before any token: the middleware answers it
            self.metrics.count("agent_streamed_calls")
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            try:
                await resp.prepare(request)
                await self._stream_turn(resp, task, stream, opts, chunks)
            except ConnectionError:  # the client went away: nobody reads the rest
                await _settled(task)  # counted once its turn ended: the episode is free again
                self.counts["stream_disconnected"] += 1
                self.metrics.count("agent_stream_disconnects")
                self.log.info("agent_stream_disconnected", path=request.path)
            return resp
        except asyncio.CancelledError:
            task.cancel()  # as an unstreamed call's turn is, when its handler is cancelled
            raise

    async def _stream_turn(
        self,
        resp: web.StreamResponse,
        task: asyncio.Future[Any],
        stream: TurnStream,
        opts: Streaming,
        chunks: ChatChunks | TextChunks,
    ) -> None:
        started = False
        while True:
            ids, lps = stream.take()
            if len(ids):
                if not started:
                    chunks.turn_id = stream.turn_id
                out = ([] if started else chunks.start()) + chunks.tokens(ids, lps)
                started = True
                await resp.write(b"".join(event(c) for c in out))
            if task.done():
                break
            await _first(task, stream)
        try:
            result = task.result()
        except (ApiError, EpisodeUnknown, EpisodeMoved, CallRefused) as exc:
            err = exc if isinstance(exc, ApiError) else api_error(exc)
            self._count(err)
            await resp.write(event(err.body()))
            return
        except Exception as exc:  # a bug here: the caller gets an error event, this node goes on
            self.log.exception("agent_endpoint_error", path="stream")
            err = ApiError(500, f"internal error: {type(exc).__name__}", "internal", "server_error")
            self._count(err)
            await resp.write(event(err.body()))
            return
        chunks.turn_id = result.turn_id
        out = ([] if started else chunks.start()) + chunks.end(result, opts.include_usage)
        if chunks.mismatch:
            self.metrics.count("agent_stream_text_mismatch")
        await resp.write(b"".join(event(c) for c in out) + DONE)
        await resp.write_eof()

    async def _models(self, request: web.Request) -> web.Response:
        self._authorized(request)
        return web.json_response(model_list(self.model_name))

    async def _claim(self, request: web.Request) -> web.Response:
        key = _token(request)
        self.driver.check_claim_key(key)
        try:
            wait_s = min(30.0, max(0.0, float(request.query.get("wait_s", "10"))))
        except ValueError:
            raise bad_request("`wait_s` must be a number", "invalid_value") from None
        got = await self.driver.claim(key, wait_s)
        if got is None:
            return web.Response(status=204)
        return web.json_response(claim_body(got))

    async def _close(self, request: web.Request) -> web.Response:
        token = self._authorized(request)
        reward, error = parse_close(await self._json(request))
        self.driver.close_episode(token, reward, error)
        return web.json_response({"ok": True})


async def _first(task: asyncio.Future[Any], stream: TurnStream) -> None:
    """Until the turn ends or the stream has tokens to take (the turn's own deadline bounds
    it: agent.episode_timeout_s)."""
    if task.done() or stream.wake.is_set():
        return
    woke = asyncio.ensure_future(stream.wake.wait())
    try:
        await asyncio.wait([task, woke], return_when=asyncio.FIRST_COMPLETED)
    finally:
        woke.cancel()


async def _settled(task: asyncio.Future[Any]) -> None:
    """The turn of a call whose client left, run to its end; its refusal has no reader."""
    try:
        await task
    except (ApiError, EpisodeUnknown, EpisodeMoved, CallRefused):
        pass
