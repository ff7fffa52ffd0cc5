"""vLLM worker extension: in-place weight loads called through AsyncLLM.collective_rpc.

    AsyncEngineArgs(..., worker_extension_cls="laminar.engines.vllm_ext.LaminarWorkerExtension")
    # spans: [(name, dtype, shape, path, offset, nbytes)]
    await llm.collective_rpc("laminar_load_spans", args=(spans,))
    # the older path (bench)
    await llm.collective_rpc("laminar_load_weights", args=(safetensors_bytes,))
    # attestation (vllm_attest.py): fold records of what the worker serves
    await llm.collective_rpc("laminar_weight_folds", args=([(name, shape), ...],))
    await llm.collective_rpc("laminar_adapter_folds", args=(lora_id, names, rank))

vLLM appends this class to every worker's bases (in the worker processes), so it
must import without vllm at module level and define no attribute a Worker
already has (vLLM asserts this): every name is prefixed `laminar_`. Tensors
cannot travel as collective_rpc arguments (the msgpack hop drops their type), so
weights come as spans of shared files: the worker maps each file read-only and hands
vLLM tensors that view the mapping, so the bytes are read once, straight into the
parameters (the relay's segment is the file: no serialisation, no temporary copy).
The load goes through vLLM's layerwise reload (Worker.reload_weights; the design
targets vLLM >= 0.20) because CPU and quantised backends repack parameters after
start-up and a plain model.load_weights would write into the wrong layout.

Importing this module in the EngineCore (vLLM does, before it loads the model) ties
that process's life to the rollout's (laminar/engines/lifeline.py): kill -9 of the
rollout leaves no engine behind.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from laminar.engines.lifeline import die_with_parent
from laminar.engines.vllm_attest import adapter_records, folding_packed_weights, weight_records

die_with_parent()  # no-op unless this is an engine process started by a rollout


def span_tensors(spans: Sequence[Sequence[Any]]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) views of each span's bytes in its file, mapped read-only, one map per file.

    The maps are never closed here: vLLM's layerwise reload may hold tensors until a layer is
    complete, and each view keeps its map alive (torch.frombuffer holds a reference), so the
    pages are unmapped when the last view is gone. Closing them earlier is a segfault."""
    import torch

    maps: dict[str, mmap.mmap] = {}
    for name, dtype, shape, path, offset, nbytes in spans:
        tdtype = getattr(torch, str(dtype))
        if nbytes == 0:
            yield str(name), torch.empty(list(shape), dtype=tdtype)
            continue
        mm = maps.get(path)
        if mm is None:
            fd = os.open(path, os.O_RDONLY)
            try:
                mm = maps[path] = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        with warnings.catch_warnings():  # read-only buffer: vLLM only reads (copies into params)
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=int(nbytes), offset=int(offset))
        yield str(name), raw.view(tdtype).reshape(list(shape))


class LaminarWorkerExtension:
    def laminar_load_spans(self, spans: Sequence[Sequence[Any]]) -> int:
        """Load HF-named tensors that view shared files (see span_tensors); returns the count."""
        device = getattr(self, "device", None)
        tensors: Iterator[tuple[str, Any]] = span_tensors(spans)
        if device is not None and str(device) != "cpu":
            tensors = ((k, v.to(device, non_blocking=True)) for k, v in tensors)
        count = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for item in tensors:
                count += 1
                yield item

        worker: Any = self
        with folding_packed_weights():  # attestation: what the CPU backend packs, folded first
            worker.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        return count

    def laminar_weight_folds(self, wanted: Sequence[Sequence[Any]]) -> list[list[Any]] | None:
        """Attestation: one fold record per (HF name, shape) of the last load, read back from the
        model this worker serves (vllm_attest.py); None when it holds a shard (TP / PP)."""
        worker: Any = self
        if worker.vllm_config.parallel_config.world_size > 1:
            return None
        return weight_records(worker.model_runner.get_model(), wanted)

    def laminar_adapter_folds(
        self, lora_id: int, names: Sequence[str], rank: int
    ) -> list[list[Any]] | None:
        """Attestation, model.lora: fold records of adapter `lora_id` as its LoRA slot holds it."""
        worker: Any = self
        if worker.vllm_config.parallel_config.world_size > 1:
            return None
        manager = worker.model_runner.lora_manager._adapter_manager
        return adapter_records(manager, lora_id, names, rank)

    def laminar_load_weights(self, blob: bytes | None = None, path: str | None = None) -> int:
        """Load HF-named tensors from safetensors bytes or a file (the path before spans:
        bench/weights_vllm.py)."""
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
        with folding_packed_weights():
            worker.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)
