"""A split repack source on the manager side (manager.repack.split_sources, issue 44).

    .venv/bin/python -m pytest tests/test_repack_moves.py -q

The planner may spread one draining source over several destinations (one Move each); the
Repacker then runs them in turn, each export naming its own destination (where that share's
agents look first) and its share placed there, and sends the emptied source one RefreshRequest
after everything is placed (a refresh between two moves would load new weights under
trajectories still to be exported).
"""

from __future__ import annotations

from laminar.manager.repack import Move
from laminar.protocol.core import NodeStatus
from laminar.protocol.rollout import (
    ExportReply,
    ExportRequest,
    ImportReply,
    ImportRequest,
    RefreshReply,
    RefreshRequest,
)
from tests.test_claims import _partial, _repacker, _Server


async def test_a_split_source_is_moved_share_by_share_and_refreshed_once_after():
    statuses = [
        NodeStatus(node_id=f"rollout-{i}", role="rollout", version=0, running=2, inflight=2)
        for i in range(3)
    ]
    uids = ("g/0", "g/1", "h/0")
    replies = {
        ImportRequest: ImportReply(accepted=list(uids)),
        RefreshRequest: RefreshReply(version=1, pending=False),
    }
    rep, _ = _repacker(statuses, bound=64, replies=replies)
    srv: _Server = rep.srv  # type: ignore[assignment]
    answer = srv.request

    async def request(node_id: str, msg: object, timeout: float | None = None) -> object:
        if isinstance(msg, ExportRequest):  # the source hands over what it was asked for
            srv.sent.append((node_id, msg))
            return ExportReply(partials=[_partial(u) for u in msg.uids])
        return await answer(node_id, msg, timeout)

    srv.request = request  # type: ignore[method-assign]
    mvs = [
        Move(source="rollout-0", dest="rollout-1", traj_ids=("g/0", "h/0"), version=0),
        Move(source="rollout-0", dest="rollout-2", traj_ids=("g/1",), version=0),
    ]
    out = await rep.move_parts(mvs, refresh=True, trainer_version=1)
    kinds = [(node, type(m).__name__) for node, m in srv.sent]
    # one export per share, each naming its own destination (its agents look there first)
    exports = [(n, m.dest, sorted(m.uids)) for n, m in srv.sent if isinstance(m, ExportRequest)]
    assert exports == [
        ("rollout-0", "rollout-1", ["g/0", "h/0"]),
        ("rollout-0", "rollout-2", ["g/1"]),
    ]
    sent = [(n, m) for n, m in srv.sent if isinstance(m, ImportRequest)]
    imports = {n: sorted(p.uid for p in m.partials) for n, m in sent}
    assert imports == {"rollout-1": ["g/0", "h/0"], "rollout-2": ["g/1"]}
    # the source refreshes once, after the last import
    assert kinds[-1] == ("rollout-0", "RefreshRequest")
    assert sum(k[1] == "RefreshRequest" for k in kinds) == 1
    assert out == {"moved": 3, "failed": 0, "elsewhere": 0, "orphaned": 0}
