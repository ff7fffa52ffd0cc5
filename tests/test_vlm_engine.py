"""The VLM engine: a tiny Qwen2-VL generating a group with its image through HF's forward,
exact logprobs, seeded determinism, abort + resume elsewhere, weight loads."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from laminar.data.vision_prompts import VisionEncoder
from laminar.engines.base import GenRequest, SamplingParams
from laminar.engines.vlm_engine import VlmEngine
from laminar.models.tiny_vlm import build_tiny_vlm, load_processor, load_vlm
from laminar.tasks import colours
from laminar.vision.images import ImageLimits
from laminar.vision.pixels import pixel_inputs
from laminar.vision.rows import image_messages


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm"), image_size=56)
    proc = load_processor(path)
    png = colours.draw(random.Random(0), "red")
    msgs, imgs = image_messages(
        [{"role": "user", "content": "<image>colour?"}], [png], None, ImageLimits()
    )
    ids, _ = VisionEncoder(proc).encode(msgs, imgs)
    return path, proc, png, ids


def _run(engine, req):
    async def go():
        await engine.start()
        try:
            return await engine.generate_all(req, timeout=60)
        finally:
            await engine.close()

    return asyncio.run(go())


def test_a_group_generates_with_its_image_and_exact_logprobs(setup):
    path, proc, png, ids = setup
    model = load_vlm(path)
    params = SamplingParams(max_tokens=6, seed=7, ignore_eos=True)
    req = GenRequest("g", ids, params, n=3, images=(png,))
    out = _run(VlmEngine(model, proc), req)
    assert set(out) == {"g/0", "g/1", "g/2"}
    px = pixel_inputs(proc, [png])
    for toks, lps, reason in out.values():
        assert len(toks) == 6 and reason == "length"
        seq = torch.as_tensor(np.concatenate([ids, toks]).astype(np.int64))[None]
        with torch.no_grad():
            logits = model(
                input_ids=seq,
                mm_token_type_ids=(seq == proc.image_token_id).long(),
                pixel_values=px.pixel_values,
                image_grid_thw=px.grid_thw,
            ).logits[0]
        ref = torch.log_softmax(logits[len(ids) - 1 : -1].float(), -1)
        want = ref[torch.arange(6), torch.as_tensor(toks.astype(np.int64))].numpy()
        np.testing.assert_allclose(lps, want, atol=1e-4)
    again = _run(VlmEngine(model, proc), req)  # seeded: the same draws
    assert all((again[k][0] == out[k][0]).all() for k in out)


def test_the_image_changes_what_is_generated(setup):
    path, proc, png, ids = setup
    model = load_vlm(path)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    other = colours.draw(random.Random(5), "blue")
    a = _run(VlmEngine(model, proc), GenRequest("a", ids, greedy, images=(png,)))
    b = _run(VlmEngine(model, proc), GenRequest("a", ids, greedy, images=(other,)))
    assert a["a/0"][1].tolist() != b["a/0"][1].tolist()  # logprobs differ: the image is read


def test_abort_then_resume_on_another_engine_continues_the_sequence(setup):
    path, proc, png, ids = setup
    params = SamplingParams(max_tokens=40, seed=3, ignore_eos=True)

    async def go():
        src = VlmEngine(load_vlm(path), proc)
        await src.start()
        req = GenRequest("g", ids, params, n=1, images=(png,))
        seen = 0
        async for ev in src.generate(req, timeout=60):
            seen += len(ev.token_ids)
            if seen >= 3:
                (p,) = await src.abort(["g/0"])
                break
        await src.close()
        assert p.images == (png,) and len(p.output_ids) >= 3
        dest = VlmEngine(load_vlm(path), proc)
        await dest.start()
        try:
            out = await dest.generate_all(GenRequest.resume(p, params), timeout=60)
        finally:
            await dest.close()
        return p, out

    p, out = asyncio.run(go())
    toks, lps, reason = out["g/0"]
    assert reason == "length" and len(p.output_ids) + len(toks) == 40
    # seeded per (seq id, index): the resumed tail is what the source would have drawn
    whole = _run(VlmEngine(load_vlm(path), proc), GenRequest("g", ids, params, images=(png,)))
    assert np.concatenate([p.output_ids, toks]).tolist() == whole["g/0"][0].tolist()


def test_load_weights_replaces_the_served_weights(setup):
    path, proc, _, _ = setup
    engine = VlmEngine(load_vlm(path), proc)
    name, value = next(iter(engine.model.state_dict().items()))

    async def go():
        await engine.start()
        try:
            await engine.load_weights([(name, torch.zeros_like(value))], version=2)
            with pytest.raises(KeyError):
                await engine.load_weights([("nope", value)], version=3)
        finally:
            await engine.close()

    asyncio.run(go())
    assert engine.version == 2 and not engine.model.state_dict()[name].any()


def test_the_factory_picks_the_vlm_engine_and_vllm_with_the_image_token(setup):
    from laminar.config import ModelConfig, RolloutConfig
    from laminar.engines.factory import make_engine
    from laminar.engines.vllm_engine import VllmEngine

    path, proc = str(setup[0]), setup[1]
    engine = make_engine(RolloutConfig(engine="torch"), ModelConfig(path=path))
    assert isinstance(engine, VlmEngine)
    served = make_engine(RolloutConfig(engine="vllm"), ModelConfig(path=path))
    assert isinstance(served, VllmEngine) and served.image_token_id == proc.image_token_id


def test_an_abort_that_empties_the_queue_before_the_step_takes_it(setup):
    """The step loop saw a waiting group, then waited for the lock while an abort took that group
    away: it must go on (it once popped an empty queue and died)."""
    path, proc, png, ids = setup
    params = SamplingParams(max_tokens=3, seed=1, ignore_eos=True)

    async def go():
        engine = VlmEngine(load_vlm(path), proc)
        await engine.start()
        try:
            async with engine._lock:  # the loop wakes, sees the group, blocks on the lock
                engine.submit(GenRequest("b", ids, params, images=(png,)))
                for _ in range(1000):  # until the step loop waits on the lock (bounded)
                    if engine._lock._waiters:
                        break
                    await asyncio.sleep(0)
                assert engine._lock._waiters, "the step loop never waited for the lock"
                (p,) = engine._drop({"b/0"})  # what abort() does under the lock
                assert not engine._waiting and len(p.output_ids) == 0
            for _ in range(20):  # the loop takes the lock, with nothing queued
                await asyncio.sleep(0)
            assert not engine._task.done(), engine._task.exception()
            out = await engine.generate_all(GenRequest("c", ids, params, images=(png,)), 60)
            assert engine._task is not None and not engine._task.done()
            return out
        finally:
            await engine.close()

    out = asyncio.run(go())
    assert len(out["c/0"][0]) == 3
