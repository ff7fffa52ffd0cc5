"""Issue 46: a rollout key cannot mint rollout ids to take the buffer.

    .venv/bin/python -m pytest tests/test_rollout_ids.py -q

Rollout ids are admitted, not claimed: a server admits at most `cluster.max_rollouts` live
rollout ids (derived: roles.rollout + max(2, roles.rollout // 4)), the run's own ids
(rollout-0 ..) always, and refuses a new id past it at HELLO (`too_many_rollouts`, counted under
the claiming key). The buffer leases prompts only to the rollouts the manager lists as serving
(an engine up in its heartbeats), no more than that engine can start, and an id that took work
and went quiet loses what it never started after `buffer.unstarted_lease_s`, not `lease_s`. A
sample from a non-owner is refused `not_owner` whether or not the real copy arrived.

The probe runs the sim cluster on tcp with CURVE and a key pair per role (tests/test_probe.py),
with a hostile client holding only the rollout key.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from laminar.buffer.experience import OPEN
from laminar.cluster import LocalCluster
from laminar.protocol.buffer import PromptReply, PromptRequest, TrajectoryAck
from laminar.transport.client import RpcClient
from laminar.transport.security import generate_role_keys
from laminar.transport.server import RpcServer
from laminar.transport.sockets import (
    IdBound,
    RemoteError,
    RequestTimeout,
    SocketOptions,
    new_context,
)
from tests.serving import rollout_status
from tests.sim_cluster import trainer_metrics, wait_for
from tests.test_probe import ROLES, finish, forged, hostile, node_row, probe_config, status_json

GHOSTS = [f"rollout-ghost{i}" for i in range(10)]


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """`laminar keys DIR --roles manager,buffer,relay,trainer,rollout,tools,cli`."""
    root = tmp_path / "keys"
    generate_role_keys(root, ROLES)
    return root


async def admitted(zctx: Any, cfg: Any, service: str, ids: list[str]) -> list[RpcClient]:
    """Connect a hostile client under each id; the ones admitted (the others are closed)."""
    out = []
    for rid in ids:
        cli = hostile(zctx, cfg, service, rid, status=lambda rid=rid: rollout_status(rid, 10**9))
        try:
            await cli.connect(timeout=1.0)
        except (RemoteError, RequestTimeout):
            # too_many_rollouts, retried until the deadline (the server counts each refusal);
            # the last try may end as a plain timeout
            await cli.close(say_bye=False)
            continue
        out.append(cli)
    return out


async def test_a_rollout_key_cannot_mint_ids_to_take_the_buffer(tmp_path, keys, zctx, capsys):
    cfg = probe_config(tmp_path, keys, total_steps=20, buffer={"unstarted_lease_s": 1.0})
    async with LocalCluster(cfg, transport="tcp") as cluster:
        cfg = cluster.cfg
        mgr, buf, trainer = (cluster.node(n) for n in ("manager-0", "buffer-0", "trainer-0"))
        await wait_for(lambda: trainer.step >= 1, 60, "the first step", cluster)
        steps = trainer.step
        bound = cfg.cluster.live_rollouts_bound()
        own = cfg.cluster.roles["rollout"]

        # 10 new ids: at most the bound is live at once, the run's own rollouts among them
        at_buffer = await admitted(zctx, cfg, "buffer", GHOSTS)
        minted = [c.node_id for c in at_buffer]
        live = [p.node_id for p in buf.srv.peers.values() if p.role == "rollout" and p.alive]
        print(f"admitted at the buffer: {minted} of {len(GHOSTS)}; live rollout ids {live}")
        assert len(minted) == bound - own == 2 and len(live) <= bound
        key_row = buf.srv.refusals["key:rollout"]
        assert key_row.refused_ids >= len(GHOSTS) - len(minted)
        assert buf.srv.refused.refused_ids == key_row.refused_ids

        # admitted is not serving: no prompts before the manager lists an engine for the id
        for cli in at_buffer:
            reply = await cli.request(
                PromptRequest(rollout_id=cli.node_id, max_groups=10**12, version=trainer.version),
                timeout=5.0,
            )
            assert isinstance(reply, PromptReply) and not reply.items
            assert reply.reason == "not_member", reply

        # beating at the manager (an engine "running 10**9"): an engine's worth each, at most
        at_manager = await admitted(zctx, cfg, "manager", minted)
        assert [c.node_id for c in at_manager] == minted
        for cli in at_manager:
            await cli.beat()
        await wait_for(
            lambda: all(buf.prompts.members.cap(rid) is not None for rid in minted),
            10,
            "the manager listing the minted ids",
            cluster,
        )
        engine = max(cfg.groups_in_hand(), -(-cfg.rollout.max_running // cfg.rollout.group_size))
        leased: dict[str, int] = {}
        for cli in at_buffer:
            for n in range(3):  # asking again gets no more
                reply = await cli.request(
                    PromptRequest(
                        rollout_id=cli.node_id,
                        max_groups=10**12,
                        version=trainer.version,
                        request_id=f"q{n}",
                    ),
                    timeout=5.0,
                )
                assert isinstance(reply, PromptReply)
                leased[cli.node_id] = leased.get(cli.node_id, 0) + len(reply.items)
                if not reply.items:
                    await asyncio.sleep(reply.retry_after_s)
        held = {rid: buf.state.open_held[rid] for rid in minted}
        print(
            f"groups leased per minted id: {leased}; share of one rollout "
            f"{cfg.groups_per_rollout()}, engine {engine}"
        )
        assert all(0 < n <= engine for n in leased.values()), leased
        assert sum(held.values()) <= min(cfg.groups_per_rollout(), len(minted) * engine)

        # a non-owner gets not_owner for a finished sample as for a running one
        def finished_of_real() -> tuple[str, int] | None:
            for g in buf.state.groups.values():
                if g.rollout_id.startswith("rollout-") and g.rollout_id not in minted:
                    for i, t in g.members.items():
                        if t.rollout_id == g.rollout_id:
                            return g.group_id, i
            return None

        await wait_for(lambda: finished_of_real() is not None, 30, "a finished sample", cluster)
        found = finished_of_real()
        assert found is not None
        gid, index = found
        ghost = at_buffer[0]
        ack = await ghost.request(forged(gid, index, rollout_id=ghost.node_id), timeout=5.0)
        assert isinstance(ack, TrajectoryAck)
        assert ack.refused == "not_owner" and not ack.duplicate, ack

        # the ids stop asking (and never start anything): their groups go back, long before
        # lease_s, to the real rollouts, which kept training meanwhile
        gids = [g.group_id for g in buf.state.groups.values() if g.rollout_id in minted]
        t0 = time.monotonic()

        def returned() -> bool:
            for gid in gids:
                g = buf.state.groups.get(gid)
                if g is not None and g.state == OPEN and g.rollout_id in minted:
                    return False
            return True

        await wait_for(returned, 30, "the minted ids' unstarted groups served again", cluster)
        back_s = time.monotonic() - t0
        print(f"{len(gids)} groups back after {back_s:.1f} s (lease_s {cfg.buffer.lease_s:g})")
        assert back_s < cfg.buffer.lease_s / 10

        await finish(cluster, cfg)
        assert trainer.step > steps  # the real rollouts kept training
        key = "security/refused_ids"
        seen = [m[key] for m in trainer_metrics(cfg) if key in m]
        assert seen and max(seen) >= 1, seen  # the manager's sum, as of the last step
        st = await status_json(cfg, tmp_path, capsys)
        row = node_row(st, "buffer-0")
        assert row["refused_ids"] >= len(GHOSTS) - len(minted), row
        assert any("key:rollout" in w and "too_many_rollouts" in w for w in row["warnings"])
        for c in (*at_buffer, *at_manager):
            await c.close()


# ---- the bound itself, at one server -------------------------------------------------------


async def test_the_bound_admits_the_runs_own_ids_and_frees_a_dead_peers_slot(tmp_path):
    ctx = new_context()
    bound = IdBound("rollout", 4, frozenset({"rollout-0", "rollout-1"}))
    opts = SocketOptions(heartbeat_interval_s=0.05, heartbeat_liveness=4, id_bound=bound)
    endpoint = f"ipc://{tmp_path}/srv.sock"
    srv: RpcServer = RpcServer(ctx, endpoint, "buffer-0", "buffer", opts)
    await srv.start()
    clients: list[RpcClient] = []

    async def join(node_id: str, role: str = "rollout") -> RpcClient | None:
        cli = RpcClient(ctx, endpoint, node_id, role, SocketOptions(heartbeat_interval_s=0.05))
        try:
            await cli.connect(timeout=0.5)
        except (RemoteError, RequestTimeout):  # too_many_rollouts, retried to the deadline
            await cli.close(say_bye=False)
            return None
        clients.append(cli)
        return cli

    try:
        extra = [await join(f"x-{i}") for i in range(5)]
        assert [c is not None for c in extra] == [True, True, False, False, False]
        assert srv.refusals["key:(none)"].refused_ids >= 3
        assert await join("trainer-0", "trainer") is not None  # other roles are not bounded
        # the run's own ids are always admitted, extras full or not
        r0 = await join("rollout-0")
        assert r0 is not None and await join("rollout-1") is not None
        # a killed rollout restarted under its id: admitted once the old one is dead
        await r0.close(say_bye=False)
        clients.remove(r0)
        await wait_for(lambda: not srv.peers["rollout-0"].alive, 5, "rollout-0 declared dead")
        assert await join("rollout-0") is not None
        # a dead extra frees its slot for another id
        first = extra[0]
        assert first is not None
        await first.close(say_bye=False)
        clients.remove(first)
        await wait_for(lambda: not srv.peers["x-0"].alive, 5, "x-0 declared dead")
        assert await join("x-9") is not None
        assert await join("x-10") is None
    finally:
        for c in clients:
            await c.close()
        await srv.close()
        ctx.destroy(linger=0)
