"""A vLLM worker extension for tests: Laminar's, plus one way to corrupt what vLLM serves.

    engine_args=dict(worker_extension_cls="tests.vllm_corrupt_ext.CorruptingExtension")
    await llm.collective_rpc("laminar_test_corrupt", args=("model.embed_tokens.weight",))

Imported by vLLM's worker (the repository root is on PYTHONPATH), never by the rollout.
"""

from __future__ import annotations

from typing import Any

from laminar.engines.vllm_ext import LaminarWorkerExtension


class CorruptingExtension(LaminarWorkerExtension):
    def laminar_test_corrupt(self, name: str) -> float:
        """Add 1.0 to the first element of parameter `name` in the model this worker serves
        (what a faulty load path would leave behind); returns the new value."""
        import torch

        worker: Any = self
        param = worker.model_runner.get_model().get_parameter(name)
        with torch.no_grad():
            param.view(-1)[0] += 1.0
        return float(param.view(-1)[0])
