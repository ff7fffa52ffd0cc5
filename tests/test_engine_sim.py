"""Sim engine: hundreds of engines in one process, the configured length tail, the latency model.

.venv/bin/python -m pytest tests/test_engine_sim.py -q
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from laminar.config import LaminarConfig
from laminar.engines.base import GenRequest, SamplingParams
from laminar.engines.factory import make_engine
from laminar.engines.sim import SimEngine, target_length

PROMPT = np.arange(4, 14, dtype=np.int32)


async def drain(
    engine: SimEngine, n: int, timeout: float = 20.0
) -> dict[str, tuple[list[int], list[float], str, float]]:
    """Consume events until n sequences finished -> {seq_id: (ids, logprobs, reason, finish
    time)}."""
    out: dict[str, tuple[list[int], list[float], str, float]] = {}
    ids: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    while len(out) < n:
        ev = await engine.next_event(timeout)
        ids.setdefault(ev.seq_id, []).extend(ev.token_ids.tolist())
        lps.setdefault(ev.seq_id, []).extend(ev.logprobs.tolist())
        if ev.finished:
            out[ev.seq_id] = (ids[ev.seq_id], lps[ev.seq_id], ev.finish_reason, time.monotonic())
    return out


async def test_256_engines_in_one_process():
    step, n_engines = 0.001, 256
    engines = [
        SimEngine(
            step_time_s=step,
            bound_b=64,
            length_p50=200,
            length_p99_over_p50=4,
            max_running=32,
            chunk_tokens=32,
            seed=i,
        )
        for i in range(n_engines)
    ]
    params = SamplingParams(max_tokens=1000)
    for e in engines:
        await e.start()
    t0, c0 = time.monotonic(), time.process_time()
    for i, e in enumerate(engines):  # two GRPO groups of 4 per engine
        e.submit(GenRequest(f"e{i}a", PROMPT, params, n=4))
        e.submit(GenRequest(f"e{i}b", PROMPT, params, n=4))
    results = await asyncio.gather(*(drain(e, 8) for e in engines))
    wall, cpu = time.monotonic() - t0, time.process_time() - c0

    longest = 0.0
    for i, res in enumerate(results):
        targets = {s: min(target_length(i, s, 200, 4), 1000) for s in res}
        for sid, (ids, lps, reason, _) in res.items():
            assert len(ids) == targets[sid] and reason == (
                "stop" if targets[sid] < 1000 else "length"
            )
            assert min(lps) >= -3 and max(lps) <= 0 and max(ids) < 32000
        # 8 sequences <= B: every step takes `step`, so the engine is done after its longest
        # sequence
        expected = max(targets.values()) * step
        finished = max(r[3] for r in res.values()) - t0
        assert finished >= expected * 0.999, (i, finished, expected)
        longest = max(longest, expected)
    assert wall < longest + 2.0, (
        f"{n_engines} engines took {wall:.2f}s for {longest:.2f}s of emulated decoding"
    )
    # event-driven: an engine wakes at chunk boundaries and finishes, not once per decode step
    # (a per-token loop would wake ~1000 times per engine); CPU time is printed, not asserted
    steps = sum(
        max(min(target_length(i, s, 200, 4), 1000) for s in res) for i, res in enumerate(results)
    )
    wakes = sum(e.wakes for e in engines)
    assert wakes < steps / 8, (wakes, steps)
    print(
        f"{n_engines} engines: {wakes} wakes for {steps} decode steps; cpu {cpu:.2f}s over wall "
        f"{wall:.2f}s"
    )


async def test_lengths_follow_configured_long_tail():
    p50, tail, n_engines, per = 100, 10.0, 32, 320
    engines = [
        SimEngine(
            step_time_s=2e-4,
            bound_b=per,
            length_p50=p50,
            length_p99_over_p50=tail,
            max_running=per,
            chunk_tokens=512,
            seed=42,
        )
        for _ in range(n_engines)
    ]
    params = SamplingParams(max_tokens=5000)
    for i, e in enumerate(engines):
        await e.start()
        for g in range(per // 8):
            e.submit(GenRequest(f"q{i}-{g}", PROMPT, params, n=8))
    results = await asyncio.gather(*(drain(e, per, timeout=30) for e in engines))
    lengths = np.array([len(v[0]) for res in results for v in res.values()])
    assert len(lengths) == n_engines * per
    p50_obs, p99_obs = np.percentile(lengths, 50), np.percentile(lengths, 99)
    assert abs(p50_obs / p50 - 1) < 0.10, p50_obs
    assert abs(p99_obs / (p50 * tail) - 1) < 0.10, p99_obs
    # and the drawn lengths themselves, on many more ids (tighter)
    drawn = np.array([target_length(7, f"s{i}", p50, tail) for i in range(50_000)])
    assert abs(np.percentile(drawn, 50) / p50 - 1) < 0.03
    assert abs(np.percentile(drawn, 99) / (p50 * tail) - 1) < 0.05


async def test_step_time_flat_until_bound_then_linear():
    e0 = SimEngine(step_time_s=0.004, bound_b=4)
    assert [e0.step_time(b) for b in (1, 4, 6, 8)] == pytest.approx([0.004, 0.004, 0.006, 0.008])

    async def run(n: int) -> float:
        e = SimEngine(
            step_time_s=0.004,
            bound_b=4,
            length_p50=10_000,
            length_p99_over_p50=1.0,
            max_running=16,
            chunk_tokens=1000,
        )
        await e.start()
        t = time.monotonic()
        e.submit(GenRequest("x", PROMPT, SamplingParams(max_tokens=50), n=n))
        res = await drain(e, n)
        assert all(len(v[0]) == 50 and v[2] == "length" for v in res.values())
        return time.monotonic() - t

    t2, t4, t8 = await run(2), await run(4), await run(8)
    # progress is analytic, so never early; a loaded event loop can only make it late
    assert (
        t2 >= 0.2 and t4 >= 0.2 and t8 >= 0.4
    )  # 50 steps x 4 ms; 8 running = 2 B: steps twice as long
    assert 0.75 < t4 / t2 < 1.33 and 1.5 < t8 / t4 < 2.5


async def test_abort_and_resume_keep_target_and_tokens():
    kw = dict(step_time_s=0.001, length_p50=60, length_p99_over_p50=3, chunk_tokens=8, seed=5)
    params = SamplingParams(max_tokens=400)
    ref = SimEngine(**kw)
    await ref.start()
    ref.submit(GenRequest("g", PROMPT, params, n=4))
    full = await drain(ref, 4)

    src, dst = SimEngine(**kw), SimEngine(**kw)
    await src.start()
    await dst.start()
    src.submit(GenRequest("g", PROMPT, params, n=4))
    streamed: dict[str, list[int]] = {}
    first = await src.next_event(5)
    streamed[first.seq_id] = first.token_ids.tolist()
    parts = await src.abort([f"g/{i}" for i in range(4)])
    assert src.stats().running == 0
    reasons = {}
    while len(reasons) < 4:  # queued chunks, then one abort each (finished ones are not aborted)
        ev = await src.next_event(5)
        streamed.setdefault(ev.seq_id, []).extend(ev.token_ids.tolist())
        if ev.finished:
            reasons[ev.seq_id] = ev.finish_reason
    assert {p.seq_id for p in parts} == {s for s, r in reasons.items() if r == "abort"} and parts
    for p in parts:
        assert p.output_ids.tolist() == streamed.get(p.seq_id, [])
        dst.submit(GenRequest.resume(p, params))
    resumed = await drain(dst, len(parts))
    for p in parts:
        assert p.output_ids.tolist() + resumed[p.seq_id][0] == full[p.seq_id][0]
        np.testing.assert_array_equal(
            np.concatenate([p.logprobs, resumed[p.seq_id][1]]).astype(np.float32),
            np.array(full[p.seq_id][1], np.float32),
        )


async def test_stats_capacity_and_weight_load_pause():
    e = SimEngine(
        step_time_s=0.002,
        length_p50=10_000,
        length_p99_over_p50=1.0,
        max_running=2,
        kv_capacity_tokens=1000,
        chunk_tokens=10,
        load_time_s=0.05,
    )
    await e.start()
    e.submit(GenRequest("w", PROMPT, SamplingParams(max_tokens=40), n=3))
    first = await e.next_event(5)
    st = e.stats()
    assert st.running == 2 and st.waiting == 1 and st.version == 0
    assert st.kv_use == pytest.approx((2 * len(PROMPT) + st.tokens_generated) / 1000)
    t = time.monotonic()
    await e.load_weights([("w", np.zeros(2))], version=3)
    assert time.monotonic() - t >= 0.05 and e.stats().version == 3
    res = await drain(e, 3)
    assert sum(len(v[0]) for v in res.values()) + len(first.token_ids) == 3 * 40
    assert e.stats().running == 0 and e.stats().kv_use == 0


def test_make_engine_from_config():
    cfg = LaminarConfig()
    cfg.rollout.engine = "sim"
    cfg.rollout.sim.step_time_s = 0.0
    eng = make_engine(cfg.rollout, cfg.model)
    assert isinstance(eng, SimEngine) and eng.chunk_tokens == cfg.rollout.partial_chunk_tokens


async def test_zero_step_time_finishes_at_once():
    e = SimEngine(step_time_s=0.0, length_p50=50, length_p99_over_p50=2)
    await e.start()
    e.submit(GenRequest("z", PROMPT, SamplingParams(max_tokens=100), n=8))
    res = await drain(e, 8, timeout=2)
    assert all(len(v[0]) == min(target_length(0, s, 50, 2), 100) for s, v in res.items())


def _prefill_engine(**kw) -> SimEngine:
    opts = dict(step_time_s=0.001, bound_b=8, length_p50=20, length_p99_over_p50=2)
    opts.update(kw)
    return SimEngine(max_running=8, chunk_tokens=8, prefill_tok_s=1000.0, **opts)


async def test_prefill_is_charged_for_prompts_resumes_and_imports_once():
    engine = _prefill_engine()
    await engine.start()
    loop = asyncio.get_running_loop()
    params = SamplingParams(max_tokens=10_000)
    # a new prompt: its tokens stall the idle engine's first step by tokens / rate
    before = loop.time()
    engine.submit(GenRequest("g0", PROMPT, params, n=1))
    assert engine.prefill_tokens == len(PROMPT)
    stall = len(PROMPT) / 1000.0
    assert engine.prefill_s == pytest.approx(stall)
    assert before + stall <= engine._t0 <= loop.time() + stall
    engine.stats()  # settling (a status, a timer) charges nothing again
    await drain(engine, 1)
    assert engine.prefill_tokens == len(PROMPT)
    # a resumed sequence (an interrupt put back, a repack import, a recovery): prompt + resumed
    resumed = np.arange(7, dtype=np.int32)
    lps = np.zeros(7, np.float32)
    engine.submit(
        GenRequest("imp", PROMPT, params, resume_ids=resumed, resume_logprobs=lps, single=True)
    )
    assert engine.prefill_tokens == 2 * len(PROMPT) + 7
    await drain(engine, 1)
    assert engine.prefill_s == pytest.approx((2 * len(PROMPT) + 7) / 1000.0)
    await engine.close()


async def test_prefill_waits_for_admission_and_a_turn_reuses_its_prefix_until_a_load():
    engine = _prefill_engine(kv_capacity_tokens=len(PROMPT) + 1)
    await engine.start()
    params = SamplingParams(max_tokens=10_000)
    engine.submit(GenRequest("a", PROMPT, params, n=2))  # the second cannot join yet: no KV
    assert engine.prefill_tokens == len(PROMPT)  # charged when it joins, not when queued
    done = await drain(engine, 2)
    assert engine.prefill_tokens == 2 * len(PROMPT)
    # the next turn of "a/0" on the same engine: only the environment's new tokens are computed
    ids, lps, reason, _ = done["a/0"]
    assert reason == "stop"
    env = [1, 2, 3]
    history = np.asarray(ids + env, np.int32)
    hlps = np.zeros(len(history), np.float32)
    nxt = GenRequest(
        "a/0",
        PROMPT,
        params,
        resume_ids=history,
        resume_logprobs=hlps,
        single=True,
        turn=1,
        turn_start=len(history),
    )
    engine.submit(nxt)
    assert engine.prefill_tokens == 2 * len(PROMPT) + len(env)
    await drain(engine, 1)
    # after a weight load the cache is gone (its KV came from the old weights): all of it again
    await engine.load_weights([], 1)
    ids1, _, _, _ = done["a/1"]
    hist1 = np.asarray(ids1 + env, np.int32)
    again = GenRequest(
        "a/1",
        PROMPT,
        params,
        resume_ids=hist1,
        resume_logprobs=np.zeros(len(hist1), np.float32),
        single=True,
        turn=1,
        turn_start=len(hist1),
    )
    engine.submit(again)
    assert engine.prefill_tokens == 2 * len(PROMPT) + len(env) + len(PROMPT) + len(hist1)
    await drain(engine, 1)
    await engine.close()


async def test_prefill_during_a_load_runs_after_it():
    engine = _prefill_engine(load_time_s=0.05)
    await engine.start()
    loop = asyncio.get_running_loop()
    load = asyncio.ensure_future(engine.load_weights([], 1))
    await asyncio.sleep(0)  # one loop turn: the load task runs up to its pause
    engine.submit(GenRequest("g", PROMPT, SamplingParams(max_tokens=10_000), n=1))
    await load
    stall = len(PROMPT) / 1000.0
    assert engine._t0 >= loop.time() + stall - 0.01  # after the load, not hidden under it
    await drain(engine, 1)
    await engine.close()
