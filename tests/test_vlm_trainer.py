"""The torch trainer on a tiny Qwen2-VL: the trainer's logprobs of a group sampled by the VLM
engine equal the engine's (same image, pixel inputs remade from the bytes), a step moves the
language model and leaves the frozen vision tower alone, a checkpoint keeps the processor files
and loads again as a VLM; an unfrozen tower trains; LoRA adapts the language model only and the
VLM engine serves its versions."""

from __future__ import annotations

import asyncio
import math
import random

import msgspec
import numpy as np
import pytest
import torch

from laminar.config import config_from_dict
from laminar.data.vision_prompts import VisionEncoder
from laminar.engines.base import GenRequest, SamplingParams
from laminar.engines.vlm_engine import VlmEngine
from laminar.models.tiny_vlm import build_tiny_vlm, load_processor, load_vlm
from laminar.protocol.data import Trajectory
from laminar.tasks import colours
from laminar.trainer import checkpoint as ck
from laminar.trainer.torch_trainer import TorchTrainer
from laminar.vision.images import ImageLimits, digest_of
from laminar.vision.rows import image_messages
from laminar.wiring.trainer import trainer_settings


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm"), image_size=56))


def make_cfg(path, run_dir, **model):
    return config_from_dict(
        {
            "run_dir": str(run_dir),
            "model": {"path": path, **model},
            "trainer": {"lr": 3e-3, "total_steps": 10, "micro_batch_tokens": 4096},
            "algo": {"advantage": "grpo", "is_mode": "truncate"},
            "rollout": {"sampling": {"temperature": 1.0, "max_tokens": 6}},
        }
    )


def sampled_group(path, proc, colour: str, seed: int, n: int = 4):
    """n samples of one image prompt from the VLM engine: Trajectories with the image digest."""
    png = colours.draw(random.Random(seed), colour)
    msgs, imgs = image_messages(
        [{"role": "user", "content": "<image>colour?"}], [png], None, ImageLimits()
    )
    ids, _ = VisionEncoder(proc).encode(msgs, imgs)
    params = SamplingParams(max_tokens=6, seed=seed, ignore_eos=True)

    async def go():
        engine = VlmEngine(load_vlm(path), proc)
        await engine.start()
        try:
            return await engine.generate_all(
                GenRequest(f"g{seed}", ids, params, n=n, images=(png,))
            )
        finally:
            await engine.close()

    out = asyncio.run(go())
    trajs = [
        Trajectory(
            uid=sid,
            group_id=f"g{seed}",
            prompt_uid=f"p{seed}",
            sample_index=i,
            prompt_ids=ids,
            response_ids=toks,
            logprobs=lps,
            version=0,
            reward=float(i % 2),
            image_digests=[digest_of(png)],
        )
        for i, (sid, (toks, lps, _)) in enumerate(sorted(out.items()))
    ]
    return trajs, {digest_of(png): png}


def test_trainer_logprobs_match_the_engine_and_the_tower_stays_frozen(vlm, tmp_path):
    proc = load_processor(vlm)
    trainer = TorchTrainer(trainer_settings(make_cfg(vlm, tmp_path)), vlm)
    trajs, images = sampled_group(vlm, proc, "red", seed=1)
    more, more_images = sampled_group(vlm, proc, "blue", seed=2)
    batch = trainer.prepare(trajs + more, {**images, **more_images})
    placeholder = int(proc.image_token_id)
    kept = [t for t in trajs + more if not (t.response_ids == placeholder).any()]
    # a random policy may sample the placeholder token: such a sample cannot be trained
    assert batch.n_seqs == len(kept) >= 6
    assert batch.dropped.get("placeholder_in_response", 0) == 8 - len(kept)
    mb = trainer.model.micro_batch(batch, list(range(batch.n_seqs)))
    assert mb.vision is not None and mb.vision["image_grid_thw"].shape == (batch.n_seqs, 3)
    with torch.no_grad():
        logp, _ = trainer.model.token_logprobs(mb)
    by_uid = {t.uid: t for t in kept}
    for i, s in enumerate(batch.samples):
        np.testing.assert_allclose(
            logp[i][mb.resp_mask[i]].numpy(), by_uid[s.uid].logprobs, atol=1e-4
        )
    module = trainer.model.module
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer.train_step(batch)
    moved = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert moved and not any(".visual." in f".{n}" for n in moved)
    assert any("language_model" in n or "lm_head" in n or "embed" in n for n in moved)
    # a trajectory whose image did not arrive is dropped, counted
    assert trainer.prepare(kept, {}).dropped["image_missing"] == len(kept)
    # one whose placeholder run does not match its image (a short or a long run) is dropped,
    # counted, and the rest still step: HF's forward would raise on it for the whole batch
    t0 = kept[0]
    run = np.flatnonzero(np.asarray(t0.prompt_ids) == placeholder)
    short = msgspec.structs.replace(t0, prompt_ids=np.delete(np.asarray(t0.prompt_ids), run[0]))
    longer = msgspec.structs.replace(
        kept[1], prompt_ids=np.insert(np.asarray(kept[1].prompt_ids), run[0], placeholder)
    )
    bad = trainer.prepare([short, longer, *kept[2:]], {**images, **more_images})
    assert bad.dropped["image_tokens_mismatch"] == 2
    assert bad.n_seqs == len(kept) - 2 - bad.dropped.get("singleton_group", 0)
    assert math.isfinite(trainer.train_step(bad)["loss"])
    # checkpoints keep the processor files; the checkpoint loads as a VLM again
    path = ck.save_trainer(trainer, tmp_path, 1, {"version": 1, "frontier": {}}, vlm).wait()
    for f in ("preprocessor_config.json", "processor_config.json", "tokenizer.json"):
        assert (path / "model" / f).is_file()
    again = TorchTrainer(
        trainer_settings(make_cfg(str(path / "model"), tmp_path)), str(path / "model")
    )
    assert again.model.processor is not None


def test_unfrozen_tower_trains(vlm, tmp_path):
    proc = load_processor(vlm)
    trainer = TorchTrainer(trainer_settings(make_cfg(vlm, tmp_path, freeze_vision=False)), vlm)
    trajs, images = sampled_group(vlm, proc, "green", seed=3)
    module = trainer.model.module
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer.train_step(trainer.prepare(trajs, images))
    moved = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert any(".visual." in f".{n}" for n in moved)


def test_lora_adapts_the_language_model_only_and_the_vlm_engine_serves_it(vlm, tmp_path):
    """model.lora on a VLM: adapters on the language model's linears (none in the tower), a step
    moves only them, and the version (the adapters) merged by the VLM engine gives the trainer's
    logprobs after the step."""
    proc = load_processor(vlm)
    cfg = make_cfg(vlm, tmp_path, lora={"rank": 4, "alpha": 8})
    trainer = TorchTrainer(trainer_settings(cfg), vlm)
    module = trainer.model.module
    adapters = [n for n, _ in module.named_parameters() if "lora_" in n]
    assert adapters and not [n for n in adapters if ".visual." in f".{n}"]
    trajs, images = sampled_group(vlm, proc, "red", seed=4)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer.train_step(trainer.prepare(trajs, images))
    moved = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= set(adapters)
    version = trainer.export()
    assert version and all("lora_" in n for n in version)
    # the VLM engine serves the version: the same group's logprobs equal the trainer's now
    png = images[trajs[0].image_digests[0]]
    engine = VlmEngine(load_vlm(vlm), proc, lora=cfg.model.lora)
    params = SamplingParams(max_tokens=6, seed=9, ignore_eos=True)

    async def go():
        await engine.start()
        try:
            await engine.load_weights(version.items(), 1)
            return await engine.generate_all(
                GenRequest("g", trajs[0].prompt_ids, params, n=2, images=(png,))
            )
        finally:
            await engine.close()

    out = asyncio.run(go())
    assert engine.served_weights() is not None
    fresh = [
        Trajectory(
            uid=sid,
            group_id="g",
            prompt_uid="p",
            sample_index=i,
            prompt_ids=trajs[0].prompt_ids,
            response_ids=toks,
            logprobs=lps,
            version=1,
            reward=float(i),
            image_digests=trajs[0].image_digests,
        )
        for i, (sid, (toks, lps, _)) in enumerate(sorted(out.items()))
    ]
    batch = trainer.prepare(fresh, images)
    if batch.n_seqs < 2:
        pytest.skip("the random policy sampled the placeholder token")
    mb = trainer.model.micro_batch(batch, list(range(batch.n_seqs)))
    with torch.no_grad():
        logp, _ = trainer.model.token_logprobs(mb)
    for i, t in enumerate(fresh):
        np.testing.assert_allclose(logp[i][mb.resp_mask[i]].numpy(), t.logprobs, atol=1e-4)
