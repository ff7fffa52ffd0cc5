"""`laminar plan` on vision-language models: the tower counted from its config (checked against
a real HF model's parameters), image tokens at the configured size, per-GPU figures for a
7B-VL shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from laminar.config import DataConfig, load_config
from laminar.plan.memory import GIB, Hardware, make_plan
from laminar.plan.vision import text_shape, vision_plan

ROOT = Path(__file__).resolve().parents[1]
VL7B = ROOT / "configs" / "shapes" / "Qwen2.5-VL-7B-Instruct"


def test_tower_count_matches_the_hf_models(tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    from laminar.models.tiny_vlm import build_tiny_vlm

    path = build_tiny_vlm(tmp_path / "tiny", image_size=56)
    shape = json.loads((path / "config.json").read_text())
    vis = vision_plan(shape, path, DataConfig())
    model = AutoModelForImageTextToText.from_pretrained(path)
    tower = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    assert vis is not None and vis.params == tower
    assert vis.image_pixels == 56 * 56 and vis.image_tokens == 4  # (56/14)^2 / 2^2
    # Qwen2.5-VL's tower (RMSNorm, gated MLP), at a small width, on the meta device
    big = json.loads((VL7B / "config.json").read_text())
    v = {**big["vision_config"], "depth": 2, "hidden_size": 64, "intermediate_size": 96}
    v["out_hidden_size"] = 128
    small = {**big, "vision_config": v}
    lm = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    lm |= {"num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 100}
    cfg = Qwen2_5_VLConfig(vision_config=v, text_config=lm)
    with torch.device("meta"):
        m = AutoModelForImageTextToText.from_config(cfg)
    tower = sum(p.numel() for n, p in m.named_parameters() if "visual" in n)
    assert vision_plan(small, VL7B, DataConfig()).params == tower


def test_7b_vl_shape_counts_677m_tower_params_and_image_tokens():
    shape = json.loads((VL7B / "config.json").read_text())
    vis = vision_plan(shape, VL7B, DataConfig(max_image_pixels=448 * 448))
    assert vis is not None and 670e6 < vis.params < 685e6  # Qwen2.5-VL-7B's ViT: ~676M
    assert vis.image_tokens == 256  # 448x448: 32x32 patches, 2x2 merged
    assert text_shape(shape)["model_type"] == "qwen2" and "vision_config" not in text_shape(shape)


@pytest.mark.slow
def test_plan_of_a_7b_vl_config_gives_per_gpu_figures():
    overrides = [
        "model.path=models/Qwen2.5-VL-7B-Instruct",
        "data.max_prompt_tokens=1024",
        f"data.max_image_pixels={448 * 448}",
    ]
    cfg = load_config(ROOT / "configs" / "qwen2.5-7b-vllm.yaml", overrides)
    plan = make_plan(cfg, Hardware(gpu_gib=80, gpus_per_node=8))
    text = make_plan(
        load_config(ROOT / "configs" / "qwen2.5-7b-vllm.yaml"),
        Hardware(gpu_gib=80, gpus_per_node=8),
    )
    trainer, rollout = plan.processes[0], plan.processes[1]
    assert plan.fits and plan.vision["image_tokens"] == 256
    assert trainer.peak_bytes > text.processes[0].peak_bytes  # the tower is on the trainer
    assert "vision tower" in trainer.detail
    # every rollout holds the tower's weights too (bf16)
    assert plan.weight_version_bytes - text.weight_version_bytes == plan.vision["tower_params"] * 2
    assert rollout.peak_bytes <= 72 * GIB
    assert any("256 image tokens" in n for n in plan.notes)
