"""A tiny Qwen2-VL-shaped vision-language model and its processor, built locally (no hub).

    path = build_tiny_vlm("/tmp/tiny-vlm", image_size=56, hidden=64, layers=2)
    model = load_vlm(path)              # Qwen2VLForConditionalGeneration, random weights
    proc = load_processor(path)         # Qwen2VLProcessor: image processor + char tokenizer

The directory is a normal HF VLM directory: config.json (model_type qwen2_vl) + safetensors,
preprocessor_config.json (Qwen2-VL's image processor: 14-pixel patches, 2x2 merge), the demo's
character tokenizer (laminar/models/tiny.py) with Qwen2-VL's vision special tokens added
(<|vision_start|> <|image_pad|> <|vision_end|> <|video_pad|>), a chat template that renders an
image part as `<|vision_start|><|image_pad|><|vision_end|>`, and processor_config.json. The
processor expands each <|image_pad|> to grid_t*grid_h*grid_w / merge_size**2 copies, as
Qwen2VLProcessor does.

`load_processor` uses AutoProcessor when it loads; transformers' Qwen2VLProcessor also wants its
video processor, which needs torchvision, so without torchvision the same Qwen2VLProcessor class
is assembled from the directory's image processor and tokenizer (video inputs then unsupported).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from laminar.models.tiny import DEFAULT_ALPHABET, IMPORT_LOCK, char_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_TOKEN = "<|image_pad|>"
# Rendered by jinja: a string content as is, a list of parts with each image part as the
# vision block; one message per line; the generation prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def vlm_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> Any:
    """The demo's character tokenizer plus Qwen2-VL's vision special tokens and chat template."""
    tok = char_tokenizer(alphabet)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_vlm_config(
    tok: Any,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vision_depth: int = 2,
    vision_dim: int = 32,
    vision_heads: int = 2,
    max_positions: int = 1024,
) -> Any:
    """A Qwen2-VL config at toy scale; `hidden` must be divisible by heads and give a head dim
    whose half splits into mrope's (temporal, height, width) sections."""
    from transformers import Qwen2VLConfig

    head_dim = hidden // heads
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]  # sums to head_dim / 2
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    return Qwen2VLConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": hidden,
            "intermediate_size": hidden * 3,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": max_positions,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": section,
                "rope_theta": 10000.0,
            },
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        },
        vision_config={
            "depth": vision_depth,
            "embed_dim": vision_dim,
            "hidden_size": hidden,
            "num_heads": vision_heads,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def build_tiny_vlm(
    path: str | os.PathLike[str],
    alphabet: str = DEFAULT_ALPHABET,
    seed: int = 0,
    image_size: int = 56,
    **cfg_kw: Any,
) -> Path:
    """Write a randomly initialised tiny Qwen2-VL + its processor files to `path`. Images are
    resized to about `image_size` x `image_size` pixels (min = max pixels), i.e.
    (image_size/14)^2 patches and a quarter of that in placeholder tokens."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if image_size % 28:
        raise ValueError(f"image_size={image_size} must be a multiple of 28 (patch 14 x merge 2)")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = vlm_tokenizer(alphabet)
    config = tiny_vlm_config(tok, **cfg_kw)
    torch.manual_seed(seed)
    model: Any = Qwen2VLForConditionalGeneration(config)
    model = model.float()
    model.save_pretrained(out, safe_serialization=True)
    pixels = image_size * image_size
    Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels).save_pretrained(out)
    tok.save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    (out / "laminar_tiny.json").write_text(
        json.dumps({"alphabet": alphabet, "seed": seed, "image_size": image_size, **cfg_kw})
    )
    return out


def is_vlm(path: str | os.PathLike[str]) -> bool:
    """True when `path`'s config.json declares a vision tower (a `vision_config`)."""
    f = Path(path) / "config.json"
    return f.exists() and "vision_config" in json.loads(f.read_text())


def load_processor(path: str | os.PathLike[str]) -> Any:
    """The model directory's HF processor (AutoProcessor), or, where its video processor cannot
    load (no torchvision), Qwen2VLProcessor assembled from the image processor and tokenizer."""
    with IMPORT_LOCK:
        from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
        from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

        try:
            return AutoProcessor.from_pretrained(str(path), local_files_only=True)
        except ImportError:  # torchvision missing: the video processor cannot be built
            pass
        image_processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    proc = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    # ProcessorMixin.__init__ insists on a video processor class; its attributes are set directly
    proc.image_processor = image_processor
    proc.tokenizer = tok
    proc.video_processor = None
    proc.chat_template = tok.chat_template
    proc.image_token = IMAGE_TOKEN
    proc.image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    proc.video_token = "<|video_pad|>"
    proc.video_token_id = tok.convert_tokens_to_ids("<|video_pad|>")
    return proc


def load_vlm(
    path: str | os.PathLike[str],
    dtype: str = "float32",
    device: str = "cpu",
    attention: str = "eager",
) -> Any:
    """The local HF vision-language model of `path` (AutoModelForImageTextToText), eval mode."""
    import torch

    with IMPORT_LOCK:
        from transformers import AutoModelForImageTextToText
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model: Any = AutoModelForImageTextToText.from_pretrained(
            str(path),
            dtype=getattr(torch, dtype),
            local_files_only=True,
            attn_implementation=attention,
        )
    return model.to(device).eval()
