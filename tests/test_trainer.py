"""Trainer policy on CPU with a random tiny model: learning, micro-batching, checkpoints, resume.

.venv/bin/python -m pytest tests/test_trainer.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from laminar.config import config_from_dict
from laminar.protocol.data import Trajectory
from laminar.trainer import checkpoint as ck
from laminar.trainer.batch import TrainBatch
from laminar.trainer.micro_batch import collate
from laminar.trainer.packing import pack_micro_batches
from laminar.trainer.torch_trainer import TorchTrainer, lr_lambda
from laminar.wiring.trainer import trainer_settings


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from laminar.models.tiny import build_tiny_model

    return str(
        build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=32, layers=1, heads=2, kv_heads=1)
    )


def make_cfg(model_path, run_dir, **trainer):
    tr = {"lr": 3e-3, "total_steps": 20, "micro_batch_tokens": 4096, "grad_clip": 10.0, **trainer}
    return config_from_dict(
        {
            "run_dir": str(run_dir),
            "model": {"path": model_path},
            "trainer": tr,
            "algo": {"advantage": "grpo", "is_mode": "truncate"},
            "rollout": {"sampling": {"temperature": 1.0, "max_tokens": 16}},
        }
    )


def make_trajs(n_groups=4, group=4, seed=0, vocab=(4, 40), version=0, behav=None):
    """Random prompts/responses; reward 1 when the first response token is even (varies inside
    groups)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        prompt = rng.integers(*vocab, size=rng.integers(3, 7)).astype(np.int32)
        for i in range(group):
            resp = rng.integers(*vocab, size=rng.integers(2, 9)).astype(np.int32)
            lp = np.full(len(resp), -3.0, dtype=np.float32) if behav is None else behav(resp)
            out.append(
                Trajectory(
                    uid=f"s{seed}g{g}/{i}",
                    group_id=f"s{seed}g{g}",
                    prompt_uid=f"p{g}",
                    sample_index=i,
                    prompt_ids=prompt,
                    response_ids=resp,
                    logprobs=lp,
                    version=version,
                    reward=float(resp[0] % 2 == 0),
                )
            )
    return out


def on_policy(policy: TorchTrainer, trajs):
    """Replace behaviour logprobs by the policy's own (what an exact sampler would have logged)."""
    batch = TrainBatch.build(trajs)
    with torch.no_grad():
        mb = collate(batch, list(range(batch.n_seqs)))
        logp, _ = policy.model.token_logprobs(mb)
    for i, t in enumerate(trajs):
        t.logprobs = logp[i][mb.resp_mask[i]].numpy().astype(np.float32)
    return trajs


def params(policy):
    return {k: v.detach().clone() for k, v in policy.model.module.state_dict().items()}


def test_loss_decreases_and_parameters_change(tiny, tmp_path):
    policy = TorchTrainer(trainer_settings(make_cfg(tiny, tmp_path)), tiny)
    trajs = on_policy(policy, make_trajs())
    batch = TrainBatch.build(trajs)
    before = params(policy)
    pos = batch.rewards > 0

    def mean_logp(sel):
        with torch.no_grad():
            mb = collate(batch, list(range(batch.n_seqs)))
            logp, _ = policy.model.token_logprobs(mb)
        per_seq = (logp * mb.resp_mask).sum(-1) / mb.resp_mask.sum(-1)
        return float(per_seq[sel].mean())

    lp_pos0, lp_neg0 = mean_logp(pos), mean_logp(~pos)
    losses = [policy.train_step(batch)["loss"] for _ in range(6)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses
    after = params(policy)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # GRPO moved probability mass from the zero-reward responses to the rewarded ones
    assert mean_logp(pos) > lp_pos0 and mean_logp(~pos) < lp_neg0


def test_step_metrics_cover_the_algorithm(tiny, tmp_path):
    policy = TorchTrainer(trainer_settings(make_cfg(tiny, tmp_path)), tiny)
    m = policy.train_step(TrainBatch.build(on_policy(policy, make_trajs())))
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "reward",
        "adv/mean",
        "entropy",
        "is/w",
        "is/w_max",
        "is/ess",
        "mismatch/kl_k3",
        "frac/clip",
        "frac/is_truncated",
        "response_len/mean",
        "tokens",
    ):
        assert key in m and math.isfinite(m[key]), key
    # on-policy data: the behaviour weight is ~1 everywhere
    assert abs(m["is/w"] - 1) < 1e-4 and m["is/ess"] > 0.999


def test_fused_proximal_logprobs_equal_a_separate_no_grad_pass(tiny, tmp_path):
    policy = TorchTrainer(trainer_settings(make_cfg(tiny, tmp_path)), tiny)
    batch = TrainBatch.build(make_trajs())
    mb = collate(batch, list(range(batch.n_seqs)))
    with torch.no_grad():
        prox, _ = policy.model.token_logprobs(mb)
    logp, _ = policy.model.token_logprobs(mb)
    assert logp.requires_grad and torch.equal(prox, logp.detach())


def test_micro_batching_gives_the_full_batch_gradient(tiny, tmp_path):
    trajs = make_trajs(seed=3)
    grads, losses, n_mb = [], [], []
    for budget in (4096, 24):
        policy = TorchTrainer(
            trainer_settings(make_cfg(tiny, tmp_path, micro_batch_tokens=budget, lr=1e-9)), tiny
        )
        m = policy.train_step(TrainBatch.build(trajs))
        losses.append(m["loss"])
        n_mb.append(m["micro_batches"])
        grads.append(
            torch.cat(
                [p.grad.flatten() for p in policy.model.module.parameters() if p.grad is not None]
            )
        )
    assert n_mb[0] == 1 and n_mb[1] >= 5
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_temperature_divides_the_logits(tiny, tmp_path):
    cfg = make_cfg(tiny, tmp_path)
    cfg.rollout.sampling.temperature = 2.0
    policy = TorchTrainer(trainer_settings(cfg), tiny)
    mb = collate(TrainBatch.build(make_trajs(n_groups=1)), [0])
    with torch.no_grad():
        logp, _ = policy.model.token_logprobs(mb)
        hidden = policy.model.module(input_ids=mb.input_ids).logits[
            :, :-1
        ]  # the trainer's head: identity
        logits = hidden @ policy.model.head.weight.T / 2.0
        ref = torch.log_softmax(logits, -1).gather(-1, mb.targets[..., None])[..., 0]
    m = mb.resp_mask
    assert torch.allclose(logp[m], ref[m], atol=1e-6)
    assert torch.count_nonzero(logp[~m]) == 0  # prompt and padding positions carry nothing


def test_checkpoint_round_trip_and_resume_give_the_same_next_step(tiny, tmp_path):
    cfg = make_cfg(tiny, tmp_path, warmup_steps=2)
    a = TorchTrainer(trainer_settings(cfg), tiny)
    b1, b2 = TrainBatch.build(make_trajs(seed=1)), TrainBatch.build(make_trajs(seed=2))
    a.train_step(b1)
    a.train_step(b1)
    path = ck.save_trainer(
        a, tmp_path, 2, {"version": 2, "frontier": {"uncommitted": []}}, tiny
    ).wait()
    assert ck.latest_checkpoint(tmp_path) == path and (path / "model" / "tokenizer.json").is_file()
    b = TorchTrainer(trainer_settings(cfg), str(path / "model"))
    meta = ck.restore_trainer(b, path)
    assert meta["step"] == 2 and meta["version"] == 2
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    sa, sb = (
        ck.optimizer_state(a.model.module, a.optimizer)["state"],
        ck.optimizer_state(b.model.module, b.optimizer)["state"],
    )
    assert sa.keys() == sb.keys()
    for name in sa:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sa[name][k]), torch.as_tensor(sb[name][k])), (
                name,
                k,
            )
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    ma, mb_ = a.train_step(b2), b.train_step(b2)
    assert (
        ma["loss"] == mb_["loss"] and ma["grad_norm"] == mb_["grad_norm"] and ma["lr"] == mb_["lr"]
    )
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_checkpoints_are_atomic_and_pruned(tiny, tmp_path):
    policy = TorchTrainer(trainer_settings(make_cfg(tiny, tmp_path)), tiny)
    (ck.checkpoint_root(tmp_path) / ".tmp-step_00000009-1").mkdir(
        parents=True
    )  # a crashed writer's leftovers
    assert ck.latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3):
        ck.save_trainer(policy, tmp_path, step, {"version": step}, tiny, keep=2).wait()
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert ck.remove_partial(tmp_path) == 1
    assert ck.resolve_resume("auto", tmp_path).name == "step_00000003"
    assert ck.resolve_resume("never", tmp_path) is None
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        ck.resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_bad_trajectories_are_dropped_and_counted():
    good = make_trajs(n_groups=1, group=2)
    bad = make_trajs(n_groups=1, group=4, seed=9)
    bad[0].reward = None
    bad[1].logprobs = bad[1].logprobs[:-1]
    bad[2].response_ids = np.array([4, 9999], dtype=np.int32)
    bad[2].logprobs = np.zeros(2, np.float32)
    bad[3].response_ids = np.zeros(0, np.int32)
    batch = TrainBatch.build(good + bad, vocab_size=64)
    assert batch.n_seqs == 2
    assert dict(batch.dropped) == {
        "no_reward": 1,
        "logprob_length": 1,
        "bad_token_id": 1,
        "empty_response": 1,
    }


def test_pack_micro_batches_respects_the_token_budget():
    lengths = [10, 3, 7, 7, 2, 12, 5]
    mbs = pack_micro_batches(lengths, 20)
    assert sorted(i for m in mbs for i in m) == list(range(7))
    for m in mbs:
        assert len(m) == 1 or max(lengths[i] for i in m) * len(m) <= 20
    assert pack_micro_batches([50], 20) == [[0]]  # longer than the budget: alone


def test_lr_schedule_warmup_then_cosine():
    f = lr_lambda(warmup=2, total=10, min_ratio=0.1)
    assert [round(f(s), 4) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert f(10) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)
    assert 0.1 < f(6) < 1.0


@pytest.mark.parametrize(
    "algo",
    [
        {"loss": "gspo", "agg": "seq_mean_token_mean", "is_level": "geometric"},
        {"kl_coef": 0.1, "kl_type": "k1_reward", "advantage": "rloo"},
        {"kl_coef": 0.1, "kl_type": "k3_loss", "entropy_coef": 0.01, "advantage": "dr_grpo"},
        {
            "decoupled": False,
            "agg": "seq_mean_token_sum_norm",
            "advantage": "reinforce_pp_baseline",
        },
        {"is_mode": "mask", "is_level": "sequence", "is_low": 0.1, "is_high": 10.0},
    ],
)
def test_algorithm_variants_train(tiny, tmp_path, algo):
    cfg = make_cfg(tiny, tmp_path)
    for k, v in algo.items():
        setattr(cfg.algo, k, v)
    policy = TorchTrainer(trainer_settings(cfg), tiny)
    assert (policy.model.ref is not None) == (cfg.algo.kl_coef > 0)
    before = params(policy)
    trajs = on_policy(policy, make_trajs())
    for _ in range(2):
        m = policy.train_step(TrainBatch.build(trajs))
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in params(policy).items())
    if algo.get("kl_type") == "k3_loss":
        assert m["kl_ref"] != 0 and "loss/kl" in m and "loss/entropy" in m
