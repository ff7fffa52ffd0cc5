"""Worker for tests/test_plan.py (not a test itself): the real training step of a small model on
CPU, its peak memory measured from the process's resident set.

    MALLOC_MMAP_THRESHOLD_=65536 python tests/plan_measure.py CONFIG.yaml OUT.json

A first step creates AdamW's state; the second is measured: the kernel's peak-RSS counter is
reset (/proc/self/clear_refs) before it, and the step's peak tensor bytes are the tensors alive
before it (parameters, gradients, optimizer state) plus how far the resident set rose above its
level before it. With glibc's mmap threshold fixed low, every tensor buffer is its own mapping,
returned to the kernel when freed, so the resident set follows the live tensors.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from laminar.config import load_config  # noqa: E402
from laminar.plan.trainer import _trajectories, micro_batch_shape, read_shape  # noqa: E402
from laminar.trainer.batch import TrainBatch  # noqa: E402
from laminar.trainer.torch_trainer import TorchTrainer  # noqa: E402
from laminar.wiring.trainer import trainer_settings  # noqa: E402


def _status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024  # type: ignore[union-attr]


def _tensor_bytes(policy: TorchTrainer) -> int:
    total = 0
    for p in policy.model.module.parameters():
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    for state in policy.optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if t.dim() > 0)
    return total


def main() -> None:
    torch.set_num_threads(1)
    cfg = load_config(sys.argv[1])
    settings = trainer_settings(cfg)
    policy = TorchTrainer(settings, str(cfg.model.path))
    model_len = int(read_shape(str(cfg.model.path)).get("max_position_embeddings") or 4096)
    rows, row, response = micro_batch_shape(settings, model_len)
    batch = TrainBatch.build(_trajectories(rows, row, response, policy.model.vocab_size))
    m = policy.train_step(batch)
    assert m["micro_batches"] == 1
    before = _tensor_bytes(policy)
    Path("/proc/self/clear_refs").write_text("5")
    rss = _status("VmRSS")
    policy.train_step(batch)
    peak = _status("VmHWM")
    Path(sys.argv[2]).write_text(
        json.dumps({"peak_bytes": before + peak - rss, "before": before, "rows": rows})
    )


if __name__ == "__main__":
    main()
