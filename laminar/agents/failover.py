"""An agent's HTTP client follows its episode to whichever rollout holds it.

    transport = FailoverTransport(base_url, endpoints_dir, reconnect_s)
    openai.AsyncOpenAI(base_url=..., api_key=token, http_client=httpx.AsyncClient(transport=...))

    call ──► the rollout it last reached ──► answer (most calls)
                 │ 421 episode_moved (a repack move), or the connection drops (the rollout died)
                 ▼
             every endpoint in endpoints_dir (run_dir/agents/endpoints: one file per rollout,
             its URL), again with backoff, until one answers other than 401 / 421: the rollout
             that imported the episode. It resumes the same call from the recorded tokens
             (laminar/rollout/agents.py `_resume`), so the agent's call only takes longer.

The request is repeated as it was (same body, same API key: the episode token travels with the
partial), so the agent code sees one call and one answer. A rollout that does not hold the
episode answers 401 (never issued here) or 421 (moved on); one that does not hold it *yet* (the
manager's recovery takes a few heartbeats) answers 401 too, so the search goes on until
`reconnect_s`, then the call fails as a connection error would have.

Used by the agent worker (laminar/agents/worker.py) for `agent.fn` agents; agents elsewhere can
pass it as their client's transport, or follow the protocol in docs/agents.md themselves. The
endpoints are the run's own: no proxy from the environment (trust_env off), and one TLS context
per process.
"""

from __future__ import annotations

import asyncio
import functools
import os
import ssl
import time
from pathlib import Path
from typing import Any

try:  # the HTTP library under the installed openai client (openai 3 is built on httpx2)
    import httpx2 as httpx
except ImportError:  # openai 1.x / 2.x: httpx
    import httpx  # type: ignore[no-redef]

_LOST = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""The rollout went away (kill -9: its sockets are reset); a timeout is the call's own."""


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

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        try:
            resp = await self.inner.handle_async_request(_to(request, self.origin, body))
        except _LOST:
            if not self.dir or self.lost:
                raise
        else:
            if resp.status_code != 421 or not self.dir or self.lost:
                return resp
            await resp.aread()
            await resp.aclose()
        return await self._follow(request, body)

    async def _follow(self, request: httpx.Request, body: bytes) -> httpx.Response:
        deadline = time.monotonic() + self.reconnect_s
        delay = 0.05
        while True:
            for origin in self._endpoints():
                try:
                    resp = await self.inner.handle_async_request(_to(request, origin, body))
                except _LOST:
                    continue
                if resp.status_code in (401, 421):  # not (or no longer) there
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

    def _endpoints(self) -> list[httpx.URL]:
        try:
            names = sorted(n for n in os.listdir(self.dir) if not n.startswith("."))
        except OSError:
            return []
        out = []
        for n in names:
            try:
                out.append(_origin(httpx.URL(Path(self.dir, n).read_text().strip())))
            except (OSError, httpx.InvalidURL):
                continue  # a rollout writing or removing its file
        # the one it last reached last: it is the one that moved the episode away or died
        return [o for o in out if o != self.origin] + [o for o in out if o == self.origin]

    async def aclose(self) -> None:
        await self.inner.aclose()


def http_client(transport: FailoverTransport, timeout_s: float) -> httpx.AsyncClient:
    """The client to hand `openai.AsyncOpenAI(http_client=...)`."""
    return httpx.AsyncClient(transport=transport, timeout=timeout_s, trust_env=False)


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One per process: building it loads the CA bundle (~25 ms of CPU), which per episode was
    half an agent worker's time at 64 rollouts (bench/agent_overhead.py)."""
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
