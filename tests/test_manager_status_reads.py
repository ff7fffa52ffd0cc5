"""The manager reads the rollouts' statuses per change it needs, not per push (issue 51).

    .venv/bin/python -m pytest tests/test_manager_status_reads.py -q

A rollout pushes up to 20 statuses a second and the manager holds each undecoded until read
(laminar/transport/sockets.py Peer). Its heartbeat summaries (refusal sums, the serving list) read
a status as last read while that read is under SUMMARY_AGE_S old (Peer.recent_status), and a
repack round lists the trajectories only of the rollouts it may plan on (candidates).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import structlog

from laminar.config import config_from_dict
from laminar.manager.moves import Repacker
from laminar.manager.node import SUMMARY_AGE_S, ManagerNode
from laminar.manager.placement import Placer
from laminar.manager.serving import serving_rollouts
from laminar.metrics import Metrics
from laminar.protocol.core import NodeStatus, RefusalSummary
from laminar.protocol.rollout import RolloutStatus
from laminar.transport.session import StatusCodec
from laminar.transport.sockets import Peer

CODEC = StatusCodec(NodeStatus)


def _rollout_status(
    node_id: str, *, running: int, agent: dict[str, int] | None = None, max_running: int = 8
) -> Any:
    return NodeStatus(
        node_id=node_id,
        role="rollout",
        version=0,
        running=running,
        inflight=running,
        kv_use=0.5,
        rollout=RolloutStatus(
            traj_tokens={f"{node_id}/{k}": 100 + k for k in range(running)},
            kv_capacity_tokens=10_000,
            measured_at=0.0,
            target_version=0,
            max_running=max_running,
            agent=agent or {},
        ),
    )


class _Decodes:
    """The server's held-status decode (RpcServer._status_of), counting its calls."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, peer: Peer, raw: Any) -> NodeStatus | None:
        self.n += 1
        return CODEC.unpack(raw)


def _peer(node_id: str, role: str = "rollout") -> Peer:
    return Peer(node_id=node_id, role=role, identity=node_id.encode())


def test_recent_status_reuses_the_last_read_within_its_age_and_never_returns_nothing_held():
    dec, p = _Decodes(), _peer("rollout-0")
    p.hold_status(CODEC.pack(_rollout_status("rollout-0", running=1)), dec)
    # never read: the held status is decoded whatever the age allows
    first = p.recent_status(3600.0)
    assert first is not None and first.running == 1 and dec.n == 1
    # a newer push within the age: the last read serves, nothing decoded
    p.hold_status(CODEC.pack(_rollout_status("rollout-0", running=2)), dec)
    assert p.recent_status(3600.0) is first and dec.n == 1
    # age 0: the latest, decoded once; `status` then has nothing held to decode
    latest = p.recent_status(0.0)
    assert latest is not None and latest.running == 2 and dec.n == 2
    assert p.status is latest and p.recent_status(0.0) is latest and dec.n == 2


def _manager_view(peers: list[Peer]) -> Any:
    """What ManagerNode.cluster_refusals reads of its node: the server's peers, its own count."""
    return SimpleNamespace(
        srv=SimpleNamespace(peers={p.node_id: p for p in peers}),
        refusal_summary=lambda: RefusalSummary(bad=1),
    )


def test_a_heartbeats_summaries_decode_each_rollout_at_most_once_per_age():
    dec = _Decodes()
    peers = [_peer(f"rollout-{i}") for i in range(4)]
    buffer = _peer("buffer-0", role="buffer")
    buffer.status = NodeStatus(node_id="buffer-0", role="buffer", refusals=RefusalSummary(bad=2))
    for i, p in enumerate(peers):
        p.hold_status(CODEC.pack(_rollout_status(p.node_id, running=1, agent={"x": i})), dec)
    view = _manager_view([*peers, buffer])
    total = ManagerNode.cluster_refusals(view)
    assert total.bad == 3 and total.agent == {"x": 0 + 1 + 2 + 3} and dec.n == 4
    # every rollout pushes again (its agent refused once more): within the age, the heartbeat's
    # summaries read what they read, decoding nothing
    for i, p in enumerate(peers):
        p.hold_status(CODEC.pack(_rollout_status(p.node_id, running=1, agent={"x": i + 1})), dec)
    assert ManagerNode.cluster_refusals(view).agent == {"x": 6} and dec.n == 4
    assert serving_rollouts(peers, 16, SUMMARY_AGE_S) == {p.node_id: 8 for p in peers}
    assert dec.n == 4
    # past the age (0 here): the newest pushes, each decoded once
    assert serving_rollouts(peers, 16, 0.0) == {p.node_id: 8 for p in peers} and dec.n == 8
    assert ManagerNode.cluster_refusals(view).agent == {"x": 10} and dec.n == 8


def test_a_repack_round_lists_trajectories_only_for_its_candidates():
    full = _rollout_status("rollout-0", running=8)  # a full batch (B = 8): not a candidate
    tail = _rollout_status("rollout-1", running=2)  # a draining tail: a candidate
    peers = [Peer(node_id=s.node_id, role="rollout", identity=b"x", status=s) for s in (full, tail)]
    metrics, log = Metrics(), structlog.get_logger("test")
    srv = SimpleNamespace(peers={p.node_id: p for p in peers})
    placer = Placer(srv, 8, 1.0, metrics, log)  # type: ignore[arg-type]
    repack = config_from_dict({}).manager.repack
    rep = Repacker(srv, placer, repack, metrics, log, max_inflight=64)  # type: ignore[arg-type]
    loads = {r.node_id: r for r in rep.rollout_loads()}
    assert loads["rollout-0"].running == 8 and loads["rollout-0"].trajectories == ()
    assert [t.traj_id for t in loads["rollout-1"].trajectories] == ["rollout-1/0", "rollout-1/1"]
    assert [round(t.kv, 4) for t in loads["rollout-1"].trajectories] == [0.01, 0.0101]


def test_a_rollout_whose_engine_comes_up_is_listed_at_once_within_the_age():
    dec, p = _Decodes(), _peer("rollout-0")
    p.hold_status(CODEC.pack(_rollout_status("rollout-0", running=0, max_running=0)), dec)
    assert serving_rollouts([p], 16, SUMMARY_AGE_S) == {} and dec.n == 1
    # the engine is up: the next summary lists it although the last read is recent
    p.hold_status(CODEC.pack(_rollout_status("rollout-0", running=0, max_running=8)), dec)
    assert serving_rollouts([p], 16, SUMMARY_AGE_S) == {"rollout-0": 8} and dec.n == 2
    # it goes down: listed until the read ages out (its prompts are recovered if it died)
    p.hold_status(CODEC.pack(_rollout_status("rollout-0", running=0, max_running=0)), dec)
    assert serving_rollouts([p], 16, SUMMARY_AGE_S) == {"rollout-0": 8} and dec.n == 2
    assert serving_rollouts([p], 16, 0.0) == {} and dec.n == 3
