"""Sampling with exact behaviour logprobs (temperature + top-p), batched, seedable per sequence.

    # (N, V): log of the distribution we sample from
    logp = processed_logprobs(logits, temperature, top_p)
    # one token per row + its logprob under `logp`
    tokens, lps = sample(logits, temperature, top_p, uniforms)

The logprob of a sampled token is taken from the same (N, V) tensor the token is
drawn from, so the trainer sees exactly the behaviour policy:

  * temperature > 0: log_softmax(logits / T), then top-p keeps the smallest set of
    most likely tokens whose mass reaches top_p (a token is kept when the mass of
    the tokens ranked strictly before it is < top_p) and renormalises over it;
  * temperature == 0 (greedy): the token is the argmax and its logprob is the plain
    log_softmax(logits) of it (temperature and top-p do not apply).

Randomness is counter-based: the draw for token t of a sequence is a hash of
(sequence key, t), so a seeded sequence yields the same tokens whatever batch it
shares and after it is aborted and resumed on another engine (same seq id).
"""

from __future__ import annotations

import hashlib

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sequence_key(seed: int | None, seq_id: str) -> int:
    """64-bit stream key of a sequence: from (seed, seq_id) when seeded, else fresh randomness."""
    if seed is None:
        import os

        return int.from_bytes(os.urandom(8), "little")
    h = hashlib.blake2b(f"{seed}\x00{seq_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def uniform(key: int, t: int) -> float:
    """The draw for token index t of the stream `key`, in the open interval (0, 1)."""
    z = _splitmix64(key ^ _splitmix64(t))
    return ((z >> 11) + 0.5) / float(1 << 53)


def processed_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """(N, V) float32 logprobs of the sampling distribution; -inf outside the top-p support.

    temperature: (N,) float, 0 marks greedy rows (plain log_softmax); top_p: (N,) float in (0, 1].
    """
    logits = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.dtype)
    logp = torch.log_softmax(logits / t[:, None], dim=-1)
    nucleus = (top_p < 1.0) & ~greedy
    if bool(nucleus.any()):
        rows = nucleus.nonzero().squeeze(1)
        sub = logp[rows]
        sorted_lp, order = sub.sort(dim=-1, descending=True)
        probs = sorted_lp.exp()
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p[rows, None].to(probs.dtype)
        drop_sorted[:, 0] = False  # the most likely token always survives
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        sub = sub.masked_fill(drop, float("-inf"))
        logp[rows] = sub - torch.logsumexp(sub, dim=-1, keepdim=True)
    return logp


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    plain: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverse CDF with the given uniforms; return (tokens, logprobs).

    Greedy rows (temperature 0) take the argmax and ignore their uniform. `plain`: the caller
    knows every row samples at temperature 1 with top_p 1 (RL's usual setting), so the draw skips
    the greedy and nucleus checks; the tokens and logprobs are the same tensors bit for bit.
    """
    if plain:
        logp = torch.log_softmax(logits.float(), dim=-1)
        return _draw(logp, uniforms, logits.shape[-1])
    logp = processed_logprobs(logits, temperature, top_p)
    greedy = temperature <= 0
    if bool(greedy.all()):
        tokens = logp.argmax(dim=-1)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
    drawn, lps = _draw(logp, uniforms, logits.shape[-1])
    if not bool(greedy.any()):
        return drawn, lps
    tokens = torch.where(greedy, logp.argmax(dim=-1), drawn)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def _draw(
    logp: torch.Tensor, uniforms: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw of one token per row of logp (N, V); (tokens, their logprobs)."""
    cdf = logp.exp().cumsum(-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=vocab - 1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
