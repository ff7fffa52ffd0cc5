"""Every mode end to end (sim rollouts, sim trainer), and its staleness at consumption matches its
definition.

    .venv/bin/python -m pytest tests/test_modes.py -q

One LocalCluster per case (manager, buffer, 3 sim rollouts, sim trainer; optionally a relay),
run until the trainer has taken its steps. What is checked, from the trainer's own records
(run_dir/metrics.jsonl: per-step staleness histogram; consumed.jsonl: uids per step):

  sync      staleness 0 for every consumed trajectory
  one_step  staleness <= 1, and exactly 1 once the trainer is a step ahead (its definition)
  stream    staleness <= 1
  laminar   unbounded, but reported: the histogram covers every consumed trajectory
  laminar + buffer.max_staleness=1: no consumed trajectory has staleness > 1 (issue 4)
  partial   unbounded (AReaL's throughput setting), reported on the oldest token; the bound and
            the interrupts themselves: tests/test_partial_mode.py

and in every mode each trajectory is consumed at most once and every consumed group is whole.
"""

from __future__ import annotations

from collections import Counter

import pytest

from laminar.cluster import LocalCluster
from tests.sim_cluster import consumed, sim_config, staleness_hist, trainer_metrics

STEPS = 6


async def run_mode(tmp_path, mode: str, **over):
    # a step takes ~0.1 s (1 ms per token) and the buffer holds 16 trajectories (finished or
    # generating): the backlog stays short, so what is consumed shows whether rollouts refreshed
    over.setdefault("buffer", {}).setdefault("capacity", 16)
    cfg = sim_config(
        tmp_path,
        mode=mode,
        rollouts=3,
        total_steps=STEPS,
        trainer={"sim_time_per_token_s": 1e-3},
        **over,
    )
    async with LocalCluster(cfg) as cluster:
        await cluster.wait_trainer(timeout=90)
        buffer_stats = cluster.node("buffer-0").stats()
        versions_now = [r.gate.version for r in cluster.role("rollout")]
    return cfg, trainer_metrics(cfg), consumed(cfg), buffer_stats, versions_now


def traj_versions(metrics) -> set[int]:
    """Versions of the consumed trajectories: step k (trainer at version k - 1) with staleness s."""
    return {
        m["version"] - 1 - int(k.split("/")[1])
        for m in metrics
        for k in m
        if k.startswith("staleness_hist/")
    }


def check_exactly_once(cfg, steps) -> None:
    uids = [u for s in steps for u in s["uids"]]
    assert len(steps) == STEPS and uids
    assert [u for u, c in Counter(uids).items() if c > 1] == []
    groups = Counter(u.rpartition("/")[0] for u in uids)
    assert set(groups.values()) == {cfg.rollout.group_size}, "a consumed group was not whole"


@pytest.mark.parametrize(
    ("mode", "relays", "bound"),
    [
        ("sync", 0, 0),
        ("one_step", 0, 1),
        ("stream", 0, 1),
        ("laminar", 0, None),
        ("laminar", 1, None),
        ("partial", 0, None),
    ],
    ids=["sync", "one_step", "stream", "laminar", "laminar-relay", "partial"],
)
async def test_mode_runs_and_staleness_matches_definition(tmp_path, mode, relays, bound):
    cfg, metrics, steps, buf, versions_now = await run_mode(tmp_path, mode, relays=relays)
    check_exactly_once(cfg, steps)
    hist = staleness_hist(metrics)
    consumed_n = sum(len(s["uids"]) for s in steps)
    assert sum(hist.values()) == consumed_n, (
        "staleness must be reported for every consumed trajectory"
    )
    assert buf.staleness_consumed.count == consumed_n
    if bound is not None:
        assert max(hist) <= bound, f"{mode}: staleness {hist} exceeds its bound {bound}"
    if mode == "one_step":
        assert max(hist) == 1, f"one_step overlaps generation with training: {hist}"
    if mode == "laminar":
        # rollouts pull newer versions as they go idle: later steps train on refreshed rollouts'
        # work
        assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
        assert min(versions_now) >= 1, versions_now
        assert max(traj_versions(metrics)) >= 1, f"no refreshed rollout's work was consumed: {hist}"
    print(f"{mode} relays={relays}: staleness at consumption {dict(sorted(hist.items()))}")


async def test_laminar_with_max_staleness_1_never_consumes_older(tmp_path):
    cfg, metrics, steps, _, _ = await run_mode(tmp_path, "laminar", buffer={"max_staleness": 1})
    check_exactly_once(cfg, steps)
    hist = staleness_hist(metrics)
    assert hist and max(hist) <= 1, hist


@pytest.mark.parametrize("n", [64, 128])
def test_emulated_configs_are_the_cluster_bench_workload(tmp_path, n):
    """configs/emulated_N.yaml runs by hand what bench/cluster.py measures (laminar mode)."""
    import sys
    from pathlib import Path

    from laminar.config import load_config

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "bench"))
    from cluster_run import BenchParams, make_config

    bench = make_config("laminar", n, 0, BenchParams(), tmp_path, tmp_path).model_dump()
    conf = load_config(root / "configs" / f"emulated_{n}.yaml").model_dump()
    for section in ("rollout", "buffer"):
        assert conf[section] == bench[section], section
    for key in ("engine", "batch_groups", "sim_time_per_token_s"):
        assert conf["trainer"][key] == pytest.approx(bench["trainer"][key]), key
    assert conf["manager"]["repack"] == bench["manager"]["repack"]
    assert conf["cluster"]["roles"] == bench["cluster"]["roles"] and conf["mode"] == bench["mode"]
