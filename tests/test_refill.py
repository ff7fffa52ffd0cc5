"""Per-sequence refill and retraction (issue 18): a rollout holds more groups than its decode
bound B, the engine queues the rest, and once newer weights are wanted the groups that never
started are taken back and run at the new version.

.venv/bin/python -m pytest tests/test_refill.py -q
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np

from laminar.engines.base import GenRequest, SamplingParams
from laminar.engines.sim import SimEngine, sim_tokens, target_length
from laminar.logs import get_logger
from laminar.metrics import Metrics
from laminar.protocol.data import PromptItem
from laminar.rollout.sequences import SequenceTable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

PARAMS = SamplingParams(max_tokens=64)
STEP = 0.002


def item(k: int, n: int = 4) -> PromptItem:
    return PromptItem(
        uid=f"p{k}", group_id=f"g{k}", prompt_ids=np.arange(1, 6, dtype=np.int32), n=n
    )


def engine(max_running: int, seed: int = 3) -> SimEngine:
    return SimEngine(
        step_time_s=STEP,
        bound_b=max_running,
        max_running=max_running,
        length_p50=12,
        length_p99_over_p50=3.0,
        seed=seed,
        chunk_tokens=1,
    )


def table_of(eng: SimEngine, metrics: Metrics | None = None) -> SequenceTable:
    return SequenceTable(
        eng,
        PARAMS,
        notify=(asyncio.Event(),),
        metrics=metrics or Metrics(),
        log=get_logger(role="rollout", node_id="t"),
    )


async def run_until_empty(
    eng: SimEngine,
    table: SequenceTable,
    done: dict[str, tuple[int, int, list[int]]],
    timeout: float = 20.0,
) -> None:
    """The rollout node's event loop, reduced: tokens into the table, finished ones out (uid ->
    (version of its events, finish count, token ids))."""
    async with asyncio.timeout(timeout):
        while table.seqs:
            ev = await eng.next_event(timeout)
            seq = table.on_event(ev)
            if seq is None or not ev.finished:
                continue
            assert not (seq.exporting and ev.finish_reason == "abort")
            assert ev.finish_reason in ("stop", "length"), ev.finish_reason
            table.forget(seq.uid)
            _, count, _ = done.get(seq.uid, (0, 0, []))
            done[seq.uid] = (seq.version, count + 1, seq.ids.copy().tolist())


async def test_a_freed_slot_is_refilled_within_one_decode_step():
    """Two slots, three sequences: the queued one joins at the very step boundary where the
    first one ends (closed form on a frozen clock), not a step later."""
    eng = engine(max_running=2)
    clock = [0.0]
    eng._now = lambda: clock[0]  # type: ignore[method-assign]
    await eng.start()
    eng._t0 = 0.0
    eng.submit(GenRequest("g", np.arange(1, 6, dtype=np.int32), PARAMS, n=3, version=0))
    first = min(target_length(3, f"g/{i}", 12, 3.0) for i in range(2))
    clock[0] = (first - 0.5) * STEP  # half a step before the first one ends
    st = eng.stats()
    assert (st.running, st.waiting) == (2, 1)
    clock[0] = (first + 0.5) * STEP  # half a step after: the freed slot is taken already
    st = eng.stats()
    assert (st.running, st.waiting) == (2, 0)
    joiner = next(s for s in eng._running if s.seq_id == "g/2")
    assert joiner.done == 0  # it joined at the boundary; its first token ends the next step
    clock[0] = (first + 1.0) * STEP
    eng.stats()
    assert joiner.done == 1
    await eng.close()


async def test_retracted_groups_run_once_at_the_new_version():
    """Three groups of 4 on B = 4: one runs, two wait in the queue. A newer version is wanted:
    the two queued groups are taken back (no token made, no finished trajectory), the running
    one drains at version 0, the weights change, the two start again at version 1. Every
    sample finishes exactly once, at one version, with the tokens an uninterrupted run makes."""
    eng = engine(max_running=4)
    await eng.start()
    metrics = Metrics()
    table = table_of(eng, metrics)
    for k in range(3):
        table.start_group(item(k), 0)
    assert eng.stats().waiting == 8
    items = await table.retract(eng.stats().waiting)
    assert [i.group_id for i in items] == ["g1", "g2"]  # oldest first: the order they came in
    assert set(table.groups) == {"g0"} and eng.stats().waiting == 0
    assert metrics.counters["retracted_groups"] == 2
    done: dict[str, tuple[int, int, list[int]]] = {}
    await run_until_empty(eng, table, done)
    assert set(done) == {f"g0/{i}" for i in range(4)}
    await eng.load_weights([], version=1)
    for it in items:
        table.start_group(it, 1)
    await run_until_empty(eng, table, done)
    assert len(done) == 12
    for uid, (version, count, ids) in done.items():
        assert count == 1, uid
        assert version == (0 if uid.startswith("g0/") else 1), uid
        assert ids == sim_tokens(_key(uid), 0, len(ids), 32000)[0].tolist()
        assert len(ids) == min(64, target_length(3, uid, 12, 3.0))
    await eng.close()


def _key(uid: str) -> int:
    from laminar.engines.sim import _hash64

    return _hash64("tok", 3, uid)


async def test_a_group_that_started_is_not_retracted():
    """Every group running (B = 8, two groups): nothing is queued, so nothing is taken back,
    even when asked for more than the queue holds; a sample aborted by a race goes straight
    back into the engine and finishes once, with every token."""
    eng = engine(max_running=8)
    clock = [0.0]
    eng._now = lambda: clock[0]  # type: ignore[method-assign]
    await eng.start()
    eng._t0 = 0.0
    metrics = Metrics()
    table = table_of(eng, metrics)
    for k in range(2):
        table.start_group(item(k), 0)
    clock[0] = 3.5 * STEP  # three tokens each, not yet seen by the table (events unread)
    eng.stats()
    assert all(q.length == 0 for q in table.seqs.values())
    items = await table.retract(8)  # asks for more than the (empty) queue: must not lose work
    assert items == [] and metrics.counters["retract_kept_group"] == 2
    assert set(table.groups) == {"g0", "g1"}
    eng._now = eng._loop.time  # type: ignore[method-assign,union-attr]  # the real clock again
    eng._t0 = eng._now()
    eng._reschedule()
    done: dict[str, tuple[int, int, list[int]]] = {}
    await run_until_empty(eng, table, done)
    assert len(done) == 8
    for uid, (_, count, ids) in done.items():
        assert count == 1, uid
        assert ids == sim_tokens(_key(uid), 0, len(ids), 32000)[0].tolist()
        assert len(ids) == min(64, target_length(3, uid, 12, 3.0))
    await eng.close()


def test_simulator_models_the_queue_and_retraction():
    """bench/simcore.py: with a queue (rollout_groups above B / group_size) the rollouts decode
    fuller, and with retraction no group runs at a version older than the one its rollout had
    when it started decoding it (counted: retracted groups start after the load)."""
    from simcore import Sim
    from simparams import SimParams

    base = SimParams(
        n_rollouts=8,
        step_time_s=0.005,
        bound_b=8,
        max_running=8,
        prompt_tokens=32,
        length_p50=100,
        length_p99_over_p50=10.0,
        max_tokens=1024,
        group_size=4,
        batch_groups=16,
        rollout_groups=2,
        trainer_s_per_token=5e-4 / 8,
        repack=False,
        refill_per_group=True,
        settle_s=10.0,
    )
    plain = Sim("laminar_norepack", base, 1, 2, 6).run()
    from dataclasses import replace

    queued = Sim(
        "laminar_norepack", replace(base, rollout_groups=4, retract_waiting=True), 1, 2, 6
    ).run()
    assert queued["decode_util"] > plain["decode_util"] + 0.05
    assert queued["retracted_groups"] > 0 and plain["retracted_groups"] == 0
