"""A multimodal prompt -> token ids with the image placeholders expanded as the model's own HF
processor expands them, and the pixel inputs of its images.

    enc = VisionEncoder(load_processor(path), max_tokens=512)   # laminar/models/tiny_vlm.py
    ids, reward_text = enc.encode(messages, images)            # raises BadRow
    ids, reward_text, grids = enc.encode_full(messages, images)  # + image grids [k, 3]
    inputs = pixel_inputs(enc.processor, [img.data for img in images])   # laminar/vision/pixels.py

The chat template renders each image part as one placeholder (<|vision_start|><|image_pad|>
<|vision_end|> for Qwen2-VL); the processor then repeats <|image_pad|> grid_t*grid_h*grid_w /
merge_size**2 times per image. A prompt whose rendered placeholders do not match its images is
a bad row. Text-only prompts go through the same template (no images, no pixel inputs).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from laminar.data.prompts import BadRow
from laminar.vision.images import ImageData, decode_rgb

__all__ = ["VisionEncoder"]


class VisionEncoder:
    """Prompts with image parts -> expanded token ids, via the model's processor."""

    def __init__(self, processor: Any, max_tokens: int = 512):
        self.processor = processor
        self.tok = processor.tokenizer
        self.max_tokens = max_tokens
        self.image_token_id = int(processor.image_token_id)
        self.use_template = True

    def encode(
        self, prompt: str | list[dict[str, Any]], images: list[ImageData] | tuple = ()
    ) -> tuple[np.ndarray, str]:
        """(prompt ids, text for the reward), as PromptEncoder.encode; raises BadRow."""
        ids, text, _ = self.encode_full(prompt, images)
        return ids, text

    def encode_full(
        self, prompt: str | list[dict[str, Any]], images: list[ImageData] | tuple = ()
    ) -> tuple[np.ndarray, str, np.ndarray]:
        """(prompt ids, text for the reward, image grids [k, 3]); raises BadRow."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        reward_text = _reward_text(messages)
        proc = self.processor
        try:
            text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template failure is a property of this row
            raise BadRow(f"chat template failed: {type(exc).__name__}: {exc}") from None
        placeholders = text.count(proc.image_token)
        if placeholders != len(images):
            raise BadRow(
                f"the rendered prompt has {placeholders} image placeholders for {len(images)} "
                "images"
            )
        try:
            if images:
                out = proc(
                    text=[text], images=[decode_rgb(i.data) for i in images], return_tensors="np"
                )
                grids = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
            else:
                out = proc.tokenizer([text], add_special_tokens=False, return_tensors="np")
                grids = np.zeros((0, 3), dtype=np.int64)
        except Exception as exc:  # the processor refused this row's images
            raise BadRow(f"processor failed: {type(exc).__name__}: {exc}") from None
        ids = np.asarray(out["input_ids"][0], dtype=np.int32)
        if not len(ids):
            raise BadRow("prompt tokenizes to nothing")
        if len(ids) > self.max_tokens:
            raise BadRow(
                f"prompt has {len(ids)} tokens (image placeholders expanded) > "
                f"data.max_prompt_tokens={self.max_tokens}"
            )
        return ids, reward_text, grids


def _reward_text(messages: list[dict[str, Any]]) -> str:
    """The last user message's text (its text parts joined): what a reward function reads."""
    users = [m for m in messages if m["role"] == "user"] or messages
    content = users[-1]["content"]
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p.get("type") == "text")
