"""`laminar status`: ask the manager for every node's state, print a table (or JSON).

    laminar status [--json] [--config run_dir/config.yaml]

`fetch_status` (a one-off RpcClient) also feeds the live progress line (laminar/progress.py);
restarts come from the launcher's run_dir/supervisor.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import TYPE_CHECKING

from laminar.config import LaminarConfig, load_config

if TYPE_CHECKING:  # the wire (zmq) loads inside fetch_status
    from laminar.protocol.manager import StatusReply


def fetch_status(cfg: LaminarConfig, timeout: float = 3.0) -> StatusReply:
    from laminar.node import socket_options
    from laminar.protocol.manager import StatusReply, StatusRequest
    from laminar.transport.client import RpcClient
    from laminar.transport.sockets import TransportError, new_context

    async def ask() -> StatusReply:
        ctx = new_context()
        cli = RpcClient(
            ctx,
            cfg.endpoint("manager"),
            f"status-{os.getpid()}",
            "cli",
            socket_options(cfg),
        )
        try:
            await cli.connect(timeout=timeout)
            reply = await cli.request(StatusRequest(), timeout=timeout, retries=0)
            if not isinstance(reply, StatusReply):
                raise TransportError(f"manager answered {type(reply).__name__}, not StatusReply")
            return reply
        finally:
            await cli.close()
            ctx.destroy(linger=0)

    return asyncio.run(ask())


def status_main(config: str | None, overrides: list[str], as_json: bool, timeout: float) -> int:
    cfg = load_config(config, overrides)
    from laminar.logs import configure_logging

    configure_logging("warning", cfg.logging.json_logs)
    from laminar.transport.sockets import TransportError

    try:
        reply = fetch_status(cfg, timeout)
    except TransportError as exc:
        print(
            f"laminar status: manager at {cfg.endpoint('manager')} did not answer: {exc}",
            file=sys.stderr,
        )
        return 1
    restarts = restarts_by_node(cfg)
    rows = []
    for e in sorted(reply.nodes, key=lambda e: (e.role, e.node_id)):
        s = e.status
        rows.append(
            {
                "node": e.node_id,
                "role": e.role,
                "alive": e.alive,
                "pid": e.pid,
                "version": s.version if s else -1,
                "kv_use": round(s.kv_use, 3) if s else 0.0,
                "inflight": s.inflight if s else 0,
                "staleness": s.staleness if s else 0.0,
                "last_beat_s": e.last_beat_s,
                "warnings": list(s.warnings) if s else [],
                "restarts": restarts.get(e.node_id, 0),
            }
        )
    if as_json:
        print(
            json.dumps(
                {
                    "mode": reply.mode,
                    "trainer_version": reply.trainer_version,
                    "nodes": rows,
                    "restarts": sum(restarts.values()),
                },
                indent=2,
            )
        )
        return 0
    cols = [
        "node",
        "role",
        "alive",
        "version",
        "kv_use",
        "inflight",
        "staleness",
        "last_beat_s",
        "pid",
        "restarts",
    ]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) if rows else len(c) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    for e in reply.nodes:  # e.g. the buffer's stall warning (laminar/buffer/health.py)
        for w in e.status.warnings if e.status else []:
            print(f"WARNING {e.node_id}: {w}")
    return 0


def restarts_by_node(cfg: LaminarConfig) -> dict[str, int]:
    """Restarts per node id, from the launcher's run_dir/supervisor.json (none without one:
    nodes started by hand or by host_daemons.sh, whose restarts are in its own output)."""
    path = cfg.resolved_run_dir() / "supervisor.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {nid: int(v["restarts"]) for v in state["nodes"].values() for nid in v["node_ids"]}
