"""Cheap checks of the reliability benches' offline parts (the benches themselves run minutes).

.venv/bin/python -m pytest tests/test_bench_tools.py -q
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import chaos  # noqa: E402
import cp_figures  # noqa: E402
import cp_node  # noqa: E402
import cp_workload  # noqa: E402


def _sim_row(rollouts: int, gen_tok_s: float, finished: int) -> dict:
    """A 1024-GPU laminar row of bench/simulate.py's results: 5 steps of 10 s measured."""
    return {
        "rollouts": rollouts,
        "gen_tok_s": {"median": gen_tok_s},
        "iteration_s": {"median": 10.0},
        "counts": {"steps_measured": 5},
        "staleness_finished": {"count": finished},
    }


def test_1024_gpu_rates_follow_the_simulator_results(tmp_path):
    row = _sim_row(128, 320_000.0, 5000)
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"results": {"32B": {"64": {}, "1024": {"laminar": row}}}}))
    rates = cp_workload.workload_rates(path)
    assert list(rates) == ["32B"]
    r = rates["32B"]
    # a 32B sequence decodes 40 tokens/s: an entry every second flush window, with 40 tokens
    assert r["entry_tokens"] == pytest.approx(40.0)
    assert r["chunks_s"] == pytest.approx(320_000 / 40)
    assert r["trajectories_s"] == pytest.approx(5000 / 50)
    assert r["heartbeats_s"] == pytest.approx(128 / cp_workload.HEARTBEAT_S)
    assert r["status_pushes_s"] == pytest.approx(128 / cp_workload.STATUS_PUSH_MIN_S)


def test_a_partial_entry_carries_what_its_sequence_decoded_in_a_flush_window():
    # faster than a chunk a window: one entry a window with all of it
    assert cp_workload.entry_tokens(100.0, 0.5, 32) == pytest.approx(50.0)
    assert cp_workload.entry_tokens(100.0, 1.0, 32) == pytest.approx(100.0)
    # exactly a chunk a window, and slower: an entry once a chunk is in, at the next window
    assert cp_workload.entry_tokens(64.0, 0.5, 32) == pytest.approx(32.0)
    assert cp_workload.entry_tokens(20.0, 0.5, 32) == pytest.approx(40.0)  # every 4th window
    assert cp_workload.entry_tokens(0.0, 0.5, 32) == 32.0


def test_a_multi_turn_row_adds_an_entry_per_tool_call(tmp_path):
    row = _sim_row(256, 1_000_000.0, 10_000)
    path = tmp_path / "sim.json"
    path.write_text(
        json.dumps({"multiturn": {"model": "7B", "results": {"1024": {"laminar": row}}}})
    )
    r = cp_workload.workload_rates(path)["7B_multiturn"]
    calls = cp_workload.tool_calls_per_trajectory("7B_multiturn")
    assert 3.0 < calls < 3.5  # p_call 0.8, at most 8 calls
    # 7B on one GPU: 100 tokens/s a sequence, more than a chunk in any window of 0.32 s or more
    per_entry = 100.0 * cp_workload.FLUSH_S
    assert per_entry >= cp_workload.CHUNK_TOKENS
    assert r["entry_tokens"] == pytest.approx(per_entry)
    assert r["chunks_s"] == pytest.approx(1_000_000 / per_entry + 200 * calls)


def test_committed_simulator_results_give_a_1024_gpu_target():
    rates = cp_workload.workload_rates(ROOT / "bench/results/simulate.json")
    assert rates and all(r["chunks_s"] > r["trajectories_s"] > 0 for r in rates.values())


def _cost_pass(
    k: int, x: float, traj_cpu: float, chunk_cpu: float, idle: float, handler: float = 0.01
) -> dict:
    """A cost pass as run_cost_pass returns it: K shards at x of the rates below, each shard at
    `idle` core-s/s idle and the given core-s/s in the trajectory and chunk phases, of which
    `handler` core-s/s in each phase's handler (Trajectory, PartialBatch; BatchRequest beside
    them at as much again)."""
    shards = ["buffer"] if k == 1 else [f"buffer{i}" for i in range(k)]
    wake = {"messages_per_wakeup": 2.0}
    h_tr = {n: {"Trajectory": handler, "BatchRequest": handler} for n in shards}
    h_ch = {n: {"PartialBatch": handler, "BatchRequest": handler} for n in shards}
    return {
        "buffer_shards": k,
        "x": x,
        "idle_cpu_per_s": {"manager": 0.05, **{n: idle for n in shards}},
        "phases": {
            "trajectory": {
                "cpu_per_s": {"manager": 0.05, **{n: traj_cpu for n in shards}},
                "achieved": {"acked": 100.0 * x, "batches": 0.0},
                "wakeups": {n: wake for n in shards},
                "handler_cpu_per_s": h_tr,
            },
            "chunk": {
                "cpu_per_s": {"manager": 0.05, **{n: chunk_cpu for n in shards}},
                "achieved": {"acked": 0.0, "batches": 200.0 * x},
                "wakeups": {n: wake for n in shards},
                "handler_cpu_per_s": h_ch,
            },
        },
    }


def test_shard_figures_are_per_shard_per_trajectory_above_idle():
    rates = {"trajectories_s": 100.0, "batches_s": 200.0}
    # one shard at half the rate and two at the whole one: each shard takes 50 trajectories/s
    # and 100 batches/s; 0.05 core-s/s above idle each for trajectories, 0.02 for batches
    one = _cost_pass(1, 0.5, 0.15, 0.12, 0.1)
    two = _cost_pass(2, 1.0, 0.15, 0.12, 0.1)
    got = cp_figures.shard_figures([one, two], rates)
    # 0.05 / 50 + 0.02 / 100 * (2 batches a trajectory) = 1000 + 400 us
    assert got["shard_cpu_us_per_trajectory_by_k"] == {"1": [1400.0], "2": [1400.0, 1400.0]}
    assert got["shard_cpu_per_trajectory_spread"] == 0.0
    assert got["shard_messages_per_wakeup_by_k"]["2"]["chunk"] == [2.0, 2.0]
    # the Trajectory and PartialBatch handlers alone (not the batch serving beside them):
    # 0.01 / 50 + 0.01 / 100 * 2 = 200 + 200 us
    assert got["shard_handler_cpu_us_per_trajectory_by_k"] == {"1": [400.0], "2": [400.0, 400.0]}
    assert got["shard_handler_cpu_per_trajectory_spread"] == 0.0
    # the same calls charged 50% more CPU on two shards: the handler figure spreads with them
    slow = _cost_pass(2, 1.0, 0.15, 0.12, 0.1, handler=0.015)
    slowed = cp_figures.shard_figures([one, slow], rates)
    assert slowed["shard_handler_cpu_per_trajectory_spread"] == pytest.approx(0.5, abs=0.001)
    # a shard that costs 10% more per trajectory shows as the spread
    dear = _cost_pass(2, 1.0, 0.155, 0.122, 0.1)
    spread = cp_figures.shard_figures([one, dear], rates)["shard_cpu_per_trajectory_spread"]
    assert spread == pytest.approx(0.1, abs=0.001)


def test_shard_figures_take_the_median_of_rounds_so_one_slowed_pass_moves_no_k():
    rates = {"trajectories_s": 100.0, "batches_s": 200.0}
    one = [_cost_pass(1, 0.5, 0.15, 0.12, 0.1) for _ in range(3)]
    two = [_cost_pass(2, 1.0, 0.15, 0.12, 0.1) for _ in range(3)]
    # the box charged one K=2 round twice the CPU above idle (0.1 + 2 x 0.05, 0.1 + 2 x 0.02)
    two[1] = _cost_pass(2, 1.0, 0.2, 0.14, 0.1)
    got = cp_figures.shard_figures([*one, *two], rates)
    assert got["shard_cpu_us_per_trajectory_by_k_rounds"] == {
        "1": [1400.0] * 3,
        "2": [1400.0, 2800.0, 1400.0],
    }
    assert got["shard_cpu_us_per_trajectory_by_k"] == {"1": [1400.0], "2": [1400.0, 1400.0]}
    assert got["shard_cpu_per_trajectory_spread"] == 0.0
    # two slowed rounds of three are the median: the spread shows them
    two[2] = _cost_pass(2, 1.0, 0.2, 0.14, 0.1)
    got = cp_figures.shard_figures([*one, *two], rates)
    assert got["shard_cpu_per_trajectory_spread"] == pytest.approx(1.0, abs=0.001)


def _kinds_pass() -> dict:
    """The kinds' pass: one buffer at 1x, 0.05 core-s/s above its idle of 0.1 for trajectories,
    0.02 for batches, and a status phase that costs the manager 0.1 for 1,000 pushes a second."""
    kinds = _cost_pass(1, 1.0, 0.15, 0.12, 0.1)
    kinds["phases"]["status"] = {
        "cpu_per_s": {"manager": 0.15, "buffer": 0.1},
        "achieved": {"pushes": 1000.0},
        "handler_cpu_per_s": {},
    }
    return kinds


def test_the_whole_workload_pass_is_read_against_its_own_idle():
    rates = {"trajectories_s": 100.0, "batches_s": 200.0, "status_pushes_s": 1000.0}
    kinds = _kinds_pass()
    whole = {
        "buffer_shards": 1,
        "x": 1.0,
        "idle_cpu_per_s": {"manager": 0.05, "buffer": 0.2},
        "phases": {
            "all": {
                "cpu_per_s": {"manager": 0.15, "buffer": 0.4},
                "achieved": {"batches": 200.0, "pushes": 1000.0, "acked": 100.0},
                "handler_cpu_per_s": {"buffer": {"Trajectory": 0.05}},
            }
        },
    }
    got = cp_figures.cost_summary([kinds, whole], rates)
    # the kinds against the first pass's idle (0.1): 0.05 + 0.02 + 0; the whole against its own
    assert got["cpu_core_s_per_1x_by_kind"]["buffer"] == {
        "status": 0.0,
        "trajectory": 0.05,
        "chunk": 0.02,
    }
    assert got["cpu_core_s_per_1x_by_node"]["buffer"] == pytest.approx(0.07)
    assert got["cpu_core_s_per_1x_whole_phase_by_node"]["buffer"] == pytest.approx(0.2)
    assert got["manager_us_per_status"] == pytest.approx(100.0)
    assert got["handler_cpu_core_s_per_1x_by_kind"]["buffer"]["trajectory"] == pytest.approx(0.05)
    # the whole-workload pass has no kinds: the shard figures come from the kinds' pass alone
    assert got["shard_cpu_us_per_trajectory_by_k"] == {"1": [700.0]}


def test_each_kind_is_the_median_of_the_one_buffer_passes_that_ran_it():
    rates = {"trajectories_s": 100.0, "batches_s": 200.0, "status_pushes_s": 1000.0}
    kinds = _kinds_pass()
    # the shard rounds' K = 1 passes: the trajectory phase cheaper in both, the chunk phase dearer
    # in one; a K = 2 pass and one buffer at half the rate count for nothing here
    rounds = [_cost_pass(1, 1.0, 0.13, 0.12, 0.1), _cost_pass(1, 1.0, 0.14, 0.13, 0.1)]
    others = [_cost_pass(2, 1.0, 0.5, 0.5, 0.1), _cost_pass(1, 0.5, 0.5, 0.5, 0.1)]
    got = cp_figures.cost_summary([kinds, *rounds, *others], rates)
    by_pass = got["cpu_core_s_per_1x_by_kind_passes"]["buffer"]
    assert by_pass == {
        "status": [0.0],
        "trajectory": [0.05, 0.03, 0.04],
        "chunk": [0.02, 0.02, 0.03],
    }
    assert got["cpu_core_s_per_1x_by_kind"]["buffer"]["trajectory"] == 0.04
    assert got["cpu_core_s_per_1x_by_node"]["buffer"] == pytest.approx(0.06)
    # the kinds' pass alone stays beside it
    assert got["cpu_core_s_per_1x_by_node_first_pass"]["buffer"] == pytest.approx(0.07)
    assert got["cpu_core_s_per_1x_by_node"]["manager"] == pytest.approx(0.1)


def test_lag_window_reads_only_samples_inside_it(tmp_path):
    path = tmp_path / "lag.jsonl"
    path.write_text(
        "".join(json.dumps({"t": t, "lags": [float(t)] * 10}) + "\n" for t in (1, 2, 3))
    )
    got = cp_node.read_lag(path, 1.5, 2.5)
    assert got["p99_ms"] == 2.0 and got["samples"] == 10


def test_step_reader_follows_an_appended_file_and_skips_a_cut_line(tmp_path):
    path = tmp_path / "consumed.jsonl"
    steps = chaos.Steps(path)
    assert steps.poll() == 0
    path.write_text(json.dumps({"step": 1, "uids": []}) + "\n" + '{"step": 2, "ui')
    assert steps.poll() == 1  # the half-written line waits for its end
    with open(path, "a") as f:
        f.write('ds": []}\n' + json.dumps({"step": 2, "uids": []}) + "\n")
    assert steps.poll() == 2
    assert chaos.pct([3.0, 1.0, 2.0], 0.5) == 2.0 and chaos.pct([], 0.5) is None


def test_emulated_rate_is_over_whole_steps():
    """bench/cluster_run.figures: steps that ended in the window, timed from the last one before
    it; with none before, from the first in it (its own start is unknown), so a barrier mode
    whose first step outlasts the warm-up is not credited a whole step for part of its time."""
    from cluster_run import figures

    def step(t: float, tokens: int) -> dict:
        return {"time": t, "tokens_total": tokens, "compute_s": 0.1}

    # a step before the window: all three inside count, over 12 s
    steps = [step(9.0, 100), step(13.0, 100), step(17.0, 100), step(21.0, 100)]
    out = figures(steps, [], [], 10.0, 28.0, 1)
    assert out["train_tok_s"] == pytest.approx(300 / 12.0) and out["iteration_s"] == 4.0
    # none before: the first inside only starts the count (200 tokens over 8 s, not 300 over 11)
    out = figures(steps[1:], [], [], 10.0, 28.0, 1)
    assert out["train_tok_s"] == pytest.approx(200 / 8.0) and out["iteration_s"] == 4.0
    # a lone step with none before: timed from the window's start
    out = figures(steps[1:2], [], [], 10.0, 28.0, 1)
    assert out["train_tok_s"] == pytest.approx(100 / 3.0)


def test_drain_sweep_feeds_stored_latencies_and_sets_simulator_fields_for_laminar_only(tmp_path):
    import drain_sweep

    stored = {
        "simulation": {
            "8": {
                "partial": {"latencies": {"global_update_s": 0.05, "actor_push_s": 0.002}},
                "laminar": {"latencies": {"relay_pull_s": 0.01, "repack_move_s": 0.007}},
            }
        }
    }
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(stored))
    lat = drain_sweep.stored_latencies(path, 8)
    assert lat["laminar"] == {"relay_pull_s": 0.01, "repack_move_s": 0.007}
    assert lat["partial"]["global_update_s"] == 0.05

    short = {"warmup_s": 4.0, "window_s": 8.0, "refill_versions": 2}
    free = drain_sweep.run_variant(8, short, [0], lat)
    stalled = drain_sweep.run_variant(8, {**short, "sim": {"repack_fixed_s": 2.0}}, [0], lat)
    # a 2 s stall per move (400 decode steps) costs laminar; partial never repacks: unchanged
    assert stalled["throughput_tok_s"]["partial"] == free["throughput_tok_s"]["partial"]
    assert stalled["throughput_tok_s"]["laminar"] < 0.95 * free["throughput_tok_s"]["laminar"]
    assert free["moves"] > 0
