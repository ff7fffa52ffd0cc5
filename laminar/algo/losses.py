"""Policy losses: decoupled PPO (clip-higher, dual-clip) and GSPO, with behaviour-weight
truncation/masking, loss aggregation, optional k3 KL and entropy bonus. Pure torch.

All tensors are [B, T] in the response-token frame (T = padded response positions):

    logp      log pi_theta   (grad)          the policy being optimised
    prox_logp log pi_prox    (no grad)       trainer recompute at the start of the step
    behav_logp log mu        (data)          what the sampler actually used
    adv       advantages broadcast to tokens; mask = model-written response tokens (1) /
              prompt, padding and environment tokens of multi-turn episodes (0)

    u = pi_theta / pi_prox        PPO ratio, clipped to [1 - eps_low, 1 + eps_high]
    w = sg[pi_prox / mu]          behaviour weight, truncated at is_cap or masked outside
                                  [is_low, is_high], per token / sequence / geometric mean
    l_t = w_t * max(-A u, -A clip(u)) (dual-clip: min(., -c A) where A < 0)

With mu == pi_prox, w == 1 and this is standard PPO exactly (tests check it). Without
decoupling ("bypass") the caller passes prox_logp = behav_logp and is_mode = none.
The clip only acts where u != 1: in decoupled mode that needs pi_theta to have moved since
pi_prox was taken, i.e. trainer.minibatches > 1 (laminar/trainer/torch_trainer.py); with one
optimizer step per batch u == 1, GSPO's gradient equals PPO's, and w is the only brake.

Aggregation (algorithms.md §2.9) uses *global* denominators passed in by the caller, so
the sum of micro-batch losses equals the full-batch loss, and a masked token keeps its
place in the token count (it contributes 0, it does not inflate the others).
Every count is of model tokens: n_tokens from the caller and |y_i| (mask.sum per row)
exclude environment tokens, which are neither targets nor part of any denominator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laminar.algo.metrics import StatAccumulator

LOG_CLAMP = 20.0
"""Log-ratios are clamped to +-20 before exp (verl / AReaL numerics)."""
KL_CLAMP = 10.0


@dataclass(frozen=True)
class LossSettings:
    """The subset of AlgoConfig the loss reads (a plain dataclass so tests need no config tree)."""

    loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0
    agg: str = "token_mean"
    norm_constant: float | None = None
    kl_coef: float = 0.0
    kl_type: str = "k3_loss"
    entropy_coef: float = 0.0
    is_mode: str = "truncate"
    is_level: str = "token"
    is_cap: float = 2.0
    is_low: float = 0.5
    is_high: float = 2.0

    @classmethod
    def from_algo(cls, algo, max_tokens: int | None = None) -> LossSettings:
        """From an AlgoConfig; the bypass mode (decoupled=False) disables the behaviour weight."""
        return cls(
            loss=algo.loss,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            dual_clip=algo.dual_clip,
            agg=algo.agg,
            norm_constant=algo.norm_constant or (float(max_tokens) if max_tokens else None),
            kl_coef=algo.kl_coef,
            kl_type=algo.kl_type,
            entropy_coef=algo.entropy_coef,
            is_mode=algo.is_mode if algo.decoupled else "none",
            is_level=algo.is_level,
            is_cap=algo.is_cap,
            is_low=algo.is_low,
            is_high=algo.is_high,
        )


def _masked_log_ratio(
    num: torch.Tensor, den: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log(num/den) clamped, 0 where masked or non-finite; also the finite-and-masked selector."""
    raw = num.to(torch.float32) - den.to(torch.float32)
    ok = mask.to(torch.bool) & torch.isfinite(raw)
    return torch.where(ok, raw.clamp(-LOG_CLAMP, LOG_CLAMP), torch.zeros_like(raw)), ok


@torch.no_grad()
def behaviour_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "truncate",
    level: str = "token",
    *,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
    stats: StatAccumulator | None = None,
) -> torch.Tensor:
    """w = pi_prox / mu after truncation or masking, [B, T] float32, 0 on padding and masked tokens.

    level: token (w_t), sequence (prod_t w_t broadcast), geometric (exp(mean_t log w_t) broadcast).
    mode: truncate (min(w, cap)), mask (w if low <= w <= high else 0), none (w = 1).
    Tokens whose behaviour logprob is not finite are masked (bad data must not poison the batch).
    """
    m = mask.to(torch.bool)
    log_w, ok = _masked_log_ratio(prox_logp, behav_logp, m)
    if stats is not None:
        w_tok = torch.exp(log_w)
        stats.add("is/w", w_tok, ok)
        stats.add("is/w_sq", w_tok * w_tok, ok)
        # k3 estimate of KL(mu || pi_prox) from samples of mu, and the plain mean log ratio (k1)
        stats.add("mismatch/kl_k3", torch.exp(log_w) - 1 - log_w, ok)
        stats.add("mismatch/kl_k1", -log_w, ok)
        stats.add("frac/bad_behaviour_logp", (m & ~ok).to(torch.float32), m)
    if mode == "none":
        return ok.to(torch.float32)
    if level == "token":
        log_v = log_w
    elif level in ("sequence", "geometric"):
        seq = log_w.sum(-1, keepdim=True)
        if level == "geometric":
            seq = seq / ok.sum(-1, keepdim=True).clamp(min=1)
        log_v = seq.clamp(-LOG_CLAMP, LOG_CLAMP).expand_as(log_w)
    else:
        raise ValueError(f"unknown is_level {level!r}; use token, sequence or geometric")
    v = torch.exp(log_v)
    if mode == "truncate":
        if stats is not None:
            stats.add("frac/is_truncated", (v > cap).to(torch.float32), ok)
        w = torch.clamp(v, max=cap)
    elif mode == "mask":
        keep = (v >= low) & (v <= high)
        if stats is not None:
            stats.add("frac/is_masked", (~keep).to(torch.float32), ok)
        w = torch.where(keep, v, torch.zeros_like(v))
    else:
        raise ValueError(f"unknown is_mode {mode!r}; use truncate, mask or none")
    return torch.where(ok, w, torch.zeros_like(w))


def ppo_token_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    ratio: torch.Tensor | None = None,
    stats: StatAccumulator | None = None,
) -> torch.Tensor:
    """Per-token clipped surrogate loss max(-A u, -A clip(u)), with dual-clip; 0 on padding."""
    m = mask.to(torch.bool)
    if ratio is None:
        log_u, _ = _masked_log_ratio(logp, prox_logp.detach(), m)
        ratio = torch.exp(log_u)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg1, pg2 = -adv * ratio, -adv * clipped
    loss = torch.maximum(pg1, pg2)
    dual_hit = torch.zeros_like(m)
    if dual_clip is not None:
        pg3 = -adv * dual_clip
        dual_hit = (adv < 0) & (pg3 < loss)
        loss = torch.where(adv < 0, torch.minimum(loss, pg3), loss)
    if stats is not None:
        with torch.no_grad():
            clip_active = pg2 > pg1
            stats.add("ratio", ratio, m)
            stats.add("frac/clip", clip_active.to(torch.float32), m)
            stats.add("frac/clip_high", (clip_active & (ratio > 1)).to(torch.float32), m)
            stats.add("frac/clip_low", (clip_active & (ratio < 1)).to(torch.float32), m)
            stats.add("frac/clip_dual", dual_hit.to(torch.float32), m)
    return torch.where(m, loss, torch.zeros_like(loss))


def gspo_ratio(logp: torch.Tensor, prox_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token ratio: value s_i = exp(mean_t log(pi/pi_prox)) on every token of sequence i,
    gradient s_i * grad log pi_t, so seq-mean-token-mean gives exactly grad s_i (GSPO, §2.7)."""
    m = mask.to(torch.bool)
    log_r, _ = _masked_log_ratio(logp, prox_logp.detach(), m)
    n = m.sum(-1, keepdim=True).clamp(min=1)
    seq = (log_r.sum(-1, keepdim=True) / n).clamp(
        max=10.0
    )  # verl clamps the sequence log-ratio at 10
    token_logp = torch.where(m, logp, torch.zeros_like(logp))
    return torch.exp(seq.detach() + token_logp - token_logp.detach())


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    n_tokens: float,
    n_seqs: float,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce [B, T] per-token losses to a scalar with global denominators (see module doc).

    token_mean               sum / n_tokens
    seq_mean_token_mean      sum_i (sum_t l / |y_i|) / n_seqs
    seq_mean_token_sum_norm  sum / (n_seqs * norm_constant)   (Dr. GRPO; constant = max length)
    """
    m = mask.to(loss_mat.dtype)
    total = (loss_mat * m).sum(-1)
    if mode == "token_mean":
        return total.sum() / max(float(n_tokens), 1.0)
    if mode == "seq_mean_token_mean":
        return (total / m.sum(-1).clamp(min=1)).sum() / max(float(n_seqs), 1.0)
    if mode == "seq_mean_token_sum_norm":
        if not norm_constant:
            raise ValueError(
                "seq_mean_token_sum_norm needs algo.norm_constant (or rollout.sampling.max_tokens)"
            )
        return total.sum() / (max(float(n_seqs), 1.0) * float(norm_constant))
    raise ValueError(f"unknown loss aggregation {mode!r}")


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = pi_ref/pi - log(pi_ref/pi) - 1 per token (unbiased, >= 0), clamped like verl."""
    log_r = (ref_logp.detach() - logp).clamp(-LOG_CLAMP, LOG_CLAMP)
    return (torch.exp(log_r) - log_r - 1).clamp(-KL_CLAMP, KL_CLAMP)


def policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    s: LossSettings,
    *,
    n_tokens: float,
    n_seqs: float,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    stats: StatAccumulator | None = None,
) -> torch.Tensor:
    """The full per-micro-batch loss (already divided by the global denominators)."""
    m = mask.to(torch.bool)
    w = behaviour_weights(
        prox_logp,
        behav_logp,
        m,
        s.is_mode,
        s.is_level,
        cap=s.is_cap,
        low=s.is_low,
        high=s.is_high,
        stats=stats,
    )
    if s.loss == "gspo":
        ratio = gspo_ratio(logp, prox_logp, m)
    elif s.loss == "ppo":
        ratio = None
    else:
        raise ValueError(f"unknown loss {s.loss!r}; use ppo or gspo")
    pg = ppo_token_loss(
        logp,
        prox_logp,
        adv,
        m,
        clip_low=s.clip_low,
        clip_high=s.clip_high,
        dual_clip=s.dual_clip,
        ratio=ratio,
        stats=stats,
    )
    loss = aggregate(pg * w, m, s.agg, n_tokens, n_seqs, s.norm_constant)
    if stats is not None:
        stats.add("sum/loss/pg", loss.detach())
    if s.kl_coef > 0 and s.kl_type == "k3_loss":
        if ref_logp is None:
            raise ValueError("kl_type=k3_loss with kl_coef > 0 needs reference logprobs")
        kl = aggregate(kl_k3(logp, ref_logp), m, s.agg, n_tokens, n_seqs, s.norm_constant)
        loss = loss + s.kl_coef * kl
        if stats is not None:
            stats.add("sum/loss/kl", kl.detach())
    if s.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs per-token entropy")
        ent = aggregate(entropy, m, s.agg, n_tokens, n_seqs, s.norm_constant)
        loss = loss - s.entropy_coef * ent
        if stats is not None:
            stats.add("sum/loss/entropy", ent.detach())
    return loss
