"""The PPO trust region in decoupled mode: trainer.minibatches > 1 makes the clip act,
config warnings when it cannot, and whole-group handling of drops in TrainBatch.build.

.venv/bin/python -m pytest tests/test_trust_region.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from laminar.config import config_from_dict, config_warnings
from laminar.protocol.data import Trajectory
from laminar.trainer.batch import TrainBatch
from laminar.trainer.packing import minibatches
from laminar.trainer.torch_trainer import TorchTrainer
from laminar.wiring.trainer import trainer_settings


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from laminar.models.tiny import build_tiny_model

    return str(
        build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=32, layers=1, heads=2, kv_heads=1)
    )


def make_cfg(model_path, run_dir, minibatches=1, lr=0.05, **algo):
    return config_from_dict(
        {
            "run_dir": str(run_dir),
            "model": {"path": model_path},
            "trainer": {
                "lr": lr,
                "total_steps": 20,
                "micro_batch_tokens": 4096,
                "grad_clip": 100.0,
                "minibatches": minibatches,
            },
            "algo": {"advantage": "grpo", "is_mode": "truncate", **algo},
            "rollout": {"sampling": {"temperature": 1.0, "max_tokens": 16}},
        }
    )


def make_trajs(n_groups=4, group=4, seed=0, reward=None):
    """Responses with rewards that vary inside every group; behaviour logprobs -3 (stale-ish)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        prompt = rng.integers(4, 40, size=5).astype(np.int32)
        for i in range(group):
            resp = rng.integers(4, 40, size=6).astype(np.int32)
            r = float(i % 2) if reward is None else reward(g, i)
            out.append(
                Trajectory(
                    uid=f"g{g}/{i}",
                    group_id=f"g{g}",
                    prompt_uid=f"p{g}",
                    sample_index=i,
                    prompt_ids=prompt,
                    response_ids=resp,
                    logprobs=np.full(len(resp), -3.0, dtype=np.float32),
                    version=0,
                    reward=r,
                )
            )
    return out


def test_minibatches_make_the_clip_act_and_change_the_loss(tiny, tmp_path):
    """A big lr moves pi_theta past 1 +- eps after mini-batch 1, so mini-batches 2..4 get
    clipped."""
    trajs = make_trajs()
    one = TorchTrainer(trainer_settings(make_cfg(tiny, tmp_path)), tiny).train_step(
        TrainBatch.build(trajs)
    )
    four = TorchTrainer(trainer_settings(make_cfg(tiny, tmp_path, minibatches=4)), tiny).train_step(
        TrainBatch.build(trajs)
    )
    assert one["minibatches"] == 1 and four["minibatches"] == 4
    assert one["frac/clip"] == 0 and one["ratio_max"] == pytest.approx(1.0)
    assert four["frac/clip"] > 0, four
    assert four["ratio_max"] > 1.28 or four["ratio_min"] < 0.8
    assert math.isfinite(four["loss"]) and four["loss"] != pytest.approx(one["loss"], abs=1e-6)


def test_minibatch_one_reuses_the_step_start_policy(tiny, tmp_path):
    """With a tiny lr the parameters barely move: every mini-batch's ratio stays ~1 (pi_prox is the
    step-start policy, not the moved one) and the loss matches the single-step loss."""
    trajs = make_trajs(seed=1)
    one = TorchTrainer(trainer_settings(make_cfg(tiny, tmp_path, lr=1e-9)), tiny).train_step(
        TrainBatch.build(trajs)
    )
    two = TorchTrainer(
        trainer_settings(make_cfg(tiny, tmp_path, minibatches=2, lr=1e-9)), tiny
    ).train_step(TrainBatch.build(trajs))
    assert two["ratio_max"] == pytest.approx(1.0, abs=1e-4) and two["frac/clip"] == 0
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-4)


def test_minibatches_split_whole_groups(tiny, tmp_path):
    policy = TorchTrainer(trainer_settings(make_cfg(tiny, tmp_path, minibatches=3)), tiny)
    batch = TrainBatch.build(make_trajs(n_groups=5))
    parts = minibatches(batch, policy.tc.minibatches)
    assert len(parts) == 3 and sorted(i for p in parts for i in p) == list(range(batch.n_seqs))
    groups = [{batch.samples[i].group_id for i in p} for p in parts]
    assert all(not (a & b) for k, a in enumerate(groups) for b in groups[k + 1 :])
    # more mini-batches than groups: one group each
    policy = TorchTrainer(trainer_settings(make_cfg(tiny, tmp_path, minibatches=9)), tiny)
    assert len(minibatches(batch, policy.tc.minibatches)) == 5


def test_params_move_more_with_minibatches(tiny, tmp_path):
    trajs = make_trajs(seed=2)
    moved = []
    for m in (1, 4):
        policy = TorchTrainer(
            trainer_settings(make_cfg(tiny, tmp_path, minibatches=m, lr=1e-3)), tiny
        )
        before = {k: v.clone() for k, v in policy.model.module.state_dict().items()}
        policy.train_step(TrainBatch.build(trajs))
        moved.append(
            sum(
                float((v - before[k]).abs().sum())
                for k, v in policy.model.module.state_dict().items()
            )
        )
    assert moved[1] > moved[0] > 0


def test_a_group_left_with_one_member_is_dropped_whole():
    """Drops leave g0 with one member: it has no baseline (advantage 0), so it goes, counted."""
    trajs = make_trajs(n_groups=3, group=2)
    trajs[0].reward = None
    batch = TrainBatch.build(trajs)
    assert batch.dropped == {"no_reward": 1, "singleton_group": 1} and batch.n_seqs == 4
    from laminar.algo.advantages import compute_advantages

    adv = compute_advantages(batch.rewards, batch.groups, "grpo")
    assert all(s.group_id != "g0" for s in batch.samples) and bool((adv != 0).all())


def test_config_warns_when_the_clip_cannot_act(tmp_path):
    base = {"run_dir": str(tmp_path)}
    assert config_warnings(config_from_dict(base)) == []  # defaults set no clip: nothing to say
    cfg = config_from_dict({**base, "algo": {"clip_low": 0.2, "clip_high": 0.28}})
    (w,) = config_warnings(cfg)
    assert "cannot act" in w and "trainer.minibatches" in w
    assert (
        config_warnings(
            config_from_dict({**base, "algo": {"clip_low": 0.2}, "trainer": {"minibatches": 2}})
        )
        == []
    )
    bypass = {**base, "algo": {"clip_low": 0.2, "decoupled": False}}
    assert config_warnings(config_from_dict(bypass)) == []
    gspo = config_warnings(config_from_dict({**base, "algo": {"loss": "gspo"}}))
    assert len(gspo) == 1 and "seq_mean_token_mean" in gspo[0]
    ok = {**base, "algo": {"loss": "gspo", "agg": "seq_mean_token_mean"}}
    assert config_warnings(config_from_dict(ok)) == []


def test_demo_config_sets_no_clip_that_cannot_act():
    from laminar.config import load_config
    from laminar.demo.__main__ import DEMO_CONFIG

    assert config_warnings(load_config(DEMO_CONFIG)) == []


def test_masked_is_drops_tokens_outside_the_band(tiny, tmp_path):
    """IcePop-style masking: behaviour weights outside [is_low, is_high] give those tokens no
    gradient."""
    trajs = make_trajs(seed=4)
    cfg = make_cfg(tiny, tmp_path, is_mode="mask", is_low=0.5, is_high=2.0)
    m = TorchTrainer(trainer_settings(cfg), tiny).train_step(TrainBatch.build(trajs))
    # behaviour logprobs -3 vs a near-uniform policy over ~40+ ids (log ~ -4): w ~ e^-1 < 0.5
    assert m["frac/is_masked"] > 0.5
    assert torch.isfinite(torch.tensor(m["loss"]))
