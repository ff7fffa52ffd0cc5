"""Colocated placement's device release, measured (docs/colocated.md): the torch engine asleep holds
no KV pool, no fused copies and no weight storage, and serves the new version after waking; the
torch trainer's offload moves parameters and AdamW state out and back bit for bit; the vLLM engine
calls vLLM's documented sleep API (a fake: no vLLM here, and sleep mode needs CUDA).

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_colocate_engine.py -q
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fakes.vllm_fake import install

from laminar.config import LaminarConfig
from laminar.engines.base import GenRequest, SamplingParams
from laminar.engines.factory import make_engine
from laminar.engines.torch_engine import TorchEngine
from laminar.engines.vllm_engine import VllmEngine
from laminar.models.offload import HostStash, device_bytes
from laminar.tasks import countup


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from laminar.models.tiny import build_tiny_model

    shape = {"hidden": 32, "layers": 2, "heads": 2, "kv_heads": 1, "max_positions": 128}
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", alphabet=countup.ALPHABET, **shape
    )


def _engine(model: Path) -> TorchEngine:
    cfg = LaminarConfig()
    cfg.model.path = str(model)
    cfg.rollout.max_running = 4
    eng = make_engine(cfg.rollout, cfg.model)
    assert isinstance(eng, TorchEngine)
    return eng


async def _greedy(eng: TorchEngine, tag: str) -> list[int]:
    params = SamplingParams(max_tokens=6, temperature=0.0, seed=1)
    req = GenRequest(tag, np.array([3, 4, 5, 6], np.int32), params, n=1, version=eng.version)
    out: list[int] = []
    async for ev in eng.generate(req):
        out.extend(ev.token_ids.tolist())
    return out


async def test_torch_engine_asleep_holds_no_kv_no_weights_and_serves_the_new_version(tiny_model):
    eng = _engine(tiny_model)
    await eng.start()
    try:
        before = await _greedy(eng, "a")
        awake = eng.device_bytes()
        assert awake["weights"] > 0 and awake["kv"] > 0 and awake["host"] == 0
        new = [(n, p.detach() * 0.5) for n, p in eng.model.named_parameters()]
        slept = await eng.sleep()
        asleep = eng.device_bytes()
        # nothing of the engine's own on the device: the weights' storage is gone (in host memory),
        # the KV pool and the lean forward's fused copies are freed
        assert asleep == {"weights": 0, "kv": 0, "fused": 0, "host": awake["weights"]}
        assert slept.weight_bytes == awake["weights"] and slept.kv_bytes == awake["kv"]
        assert all(p.numel() == 0 for p in eng.model.parameters())
        assert not eng.cache.allocated and eng.stats().kv_use == 0.0
        # the new version (every weight scaled) is loaded after the wake and served
        with pytest.raises(ValueError):  # loading into a sleeping engine fails loudly
            await eng.load_weights([(n, torch.zeros(1)) for n, _ in new[:1]], 1)
        woke = await eng.wake_up()
        assert woke.weight_bytes == awake["weights"] and woke.kv_bytes == awake["kv"]
        assert eng.device_bytes() == awake
        assert await _greedy(eng, "b") == before  # the same weights came back
        host = {n: t.clone() for n, t in new}
        await eng.load_weights(list(host.items()), 1)
        served = dict(eng.served_weights() or [])
        assert eng.version == 1 and all(torch.equal(served[n], host[n]) for n in host)
        await _greedy(eng, "c")
    finally:
        await eng.close()


async def test_torch_engine_drop_sleep_frees_the_weights_with_no_host_copy_and_needs_a_load(
    tiny_model,
):
    """cluster.colocate.rollout_weights=drop: nothing of the weights is kept anywhere while
    asleep; the wake allocates them empty and no prompt runs until a whole version is loaded."""
    eng = _engine(tiny_model)
    await eng.start()
    try:
        before = await _greedy(eng, "a")
        awake = eng.device_bytes()
        version = [(n, p.detach().clone()) for n, p in eng.model.named_parameters()]
        slept = await eng.sleep(keep_weights=False)
        assert eng.device_bytes() == {"weights": 0, "kv": 0, "fused": 0, "host": 0}
        assert slept.weight_bytes == 0 and slept.kv_bytes == awake["kv"]
        assert slept.dropped_bytes == awake["weights"]
        woke = await eng.wake_up()
        assert woke.needs_load and woke.weight_bytes == 0 and woke.kv_bytes == awake["kv"]
        assert not eng.asleep
        prompt = np.array([3, 4], np.int32)
        with pytest.raises(RuntimeError, match="dropped"):  # never samples from garbage
            eng.submit(GenRequest("x", prompt, SamplingParams(max_tokens=2), n=1))
        with pytest.raises(RuntimeError, match="without values"):  # a part of a version
            await eng.load_weights(version[:1], 1)
        await eng.load_weights(version, 1)
        assert eng.version == 1 and eng.device_bytes() == awake
        assert await _greedy(eng, "b") == before  # the same values, loaded again
    finally:
        await eng.close()


async def test_torch_engine_refuses_to_sleep_with_sequences_in_flight(tiny_model):
    eng = _engine(tiny_model)
    eng.submit(GenRequest("x", np.array([3, 4], np.int32), SamplingParams(max_tokens=4), n=1))
    with pytest.raises(RuntimeError, match="in flight"):
        await eng.sleep()
    await eng.close()


def test_host_stash_round_trip_frees_and_restores_the_same_objects():
    a = torch.randn(64, 8)
    b = torch.nn.Parameter(torch.randn(16))
    values = (a.clone(), b.detach().clone())
    stash = HostStash()
    moved = stash.offload([a, b, b])  # b twice (tied): moved once
    assert moved.tensors == 2 and moved.nbytes == (64 * 8 + 16) * 4
    assert device_bytes([a, b]) == 0 and stash.nbytes == moved.nbytes
    back = stash.restore()
    assert back.nbytes == moved.nbytes and not stash.offloaded
    assert torch.equal(a, values[0]) and torch.equal(b.detach(), values[1])


def test_torch_trainer_offload_moves_params_and_adam_state_out_and_back(tiny_model):
    from laminar.protocol.data import Trajectory
    from laminar.trainer.torch_trainer import TorchTrainer
    from laminar.wiring.trainer import trainer_settings

    cfg = LaminarConfig()
    cfg.model.path = str(tiny_model)
    cfg.trainer.lr = 1e-2
    tr = TorchTrainer(trainer_settings(cfg), str(tiny_model))
    rng = np.random.default_rng(0)
    trajs = [
        Trajectory(
            uid=f"g{g}/{i}",
            group_id=f"g{g}",
            prompt_uid=f"p{g}",
            sample_index=i,
            rollout_id="r",
            version=0,
            prompt_ids=np.array([3, 4, 5], np.int32),
            response_ids=rng.integers(3, 10, 5).astype(np.int32),
            logprobs=np.full(5, -1.0, np.float32),
            reward=float(i),
        )
        for g in range(2)
        for i in range(2)
    ]
    tr.step(tr.prepare(trajs))  # AdamW has state now
    params = list(tr.model.module.parameters())
    state = [t for st in tr.optimizer.state.values() for t in st.values() if t.numel() > 1]
    snapshot = [t.detach().clone() for t in params + state]
    moved = tr.offload()
    assert tr.offloaded and device_bytes(params) == 0 and device_bytes(state) == 0
    assert moved.nbytes >= 3 * device_bytes(snapshot[: len(params)])  # params + exp_avg + sq
    back = tr.onload()
    assert back.nbytes == moved.nbytes
    assert all(torch.equal(t, s) for t, s in zip(params + state, snapshot, strict=True))
    tr.offload(params=True, optimizer=False)
    tr.step(tr.prepare(trajs))  # a step finds its state offloaded: it comes back first
    assert tr.auto_onloads == 1 and not tr.offloaded


async def test_vllm_engine_sleeps_and_wakes_through_the_documented_api(monkeypatch):
    fake = install(monkeypatch)
    cfg = LaminarConfig()
    cfg.rollout.engine = "vllm"
    cfg.model.path = "/models/tiny"
    eng = make_engine(cfg.rollout, cfg.model, sleep_mode=True)
    assert isinstance(eng, VllmEngine)
    await eng.start()
    try:
        assert fake.llm.args["enable_sleep_mode"] is True
        await eng.sleep()
        assert fake.llm.calls[-1] == ("sleep", 1) and fake.llm.sleeping == 1
        await eng.wake_up()
        assert fake.llm.calls[-1] == ("wake_up", None) and fake.llm.sleeping == 0
        await eng.wake_up()  # awake already: no second call
        assert [c for c in fake.llm.calls if c[0] == "wake_up"] == [("wake_up", None)]
        # rollout_weights=drop: level 2 discards the weights; the wake says a load must follow
        await eng.sleep(keep_weights=False)
        assert fake.llm.calls[-1] == ("sleep", 2) and fake.llm.sleeping == 2
        woke = await eng.wake_up()
        assert woke.needs_load and fake.llm.sleeping == 0
        assert not (await eng.wake_up()).needs_load
    finally:
        await eng.close()


async def test_vllm_engine_without_sleep_mode_refuses_to_sleep(monkeypatch):
    install(monkeypatch)
    cfg = LaminarConfig()
    cfg.rollout.engine = "vllm"
    cfg.model.path = "/models/tiny"
    eng = make_engine(cfg.rollout, cfg.model)
    await eng.start()
    try:
        with pytest.raises(RuntimeError, match="sleep_mode"):
            await eng.sleep()
    finally:
        await eng.close()
