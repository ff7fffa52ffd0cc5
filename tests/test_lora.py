"""LoRA (model.lora): the trainer trains adapters on a frozen base, a version is the adapters,
the engines merge them, the checkpoint's adapter directory is peft's.

    .venv/bin/python -m pytest tests/test_lora.py -q
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import structlog
import torch

from laminar.config import ConfigError, LoraConfig, config_from_dict
from laminar.engines.base import GenRequest, SamplingParams
from laminar.engines.torch_engine import TorchEngine
from laminar.metrics import Metrics
from laminar.models import lora as lo
from laminar.models.decoder_lm import load_model
from laminar.models.rejected import WeightsRejected
from laminar.rollout.versions import VersionGate
from laminar.trainer import checkpoint as ck
from laminar.trainer.batch import TrainBatch
from laminar.trainer.factory import open_trainer
from laminar.trainer.micro_batch import collate
from laminar.trainer.torch_trainer import TorchTrainer
from laminar.weights.dir import DirPublisher, DirSubscriber
from laminar.weights.layout import align_up, layout_of, named_list
from laminar.wiring.nodes import build_node
from laminar.wiring.trainer import trainer_settings
from tests.test_trainer import make_cfg, make_trajs, on_policy
from tests.test_trainer_node import harness  # noqa: F401  (a fixture)

LORA = {"rank": 4, "alpha": 8}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from laminar.models.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    return str(build_tiny_model(path, hidden=32, layers=2, heads=4, kv_heads=2))


def lora_cfg(model_path, run_dir, lora=LORA, **trainer):
    cfg = make_cfg(model_path, run_dir, **trainer)
    cfg.model.lora = LoraConfig(**lora)
    return cfg


def trained(tiny, tmp_path, steps=3, **trainer) -> TorchTrainer:
    """A LoRA policy after a few steps at a high rate (its B far from zero)."""
    policy = TorchTrainer(trainer_settings(lora_cfg(tiny, tmp_path, lr=3e-2, **trainer)), tiny)
    batch = TrainBatch.build(on_policy(policy, make_trajs()))
    for _ in range(steps):
        policy.train_step(batch)
    return policy


def peft_model(base_path: str, adapter_dir):
    from peft import PeftModel

    from laminar.models.tiny import load_causal_lm

    return PeftModel.from_pretrained(load_causal_lm(base_path), str(adapter_dir)).eval()


def test_config_names_the_fix_for_bad_targets():
    with pytest.raises(ConfigError, match="not decoder linear layers"):
        config_from_dict({"model": {"lora": {"target_modules": ["q_proj", "qproj"]}}})
    with pytest.raises(ConfigError, match="empty"):
        config_from_dict({"model": {"lora": {"target_modules": []}}})
    cfg = config_from_dict({"model": {"lora": {"rank": 8}}})
    assert (
        cfg.model.lora is not None
        and cfg.model.lora.target_modules == lo.LoraConfig(rank=1).target_modules
    )
    assert config_from_dict({}).model.lora is None


def test_only_the_adapters_train_and_hold_optimizer_state(tiny, tmp_path):
    policy = TorchTrainer(trainer_settings(lora_cfg(tiny, tmp_path, lr=1e-2)), tiny)
    base0 = {n: p.detach().clone() for n, p in policy.model.module.named_parameters()}
    trainable = {n for n, p in policy.model.module.named_parameters() if p.requires_grad}
    # 2 layers x 7 targets x (A, B)
    assert len(trainable) == 28 and all(lo.is_adapter_name(n) for n in trainable)
    in_opt = {id(p) for g in policy.optimizer.param_groups for p in g["params"]}
    assert in_opt == {id(p) for n, p in policy.model.module.named_parameters() if n in trainable}
    trajs = on_policy(policy, make_trajs())
    batch = TrainBatch.build(trajs)
    pos = batch.rewards > 0

    def mean_logp(sel):
        with torch.no_grad():
            logp, _ = policy.model.token_logprobs(collate(batch, list(range(batch.n_seqs))))
        mask = collate(batch, list(range(batch.n_seqs))).resp_mask
        return float(((logp * mask).sum(-1) / mask.sum(-1))[sel].mean())

    lp0 = mean_logp(pos)
    for _ in range(4):
        policy.train_step(batch)
    after = dict(policy.model.module.named_parameters())
    for n, p in base0.items():
        if n in trainable:
            if ".lora_B." in n:  # B starts at 0 and moves; A moves too
                assert not torch.equal(p, after[n]), n
        else:
            assert torch.equal(p, after[n]), f"frozen {n} changed"
    assert mean_logp(pos) > lp0
    state = policy.optimizer.state_dict()["state"]
    assert len(state) == len(trainable)  # AdamW moments for the adapters alone


def test_packed_and_hf_forwards_train_the_same_adapter(tiny, tmp_path):
    """The packed forward adds each adapter's share itself; HF's forward runs peft's layers."""
    packed = trained(tiny, tmp_path / "a")
    assert packed.model.packed is not None
    hf = TorchTrainer(trainer_settings(lora_cfg(tiny, tmp_path / "b", forward="hf")), tiny)
    assert hf.model.packed is None
    lo.load_adapter_state(hf.model.module, packed.model.export_weights())
    packed.optimizer.zero_grad(set_to_none=True)  # the last step's gradients
    batch = TrainBatch.build(make_trajs(seed=5))
    idx = list(range(batch.n_seqs))
    a, _ = packed.model.token_logprobs(packed.model.micro_batch(batch, idx))
    b, _ = hf.model.token_logprobs(hf.model.micro_batch(batch, idx))
    assert torch.allclose(a, b, atol=1e-5)
    a.sum().backward()
    b.sum().backward()
    ga = {n: p.grad for n, p in packed.model.module.named_parameters() if p.grad is not None}
    gb = {n: p.grad for n, p in hf.model.module.named_parameters() if p.grad is not None}
    assert ga.keys() == gb.keys() and len(ga) == 28
    for n in ga:
        assert torch.allclose(ga[n], gb[n], atol=1e-4), n


def test_a_version_is_the_adapter_in_peft_names(tiny, tmp_path):
    policy = trained(tiny, tmp_path, steps=1)
    w = policy.model.export_weights("bfloat16")
    assert all(k.startswith(lo.PREFIX) and lo.is_adapter_name(k) for k in w)
    assert all(v.dtype == torch.bfloat16 for v in w.values())
    n_bytes = sum(v.numel() * v.element_size() for v in w.values())
    raw = load_model(tiny)
    fp = lo.lora_footprint(raw.raw_config, policy.model.lora, rollout_dtype_bytes=2)
    assert n_bytes == fp.version_bytes == 2 * lo.MergedAdapter(raw, policy.model.lora).params
    full = sum(p.numel() for p in raw.parameters())
    assert fp.base_params == full
    # what the relay tier moves: the flat layout of exactly these tensors, each 256-byte aligned
    # (this tiny model's tensors are small enough for that to matter: see the demo-shape test)
    aligned = sum(align_up(v.numel() * v.element_size()) for v in w.values())
    assert layout_of(named_list(w)).total_bytes == aligned


def test_a_demo_model_version_is_its_adapter_bytes(tmp_path):
    """Acceptance: the demo policy's shape (laminar.config.DemoModelConfig), rank 16 on every
    projection, float32 rollouts: the version the relay tier moves is the adapter's bytes within
    1%."""
    from laminar.config import DemoModelConfig
    from laminar.models.tiny import build_tiny_model

    d = DemoModelConfig()
    path = build_tiny_model(
        tmp_path / "demo", hidden=d.hidden, layers=d.layers, heads=d.heads, kv_heads=d.kv_heads
    )
    model = load_model(path)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    lo.add_adapters(model, LoraConfig(rank=16))
    version = lo.adapter_state(model)
    adapter_bytes = sum(v.numel() * v.element_size() for v in version.values())
    shipped = layout_of(named_list(version)).total_bytes
    print(
        f"\ndemo r16: adapter {adapter_bytes / 2**10:.1f} KiB, version {shipped / 2**10:.1f} KiB, "
        f"full {full_bytes / 2**20:.2f} MiB ({shipped / full_bytes:.1%})"
    )
    assert adapter_bytes <= shipped <= 1.01 * adapter_bytes


def test_dropout_acts_in_gradient_passes_only(tiny, tmp_path):
    cfg = lora_cfg(tiny, tmp_path, lora={**LORA, "dropout": 0.5})
    policy = TorchTrainer(trainer_settings(cfg), tiny)
    with torch.no_grad():  # a non-zero B, so the adapter's input matters
        for n, p in policy.model.module.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.5)
    mb = policy.model.micro_batch(TrainBatch.build(make_trajs()), list(range(16)))
    with torch.no_grad():
        x1, _ = policy.model.token_logprobs(mb)
        x2, _ = policy.model.token_logprobs(mb)
    g1, _ = policy.model.token_logprobs(mb)
    assert torch.equal(x1, x2) and not torch.allclose(g1.detach(), x1)


def test_engine_serves_the_version_peft_loads_from_the_checkpoint(tiny, tmp_path):
    """Acceptance: the exported adapter, loaded with peft onto the base, gives the engine's logits
    for that version within 1e-4 (fp32, CPU), and the engine's sampled logprobs are peft's."""
    policy = trained(tiny, tmp_path)
    path = ck.save_trainer(policy, tmp_path, 3, {"version": 3}, tiny).wait()
    assert path is not None and not (path / "model").exists()
    adapter_dir = path / "adapter"
    assert (adapter_dir / "adapter_config.json").is_file()
    ref = peft_model(tiny, adapter_dir)

    cfg = lora_cfg(tiny, tmp_path)
    engine = TorchEngine.from_config(cfg.rollout, cfg.model, max_running=4)

    async def serve():
        await engine.start()
        try:
            await engine.load_weights(policy.model.export_weights().items(), version=3)
            req = GenRequest("g", np.array([5, 9, 11, 7]), SamplingParams(max_tokens=12, seed=1))
            return await engine.generate_all(req, timeout=60)
        finally:
            await engine.close()

    out = asyncio.run(serve())
    ids = torch.tensor([[5, 9, 11, 7]])
    with torch.no_grad():
        mine = engine.model(ids).logits
        theirs = ref(input_ids=ids).logits
        base = load_model(tiny)(ids).logits
    assert (mine - theirs).abs().max() < 1e-4
    assert (mine - base).abs().max() > 1e-2  # the adapter changes the model: not the base served
    toks, lps, _ = out["g/0"]
    seq = torch.tensor([[5, 9, 11, 7, *toks.tolist()]])
    with torch.no_grad():
        logits = ref(input_ids=seq).logits[0, 3:-1]
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks, dtype=torch.long)[:, None])
    assert np.abs(want[:, 0].numpy() - lps).max() < 1e-4


def test_checkpoint_resumes_adapters_and_optimizer(tiny, tmp_path):
    cfg = lora_cfg(tiny, tmp_path, lr=1e-2, warmup_steps=2)
    a = TorchTrainer(trainer_settings(cfg), tiny)
    b1, b2 = TrainBatch.build(make_trajs(seed=1)), TrainBatch.build(make_trajs(seed=2))
    a.train_step(b1)
    a.train_step(b1)
    ck.save_trainer(a, tmp_path, 2, {"version": 2, "frontier": {}}, tiny).wait()
    cfg.trainer.resume = "auto"
    opened = open_trainer(trainer_settings(cfg), tmp_path)
    b = opened.trainer
    assert isinstance(b, TorchTrainer) and opened.meta is not None and opened.meta["step"] == 2
    wa, wb = a.model.export_weights(), b.model.export_weights()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (
        ck.optimizer_state(a.model.module, a.optimizer)["state"],
        ck.optimizer_state(b.model.module, b.optimizer)["state"],
    )
    assert sa.keys() == sb.keys() and len(sa) == 28
    ma, mb = a.train_step(b2), b.train_step(b2)
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    # a LoRA checkpoint does not resume a full fine-tuning run, nor the other way round
    full = make_cfg(tiny, tmp_path)
    full.trainer.resume = "auto"
    with pytest.raises(ValueError, match="holds LoRA adapters but model.lora is not set"):
        open_trainer(trainer_settings(full), tmp_path)


def test_merged_hf_export_equals_peft_merge(tiny, tmp_path):
    policy = trained(tiny, tmp_path, steps=2)
    adapter = lo.write_adapter_dir(
        tmp_path / "ad", policy.model.lora, policy.model.export_weights(), tiny
    )
    out = lo.export_merged(tiny, adapter, tmp_path / "merged")
    from laminar.models.tiny import load_causal_lm

    ids = torch.tensor([[4, 8, 15, 16, 23]])
    with torch.no_grad():
        merged = load_causal_lm(out)(input_ids=ids).logits
        theirs = peft_model(tiny, adapter)(input_ids=ids).logits
    assert (merged - theirs).abs().max() < 1e-4
    assert (out / "tokenizer.json").is_file()


# ---- a version that does not fit is never served -------------------------------------------


def _bad_versions(good: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    first = next(iter(good))
    nan = dict(good)
    nan[first] = good[first].clone()
    nan[first][0, 0] = float("nan")
    wrong_rank = {k: (v[:2] if ".lora_A." in k else v[:, :2]) for k, v in good.items()}
    return {
        # a loader matching names leniently would apply nothing and serve the base unnoticed
        "unprefixed": {k.removeprefix(lo.PREFIX): v for k, v in good.items()},
        "missing": {k: v for k, v in good.items() if k != first},
        "wrong_rank": wrong_rank,
        "nan": nan,
        "full_model": {"model.norm.weight": torch.ones(32)},
    }


def test_an_adapter_that_does_not_fit_leaves_the_previous_version_serving(tiny, tmp_path):
    policy = trained(tiny, tmp_path)
    v1 = policy.model.export_weights()
    cfg = lora_cfg(tiny, tmp_path)
    engine = TorchEngine.from_config(cfg.rollout, cfg.model, max_running=4)
    prompt = np.array([6, 10, 12])

    async def run():
        await engine.start()
        try:
            await engine.load_weights(v1.items(), version=1)
            served = {n: p.detach().clone() for n, p in engine.model.state_dict().items()}
            want = await engine.generate_all(
                GenRequest("a", prompt, SamplingParams(max_tokens=8, seed=3)), timeout=60
            )
            for why, bad in _bad_versions(v1).items():
                with pytest.raises(WeightsRejected) as err:
                    await engine.load_weights(bad.items(), version=2)
                assert err.value.version == 2, why
                assert engine.version == 1, why
                now = engine.model.state_dict()
                assert all(torch.equal(served[n], now[n]) for n in served), why
            got = await engine.generate_all(
                GenRequest("a", prompt, SamplingParams(max_tokens=8, seed=3)), timeout=60
            )
            return want, got
        finally:
            await engine.close()

    want, got = asyncio.run(run())
    # the same sequence key draws the same tokens: after the refusals it still serves version 1
    assert np.array_equal(want["a/0"][0], got["a/0"][0])
    assert np.allclose(want["a/0"][1], got["a/0"][1], atol=1e-6)


def test_the_rollout_skips_a_refused_version_and_labels_tokens_with_the_one_it_serves(
    tiny, tmp_path
):
    """The gate counts the refusal, never offers that version again, keeps serving (and labelling
    trajectories with) the version it had; the next good version loads."""
    policy = trained(tiny, tmp_path)
    good = policy.model.export_weights()
    cfg = lora_cfg(tiny, tmp_path)
    engine = TorchEngine.from_config(cfg.rollout, cfg.model, max_running=4)
    pub, metrics = DirPublisher(tmp_path / "w"), Metrics()

    async def run():
        await pub.start()
        await engine.start()
        gate = VersionGate(
            DirSubscriber(tmp_path / "w", poll_s=0.0),
            engine,
            auto_refresh=True,
            refresh_wait_s=1.0,
            notify=(),
            metrics=metrics,
            log=structlog.get_logger(),
        )
        try:
            await pub.publish(1, 1, good)
            async with gate.lock:
                assert await gate.load() and gate.version == engine.version == 1
            await pub.publish(2, 2, _bad_versions(good)["unprefixed"])
            assert gate.loadable() == 2
            async with gate.lock:
                assert not await gate.load()
            assert gate.version == engine.version == 1 and gate.rejected == 2
            assert gate.loadable() == -1  # not tried again
            req = GenRequest("g", np.array([6, 10, 12]), SamplingParams(max_tokens=6), n=2)
            versions = set()
            async for ev in engine.generate(req, timeout=60):
                versions.add(ev.version)
            await pub.publish(3, 3, good)
            assert gate.loadable() == 3
            async with gate.lock:
                assert await gate.load() and engine.version == 3
            return versions
        finally:
            await engine.close()

    assert asyncio.run(run()) == {1}
    assert metrics.counters["weight_rejected"] == 1  # the bad one; the two good loads count apart
    assert metrics.counters["weight_loads_dir"] == 2


# ---- sizes ---------------------------------------------------------------------------------


def qwen25_7b_config() -> dict:
    """Qwen2.5-7B's shape (config.json of Qwen/Qwen2.5-7B-Instruct)."""
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }


def test_a_7b_version_at_rank_16_is_under_one_percent_of_the_model():
    """Acceptance: Qwen2.5-7B's shape on the meta device, rank 16 on every projection: a version
    (bf16) is the adapter's bytes within 1% and under 1% of the full model."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    raw = qwen25_7b_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**raw), dtype=torch.bfloat16)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    lora = LoraConfig(rank=16)
    fp = lo.lora_footprint(raw, lora, rollout_dtype_bytes=2)
    assert fp.base_params == sum(p.numel() for p in model.parameters())
    lo.add_adapters(model, lora)
    version = {k: v.to(torch.bfloat16) for k, v in lo.adapter_state(model).items()}
    adapter_bytes = sum(v.numel() * v.element_size() for v in version.values())
    shipped = layout_of(named_list(version)).total_bytes  # the relay tier's flat buffer
    print(
        f"\nQwen2.5-7B r16: adapter {adapter_bytes / 2**20:.1f} MiB, version {shipped / 2**20:.1f}"
        f" MiB, full {full_bytes / 2**30:.2f} GiB ({shipped / full_bytes:.2%})"
    )
    assert adapter_bytes == fp.version_bytes
    assert adapter_bytes <= shipped <= 1.01 * adapter_bytes
    assert shipped < 0.01 * full_bytes
    assert fp.optimizer_bytes == 8 * fp.params and fp.params == 40_370_176


# ---- FSDP2 -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_rank_fsdp_lora_matches_one_process(tmp_path):
    """Acceptance: FSDP2 on gloo, 2 ranks, LoRA: per step the loss (abs 1e-5), the adapter
    gradients (atol 1e-5 + rtol 1e-4: the reduction order differs) and, after three steps, the
    exported adapter (atol 1e-5) match one process; the frozen base is sharded as before."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from laminar.models.tiny import build_tiny_model
    from tests.fsdp_lora_worker import SEEDS, adapter_grads, lora_fsdp_cfg

    root = Path(__file__).resolve().parents[1]
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
        "torchrun"
    )
    if torchrun is None:
        pytest.skip("torchrun not found")
    model = str(build_tiny_model(tmp_path / "model", hidden=32, layers=2, heads=2, kv_heads=1))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    worker = str(root / "tests" / "fsdp_lora_worker.py")
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", worker, model, str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((out / "result.json").read_text())
    theirs = torch.load(out / "tensors.pt", weights_only=True)
    assert res["world"] == 2
    ref = TorchTrainer(trainer_settings(lora_fsdp_cfg(model, tmp_path / "ref")), model)
    for k, seed in enumerate(SEEDS):
        m = ref.train_step(TrainBatch.build(make_trajs(seed=seed)))
        assert res["losses"][k] == pytest.approx(m["loss"], abs=1e-5)
        assert res["grad_norms"][k] == pytest.approx(m["grad_norm"], rel=1e-4)
        mine = adapter_grads(ref)
        assert mine.keys() == theirs["grads"][k].keys() and len(mine) == 28
        for n, g in mine.items():
            torch.testing.assert_close(theirs["grads"][k][n], g, atol=1e-5, rtol=1e-4, msg=n)
    mine_w = ref.model.export_weights()
    assert mine_w.keys() == theirs["weights"].keys()
    for n, w in mine_w.items():
        torch.testing.assert_close(theirs["weights"][n], w, atol=1e-5, rtol=0, msg=n)
    # the checkpoint rank 0 gathered (adapter dir + AdamW state) resumes in one process
    ckpt = Path(res["checkpoint"])
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and not (ckpt / "model").exists()
    resumed = TorchTrainer(
        trainer_settings(lora_fsdp_cfg(model, tmp_path / "r")), model, adapter=ckpt / "adapter"
    )
    ck.restore_trainer(resumed, ckpt)
    for n, w in resumed.model.export_weights().items():
        torch.testing.assert_close(w, mine_w[n], atol=1e-5, rtol=0, msg=n)
    assert set(ck.optimizer_state(resumed.model.module, resumed.optimizer)["state"]) == set(
        ck.optimizer_state(ref.model.module, ref.optimizer)["state"]
    )


# ---- the trainer node through the relay tier -----------------------------------------------


async def test_adapter_versions_go_through_the_relay_tier(tiny, tmp_path, harness):  # noqa: F811
    """The trainer node publishes adapters only, through a relay; a rollout's engine loads them
    from the relay's shared memory (the base from model.path); push_bytes is the adapter's
    bytes; snapshots carry their LoRA settings."""
    from laminar.demo.results import load_snapshot
    from laminar.rollout.versions import VersionGate
    from laminar.supervise import detached_spawn
    from laminar.transport.sockets import Wiring
    from laminar.weights.puller import WeightPuller
    from laminar.weights.relay import RelaySubscriber
    from laminar.wiring.common import relay_links
    from tests.test_trainer_node import groups_of, node_cfg, read_jsonl, run_trainer

    ctx, make = harness
    cfg = node_cfg(tmp_path, tiny, total_steps=2, snapshot_every=1, lr=3e-2)
    cfg.model.lora = LoraConfig(**LORA)
    cfg.cluster.roles = {"manager": 1, "buffer": 1, "relay": 1, "trainer": 1, "rollout": 0}
    cfg.relay.shm_dir = str(tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    await make(cfg, groups_of(make_trajs(n_groups=4, group=2)))
    relay = build_node(cfg, "relay", ctx=ctx)
    relay_task = asyncio.create_task(relay.run())
    engine = TorchEngine.from_config(cfg.rollout, cfg.model, max_running=2)
    try:
        await asyncio.wait_for(relay.ready.wait(), 10)
        node = await run_trainer(cfg, ctx)
        assert node.version == 2
        lines = read_jsonl(cfg.resolved_run_dir() / "metrics.jsonl")
        run = cfg.resolved_run_dir()
        final = ck.latest_checkpoint(run) / "adapter"
        _, saved = lo.read_adapter_dir(final)
        n_bytes = sum(v.numel() * v.element_size() for v in saved.values())
        assert [x["push_bytes"] for x in lines] == [n_bytes, n_bytes]
        assert (
            n_bytes
            == lo.lora_footprint(load_model(tiny).raw_config, cfg.model.lora, 4).version_bytes
        )
        wiring = Wiring(ctx, relay.opts, "reader-0", "rollout", relay.log, detached_spawn)
        gate = VersionGate(
            RelaySubscriber(WeightPuller(relay_links(cfg), wiring)),
            engine,
            auto_refresh=True,
            refresh_wait_s=1.0,
            notify=(),
            metrics=Metrics(),
            log=structlog.get_logger(),
        )
        await gate.source.start()
        await engine.start()
        try:
            assert await gate.source.wait_newer(1, timeout=10) == 2
            async with gate.lock:
                assert await gate.load() and engine.version == 2
            # attested: what the engine merged is the adapter the trainer published
            assert gate.digest(2) and gate.digest(2) == await node.attest.digest(2)
        finally:
            await gate.source.close()
        ids = torch.tensor([[5, 9, 11, 7]])
        with torch.no_grad():
            served = engine.model(ids).logits
            theirs = peft_model(tiny, final)(input_ids=ids).logits
            snap = load_snapshot(tiny, run / "snapshots" / "v2.safetensors")(input_ids=ids).logits
        assert (served - theirs).abs().max() < 1e-4 and (snap - theirs).abs().max() < 1e-4
    finally:
        await engine.close()
        relay.request_stop("test done")
        await asyncio.wait_for(relay_task, 10)
