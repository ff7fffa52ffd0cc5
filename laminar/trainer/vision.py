"""The trainer's side of a vision-language model: the checks and the frozen tower at load, and
each micro-batch's pixel inputs.

    processor = vision_model(module, model_path, settings)   # at TrainedModel's load
    mb.vision = vision_inputs(processor, samples, mb.input_ids)       # per micro-batch

Micro-batches of a vision-language model run HF's padded forward (not the packed one): HF's
Qwen2-VL forward takes one `pixel_values` for the batch (every row's image patches, in row order)
with `image_grid_thw` per image and computes each row's M-RoPE positions from its grid and
attention mask; the packed forward (trainer/packed.py) runs the decoder's layers itself and has
no vision tower or M-RoPE. The pixel inputs are remade here from the encoded images the buffer
served by digest (the same image processor as the rollouts').

model.freeze_vision (default true): the tower and its patch merger get requires_grad False, so
AdamW skips them and backward stops at the image embeddings. FSDP2 (trainer world > 1): the
language model's decoder layers are units of their own, the tower stays in the root's unit
(trainer/model.py apply_fsdp: a rank whose micro-batch shows no image skips the tower). LoRA
(model.lora): adapters on the language model's linears only (models/lora.py), the rest frozen;
a version is the adapters, which the VLM engine merges (engines/vlm_engine.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from laminar.vision.pixels import pixel_inputs

if TYPE_CHECKING:
    from laminar.trainer.batch import Sample
    from laminar.trainer.protocol import TrainerSettings

__all__ = ["vision_inputs", "vision_model"]


def vision_model(module: Any, model_path: str, settings: TrainerSettings) -> Any:
    """Check what a vision-language model supports, freeze its tower (model.freeze_vision; with
    model.lora everything but the adapters is frozen, and they sit on the language model only:
    models/lora.py), and return its processor."""
    from laminar.models.tiny_vlm import load_processor

    if settings.trainer.forward == "packed":
        raise ValueError(
            "trainer.forward=packed: a vision-language model runs HF's forward (set auto or hf)"
        )
    if settings.model.freeze_vision:
        for name, p in module.named_parameters():
            if ".visual." in f".{name}":
                p.requires_grad_(False)
    return load_processor(model_path)


def vision_inputs(
    processor: Any, samples: list[Sample], input_ids: torch.Tensor
) -> dict[str, torch.Tensor] | None:
    """HF's pixel inputs of these rows (their images in row order); None when none has one."""
    images = [img for s in samples for img in s.images]
    if not images:
        return None
    px = pixel_inputs(processor, images)
    return {
        "pixel_values": px.pixel_values,
        "image_grid_thw": px.grid_thw,
        "mm_token_type_ids": (input_ids == int(processor.image_token_id)).long(),
    }
