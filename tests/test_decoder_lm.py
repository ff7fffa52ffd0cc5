"""The module-free model: an HF Llama-family checkpoint loaded without transformers has HF's
names, weights and RoPE table, runs the lean and packed forwards as the HF model does, and
saves a checkpoint transformers loads; anything else is declined.

    .venv/bin/python -m pytest tests/test_decoder_lm.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from laminar.models.decoder_lm import DecoderLM, load_decoder_lm, load_model
from laminar.models.decoder_ops import rope_table, unsupported
from laminar.trainer.batch import TrainBatch
from laminar.trainer.micro_batch import collate
from laminar.trainer.packed import PackedForward, PackedLayout
from tests.test_engine_lean_forward import CASES, _model
from tests.test_trainer_packed import _packed_logp, _padded_logp, _trajs


def _saved(tmp_path, case: str):
    spec = dict(CASES[case])
    hf = _model(spec.pop("kind"), **spec)
    hf.save_pretrained(tmp_path / case)
    return hf, tmp_path / case


DENSE = [c for c in CASES if "moe" not in c and c != "mixtral"]
"""The module-free tree is dense-only: an MoE model keeps HF's modules (its experts module)."""


@pytest.mark.parametrize("case", DENSE)
def test_loads_as_hf_does_and_runs_the_same_forwards(tmp_path, case):
    hf, path = _saved(tmp_path, case)
    lm = load_decoder_lm(path)
    assert isinstance(lm, DecoderLM) and unsupported(lm, 64) is None
    want, got = hf.state_dict(), lm.state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)
    for a, b in zip(rope_table(lm, 64), rope_table(hf, 64), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert lm.get_input_embeddings().num_embeddings == hf.config.vocab_size
    ids = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 13, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():  # its own padded forward: HF's logits on every real position
        got_logits, want_logits = (
            lm(ids, mask).logits,
            hf(input_ids=ids, attention_mask=mask).logits,
        )
    torch.testing.assert_close(
        got_logits[mask.bool()], want_logits[mask.bool()], rtol=1e-5, atol=1e-5
    )
    # the trainer's packed forward, over the module-free model and the HF one's padded forward
    batch = TrainBatch.build(_trajs())
    idx = list(range(batch.n_seqs))
    mb = collate(batch, idx)
    mb.layout = PackedLayout.build(batch.samples)
    with torch.no_grad():
        torch.testing.assert_close(
            _packed_logp(PackedForward(lm), mb), _padded_logp(hf, mb), rtol=1e-5, atol=1e-5
        )


def test_saves_what_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    hf, path = _saved(tmp_path, "qwen3")
    lm = load_decoder_lm(path)
    assert lm is not None
    with torch.no_grad():
        lm.model.norm.weight.add_(0.5)  # a trained model: not the weights it was loaded with
    lm.save_pretrained(tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for name, t in lm.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], t, rtol=0, atol=0, msg=name)
    assert json.loads((tmp_path / "out/config.json").read_text())["model_type"] == "qwen3"
    # and a tied head is stored once, under the embedding's name, as transformers writes it
    tiny_hf, tiny = _saved(tmp_path, "llama")
    assert tiny_hf.config.tie_word_embeddings is False
    tied = _model("llama", tie_word_embeddings=True)
    tied.save_pretrained(tmp_path / "tied")
    lm = load_decoder_lm(tmp_path / "tied")
    assert lm is not None and lm.lm_head.weight is lm.model.embed_tokens.weight
    lm.save_pretrained(tmp_path / "tied-out")
    assert "lm_head.weight" not in load_file(tmp_path / "tied-out/model.safetensors")


def test_declines_what_it_cannot_load_exactly(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gpt2", vocab_size=40, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    )
    gpt2.save_pretrained(tmp_path / "gpt2")
    assert load_decoder_lm(tmp_path / "gpt2") is None
    assert (
        type(load_model(tmp_path / "gpt2")).__name__ == "GPT2LMHeadModel"
    )  # transformers loads it
    dyn = _model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    dyn.save_pretrained(tmp_path / "dynamic")
    assert load_decoder_lm(tmp_path / "dynamic") is None
    window = _model("mistral", sliding_window=16)
    window.save_pretrained(tmp_path / "window")
    assert load_decoder_lm(tmp_path / "window", max_len=64) is None
    assert load_decoder_lm(tmp_path / "window", max_len=16) is not None  # the window never binds
    _, path = _saved(tmp_path, "llama")
    extra = load_file(path / "model.safetensors")
    extra["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(
        64
    )  # a tensor the tree has no place for
    save_file(extra, path / "model.safetensors", metadata={"format": "pt"})
    assert load_decoder_lm(path) is None
    assert load_decoder_lm(tmp_path / "missing") is None
    assert type(load_model(path, module_free=False)).__name__ == "LlamaForCausalLM"


def test_a_rollout_engine_and_a_trainer_start_without_transformers(tmp_path):
    """The point of it all: a demo-sized model serves and trains with transformers never
    imported."""
    from laminar.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny", hidden=32, layers=2, heads=4, kv_heads=2)
    code = f"""
import sys, asyncio
import numpy as np
from laminar.config import config_from_dict
from laminar.engines.torch_engine import TorchEngine
from laminar.wiring.trainer import trainer_settings
from laminar.trainer.torch_trainer import TorchTrainer
from laminar.protocol.data import Trajectory
cfg = config_from_dict({{"run_dir": {str(tmp_path / "run")!r}, "model": {{"path": {str(path)!r}}},
                        "rollout": {{"max_running": 4, "max_model_len": 64}},
                        "trainer": {{"lr": 1e-3}}}})
engine = TorchEngine.from_config(cfg.rollout, cfg.model)
assert engine.lean is not None and engine.tokenizer.decode([5, 6]) != ""
pol = TorchTrainer(trainer_settings(cfg), {str(path)!r})
assert pol.model.packed is not None
trajs = [Trajectory(uid=f"g/{{i}}", group_id="g", prompt_uid="g", sample_index=i,
                    prompt_ids=np.array([5, 6, 7]), response_ids=np.array([8 + i, 9]),
                    logprobs=np.full(2, -2.0, np.float32), version=0,
                    reward=float(i % 2)) for i in range(4)]
before = pol.model.module.model.norm.weight.detach().clone()
pol.train_step(pol.prepare(trajs))
assert not bool((pol.model.module.model.norm.weight == before).all())
pol.save({str(tmp_path / "run")!r}, 1, {{}}, 1)
print(sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
    from transformers import AutoModelForCausalLM

    saved = next((tmp_path / "run/checkpoints").glob("step_*/model"))
    back = AutoModelForCausalLM.from_pretrained(saved)
    assert np.isfinite(back.model.norm.weight.detach().numpy()).all()


def test_import_prefetch_and_an_hf_load_at_once(tmp_path):
    """A node's import prefetch (laminar/launch/tuning.py) and an HF model load on another thread
    at the same moment: transformers' lazy module once handed the loader a half-built module (every
    rollout with rollout.torch_forward=hf died with "cannot import name AutoModelForCausalLM")."""
    from laminar.launch.tuning import heavy_imports
    from laminar.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny", hidden=32, layers=1, heads=2, kv_heads=1)
    code = f"""
from laminar.config import load_config
from laminar.launch.tuning import heavy_imports, prefetch_imports
from laminar.models.tiny import load_causal_lm, load_tokenizer
prefetch_imports(heavy_imports(load_config(None, ["rollout.torch_forward=hf"]), "rollout"))
print(type(load_causal_lm({str(path)!r})).__name__, type(load_tokenizer({str(path)!r})).__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "LlamaForCausalLM"
    from laminar.config import load_config

    # the lean forward's rollouts never import transformers at all
    assert not any(
        m.startswith("transformers") for m in heavy_imports(load_config(None, []), "rollout")
    )


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_moe_models_load_through_transformers(tmp_path, case):
    _, path = _saved(tmp_path, case)
    assert load_decoder_lm(path) is None
