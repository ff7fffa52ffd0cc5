"""The trainer's packed forward equals HF's padded forward, in logprobs and in gradients, per
architecture it claims; its micro-batch plan keeps a prompt's samples together.

    .venv/bin/python -m pytest tests/test_trainer_packed.py -q

Each case builds a tiny random model of one family in memory (no files, no hub), a batch of
groups that share prompts (ragged lengths, one multi-turn loss mask), and compares the packed
forward's log pi of every trained token, and the gradient of a weighted sum of them, with the
padded HF forward the trainer ran before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from laminar.config import config_from_dict
from laminar.protocol.data import Trajectory
from laminar.trainer.batch import TrainBatch
from laminar.trainer.micro_batch import collate
from laminar.trainer.packed import PackedForward, PackedLayout, packed_forward
from laminar.trainer.packing import pack_by_prompt
from laminar.trainer.torch_trainer import TorchTrainer
from laminar.wiring.trainer import trainer_settings
from tests.test_engine_lean_forward import CASES, _model


def _trajs(n_groups: int = 3, group: int = 4, seed: int = 0, vocab: int = 40) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        prompt = rng.integers(3, vocab, size=int(rng.integers(2, 9)))
        for i in range(group):
            n = int(rng.integers(1, 14))
            mask = None
            if g == 1 and i == 0 and n > 3:  # a tool turn: tokens 1..2 are the environment's
                mask = np.ones(n, dtype=np.int8)
                mask[1:3] = 0
            out.append(
                Trajectory(
                    uid=f"g{g}/{i}",
                    group_id=f"g{g}",
                    prompt_uid=f"p{g}",
                    sample_index=i,
                    prompt_ids=prompt,
                    response_ids=rng.integers(3, vocab, size=n),
                    logprobs=np.full(n, -3.0, dtype=np.float32),
                    version=0,
                    reward=float(i % 2),
                    loss_mask=mask,
                )
            )
    return out


def _padded_logp(model, mb) -> torch.Tensor:
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
    return torch.log_softmax(logits[mb.resp_mask], -1).gather(
        -1, mb.targets[mb.resp_mask][:, None]
    )[:, 0]


def _packed_logp(fwd: PackedForward, mb) -> torch.Tensor:
    assert mb.layout is not None
    logits = fwd(mb.layout)
    return torch.log_softmax(logits, -1).gather(-1, mb.targets[mb.resp_mask][:, None])[:, 0]


@pytest.mark.parametrize("attn_tokens", [1024, 24])  # one attention chunk, or many
@pytest.mark.parametrize("case", list(CASES))
def test_packed_forward_equals_padded_hf(case, attn_tokens):
    spec = dict(CASES[case])
    model = _model(spec.pop("kind"), **spec)
    batch = TrainBatch.build(_trajs())
    idx = list(range(batch.n_seqs))[::-1]  # any sample order
    mb = collate(batch, idx)
    mb.layout = PackedLayout.build([batch.samples[i] for i in idx], attn_tokens)
    assert len(mb.layout.ids) < mb.attention_mask.sum()  # each prompt ran once
    fwd = PackedForward(model)
    weights = torch.randn(int(mb.resp_mask.sum()), generator=torch.Generator().manual_seed(1))

    want = _padded_logp(model, mb)
    (want * weights).sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = _packed_logp(fwd, mb)
    (got * weights).sum().backward()

    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # summation order differs: tolerance per tensor's scale
    for name, p in model.named_parameters():
        scale = float(want_grads[name].abs().max())
        torch.testing.assert_close(p.grad, want_grads[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_rope_table_grows_past_its_first_length():
    model = _model("llama")  # max_position_embeddings 64; the table starts at 512 and must grow
    fwd = PackedForward(model)
    n0 = fwd.cos.shape[0]
    long = Trajectory(
        uid="a/0",
        group_id="a",
        prompt_uid="a",
        sample_index=0,
        prompt_ids=np.arange(3, 3 + n0 + 5) % 37 + 3,
        response_ids=np.array([5, 6]),
        logprobs=np.zeros(2, np.float32),
        version=0,
        reward=1.0,
    )
    batch = TrainBatch.build([long])
    mb = collate(batch, [0])
    mb.layout = PackedLayout.build(batch.samples)
    with torch.no_grad():
        got = _packed_logp(fwd, mb)
    assert fwd.cos.shape[0] > n0 and torch.isfinite(got).all()


def test_pack_by_prompt_keeps_groups_together_within_budget():
    batch = TrainBatch.build(_trajs(n_groups=5, group=6, seed=3))
    s = batch.samples
    idx = list(range(batch.n_seqs))
    plan = pack_by_prompt(s, idx, 60)
    assert sorted(i for mb in plan for i in mb) == idx
    assert plan == pack_by_prompt(s, idx, 60)  # deterministic
    for mb in plan:
        prompts = {s[i].prompt_ids.tobytes(): len(s[i].prompt_ids) for i in mb}
        cost = sum(prompts.values()) + sum(len(s[i].response_ids) for i in mb)
        assert cost <= 60 or len(mb) == 1
    # a group is split only where it alone is over the budget: it spans consecutive micro-batches
    where: dict[str, list[int]] = {}
    for k, mb in enumerate(plan):
        for i in mb:
            where.setdefault(s[i].group_id, []).append(k)
    for ks in where.values():
        assert sorted(set(ks)) == list(range(min(ks), max(ks) + 1))
    assert pack_by_prompt(s, idx, 1) == [[i] for mb in pack_by_prompt(s, idx, 1) for i in mb]


def _policy(model_path, run_dir, forward: str, **algo) -> TorchTrainer:
    cfg = config_from_dict(
        {
            "run_dir": str(run_dir),
            "model": {"path": model_path},
            "trainer": {
                "lr": 1e-2,
                "total_steps": 5,
                "micro_batch_tokens": 40,
                "minibatches": 2,
                "forward": forward,
            },
            "algo": {"advantage": "grpo", "is_mode": "truncate", **algo},
            "rollout": {"sampling": {"temperature": 0.7, "max_tokens": 16}},
        }
    )
    torch.manual_seed(0)
    return TorchTrainer(trainer_settings(cfg), model_path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from laminar.models.tiny import build_tiny_model

    return str(
        build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2, heads=4, kv_heads=2)
    )


def test_train_step_packed_matches_hf(tiny, tmp_path):
    """Same batch, same start: the packed and padded trainers report the same loss and move the
    weights to the same place (mini-batches, pi_prox pass, temperature and the k3 KL included)."""
    trajs = _trajs(n_groups=4, group=4, seed=5, vocab=20)
    stats, moved = {}, {}
    for forward in ("packed", "hf"):
        pol = _policy(tiny, tmp_path / forward, forward, kl_coef=0.01, kl_type="k3_loss")
        assert (pol.model.packed is not None) == (forward == "packed")
        before = {n: p.detach().clone() for n, p in pol.model.module.named_parameters()}
        stats[forward] = pol.train_step(pol.prepare(trajs))
        moved[forward] = {n: p.detach() - before[n] for n, p in pol.model.module.named_parameters()}
    for key in ("loss", "entropy", "logp", "frac/clip", "kl_ref", "grad_norm"):
        assert stats["packed"][key] == pytest.approx(stats["hf"][key], rel=1e-4, abs=1e-6), key
    assert stats["packed"]["micro_batches"] <= stats["hf"]["micro_batches"]
    # AdamW divides by the gradient's own scale: where a gradient is ~0 (a vocabulary row seen only
    # through the tied head) rounding moves the update by up to ~1% of the step size
    for name, d in moved["packed"].items():
        scale = float(moved["hf"][name].abs().max())
        assert scale > 0, name
        torch.testing.assert_close(d, moved["hf"][name], rtol=1e-2, atol=1e-2 * scale, msg=name)


def test_forward_choice(tiny):
    from laminar.models.tiny import load_causal_lm

    model = load_causal_lm(tiny)
    assert isinstance(packed_forward(model, 64, "auto", sharded=False), PackedForward)
    assert packed_forward(model, 64, "auto", sharded=True) is None  # FSDP: HF forward
    assert packed_forward(model, 64, "hf", sharded=False) is None
    with pytest.raises(ValueError, match="FSDP"):
        packed_forward(model, 64, "packed", sharded=True)
    gpt2 = _gpt2()
    assert packed_forward(gpt2, 64, "auto", sharded=False) is None
    with pytest.raises(ValueError, match="model_type"):
        packed_forward(gpt2, 64, "packed", sharded=False)


def _gpt2():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "gpt2", vocab_size=40, n_embd=32, n_layer=1, n_head=2, n_positions=64
    )
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("forward", ["packed", "hf"])
def test_zero_advantage_samples_skipped_without_changing_the_update(tiny, tmp_path, forward):
    """trainer.skip_zero_advantage: the groups whose rewards all agree (advantage exactly 0) get no
    forward or backward, and the step is the one that trains them: same loss, same gradient norm,
    weights moved to the same place. Here the whole first mini-batch is such groups, so its AdamW
    step runs on zero gradients (momentum and weight decay still move the weights)."""
    trajs = _trajs(n_groups=4, group=4, seed=7, vocab=20)
    for t in trajs:
        g = int(t.group_id[1:])
        if g < 2:  # groups 0 and 1 (mini-batch 1 of 2): all right, all wrong
            t.reward = float(g == 0)
    stats, moved = {}, {}
    for skip in (True, False):
        pol = _policy(tiny, tmp_path / f"{forward}{skip}", forward)
        pol.tc.skip_zero_advantage = skip
        pol.tc.weight_decay = 0.1
        for group in pol.optimizer.param_groups:
            group["weight_decay"] = 0.1
        before = {n: p.detach().clone() for n, p in pol.model.module.named_parameters()}
        for _ in range(2):  # the second step's zero-gradient mini-batch moves by momentum
            stats[skip] = pol.train_step(pol.prepare(trajs))
        moved[skip] = {n: p.detach() - before[n] for n, p in pol.model.module.named_parameters()}
    assert stats[True]["seqs_trained"] == 8 and stats[False]["seqs_trained"] == 16
    assert stats[True]["micro_batches"] < stats[False]["micro_batches"]
    for key in ("loss", "grad_norm"):
        assert stats[True][key] == pytest.approx(stats[False][key], rel=1e-5, abs=1e-7), key
    for name, d in moved[True].items():
        torch.testing.assert_close(d, moved[False][name], rtol=1e-4, atol=1e-7, msg=name)
