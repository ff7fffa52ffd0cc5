"""Chunked log-probabilities (laminar/trainer/logprobs.py) equal the full fp32 computation.

.venv/bin/python -m pytest tests/test_logprobs.py -q
"""

from __future__ import annotations

import pytest
import torch

from laminar.trainer.logprobs import full_token_logprobs, token_logprobs


def _inputs(n: int, d: int, v: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float32, requires_grad=True)
    w = (torch.randn(v, d, generator=g) / d**0.5).requires_grad_(True)
    b = (torch.randn(v, generator=g) * 0.1).requires_grad_(True) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    return h, w, b, t


@pytest.mark.parametrize(
    ("chunk", "temperature", "bias"), [(7, 1.0, False), (16, 0.7, True), (1000, 1.3, False)]
)
def test_chunked_equals_full_values_and_gradients(chunk, temperature, bias):
    n, d, v = 50, 24, 97
    h, w, b, t = _inputs(n, d, v, bias)
    g = torch.Generator().manual_seed(1)
    g_logp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    leaves = [x for x in (h, w, b) if x is not None]

    def run(fn, **kw):
        logp, ent = fn(h, w, b, t, temperature, **kw)
        grads = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), leaves)
        return logp.detach(), ent.detach(), grads

    ref = run(full_token_logprobs)
    got = run(token_logprobs, chunk=chunk)
    assert torch.allclose(got[0], ref[0], atol=1e-5, rtol=0)
    assert torch.allclose(got[1], ref[1], atol=1e-5, rtol=0)
    for a, r in zip(got[2], ref[2], strict=True):
        assert torch.allclose(a, r, atol=1e-5, rtol=0)
    assert float(ref[2][0].abs().max()) > 1e-3  # the gradients compared are not all ~0


def test_logp_only_gradient_skips_entropy():
    """An unused entropy output contributes no gradient (its grad is None, not zeros)."""
    h, w, b, t = _inputs(20, 8, 33, False, seed=3)
    logp, _ = token_logprobs(h, w, b, t, chunk=6)
    (gh,) = torch.autograd.grad(logp.sum(), [h])
    logp_ref, _ = full_token_logprobs(h, w, b, t)
    (gr,) = torch.autograd.grad(logp_ref.sum(), [h])
    assert torch.allclose(gh, gr, atol=1e-5, rtol=0)
