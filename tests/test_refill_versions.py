"""rollout.refill_versions (K) and repack's draining candidates (issue 44).

  .venv/bin/python -m pytest tests/test_refill_versions.py -q

* the gate: with K = 3 a busy rollout at version v takes prompts at v while the newest is v + 2
  and drains at v + 3; an idle one loads the newest at once; K = 0 drains for anything newer;
* the repack planner: a rollout that says it drains is a candidate while its KV still rises,
  and one that does not is never one, whatever its KV does;
* a cluster in mode laminar with K = 3: rollouts refill at their version while newer ones are
  out, no trajectory mixes versions, each is trained once.
"""

from __future__ import annotations

from collections import Counter

import structlog

from laminar.cluster import LocalCluster
from laminar.manager.repack import RolloutLoad, TrajLoad, is_candidate, plan_repack
from laminar.metrics import Metrics
from laminar.rollout.versions import VersionGate
from tests.sim_cluster import consumed, sim_config, trainer_metrics


class _Source:
    """A weights source whose newest version the test sets."""

    name = "test"
    last_source = "test"

    def __init__(self, newest: int) -> None:
        self.newest = newest

    def latest_version(self) -> int:
        return self.newest

    def announce(self, version: int) -> None:
        pass


class _Engine:
    version = 0


def gate(k: int, newest: int) -> tuple[VersionGate, _Source]:
    source = _Source(newest)
    g = VersionGate(
        source,  # type: ignore[arg-type]
        _Engine(),  # type: ignore[arg-type]
        auto_refresh=True,
        refill_versions=k,
        refresh_wait_s=1.0,
        notify=(),
        metrics=Metrics(),
        log=structlog.get_logger(),
    )
    return g, source


def test_a_busy_rollout_refills_until_the_newest_is_k_ahead():
    g, source = gate(3, newest=0)
    for newest in (1, 2):
        source.newest = newest
        assert not g.behind(), newest  # busy: keeps taking prompts at version 0
        assert g.target() == 0
        assert g.behind(idle=True) and g.target(idle=True) == newest  # dry: loads the newest
    source.newest = 3
    assert g.behind() and g.target() == 3  # v + K: stops asking and drains


def test_k_zero_drains_for_anything_newer():
    g, source = gate(0, newest=0)
    assert not g.behind()
    source.newest = 1
    assert g.behind() and g.target() == 1


def test_the_buffer_minimum_still_binds_within_the_budget():
    g, _ = gate(3, newest=1)
    assert not g.behind()
    g.require(1)  # buffer.max_staleness asks for it: hard, whatever K says
    assert g.behind() and g.target() == 1


def load(node: str, kv: float, *, rising: bool, draining: bool | None) -> RolloutLoad:
    return RolloutLoad(
        node_id=node,
        version=0,
        kv_use=kv,
        kv_rising=rising,
        running=2,
        waiting=0,
        trajectories=(TrajLoad(f"{node}-a", kv / 2), TrajLoad(f"{node}-b", kv / 2)),
        draining=draining,
    )


def test_a_draining_rollout_is_a_candidate_while_its_kv_rises():
    assert is_candidate(load("a", 0.2, rising=True, draining=True), 0.9, 8)
    assert not is_candidate(load("a", 0.2, rising=False, draining=False), 0.9, 8)
    # not reported: the KV rule stands in
    assert not is_candidate(load("a", 0.2, rising=True, draining=None), 0.9, 8)
    assert is_candidate(load("a", 0.2, rising=False, draining=None), 0.9, 8)
    # two draining tails, both rising: one is packed onto the other
    plan = plan_repack(
        [load("a", 0.2, rising=True, draining=True), load("b", 0.3, rising=True, draining=True)],
        0.9,
        8,
    )
    assert plan.emptied == ("a",) and plan.moves[0].dest == "b"


async def test_laminar_mode_refills_behind_the_newest_and_never_mixes_versions(tmp_path):
    # responses of ~80 tokens at 4 ms a step (~0.3 s) against trainer steps of ~0.1 s: versions
    # come out while a rollout is busy, so it refills at its own
    cfg = sim_config(
        tmp_path,
        mode="laminar",
        rollouts=2,
        total_steps=8,
        trainer={"sim_time_per_token_s": 1e-3},
        buffer={"capacity": 64},
        rollout={
            "refill_versions": 3,
            "refill_slots": 12,
            "max_running": 8,
            "sampling": {"max_tokens": 400},
            "sim": {"length_p50": 80, "step_time_s": 0.004, "kv_capacity_tokens": 8 * 420},
        },
    )
    async with LocalCluster(cfg) as cluster:
        await cluster.wait_trainer(timeout=90)
        rollouts = cluster.role("rollout")
        behind = sum(r.metrics.counters.get("refill_behind_newest", 0) for r in rollouts)
        mismatched = sum(r.metrics.counters.get("version_mismatch_events", 0) for r in rollouts)
    steps, metrics = consumed(cfg), trainer_metrics(cfg)
    uids = [u for s in steps for u in s["uids"]]
    assert len(steps) == 8 and uids and max(Counter(uids).values()) == 1
    assert behind > 0  # prompts were taken at a version older than the newest
    assert mismatched == 0
    assert sum(m.get("spanning_versions", 0) for m in metrics) == 0, metrics


async def test_split_repack_of_draining_tails_never_mixes_versions(tmp_path):
    # four rollouts with the bench's repack: draining candidates, sources spread over several
    # destinations, a round every 0.2 s; every trajectory still trains on one version, once
    cfg = sim_config(
        tmp_path,
        mode="laminar",
        rollouts=4,
        total_steps=10,
        trainer={"sim_time_per_token_s": 1e-3},
        buffer={"capacity": 128},
        rollout={
            "refill_versions": 3,
            "refill_slots": 12,
            "max_running": 8,
            "sampling": {"max_tokens": 400},
            "sim": {"length_p50": 80, "step_time_s": 0.004, "kv_capacity_tokens": 8 * 420},
        },
        manager={"repack": {"interval_s": 0.2, "candidates": "draining", "split_sources": True}},
    )
    async with LocalCluster(cfg) as cluster:
        await cluster.wait_trainer(timeout=120)
        rollouts = cluster.role("rollout")
        mismatched = sum(r.metrics.counters.get("version_mismatch_events", 0) for r in rollouts)
        rounds = cluster.node("manager-0").metrics.counters.get("repack_rounds", 0)
    steps, metrics = consumed(cfg), trainer_metrics(cfg)
    uids = [u for s in steps for u in s["uids"]]
    assert len(steps) == 10 and uids and max(Counter(uids).values()) == 1
    assert rounds > 0 and mismatched == 0
    assert sum(m.get("spanning_versions", 0) for m in metrics) == 0, metrics
