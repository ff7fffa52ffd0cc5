"""The pixel inputs of encoded images, as the model's HF image processor makes them (the same on
every receiver, so only the encoded bytes travel).

    inputs = pixel_inputs(processor, [png_bytes, ...])
    model(input_ids=..., mm_token_type_ids=..., pixel_values=inputs.pixel_values,
          image_grid_thw=inputs.grid_thw)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from laminar.vision.images import decode_rgb

__all__ = ["PixelInputs", "image_token_counts", "pixel_inputs"]


@dataclass
class PixelInputs:
    pixel_values: Any
    """torch tensor [patches, C*T*P*P] (Qwen2-VL's flattened patches), float32."""
    grid_thw: Any
    """torch tensor [images, 3] int64: (t, h, w) patches of each image."""


def pixel_inputs(processor: Any, images: list[bytes]) -> PixelInputs:
    """The processor's pixel inputs of encoded images (the same on every receiver)."""
    out = processor.image_processor(images=[decode_rgb(d) for d in images], return_tensors="pt")
    return PixelInputs(out["pixel_values"], out["image_grid_thw"])


def image_token_counts(processor: Any, images: Mapping[str, bytes]) -> dict[str, int]:
    """Each image's placeholder run, as the processor expands it (grid_t * grid_h * grid_w /
    merge_size**2), by digest; an image the processor cannot read has none."""
    merge = int(getattr(processor.image_processor, "merge_size", 1) or 1)
    out: dict[str, int] = {}
    for digest, data in images.items():
        try:
            grid = pixel_inputs(processor, [data]).grid_thw[0]
        except Exception:  # noqa: BLE001 - the trajectories showing it are dropped, counted
            continue
        out[digest] = int(grid.prod()) // (merge**2)
    return out
