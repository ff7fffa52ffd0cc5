"""The engine rollout.engine names (sim, torch, vllm), built from its config sections.

    engine = make_engine(cfg.rollout, cfg.model)   # not started: `await engine.start()`

Each backend is imported only when chosen (torch and vllm are heavy). rollout.engine=torch with a
vision-language model.path (a `vision_config` in its config.json) is the VLM engine
(engines/vlm_engine.py); rollout.engine=vllm with one passes each request's images as vLLM's
`multi_modal_data` (engines/vllm_engine.py: vllm_prompt).
"""

from __future__ import annotations

from typing import Any

from laminar.config import ModelConfig, RolloutConfig
from laminar.engines.base import Engine
from laminar.models.tiny_vlm import is_vlm


def make_engine(rollout: RolloutConfig, model: ModelConfig, **kw: Any) -> Engine:
    """Engine for rollout.engine; `kw` overrides what the sections say."""
    kind = rollout.engine
    if kind == "sim":
        from laminar.engines.sim import SimEngine

        return SimEngine.from_config(rollout, **kw)
    if kind == "torch" and model.path and is_vlm(model.path):
        from laminar.engines.vlm_engine import VlmEngine

        return VlmEngine.from_config(rollout, model, **kw)
    if kind == "torch":
        from laminar.engines.torch_engine import TorchEngine

        return TorchEngine.from_config(rollout, model, **kw)
    if kind == "vllm":
        from laminar.engines.vllm_engine import VllmEngine

        return VllmEngine.from_config(rollout, model, **kw)
    raise ValueError(f"unknown engine {kind!r}")
