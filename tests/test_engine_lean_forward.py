"""The torch engine's lean forward equals the HF model's own forward, per architecture it claims.

    .venv/bin/python -m pytest tests/test_engine_lean_forward.py -q

Each case builds a tiny random model of one family in memory (no files, no hub), runs one
packed prefill step (two sequences), one packed decode step and a mixed step (a decode query and
a segment continuing a cached prefix) through the paged KV cache
with LeanDecoder, and compares the logits with a plain full-sequence HF forward (eager
attention, no cache) of the same model. Families it must not run fall back to HF.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from laminar.engines.base import GenRequest, SamplingParams
from laminar.engines.kv_cache import PagedKVCache
from laminar.engines.lean_forward import LeanDecoder
from laminar.engines.torch_engine import TorchEngine
from laminar.models.decoder_ops import unsupported

SMALL = dict(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.3,
)


def _model(kind: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind, **SMALL, **extra)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


CASES = {
    "llama": dict(kind="llama"),
    "llama-bias": dict(kind="llama", attention_bias=True),
    "llama3-rope": dict(
        kind="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "mistral": dict(kind="mistral", sliding_window=None),
    "qwen2": dict(kind="qwen2"),
    "qwen3": dict(kind="qwen3", head_dim=8),
    # mixture-of-experts: routed MLPs through models/moe.py (HF's router weight and experts)
    "qwen3_moe": dict(
        kind="qwen3_moe",
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
    ),
    "mixtral": dict(
        kind="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None
    ),
}


def _reference(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0, -1]


@pytest.mark.parametrize("case", list(CASES))
def test_lean_step_logits_equal_hf_forward(case):
    spec = dict(CASES[case])
    model = _model(spec.pop("kind"), **spec)
    assert unsupported(model, 64) is None
    lean = LeanDecoder(model, 64)
    # 3 positions a block: both sequences span several blocks, interleaved in the pool
    cache = PagedKVCache.for_model(model, capacity_tokens=30, rows=2, max_len=64, block_tokens=3)
    a, b = [5, 6, 7, 8, 9], [11, 12, 13]
    with torch.inference_mode():
        # step 1: both prompts prefilled in one packed forward (row 0: a, row 1: b)
        assert cache.reserve(0, 3) and cache.reserve(1, 3) and cache.reserve(0, len(a) + 1)
        assert cache.reserve(1, len(b) + 1)
        lay = cache.step_layout([], [(0, 0, len(a)), (1, 0, len(b))])
        ids = torch.tensor(a + b)
        pos = torch.tensor(list(range(len(a))) + list(range(len(b))))
        with cache.step(lay):
            got = lean(ids, pos, torch.tensor([len(a) - 1, len(a) + len(b) - 1]), cache)
        torch.testing.assert_close(got[0], _reference(model, a), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], _reference(model, b), rtol=1e-5, atol=1e-5)
        # step 2: one decode token each, at each sequence's own position
        a2, b2 = a + [21], b + [22]
        lay = cache.step_layout([len(a), len(b)], [])
        with cache.step(lay):
            got = lean(
                torch.tensor([21, 22]), torch.tensor([len(a), len(b)]), torch.tensor([0, 1]), cache
            )
        # step 3: b continues with a 3-token segment after its cached prefix (start > 0) while a
        # decodes
        a3, b3 = a2 + [23], b2 + [24, 25, 26]
        assert cache.reserve(0, len(a3)) and cache.reserve(1, len(b3))
        lay = cache.step_layout([len(a2)], [(1, len(b2), 3)])
        ids = torch.tensor([23, 24, 25, 26])
        pos = torch.tensor([len(a2), len(b2), len(b2) + 1, len(b2) + 2])
        with cache.step(lay):
            got3 = lean(ids, pos, torch.tensor([0, 3]), cache)
    torch.testing.assert_close(got3[0], _reference(model, a3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got3[1], _reference(model, b3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], _reference(model, a2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], _reference(model, b2), rtol=1e-5, atol=1e-5)


def test_models_it_cannot_run_exactly_fall_back_to_hf():
    dynamic = _model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "dynamic" in (unsupported(dynamic, 64) or "")
    windowed = _model("mistral", sliding_window=16)
    assert "sliding window" in (unsupported(windowed, 64) or "")
    gpt2 = _model("gpt2")
    assert "model_type" in (unsupported(gpt2, 64) or "")
    auto = TorchEngine(dynamic, max_running=2, max_model_len=64, eos_token_ids=[])
    assert auto.lean is None  # auto: the HF forward runs it
    with pytest.raises(ValueError, match="torch_forward=lean cannot run this model: rope_type"):
        TorchEngine(dynamic, max_running=2, max_model_len=64, eos_token_ids=[], forward="lean")
    with pytest.raises(ValueError, match="auto, lean or hf"):
        TorchEngine(
            _model("llama"), max_running=2, max_model_len=64, eos_token_ids=[], forward="fast"
        )


async def test_weights_loaded_in_place_reach_the_fused_copies():
    """load_weights copies into the model's tensors; the lean forward's fused q/k/v and gate/up
    copies must follow, or it would sample from the old policy."""
    model, other = _model("qwen2"), _model("qwen2")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    eng = TorchEngine(model, max_running=2, max_model_len=64, eos_token_ids=[], forward="lean")
    await eng.start()
    try:
        await eng.load_weights(other.state_dict().items(), version=1)
        got = (await eng.generate_all(GenRequest("p", np.array([3, 4, 5]), params, single=True)))[
            "p"
        ][0]
    finally:
        await eng.close()
    ref = [3, 4, 5]
    for _ in range(8):
        ref.append(int(_reference(other, ref).argmax()))
    assert got.tolist() == ref[3:]


def test_rolled_rotation_and_fused_norm_equal_hf_formulas() -> None:
    """The three-op RoPE (rotate, the sign folded into sin) and the
    single-call float32 RMSNorm are HF's formulas to float rounding (a fused multiply-add)."""
    from laminar.models.decoder_ops import rms, rotate, signed_sin

    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 6, 16, generator=g)
    ang = torch.randn(7, 1, 16, generator=g)
    cos, sin = ang.cos(), ang.sin()
    assert torch.allclose(
        rotate(x, cos, signed_sin(sin)),
        x * cos + torch.cat([-x[..., 8:], x[..., :8]], -1) * sin,
        rtol=0,
        atol=1e-6,
    )
    w = torch.randn(16, generator=g)
    hf = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(rms(x, w, 1e-6), hf, rtol=1e-6, atol=1e-6)
    xb = x.bfloat16()  # other dtypes: normalised in float32, back, then scaled
    assert rms(xb, w.bfloat16(), 1e-6).dtype == torch.bfloat16
