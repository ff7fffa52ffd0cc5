"""Torch engine: continuous batching equals one-at-a-time decoding, exact logprobs, abort/resume,
weights. Every engine test runs on both step forwards (lean_forward.py and the HF model's own).

    .venv/bin/python -m pytest tests/test_engine_torch.py -q

The reference for every comparison is a plain full-sequence forward of a second
copy of the same HF model (eager attention, no cache), so the engine's own
cache, packing and sampling are checked against an independent path. The tiny
models use a large init range so greedy outputs vary token to token (the
default init gives near-uniform logits and "8888..." outputs).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from laminar.engines.base import GenRequest, SamplingParams
from laminar.engines.sampling import processed_logprobs, sample
from laminar.engines.torch_engine import TorchEngine
from laminar.models.tiny import build_tiny_model, load_causal_lm, load_tokenizer

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27], [30], [13, 14, 15, 16]]
T = 10.0  # deadline (s) for any one request in these tests


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    a = build_tiny_model(root / "a", hidden=64, layers=2, initializer_range=0.5, seed=0)
    b = build_tiny_model(root / "b", hidden=64, layers=2, initializer_range=0.5, seed=1)
    return a, b


@pytest.fixture(params=["lean", "hf"])
async def engine_factory(tiny, request):
    """Engines on either forward: every test here holds for the lean one and for HF's."""
    made: list[TorchEngine] = []

    async def make(path=None, **kw) -> TorchEngine:
        path = path or tiny[0]
        kw.setdefault("forward", request.param)
        eng = TorchEngine(load_causal_lm(path), load_tokenizer(path), **kw)
        assert (eng.lean is not None) == (request.param == "lean")
        await eng.start()
        made.append(eng)
        return eng

    yield make
    for eng in made:
        await eng.close()


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def recompute_logprobs(model, prompt, response, temperature: float, top_p: float) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(response)])).logits[
            0, len(prompt) - 1 : -1
        ]
    n = len(response)
    lp = processed_logprobs(logits, torch.full((n,), temperature), torch.full((n,), top_p))
    return lp.gather(1, torch.tensor(response, dtype=torch.long)[:, None]).squeeze(1).numpy()


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


async def test_continuous_batching_matches_one_at_a_time(tiny, engine_factory):
    ref = load_causal_lm(tiny[0])
    eng = await engine_factory(max_running=3)  # 5 requests, 3 slots: joins, leaves and waiting
    lengths = [24, 9, 17, 24, 5]
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(5)}
    finished: set[str] = set()
    eng.submit(GenRequest("r0", np.array(PROMPTS[0]), GREEDY, single=True))
    submitted = 1

    async def consume():
        nonlocal submitted
        while len(finished) < 5:
            ev = await eng.next_event(timeout=T)
            got[ev.seq_id].extend(ev.token_ids.tolist())
            if ev.finished:
                assert ev.finish_reason == "length"
                finished.add(ev.seq_id)
            # the next request arrives once r0 has made 2*i tokens: it joins a batch mid-flight
            while submitted < 5 and len(got["r0"]) >= 2 * submitted:
                i = submitted
                params = SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True)
                eng.submit(GenRequest(f"r{i}", np.array(PROMPTS[i]), params, single=True))
                submitted += 1

    await asyncio.wait_for(consume(), 30)
    for i in range(5):
        assert got[f"r{i}"] == greedy_reference(ref, PROMPTS[i], lengths[i]), f"r{i}"
    assert eng.stats().running == 0 and eng.stats().kv_use == 0.0


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8), (0.0, 1.0)])
async def test_logprobs_equal_full_recompute(tiny, engine_factory, temperature, top_p):
    ref = load_causal_lm(tiny[0])
    eng = await engine_factory(max_running=4)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=20, seed=7)
    res = await eng.generate_all(GenRequest("g", np.array(PROMPTS[0]), params, n=4), timeout=T)
    assert set(res) == {f"g/{i}" for i in range(4)}
    for ids, lps, reason in res.values():
        assert reason in ("stop", "length") and len(ids) == len(lps) >= 1
        rec = recompute_logprobs(ref, PROMPTS[0], ids.tolist(), temperature, top_p)
        np.testing.assert_allclose(lps, rec, atol=1e-4, rtol=0)
        assert np.all(np.isfinite(lps)) and np.all(lps <= 0)
    if temperature > 0:  # n samples of one prompt differ (distinct per-sequence streams)
        assert len({tuple(v[0].tolist()) for v in res.values()}) > 1


async def test_seeded_sampling_is_reproducible_across_batches(engine_factory):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=3, ignore_eos=True)
    alone = await (await engine_factory(max_running=1)).generate_all(
        GenRequest("s", np.array(PROMPTS[1]), params, n=3)
    )
    batched = await (await engine_factory(max_running=8)).generate_all(
        GenRequest("s", np.array(PROMPTS[1]), params, n=3)
    )
    for sid in alone:
        assert alone[sid][0].tolist() == batched[sid][0].tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_abort_then_resume_elsewhere_equals_uninterrupted(engine_factory, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=30, seed=11, ignore_eos=True)
    full = await (await engine_factory()).generate_all(
        GenRequest("x", np.array(PROMPTS[2]), params, n=2), timeout=T
    )

    src = await engine_factory(max_running=2)
    src.submit(GenRequest("x", np.array(PROMPTS[2]), params, n=2))
    streamed: dict[str, list[int]] = {"x/0": [], "x/1": []}
    while sum(map(len, streamed.values())) < 2 * 7:  # both sequences a few tokens in
        ev = await src.next_event(timeout=T)
        streamed[ev.seq_id].extend(ev.token_ids.tolist())
    partials = await src.abort(["x/0", "x/1", "unknown"])
    assert [p.seq_id for p in partials] == ["x/0", "x/1"]
    # events still queued, then exactly one final abort each: the stream equals the partial state
    last: dict[str, str | None] = {"x/0": None, "x/1": None}
    while any(r != "abort" for r in last.values()):
        ev = await src.next_event(timeout=T)
        assert last[ev.seq_id] is None, "event after the final abort"
        streamed[ev.seq_id].extend(ev.token_ids.tolist())
        last[ev.seq_id] = ev.finish_reason
    assert src.stats().running == 0 and src.stats().waiting == 0
    assert src.cache.free_blocks == src.cache.blocks  # an export frees the sequences' blocks
    for p in partials:
        assert streamed[p.seq_id] == p.output_ids.tolist()

    dst = await engine_factory(max_running=2)
    for p in partials:
        assert 7 <= len(p.output_ids) < 30 and len(p.logprobs) == len(p.output_ids)
        assert p.prompt_ids.tolist() == PROMPTS[2]
        res = await dst.generate_all(GenRequest.resume(p, params), timeout=T)
        new_ids, new_lps, reason = res[p.seq_id]
        assert reason == "length"
        assert p.output_ids.tolist() + new_ids.tolist() == full[p.seq_id][0].tolist()
        np.testing.assert_allclose(
            np.concatenate([p.logprobs, new_lps]), full[p.seq_id][1], atol=1e-4
        )


async def test_abort_waiting_sequence(engine_factory):
    eng = await engine_factory(max_running=1)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    eng.submit(GenRequest("a", np.array(PROMPTS[0]), long, single=True))
    eng.submit(GenRequest("b", np.array(PROMPTS[1]), long, single=True))
    ev = await eng.next_event(timeout=T)
    assert ev.seq_id == "a" and eng.stats().waiting == 1 and eng.stats().running == 1
    parts = await eng.abort(["b", "a"])
    assert [p.seq_id for p in parts] == ["b", "a"]
    assert len(parts[0].output_ids) == 0 and len(parts[1].output_ids) >= 1


async def test_load_weights_changes_outputs(tiny, engine_factory):
    a, b = tiny
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eng = await engine_factory(a)
    before = (await eng.generate_all(GenRequest("p", np.array(PROMPTS[0]), params, single=True)))[
        "p"
    ][0]
    other = load_causal_lm(b).state_dict()
    await eng.load_weights(((k, v.numpy()) for k, v in other.items()), version=5)
    assert eng.stats().version == 5
    got = []
    async for ev in eng.generate(
        GenRequest("p", np.array(PROMPTS[0]), params, single=True), timeout=T
    ):
        assert ev.version == 5
        got.extend(ev.token_ids.tolist())
    ref_b = greedy_reference(load_causal_lm(b), PROMPTS[0], 12)
    assert got == ref_b and got != before.tolist()
    with pytest.raises(KeyError):
        await eng.load_weights([("no.such.weight", np.zeros(3, np.float32))], version=6)
    assert eng.stats().version == 5


async def test_load_weights_mid_generation_recomputes(tiny, engine_factory):
    a, b = tiny
    eng = await engine_factory(a, max_running=2)
    eng.submit(
        GenRequest(
            "m",
            np.array(PROMPTS[0]),
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
            single=True,
        )
    )
    toks, versions = [], []
    while len(toks) < 6:
        ev = await eng.next_event(timeout=T)
        toks.extend(ev.token_ids.tolist())
        versions.append(ev.version)
    await eng.load_weights(load_causal_lm(b).state_dict().items(), version=1)
    while True:
        ev = await eng.next_event(timeout=T)
        toks.extend(ev.token_ids.tolist())
        versions.append(ev.version)
        if ev.finished:
            break
    k = versions.index(1)
    # after the load, the continuation is exactly what model b does from the same prefix
    ref_b = load_causal_lm(b)
    assert toks[k:] == greedy_reference(ref_b, PROMPTS[0] + toks[:k], 20 - k)


async def test_stop_token_stop_string_eos_and_length(tiny, engine_factory):
    tok = load_tokenizer(tiny[0])
    eng = await engine_factory(max_running=4)
    base = (await eng.generate_all(GenRequest("b", np.array(PROMPTS[0]), GREEDY, single=True)))[
        "b"
    ][0].tolist()
    # stop token id: stops at its first occurrence, the token is kept
    k = 5
    sp = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(base[k],), ignore_eos=True)
    ids, _, reason = (
        await eng.generate_all(GenRequest("s", np.array(PROMPTS[0]), sp, single=True))
    )["s"]
    assert reason == "stop" and ids.tolist() == base[: base.index(base[k]) + 1]
    # stop string made of two generated characters: output ends with it
    j = next(
        i for i in range(8, 22) if base[i] >= 4 and base[i + 1] >= 4
    )  # printable, not specials
    stop = tok.decode(base[j : j + 2])
    assert len(stop) == 2
    sp = SamplingParams(temperature=0.0, max_tokens=24, stop=(stop,), ignore_eos=True)
    ids, _, reason = (
        await eng.generate_all(GenRequest("t", np.array(PROMPTS[0]), sp, single=True))
    )["t"]
    text = tok.decode(ids.tolist())
    assert reason == "stop" and text.endswith(stop) and stop not in text[:-1]
    # EOS (here: the engine's eos set) stops unless ignore_eos
    eos_eng = await engine_factory(max_running=2, eos_token_ids=[base[3]])
    ids, _, reason = (
        await eos_eng.generate_all(
            GenRequest(
                "e",
                np.array(PROMPTS[0]),
                SamplingParams(temperature=0.0, max_tokens=24),
                single=True,
            )
        )
    )["e"]
    assert reason == "stop" and ids.tolist() == base[: base.index(base[3]) + 1]
    ids, _, reason = (
        await eos_eng.generate_all(GenRequest("f", np.array(PROMPTS[0]), GREEDY, single=True))
    )["f"]
    assert reason == "length" and len(ids) == 24
    # max_tokens counts resumed tokens
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    req = GenRequest(
        "r",
        np.array(PROMPTS[0]),
        sp,
        resume_ids=np.array(base[:4], np.int32),
        resume_logprobs=np.zeros(4, np.float32),
        single=True,
    )
    ids, _, reason = (await eng.generate_all(req))["r"]
    assert reason == "length" and ids.tolist() == base[4:10]


async def test_stats_waiting_and_kv_use(engine_factory):
    eng = await engine_factory(max_running=2, kv_capacity_tokens=400)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eng.submit(GenRequest("q", np.array(PROMPTS[2]), sp, n=4))
    ev = await eng.next_event(timeout=T)
    st = eng.stats()
    assert st.running == 2 and st.waiting == 2 and 0 < st.kv_use <= 1
    done = {ev.seq_id} if ev.finished else set()
    while len(done) < 4:
        ev = await eng.next_event(timeout=T)
        if ev.finished:
            done.add(ev.seq_id)
    st = eng.stats()
    assert (st.running, st.waiting, st.kv_use, st.tokens_generated) == (0, 0, 0.0, 160)


async def test_kv_pressure_preempts_and_recomputes(tiny, engine_factory):
    # 4 slots but room for ~2 growing sequences: the newest is preempted and recomputed later,
    # and outputs still equal plain greedy decoding.
    ref = load_causal_lm(tiny[0])
    eng = await engine_factory(max_running=4, kv_capacity_tokens=60)
    sp = SamplingParams(temperature=0.0, max_tokens=22, ignore_eos=True)
    reqs = [GenRequest(f"k{i}", np.array(PROMPTS[i]), sp, single=True) for i in range(4)]
    results = await asyncio.gather(*(eng.generate_all(r, timeout=T) for r in reqs))
    for i, res in enumerate(results):
        assert res[f"k{i}"][0].tolist() == greedy_reference(ref, PROMPTS[i], 22)
    assert eng.preemptions > 0 and eng.stats().preemptions == eng.preemptions
    assert eng.cache.free_blocks == eng.cache.blocks and eng.stats().kv_use == 0.0


async def test_bad_requests_get_error_events(engine_factory):
    eng = await engine_factory(max_running=2, max_model_len=32)
    res = await eng.generate_all(
        GenRequest("e1", np.array([], np.int32), GREEDY, single=True), timeout=T
    )
    assert res["e1"][2] == "error"
    res = await eng.generate_all(GenRequest("e2", np.arange(4, 40), GREEDY, single=True), timeout=T)
    assert res["e2"][2] == "error"
    res = await eng.generate_all(
        GenRequest("e3", np.array([5, 999]), GREEDY, single=True), timeout=T
    )
    assert res["e3"][2] == "error"  # out-of-vocabulary id: rejected, the engine keeps serving
    # max_model_len caps prompt + response
    res = await eng.generate_all(
        GenRequest("ok", np.array(PROMPTS[2]), GREEDY, single=True), timeout=T
    )
    assert res["ok"][2] == "length" and len(res["ok"][0]) == 32 - len(PROMPTS[2])


def test_plain_sampling_is_the_general_path_bit_for_bit() -> None:
    """sample(plain=True) (every row at temperature 1, top_p 1) skips the greedy and nucleus
    checks; its tokens and logprobs are exactly the general path's. A batch mixing greedy and
    sampled rows still takes the argmax on the greedy ones."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 50, generator=g) * 3
    u = torch.rand(64, generator=g, dtype=torch.float64)
    ones = torch.ones(64)
    t_plain, lp_plain = sample(logits, ones, ones, u, plain=True)
    t_gen, lp_gen = sample(logits, ones, ones, u)
    assert torch.equal(t_plain, t_gen) and torch.equal(lp_plain, lp_gen)
    assert len(set(t_plain.tolist())) > 5  # drawn, not argmax
    temp = torch.where(torch.arange(64) % 2 == 0, 0.0, 0.7)
    top_p = torch.full((64,), 0.9)
    tokens, lps = sample(logits, temp, top_p, u)
    greedy = torch.arange(64) % 2 == 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    logp = processed_logprobs(logits, temp, top_p)
    assert torch.equal(lps, logp.gather(1, tokens[:, None]).squeeze(1))
    assert torch.isfinite(lps).all()  # every drawn token is inside its row's nucleus


# ---- the paged KV cache (kv_cache.py) ----------------------------------------------------------
LONG_TAIL = [2, 45, 6, 70, 11, 3, 33, 18]
"""Response lengths of a long-tailed batch: most short, a few long."""


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.8, 0.9)])
async def test_long_tailed_batch_on_small_blocks_equals_full_forward(
    tiny, engine_factory, temperature, top_p
):
    """4-position blocks: every sequence spans many blocks, interleaved in the pool as sequences
    join and leave; tokens (greedy) and logprobs (any sampling) equal a plain full forward, and a
    seeded sequence draws the same tokens in the batch as alone."""
    ref = load_causal_lm(tiny[0])
    eng = await engine_factory(max_running=4, block_tokens=4)
    alone = await engine_factory(max_running=1, block_tokens=4)

    def req(i: int, n: int) -> GenRequest:
        sp = SamplingParams(temperature, top_p, max_tokens=n, seed=5, ignore_eos=True)
        return GenRequest(f"t{i}", np.array(PROMPTS[i % 5]), sp, single=True)

    reqs = [req(i, n) for i, n in enumerate(LONG_TAIL)]
    batched = await asyncio.gather(*(eng.generate_all(r, timeout=30) for r in reqs))
    for i, (r, res) in enumerate(zip(reqs, batched, strict=True)):
        ids, lps, reason = res[r.req_id]
        assert reason == "length" and len(ids) == LONG_TAIL[i]
        prompt = PROMPTS[i % 5]
        rec = recompute_logprobs(ref, prompt, ids.tolist(), temperature, top_p)
        np.testing.assert_allclose(lps, rec, atol=1e-4, rtol=0)
        if temperature == 0.0:
            assert ids.tolist() == greedy_reference(ref, prompt, LONG_TAIL[i])
        elif LONG_TAIL[i] >= 33:  # the long ones, again alone
            solo = (await alone.generate_all(r, timeout=30))[r.req_id][0]
            assert solo.tolist() == ids.tolist()
    assert eng.cache.free_blocks == eng.cache.blocks and eng.preemptions == 0


async def test_kv_memory_is_the_capacity_pool_not_rows_times_max_len(engine_factory):
    eng = await engine_factory(max_running=8, max_model_len=512, kv_capacity_tokens=100)
    cache, cfg = eng.cache, eng.model.config
    kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_position = 2 * cfg.num_hidden_layers * kv_heads * head_dim * 4  # K and V, fp32
    # 100 positions in 16-position blocks: 7 blocks, + the null block
    assert (cache.blocks, cache.block_tokens, eng.capacity) == (7, 16, 112)
    assert cache.nbytes == 8 * 16 * per_position
    assert (
        cache.nbytes < 8 * 512 * per_position / 30
    )  # rows x max_model_len would be 4096 positions
    default = await engine_factory(max_running=8, max_model_len=512)
    assert default.capacity == 8 * 512  # unset: what the rows could hold at most


async def test_requests_wait_for_blocks_and_nothing_is_lost(tiny, engine_factory):
    """A pool of 48 positions for 6 sequences of up to 36: requests wait for blocks though rows
    are free, running ones are preempted and recomputed; every sequence ends with the tokens and
    logprobs of a plain full forward."""
    ref = load_causal_lm(tiny[0])
    eng = await engine_factory(max_running=6, kv_capacity_tokens=48, block_tokens=8)
    lengths = [30, 12, 28, 6, 31, 20]
    sp = [SamplingParams(0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    for i in range(6):
        eng.submit(GenRequest(f"w{i}", np.array(PROMPTS[i % 5]), sp[i], single=True))
    got: dict[str, list[int]] = {f"w{i}": [] for i in range(6)}
    lps: dict[str, list[float]] = {f"w{i}": [] for i in range(6)}
    waited_for_blocks = False
    done = 0
    while done < 6:
        ev = await eng.next_event(timeout=T)
        got[ev.seq_id] += ev.token_ids.tolist()
        lps[ev.seq_id] += ev.logprobs.tolist()
        st = eng.stats()
        waited_for_blocks |= st.waiting > 0 and st.running < 6
        assert 0.0 <= st.kv_use <= 1.0
        if ev.finished:
            assert ev.finish_reason == "length"
            done += 1
    assert waited_for_blocks and eng.preemptions > 0 and eng.kv_truncated == 0
    for i in range(6):
        prompt = PROMPTS[i % 5]
        assert got[f"w{i}"] == greedy_reference(ref, prompt, lengths[i])
        rec = recompute_logprobs(ref, prompt, got[f"w{i}"], 0.0, 1.0)
        np.testing.assert_allclose(lps[f"w{i}"], rec, atol=1e-4, rtol=0)
    assert eng.cache.free_blocks == eng.cache.blocks


async def test_a_sequence_outgrowing_the_whole_pool_ends_with_length(tiny, engine_factory):
    """24 positions: a sequence alone can hold 24; at 5 prompt + 20 response tokens it needs a 25th,
    so it ends there ("length", counted) with every token it made; others keep running."""
    ref = load_causal_lm(tiny[0])
    eng = await engine_factory(
        max_running=2, max_model_len=64, kv_capacity_tokens=24, block_tokens=8
    )
    long = SamplingParams(0.0, max_tokens=40, ignore_eos=True)
    ids, _, reason = (await eng.generate_all(GenRequest("big", np.array(PROMPTS[0]), long)))[
        "big/0"
    ]
    assert reason == "length" and ids.tolist() == greedy_reference(ref, PROMPTS[0], 20)
    assert eng.kv_truncated == 1
    short = SamplingParams(0.0, max_tokens=8, ignore_eos=True)
    ids, _, reason = (await eng.generate_all(GenRequest("s", np.array(PROMPTS[1]), short)))["s/0"]
    assert reason == "length" and ids.tolist() == greedy_reference(ref, PROMPTS[1], 8)
    # a prompt that cannot fit even alone is refused at submit
    res = await eng.generate_all(GenRequest("huge", np.arange(4, 30) % 30 + 4, short), timeout=T)
    assert res["huge/0"][2] == "error"


async def test_contiguous_rows_by_default_and_both_layouts_agree(engine_factory):
    """A pool that covers every row at max_model_len (the default) gives each row a fixed
    contiguous range, read as a slice; one position short it is paged (gathered). The long tail
    (rows leave and are moved, mixed positions, masks) ends with the same tokens and logprobs."""
    dense = await engine_factory(max_running=4, max_model_len=256, block_tokens=4)
    paged = await engine_factory(
        max_running=4, max_model_len=256, block_tokens=4, kv_capacity_tokens=4 * 256 - 1
    )
    assert dense.cache.contiguous and not paged.cache.contiguous
    assert dense.cache.table[1, 0] == 1 + 256 // 4  # row 1's range follows row 0's

    def req(i: int, n: int) -> GenRequest:
        sp = SamplingParams(1.0, 0.9, max_tokens=n, seed=9, ignore_eos=True)
        return GenRequest(f"c{i}", np.array(PROMPTS[i % 5]), sp, single=True)

    reqs = [req(i, n) for i, n in enumerate(LONG_TAIL)]
    a = await asyncio.gather(*(dense.generate_all(r, timeout=30) for r in reqs))
    b = await asyncio.gather(*(paged.generate_all(r, timeout=30) for r in reqs))
    for r, x, y in zip(reqs, a, b, strict=True):
        assert x[r.req_id][0].tolist() == y[r.req_id][0].tolist()
        np.testing.assert_allclose(x[r.req_id][1], y[r.req_id][1], atol=1e-5, rtol=0)
    assert dense.cache.free_blocks == dense.cache.blocks == 4 * 256 // 4
