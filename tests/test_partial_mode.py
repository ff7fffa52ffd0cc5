"""Mode partial (AReaL-style partial rollout): an update interrupts in-flight trajectories, which
continue under the new version with every earlier token (and its version and logprob) kept.

    .venv/bin/python -m pytest tests/test_partial_mode.py -q

  * the table level: a group interrupted mid-generation, weights loaded, continued: the tokens are
    exactly an uninterrupted run's (the sim engine's tokens are a hash of sequence and position),
    and each token records the version that sampled it (SeqState.runs -> token_versions);
  * the wire: a partial spanning versions goes through a PartialBatch into the buffer's partial
    pool and back (recovery) with its per-token versions, and resumes on a newer rollout;
  * the trainer: the correction weight of each token is pi_prox / mu of that token's own
    behaviour logprob, whatever version sampled it; per-token staleness is reported;
  * a cluster: every consumed trajectory's oldest token is within buffer.max_staleness, some
    trajectories span versions, each consumed exactly once;
  * a rollout killed (no drain, no Bye) mid-trajectory after an interrupt: its trajectories resume
    elsewhere with every token and its per-token versions, each stored exactly once (the same with
    a real kill -9 of a rollout process: tests/test_faults.py, slow).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from laminar.algo.losses import behaviour_weights
from laminar.buffer.experience import ExperienceState
from laminar.buffer.partials import PartialPool
from laminar.cluster import LocalCluster
from laminar.engines.base import SamplingParams
from laminar.engines.sim import SimEngine
from laminar.logs import get_logger
from laminar.metrics import Metrics
from laminar.modes import Admission, policy_for
from laminar.protocol.data import PromptItem, Trajectory
from laminar.protocol.rollout import RefreshRequest
from laminar.rollout.deliver import partial_batch
from laminar.rollout.sequences import SequenceTable
from laminar.rollout.tracking import SeqState
from laminar.trainer.batch import TrainBatch, token_staleness
from tests.sim_cluster import consumed, sim_config, staleness_hist, trainer_metrics, wait_for
from tests.test_manager import all_running, check_tokens, long_config, running, stored

PARAMS = SamplingParams(max_tokens=200)


def engine(seed: int = 5) -> SimEngine:
    return SimEngine(
        step_time_s=0.002,
        bound_b=8,
        max_running=8,
        length_p50=60,
        length_p99_over_p50=2.0,
        seed=seed,
        chunk_tokens=1,
    )


def table_of(eng: SimEngine, metrics: Metrics) -> SequenceTable:
    return SequenceTable(
        eng,
        PARAMS,
        notify=(asyncio.Event(),),
        metrics=metrics,
        log=get_logger(role="rollout", node_id="t"),
        interrupts=True,
    )


async def run_group(interrupt_after: int | None) -> tuple[dict[str, SeqState], dict[str, int]]:
    """One group of 4 on a sim engine; with `interrupt_after`, once every sample has made that
    many tokens: interrupt, load version 1, continue. Returns the finished sequences and, per
    uid, the engine's token count at the interrupt."""
    eng = engine()
    await eng.start()
    metrics = Metrics()
    table = table_of(eng, metrics)
    item = PromptItem(uid="p", group_id="g", prompt_ids=np.arange(1, 9, dtype=np.int32), n=4)
    table.start_group(item, 0)
    done: dict[str, SeqState] = {}
    at: dict[str, int] = {}
    pending = interrupt_after
    async with asyncio.timeout(20):
        while table.seqs:
            ev = await eng.next_event(20)
            seq = table.on_event(ev)
            if seq is not None and ev.finished:
                assert ev.finish_reason in ("stop", "length")
                table.forget(seq.uid)
                done[seq.uid] = seq
            if pending is not None and all(q.length >= pending for q in table.seqs.values()):
                pending = None
                states = await table.interrupt()
                at = {p.seq_id: len(p.output_ids) for p in states}
                await eng.load_weights([], 1)
                table.continue_at(states, 1)
    assert not metrics.counters.get("version_mismatch_events"), metrics.counters
    await eng.close()
    return done, at


async def test_an_interrupted_trajectory_continues_under_the_new_version_tokens_unchanged():
    plain, _ = await run_group(None)
    moved, at = await run_group(interrupt_after=5)
    assert set(moved) == set(plain) and len(at) >= 1
    for uid, seq in moved.items():
        t = seq.trajectory("stop", "r0", 0.0)
        ref = plain[uid].trajectory("stop", "r0", 0.0)
        # every token and behaviour logprob exactly what an uninterrupted run makes
        np.testing.assert_array_equal(t.response_ids, ref.response_ids)
        np.testing.assert_array_equal(t.logprobs, ref.logprobs)
        assert t.version == 0  # the oldest token's: what staleness bounds
        if uid not in at:
            continue  # finished before the interrupt: one version, nothing recorded
        k = at[uid]
        assert k >= 5
        if k == len(t.response_ids):
            continue  # ended exactly at the interrupt
        tv = t.token_versions
        assert tv is not None and len(tv) == len(t.response_ids)
        assert (tv[:k] == 0).all() and (tv[k:] == 1).all(), (k, tv)
    assert any(s.token_versions() is not None for s in moved.values()), "nothing spanned versions"


def test_a_sample_interrupted_before_its_first_token_simply_starts_at_the_new_version():
    item = PromptItem(uid="p", group_id="g", prompt_ids=np.arange(1, 4, dtype=np.int32), n=1)
    seq = SeqState.from_item(item, 0, 3, 0.0)
    seq.continue_at(4)
    assert seq.version == 4 and seq.runs == [] and seq.token_versions() is None
    seq.append(np.arange(3, dtype=np.int32), np.zeros(3, np.float32), 0.0)
    seq.continue_at(6, at=2)  # the engine had 2 tokens when it was interrupted
    assert seq.token_versions().tolist() == [4, 4, 6]
    with pytest.raises(ValueError, match="cannot continue"):
        seq.continue_at(5)


async def test_per_token_versions_survive_the_partial_pool_and_resume_on_a_newer_rollout():
    item = PromptItem(uid="p", group_id="g", prompt_ids=np.arange(1, 6, dtype=np.int32), n=2)
    a, b = (SeqState.from_item(item, i, 2, 0.0) for i in range(2))
    for s in (a, b):
        s.append(np.arange(4, dtype=np.int32), np.full(4, -0.5, np.float32), 0.0)
    a.continue_at(3)
    a.append(np.arange(4, 7, dtype=np.int32), np.full(3, -1.5, np.float32), 0.0)
    pool = PartialPool()
    msg, upto = partial_batch([a, b], "rollout-0")
    assert (
        msg.token_versions is not None
        and msg.token_versions.tolist() == [2] * 4 + [3] * 3 + [2] * 4
    )
    assert pool.apply_batch(msg) == Counter()
    a.sent_upto, b.sent_upto = upto
    a.continue_at(5)  # a second interrupt: the next batch carries only the new tokens
    a.append(np.arange(7, 9, dtype=np.int32), np.full(2, -2.5, np.float32), 0.0)
    msg2, _ = partial_batch([a], "rollout-0")
    assert msg2.token_versions.tolist() == [5, 5] and msg2.versions.tolist() == [2]
    assert pool.apply_batch(msg2) == Counter()
    got = {p.uid: p for p in pool.query("rollout-0")}
    pa, pb = got["g/0"], got["g/1"]
    assert pa.version == 2 and pa.token_versions.tolist() == [2] * 4 + [3] * 3 + [5] * 2
    np.testing.assert_array_equal(pa.logprobs, a.logprobs.copy())
    assert pb.token_versions is None  # one version: no column
    # a rollout at version 6 continues it (mode partial): earlier tokens keep their versions
    eng = engine()
    table = table_of(eng, Metrics())
    accepted, dup = table.resume([pa], at_version=6)
    assert accepted == ["g/0"] and not dup
    seq = table.seqs["g/0"]
    assert seq.version == 2 and seq.current_version == 6
    assert seq.token_versions().tolist() == [2] * 4 + [3] * 3 + [5] * 2
    assert eng.stats().waiting + eng.stats().running == 1
    await eng.close()


def test_bad_token_versions_are_refused_by_pool_and_buffer():
    item = PromptItem(uid="p", group_id="g", prompt_ids=np.arange(1, 6, dtype=np.int32), n=1)
    s = SeqState.from_item(item, 0, 2, 0.0)
    s.append(np.arange(3, dtype=np.int32), np.zeros(3, np.float32), 0.0)
    s.continue_at(3)
    s.append(np.arange(2, dtype=np.int32), np.zeros(2, np.float32), 0.0)
    msg, _ = partial_batch([s], "r")
    msg.token_versions = msg.token_versions[:-1]
    assert PartialPool().apply_batch(msg) == Counter(bad=1)
    t = s.trajectory("stop", "r", 0.0)
    t.token_versions = np.array([2, 3, 2, 3, 3], np.int32)  # goes back in time
    state = ExperienceState(
        group_size=1, lost_member_policy="drop_group", admission=Admission.for_mode("partial", 1)
    )
    assert state.check_trajectory(t)[0] == "bad"
    t.token_versions = np.array([2, 2, 2, 3, 3], np.int32)
    assert state.check_trajectory(t)[0] == "ok"


def test_the_correction_weight_of_each_token_is_its_own_behaviour_logprob():
    """Tokens 0-1 sampled by version 3, tokens 2-3 by version 4 with other logprobs: the trainer
    keeps each token's behaviour logprob, and w_t = pi_prox_t / mu_t per token (TIS, cap 2)."""
    behav = np.array([-1.0, -1.0, -2.0, -0.5], np.float32)
    t = Trajectory(
        uid="g/0",
        group_id="g",
        prompt_uid="p",
        sample_index=0,
        prompt_ids=np.arange(1, 4, dtype=np.int32),
        response_ids=np.arange(4, 8, dtype=np.int32),
        logprobs=behav,
        version=3,
        reward=1.0,
        token_versions=np.array([3, 3, 4, 4], np.int32),
    )
    other = Trajectory(
        uid="g/1",
        group_id="g",
        prompt_uid="p",
        sample_index=1,
        prompt_ids=np.arange(1, 4, dtype=np.int32),
        response_ids=np.arange(4, 8, dtype=np.int32),
        logprobs=np.full(4, -1.0, np.float32),
        version=4,
        reward=0.0,
    )
    batch = TrainBatch.build([t, other])
    s = batch.samples[0]
    np.testing.assert_array_equal(s.behav_logp, behav)
    assert s.token_versions.tolist() == [3, 3, 4, 4]
    prox = torch.full((1, 4), -1.0)
    w = behaviour_weights(prox, torch.from_numpy(s.behav_logp)[None], torch.ones(1, 4), cap=2.0)
    expect = torch.tensor([[1.0, 1.0, 2.0, float(np.exp(-0.5))]])  # e^1 truncated at the cap
    torch.testing.assert_close(w, expect)
    # per-token staleness at trainer version 5: (2+2+1+1 + 1*4) / 8; one sample spans versions
    m = token_staleness(5, batch.samples)
    assert m == {"staleness_token": pytest.approx(10 / 8), "spanning_versions": 1.0}
    assert token_staleness(5, TrainBatch.build([other]).samples) == {}


def test_partial_policy_is_a_global_update_that_interrupts():
    p = policy_for("partial", 4)
    assert p.global_update and p.interrupts and not p.whole_batch and p.max_staleness == 4
    assert policy_for("partial").max_staleness is None
    assert not policy_for("stream").interrupts


async def test_partial_mode_cluster_bounds_the_oldest_token_and_spans_versions(tmp_path):
    # responses of ~80 tokens at 4 ms a step (~0.3 s) against trainer steps of ~0.1 s: updates
    # land mid-trajectory, so trajectories span versions
    cfg = sim_config(
        tmp_path,
        mode="partial",
        rollouts=3,
        total_steps=6,
        trainer={"sim_time_per_token_s": 1e-3},
        buffer={"capacity": 32, "max_staleness": 2},
        rollout={
            "sampling": {"max_tokens": 400},
            "sim": {"length_p50": 80, "step_time_s": 0.004, "kv_capacity_tokens": 8 * 420},
        },
    )
    async with LocalCluster(cfg) as cluster:
        await cluster.wait_trainer(timeout=90)
        rollouts = cluster.role("rollout")
        interrupted = sum(r.metrics.counters.get("interrupted", 0) for r in rollouts)
        mismatched = sum(r.metrics.counters.get("version_mismatch_events", 0) for r in rollouts)
    steps, metrics = consumed(cfg), trainer_metrics(cfg)
    uids = [u for s in steps for u in s["uids"]]
    assert len(steps) == 6 and uids and max(Counter(uids).values()) == 1
    groups = Counter(u.rpartition("/")[0] for u in uids)
    assert set(groups.values()) == {cfg.rollout.group_size}
    hist = staleness_hist(metrics)
    assert max(hist) <= 2, hist  # the oldest token of every consumed trajectory
    assert interrupted > 0 and mismatched == 0
    assert sum(m.get("spanning_versions", 0) for m in metrics) > 0, metrics


async def test_a_killed_rollout_in_partial_mode_loses_nothing_and_duplicates_nothing(tmp_path):
    """Each rollout holds a group of 2 x 400 tokens; an update (version 1) interrupts them all
    mid-trajectory; rollout-0 then dies (no drain, no Bye). Its trajectories resume on a rollout
    at version 1 with their tokens and per-token versions (0 up to the interrupt, then 1), and
    every trajectory is stored exactly once."""
    # a flush window well inside the 0.8 s a response takes: version 1's tokens are pooled
    # before the response ends
    cfg = long_config(
        tmp_path, mode="partial", rollout={"partial_chunk_tokens": 16, "partial_flush_s": 0.5}
    )
    async with LocalCluster(cfg) as cluster:
        mgr, buf = cluster.node("manager-0"), cluster.node("buffer-0")
        await all_running(cluster)
        victim = cluster.node("rollout-0")
        lost = running(victim)
        all_uids = set().union(*(running(r) for r in cluster.role("rollout")))
        await mgr.srv.broadcast(RefreshRequest(min_version=1), role="rollout")  # the update
        await wait_for(
            lambda: all(r.gate.version == 1 for r in cluster.role("rollout")),
            10,
            "every rollout at version 1",
            cluster,
        )
        bounds = {u: victim.table.seqs[u].runs[0][0] for u in lost}  # where version 1 took over

        def pooled() -> bool:
            return all((buf.partials.length(u) or 0) >= bounds[u] + 32 for u in lost)

        await wait_for(pooled, 10, "version-1 tokens in the partial pool", cluster)
        await cluster.kill_node("rollout-0")
        await wait_for(lambda: mgr.recovery_log, 10, "recovery of rollout-0", cluster)
        assert mgr.recovery_log[0]["trajectories"] == 2 and mgr.recovery_log[0]["orphans"] == 0
        await wait_for(
            lambda: all_uids <= set(stored(buf)), 30, "every trajectory finishing", cluster
        )
        counts = Counter(t.uid for g in buf.state.groups.values() for t in g.members.values())
        assert max(counts.values()) == 1
        assert not mgr.metrics.counters.get("restarted_from_prompt")
        for uid in all_uids:
            t = stored(buf)[uid]
            check_tokens(cfg, t)  # every token exactly as without the interrupt or the death
            assert t.version == 0
            tv = t.token_versions
            assert tv is not None and set(tv.tolist()) == {0, 1}, uid
            k = int(np.argmax(tv == 1))
            assert (tv[:k] == 0).all() and (tv[k:] == 1).all()
            if uid in lost:
                assert t.rollout_id != "rollout-0" and t.resumed == 1 and k == bounds[uid]


def _multiturn_partial_config(tmp_path, **episodes: Any):
    """Two sim rollouts in mode partial, updates landing mid-episode; `episodes`: the env or
    agent section."""
    return sim_config(
        tmp_path,
        mode="partial",
        rollouts=2,
        total_steps=5,
        trainer={"sim_time_per_token_s": 1e-3},
        buffer={"capacity": 32},
        rollout={
            "sampling": {"max_tokens": 400},
            # a load that takes a while: environment steps end while the version changes
            "sim": {
                "length_p50": 30,
                "step_time_s": 0.004,
                "kv_capacity_tokens": 8 * 420,
                "load_time_s": 0.05,
            },
        },
        **episodes,
    )


async def test_multi_turn_episodes_continue_across_versions(tmp_path):
    """Episodes (SimToolEnv: model turns, tool waits, observations) in mode partial: a turn in
    the engine is interrupted and resumed with its own turn caps; a turn submitted while the
    version changes waits for the new one. Nothing is generated at a version the table did not
    expect, and each episode is consumed once."""
    cfg = _multiturn_partial_config(
        tmp_path,
        env={
            "fn": "laminar.envs.sim:SimToolEnv",
            "kwargs": {"seed": 1, "p_call": 0.7, "latency_p50_s": 0.02, "latency_p99_s": 0.2},
            "limits": {"max_turns": 5, "max_tool_calls": 4},
        },
    )
    async with LocalCluster(cfg) as cluster:
        await cluster.wait_trainer(timeout=90)
        rollouts = cluster.role("rollout")
        counters = Counter()
        for r in rollouts:
            counters.update(r.metrics.counters)
    uids = [u for s in consumed(cfg) for u in s["uids"]]
    assert uids and max(Counter(uids).values()) == 1
    assert counters["interrupted"] > 0 and counters["env_tokens"] > 0
    assert not counters.get("version_mismatch_events"), counters


async def test_agent_episodes_continue_across_versions(tmp_path):
    """The same episodes driven by a black-box agent through the rollouts' endpoints (the sim
    agent, one shared pool): a call after an update runs at the new version (its tokens recorded
    so), a turn in the engine is interrupted and continued; no attempt fails, each episode is
    consumed once, and some span versions."""
    cfg = _multiturn_partial_config(
        tmp_path,
        agent={
            "fn": "laminar.agents.sim:sim_tool_agent",
            "kwargs": {
                "seed": 1,
                "max_calls": 4,
                "p_call": 0.7,
                "latency_p50_s": 0.02,
                "latency_p99_s": 0.2,
                "client_call": "post",
            },
            "workers": 1,
            "concurrency": 64,
            "shared_workers": True,
            "max_calls": 5,
        },
    )
    async with LocalCluster(cfg) as cluster:
        await cluster.wait_trainer(timeout=120)
        counters = Counter()
        for r in cluster.role("rollout"):
            counters.update(r.metrics.counters)
        done = list(stored(cluster.node("buffer-0")).values())
    uids = [u for s in consumed(cfg) for u in s["uids"]]
    assert uids and max(Counter(uids).values()) == 1
    assert counters["interrupted"] > 0 and counters["agent_calls"] > len(uids), counters
    assert not any(k.startswith("agent_failure") for k in counters), counters
    assert not counters.get("version_mismatch_events"), counters
    # the episodes that spanned an update: their tokens name the versions that sampled them, in
    # order, the first being the episode's own
    spanning = [t for t in done if t.token_versions is not None]
    assert spanning, counters
    for t in spanning:
        tv = t.token_versions
        assert tv[0] == t.version and (np.diff(tv) >= 0).all() and tv[-1] > t.version
