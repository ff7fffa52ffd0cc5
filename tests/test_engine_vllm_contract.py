"""VllmEngine adapter logic on CPU against a fake `vllm` package (tests/fakes/vllm_fake.py).

    .venv/bin/python -m pytest tests/test_engine_vllm_contract.py -q

What the adapter must do with vLLM's API: engine args (processed logprobs, our
worker extension), per-sequence DELTA streams with the sampled token's logprob,
abort -> partial state, resume as prompt + partial with max_tokens reduced, weight
loads bracketed by pause(keep) ... reset_prefix_cache ... resume, and stats from
the stat logger. The real-vLLM counterpart is tests/test_engine_vllm_gpu.py.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch
from fakes.vllm_fake import EOS, RequestOutputKind, install

from laminar.config import LaminarConfig
from laminar.engines.base import GenRequest, SamplingParams, Structured
from laminar.engines.factory import make_engine
from laminar.engines.vllm_engine import VllmEngine, sampled_logprobs, structured_outputs
from laminar.engines.vllm_ext import LaminarWorkerExtension

PROMPT = np.array([5, 6, 7, 8, 9, 10], np.int32)
T = 10.0


@pytest.fixture
async def engine(monkeypatch):
    fake = install(monkeypatch)
    cfg = LaminarConfig()
    cfg.rollout.engine = "vllm"
    cfg.model.path = "/models/tiny"
    cfg.rollout.max_running = 3
    cfg.rollout.vllm_args = {"enforce_eager": True}
    eng = make_engine(cfg.rollout, cfg.model)
    assert isinstance(eng, VllmEngine)
    await eng.start()
    yield eng, fake
    await eng.close()


def reference(fake, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ctx, toks, lps = list(prompt), [], []
    for _ in range(n):
        t, lp = fake.llm.next_token(ctx)
        ctx.append(t)
        toks.append(t)
        lps.append(lp)
    return toks, lps


async def test_engine_args_and_sampling_params(engine):
    eng, fake = engine
    args = fake.llm.args
    assert args["model"] == "/models/tiny" and args["logprobs_mode"] == "processed_logprobs"
    assert args["worker_extension_cls"] == "laminar.engines.vllm_ext.LaminarWorkerExtension"
    assert (
        args["max_num_seqs"] == 3 and args["enforce_eager"] is True and args["dtype"] == "float32"
    )
    sp = eng._sampling_params(
        type(
            "S", (), {"params": SamplingParams(0.7, 0.9, 50, ("##",), (9,), 4), "seq_id": "g/1"}
        )(),
        20,
    )
    kw = sp.kw
    assert kw["logprobs"] == 0 and kw["output_kind"] is RequestOutputKind.DELTA and kw["n"] == 1
    assert kw["max_tokens"] == 30 and kw["temperature"] == 0.7 and kw["top_p"] == 0.9
    assert (
        kw["stop"] == ["##"]
        and kw["include_stop_str_in_output"]
        and kw["detokenize"]
        and kw["stop_token_ids"] == [9]
    )
    assert isinstance(kw["seed"], int) and kw["seed"] >= 0


async def test_structured_outputs_reach_vllm_as_its_documented_params(engine, monkeypatch):
    """An agent call's response_format (issue 47) goes to vLLM's structured outputs:
    SamplingParams(structured_outputs=StructuredOutputsParams(json=schema | json_object=True)).
    A turn resumed after tokens of its own goes on unconstrained (vLLM's grammar would start over
    mid-output). Checked against the fake only: no vLLM here."""
    eng, fake = engine
    assert eng.structured == {"json_object", "json_schema"}
    assert structured_outputs(Structured("json_schema", '{"type": "object"}')) == {
        "json": {"type": "object"}
    }
    assert structured_outputs(Structured("json_object")) == {"json_object": True}
    params = SamplingParams(
        max_tokens=8, structured=Structured("json_schema", '{"type": "object"}')
    )
    sp = eng._sampling_params(type("S", (), {"params": params, "seq_id": "g/0"})(), 0)
    assert sp.kw["structured_outputs"].kw == {"json": {"type": "object"}}
    plain = eng._sampling_params(type("S", (), {"params": SamplingParams(), "seq_id": "g/0"})(), 0)
    assert "structured_outputs" not in plain.kw
    eng.submit(GenRequest("fresh", PROMPT, params, single=True))
    mid = GenRequest("mid", PROMPT, params, resume_ids=np.array([3, 4], np.int32), single=True)
    mid.resume_logprobs = np.zeros(2, np.float32)
    eng.submit(mid)  # its turn began at response index 0: two of its own tokens are out
    after = GenRequest("next", PROMPT, params, resume_ids=np.array([3, 4], np.int32), single=True)
    after.resume_logprobs, after.turn_start = np.zeros(2, np.float32), 2  # a new turn
    eng.submit(after)
    kws = {eng._seqs[s].seq_id: eng._seqs[s].params.structured for s in ("fresh", "mid", "next")}
    assert kws == {"fresh": params.structured, "mid": None, "next": params.structured}
    await eng.abort(["fresh", "mid", "next"])


def test_a_vllm_without_structured_outputs_enforces_none(monkeypatch):
    import sys

    install(monkeypatch)
    monkeypatch.delattr(sys.modules["vllm.sampling_params"], "StructuredOutputsParams")
    from laminar.engines.vllm_engine import _import_vllm

    assert _import_vllm().StructuredOutputsParams is None


async def test_an_moe_policy_says_why_vllm_records_no_routes(monkeypatch, tmp_path, caplog):
    """A vLLM without a route return (no enable_return_routed_experts engine argument): the
    engine says so at start and trajectories carry no routes."""
    from laminar.engines.vllm_engine import _import_vllm, routes_note
    from laminar.models.tiny import build_tiny_model

    fake = install(monkeypatch)
    moe = build_tiny_model(tmp_path / "moe", hidden=32, layers=2, kind="moe", experts=8)
    dense = build_tiny_model(tmp_path / "dense", hidden=32, layers=2)
    cfg = LaminarConfig()
    cfg.rollout.engine, cfg.model.path = "vllm", str(moe)
    eng = make_engine(cfg.rollout, cfg.model)
    assert isinstance(eng, VllmEngine)
    with caplog.at_level("WARNING", logger="laminar.engines.vllm_engine"):
        await eng.start()
    try:
        assert eng.routes_note is not None and "has no route return" in eng.routes_note
        assert any("records no MoE routes" in r.getMessage() for r in caplog.records)
        assert eng.moe is None and not fake.llm.args.get("enable_return_routed_experts")
        evs = [
            ev
            async for ev in eng.generate(
                GenRequest("a", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)), T
            )
        ]
        assert evs[-1].finish_reason == "length" and all(e.routes is None for e in evs)
    finally:
        await eng.close()
    assert routes_note(str(dense), _import_vllm()) is None
    install(monkeypatch, route_return=True)
    assert routes_note(str(moe), _import_vllm()) is None  # it has one: start() reads it


def _moe_engine(monkeypatch, tmp_path, dense_first: bool = False, replay: bool = True):
    """A fake vLLM with the route return, an engine on a tiny MoE (8 experts, top-2, 2 layers;
    dense_first: layer 0's MLP dense, as DeepSeek-style models have)."""
    import json

    from laminar.models.tiny import build_tiny_model

    fake = install(monkeypatch, route_return=True)
    moe = build_tiny_model(tmp_path / "moe", hidden=32, layers=2, kind="moe", experts=8)
    if dense_first:
        cfg_path = moe / "config.json"
        c = json.loads(cfg_path.read_text())
        c["mlp_only_layers"] = [0]
        cfg_path.write_text(json.dumps(c))
    cfg = LaminarConfig()
    cfg.rollout.engine, cfg.model.path = "vllm", str(moe)
    cfg.model.moe.routing_replay = replay
    return fake, make_engine(cfg.rollout, cfg.model)


@pytest.mark.parametrize("dense_first", [False, True])
async def test_vllm_route_return_reaches_the_events(monkeypatch, tmp_path, dense_first):
    """vLLM's route return ((prompt + generated - 1, num_hidden_layers, k) int32, on the final
    output only) becomes the final event's routes: positions 0 .. of prompt + response, the
    policy's routed layers, its route dtype; a resumed request's return covers the resumed
    tokens too, with the same rows."""
    from fakes.vllm_fake import fake_routes

    fake, eng = _moe_engine(monkeypatch, tmp_path, dense_first)
    await eng.start()
    try:
        assert eng.routes_note is None and eng.moe is not None
        assert fake.llm.args["enable_return_routed_experts"] is True
        layers = list(eng.moe.layers)
        assert layers == ([1] if dense_first else [0, 1])
        evs = [
            ev
            async for ev in eng.generate(
                GenRequest("a", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True)), T
            )
        ]
        assert all(e.routes is None for e in evs[:-1])  # vLLM returns them once, at the end
        last = evs[-1]
        out = np.concatenate([e.token_ids for e in evs]).tolist()
        want = fake_routes(PROMPT.tolist() + out, 2, 2, 8)[:, layers]
        assert last.finish_reason == "length" and last.route_start == 0
        assert last.routes is not None and last.routes.dtype == np.uint8
        assert last.routes.shape == (len(PROMPT) + 6 - 1, len(layers), 2)
        np.testing.assert_array_equal(last.routes, want)
        assert eng.moe.check(last.routes, len(PROMPT) + 6) is None  # what the buffer checks

        # resume: the new request's prompt is prompt + resumed; its return covers both
        req = GenRequest(
            "b",
            PROMPT,
            SamplingParams(max_tokens=6, ignore_eos=True),
            resume_ids=np.array(out[:3], np.int32),
        )
        req.resume_logprobs = np.zeros(3, np.float32)
        evs = [ev async for ev in eng.generate(req, T)]
        np.testing.assert_array_equal(evs[-1].routes, want)
        assert eng.route_counts == {"routes_refused": 0, "routes_missing": 0}
    finally:
        await eng.close()


@pytest.mark.parametrize("bug", ["rows", "layers", "ids", "none"])
async def test_a_bad_vllm_route_return_is_refused_and_counted(monkeypatch, tmp_path, bug):
    """A return of the wrong length, layer count or ids (or none at all) is not handed on: the
    sequence finishes normally without routes (the trainer routes it live), counted and logged;
    the engine keeps serving."""
    fake, eng = _moe_engine(monkeypatch, tmp_path)
    await eng.start()
    try:
        fake.llm.route_bug = bug
        evs = [
            ev
            async for ev in eng.generate(
                GenRequest("a", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)), T
            )
        ]
        assert evs[-1].finish_reason == "length" and all(e.routes is None for e in evs)
        key = "routes_missing" if bug == "none" else "routes_refused"
        assert eng.route_counts[key] == 1 and sum(eng.route_counts.values()) == 1
        fake.llm.route_bug = None
        evs = [
            ev
            async for ev in eng.generate(
                GenRequest("b", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)), T
            )
        ]
        assert evs[-1].routes is not None
    finally:
        await eng.close()


async def test_aborted_and_replay_off_carry_no_vllm_routes(monkeypatch, tmp_path):
    """An abort's final output has no route return in vLLM: the partial carries none and
    nothing is counted; model.moe.routing_replay false: the argument is not passed."""
    fake, eng = _moe_engine(monkeypatch, tmp_path)
    await eng.start()
    try:
        fake.llm.step_s = 0.05
        eng.submit(
            GenRequest("a", PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), single=True)
        )
        first = await eng.next_event(T)
        assert first.routes is None and first.finish_reason is None
        parts = await eng.abort(["a"])
        assert len(parts) == 1 and sum(eng.route_counts.values()) == 0
    finally:
        await eng.close()
    fake, eng = _moe_engine(monkeypatch, tmp_path / "off", replay=False)
    await eng.start()
    try:
        assert eng.moe is None and not fake.llm.args.get("enable_return_routed_experts")
        assert eng.routes_note is not None and "routing_replay is off" in eng.routes_note
    finally:
        await eng.close()


async def test_generate_streams_tokens_and_sampled_logprobs(engine):
    eng, fake = engine
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    events = []
    async for ev in eng.generate(GenRequest("g", PROMPT, params, n=2), timeout=T):
        events.append(ev)
        assert len(ev.token_ids) <= 1  # one delta per step
    want_ids, want_lps = reference(fake, PROMPT.tolist(), 12)
    for sid in ("g/0", "g/1"):
        evs = [e for e in events if e.seq_id == sid]
        assert evs[-1].finish_reason == "length" and all(e.finish_reason is None for e in evs[:-1])
        assert np.concatenate([e.token_ids for e in evs]).tolist() == want_ids
        np.testing.assert_allclose(np.concatenate([e.logprobs for e in evs]), want_lps, rtol=1e-6)
    # each sequence is its own vLLM request with a unique id
    assert len(set(fake.llm.order)) == 0 and eng.stats().running == 0


async def test_stop_reason_and_eos(engine):
    eng, fake = engine
    ids, _ = reference(fake, PROMPT.tolist(), 40)
    k = next(i for i, t in enumerate(ids) if t != EOS)
    res = await eng.generate_all(
        GenRequest(
            "s", PROMPT, SamplingParams(max_tokens=40, stop_token_ids=(ids[k],)), single=True
        ),
        timeout=T,
    )
    got, lps, reason = res["s"]
    assert reason == "stop" and got[-1] == ids[k] and len(got) == len(lps) == k + 1


async def test_abort_returns_partial_and_resume_continues(engine):
    eng, fake = engine
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    eng.submit(GenRequest("x", PROMPT, params, n=2))
    streamed = {"x/0": [], "x/1": []}
    while min(map(len, streamed.values())) < 5:
        ev = await eng.next_event(T)
        streamed[ev.seq_id].extend(ev.token_ids.tolist())
    parts = await eng.abort(["x/1", "x/0", "missing"])
    assert [p.seq_id for p in parts] == ["x/1", "x/0"]
    final = {}
    while len(final) < 2:
        ev = await eng.next_event(T)
        assert ev.seq_id not in final, "event after the final abort"
        streamed[ev.seq_id].extend(ev.token_ids.tolist())
        if ev.finished:
            assert ev.finish_reason == "abort" and len(ev.token_ids) == 0
            final[ev.seq_id] = ev
    want, want_lps = reference(fake, PROMPT.tolist(), 60)
    for p in parts:
        assert p.output_ids.tolist() == streamed[p.seq_id] == want[: len(p.output_ids)]
        np.testing.assert_allclose(p.logprobs, want_lps[: len(p.output_ids)], rtol=1e-6)
        assert p.prompt_ids.tolist() == PROMPT.tolist() and 5 <= len(p.output_ids) < 60
    # resume: prompt + partial is the new prompt, max_tokens reduced by what is done
    before = set(fake.llm.requests)
    eng.submit(GenRequest.resume(parts[0], params))
    ev = await eng.next_event(T)
    (rid,) = set(fake.llm.requests) - before
    req = fake.llm.requests[rid]
    n_done = len(parts[0].output_ids)
    assert req.sp.max_tokens == 60 - n_done and rid.startswith("x/1#")
    rest = ev.token_ids.tolist()
    while not ev.finished:
        ev = await eng.next_event(T)
        rest.extend(ev.token_ids.tolist())
    assert ev.finish_reason == "length" and parts[0].output_ids.tolist() + rest == want
    # aborting a finished sequence gives nothing back
    assert await eng.abort(["x/1"]) == []


async def test_abort_with_history_repeating_final_delta(engine):
    eng, fake = engine
    fake.llm.p12_bug = True  # vLLM <= 0.28: the final abort delta carries every logprob again
    eng.submit(
        GenRequest("h", PROMPT, SamplingParams(max_tokens=100, ignore_eos=True), single=True)
    )
    n = 0
    while n < 4:
        n += len((await eng.next_event(T)).token_ids)
    (p,) = await eng.abort(["h"])
    assert len(p.output_ids) == len(p.logprobs) >= 4


def test_sampled_logprobs_indexes_by_sampled_id():
    from fakes.vllm_fake import Logprob

    entries = [{3: Logprob(-0.5), 4: Logprob(-0.1)}, {7: Logprob(-2.0), 3: Logprob(-0.3)}]
    assert sampled_logprobs([3, 7], entries) == [-0.5, -2.0]
    assert sampled_logprobs([7], entries) == [
        -2.0
    ]  # history repeated: the last entries are the new ones
    assert sampled_logprobs([], entries) == []
    assert np.isnan(sampled_logprobs([1], None)).all()


async def test_load_weights_pauses_rpcs_resets_prefix_cache(engine):
    eng, fake = engine
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    before = (await eng.generate_all(GenRequest("a", PROMPT, params, single=True), timeout=T))["a"][
        0
    ]
    weights = {
        "model.embed_tokens.weight": torch.ones(4, 2),
        "lm_head.weight": None,
        "x": np.full(3, 0.5, np.float32),
    }
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied: shared storage
    await eng.load_weights(weights.items(), version=7)
    kinds = [c[0] for c in fake.llm.calls]
    assert kinds == ["pause", "rpc", "reset_prefix_cache", "resume"]
    assert fake.llm.calls[0] == ("pause", "keep", True)
    # plain tensors (no shared file under them) are staged once into /dev/shm, then unlinked
    method, (spans,) = fake.llm.calls[1][1], fake.llm.calls[1][2]
    assert method == "laminar_load_spans" and [s[0] for s in spans] == list(weights)
    assert len({s[3] for s in spans}) == 1 and not os.path.exists(spans[0][3])
    assert eng.last_load["path"] == "staged" and eng.last_load["tensors"] == 3
    assert eng.last_load["bytes"] == 4 * 2 * 4 + 4 * 2 * 4 + 3 * 4
    assert fake.llm.salt == 17.5 and not fake.llm.paused
    after = []
    async for ev in eng.generate(GenRequest("a", PROMPT, params, single=True), timeout=T):
        assert ev.version == 7
        after.extend(ev.token_ids.tolist())
    assert after != before.tolist() and eng.stats().version == 7


async def test_served_digest_asks_the_workers_for_what_they_serve(engine):
    """Attestation: the digest comes from fold records the worker computes over what it holds
    (names and shapes of the last load), equal to the digest of the version; a worker holding
    other values gives another digest; a dtype the version does not have: not attested."""
    from laminar.weights.digest import weights_digest

    eng, fake = engine
    assert await eng.served_digest() is None  # version 0: nothing loaded, nothing to attest
    weights = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}
    await eng.load_weights(weights.items(), version=2)
    assert await eng.served_digest() == weights_digest(weights.items())
    (wanted,) = fake.llm.calls[-1][2]
    assert fake.llm.calls[-1][1] == "laminar_weight_folds" and wanted == [
        ("w", [2, 3]),
        ("b", [5]),
    ]
    fake.llm.weights["w"][1, 2] += 1
    assert await eng.served_digest() not in (None, weights_digest(weights.items()))
    fake.llm.weights["w"] = weights["w"].double()  # served in float64: cannot equal float32
    assert await eng.served_digest() is None


async def test_load_weights_from_shared_memory_passes_spans_without_copies(engine, tmp_path):
    """Tensors that view a shared file mapping (the relay's segment) go to the worker as spans of
    that very file: no staging file, no serialised bytes."""
    import mmap

    eng, fake = engine
    src = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.full((5,), 2.0, dtype=torch.bfloat16),
    }
    seg = tmp_path / "segment"
    raw = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in src.values())
    seg.write_bytes(raw + b"\0" * (4096 - len(raw)))
    fd = os.open(seg, os.O_RDONLY)
    mm = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    os.close(fd)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        a = (
            torch.frombuffer(mm, dtype=torch.uint8, count=24, offset=0)
            .view(torch.float32)
            .reshape(2, 3)
        )
        b = torch.frombuffer(mm, dtype=torch.uint8, count=10, offset=24).view(torch.bfloat16)
    await eng.load_weights([("a", a), ("b", b)], version=3)
    (spans,) = fake.llm.calls[1][2]
    assert spans == [
        ("a", "float32", [2, 3], str(seg), 0, 24),
        ("b", "bfloat16", [5], str(seg), 24, 10),
    ]
    assert eng.last_load["path"] == "shared" and seg.exists()
    assert fake.llm.salt == round(float(sum(t.double().sum() for t in src.values())), 6)
    del a, b


async def test_stats_from_stat_logger(engine):
    eng, fake = engine
    assert eng.stats().running == 0 and eng.stats().kv_use == 0.0
    eng.submit(GenRequest("q", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True), n=5))
    await eng.next_event(T)
    await eng.next_event(T)  # at least one full step logged after all 5 were added
    st = eng.stats()
    assert st.running == 3 and st.waiting == 2 and 0 < st.kv_use <= 1
    parts = await eng.abort([f"q/{i}" for i in range(5)])
    assert len(parts) == 5 and eng.stats().running == 0 and eng.stats().tokens_generated > 0


async def test_engine_errors_become_error_events(engine):
    eng, fake = engine
    fake.llm.fail_next = True
    res = await eng.generate_all(
        GenRequest("e", PROMPT, SamplingParams(max_tokens=5), single=True), timeout=T
    )
    assert res["e"][2] == "error"
    res = await eng.generate_all(
        GenRequest("z", np.array([], np.int32), SamplingParams(max_tokens=5), single=True),
        timeout=T,
    )
    assert res["z"][2] == "error"
    # resumed at its cap: finishes at once without a request
    req = GenRequest(
        "c",
        PROMPT,
        SamplingParams(max_tokens=3),
        resume_ids=np.array([1, 2, 3], np.int32),
        single=True,
    )
    res = await eng.generate_all(req, timeout=T)
    assert res["c"][2] == "length" and len(res["c"][0]) == 0


def test_worker_extension_loads_through_reload_weights(tmp_path):
    import safetensors.torch

    from laminar.engines.vllm_engine import spans_file

    blob = safetensors.torch.save({"a": torch.ones(2), "b": torch.zeros(3)})

    class Worker(LaminarWorkerExtension):  # vLLM's layerwise reload on the worker
        def reload_weights(self, weights_iterator=None, is_checkpoint_format=True):
            self.got = {k: v.clone() for k, v in weights_iterator}

    w = Worker()
    assert w.laminar_load_weights(blob) == 2 and set(w.got) == {"a", "b"}
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(blob)
        f.flush()
        w2 = Worker()
        assert w2.laminar_load_weights(path=f.name) == 2 and set(w2.got) == {"a", "b"}
    with pytest.raises(ValueError):
        w.laminar_load_weights()
    # spans: views of a shared file, dtypes and shapes kept (a zero-size tensor too)
    spans: list = []
    src = [
        ("x", torch.arange(12, dtype=torch.int32).reshape(3, 4)),
        ("e", torch.zeros(0)),
        ("h", torch.tensor([1.5, -2.0], dtype=torch.float16)),
    ]
    path = spans_file(src, spans)
    try:
        w3 = Worker()
        assert w3.laminar_load_spans(spans) == 3
        for name, t in src:
            assert w3.got[name].dtype == t.dtype and torch.equal(w3.got[name], t)
    finally:
        os.unlink(path)


def test_missing_vllm_is_a_clear_error(monkeypatch):
    import asyncio
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)
    eng = VllmEngine("/models/tiny")
    with pytest.raises(RuntimeError, match="needs vllm installed"):
        asyncio.run(eng.start())


def test_vllm_config_validates_and_reaches_the_engine():
    """rollout.vllm (issue 19): bounds checked at load, each setting lands in vLLM's engine args
    or the EngineCore's environment; rollout.vllm_args still overrides."""
    from laminar.config import ConfigError, config_from_dict

    cfg = config_from_dict(
        {
            "model": {"path": "/models/tiny", "dtype": "bfloat16", "device": "cuda"},
            "rollout": {
                "engine": "vllm",
                "max_running": 8,
                "engine_start_timeout_s": 120,
                "vllm": {
                    "gpu_memory_utilization": 0.4,
                    "max_num_seqs": 64,
                    "enable_prefix_caching": False,
                    "dtype": "float16",
                    "cpu_kvcache_space_gib": 2.5,
                },
                "vllm_args": {"enforce_eager": True, "enable_prefix_caching": True},
            },
        }
    )
    eng = VllmEngine.from_config(cfg.rollout, cfg.model, env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    assert eng.dtype == "float16" and eng.max_running == 64
    assert eng.engine_args == {
        "enable_prefix_caching": True,
        "gpu_memory_utilization": 0.4,
        "enforce_eager": True,
    }
    assert eng.env == {"VLLM_CPU_KVCACHE_SPACE": "2.5", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert cfg.rollout.engine_start_timeout_s == 120
    # defaults: model.dtype, rollout.max_running, no GPU share on a CPU device, vLLM's own KV space
    plain_cfg = config_from_dict({"model": {"path": "/m"}, "rollout": {"engine": "vllm"}})
    plain = VllmEngine.from_config(plain_cfg.rollout, plain_cfg.model)
    assert plain.dtype == "float32" and plain.max_running == 32 and plain.env == {}
    assert plain.engine_args == {"enable_prefix_caching": True}
    for bad in (
        {"gpu_memory_utilization": 1.5},
        {"max_num_seqs": 0},
        {"cpu_kvcache_space_gib": 0},
        {"dtype": "int8"},
        {"typo": 1},
    ):
        with pytest.raises(ConfigError, match="rollout.vllm"):
            config_from_dict({"rollout": {"vllm": bad}})
    with pytest.raises(ConfigError, match="engine_start_timeout_s"):
        config_from_dict({"rollout": {"engine_start_timeout_s": 0}})


IMG = 99  # the image placeholder id (outside the fake's vocabulary: never sampled)


def _png(colour: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


async def test_a_vlm_request_carries_its_images_as_multi_modal_data(monkeypatch):
    """Expanded placeholder runs go to vLLM as one token per image (vLLM expands token prompts
    itself), the images as PIL images in placeholder order, for every sample of the group and
    again on resume; a request whose placeholders and images do not pair up ends in "error"
    and the engine goes on."""
    fake = install(monkeypatch)
    eng = VllmEngine("/models/tiny-vl", engine_args={"enforce_eager": True}, image_token_id=IMG)
    await eng.start()
    try:
        red, blue = _png((200, 0, 0), (28, 56)), _png((0, 0, 200), (56, 28))
        prompt = np.array([5, 6, IMG, IMG, IMG, IMG, 7, IMG, IMG, 8], np.int32)
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        eng.submit(GenRequest("v", prompt, params, n=2, images=(red, blue)))
        streamed: dict[str, list[int]] = {"v/0": [], "v/1": []}
        while min(map(len, streamed.values())) < 3:
            ev = await eng.next_event(T)
            streamed[ev.seq_id].extend(ev.token_ids.tolist())
        sent = list(fake.llm.prompts.values())
        assert len(sent) == 2
        for p in sent:
            assert p["prompt_token_ids"] == [5, 6, IMG, 7, IMG, 8]
            imgs = p["multi_modal_data"]["image"]
            assert [(im.mode, im.size) for im in imgs] == [("RGB", (28, 56)), ("RGB", (56, 28))]
            assert imgs[0].getpixel((0, 0)) == (200, 0, 0)
        parts = await eng.abort(["v/0"])
        assert parts[0].images == (red, blue) and parts[0].prompt_ids.tolist() == prompt.tolist()
        while True:  # the aborted sequence's last event
            ev = await eng.next_event(T)
            if ev.seq_id == "v/0" and ev.finished:
                break
        before = set(fake.llm.prompts)
        eng.submit(GenRequest.resume(parts[0], params))
        finished: set[str] = set()
        while finished != {"v/0", "v/1"}:
            ev = await eng.next_event(T)
            if ev.finished:
                assert ev.finish_reason == "length"
                finished.add(ev.seq_id)
        (rid,) = set(fake.llm.prompts) - before
        again = fake.llm.prompts[rid]
        done = parts[0].output_ids.tolist()
        assert again["prompt_token_ids"] == [5, 6, IMG, 7, IMG, 8] + done
        assert len(again["multi_modal_data"]["image"]) == 2
        # placeholders without images, images without placeholders: refused per request
        for k, (ids, images) in enumerate([(prompt, ()), (PROMPT, (red,)), (prompt, (red,))]):
            got = await eng.generate_all(
                GenRequest(f"bad{k}", ids, params, single=True, images=images), timeout=T
            )
            assert got[f"bad{k}"][2] == "error"
        # a text prompt on the same engine still runs, without multi_modal_data
        got = await eng.generate_all(GenRequest("t", PROMPT, params, single=True), timeout=T)
        assert got["t"][2] == "length"
        (text,) = [p for r, p in fake.llm.prompts.items() if r.startswith("t#")]
        assert "multi_modal_data" not in text
        assert not any(r.startswith("bad") for r in fake.llm.prompts)  # never reached vLLM
    finally:
        await eng.close()


def test_vllm_prompt_without_images_is_the_token_prompt(monkeypatch):
    from laminar.engines.vllm_engine import vllm_prompt

    fake = install(monkeypatch)
    import vllm

    del fake
    assert vllm_prompt(vllm, PROMPT, [3], (), None) == {"prompt_token_ids": PROMPT.tolist() + [3]}
    with pytest.raises(ValueError, match="text-only"):
        vllm_prompt(vllm, PROMPT, [], (b"x",), None)


def test_vllm_prompt_collapses_a_later_turns_image_run_in_the_resumed_tokens(monkeypatch):
    """An environment's screenshot after the model's first turn: its expanded run in the resumed
    tokens goes to vLLM as one placeholder, its image after the prompt's; a placeholder the model
    sampled makes one run too many and is refused."""
    from laminar.engines.vllm_engine import vllm_prompt

    install(monkeypatch)
    import vllm

    red, blue = _png((200, 0, 0), (28, 28)), _png((0, 0, 200), (28, 28))
    prompt = np.array([5, IMG, IMG, IMG, IMG, 6], np.int32)
    out = [11, 12, 7, IMG, IMG, IMG, IMG, 8, 13]
    p = vllm_prompt(vllm, prompt, out, (red, blue), IMG)
    assert p["prompt_token_ids"] == [5, IMG, 6, 11, 12, 7, IMG, 8, 13]
    assert [im.getpixel((0, 0)) for im in p["multi_modal_data"]["image"]] == [
        (200, 0, 0),
        (0, 0, 200),
    ]
    with pytest.raises(ValueError, match="3 image placeholder run"):
        vllm_prompt(vllm, prompt, [*out, IMG], (red, blue), IMG)
