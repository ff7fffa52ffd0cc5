"""Mixture-of-Experts policies and rollout routing replay (R3): the torch engine records each
token's experts, the routes travel with the trajectory (export/import, multi-turn, the wire) and
are checked at the buffer, and the trainer's packed forward replays them.

    .venv/bin/python -m pytest tests/test_moe.py -q

Every model is the tiny Qwen3-MoE built locally (models/tiny.py kind moe, random weights).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from laminar.buffer.experience import ExperienceState
from laminar.buffer.owners import SampleLimits
from laminar.engines.base import GenRequest, PartialState, SamplingParams, TokenEvent
from laminar.engines.torch_engine import TorchEngine
from laminar.message import ProtocolError
from laminar.models.moe import MoeShape
from laminar.models.tiny import build_tiny_model, load_causal_lm
from laminar.modes import Admission
from laminar.protocol.data import PartialTrajectory, PromptItem, Trajectory
from laminar.rollout.tracking import SeqState
from laminar.trainer.batch import TrainBatch
from laminar.trainer.packed import PackedForward, PackedLayout
from laminar.transport.codec import decode, encode

EXPERTS = 8


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("moe") / "m", hidden=32, layers=2, kind="moe", experts=EXPERTS
    )


def _rollout(model, prompts, max_tokens=12, forward="auto", seed=3):
    """Run the engine; {seq_id: (prompt, response, logprobs, routes as the rollout keeps them)}."""

    async def go():
        eng = TorchEngine(model, None, max_running=8, max_model_len=64, forward=forward)
        await eng.start()
        out = {}
        try:
            for g, prompt in enumerate(prompts):
                item = PromptItem(f"p{g}", f"g{g}", np.asarray(prompt, np.int32), 2)
                seqs = {f"g{g}/{i}": SeqState.from_item(item, i, 0, 0.0) for i in range(2)}
                req = GenRequest(
                    f"g{g}",
                    item.prompt_ids,
                    SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True),
                    n=2,
                )
                async for ev in eng.generate(req, 60):
                    s = seqs[ev.seq_id]
                    s.append(ev.token_ids, ev.logprobs, 0.0)
                    if ev.routes is not None:
                        assert s.add_routes(ev.route_start, ev.routes)
                for sid, s in seqs.items():
                    out[sid] = s.trajectory("length", "r0", 0.0)
        finally:
            await eng.close()
        return out

    return asyncio.run(go())


def test_engine_records_routes_lean_and_hf_alike(moe_path):
    model = load_causal_lm(moe_path)
    lean = _rollout(model, [[1, 5, 6, 7, 8]], forward="auto")
    hf = _rollout(load_causal_lm(moe_path), [[1, 5, 6, 7, 8]], forward="hf")
    for sid, t in lean.items():
        r = t.routes
        assert r is not None and r.dtype == np.uint8
        # every position the engine fed: the prompt's prefill and each response token but the last
        assert r.shape == (len(t.prompt_ids) + len(t.response_ids) - 1, 2, 2)
        assert int(r.max()) < EXPERTS
        np.testing.assert_array_equal(t.response_ids, hf[sid].response_ids)
        np.testing.assert_array_equal(r, hf[sid].routes)


def _perturbed(path, scale=0.03, seed=1):
    """The same policy with its router weights nudged: the trainer's top-k differs somewhere."""
    m = load_causal_lm(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in m.model.layers:
            w = layer.mlp.gate.weight
            w.add_(scale * w.abs().mean() * torch.randn(w.shape, generator=g))
    return m


def _batch(trajs):
    for t in trajs:
        t.reward = 1.0
    return TrainBatch.build(trajs)


def test_replay_forces_the_recorded_selection(moe_path):
    rolled = _rollout(load_causal_lm(moe_path), [[1, 5, 6, 7, 8], [1, 9, 9, 4]], max_tokens=16)
    batch = _batch(list(rolled.values()))
    model = _perturbed(moe_path)
    fwd = PackedForward(model)
    live = PackedLayout.build(batch.samples)  # no moe shape: routes live
    fwd.hidden(live)
    live_routes = torch.stack(fwd.live_routes, 1)
    lay = PackedLayout.build(batch.samples, moe=fwd.moe)
    assert lay.routes is not None and lay.routed is not None
    differs = (live_routes[lay.routed] != lay.routes[lay.routed]).any(-1).any(-1)
    assert differs.any(), "the perturbation should flip some token's experts"
    h = fwd.hidden(lay)
    replayed = torch.stack(fwd.live_routes, 1)
    assert torch.equal(replayed[lay.routed], lay.routes[lay.routed])
    # the last response token of each sample has no route: it routes live
    assert (~lay.routed).sum() == len(batch.samples)
    assert torch.equal(replayed[~lay.routed], live_routes[~lay.routed])
    # the router still learns: gradients reach every MoE layer's router through the gate weights
    h.square().sum().backward()
    for layer in model.model.layers:
        g = layer.mlp.gate.weight.grad
        assert g is not None and g.abs().sum() > 0


def test_replay_under_activation_checkpointing(moe_path):
    rolled = _rollout(load_causal_lm(moe_path), [[1, 5, 6, 7, 8]], max_tokens=10)
    batch = _batch(list(rolled.values()))
    grads = []
    for ckpt in (False, True):
        model = _perturbed(moe_path)
        fwd = PackedForward(model)
        lay = PackedLayout.build(batch.samples, moe=fwd.moe)
        fwd.hidden(lay, checkpoint=ckpt).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-6, msg=n)


def test_routes_survive_export_import_on_the_wire(moe_path):
    t = next(iter(_rollout(load_causal_lm(moe_path), [[1, 5, 6, 7, 8]]).values()))
    seq = SeqState(t.uid, t.group_id, t.prompt_uid, 0, 2, t.prompt_ids, 0, routes=None)
    seq.append(t.response_ids, t.logprobs, 0.0)
    assert seq.add_routes(0, t.routes)
    part = seq.partial(seq.ids.copy(), seq.logprobs.copy(), "r0")
    back = decode(encode(part))
    assert isinstance(back, PartialTrajectory)
    np.testing.assert_array_equal(back.routes, t.routes)
    assert back.routes.dtype == np.uint8
    resumed = SeqState.from_partial(back, 0.0)
    # the importer's prefill records every position again: the recorded ones are kept
    fresh = np.full((len(t.routes) + 1, 2, 2), 7, np.uint8)
    assert resumed.add_routes(0, fresh)
    got = resumed.trajectory("stop", "r1", 0.0).routes
    np.testing.assert_array_equal(got[: len(t.routes)], t.routes)
    assert (got[len(t.routes) :] == 7).all()
    traj = decode(encode(resumed.trajectory("stop", "r1", 0.0)))
    np.testing.assert_array_equal(traj.routes, got)


def test_multi_turn_appends_routes_of_the_shared_prefix(moe_path):
    """Turn 2 is submitted with every token so far (the env's included): its prefill brings routes
    of the whole prefix, of which only the positions turn 1 never fed (its last token, the env's
    answer) are appended."""
    model = load_causal_lm(moe_path)
    item = PromptItem("p", "g", np.array([1, 5, 6, 7], np.int32), 1)
    seq = SeqState.from_item(item, 0, 0, 0.0, multi_turn=True)

    async def turn(eng, resume):
        req = GenRequest(
            "g/0",
            item.prompt_ids,
            # max_tokens caps the whole response: this turn's 5 after what it resumes
            SamplingParams(max_tokens=len(resume) + 5, seed=1, ignore_eos=True),
            resume_ids=resume,
            single=True,
        )
        recorded = []
        async for ev in eng.generate(req, 60):
            seq.append(ev.token_ids, ev.logprobs, 0.0)
            recorded.append((ev.route_start, ev.routes))
            assert seq.add_routes(ev.route_start, ev.routes)
        return recorded

    async def go():
        eng = TorchEngine(model, None, max_running=2, max_model_len=64)
        await eng.start()
        try:
            first = await turn(eng, np.zeros(0, np.int32))
            before = seq.routes.copy()
            seq.append_env(np.array([9, 10, 11], np.int32))
            second = await turn(eng, seq.ids.copy())
        finally:
            await eng.close()
        return first, before, second

    first, before, second = asyncio.run(go())
    routes = seq.trajectory("length", "r0", 0.0).routes
    assert routes.shape[0] == len(item.prompt_ids) + seq.length - 1
    np.testing.assert_array_equal(routes[: len(before)], before)  # turn 1 as its engine recorded
    start, prefill = second[0]
    assert start == 0
    # the positions turn 1 never fed come from turn 2's prefill, exactly as recorded there
    np.testing.assert_array_equal(routes[len(before) : len(prefill)], prefill[len(before) :])
    decode_steps = np.concatenate([r for _, r in second[1:]])
    np.testing.assert_array_equal(routes[len(prefill) :], decode_steps)


def _traj(routes, prompt=4, resp=3):
    return Trajectory(
        uid="g/0",
        group_id="g",
        prompt_uid="p",
        sample_index=0,
        prompt_ids=np.arange(3, 3 + prompt, dtype=np.int32),
        response_ids=np.arange(3, 3 + resp, dtype=np.int32),
        logprobs=np.zeros(resp, np.float32),
        version=0,
        reward=1.0,
        routes=routes,
    )


def test_malformed_routes_are_refused_and_dropped():
    shape = MoeShape(EXPERTS, 2, (0, 1), True, 32)
    limits = SampleLimits(moe=shape)
    good = np.zeros((6, 2, 2), np.uint8)
    assert limits.refusal(_traj(good)) is None
    assert limits.refusal(_traj(np.full((6, 2, 2), EXPERTS, np.uint8))) == "bad_routes"
    assert limits.refusal(_traj(np.zeros((6, 3, 2), np.uint8))) == "bad_routes"
    assert limits.refusal(_traj(np.zeros((6, 2, 1), np.uint8))) == "bad_routes"
    state = ExperienceState(
        group_size=1,
        lost_member_policy="release_partial",
        admission=Admission.for_mode("laminar", 2),
    )
    verdict, why = state.check_trajectory(_traj(np.zeros((8, 2, 2), np.uint8)))
    assert verdict == "bad" and "routes" in why
    # a wrong dtype never decodes
    with pytest.raises(ProtocolError):
        decode(encode(_traj(np.zeros((6, 2, 2), np.float32))))
    batch = TrainBatch.build([_traj(np.zeros((8, 2, 2), np.uint8))])
    assert batch.dropped["bad_routes"] == 1 and not batch.samples


def test_route_dtype_holds_the_expert_count():
    from laminar.models.moe import route_dtype

    assert route_dtype(8) == np.uint8 and route_dtype(256) == np.uint8
    assert route_dtype(257) == np.int16


def test_abort_then_resume_keeps_first_routes(moe_path):
    """A sequence aborted mid-generation (export) and resumed (import): the resuming engine's
    prefill recomputes every route; the ones the aborted run recorded are the ones kept."""
    model = load_causal_lm(moe_path)
    item = PromptItem("p", "g", np.array([1, 5, 6, 7], np.int32), 1)
    seq = SeqState.from_item(item, 0, 0, 0.0)

    async def go():
        eng = TorchEngine(model, None, max_running=2, max_model_len=64)
        await eng.start()
        try:
            params = SamplingParams(max_tokens=12, seed=2, ignore_eos=True)
            eng.submit(GenRequest("g/0", item.prompt_ids, params, single=True))
            while seq.length < 4:
                ev: TokenEvent = await eng.next_event(30)
                seq.append(ev.token_ids, ev.logprobs, 0.0)
                assert seq.add_routes(ev.route_start, ev.routes)
            states = await eng.abort(["g/0"])
            while True:  # drain up to the abort event
                ev = await eng.next_event(30)
                if ev.finished:
                    break
                seq.append(ev.token_ids, ev.logprobs, 0.0)
                seq.add_routes(ev.route_start, ev.routes)
            kept = seq.routes.copy()
            st: PartialState = states[0]
            part = seq.partial(st.output_ids, st.logprobs, "r0")
            moved = SeqState.from_partial(decode(encode(part)), 0.0)
            eng.submit(
                GenRequest.resume(
                    PartialState(
                        "g/0", item.prompt_ids, moved.ids.copy(), moved.logprobs.copy(), 0
                    ),
                    params,
                )
            )
            while True:
                ev = await eng.next_event(30)
                moved.append(ev.token_ids, ev.logprobs, 0.0)
                if ev.routes is not None:
                    assert moved.add_routes(ev.route_start, ev.routes)
                if ev.finished:
                    break
        finally:
            await eng.close()
        return kept, moved

    kept, moved = asyncio.run(go())
    routes = moved.trajectory("length", "r1", 0.0).routes
    assert routes.shape[0] == len(item.prompt_ids) + moved.length - 1
    np.testing.assert_array_equal(routes[: len(kept)], kept)


def test_buffer_reads_the_moe_shape_from_config_json(moe_path):
    from laminar.wiring.buffer import model_moe

    shape = model_moe(str(moe_path))
    assert shape == MoeShape.of(load_causal_lm(moe_path))
    assert shape is not None and shape.experts == EXPERTS and shape.layers == (0, 1)
