"""FSDP2 across 2 CPU processes (gloo) on a tiny Qwen2-VL matches the single-process trainer.

    .venv/bin/python -m pytest tests/test_vlm_fsdp.py -q -m slow

Groups sampled here by the VLM engine (one image per prompt) are trained for two steps by
tests/fsdp_worker.py (vlm mode) on 2 ranks (each remakes its micro-batches' pixel inputs; the
tower stays in the root's FSDP unit) and again in this process: losses, gradient norms and the
gathered weights agree (to float tolerance), the frozen tower did not move, and the checkpoint
rank 0 gathered keeps the processor files.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from laminar.models.tiny_vlm import build_tiny_vlm, load_processor, load_vlm
from laminar.trainer.torch_trainer import TorchTrainer
from laminar.wiring.trainer import trainer_settings
from tests.fsdp_worker import vlm_cfg
from tests.test_trainer_fsdp import assert_steps_match
from tests.test_vlm_trainer import sampled_group

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_rank_fsdp_on_a_vlm_matches_one_process(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
        "torchrun"
    )
    if torchrun is None:
        pytest.skip("torchrun not found")
    model = str(build_tiny_vlm(tmp_path / "vlm", image_size=56))
    proc = load_processor(model)
    batches = []
    for seeds in ((1, 2), (3, 4)):
        trajs, images = [], {}
        for seed in seeds:
            t, im = sampled_group(model, proc, ("red", "blue", "green", "yellow")[seed % 4], seed)
            trajs += t
            images.update(im)
        batches.append((trajs, images))
    data = tmp_path / "batches.pkl"
    data.write_bytes(pickle.dumps(batches))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [torchrun, "--standalone", "--nproc_per_node", "2"]
    cmd += [str(ROOT / "tests" / "fsdp_worker.py"), model, str(out), "vlm", str(data)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    rank1 = "\n".join(line for line in run.stderr.splitlines() if "[rank1]" in line)
    assert run.returncode == 0, (rank1 or run.stderr)[-4000:]
    res = json.loads((out / "result.json").read_text())
    assert res["micro_batches"] >= 2
    ref = TorchTrainer(trainer_settings(vlm_cfg(model, tmp_path / "ref")), model)
    assert_steps_match(res, out, ref, batches)
    weights = torch.load(out / "weights.pt", weights_only=True)
    mine = ref.model.full_state_dict()
    base = load_vlm(model).state_dict()
    for k in mine:
        if ".visual." in f".{k}":  # model.freeze_vision: the tower never moved
            assert torch.equal(weights[k].float(), base[k].float()), k
    assert any(not torch.equal(weights[k], base[k]) for k in mine if "visual" not in k)
    ckpt = Path(res["checkpoint"]) / "model"
    for f in ("preprocessor_config.json", "processor_config.json", "tokenizer.json"):
        assert (ckpt / f).is_file(), f
