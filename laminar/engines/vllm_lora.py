"""LoRA versions on a running vLLM engine (model.lora with rollout.engine=vllm): each version is
a new adapter, added without restarting the engine; requests run on the adapter that was current
when they started, and carry its version.

    adapters = VllmAdapters(lora, model_path, shm_dir)
    args.update(adapters.engine_args())              # enable_lora, max_lora_rank, max_loras
    req = await adapters.add(llm, v, named, version)  # checked, written as a peft dir, add_lora
    llm.generate(..., lora_request=adapters.current)  # new requests: the newest adapter
    await adapters.prune(llm, in_use={...})           # remove_lora + delete the ones nothing uses

vLLM loads an adapter from a directory (LoRARequest(name, int id, path)): each version is written
as a peft adapter directory (models/lora.py write_adapter_dir) under /dev/shm and added under a
fresh id, so vLLM never serves a cached older adapter under a reused id. A version that does not
fit (names, shapes, values: models/lora.py validate_adapter against config.json; or vLLM's own
refusal) raises AdapterRejected and the previous adapter stays current.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laminar.config import LoraConfig

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM accepts (the smallest one >= model.lora.rank is asked for)."""


@dataclass
class _Adapter:
    version: int
    request: Any
    """vLLM's LoRARequest."""
    path: Path
    spec: list[tuple[str, str, list[int]]]
    """(peft name, dtype, shape) of each tensor of the version (what attestation folds back)."""

    @property
    def lora_id(self) -> int:
        return int(self.request.lora_int_id)


class VllmAdapters:
    def __init__(self, lora: LoraConfig, model_path: str | None, shm_dir: str) -> None:
        from laminar.models.lora import config_target_shapes

        self.lora, self.model_path, self.shm_dir = lora, model_path, shm_dir
        cfg = Path(model_path or "") / "config.json"
        self.shapes = (
            config_target_shapes(json.loads(cfg.read_text()), lora) if cfg.is_file() else None
        )
        """(in, out) of every target from config.json (None: no config at hand; vLLM checks)."""
        self._ids = itertools.count(1)
        self.live: list[_Adapter] = []
        """Added and not yet removed, oldest first; the last is current."""

    def engine_args(self) -> dict[str, Any]:
        rank = next((r for r in VLLM_RANKS if r >= self.lora.rank), self.lora.rank)
        # 2: requests started on the previous version may still run beside the new one
        return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 2, "max_cpu_loras": 2}

    @property
    def current(self) -> Any:
        """The LoRARequest new requests run with (None: version 0, the base)."""
        return self.live[-1].request if self.live else None

    @property
    def current_id(self) -> int:
        return self.live[-1].lora_id if self.live else 0

    def version_of(self, lora_id: int, default: int) -> int:
        return next((a.version for a in self.live if a.lora_id == lora_id), default)

    async def add(
        self, llm: Any, v: Any, named_tensors: Iterable[tuple[str, Any]], version: int
    ) -> Any:
        """Check the version, write it, add it to vLLM; it becomes current. AdapterRejected (and
        nothing changed) when it does not fit."""
        from laminar.models.lora import (
            AdapterRejected,
            validate_adapter,
            version_names,
            write_adapter_dir,
        )

        tensors = dict(named_tensors)
        staged = await asyncio.to_thread(validate_adapter, tensors, self.lora, self.shapes)
        out = Path(tempfile.mkdtemp(prefix=f"laminar-lora-v{version}-", dir=self.shm_dir))
        try:
            flat = {}
            for module, (a, b) in staged.items():  # copies: the relay's segment is released next
                a_name, b_name = version_names(module)
                flat[a_name], flat[b_name] = a.clone(), b.clone()
            await asyncio.to_thread(write_adapter_dir, out, self.lora, flat, self.model_path)
            lora_id = next(self._ids)
            request = v.LoRARequest(f"laminar-v{version}-{lora_id}", lora_id, str(out))
            try:
                added = await llm.add_lora(request)
            except Exception as exc:  # vLLM's own checks (rank, modules, dtype)
                why = f"vLLM refused the adapter: {type(exc).__name__}: {exc}"
                raise AdapterRejected(why) from exc
            if added is False:
                raise AdapterRejected("vLLM's add_lora returned False")
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        spec = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in flat.items()]
        self.live.append(_Adapter(version, request, out, spec))
        return request

    async def prune(self, llm: Any, in_use: set[int]) -> None:
        """Remove every adapter but the current one that no running request uses."""
        keep = []
        for i, a in enumerate(self.live):
            if i == len(self.live) - 1 or a.lora_id in in_use:
                keep.append(a)
                continue
            await llm.remove_lora(a.lora_id)
            shutil.rmtree(a.path, ignore_errors=True)
        self.live = keep

    def close(self) -> None:
        for a in self.live:
            shutil.rmtree(a.path, ignore_errors=True)
        self.live = []
