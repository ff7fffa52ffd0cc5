"""The refusal of a weight version that does not fit a model: raised where the model is loaded
into (models/lora.py's adapters), caught by the engines, which keep serving their previous
version (engines/torch_engine.py, engines/vllm_engine.py) and by the rollout that asked
(rollout/versions.py). A leaf, so models need not import the engines above them."""


class WeightsRejected(ValueError):
    """An engine refused a version it was given (it does not fit the model: names, shapes,
    values). Nothing of it was applied: the engine still serves, and labels its tokens with, its
    previous version."""

    version: int = -1
    """The version refused (set by the engine that refused it)."""
