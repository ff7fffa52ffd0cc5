"""Experience state machine: group release, dedup, lost-member policies, batches, commits, snapshots.

.venv/bin/python -m pytest tests/test_buffer_experience.py -q
"""

from __future__ import annotations

import numpy as np

from laminar.buffer.admission import Admission
from laminar.buffer.experience import ExperienceState
from laminar.buffer.journal import decode_record, encode_record
from laminar.protocol.data import PromptItem, Trajectory

N = 3


def state(
    policy: str = "release_partial", mode: str = "laminar", sampling: str = "fifo"
) -> ExperienceState:
    return ExperienceState(
        group_size=N,
        lost_member_policy=policy,
        admission=Admission.for_mode(mode, 2),
        sampling=sampling,
    )


def serve(st: ExperienceState, *gids: str, version: int = 0, rollout: str = "r0") -> None:
    items = [
        PromptItem(uid="u-" + g, group_id=g, prompt_ids=np.arange(2, dtype=np.int32), n=N)
        for g in gids
    ]
    st.apply(
        "served",
        {
            "rollout_id": rollout,
            "groups": [
                {"group_id": g, "n": N, "version": version, "item": i} for i, g in enumerate(gids)
            ],
        },
        items,
    )


def tr(
    gid: str, i: int, version: int = 0, reward: float | None = 1.0, reason: str = "stop"
) -> Trajectory:
    return Trajectory(
        uid=f"{gid}/{i}",
        group_id=gid,
        prompt_uid="u-" + gid,
        sample_index=i,
        prompt_ids=np.arange(2, dtype=np.int32),
        response_ids=np.arange(4, dtype=np.int32),
        logprobs=np.zeros(4, np.float32),
        version=version,
        reward=reward,
        finish_reason=reason,
    )


def arrive(st: ExperienceState, t: Trajectory) -> str:
    verdict, _ = st.check_trajectory(t)
    if verdict == "ok":
        st.apply("traj", {}, [t])
    return verdict


def test_group_released_when_all_members_arrive_and_dedup():
    st = state()
    serve(st, "g1")
    assert (st.pending, st.held) == (N, 0)
    assert arrive(st, tr("g1", 0)) == "ok" and arrive(st, tr("g1", 0)) == "duplicate"
    assert arrive(st, tr("g1", 2)) == "ok" and st.groups["g1"].state == "open"
    assert arrive(st, tr("g1", 1)) == "ok" and st.groups["g1"].state == "ready"
    assert (st.pending, st.held) == (0, N)
    assert arrive(st, tr("g1", 1)) == "duplicate"  # released: a resend is acked, stored once
    assert st.check_trajectory(tr("g1", 5))[0] == "bad"  # outside the group
    bad = tr("g1", 0)
    bad.logprobs = np.zeros(3, np.float32)
    assert st.check_trajectory(bad)[0] == "bad"


def test_release_partial_keeps_usable_members():
    st = state("release_partial")
    serve(st, "g")
    arrive(st, tr("g", 0))
    arrive(st, tr("g", 1, reward=None))  # reward failed: lost for good, but stored
    assert st.check_abandoned("g/2", "g")[0] == "ok"
    st.apply("abandon", {"group_id": "g", "sample_index": 2})
    grp = st.groups["g"]
    assert grp.state == "ready" and [t.sample_index for t in grp.usable_members()] == [0]
    assert (
        st.check_abandoned("g/2", "g")[0] == "ignore" and st.check_abandoned("h/2", "g")[0] == "bad"
    )
    serve(st, "all_bad")
    for i in range(N):
        arrive(st, tr("all_bad", i, reason="error"))
    assert "all_bad" not in st.groups and st.closed["all_bad"] == "dropped"
    assert (
        st.counts["dropped_no_usable_member"] == 1 and st.held == 2 and st.pending == 0
    )  # g holds 2


def test_drop_group_policy_drops_at_first_loss():
    st = state("drop_group")
    serve(st, "g")
    arrive(st, tr("g", 0))
    st.apply("abandon", {"group_id": "g", "sample_index": 1})
    assert st.closed["g"] == "dropped" and (st.held, st.pending) == (0, 0)
    assert arrive(st, tr("g", 2)) == "late"


def test_batches_commit_requeue_exactly_once():
    st = state()
    serve(st, "a", "b", "c")
    for gid in "abc":
        for i in range(N):
            arrive(st, tr(gid, i))
    plan = st.plan(2, 0, final=False)
    assert plan.take == ["a", "b"]  # FIFO by completion
    st.apply("batch", {"batch_id": "B1", "version": 0, "group_ids": plan.take})
    assert st.plan(2, 1, final=False).take == []  # only "c" is left
    st.apply("requeue", {"trainer_version": 0})  # the trainer restarted without committing B1
    assert st.plan(2, 0, final=False).take == ["a", "b"]  # back at the front
    st.apply("batch", {"batch_id": "B2", "version": 0, "group_ids": ["a", "b"]})
    st.apply(
        "commit", {"batch_id": "B1", "step": 1, "version": 1}
    )  # the dead trainer's batch: no effect
    assert st.groups["a"].state == "outstanding"
    st.apply("commit", {"batch_id": "B2", "step": 1, "version": 1})
    assert st.closed == {"a": "committed", "b": "committed"} and st.held == N
    assert arrive(st, tr("a", 0)) == "late"
    assert st.consumed_hist.total == 2 * N and st.trainer_version == 1 and st.next_version == 1


def test_lifo_and_random_sampling():
    st = state(sampling="lifo")
    serve(st, "a", "b", "c")
    for gid in "abc":
        for i in range(N):
            arrive(st, tr(gid, i))
    assert st.plan(2, 0, final=False).take == ["c", "b"]
    st2 = state(sampling="random")
    serve(st2, *"abcdefgh")
    for gid in "abcdefgh":
        for i in range(N):
            arrive(st2, tr(gid, i))
    take = st2.plan(8, 0, final=False).take
    assert sorted(take) == list("abcdefgh") and take != list("abcdefgh")


def test_snapshot_rebuilds_the_same_state():
    st = state()
    serve(st, "a", "b", "c", "d")
    for i in range(N):
        arrive(st, tr("a", i))
        arrive(st, tr("b", i, version=1))
    arrive(st, tr("c", 0))
    st.apply("abandon", {"group_id": "c", "sample_index": 2})
    st.apply("batch", {"batch_id": "B1", "version": 0, "group_ids": ["a"]})
    st.apply("batch", {"batch_id": "B0", "version": 0, "group_ids": ["b"]})
    st.apply("commit", {"batch_id": "B0", "step": 0, "version": 1})
    st.apply("drop", {"group_ids": ["d"], "reason": "expired"})
    st.apply("served", {"groups": [], "cursor": {"epoch": 2, "pos": 5, "serial": 9, "rows": 10}})
    again = state()
    for (
        kind,
        body,
        msgs,
    ) in st.snapshot():  # through the journal's encoding, as compaction writes it
        again.apply(*decode_record(encode_record(kind, body, msgs)[8:]))
    assert again.summary() == st.summary()
    assert again.closed == st.closed and again.cursor == st.cursor
    assert {g: s.state for g, s in again.groups.items()} == {"a": "outstanding", "c": "open"}
    assert again.groups["c"].lost == {2} and again.batches["B0"].state == "committed"
    assert again.finish_hist.counts == st.finish_hist.counts
    assert again.consumed_hist.counts == st.consumed_hist.counts
    again.apply("commit", {"batch_id": "B1", "step": 1, "version": 2})
    assert again.closed["a"] == "committed"
