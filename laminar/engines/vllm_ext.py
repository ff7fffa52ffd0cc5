"""vLLM worker extension: in-place weight loads called through AsyncLLM.collective_rpc.

    AsyncEngineArgs(..., worker_extension_cls="laminar.engines.vllm_ext.LaminarWorkerExtension")
    await llm.collective_rpc("laminar_load_weights", args=(safetensors_bytes,))      # small models
    await llm.collective_rpc("laminar_load_weights", kwargs={"path": "/dev/shm/x"})  # big ones

vLLM appends this class to every worker's bases (in the worker processes), so it
must import without vllm at module level and define no attribute a Worker
already has (vLLM asserts this): every name is prefixed `laminar_`. Tensors
cannot travel as collective_rpc arguments (the msgpack hop drops their type), so
weights come as safetensors bytes or a file path. The load goes through vLLM's
layerwise reload (Worker.reload_weights; the design targets vLLM >= 0.20) because
CPU and quantised backends repack parameters after start-up and a plain
model.load_weights would write into the wrong layout.
"""

from __future__ import annotations

from typing import Any


class LaminarWorkerExtension:
    def laminar_load_weights(self, blob: bytes | None = None, path: str | None = None) -> int:
        """Load HF-named tensors from safetensors bytes or a file into this worker's model; returns the count."""
        import safetensors.torch

        if (blob is None) == (path is None):
            raise ValueError("laminar_load_weights needs exactly one of blob or path")
        tensors = (
            safetensors.torch.load(blob)
            if blob is not None
            else safetensors.torch.load_file(str(path))
        )
        device = getattr(self, "device", None)
        if device is not None and str(device) != "cpu":
            tensors = {k: v.to(device, non_blocking=True) for k, v in tensors.items()}
        worker: Any = self
        worker.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)
