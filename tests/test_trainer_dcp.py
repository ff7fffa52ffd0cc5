"""Sharded checkpoints (torch.distributed.checkpoint): 2 ranks (gloo) write, 2 ranks resume, the
next step's loss equals the uninterrupted run's; `laminar export` makes an HF directory of it.

    .venv/bin/python -m pytest tests/test_trainer_dcp.py -q -m slow     # ~1 min on 2 cores
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from laminar.cli import main as cli_main
from laminar.trainer import checkpoint as ck

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _two_ranks(model: str, out: Path, mode: str) -> dict:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
        "torchrun"
    )
    if torchrun is None:
        pytest.skip("torchrun not found")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [torchrun, "--standalone", "--nproc_per_node", "2"]
    argv += [str(ROOT / "tests" / "fsdp_dcp_worker.py"), model, str(out), mode]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / f"{mode}.json").read_text())


def test_two_ranks_write_two_ranks_resume_same_next_loss(tmp_path):
    from laminar.models.tiny import build_tiny_model

    model = str(build_tiny_model(tmp_path / "model", hidden=32, layers=2, heads=2, kv_heads=1))
    out = tmp_path / "out"
    run = _two_ranks(model, out, "run")
    path = Path(run["checkpoint"])
    assert run["streamed_equal"]  # FSDP: the streamed export is the unstreamed one, byte for byte
    # every rank wrote its own shards; no HF directory was gathered
    shards = sorted(p.name for p in (path / "dcp").glob("*.distcp"))
    assert len(shards) == 2, shards
    assert not (path / "model").exists() and (path / "meta.json").is_file()
    resumed = _two_ranks(model, out, "resume")
    assert resumed["empty"]  # built without weights, each rank read its own shards
    assert resumed["meta"]["version"] == 2
    assert resumed["meta"]["frontier"] == {"committed": [0, 1], "uncommitted": []}
    assert resumed["last_epoch"] == 2
    assert resumed["loss"] == pytest.approx(run["losses"][2], abs=1e-6)
    assert run["losses"][2] != run["losses"][1]
    # the HF export, a separate step in one process: the weights after step 2
    dst = tmp_path / "hf"
    assert cli_main(["export", str(path), str(dst)]) == 0
    from safetensors.torch import load_file

    exported = load_file(str(dst / "model.safetensors"))
    weights = torch.load(out / "weights2.pt", weights_only=True)
    assert weights.keys() <= exported.keys()
    for k, v in weights.items():
        assert torch.equal(exported[k], v), k
    assert (dst / "config.json").is_file() and (dst / "tokenizer.json").is_file()
    assert ck.latest_checkpoint(out / "run") == path


def test_resume_reads_each_ranks_share_not_the_full_weights(tmp_path):
    """A rank resuming from a sharded checkpoint builds the model on the meta device and reads
    its shards: its host peak while building is about its half of the weights, where loading
    the model whole first costs the full weights. Same next-step loss either way."""
    from laminar.models.tiny import build_tiny_model

    shape = {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4}  # ~25M params, ~100 MB fp32
    model = str(build_tiny_model(tmp_path / "model", **shape))
    out = tmp_path / "out"
    run = _two_ranks(model, out, "run")
    empty = _two_ranks(model, out, "resume")
    full = _two_ranks(model, out, "resume_full")
    assert empty["empty"] and not full["empty"]
    assert empty["loss"] == pytest.approx(run["losses"][2], abs=1e-6)
    assert full["loss"] == pytest.approx(run["losses"][2], abs=1e-6)
    weights = full["full_weights_bytes"]
    mib = {k: f"{v / 2**20:.1f} MiB" for k, v in [("weights", weights)]}
    for name, r in (("empty", empty), ("whole", full)):
        mib[name] = f"{r['weights_peak_bytes'] / 2**20:.1f} / {r['resume_peak_bytes'] / 2**20:.1f}"
    print(f"rank 0 host peak growth, weights read / whole resume: {mib}")
    assert full["weights_peak_bytes"] > 0.9 * weights  # the measurement sees a full load
    # its half of the weights and DCP's read buffers (measured: 60 MiB of 96, whole: 128)
    assert empty["weights_peak_bytes"] < 0.75 * weights
    assert empty["weights_peak_bytes"] < 0.6 * full["weights_peak_bytes"]
    # AdamW's state (2x the rank's share) comes after the weights in both: the same either way
    assert empty["resume_peak_bytes"] <= full["resume_peak_bytes"] * 1.05
