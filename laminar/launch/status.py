"""`laminar status`: ask the manager for every node's state, print a table (or JSON).

    laminar status [--json] [--config run_dir/config.yaml]

Each node's refusals (`NodeStatus.refusals`: messages its servers refused as unauthorized or
bad, refused handshakes, the buffer's refused trajectories) are columns of the table and, per
peer, `refusals` in the JSON; a peer that sends what it may not gets a WARNING line.
`attest_mismatches`: a rollout's loads whose served weights did not match the trainer's digest
(each quarantined and reloaded; docs/DESIGN.md "Attested versions"). A rollout's agent endpoint
(RolloutStatus.agent: refusals per reason, idle-expired episodes, agent failures, and the
rollout's `agent_*` counters: calls, input tokens, rewrites, moves ...) and the samples
its outbox dropped are `agent` / `outbox_dropped` in the JSON and an AGENT line in the text.
Colocated placement (docs/colocated.md): a rollout's `asleep`, and the trainer's last cycle
(`colocate`: colocate/sleep_s, wake_s, handoff_s, bytes, as in metrics.jsonl) in the JSON and a
COLOCATE line in the text.

`fetch_status` (a one-off RpcClient) also feeds the live progress line (laminar/progress.py),
`fetch_buffer_stats` the launcher's no-progress watch (laminar/launch/no_progress.py);
restarts come from the launcher's run_dir/supervisor.json. A node the manager declared dead
(NodeEntry.deaths: silent past transport.heartbeat_liveness beats) reads `DEAD` under `alive` while
it is silent; `deaths` (and `last_death_s` in the JSON) and a WARNING line keep saying so after
it is heard from again, since a stalled process is not restarted.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import TYPE_CHECKING, TypeVar

import msgspec

from laminar.config import LaminarConfig, load_config

if TYPE_CHECKING:  # the wire (zmq) loads inside _ask
    from laminar.message import Message
    from laminar.protocol.buffer import BufferStats
    from laminar.protocol.core import RefusalSummary
    from laminar.protocol.manager import NodeEntry, StatusReply

R = TypeVar("R")

HELLOS_WARN = 10
"""Refused handshakes from one claimed id before it is warned about: a restarted process retries
a few times until its old incarnation is declared dead; a stranger keeps knocking."""


def fetch_status(cfg: LaminarConfig, timeout: float = 3.0) -> StatusReply:
    from laminar.protocol.manager import StatusReply, StatusRequest

    return _ask(cfg, "manager", StatusRequest(), StatusReply, timeout)


def fetch_buffer_stats(cfg: LaminarConfig, timeout: float = 3.0) -> BufferStats:
    """The buffer's figures (laminar/buffer/node.py `stats`): `laminar run`'s no-progress watch."""
    from laminar.protocol.buffer import BufferStats, BufferStatsRequest

    return _ask(cfg, "buffer", BufferStatsRequest(), BufferStats, timeout)


def _ask(
    cfg: LaminarConfig, service: str, request: Message, reply_type: type[R], timeout: float
) -> R:
    """One request to a service with a one-off RpcClient; TransportError when it does not answer
    (or answers something else)."""
    from laminar.transport.client import RpcClient
    from laminar.transport.sockets import TransportError, new_context
    from laminar.wiring.common import socket_options

    async def ask() -> R:
        ctx = new_context()
        cli = RpcClient(
            ctx,
            cfg.endpoint(service),
            f"cli-{os.getpid()}",  # a `cli` key (laminar keys --roles cli) may claim cli-*
            "cli",
            # its own pair when the host has one (`laminar keys DIR --roles cli`): a host with
            # only the cli pair and the servers' public key can ask, the server pair stays home
            socket_options(cfg, "cli"),
        )
        try:
            await cli.connect(timeout=timeout)
            reply = await cli.request(request, timeout=timeout, retries=0)
            if not isinstance(reply, reply_type):
                raise TransportError(
                    f"{service} answered {type(reply).__name__}, not {reply_type.__name__}"
                )
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
        refused = s.refusals if s else None
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
                "warnings": [
                    *death_warnings(e),
                    *(s.warnings if s else []),
                    *refusal_warnings(refused),
                ],
                "restarts": restarts.get(e.node_id, 0),
                "deaths": e.deaths,
                "last_death_s": e.last_death_s,
                "unauthorized": refused.unauthorized if refused else 0,
                "bad": refused.bad if refused else 0,
                "refused_hellos": refused.refused_hellos if refused else 0,
                "refused_ids": refused.refused_ids if refused else 0,
                "refused_trajectories": refused.refused_trajectories if refused else 0,
                "refusals": msgspec.to_builtins(refused.peers) if refused else [],
                "attest_mismatches": s.attest_mismatches if s else 0,
                "agent": dict(s.rollout.agent) if s and s.rollout else {},
                "outbox_dropped": s.rollout.outbox_dropped if s and s.rollout else 0,
                "asleep": bool(s.rollout.asleep) if s and s.rollout else False,
                "colocate": {k: v for k, v in s.extra.items() if k.startswith("colocate/")}
                if s
                else {},
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
        "deaths",
        "unauthorized",
        "bad",
        "refused_hellos",
        "refused_ids",
        "refused_trajectories",
        "attest_mismatches",
    ]
    # a node the manager holds dead reads `DEAD`, not `False` beside `True`s
    cells = [{**r, "alive": "yes" if r["alive"] else "DEAD"} for r in rows]
    widths = {c: max(len(c), *(len(str(r[c])) for r in cells)) if cells else len(c) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in cells:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    for r in rows:  # a rollout's agent endpoint: refusals and agent failures per reason
        if r["agent"] or r["outbox_dropped"]:
            agent = " ".join(f"{k}={v}" for k, v in sorted(r["agent"].items()))
            print(f"AGENT {r['node']}: {agent} outbox_dropped={r['outbox_dropped']}".rstrip())
    for r in rows:  # colocated placement: the last sleep / wake / handoff, who sleeps now
        if r["colocate"]:
            cycle = " ".join(
                f"{k.removeprefix('colocate/')}={v:g}" for k, v in r["colocate"].items()
            )
            print(f"COLOCATE {r['node']}: {cycle}")
        elif r["asleep"]:
            print(f"COLOCATE {r['node']}: asleep (the trainer has the device)")
    for r in rows:  # e.g. the buffer's stall warning (laminar/buffer/health.py), refused peers
        for w in r["warnings"]:
            print(f"WARNING {r['node']}: {w}")
    return 0


def death_warnings(entry: NodeEntry) -> list[str]:
    """A node the manager declared dead: silent now, or heard from again after a stall (its
    process was not restarted, so `restarts` stays 0; a rollout's episodes were recovered)."""
    if not entry.deaths:
        return []
    now = "and it is silent now" if not entry.alive else "and it was heard from again since"
    return [
        f"declared dead by the manager {entry.deaths} time(s), last {entry.last_death_s:.0f} s "
        f"ago (no message for transport.heartbeat_liveness beats), {now}"
    ]


def refusal_warnings(refused: RefusalSummary | None) -> list[str]:
    """One line per peer that sent what it may not (or malformed messages), or kept knocking
    with refused handshakes."""
    out = []
    for p in refused.peers if refused else []:
        if p.refused_ids:
            out.append(
                f"{p.peer} claimed {p.refused_ids} rollout ids past the bound on live ones "
                "(cluster.max_rollouts): refused too_many_rollouts"
            )
        elif p.unauthorized or p.bad or p.refused_trajectories or p.refused_hellos >= HELLOS_WARN:
            out.append(
                f"peer {p.peer!r} was refused {p.unauthorized} unauthorized and {p.bad} bad "
                f"messages, {p.refused_trajectories} trajectories and {p.refused_hellos} handshakes"
            )
    return out


def restarts_by_node(cfg: LaminarConfig) -> dict[str, int]:
    """Restarts per node id, from the launcher's run_dir/supervisor.json (none without one:
    nodes started by hand or by host_daemons.sh, whose restarts are in its own output)."""
    path = cfg.resolved_run_dir() / "supervisor.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {nid: int(v["restarts"]) for v in state["nodes"].values() for nid in v["node_ids"]}
