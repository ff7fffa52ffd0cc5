"""Manager node: `laminar status`, repack moves on a live cluster, placement fallbacks, recovery,
rejoin.

    .venv/bin/python -m pytest tests/test_manager.py -q

Everything runs in this process (LocalCluster: manager, buffer, sim rollouts; no trainer, so
every rollout stays at version 0 unless a test says otherwise). Sim response lengths are
fixed (p99/p50 = 1) so a test knows how long each trajectory runs and what its tokens are.
The planner itself is tested in tests/test_repack.py; here the manager executes real plans.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from laminar.cluster import LocalCluster
from laminar.config import write_resolved
from laminar.engines.sim import _hash64, sim_tokens
from laminar.protocol.rollout import ExportRequest, RefreshRequest
from tests.sim_cluster import merge, sim_config, wait_for

LENGTH = 400  # tokens per response, at 2 ms a step: 0.8 s of decoding


def long_config(tmp: Path, rollouts: int = 3, **over):
    """Rollouts that each hold one group of 2 samples of exactly LENGTH tokens (2 < B = 8)."""
    base = {
        "cluster": {"roles": {"trainer": 0}},
        "manager": {"repack": {"interval_s": 3600}},
        "rollout": {
            "credits": 1,
            "sampling": {"max_tokens": 1000},
            "sim": {"length_p50": LENGTH, "length_p99_over_p50": 1.0, "kv_capacity_tokens": 8000},
        },
    }
    return sim_config(tmp, rollouts=rollouts, total_steps=1, **merge(base, over))


def stored(buffer) -> dict:
    """uid -> finished Trajectory held by the buffer."""
    return {t.uid: t for g in buffer.state.groups.values() for t in g.members.values()}


def running(node) -> set[str]:
    return set(node.table.seqs)


def check_tokens(cfg, t) -> None:
    """A trajectory that moved keeps exactly the tokens it would have had without moving."""
    assert len(t.response_ids) == LENGTH and len(t.logprobs) == LENGTH
    ids, lps = sim_tokens(
        _hash64("tok", cfg.rollout.sim.seed, t.uid), 0, LENGTH, cfg.rollout.sim.vocab_size
    )
    np.testing.assert_array_equal(t.response_ids, ids)
    np.testing.assert_array_equal(t.logprobs, lps)


async def all_running(cluster, n_each: int = 2) -> None:
    mgr = cluster.node("manager-0")

    def ok() -> bool:
        peers = mgr._live("rollout")
        return len(peers) == len(cluster.role("rollout")) and all(
            p.status is not None and p.status.running == n_each for p in peers
        )

    await wait_for(ok, 20, "every rollout reporting its group running", cluster)


# ---- laminar status --------------------------------------------------------------------------


async def test_status_cli_lists_every_node_with_its_columns(tmp_path, short_dir):
    cfg = sim_config(
        tmp_path,
        rollouts=2,
        net="ipc",
        cluster={"ipc_dir": str(short_dir)},
        trainer={"total_steps": 1000, "sim_time_per_token_s": 1e-4},
    )
    async with LocalCluster(cfg, transport="ipc") as cluster:
        path = write_resolved(cluster.cfg, tmp_path / "status")
        await wait_for(
            lambda: cluster.node("trainer-0").version >= 1, 30, "a trainer step", cluster
        )
        await all_ready(cluster)

        async def cli(*extra: str) -> str:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "laminar",
                "status",
                "--config",
                str(path),
                *extra,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            return out.decode()

        doc = json.loads(await cli("--json"))
        table = await cli()
    assert doc["mode"] == "laminar" and doc["trainer_version"] >= 1
    rows = {r["node"]: r for r in doc["nodes"]}
    assert set(rows) == {"manager-0", "buffer-0", "trainer-0", "rollout-0", "rollout-1"}
    assert rows["manager-0"]["version"] == doc["trainer_version"]  # the manager is a row too
    for r in rows.values():
        assert {
            "node",
            "role",
            "alive",
            "version",
            "kv_use",
            "inflight",
            "staleness",
            "last_beat_s",
            "pid",
        } <= set(r)
        assert r["alive"] and 0 <= r["last_beat_s"] < 5 and r["role"] == r["node"].split("-")[0]
    for name in ("rollout-0", "rollout-1"):
        r = rows[name]
        assert 0.0 <= r["kv_use"] <= 1.0 and r["version"] >= 0 and r["inflight"] >= 0
        assert (
            r["staleness"] == doc["trainer_version"] - r["version"]
        )  # versions behind the trainer
    assert rows["trainer-0"]["version"] >= 1
    lines = table.strip().splitlines()
    assert lines[0].split() == [
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
    assert sorted(line.split()[0] for line in lines[1:]) == sorted(rows)
    # an honest run: nothing refused anywhere, no rollout served other weights
    assert all(
        r["unauthorized"] == r["bad"] == r["refused_trajectories"] == 0 for r in rows.values()
    )
    assert all(r["attest_mismatches"] == 0 for r in rows.values())
    assert all(r["deaths"] == 0 and r["last_death_s"] == -1 for r in rows.values())


async def test_status_shows_a_rollout_the_manager_declared_dead(tmp_path, monkeypatch, capsys):
    """While the manager holds a rollout dead it reads DEAD; once the id is back (a stall ends,
    or here a new process) it is alive again, and `deaths` and a WARNING still say it was
    declared dead, although the launcher restarted nothing (it used to read alive, restarts 0)."""
    import laminar.launch.status as status_cli
    from laminar.protocol.manager import StatusReply

    cfg = sim_config(tmp_path, rollouts=1, total_steps=1, cluster={"roles": {"trainer": 0}})
    monkeypatch.setattr("laminar.logs.configure_logging", lambda *a, **k: None)  # keep ours

    def table(reply: StatusReply) -> tuple[dict, list[str]]:
        monkeypatch.setattr(status_cli, "fetch_status", lambda cfg, timeout: reply)
        capsys.readouterr()  # the cluster's log lines so far
        assert status_cli.status_main(None, [], as_json=True, timeout=1.0) == 0
        rows = {r["node"]: r for r in json.loads(capsys.readouterr().out)["nodes"]}
        assert status_cli.status_main(None, [], as_json=False, timeout=1.0) == 0
        return rows["rollout-0"], capsys.readouterr().out.splitlines()

    async with LocalCluster(cfg) as cluster:
        mgr = cluster.node("manager-0")
        await all_ready(cluster)
        cluster.node("rollout-0").say_bye = False  # a crash: no Bye
        await cluster.kill_node("rollout-0")
        await wait_for(
            lambda: not mgr.srv.peers["rollout-0"].alive, 10, "rollout-0 declared dead", cluster
        )
        dead = StatusReply(nodes=mgr.members(), trainer_version=0, mode="laminar")
        await cluster.add("rollout", 0)
        await wait_for(lambda: mgr.srv.peers["rollout-0"].alive, 10, "rollout-0 back", cluster)
        back = StatusReply(nodes=mgr.members(), trainer_version=0, mode="laminar")
    row, text = table(dead)
    assert not row["alive"] and row["deaths"] == 1 and row["last_death_s"] >= 0
    assert "deaths" in text[0].split()
    line = next(t.split() for t in text if t.startswith("rollout-0 "))
    assert line[2] == "DEAD" and line[text[0].split().index("deaths")] == "1"
    assert any(t.startswith("WARNING rollout-0: declared dead") for t in text)
    row, text = table(back)
    assert row["alive"] and row["deaths"] == 1 and row["restarts"] == 0
    assert any("declared dead" in w for w in row["warnings"])
    line = next(t.split() for t in text if t.startswith("rollout-0 "))
    assert line[2] == "yes"
    assert any(t.startswith("WARNING rollout-0: declared dead") for t in text)


async def all_ready(cluster) -> None:
    mgr = cluster.node("manager-0")
    want = {n.node_id for n in cluster.nodes.values() if n.role != "manager"}
    await wait_for(
        lambda: {p.node_id for p in mgr.srv.peers.values() if p.alive and p.status} >= want,
        20,
        "every node beating",
        cluster,
    )


# ---- repack on a live cluster ------------------------------------------------------------------


async def test_repack_consolidates_draining_rollouts_and_frees_the_sources(tmp_path):
    cfg = long_config(tmp_path)
    async with LocalCluster(cfg) as cluster:
        mgr, buf = cluster.node("manager-0"), cluster.node("buffer-0")
        rollouts = {n.node_id: n for n in cluster.role("rollout")}
        await all_running(cluster)
        before = {k: running(n) for k, n in rollouts.items()}
        # the previous round's KV: no heartbeat in between, so nothing is "rising"
        mgr.repacker.rollout_loads()
        entry = await mgr.repack_once()
        # 3 candidates of 2 sequences, B = 8: the two emptiest go to the third one
        assert entry["moves"] == 2 and entry["trajectories"] == 4 and entry["failed"] == 0, entry
        dest = next(k for k in rollouts if k not in entry["emptied"])
        moved = set().union(*(before[k] for k in entry["emptied"]))
        assert running(rollouts[dest]) == before[dest] | moved
        # the emptied sources take new prompts at once (same version: nothing to load first)
        await wait_for(
            lambda: all(
                running(rollouts[k]) and not running(rollouts[k]) & moved for k in entry["emptied"]
            ),
            10,
            "sources running new groups",
            cluster,
        )
        await wait_for(
            lambda: moved | before[dest] <= set(stored(buf)),
            30,
            "moved trajectories finishing",
            cluster,
        )
        done = stored(buf)
        for uid in moved:
            assert done[uid].rollout_id == dest and done[uid].resumed == 1
            check_tokens(cfg, done[uid])
        assert mgr.metrics.counters.get("restarted_from_prompt", 0) == 0


async def test_repack_fires_on_its_own_while_rollouts_drain_long_tails(tmp_path):
    """No trainer, so no new versions: rollouts refill their credits as groups finish, and the
    periodic rounds find the ones draining a group's tail (running < B, nothing waiting, KV not
    rising since the last round) and consolidate them. Moved trajectories keep their tokens."""
    cfg = sim_config(
        tmp_path,
        rollouts=6,
        cluster={"roles": {"trainer": 0}},
        rollout={
            "credits": 2,
            "group_size": 4,
            "partial_chunk_tokens": 32,
            "sampling": {"max_tokens": 600},
            "sim": {
                "step_time_s": 0.002,
                "length_p50": 40,
                "length_p99_over_p50": 10,
                "kv_capacity_tokens": 8 * 620,
            },
        },
        manager={"repack": {"interval_s": 0.25}},
    )
    async with LocalCluster(cfg) as cluster:
        mgr, buf = cluster.node("manager-0"), cluster.node("buffer-0")
        await wait_for(
            lambda: sum(e["trajectories"] for e in mgr.repack_log) >= 8,
            30,
            "repack rounds moving work",
            cluster,
        )
        moved_rounds = [e for e in mgr.repack_log if e["moves"]]
        assert all(e["failed"] == 0 for e in moved_rounds), moved_rounds
        await wait_for(
            lambda: any(t.resumed for t in stored(buf).values()),
            20,
            "a moved trajectory finishing",
            cluster,
        )
        resumed = [t for t in stored(buf).values() if t.resumed]
        for t in resumed:
            ids, lps = sim_tokens(
                _hash64("tok", cfg.rollout.sim.seed, t.uid),
                0,
                len(t.response_ids),
                cfg.rollout.sim.vocab_size,
            )
            np.testing.assert_array_equal(t.response_ids, ids)
            np.testing.assert_array_equal(t.logprobs, lps)
    print(
        f"{len(moved_rounds)} rounds moved {sum(e['trajectories'] for e in moved_rounds)} "
        f"trajectories; {len(resumed)} moved ones finished with their tokens"
    )


async def test_a_stale_destination_falls_back_and_an_unheld_version_restarts_from_the_prompt(
    tmp_path,
):
    cfg = long_config(tmp_path)
    async with LocalCluster(cfg) as cluster:
        mgr, buf = cluster.node("manager-0"), cluster.node("buffer-0")
        await all_running(cluster)
        # rollout-1 moves on to version 3 (it drains its group first, then loads and takes new
        # prompts)
        await mgr.srv.request("rollout-1", RefreshRequest(min_version=3))
        await wait_for(
            lambda: (
                cluster.node("rollout-1").gate.version == 3 and running(cluster.node("rollout-1"))
            ),
            20,
            "rollout-1 at version 3",
            cluster,
        )
        exp = await mgr.srv.request("rollout-0", ExportRequest(uids=[]))
        assert len(exp.partials) == 2 and all(p.version == 0 for p in exp.partials)
        # the manager's view of rollout-1 is a beat old: it still says version 0
        mgr.srv.peers["rollout-1"].status.version = 0
        placed = await mgr.placer.place(
            exp.partials, mgr.trainer_version, prefer="rollout-1", source="rollout-0"
        )
        assert placed == {"rollout-2": 2}, placed
        assert (
            mgr.metrics.counters["import_version_mismatch"] == 1 and "rollout-1" in mgr.placer.stale
        )
        await wait_for(
            lambda: {p.uid for p in exp.partials} <= set(stored(buf)),
            30,
            "placed partials finishing",
            cluster,
        )
        for p in exp.partials:
            check_tokens(cfg, stored(buf)[p.uid])
        # a version nobody holds any more: start over from the prompt on a rollout of the newest
        # version
        await wait_for(
            lambda: mgr.srv.peers["rollout-1"].status.version == 3, 5, "a fresh beat", cluster
        )
        await wait_for(
            lambda: running(cluster.node("rollout-2")), 10, "rollout-2 running a group", cluster
        )
        exp2 = await mgr.srv.request("rollout-2", ExportRequest(uids=[]))
        assert exp2.partials
        for p in exp2.partials:
            p.version = 1
        placed2 = await mgr.placer.place(exp2.partials, mgr.trainer_version)
        # rollout-1 holds version 3; rollout-0, emptied by the first export, may have pulled it too
        # while idle, and then wins as the less loaded one: either is a rollout of the newest
        # version
        (dest,) = placed2
        assert placed2[dest] == len(exp2.partials) and dest != "rollout-2", placed2
        assert cluster.node(dest).gate.version == 3, (dest, cluster.node(dest).gate.version)
        assert mgr.metrics.counters["restarted_from_prompt"] == len(exp2.partials)
        await wait_for(
            lambda: {p.uid for p in exp2.partials} <= set(stored(buf)),
            30,
            "restarted ones finishing",
            cluster,
        )
        for p in exp2.partials:
            t = stored(buf)[p.uid]
            assert t.version == 3 and t.resumed >= 1
            check_tokens(cfg, t)
        counts = Counter(t.uid for g in buf.state.groups.values() for t in g.members.values())
        assert max(counts.values()) == 1


# ---- recovery ---------------------------------------------------------------------------------


async def test_a_dead_rollouts_trajectories_resume_elsewhere_with_their_tokens(tmp_path):
    # a flush window well inside the 0.8 s a response takes: its second flush lands mid-response
    cfg = long_config(tmp_path, rollout={"partial_chunk_tokens": 16, "partial_flush_s": 0.5})
    async with LocalCluster(cfg) as cluster:
        mgr, buf = cluster.node("manager-0"), cluster.node("buffer-0")
        await all_running(cluster)
        victim = cluster.node("rollout-0")
        lost = running(victim)
        await wait_for(
            lambda: all((buf.partials.length(u) or 0) >= 32 for u in lost),
            10,
            "tokens in the partial pool",
            cluster,
        )
        victim.say_bye = False  # a crash: no Bye, no drain
        await cluster.kill_node("rollout-0")
        took = await wait_for(lambda: mgr.recovery_log, 10, "recovery of rollout-0", cluster)
        assert took < 4.0  # 2 s to declare the death, then one buffer query and one import
        entry = mgr.recovery_log[0]
        assert (
            entry["rollout"] == "rollout-0" and entry["trajectories"] == 2 and entry["tokens"] >= 64
        ), entry
        await wait_for(
            lambda: lost <= set(stored(buf)), 30, "recovered trajectories finishing", cluster
        )
        for uid in lost:
            t = stored(buf)[uid]
            assert t.rollout_id != "rollout-0" and t.resumed == 1
            check_tokens(cfg, t)


async def test_an_export_nobody_placed_is_found_by_reconciliation_and_resumes_with_its_tokens(
    tmp_path,
):
    """A repack move's export whose placement never came (the manager died, or lost the reply,
    between export and import): the source forgot the samples and the buffer still puts them on
    it. The reconciliation finds them within two rounds and they resume elsewhere, token for
    token, instead of waiting for their group's lease (600 s)."""
    cfg = long_config(
        tmp_path,
        rollout={"partial_chunk_tokens": 16, "partial_flush_s": 0.5},
        manager={"reconcile_interval_s": 0.5},
    )
    async with LocalCluster(cfg) as cluster:
        mgr, buf = cluster.node("manager-0"), cluster.node("buffer-0")
        await all_running(cluster)
        lost = running(cluster.node("rollout-0"))
        await wait_for(
            lambda: all((buf.partials.length(u) or 0) >= 32 for u in lost),
            10,
            "tokens in the partial pool",
            cluster,
        )
        # the move's first half, as the repacker sends it; its second half never comes
        rep = await mgr.srv.request("rollout-0", ExportRequest(uids=sorted(lost)), timeout=5.0)
        assert {p.uid for p in rep.partials} == lost and not running(cluster.node("rollout-0"))
        took = await wait_for(
            lambda: mgr.metrics.counters.get("reconciled_stranded", 0) == len(lost),
            10,
            "the stranded samples found",
            cluster,
        )
        assert took < 5.0  # two rounds 0.5 s apart, each on a newer status
        await wait_for(lambda: lost <= set(stored(buf)), 30, "them finishing", cluster)
        for uid in lost:
            t = stored(buf)[uid]
            assert t.resumed == 1
            check_tokens(cfg, t)
        assert mgr.metrics.counters["reconciled_stranded"] == len(lost)  # found once


async def test_a_rollout_that_stops_gracefully_hands_over_its_unfinished_work(tmp_path):
    cfg = long_config(tmp_path, transport={"stop_timeout_s": 1.0})
    async with LocalCluster(cfg) as cluster:
        mgr, buf = cluster.node("manager-0"), cluster.node("buffer-0")
        await all_running(cluster)
        left = running(cluster.node("rollout-1"))
        await cluster.stop_node("rollout-1")  # drains for half the stop budget, then says Bye
        await wait_for(
            lambda: any(e["rollout"] == "rollout-1" for e in mgr.recovery_log),
            10,
            "recovery after the leave",
            cluster,
        )
        await wait_for(
            lambda: left <= set(stored(buf)), 30, "handed-over trajectories finishing", cluster
        )
        assert mgr.metrics.counters["leaves"] >= 1
        for uid in left:
            check_tokens(cfg, stored(buf)[uid])


async def test_a_restarted_rollout_is_readmitted_and_its_old_work_recovered(tmp_path):
    cfg = long_config(tmp_path)
    async with LocalCluster(cfg) as cluster:
        mgr, buf = cluster.node("manager-0"), cluster.node("buffer-0")
        await all_running(cluster)
        old = running(cluster.node("rollout-2"))
        cluster.node("rollout-2").say_bye = False
        await cluster.kill_node("rollout-2")
        # back at once, before its death could be noticed: a new incarnation under the same id
        new = await cluster.add("rollout", 2)
        await wait_for(
            lambda: any(e["rollout"] == "rollout-2" for e in mgr.recovery_log),
            10,
            "recovery of the old incarnation",
            cluster,
        )
        # normally the new incarnation's hello beats the 2 s death detector ("restarted"); on a
        # loaded box the death may be noticed first ("dead"): either way, recovered once
        c = mgr.metrics.counters
        assert c.get("restarts_unnoticed", 0) + c.get("deaths", 0) >= 1 and c["rejoins"] >= 1
        peer = mgr.srv.peers["rollout-2"]
        assert peer.alive
        await wait_for(
            lambda: running(new) - old, 10, "the restarted rollout taking new prompts", cluster
        )
        await wait_for(
            lambda: old <= set(stored(buf)), 30, "the old incarnation's work finishing", cluster
        )
        counts = Counter(t.uid for g in buf.state.groups.values() for t in g.members.values())
        assert max(counts.values()) == 1
        assert len([e for e in mgr.recovery_log if e["rollout"] == "rollout-2"]) == 1
        for uid in old:
            check_tokens(cfg, stored(buf)[uid])


# ---- a fresh view for the planner; concurrent moves -------------------------------------------


async def test_a_rollout_pushes_its_status_when_it_changes_not_only_on_the_beat(tmp_path):
    """Repack plans from the rollouts' statuses: one a beat old lists trajectories that finished or
    moved meanwhile. Here beats come every 5 s, yet the manager sees an export within a moment."""
    cfg = long_config(tmp_path, transport={"heartbeat_interval_s": 5.0})
    async with LocalCluster(cfg) as cluster:
        mgr = cluster.node("manager-0")
        await all_running(cluster)  # (the first statuses came as pushes too: no beat yet)
        exp = await mgr.srv.request("rollout-0", ExportRequest(uids=[]))
        gone = {p.uid for p in exp.partials}
        assert len(gone) == 2

        def view_updated() -> bool:
            s = mgr.srv.peers["rollout-0"].status
            return s.rollout is not None and not gone & set(s.rollout.traj_tokens)

        await wait_for(
            view_updated, 2.0, "the export in the manager's view, before any beat", cluster
        )
        assert cluster.node("rollout-0").metrics.counters["status_pushed"] >= 2
        await mgr.placer.place(
            exp.partials, mgr.trainer_version, prefer="rollout-1", source="rollout-0"
        )  # (hand them back)


async def test_concurrent_rounds_on_the_same_view_never_move_a_trajectory_twice(tmp_path):
    """Two rounds planned from the same statuses run their moves at once (the worst case of a
    stale view): each trajectory ends up running on exactly one rollout and finishes once."""
    cfg = long_config(tmp_path)
    async with LocalCluster(cfg) as cluster:
        mgr, buf = cluster.node("manager-0"), cluster.node("buffer-0")
        rollouts = cluster.role("rollout")
        await all_running(cluster)
        before = set().union(*(running(n) for n in rollouts))
        mgr.repacker.rollout_loads()  # the previous round's KV: nothing "rising"
        a, b = await asyncio.gather(mgr.repack_once(), mgr.repack_once())
        assert a["moves"] == b["moves"] == 2, (a, b)  # the same plan twice
        assert a["trajectories"] + b["trajectories"] == 4  # each trajectory exported once
        holders = Counter(u for n in rollouts for u in running(n) if u in before)
        assert max(holders.values()) == 1 and set(holders) | set(stored(buf)) >= before, holders
        await wait_for(
            lambda: before <= set(stored(buf)), 30, "every trajectory finishing", cluster
        )
        counts = Counter(t.uid for g in buf.state.groups.values() for t in g.members.values())
        assert max(counts.values()) == 1
        for uid in before:
            check_tokens(cfg, stored(buf)[uid])


async def test_a_rounds_moves_run_concurrently_up_to_the_bound(tmp_path):
    """manager.repack.max_concurrent_moves caps the moves in flight; every move still runs."""
    cfg = long_config(tmp_path, rollouts=5, manager={"repack": {"max_concurrent_moves": 1}})
    async with LocalCluster(cfg) as cluster:
        mgr = cluster.node("manager-0")
        await all_running(cluster)
        inner, now, peak = mgr.repacker.move_parts, 0, 0

        async def counted(mvs, refresh, trainer_version):  # one source's moves (one unsplit)
            nonlocal now, peak
            now += 1
            peak = max(peak, now)
            try:
                return await inner(mvs, refresh, trainer_version)
            finally:
                now -= 1

        mgr.repacker.move_parts = counted
        mgr.repacker.rollout_loads()  # the previous round's KV: nothing "rising"
        entry = await mgr.repack_once()
        # 5 candidates of 2 sequences, B = 8: three sources go to one destination, one stays
        assert entry["moves"] == 3 and entry["trajectories"] == 6 and entry["failed"] == 0, entry
        assert peak == 1
