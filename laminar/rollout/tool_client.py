"""The rollout's client of the tools node: what an environment step calls
(laminar.envs.base.ToolClient) when the tools run on the tools role.

    tools = RemoteToolClient(node.client(tools_endpoint), call_timeout_s)
    res = await tools.call(ctx.call_id(0), "python", {"code": "2**100"}, timeout_s=5.0)

It never raises for a failed call: a lost or late reply becomes ToolResult(ok=False,
error_kind="unreachable" | "timeout"), an observation the model reads, so one tool never ends an
episode by exception. A retried request keeps its call id, and the tools node answers a repeat
from its cache, so retries are safe for side-effecting tools too.
"""

from __future__ import annotations

from typing import Any

from laminar.envs.base import ToolResult
from laminar.protocol.tools import ToolCallReply, ToolCallRequest
from laminar.transport.client import RpcClient
from laminar.transport.sockets import RemoteError, RequestTimeout, TransportError


def result_of(name: str, rep: ToolCallReply) -> ToolResult:
    return ToolResult(
        call_id=rep.call_id,
        name=name,
        ok=rep.ok,
        output=rep.output,
        error=rep.error,
        error_kind=rep.error_kind,
        seconds=rep.seconds,
        cached=rep.cached,
        truncated=rep.truncated,
    )


class RemoteToolClient:
    """ToolClient over the transport to the tools node."""

    def __init__(self, client: RpcClient, timeout_s: float, retries: int = 1):
        self.client, self.timeout_s, self.retries = client, timeout_s, retries

    async def call(
        self, call_id: str, name: str, arguments: dict[str, Any], timeout_s: float = 0.0
    ) -> ToolResult:
        req = ToolCallRequest(call_id=call_id, name=name, arguments=arguments, timeout_s=timeout_s)
        # the reply must be able to arrive after the tool's own wall limit
        wait = max(self.timeout_s, timeout_s + 5.0) if timeout_s > 0 else self.timeout_s

        def fail(kind: str, error: str) -> ToolResult:
            return ToolResult(call_id, name, False, error=error, error_kind=kind)

        try:
            rep = await self.client.request(req, timeout=wait, retries=self.retries)
        except RequestTimeout as exc:
            return fail("timeout", f"no answer from the tools node: {exc}")
        except RemoteError as exc:
            kind = "bad_call" if exc.code in ("bad_request", "protocol") else "unreachable"
            return fail(kind, f"the tools node refused the call: {exc}")
        except TransportError as exc:
            return fail("unreachable", f"tools node unreachable: {exc}")
        if not isinstance(rep, ToolCallReply):
            return fail("unreachable", f"tools node answered {type(rep).__name__}")
        return result_of(name, rep)
