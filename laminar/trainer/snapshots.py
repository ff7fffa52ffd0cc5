"""Weight snapshots for evaluation after the run (the demo's held-out accuracy curve).

    snaps = Snapshots(run_dir, every=cfg.trainer.snapshot_every)    # every=0: off
    if snaps.due(version): snaps.save(version, step, weights)       # blocking: worker thread

    run_dir/snapshots/v{version}.safetensors   model-only weights (written to a temp name, renamed);
                                               with LoRA the adapters, their settings in the header
    run_dir/snapshots/index.jsonl              {"version", "step", "time"} per snapshot

Evaluating inside the run would steal its CPU and skew its timing, so the run only
writes the weights with their wall time and laminar/demo evaluates them afterwards.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Snapshots:
    def __init__(self, run_dir: Path, every: int):
        self.dir = run_dir / "snapshots"
        self.every = every

    def due(self, version: int) -> bool:
        return self.every > 0 and version % self.every == 0

    def save(
        self,
        version: int,
        step: int,
        weights: dict[str, torch.Tensor],
        metadata: dict[str, str] | None = None,
    ) -> None:
        """`metadata`: the safetensors header's (LoRA: models/lora.py snapshot_metadata)."""
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".v{version}.tmp"
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
        save_file(cpu, str(tmp), metadata=metadata)
        os.replace(tmp, self.dir / f"v{version}.safetensors")
        with open(self.dir / "index.jsonl", "a") as f:
            f.write(json.dumps({"version": version, "step": step, "time": time.time()}) + "\n")
