"""Multimodal row shapes -> chat messages with image parts + the images, in order.

    messages, images = image_messages(obj["prompt"], obj.get("images"), base_dir, limits)

Shapes taken as they are:
  * TRL: content parts `[{"type": "image"}, {"type": "text", "text": ...}]`, the images in the
    row's `images` column, in order;
  * verl: string content with `<image>` markers, the images in `images` (each a path, bytes or
    an HF `datasets` Image value {"bytes", "path"});
  * inline parts: `{"type": "image", "image": SOURCE}` (qwen-vl-utils) and
    `{"type": "image_url", "image_url": {"url": ...}}` (OpenAI; data: URIs and local files).

Out: messages whose content is a string or a list of `{"type": "text", "text"}` and
`{"type": "image"}` parts (what an HF processor's chat template renders), and one ImageData per
image part. A placeholder without an image, an image without a placeholder, or a bad image
raises BadImage naming the part.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from laminar.vision.images import BadImage, ImageData, ImageLimits, load_image

__all__ = ["VERL_IMAGE_MARKER", "has_images", "image_messages"]

VERL_IMAGE_MARKER = "<image>"
_INLINE_KEYS = ("image", "path", "bytes", "url")


def has_images(prompt: Any, images: Any) -> bool:
    """Whether a row is multimodal: an `images` column, or a message whose content is a list."""
    if images:
        return True
    return isinstance(prompt, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) for m in prompt
    )


def _parts(content: Any, i: int) -> list[dict[str, Any]]:
    if isinstance(content, str):
        if VERL_IMAGE_MARKER not in content:
            return [{"type": "text", "text": content}]
        out: list[dict[str, Any]] = []
        for k, piece in enumerate(re.split(re.escape(VERL_IMAGE_MARKER), content)):
            if k:
                out.append({"type": "image"})
            if piece:
                out.append({"type": "text", "text": piece})
        return out
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise BadImage(f"message {i}: content must be a string or a list of part objects")
    return content


def image_messages(
    prompt: Any, images: Any, base_dir: Path | None, limits: ImageLimits
) -> tuple[list[dict[str, Any]], list[ImageData]]:
    """Normalise a multimodal prompt (see the module docstring); raises BadImage."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise BadImage("'prompt' must be a string or a non-empty list of chat messages")
    column = list(images) if isinstance(images, list | tuple) else ([] if images is None else None)
    if column is None:
        raise BadImage(f"'images' must be a list, got {type(images).__name__}")
    taken = 0
    out_msgs: list[dict[str, Any]] = []
    found: list[ImageData] = []
    total = 0
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadImage(f"message {i} must be {{'role': str, 'content': ...}}")
        parts: list[dict[str, Any]] = []
        for j, p in enumerate(_parts(m.get("content"), i)):
            kind = p.get("type")
            if kind == "text":
                if not isinstance(p.get("text"), str):
                    raise BadImage(f"message {i} part {j}: a text part needs a string 'text'")
                parts.append({"type": "text", "text": p["text"]})
                continue
            if kind not in ("image", "image_url"):
                raise BadImage(f"message {i} part {j}: unsupported part type {kind!r}")
            if kind == "image_url":
                url = p.get("image_url")
                source = url.get("url") if isinstance(url, dict) else url
            else:
                source = next((p[k] for k in _INLINE_KEYS if p.get(k) is not None), None)
            if source is None:  # a bare placeholder: the next image of the `images` column
                if taken >= len(column):
                    raise BadImage(
                        f"message {i} part {j}: image placeholder {taken + 1} but the row's "
                        f"'images' holds {len(column)}"
                    )
                source = column[taken]
                taken += 1
            try:
                img = load_image(source, base_dir, limits)
            except BadImage as exc:
                raise BadImage(f"message {i} part {j} (image {len(found) + 1}): {exc}") from None
            total += len(img.data)
            if total > limits.max_bytes_per_prompt:
                raise BadImage(
                    f"the prompt's images are {total} bytes > "
                    f"data.max_image_bytes={limits.max_bytes_per_prompt}"
                )
            found.append(img)
            parts.append({"type": "image"})
        content: Any = parts
        if all(p["type"] == "text" for p in parts):
            content = "".join(p["text"] for p in parts)
        out_msgs.append({"role": m["role"], "content": content})
    if taken < len(column):
        raise BadImage(
            f"the row's 'images' holds {len(column)} images but its messages have "
            f"{taken} placeholders for them"
        )
    return out_msgs, found
