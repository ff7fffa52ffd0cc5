"""The outside probe of issue 29, as tests: a hostile insider holding only the rollout role's
key, against a running sim cluster on tcp with CURVE and a key pair per role.

    .venv/bin/python -m pytest tests/test_probe.py -q

Every test starts the whole cluster in this process (LocalCluster over tcp on 127.0.0.1, sim
engines and trainer, one relay, `laminar keys DIR --roles ...`) and a hostile RpcClient on its
own zmq context with the rollout key. What the hostile client may not do is refused (an
ErrorReply or a refusing ack, counted per peer) and changes nothing; training runs to its last
step throughout, no sample is trained twice (run_dir/consumed.jsonl), and the buffer's journal
replays clean with every trained sample in it. `laminar status` (and `--json`) then shows the
refused and bad counts per node and per peer, and metrics.jsonl the cluster's totals.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import secrets
import shutil
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

import laminar.protocol  # noqa: F401
from laminar.buffer.experience import OPEN
from laminar.cluster import LocalCluster
from laminar.config import LaminarConfig
from laminar.message import Message
from laminar.protocol.buffer import (
    BatchCommit,
    BatchRequest,
    PartialsRequest,
    PromptReply,
    PromptRequest,
    TrajectoryAck,
)
from laminar.protocol.core import NodeStatus
from laminar.protocol.data import Trajectory
from laminar.protocol.relay import (
    CommitRequest,
    PushChunk,
    RelayReset,
    StageRequest,
    WeightLayout,
)
from laminar.protocol.trainer import VersionPublished
from laminar.transport.client import RpcClient
from laminar.transport.security import generate_role_keys
from laminar.transport.sockets import RemoteError, RequestTimeout, TransportError
from laminar.wiring.common import socket_options
from tests.serving import rollout_status
from tests.sim_cluster import consumed, sim_config, trainer_metrics, wait_for

ROLES = ["manager", "buffer", "relay", "trainer", "rollout", "tools", "cli"]
HOSTILE = "rollout-9"
"""An id the rollout key may claim (rollout-*) that the cluster does not run."""


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base_port() -> int:
    """A base port whose every service port (manager .. relay_data) was free a moment ago."""
    for _ in range(200):
        base = random.randrange(20_000, 60_000)
        if all(_port_free(base + off) for off in (0, 1, 2, 3, 10, 60, 110)):
            return base
    raise RuntimeError("no free tcp port range on 127.0.0.1")


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """`laminar keys DIR --roles manager,buffer,relay,trainer,rollout,tools`."""
    root = tmp_path / "keys"
    generate_role_keys(root, ROLES)
    return root


def probe_config(tmp_path: Path, keys: Path, **over: Any) -> LaminarConfig:
    """A sim cluster on tcp with CURVE and per-role keys, bound to 127.0.0.1 only. It runs a
    relay (for the weight probes) while versions travel as announcements (sim: no tensors)."""
    over.setdefault("total_steps", 10)
    return sim_config(
        tmp_path,
        net="tcp",
        relays=1,
        cluster={"host": "127.0.0.1", "base_port": free_base_port()},
        security={"keys_dir": str(keys)},
        rollout={"weights": "announce"},
        **over,
    )


def hostile(zctx: Any, cfg: LaminarConfig, service: str, node_id: str = HOSTILE, **kw: Any):
    """A client on its own context holding only the rollout key (what a rollout host has)."""
    opts = socket_options(cfg, "rollout")
    assert opts.security is not None and opts.security.name == "rollout"
    return RpcClient(zctx, cfg.endpoint(service), node_id, "rollout", opts, **kw)


async def refused(cli: RpcClient, msg: Message, code: str = "unauthorized") -> RemoteError:
    """`msg` is answered with an ErrorReply of `code`, not done."""
    with pytest.raises(RemoteError) as err:
        await cli.request(msg, timeout=5.0, retries=0)
    assert err.value.code == code, err.value
    return err.value


def layout() -> WeightLayout:
    return WeightLayout(names=["w"], dtypes=["float32"], shapes=[[4]], offsets=[0], total_bytes=16)


def forged(group_id: str, index: int = 0, *, reward: float = 1.0, ids: int = 5, **kw: Any):
    """A finished sample as a rollout would send it (prompt and response as small ids)."""
    return Trajectory(
        uid=f"{group_id}/{index}",
        group_id=group_id,
        prompt_uid=group_id.split("#")[0],
        sample_index=index,
        prompt_ids=np.array([1, 2, 3], np.int32),
        response_ids=np.array([ids] * 4, np.int32),
        logprobs=np.zeros(4, np.float32),
        version=0,
        finish_reason="stop",
        reward=reward,
        rollout_id=kw.pop("rollout_id", HOSTILE),
        **kw,
    )


async def serving(zctx: Any, cfg: LaminarConfig, node_id: str = HOSTILE) -> RpcClient:
    """The hostile id at the manager, beating a serving rollout's status (an engine up,
    claiming to run 10**9 at once): the buffer serves prompts only to what the manager lists."""
    cli = hostile(zctx, cfg, "manager", node_id, status=lambda: rollout_status(node_id, 10**9))
    await cli.connect(timeout=10)
    await cli.beat()
    return cli


async def served(cli: RpcClient, trainer: Any, max_groups: int, timeout: float = 20.0) -> list:
    """Ask for prompts as the hostile rollout until some come (admission may say wait)."""
    deadline = time.monotonic() + timeout
    n = 0
    while True:
        n += 1
        req = PromptRequest(
            rollout_id=HOSTILE, max_groups=max_groups, version=trainer.version, request_id=str(n)
        )
        reply = await cli.request(req, timeout=5.0)
        assert isinstance(reply, PromptReply), reply
        if reply.items or time.monotonic() > deadline:
            assert reply.items, f"no prompts served: {reply.reason}"
            return reply.items
        await asyncio.sleep(max(0.05, reply.retry_after_s))  # the buffer's own retry hint


def theirs_gid(theirs: list) -> str:
    return theirs[0][0].group_id if theirs else ""


def trained_uids(cfg: LaminarConfig) -> Counter[str]:
    return Counter(uid for step in consumed(cfg) for uid in step["uids"])


async def finish(cluster: LocalCluster, cfg: LaminarConfig, timeout: float = 120.0) -> None:
    """Training ran to its last step and trained no sample twice."""
    trainer = cluster.node("trainer-0")
    await wait_for(
        lambda: trainer.step >= cfg.trainer.total_steps, timeout, "the last step", cluster
    )
    twice = [uid for uid, n in trained_uids(cfg).items() if n > 1]
    assert not twice, f"trained twice: {twice[:5]}"
    assert trainer.metrics.counters.get("commit_rejected", 0) == 0


def audit(cfg: LaminarConfig) -> list[Trajectory]:
    """After the cluster stopped: the buffer's journal is clean, and every trained sample is one
    the buffer recorded, trained once; returns every trajectory the journal recorded."""
    from laminar.journal_check import check_run_dir, replay_buffer_journal
    from laminar.wiring.buffer import experience_state

    run_dir = cfg.resolved_run_dir()
    report = io.StringIO()
    assert check_run_dir(run_dir, report) == 0, report.getvalue()
    state, trajs = replay_buffer_journal(run_dir / "buffer-0.journal", experience_state(cfg))
    trained = trained_uids(cfg)
    assert set(trained) <= {t.uid for t in trajs}
    assert all(n == 1 for n in trained.values())
    assert state.summary().get("groups_committed", 0) >= cfg.trainer.total_steps
    return trajs


async def status_json(cfg: LaminarConfig, tmp_path: Path, capsys: Any) -> dict[str, Any]:
    """What `laminar status --json` prints for this cluster (run in a thread: it runs its own
    event loop)."""
    from laminar.launch.status import status_main

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    # an operator's host: the cli pair and the servers' public key, no server secret
    keys, own = Path(str(cfg.security.keys_dir)), tmp_path / "cli-host-keys"
    own.mkdir(exist_ok=True)
    for name in ("cli.key", "cli.key_secret", "node.key"):
        shutil.copy(keys / name, own / name)
    capsys.readouterr()
    assert (
        await asyncio.to_thread(status_main, str(path), [f"security.keys_dir={own}"], True, 5.0)
        == 0
    )
    out = capsys.readouterr().out  # the cluster's own log lines share stdout
    return json.JSONDecoder().raw_decode(out, out.index('{\n  "mode"'))[0]


def node_row(status: dict[str, Any], node_id: str) -> dict[str, Any]:
    rows = [r for r in status["nodes"] if r["node"] == node_id]
    assert rows, f"{node_id} not in laminar status"
    return rows[0]


def peer_row(row: dict[str, Any], peer: str) -> dict[str, Any]:
    rows = [p for p in row["refusals"] if p["peer"] == peer]
    assert rows, f"no refusals of {peer} at {row['node']}: {row['refusals']}"
    return rows[0]


# ---- weights, batches and versions belong to the trainer ----


async def test_a_rollout_key_cannot_move_weights_batches_or_versions(tmp_path, keys, zctx, capsys):
    cfg = probe_config(tmp_path, keys)
    async with LocalCluster(cfg, transport="tcp") as cluster:
        cfg = cluster.cfg
        mgr, buf, relay = (cluster.node(n) for n in ("manager-0", "buffer-0", "relay-0"))
        trainer = cluster.node("trainer-0")
        await wait_for(lambda: trainer.step >= 1, 60, "the first step", cluster)

        at_relay = hostile(zctx, cfg, "relay")
        await at_relay.connect(timeout=10)
        relay_before = relay.status()
        await refused(at_relay, StageRequest(version=1_000_122, layout=layout(), takeover=True))
        await refused(
            at_relay,
            PushChunk(version=1_000_122, token=1, offset=0, data=np.zeros(16, np.uint8)),
        )
        await refused(at_relay, CommitRequest(version=1_000_122, token=1))
        await refused(at_relay, RelayReset())
        after = relay.status()
        assert after.version == relay_before.version < 1_000_122
        assert after.relay is not None and after.relay.incoming < 1_000_122

        at_buffer = hostile(zctx, cfg, "buffer")
        await at_buffer.connect(timeout=10)
        steps_before = trainer.step
        for msg in (
            BatchRequest(trainer_id="trainer-0", groups=1, trainer_version=0, restart=True),
            BatchRequest(trainer_id=HOSTILE, groups=1, trainer_version=0),
            BatchCommit(batch_id="b-1", step=steps_before + 1, version=steps_before + 1),
            PartialsRequest(rollout_id="rollout-0"),  # a manager's question
        ):
            await refused(at_buffer, msg)

        at_manager = hostile(zctx, cfg, "manager")
        await at_manager.connect(timeout=10)
        forged_version = VersionPublished(trainer_id="trainer-0", version=1_000_000, step=1)
        await refused(at_manager, forged_version)
        await at_manager.send(forged_version)  # one-way, as the trainer sends it: dropped too
        await refused(at_manager, VersionPublished(trainer_id=HOSTILE, version=1_000_000, step=1))

        await finish(cluster, cfg)
        assert mgr.trainer_version <= trainer.version < 1_000_000
        assert relay.status().version < 1_000_122
        # counted per peer, where it was refused
        assert relay.srv.refusals[HOSTILE].unauthorized == 4
        assert buf.srv.refusals[HOSTILE].unauthorized == 4
        assert mgr.srv.refusals[HOSTILE].unauthorized == 3
        assert "trainer-0" not in buf.srv.refusals and "trainer-0" not in mgr.srv.refusals
        # metrics.jsonl: the cluster's counts as the manager summed them
        seen = [
            m["security/unauthorized"] for m in trainer_metrics(cfg) if "security/unauthorized" in m
        ]
        assert seen and max(seen) >= 1, seen

        # and shown where users look: laminar status --json, per node and per peer (once the
        # nodes' heartbeats brought their counts to the manager)
        st = await status_json(cfg, tmp_path, capsys)
        deadline = time.monotonic() + 10
        while node_row(st, "relay-0")["unauthorized"] < 4 and time.monotonic() < deadline:
            st = await status_json(cfg, tmp_path, capsys)
        for node_id, n in (("relay-0", 4), ("buffer-0", 4), ("manager-0", 3)):
            row = node_row(st, node_id)
            assert row["unauthorized"] >= n, row
            assert peer_row(row, HOSTILE)["unauthorized"] >= n
            assert any(HOSTILE in w for w in row["warnings"]), row["warnings"]
        # the table says it too, with a warning line per refused peer
        from laminar.launch.status import status_main

        capsys.readouterr()
        assert (
            await asyncio.to_thread(status_main, str(tmp_path / "config.yaml"), [], False, 5) == 0
        )
        out = capsys.readouterr().out
        assert "unauthorized" in out and "refused_hellos" in out
        assert f"WARNING relay-0: peer '{HOSTILE}' was refused 4 unauthorized" in out
        for c in (at_relay, at_buffer, at_manager):
            await c.close()
    audit(cfg)


# ---- only what was served comes back ----


async def test_a_rollout_key_cannot_submit_what_it_was_not_served(tmp_path, keys, zctx):
    cfg = probe_config(tmp_path, keys, reward={"min_value": 0.0, "max_value": 1.0})
    async with LocalCluster(cfg, transport="tcp") as cluster:
        cfg = cluster.cfg
        buf, trainer = cluster.node("buffer-0"), cluster.node("trainer-0")
        await wait_for(lambda: trainer.step >= 1, 60, "the first step", cluster)
        cli = hostile(zctx, cfg, "buffer")
        await cli.connect(timeout=10)
        member = await serving(zctx, cfg)

        def answer_refused(reply: Any) -> bool:
            # refused, or (the owner's copy came first) acked as a duplicate: nothing stored
            return isinstance(reply, RemoteError) or (
                isinstance(reply, TrajectoryAck) and bool(reply.refused or reply.duplicate)
            )

        async def sent(t: Trajectory) -> Any:
            try:
                return await cli.request(t, timeout=5.0, retries=0)
            except RemoteError as exc:
                return exc

        # its own served group first (the buffer serves what the manager lists as serving: the
        # hostile id beats there), so another rollout's sample below is still generating
        mine = (await served(cli, trainer, max_groups=1))[0]
        forgeries: list[Trajectory] = []
        # a group nobody was served
        forgeries.append(forged("ghost#0#0"))
        # another rollout's in-flight sample (what PartialsRequest would have told)
        theirs = [
            (g, i)
            for g in buf.state.groups.values()
            if g.state == OPEN and g.rollout_id != HOSTILE
            for i in range(g.n)
            if i not in g.members and i not in g.lost
        ]
        if theirs:  # a sample still generating there: the forged copy must not take its place
            forgeries.append(forged(theirs[0][0].group_id, theirs[0][1]))
        # the ids of another rollout in the body: refused before the buffer looks
        forgeries.append(forged("ghost#0#1", rollout_id="rollout-0"))
        # its own served group, with a reward and token ids out of range
        forgeries.append(forged(mine.group_id, 0, reward=1e6))
        forgeries.append(forged(mine.group_id, 1, reward=float("nan")))
        forgeries.append(forged(mine.group_id, 0, ids=10**9))
        answers = [await sent(t) for t in forgeries]
        assert all(answer_refused(a) for a in answers), answers

        if theirs:  # the owner's own copy still lands (it is not refused as a duplicate)
            group, index = theirs[0]
            owner = group.rollout_id
            await wait_for(
                lambda: index in group.members or index in group.lost or group.state != OPEN,
                30,
                "the owner's copy",
                cluster,
            )
            if index in group.members:  # from a real rollout: its holder, a former one (a
                # lease ran out) or the one a repack move placed it on
                real = group.members[index].rollout_id
                assert real != HOSTILE and real.startswith("rollout-"), real
            assert not buf.refusals.by_peer.get(owner), buf.refusals.figures()
        await finish(cluster, cfg)
        trained = trained_uids(cfg)
        assert not {t.uid for t in forgeries if t.group_id != theirs_gid(theirs)} & set(trained)
        refusals = buf.refusal_summary()
        n_refused = sum(isinstance(a, TrajectoryAck) and bool(a.refused) for a in answers)
        assert n_refused >= len(forgeries) - 2  # all but the id-naming one (and a duplicate)
        assert refusals is not None and refusals.refused_trajectories >= n_refused
        assert refusals.unauthorized >= 1  # the one naming rollout-0
        assert max(m["reward"] for m in trainer_metrics(cfg) if "reward" in m) <= 1.0
        assert buf.stats().refused[HOSTILE], "BufferStats.refused names the peer"
        row = next(p for p in refusals.peers if p.peer == HOSTILE)
        assert row.refused_trajectories == refusals.refused_trajectories
        await cli.close()
        await member.close()
    # nothing the hostile client sent was ever recorded, let alone trained
    assert not [t.uid for t in audit(cfg) if t.rollout_id == HOSTILE]


# ---- a live rollout's id is its own ----


async def test_a_rollout_key_cannot_take_over_a_live_rollout(tmp_path, keys, zctx):
    cfg = probe_config(tmp_path, keys)
    async with LocalCluster(cfg, transport="tcp") as cluster:
        cfg = cluster.cfg
        mgr, buf, trainer = (cluster.node(n) for n in ("manager-0", "buffer-0", "trainer-0"))
        victim = cluster.node("rollout-0")
        await wait_for(lambda: trainer.step >= 1, 60, "the first step", cluster)
        held = {srv.node_id: srv.peers["rollout-0"] for srv in (mgr.srv, buf.srv)}
        for service, srv in (("buffer", buf.srv), ("manager", mgr.srv)):
            peer = srv.peers["rollout-0"]
            # every fact the HELLO states, copied: pid and host (this process: the same), the
            # start time, and a made-up nonce
            imp = hostile(zctx, cfg, service, "rollout-0", started=peer.started)
            assert (imp._hello.pid, imp._hello.host) == (peer.pid, peer.host)
            imp.opts.nonces[(cfg.endpoint(service), "rollout-0")] = secrets.token_bytes(16)
            with pytest.raises((RequestTimeout, RemoteError), match="id_in_use"):
                await imp.connect(timeout=2.0)
            await imp.close(say_bye=False)
            assert srv.peers["rollout-0"] is held[srv.node_id] and held[srv.node_id].alive
            assert srv.refusals["rollout-0"].refused_hello >= 1
        # the real rollout kept its entries and keeps working
        stored = buf.state.counts["trajectories"]
        await wait_for(
            lambda: buf.state.counts["trajectories"] > stored, 30, "the victim's work", cluster
        )
        assert not victim.stopping.is_set()
        await finish(cluster, cfg)
        assert mgr.srv.peers["rollout-0"] is held[mgr.srv.node_id]
        assert mgr.metrics.counters.get("restarts_unnoticed", 0) == 0
    audit(cfg)


# ---- claims are bounded ----


async def test_a_rollout_key_cannot_claim_work_beyond_the_config(tmp_path, keys, zctx):
    cfg = probe_config(tmp_path, keys)
    async with LocalCluster(cfg, transport="tcp") as cluster:
        cfg = cluster.cfg
        mgr, buf, trainer = (cluster.node(n) for n in ("manager-0", "buffer-0", "trainer-0"))
        await wait_for(lambda: trainer.step >= 1, 60, "the first step", cluster)

        # a heartbeat claiming 3,000,000 samples in flight
        def claim() -> NodeStatus:  # an engine up, running 10**9 at once, it says
            return rollout_status(
                HOSTILE,
                10**9,
                version=max(0, trainer.version),
                kv_use=0.5,
                running=1,
                inflight=3_000_000,
            )

        at_manager = hostile(zctx, cfg, "manager", status=claim)
        await at_manager.connect(timeout=10)
        await at_manager.beat()
        await wait_for(
            lambda: (
                HOSTILE in mgr.srv.peers
                and (
                    mgr.srv.refusals.get(HOSTILE) is not None
                    or mgr.srv.peers[HOSTILE].status is not None
                )
            ),
            10,
            "the claim reaching the manager",
            cluster,
        )
        t0 = time.perf_counter()
        loads = mgr.repacker.rollout_loads()
        planning_s = time.perf_counter() - t0
        sizes = {load.node_id: len(load.trajectories) for load in loads}
        assert all(n <= cfg.inflight_per_rollout() for n in sizes.values()), sizes
        assert mgr.repacker.claims[HOSTILE] >= 1  # clamped, and counted against the claimer
        assert planning_s < 0.5

        # a prompt request for 10**12 groups, under its own id and under a ghost's
        at_buffer = hostile(zctx, cfg, "buffer")
        await at_buffer.connect(timeout=10)
        await refused(
            at_buffer,
            PromptRequest(rollout_id="rollout-ghost", max_groups=10**12, version=trainer.version),
        )
        items = await served(at_buffer, trainer, max_groups=10**12)
        share = cfg.groups_per_rollout()
        assert len(items) <= share < cfg.buffer.capacity // cfg.rollout.group_size
        again = await at_buffer.request(
            PromptRequest(
                rollout_id=HOSTILE, max_groups=10**12, version=trainer.version, request_id="again"
            ),
            timeout=5.0,
        )
        assert isinstance(again, PromptReply)
        assert len(items) + len(again.items) <= share
        assert buf.state.open_held[HOSTILE] <= share

        # training goes on with the rest, and the manager kept answering in time
        await finish(cluster, cfg)
        t0 = time.perf_counter()
        await asyncio.to_thread(_status_round_trip, cfg)
        assert time.perf_counter() - t0 < 2.0
        assert mgr.metrics.counters.get("deaths", 0) == 0  # nobody went silent meanwhile
        for c in (at_manager, at_buffer):
            await c.close()
    audit(cfg)


def _status_round_trip(cfg: LaminarConfig) -> None:
    from laminar.launch.status import fetch_status

    try:
        fetch_status(cfg, timeout=2.0)
    except TransportError as exc:  # pragma: no cover - the failure this test is about
        raise AssertionError(f"the manager did not answer: {exc}") from None
