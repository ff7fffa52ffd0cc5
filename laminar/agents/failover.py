"""An agent's HTTP client follows its episode to whichever rollout holds it.

    transport = FailoverTransport(base_url, endpoints_dir, reconnect_s)
    openai.AsyncOpenAI(base_url=..., api_key=token, http_client=httpx.AsyncClient(transport=...))

    call ──► the rollout it last reached ──► answer (most calls)
                 │ 421 episode_moved (a repack move), or the connection drops (the rollout died)
                 ▼
             the search, in rounds with backoff, until a rollout answers other than 401 / 421:
             the one that imported the episode. It resumes the same call from the recorded
             tokens (laminar/rollout/agent_calls.py `_resume`), so the agent's call only takes
             longer.
               with a hint (the 421's `Laminar-Moved-To: <node id>`, a repack move): every round
                 asks that rollout (endpoints_dir/<node id>); the others only in a sweep, at
                 most every third round and 1 s apart, in case placement chose another
               without (a dropped connection, or a hint naming no endpoint): every round asks
                 every endpoint in endpoints_dir (run_dir/agents/endpoints: one file per rollout,
                 named by its node id, holding its URL), the one it last reached last

Why the hint: the manager imports a moved episode on the move's destination unless that one
refuses it, and each probe of a rollout that does not hold the episode costs that rollout a
request (answered 401). Without it a move cost about a dozen such probes at 64 rollouts; with
it, one per round until the import lands. If the import went elsewhere, the sweep finds it a
few seconds later at most (three rounds of the backoff, which stops doubling at 1 s). A hint
whose rollout refuses the connection (it died) is dropped: the search sweeps every round again.
A 421 from another rollout met during the search (the episode moved on again) may bring a
newer hint.

The request is repeated as it was (same body, same API key: the episode token travels with the
partial), so the agent code sees one call and one answer. A rollout that does not hold the
episode answers 401 (never issued here) or 421 (moved on); one that does not hold it *yet* (the
manager's recovery takes a few heartbeats) answers 401 too, so the search goes on until
`reconnect_s`, then the call fails as a connection error would have. `probes` and `searches`
count what the searches cost.

Used by the agent worker (laminar/agents/worker.py) for `agent.fn` agents (`episode_client`);
a framework that is not async (smolagents) gets a sync client sharing the episode's transport
(`blocking_client`: its calls run on the worker's loop; the framework runs in a thread); agents
elsewhere can pass it as their client's transport, or follow the protocol in docs/agents.md
themselves. The endpoints are the run's own: no proxy from the environment (trust_env off), and
one TLS context per process.
"""

from __future__ import annotations

import asyncio
import functools
import os
import ssl
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from laminar.agents import MOVED_TO

try:  # the HTTP library under the installed openai client (openai 3 is built on httpx2)
    import httpx2 as httpx
except ImportError:  # openai 1.x / 2.x: httpx
    import httpx  # type: ignore[no-redef]

_LOST = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""The rollout went away (kill -9: its sockets are reset); a timeout is the call's own."""


_SWEEP_ROUNDS = 3
_SWEEP_S = 1.0
"""With a hint, the other rollouts are asked at most every `_SWEEP_ROUNDS` rounds and
`_SWEEP_S` apart (both): a sweep costs one request per rollout."""


class FailoverTransport(httpx.AsyncBaseTransport):
    def __init__(self, base_url: str, endpoints_dir: str = "", reconnect_s: float = 30.0):
        self.inner = httpx.AsyncHTTPTransport(verify=_ssl_context(), trust_env=False)
        self.origin = _origin(httpx.URL(base_url))
        self.dir = endpoints_dir
        self.reconnect_s = reconnect_s
        self.moves = 0
        """Times a call had to find the episode on another rollout."""
        self.lost = False
        """A search found no rollout holding the episode: later calls do not search again."""
        self.searches = 0
        """Searches started (a 421 or a dropped connection), found or not."""
        self.hinted = 0
        """... of which started with a usable hint (a 421 naming a rollout with an endpoint)."""
        self.probes = 0
        """Requests the searches sent (each one asks one rollout), all searches together."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        hint = ""
        try:
            resp = await self.inner.handle_async_request(_to(request, self.origin, body))
        except _LOST:
            if not self.dir or self.lost:
                raise
        else:
            if resp.status_code != 421 or not self.dir or self.lost:
                return resp
            hint = resp.headers.get(MOVED_TO, "")
            await resp.aread()
            await resp.aclose()
        return await self._follow(request, body, hint)

    async def _follow(self, request: httpx.Request, body: bytes, hint_id: str) -> httpx.Response:
        start = time.monotonic()
        deadline = start + self.reconnect_s
        delay = 0.05
        hint = self._hint(hint_id)
        self.searches += 1
        self.hinted += hint is not None
        rounds, swept_at = 0, start  # since the last sweep (or the start)
        while True:
            now = time.monotonic()
            sweep = hint is None or (rounds >= _SWEEP_ROUNDS and now - swept_at >= _SWEEP_S)
            ask = [] if hint is None else [hint]
            if sweep:
                ask += [o for o in self._endpoints() if o != hint]
                rounds, swept_at = 0, now
            rounds += 1
            for origin in ask:
                self.probes += 1
                try:
                    resp = await self.inner.handle_async_request(_to(request, origin, body))
                except _LOST:
                    if origin == hint:  # its rollout died: look everywhere again
                        hint = None
                    continue
                if resp.status_code in (401, 421):  # not (or no longer) there
                    if resp.status_code == 421 and origin != self.origin:  # it moved on again
                        hint = self._hint(resp.headers.get(MOVED_TO, "")) or hint
                    await resp.aread()
                    await resp.aclose()
                    continue
                self.origin = origin
                self.moves += 1
                return resp
            if time.monotonic() + delay > deadline:
                self.lost = True
                raise httpx.ConnectError(
                    f"no rollout in {self.dir} holds this episode after {self.reconnect_s:g}s",
                    request=request,
                )
            # a retry backoff: the manager places the episode on its new rollout within beats
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _hint(self, node_id: str) -> httpx.URL | None:
        """The endpoint of the rollout a 421 named; None when it names none, or none with an
        endpoint file (gone, or not a node id: the header is input), or the one it came from."""
        if not node_id or node_id.startswith(".") or "/" in node_id or "\\" in node_id:
            return None
        url = self._read(node_id)
        return None if url is None or url == self.origin else url

    def _read(self, name: str) -> httpx.URL | None:
        try:
            return _origin(httpx.URL(Path(self.dir, name).read_text().strip()))
        except (OSError, httpx.InvalidURL, UnicodeDecodeError):
            return None  # a rollout writing or removing its file

    def _endpoints(self) -> list[httpx.URL]:
        try:
            names = sorted(n for n in os.listdir(self.dir) if not n.startswith("."))
        except OSError:
            return []
        out = [u for u in map(self._read, names) if u is not None]
        # the one it last reached last: it is the one that moved the episode away or died
        return [o for o in out if o != self.origin] + [o for o in out if o == self.origin]

    async def aclose(self) -> None:
        await self.inner.aclose()


def http_client(transport: FailoverTransport, timeout_s: float) -> httpx.AsyncClient:
    """The client to hand `openai.AsyncOpenAI(http_client=...)`."""
    return httpx.AsyncClient(transport=transport, timeout=timeout_s, trust_env=False)


_EPISODE_CLIENTS: weakref.WeakKeyDictionary[Any, tuple[FailoverTransport, Any]] = (
    weakref.WeakKeyDictionary()
)
"""The episode clients this process built, with their transport and timeout
(`blocking_client` finds them here)."""


def episode_client(
    base_url: str, api_key: str, transport: FailoverTransport, http: httpx.AsyncClient
) -> Any:
    """The openai.AsyncOpenAI an agent's `run(row, client)` gets: its calls go through `http`
    (`http_client(transport, ...)`); no retries of its own: a refused call is the agent's."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http)
    _EPISODE_CLIENTS[client] = (transport, http.timeout)
    return client


def blocking_client(client: Any) -> Any:
    """A sync openai.OpenAI on the episode of `client` (the one `run(row, client)` got), for a
    framework that is not async (smolagents): its calls go through the same FailoverTransport,
    run on this event loop, so run the framework in a thread (`await asyncio.to_thread(...)`);
    a call from the loop's own thread would wait on itself and is refused."""
    import openai

    got = _EPISODE_CLIENTS.get(client)
    if got is None:
        raise ValueError(
            "blocking_client takes the client Laminar handed `run(row, client)` (an agent "
            "elsewhere builds its own: openai.OpenAI(base_url=..., api_key=<episode token>))"
        )
    transport, timeout = got
    bridge = _Blocking(transport, asyncio.get_running_loop())
    http = httpx.Client(transport=bridge, timeout=timeout, trust_env=False)
    return openai.OpenAI(
        base_url=str(client.base_url), api_key=client.api_key, max_retries=0, http_client=http
    )


class _Blocking(httpx.BaseTransport):
    """A sync transport that sends each request through an async one on its event loop."""

    def __init__(self, inner: FailoverTransport, loop: asyncio.AbstractEventLoop):
        self.inner, self.loop = inner, loop
        self.loop_thread = threading.get_ident()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if threading.get_ident() == self.loop_thread:
            raise RuntimeError(
                "a blocking_client call from its event loop's thread would wait on itself: "
                "run the framework in a thread (await asyncio.to_thread(agent.run, task))"
            )
        body = request.read()
        sent = asyncio.run_coroutine_threadsafe(self._send(request, body), self.loop)
        status, headers, content = sent.result()
        return httpx.Response(status, headers=headers, content=content, request=request)

    async def _send(self, request: httpx.Request, body: bytes) -> tuple[int, Any, bytes]:
        again = httpx.Request(
            request.method,
            request.url,
            headers=request.headers,
            content=body,
            extensions=request.extensions,
        )
        resp = await self.inner.handle_async_request(again)
        try:
            content = await resp.aread()
        finally:
            await resp.aclose()
        return resp.status_code, resp.headers, content


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One per process: building it loads the CA bundle, ~22 ms of CPU, which paid per episode
    (each episode's client has its transport) was most of an agent worker's time at 64 emulated
    rollouts; with it shared a client costs ~1 ms to build."""
    return httpx.create_ssl_context()


async def close_episode(
    http: httpx.AsyncClient, base_url: str, token: str, body: dict[str, Any]
) -> str:
    """POST /laminar/v1/episodes/close through `http` (so to the rollout holding the episode).
    Returns "" or why it failed (no rollout holds it: it was started again from its prompt)."""
    url = httpx.URL(base_url).join("/laminar/v1/episodes/close")
    try:
        resp = await http.post(url, json=body, headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "" if resp.status_code == 200 else f"HTTP {resp.status_code}: {resp.text[:300]}"


def _origin(url: httpx.URL) -> httpx.URL:
    return httpx.URL(scheme=url.scheme, host=url.host, port=url.port)


def _to(request: httpx.Request, origin: httpx.URL, body: bytes) -> httpx.Request:
    url = request.url.copy_with(scheme=origin.scheme, host=origin.host, port=origin.port)
    headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"host"]
    return httpx.Request(
        request.method, url, headers=headers, content=body, extensions=request.extensions
    )
