"""Advantage estimators, policy losses and IS weights against hand-computed values.

.venv/bin/python -m pytest tests/test_algo.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from laminar.algo.advantages import compute_advantages, group_index
from laminar.algo.losses import (
    LossSettings,
    aggregate,
    behaviour_weights,
    gspo_ratio,
    kl_k3,
    policy_loss,
    ppo_token_loss,
)
from laminar.algo.metrics import StatAccumulator, length_stats, normalized_ess, staleness_histogram

T = torch.tensor


def close(a, b, tol=1e-5):
    assert torch.allclose(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol
    ), (a, b)


# ---- advantages ---------------------------------------------------------------------------


def test_group_index_is_dense_in_order_of_first_appearance():
    assert group_index(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]


def test_grpo_with_and_without_std():
    r, g = T([1.0, 0.0, 1.0, 1.0]), T([0, 0, 1, 1])
    # group 0: mean .5, unbiased std sqrt(.5); group 1: all equal -> 0
    close(compute_advantages(r, g, "grpo"), [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), 0, 0])
    close(compute_advantages(r, g, "grpo", norm_std=False), [0.5, -0.5, 0, 0])
    close(compute_advantages(r, g, "dr_grpo"), [0.5, -0.5, 0, 0])


def test_rloo_is_leave_one_out_mean():
    r, g = T([3.0, 0.0, 0.0, 1.0, 0.0]), T([0, 0, 0, 1, 1])
    # sample 0: 3 - mean(0, 0) = 3; sample 1: 0 - mean(3, 0) = -1.5; group 1: +-1
    close(compute_advantages(r, g, "rloo"), [3.0, -1.5, -1.5, 1.0, -1.0])


def test_reinforce_pp_baseline_group_mean_then_batch_std():
    r, g = T([1.0, 0.0, 2.0, 0.0]), T([0, 0, 1, 1])
    centred = torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float64)
    std = math.sqrt((0.25 + 0.25 + 1 + 1) / 3)
    close(compute_advantages(r, g, "reinforce_pp_baseline"), centred / std)


def test_singleton_group_has_zero_advantage_and_bad_input_is_rejected():
    r, g = T([5.0, 1.0, 0.0]), T([0, 1, 1])
    for est in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        assert compute_advantages(r, g, est)[0] == 0.0
    with pytest.raises(ValueError, match="finite"):
        compute_advantages(T([float("nan"), 1.0]), T([0, 0]))
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages(r, g, "gae")


# ---- PPO surrogate, aggregation ------------------------------------------------------------


def test_ppo_clip_higher_and_dual_clip_hand_values():
    ratio = T([[1.5, 0.5, 1.0, 5.0, 0.5]])
    adv = T([[1.0, 1.0, -1.0, -1.0, -1.0]])
    mask = torch.ones_like(ratio, dtype=torch.bool)
    stats = StatAccumulator()
    loss = ppo_token_loss(
        ratio.log(),
        torch.zeros_like(ratio),
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
        stats=stats,
    )
    # 1.5,A+ -> clipped at 1.28; 0.5,A+ -> -0.5; 1.0 -> 1; 5.0,A- -> 5 capped by dual clip at 3;
    # 0.5,A- -> 0.8
    close(loss, [[-1.28, -0.5, 1.0, 3.0, 0.8]])
    out = stats.finalize()
    # the clipped term binds at tokens 0 and 4 only (at token 3 the unclipped -A r is the larger)
    assert out["frac/clip"] == pytest.approx(2 / 5)
    assert out["frac/clip_high"] == pytest.approx(1 / 5)
    assert out["frac/clip_low"] == pytest.approx(1 / 5)
    assert out["frac/clip_dual"] == pytest.approx(1 / 5)
    no_dual = ppo_token_loss(
        ratio.log(),
        torch.zeros_like(ratio),
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=None,
    )
    assert no_dual[0, 3] == pytest.approx(5.0)


def test_aggregation_modes():
    loss = T([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    assert aggregate(loss, mask, "token_mean", 4, 2) == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq_mean_token_mean", 4, 2) == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert aggregate(loss, mask, "seq_mean_token_sum_norm", 4, 2, norm_constant=4) == pytest.approx(
        10 / 8
    )
    # global denominators: two micro-batches sum to the full-batch loss
    halves = sum(aggregate(loss[i : i + 1], mask[i : i + 1], "token_mean", 4, 2) for i in range(2))
    assert halves == pytest.approx(10 / 4)
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate(loss, mask, "seq_mean_token_sum_norm", 4, 2)


# ---- decoupled PPO and behaviour weights -----------------------------------------------------


def _batch(seed=0, b=3, t=5):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(b, t, generator=g) * 3
    logp = (prox + 0.3 * torch.randn(b, t, generator=g)).requires_grad_()
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 3:] = False
    return logp, prox, adv, mask


@pytest.mark.parametrize("mode", ["truncate", "mask", "none"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_decoupled_with_behaviour_equal_proximal_is_standard_ppo(mode, level, agg):
    logp, prox, adv, mask = _batch()
    s = LossSettings(is_mode=mode, is_level=level, agg=agg, norm_constant=5.0)
    n_tok, n_seq = float(mask.sum()), 3.0
    dec = policy_loss(logp, prox, prox.clone(), adv, mask, s, n_tokens=n_tok, n_seqs=n_seq)
    (g_dec,) = torch.autograd.grad(dec, logp)
    std = aggregate(
        ppo_token_loss(
            logp, prox, adv, mask, clip_low=s.clip_low, clip_high=s.clip_high, dual_clip=s.dual_clip
        ),
        mask,
        agg,
        n_tok,
        n_seq,
        5.0,
    )
    (g_std,) = torch.autograd.grad(std, logp)
    assert torch.equal(dec, std)
    assert torch.equal(g_dec, g_std)


def test_token_truncate_and_mask_values():
    w_true = T([[0.5, 1.5, 3.0, 10.0]])
    behav = torch.zeros(1, 4)
    prox = w_true.log()
    mask = torch.ones(1, 4, dtype=torch.bool)
    close(
        behaviour_weights(prox, behav, mask, "truncate", "token", cap=2.0), [[0.5, 1.5, 2.0, 2.0]]
    )
    close(
        behaviour_weights(prox, behav, mask, "mask", "token", low=0.5, high=2.0),
        [[0.5, 1.5, 0.0, 0.0]],
    )
    # sequence: product 22.5 -> truncated at 2 everywhere, masked everywhere
    close(behaviour_weights(prox, behav, mask, "truncate", "sequence", cap=2.0), [[2.0] * 4])
    close(behaviour_weights(prox, behav, mask, "mask", "sequence", low=0.5, high=2.0), [[0.0] * 4])
    # geometric mean 22.5 ** (1/4) = 2.178: inside [0.5, 3] is kept as is
    geo = 22.5**0.25
    close(behaviour_weights(prox, behav, mask, "mask", "geometric", low=0.5, high=3.0), [[geo] * 4])
    close(behaviour_weights(prox, behav, mask, "none", "token"), [[1.0] * 4])


def test_masking_keeps_the_original_token_denominator():
    prox = torch.zeros(1, 4)
    behav = T([[0.0, 0.0, -5.0, 0.0]])  # token 2: w = e^5, outside [0.5, 2] -> masked
    logp = torch.zeros(1, 4, requires_grad=True)
    adv = torch.ones(1, 4)
    mask = torch.ones(1, 4, dtype=torch.bool)
    s = LossSettings(is_mode="mask", is_low=0.5, is_high=2.0, agg="token_mean")
    stats = StatAccumulator()
    loss = policy_loss(logp, prox, behav, adv, mask, s, n_tokens=4, n_seqs=1, stats=stats)
    # three kept tokens each contribute -1 (ratio 1, A = 1); the masked one 0; denominator stays 4
    assert loss.item() == pytest.approx(-3 / 4)
    (g,) = torch.autograd.grad(loss, logp)
    close(g, [[-0.25, -0.25, 0.0, -0.25]])
    assert stats.finalize()["frac/is_masked"] == pytest.approx(1 / 4)


def test_very_stale_batch_gives_finite_bounded_gradients():
    logp, prox, adv, mask = _batch(seed=1)
    stale = prox - 30.0  # behaviour logprobs far off: w = e^30 before the guard
    n_tok, n_seq = float(mask.sum()), 3.0
    on = policy_loss(logp, prox, prox, adv, mask, LossSettings(), n_tokens=n_tok, n_seqs=n_seq)
    (g_on,) = torch.autograd.grad(on, logp)
    for mode in ("truncate", "mask"):
        for level in ("token", "sequence", "geometric"):
            s = LossSettings(is_mode=mode, is_level=level, is_cap=2.0)
            loss = policy_loss(logp, prox, stale, adv, mask, s, n_tokens=n_tok, n_seqs=n_seq)
            (g,) = torch.autograd.grad(loss, logp)
            assert torch.isfinite(loss) and torch.isfinite(g).all()
            if (
                mode == "truncate"
            ):  # every weight hits the cap: exactly cap x the on-policy gradient
                close(g, 2.0 * g_on)
            else:  # every token is masked: no gradient at all
                assert torch.count_nonzero(g) == 0
    # the other direction (behaviour far more likely than proximal): weights -> ~0, still finite
    loss = policy_loss(
        logp, prox, prox + 30.0, adv, mask, LossSettings(), n_tokens=n_tok, n_seqs=n_seq
    )
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(g).all() and g.abs().max() < 1e-6


def test_non_finite_behaviour_logprobs_are_masked_and_counted():
    logp, prox, adv, mask = _batch()
    behav = prox.clone()
    behav[0, 0] = float("-inf")
    behav[2, 1] = float("nan")
    stats = StatAccumulator()
    loss = policy_loss(
        logp,
        prox,
        behav,
        adv,
        mask,
        LossSettings(),
        n_tokens=float(mask.sum()),
        n_seqs=3.0,
        stats=stats,
    )
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert g[0, 0] == 0 and g[2, 1] == 0
    assert stats.finalize()["frac/bad_behaviour_logp"] == pytest.approx(2 / float(mask.sum()))


# ---- GSPO, KL, entropy -------------------------------------------------------------------------


def test_gspo_ratio_is_the_geometric_mean_and_its_gradient_is_the_sequence_gradient():
    logp, prox, adv, mask = _batch(seed=2)
    r = gspo_ratio(logp, prox, mask)
    for i in range(3):
        m = mask[i]
        s_i = torch.exp((logp[i][m] - prox[i][m]).mean())
        close(r[i][m], s_i.expand(int(m.sum())))
    # unclipped regime: seq-mean-token-mean of -A r has the gradient of -(1/B) sum_i A_i s_i
    s = LossSettings(
        loss="gspo",
        agg="seq_mean_token_mean",
        clip_low=10.0,
        clip_high=10.0,
        dual_clip=None,
        is_mode="none",
    )
    loss = policy_loss(logp, prox, prox, adv, mask, s, n_tokens=float(mask.sum()), n_seqs=3.0)
    (g,) = torch.autograd.grad(loss, logp)
    seq = torch.stack([torch.exp((logp[i][mask[i]] - prox[i][mask[i]]).mean()) for i in range(3)])
    direct = -(adv[:, 0] * seq).sum() / 3
    (g_direct,) = torch.autograd.grad(direct, logp)
    close(g, g_direct)


def test_k3_kl_and_entropy_terms():
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = T([[math.log(2.0), 0.0]])
    close(kl_k3(logp, ref), [[2 - math.log(2) - 1, 0.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    zero = torch.zeros(1, 2)
    ent = T([[1.0, 3.0]])
    s = LossSettings(kl_coef=0.5, entropy_coef=0.1, is_mode="none")
    loss = policy_loss(
        logp, zero, zero, zero, mask, s, n_tokens=2, n_seqs=1, ref_logp=ref, entropy=ent
    )
    assert loss.item() == pytest.approx(0.5 * (2 - math.log(2) - 1) / 2 - 0.1 * 2.0)
    with pytest.raises(ValueError, match="reference"):
        policy_loss(logp, zero, zero, zero, mask, s, n_tokens=2, n_seqs=1, entropy=ent)


# ---- metrics ------------------------------------------------------------------------------------


def test_ess_staleness_lengths_and_nan_safety():
    assert normalized_ess(T([1.0, 1.0, 1.0, 1.0])) == pytest.approx(1.0)
    assert normalized_ess(T([4.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    assert math.isnan(normalized_ess(T([])))
    assert staleness_histogram([0, 2, 0, 1]) == {
        "staleness_hist/0": 2,
        "staleness_hist/1": 1,
        "staleness_hist/2": 1,
    }
    assert length_stats([1, 2, 3, 10])["response_len/max"] == 10.0
    acc = StatAccumulator()
    acc.add("x", T([1.0, float("nan"), 3.0]))
    acc.add("empty", T([1.0]), T([False]))
    out = acc.finalize()
    assert out["x"] == 2.0 and out["x_max"] == 3.0 and out["nonfinite/x"] == 1
    assert math.isnan(out["empty"])


def test_importance_stats_from_behaviour_weights():
    w = T([[1.0, 2.0, 0.5, 1.0]])
    stats = StatAccumulator()
    behaviour_weights(
        w.log(),
        torch.zeros(1, 4),
        torch.ones(1, 4, dtype=torch.bool),
        "truncate",
        cap=1.5,
        stats=stats,
    )
    out = stats.finalize()
    assert out["is/w"] == pytest.approx(1.125) and out["is/w_max"] == pytest.approx(2.0)
    assert out["is/ess"] == pytest.approx(4.5**2 / (4 * 6.25))
    assert out["frac/is_truncated"] == pytest.approx(0.25)
    k3 = sum(x - 1 - math.log(x) for x in (1.0, 2.0, 0.5, 1.0)) / 4
    assert out["mismatch/kl_k3"] == pytest.approx(k3)
