"""Leases: a group served to a rollout that goes silent is served again to another, counted once.

    .venv/bin/python -m pytest tests/test_leases.py -q

The buffer's lease clock is injected (`buffer.leases.clock`), so a lease "runs out" by
moving a number, never by sleeping.
"""

from __future__ import annotations

from laminar.buffer.experience import OPEN, READY, Group
from laminar.buffer.leases import Leases
from laminar.protocol.buffer import TrajectoryAck
from tests.test_buffer_node import Harness, batch, finished, group_ids, make_cfg, prompts, stats


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_leases_expire_oldest_first_skip_the_holder_and_forget_closed_groups() -> None:
    clock = Clock()
    leases = Leases(10.0, clock)
    groups = {gid: Group(gid, "p", 2, 0, "r0", i) for i, gid in enumerate(["a", "b", "c"])}
    for g in groups.values():
        g.item = object()  # type: ignore[assignment]
        leases.served(g.group_id)
    clock.t += 5
    leases.touch("a")  # progress on a: its lease starts again
    assert leases.expired(groups, "r1", 10) == []
    clock.t += 6  # b and c: 11 s silent; a: 6 s
    assert [g.group_id for g in leases.expired(groups, "r1", 10)] == ["b", "c"]
    assert leases.expired(groups, "r0", 10) == []  # never back to its silent holder
    assert [g.group_id for g in leases.expired(groups, "r1", 1)] == ["b"]
    groups["b"].state = READY  # finished meanwhile: forgotten, never served again
    assert [g.group_id for g in leases.expired(groups, "r1", 10)] == ["c"]
    assert len(leases) == 2
    leases.touch("b")  # a late trajectory of a closed group does not bring its lease back
    assert len(leases) == 2
    clock.t += 20  # a and c silent again; one partial batch with progress on both (and on b)
    leases.touch_many(["a", "c", "b"])
    assert leases.expired(groups, "r1", 10) == [] and len(leases) == 2
    clock.t += 11
    assert [g.group_id for g in leases.expired(groups, "r1", 10)] == ["a", "c"]


def test_unstarted_groups_of_busy_holders_are_not_scanned_again_for_a_moment() -> None:
    """Old unstarted groups whose holders all keep asking: one scan finds no idle holder, and the
    requests of the next QUIET_S (at most a tenth of unstarted_s) do not look again; once a
    holder has been idle for unstarted_s, a request after that window gets its groups."""
    clock = Clock()
    leases = Leases(100.0, clock, unstarted_s=20.0)
    groups = {f"g{i}": Group(f"g{i}", "p", 2, 0, f"r{i % 2}", i) for i in range(6)}
    for g in groups.values():
        g.item = object()  # type: ignore[assignment]
        leases.served(g.group_id)
    clock.t += 25  # every group served 25 s ago, never started
    leases.asked("r0")
    leases.asked("r1")  # both holders busy
    assert leases.expired(groups, "r2", 10) == []
    clock.t += 21  # r1 asked again, r0 did not: r0 idle for 21 s
    leases.asked("r1")
    got = [g.group_id for g in leases.expired(groups, "r2", 10)]
    assert got == ["g0", "g2", "g4"]  # 21 s > the window (min(1, 2) s): served again
    leases.asked("r0")
    assert [g.group_id for g in leases.expired(groups, "r0", 10)] == []  # never to its holder
    # a window: no idle holder at t; r1 goes idle past unstarted_s within 1 s: seen after it
    leases2 = Leases(100.0, clock, unstarted_s=20.0)
    for g in groups.values():
        leases2.served(g.group_id)
    clock.t += 21
    leases2.asked("r0")
    leases2.asked("r1")
    clock.t += 19.5  # r1's ask 19.5 s ago: busy
    leases2.asked("r0")
    assert leases2.expired(groups, "r2", 10) == []  # quiet until +1 s
    clock.t += 0.6  # r1 idle for 20.1 s, inside the window: not looked at yet
    assert leases2.expired(groups, "r2", 10) == []
    clock.t += 0.5  # past the window
    assert [g.group_id for g in leases2.expired(groups, "r2", 10)] == ["g1", "g3", "g5"]


async def test_silent_rollout_group_is_served_again_once_and_counted_once(tmp_path) -> None:
    cfg = make_cfg(tmp_path, transport="ipc", buffer={"fsync": "batch", "lease_s": 60.0})
    h = await Harness(cfg).start()
    try:
        clock = Clock()
        h.buffer.leases.clock = clock
        r0, r1, r2 = await h.client("r0"), await h.client("r1"), await h.client("r2")
        tr = await h.client("t0", "trainer")
        (item,) = (await prompts(r0, 1, rid="r0")).items
        # r0 finishes one sample, then goes silent (it keeps heartbeating: the manager never
        # declares it dead)
        assert isinstance(await r0.request(finished(item, 0, 0, rollout="r0")), TrajectoryAck)
        clock.t += 59
        other = (await prompts(r1, 1, rid="r1")).items
        assert [it.group_id for it in other] != [item.group_id]  # still leased: r1 gets new work
        clock.t += 2  # 61 s without progress from r0
        again = await prompts(r2, 4, rid="r2", request_id="q1")
        assert [it.group_id for it in again.items] == [item.group_id]
        assert again.items[0].n == item.n and again.items[0].prompt == item.prompt
        # a retry of the same request gets the same group; nobody else gets it again
        retry = await prompts(r2, 4, rid="r2", request_id="q1")
        assert [it.group_id for it in retry.items] == [item.group_id]
        more = await prompts(r1, 4, rid="r1")
        assert item.group_id not in {it.group_id for it in more.items}
        st = h.buffer.state
        assert st.groups[item.group_id].rollout_id == "r2"
        assert st.counts["groups_reserved"] == 1
        # r2 generates every sample: sample 0 r0 already delivered (a duplicate); r2's sample
        # 1 completes the group; r0 wakes up and its late copy of sample 1 is acked, not stored
        assert item.n == 2
        dup = await r2.request(finished(item, 0, 0, rollout="r2"))
        assert isinstance(dup, TrajectoryAck) and dup.duplicate
        assert isinstance(await r2.request(finished(item, 1, 0, rollout="r2")), TrajectoryAck)
        late = await r0.request(finished(item, 1, 0, rollout="r0"))
        assert isinstance(late, TrajectoryAck) and late.duplicate
        g = st.groups[item.group_id]
        assert g.state == READY and len(g.members) == item.n
        assert [g.members[i].rollout_id for i in range(2)] == ["r0", "r2"]
        s = await stats(tr)
        assert s.held == item.n and s.counts["trajectories"] == item.n
        assert s.counters["trajectories_duplicate"] == 2
        b = await batch(tr, 0, groups=1)
        assert group_ids(b) == [item.group_id] and len(b.trajectories) == item.n
        assert len({t.uid for t in b.trajectories}) == item.n
    finally:
        await h.close()


async def test_lease_state_survives_a_buffer_restart(tmp_path) -> None:
    cfg = make_cfg(tmp_path, transport="ipc", buffer={"fsync": "batch", "lease_s": 60.0})
    h = await Harness(cfg).start()
    try:
        clock = Clock()
        h.buffer.leases.clock = clock
        r0, r1 = await h.client("r0"), await h.client("r1")
        a, b = (await prompts(r0, 2, rid="r0")).items
        clock.t += 61
        (moved,) = (await prompts(r1, 1, rid="r1")).items
        assert moved.group_id == a.group_id
        await h.stop_buffer()
        await h.start_buffer()
        st = h.buffer.state
        # the journal kept the new holder; every open group got a fresh lease at restart
        assert st.groups[a.group_id].rollout_id == "r1"
        assert st.groups[b.group_id].rollout_id == "r0"
        assert st.groups[b.group_id].state == OPEN and st.counts["groups_reserved"] == 1
        clock2 = Clock()
        clock2.t = h.buffer.leases.clock()  # the seeded leases are on the real clock
        h.buffer.leases.clock = clock2
        r2 = await h.client("r2")  # r1 is the same rollout: its client handshakes again
        clock2.t += 30
        assert isinstance(
            await r1.request(finished(a, 0, 0, rollout="r1")), TrajectoryAck
        )  # r1 progresses on a
        fresh = (await prompts(r2, 1, rid="r2")).items
        assert [it.group_id for it in fresh] not in ([a.group_id], [b.group_id])
        clock2.t += 31  # a: 31 s since r1's progress; b: 61 s since the restart
        (late,) = (await prompts(r2, 1, rid="r2")).items
        assert late.group_id == b.group_id  # r1 holds a: it is b that r0 left silent
        assert h.buffer.state.counts["groups_reserved"] == 2
    finally:
        await h.close()
