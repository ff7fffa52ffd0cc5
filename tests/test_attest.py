"""Attested versions: a rollout whose engine serves other weights than the trainer published is
caught before any of its trajectories at that version is trained on, quarantined, reloaded,
and counted (rollout status, laminar status, metrics.jsonl).

    .venv/bin/python -m pytest tests/test_attest.py -q

One process (inproc): manager, buffer, torch trainer, two torch rollouts on a tiny random model
(weights through run_dir/weights). rollout-0's engine gets one parameter corrupted right after
it loads its first version: what a faulty load path would leave behind.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from laminar.cluster import LocalCluster
from laminar.config import config_from_dict
from laminar.protocol.data import Trajectory
from laminar.tasks import countup
from laminar.trainer.attest import AttestBook
from laminar.weights.digest import weights_digest
from tests.sim_cluster import wait_for

STEPS = 24
"""Long enough that rollout-0 loads a trained version while the trainer runs: with 8, on a quiet
box the trainer once took all its steps from version 0's first batches (0.01 s a step) while
rollout-0, never empty, had not refreshed yet."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from laminar.models.tiny import build_tiny_model

    shape = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "max_positions": 128}
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", alphabet=countup.ALPHABET, **shape
    )


def _cfg(tmp: Path, model: Path):
    prompts = [countup.make_prompt(i % 7, 1 + i % 3, 30) for i in range(400)]
    data = tmp / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p, "answer": countup.answer_of(p)}) + "\n" for p in prompts)
    )
    return config_from_dict(
        {
            "name": "attest",
            "run_dir": str(tmp / "run"),
            "cluster": {
                "transport": "inproc",
                "roles": {"manager": 1, "buffer": 1, "trainer": 1, "rollout": 0},
            },
            "transport": {
                "heartbeat_interval_s": 0.3,
                "heartbeat_liveness": 20,
                "request_timeout_s": 2.0,
                "startup_timeout_s": 60.0,
                "stop_timeout_s": 5.0,
            },
            "logging": {"progress_every_s": 0},
            "model": {"path": str(model)},
            "data": {"train": str(data)},
            "reward": {"fn": "laminar.tasks.countup:reward", "workers": 0},
            "rollout": {
                "engine": "torch",
                "group_size": 2,
                "credits": 2,
                "max_running": 8,
                "weights": "dir",
                "prompt_retry_s": 0.05,
                "sampling": {"max_tokens": 12},
            },
            "trainer": {"engine": "torch", "total_steps": STEPS, "batch_groups": 2},
            "buffer": {"retry_after_s": 0.05},
        }
    )


def _corrupting_engine(cfg) -> tuple[Any, list[int]]:
    """A torch engine that, after its first weight load, adds 1.0 to one element of the token
    embedding (in the engine itself: the model the forward reads). Returns the engine and, once
    it happened, the version it corrupted."""
    from laminar.engines.torch_engine import TorchEngine

    engine = TorchEngine.from_config(cfg.rollout, cfg.model)
    corrupted: list[int] = []
    load = engine.load_weights

    async def load_then_corrupt(named_tensors, version: int) -> None:
        await load(named_tensors, version)
        if version > 0 and not corrupted:
            name = next(n for n in engine.loaded_names if "embed_tokens" in n)
            with torch.no_grad():
                engine.model.get_parameter(name).view(-1)[0] += 1.0
            corrupted.append(version)

    engine.load_weights = load_then_corrupt  # type: ignore[method-assign]
    return engine, corrupted


async def test_a_corrupted_parameter_is_caught_quarantined_reloaded_and_counted(
    tmp_path, tiny_model
):
    cfg = _cfg(tmp_path, tiny_model)
    engine, corrupted = _corrupting_engine(cfg)
    sent: list[Trajectory] = []
    async with LocalCluster(cfg) as cluster:
        r0 = await cluster.add("rollout", 0, engine=engine)
        put = r0.outbox.put

        def record(msg: Any) -> None:
            if isinstance(msg, Trajectory):
                sent.append(msg)
            put(msg)

        r0.outbox.put = record  # type: ignore[method-assign]
        await cluster.add("rollout", 1)
        await cluster.wait_trainer(300)
        trainer = cluster.node("trainer-0")
        book: AttestBook = trainer.attest
        assert len(corrupted) == 1, "rollout-0 loaded no trained version while the trainer ran"
        target = corrupted[0]
        expected = await book.digest(target)
        # the rollout compares digests when it next hears the trainer's (the trainer may finish
        # first on a busy machine): the count must reach its status
        await wait_for(lambda: r0.gate.mismatches >= 1, 60, "the mismatch counted", cluster)
        status = r0.status()
        # after the reload it serves the trainer's digest of its version; read the pair only
        # while no load is under way (a load in flight changes the weights before the version)
        latest, served_now, want_latest = -1, "", "x"
        for _ in range(600):  # <= 60 s: the rollout may still be loading the trainer's last push
            latest = r0.gate.version
            want_latest = await book.digest(latest)
            served_now = weights_digest(engine.served_weights())
            if served_now == want_latest and r0.gate.version == latest:
                break
            await asyncio.sleep(0.1)  # polling under the bound above

    assert expected and len(expected) == 32
    bad = [t for t in sent if t.version == target and t.weights_digest != expected]
    assert bad, "rollout-0 produced nothing on the corrupted weights: nothing was tested"
    assert all(t.weights_digest for t in sent if t.version > 0)  # every load attested

    # never trained: every bad uid that reached a batch is journaled as excluded for attestation
    audit = [json.loads(x) for x in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
    trained = {u for rec in audit for u in rec["uids"]}
    attest_excluded = {u for rec in audit for u in rec.get("attest_excluded", [])}
    bad_uids = {t.uid for t in bad}
    assert not bad_uids & trained
    assert attest_excluded <= bad_uids
    # the rollout saw the mismatch, was quarantined and reloaded: it serves the right weights
    assert r0.gate.mismatches >= 1 and status.attest_mismatches == r0.gate.mismatches
    assert r0.gate.quarantined == -1
    assert latest > 0 and served_now == want_latest
    # the counts in metrics.jsonl
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "attest/excluded_total" in r][-1]
    assert last["attest/excluded_total"] == len(attest_excluded)
    if attest_excluded:
        assert last["attest/mismatched_rollouts"] >= 1


class _Source:
    """A weights source offering one fixed version."""

    name = "fake"
    last_source = ""

    def __init__(self, version: int) -> None:
        self.version = version

    def latest_version(self) -> int:
        return self.version

    def announce(self, version: int) -> None:
        pass

    async def load_into(self, engine: Any) -> int:
        await engine.load_weights([("w", torch.ones(4))], self.version)
        return self.version


class _Engine:
    def __init__(self) -> None:
        self.version = 0
        self.w = torch.zeros(4)
        self.corrupt_next = True

    async def load_weights(self, named_tensors: Any, version: int) -> None:
        for _, t in named_tensors:
            self.w.copy_(t)
        if self.corrupt_next:
            self.w[0] += 1
            self.corrupt_next = False
        self.version = version

    def served_weights(self) -> list[tuple[str, Any]]:
        return [("w", self.w)]

    async def served_digest(self) -> str:
        return weights_digest(self.served_weights())


async def test_a_mismatch_at_the_running_version_quarantines_until_a_reload_matches():
    import structlog

    from laminar.metrics import Metrics
    from laminar.rollout.versions import VersionGate

    engine = _Engine()
    gate = VersionGate(
        _Source(3),  # type: ignore[arg-type]
        engine,  # type: ignore[arg-type]
        auto_refresh=True,
        refresh_wait_s=1.0,
        notify=(),
        metrics=Metrics(),
        log=structlog.get_logger(),
    )
    async with gate.lock:
        assert await gate.load()
    expected = {3: weights_digest([("w", torch.ones(4))])}
    assert gate.digest(3) != expected[3]
    assert not gate.behind()
    assert gate.attest(expected) and gate.quarantined == 3
    assert gate.behind() and gate.loadable() == 3  # the same version again
    assert not gate.attest(expected) and gate.mismatches == 1  # counted once
    async with gate.lock:
        assert await gate.load()
    assert gate.quarantined == -1 and gate.digest(3) == expected[3]
    assert not gate.attest(expected) and not gate.behind() and gate.mismatches == 1


# ---- vLLM's layout (laminar/engines/vllm_attest.py), without vLLM ---------------------------


class _Fused(torch.nn.Module):
    """A vLLM-style fused linear: the parts' rows stacked, their sizes in output_sizes."""

    def __init__(self, *parts: torch.Tensor, biases: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.cat(parts), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.cat(biases), requires_grad=False) if biases else None
        self.output_sizes = [p.shape[0] for p in parts]


def _vllm_shaped(hf: dict[str, torch.Tensor]) -> torch.nn.Module:
    """What vLLM builds from an HF checkpoint of one layer: q/k/v and gate/up fused, the
    embedding padded to 64 rows."""
    m = torch.nn.Module()
    m.packed_modules_mapping = {  # type: ignore[assignment]
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    m.model = torch.nn.Module()
    emb = hf["model.embed_tokens.weight"]
    m.model.embed_tokens = torch.nn.Module()
    m.model.embed_tokens.weight = torch.nn.Parameter(
        torch.cat([emb, emb.new_zeros(64 - emb.shape[0], emb.shape[1])]), requires_grad=False
    )
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    p = "model.layers.0."
    layer.self_attn.qkv_proj = _Fused(
        *(hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"),
        biases=tuple(hf[f"{p}self_attn.{x}_proj.bias"] for x in "qkv"),
    )
    layer.self_attn.o_proj = _Fused(hf[f"{p}self_attn.o_proj.weight"])
    layer.mlp.gate_up_proj = _Fused(*(hf[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up")))
    m.model.layers = torch.nn.ModuleList([layer])
    return m


def test_vllm_records_of_fused_padded_and_packed_weights_equal_the_trainers_digest():
    from laminar.engines.vllm_attest import (
        _row_block_folds,
        adapter_records,
        from_wire,
        weight_records,
    )
    from laminar.weights.digest import records_digest

    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (50, 8),
        "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.layers.0.self_attn.k_proj.weight": (4, 8),
        "model.layers.0.self_attn.v_proj.weight": (4, 8),
        "model.layers.0.self_attn.q_proj.bias": (8,),
        "model.layers.0.self_attn.k_proj.bias": (4,),
        "model.layers.0.self_attn.v_proj.bias": (4,),
        "model.layers.0.self_attn.o_proj.weight": (8, 8),
        "model.layers.0.mlp.gate_proj.weight": (16, 8),
        "model.layers.0.mlp.up_proj.weight": (16, 8),
    }
    hf = {n: torch.randn(s, generator=g).bfloat16() for n, s in shapes.items()}
    want = weights_digest(hf.items())
    wanted = [(n, list(t.shape)) for n, t in hf.items()]

    def digest(model: torch.nn.Module) -> str:
        return records_digest(from_wire(r) for r in weight_records(model, wanted))

    model = _vllm_shaped(hf)
    assert digest(model) == want
    # the CPU backend packs linear weights at load and leaves 0 elements (and on AMX turns a
    # bf16 bias into fp32): folded before that
    attn = model.model.layers[0].self_attn
    for lin in (attn.qkv_proj, attn.o_proj):
        lin._laminar_folds = _row_block_folds(lin)
        lin.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    attn.qkv_proj.bias.data = attn.qkv_proj.bias.float()
    assert digest(model) == want
    # one changed element of a served tensor, a k row, or a name vLLM does not hold: caught
    model.model.embed_tokens.weight.data[3, 1] += 1
    assert digest(model) != want
    model = _vllm_shaped(hf)
    model.model.layers[0].self_attn.qkv_proj.weight.data[9, 0] += 0.5  # k_proj's 2nd row
    assert digest(model) != want
    assert digest(_vllm_shaped(hf)) == want
    missing = weight_records(_vllm_shaped(hf), [("model.norm.weight", [8])])
    assert missing[0][1] == "missing"
    hf = {n: t.float() for n, t in hf.items()}  # fp32 from here on (the adapter's slots)

    # LoRA: an adapter's slot (rank-padded, q/k/v as slices of qkv_proj) read back as peft names
    class _Slot:
        def __init__(self, *outs: int) -> None:
            self.lora_a_stacked = tuple(torch.zeros(2, 1, 8, 8) for _ in outs)
            self.lora_b_stacked = tuple(torch.zeros(2, 1, o, 8) for o in outs)

    manager = torch.nn.Module()
    manager.model = _vllm_shaped(hf)
    qkv = _Slot(8, 4, 4)
    manager.modules = {"model.layers.0.self_attn.qkv_proj": qkv}  # type: ignore[assignment]
    manager.lora_index_to_id = [None, 7]
    a, b = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)  # rank 4, v_proj
    qkv.lora_a_stacked[2][1, 0, :4] = a
    qkv.lora_b_stacked[2][1, 0, :, :4] = b
    names = [f"base_model.model.model.layers.0.self_attn.v_proj.lora_{x}.weight" for x in "AB"]
    got = records_digest(from_wire(r) for r in adapter_records(manager, 7, names, 4))
    assert got == weights_digest(zip(names, (a, b), strict=True))
    assert adapter_records(manager, 3, names, 4)[0][1] == "missing"  # not in a slot
