"""Experience state machine: group release, dedup, lost-member policies, batches, commits,
snapshots.

.venv/bin/python -m pytest tests/test_buffer_experience.py -q
"""

from __future__ import annotations

import numpy as np

from laminar.buffer.experience import ExperienceState
from laminar.buffer.journal_format import decode_record, encode_record
from laminar.buffer.records import (
    BatchCommitted,
    BatchesRequeued,
    BatchServed,
    GroupsDropped,
    GroupsServed,
    MemberAbandoned,
    PoolCursor,
    ServedGroup,
    TrajectoryAccepted,
)
from laminar.modes import Admission
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
    groups = [ServedGroup(it.group_id, it.uid, N, version, item=it) for it in items]
    st.apply(GroupsServed(groups, rollout_id=rollout))


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
        st.apply(TrajectoryAccepted(t))
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
    st.apply(MemberAbandoned("g", 2))
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
    st.apply(MemberAbandoned("g", 1))
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
    st.apply(BatchServed("B1", 0, plan.take))
    assert st.plan(2, 1, final=False).take == []  # only "c" is left
    st.apply(BatchesRequeued(0))  # the trainer restarted without committing B1
    assert st.plan(2, 0, final=False).take == ["a", "b"]  # back at the front
    st.apply(BatchServed("B2", 0, ["a", "b"]))
    st.apply(BatchCommitted("B1", 1, 1))  # the dead trainer's batch: no effect
    assert st.groups["a"].state == "outstanding"
    st.apply(BatchCommitted("B2", 1, 1))
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
    st.apply(MemberAbandoned("c", 2))
    st.apply(BatchServed("B1", 0, ["a"]))
    st.apply(BatchServed("B0", 0, ["b"]))
    st.apply(BatchCommitted("B0", 0, 1))
    st.apply(GroupsDropped(["d"], reason="expired"))
    st.apply(GroupsServed([], cursor=PoolCursor(epoch=2, pos=5, serial=9, rows=10)))
    again = state()
    for rec in st.snapshot():  # through the journal's encoding, as compaction writes it
        again.apply(decode_record(encode_record(rec)[8:]))
    assert again.summary() == st.summary()
    assert again.closed == st.closed and again.cursor == st.cursor
    assert {g: s.state for g, s in again.groups.items()} == {"a": "outstanding", "c": "open"}
    assert again.groups["c"].lost == {2} and again.batches["B0"].state == "committed"
    assert again.finish_hist.counts == st.finish_hist.counts
    assert again.consumed_hist.counts == st.consumed_hist.counts
    again.apply(BatchCommitted("B1", 1, 2))
    assert again.closed["a"] == "committed"


def test_open_and_unconsumed_counts_follow_every_change():
    """The open groups (count, and whether one is older than a version) and the unconsumed
    groups by version are kept as groups change (they are read per prompt request and per
    timed-out batch request): after every record of a random history, and after a snapshot
    rebuild, they are what a scan of the groups gives."""
    import random
    from collections import Counter

    def scanned(s: ExperienceState) -> tuple[int, Counter, list[bool]]:
        opened = [g for g in s.groups.values() if g.state == "open"]
        before = [any(g.version < v for g in opened) for v in range(5)]
        return len(opened), Counter(g.version for g in s.unconsumed()), before

    def kept(s: ExperienceState) -> tuple[int, Counter, list[bool]]:
        before = [s.open_before(v) for v in range(5)]
        return s.open_groups(), s.unconsumed_by_version(), before

    for seed in range(20):
        rng = random.Random(seed)
        st = state("drop_group" if seed % 4 == 0 else "release_partial")
        served, batch_n = 0, 0
        for _ in range(300):
            op = rng.random()
            live = list(st.groups.values())
            opened = [g for g in live if g.state == "open"]
            if op < 0.15 or not live:
                served += 1
                serve(st, f"g{served}", version=rng.randrange(4))
            elif op < 0.6 and opened:
                g = rng.choice(opened)
                i = rng.randrange(N)
                # a member may be older or newer than the version its group was served at
                arrive(st, tr(g.group_id, i, version=rng.randrange(4)))
            elif op < 0.68 and opened:
                g = rng.choice(opened)
                i = rng.randrange(N)
                if st.check_abandoned(f"{g.group_id}/{i}", g.group_id)[0] == "ok":
                    st.apply(MemberAbandoned(g.group_id, i))
            elif op < 0.74:
                st.apply(GroupsDropped([rng.choice(live).group_id], reason="expired"))
            elif op < 0.86:
                take = st.plan(2, st.next_version, final=False).take
                if take:
                    batch_n += 1
                    st.apply(BatchServed(f"B{batch_n}", st.next_version, take))
            elif op < 0.95 and st.outstanding():
                b = rng.choice(st.outstanding())
                st.apply(BatchCommitted(b.batch_id, b.version + 1, batch_n))
            else:
                st.apply(BatchesRequeued(st.trainer_version))
            assert kept(st) == scanned(st)
        again = state(st.policy)
        for rec in st.snapshot():
            again.apply(decode_record(encode_record(rec)[8:]))
        assert kept(again) == scanned(again) == kept(st)
