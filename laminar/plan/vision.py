"""What a vision-language model adds to the memory plan: the vision tower's parameters, its
activations at the configured image size, and the image tokens each image puts in a sequence.

    vis = vision_plan(shape, shape_dir, data_config, dtype_bytes=2)   # None: a text model
    vis.params, vis.image_tokens, vis.tower_activation_bytes(images=rows)
    text = text_shape(shape)   # the language model alone, as a qwen2 causal-LM config

The language model is traced like any decoder (laminar/plan/trainer.py) from `text_shape`; the
vision tower is counted from its config (Qwen2-VL: embed_dim + mlp_ratio; Qwen2.5-VL:
hidden_size + a gated MLP of intermediate_size), frozen (model.freeze_vision's default in
docs/vision.md): the trainer holds its weights (fp32, sharded like the rest) and, per
micro-batch, one block's forward activations at a time (no_grad: nothing kept for backward).
The configured image size is the largest the processor makes: its preprocessor_config.json's
max_pixels (Qwen2-VL's 28*28*1280 default when absent), capped by data.max_image_pixels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laminar.config import DataConfig

__all__ = ["VisionPlan", "text_shape", "vision_plan"]

_QWEN_MAX_PIXELS = 28 * 28 * 1280
_TEXT_KEYS_DROP = ("vision_config", "text_config", "architectures", "rope_scaling")


@dataclass
class VisionPlan:
    params: int
    """Vision tower parameters (patch embedding, blocks, patch merger)."""
    dim: int
    depth: int
    mlp: int
    """The blocks' MLP width."""
    patch: int
    merge: int
    image_pixels: int
    """Pixels of the largest image the processor makes (the configured image size)."""

    @property
    def patches(self) -> int:
        """Patches of one such image (temporal patch 2: a still image is one frame pair)."""
        return max(1, self.image_pixels // (self.patch * self.patch))

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens one image takes in the sequence (patches / merge**2)."""
        return max(1, self.patches // (self.merge * self.merge))

    def tower_activation_bytes(self, images: int, dtype_bytes: int) -> int:
        """Peak activations of the frozen tower over `images` images: one block's hidden states,
        q/k/v and MLP at a time (sdpa: no [patches, patches] score matrix kept)."""
        per_patch = self.dim * (1 + 3 + 1) + 2 * self.mlp
        return images * self.patches * per_patch * dtype_bytes


def _vision_params(v: dict[str, Any]) -> tuple[int, int, int]:
    """(params, dim, mlp width) of a Qwen2-VL / Qwen2.5-VL vision tower config."""
    depth = int(v["depth"])
    patch = int(v.get("patch_size", 14))
    t = int(v.get("temporal_patch_size", 2))
    chans = int(v.get("in_chans", v.get("in_channels", 3)))
    merge = int(v.get("spatial_merge_size", 2))
    if "embed_dim" in v:  # Qwen2-VL: LayerNorm, fc1/fc2 MLP; hidden_size is the LM's width
        dim, out = int(v["embed_dim"]), int(v["hidden_size"])
        mlp = int(dim * float(v.get("mlp_ratio", 4)))
        block_mlp = 2 * dim * mlp + mlp + dim
        norms = 2 * 2 * dim  # LayerNorm: weight and bias
    else:  # Qwen2.5-VL: RMSNorm, gated MLP
        dim, out = int(v["hidden_size"]), int(v["out_hidden_size"])
        mlp = int(v["intermediate_size"])
        block_mlp = 3 * dim * mlp + 2 * mlp + dim
        norms = 2 * dim
    attn = dim * 3 * dim + 3 * dim + dim * dim + dim
    merged = dim * merge * merge
    merger = norms // 2 + merged * merged + merged + merged * out + out
    embed = chans * t * patch * patch * dim
    return embed + depth * (attn + block_mlp + norms) + merger, dim, mlp


def vision_plan(
    shape: dict[str, Any], shape_dir: str | Path, data: DataConfig
) -> VisionPlan | None:
    v = shape.get("vision_config")
    if not isinstance(v, dict):
        return None
    params, dim, mlp = _vision_params(v)
    pre = Path(shape_dir) / "preprocessor_config.json"
    max_pixels = _QWEN_MAX_PIXELS
    if pre.is_file():
        conf = json.loads(pre.read_text())
        size = conf.get("size") or {}
        max_pixels = int(conf.get("max_pixels") or size.get("longest_edge") or max_pixels)
    return VisionPlan(
        params=params,
        dim=dim,
        depth=int(v["depth"]),
        mlp=mlp,
        patch=int(v.get("patch_size", 14)),
        merge=int(v.get("spatial_merge_size", 2)),
        image_pixels=min(max_pixels, data.max_image_pixels),
    )


def text_shape(shape: dict[str, Any]) -> dict[str, Any]:
    """The language model of a VLM config as a qwen2 causal-LM config (nested `text_config`
    or Qwen2.5-VL's flat fields); M-RoPE changes no memory figure."""
    text = dict(shape.get("text_config") or shape)
    for k in _TEXT_KEYS_DROP:
        text.pop(k, None)
    for k in ("vocab_size", "tie_word_embeddings"):
        if k in shape and k not in text:
            text[k] = shape[k]
    text["model_type"] = "qwen2"
    return text
