"""Log-probabilities and entropies of target tokens without a [tokens, vocab] fp32 tensor alive.

    logp, ent = token_logprobs(hidden, head_weight, head_bias, targets, temperature, chunk=1024)
    # hidden [N, D] (the positions that predict a trained token), targets [N]

Why: a 7B Qwen's vocabulary is 152k; the full computation holds fp32 logits (and, for backward,
their softmax) for every trained token of a micro-batch: 16k tokens x 152k x 4 B = 10 GB, twice.
Here the head's matmul, the log-softmax and the entropy run over `chunk` tokens at a time in
fp32; only each token's log-sum-exp is kept, and backward recomputes a chunk's logits to form
its gradient (softmax - one-hot, and the entropy's -p (z - E_p z)). The largest temporary is then
`chunk x vocab` fp32 (1024 x 152k: 0.6 GB), independent of the micro-batch size.

Exactness: the same fp32 arithmetic as `full_token_logprobs` (logits = h W^T + b, / T, log-softmax),
chunk by chunk; tests/test_logprobs.py checks values and gradients agree within 1e-5.
The head weight is cast to fp32 once per call (a bf16 weight under FSDP's mixed precision).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, temp: float) -> torch.Tensor:
    with torch.autocast(h.device.type, enabled=False):
        z = F.linear(h.float(), w, b)
    return z / temp if temp != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        w = weight.float()
        b = None if bias is None else bias.float()
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        for s in range(0, n, chunk):
            z = _logits(hidden[s : s + chunk], w, b, temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s : s + chunk] = lse_c
            logp[s : s + chunk] = z.gather(-1, targets[s : s + chunk, None]).squeeze(-1) - lse_c
            ent[s : s + chunk] = lse_c - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(
        ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[Any, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temp, chunk = ctx.temperature, ctx.chunk
        w = weight.float()
        b = None if bias is None else bias.float()
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_h = torch.empty_like(hidden) if need_h else None
        g_w = torch.zeros_like(w) if need_w else None
        g_b = torch.zeros_like(b) if need_b and b is not None else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            z = _logits(h, w, b, temp)
            # one [chunk, V] buffer becomes p, then the gradient (two when the entropy has one)
            p = (z if g_ent is None else z.clone()).sub_(lse[s : s + chunk, None]).exp_()
            if g_ent is not None:  # d H / dz = -p (z - E_p z)
                mean_z = (p * z).sum(-1, keepdim=True)
                z.sub_(mean_z).mul_(p).mul_(-g_ent[s : s + chunk, None])
            if g_logp is not None:  # d logp / dz = onehot(target) - p
                gl = g_logp[s : s + chunk, None]
                g_z = p.mul_(-gl).scatter_add_(-1, targets[s : s + chunk, None], gl)
                if g_ent is not None:
                    g_z.add_(z)
            else:
                g_z = z
            if temp != 1.0:
                g_z.div_(temp)
            if g_h is not None:
                g_h[s : s + chunk] = (g_z @ w).to(hidden.dtype)
            if g_w is not None:
                g_w.addmm_(g_z.t(), h.float())
            if g_b is not None:
                g_b += g_z.sum(0)
        g_weight = None if g_w is None else g_w.to(weight.dtype)
        g_bias = None if g_b is None else g_b.to(bias.dtype)
        return g_h, g_weight, g_bias, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(h W^T + b / T)[target], entropy), both [N] fp32, `chunk` tokens at a time and
    recomputed in backward. The entropy has a gradient where its caller uses one."""
    out = _ChunkedLogprobs.apply(hidden, weight, bias, targets, float(temperature), int(chunk))
    return out[0], out[1]


def full_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same figures from the whole [N, V] fp32 logits at once (autograd keeps them and their
    softmax for backward): the reference, and trainer.logprob_chunk_tokens = 0."""
    z = _logits(hidden, weight.float(), None if bias is None else bias.float(), temperature)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, ent
