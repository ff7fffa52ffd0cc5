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
from tests.test_agents import agent_files  # noqa: F401  (a fixture)

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
        model = _perturbed(moe_path, scale=0.5)  # routes some recorded positions otherwise
        fwd = PackedForward(model)
        lay = PackedLayout.build(batch.samples, moe=fwd.moe)
        # the whole layer recomputed (not stopped once its saved tensors are back): its experts
        # are appended to live_routes after the forward's
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            fwd.hidden(lay, checkpoint=ckpt).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    # backward recomputed each layer with the recorded experts
    assert lay.routes is not None and lay.routed is not None and len(fwd.live_routes) == 4
    recomputed = torch.stack(fwd.live_routes[2:][::-1], 1)  # backward runs the last layer first
    assert torch.equal(recomputed[lay.routed], lay.routes[lay.routed])
    with torch.no_grad():  # where this model's own routing would have gone elsewhere
        fwd.hidden(PackedLayout.build(batch.samples))
    live = torch.stack(fwd.live_routes, 1)
    assert (live[lay.routed] != lay.routes[lay.routed]).any()
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


def _streamed_seq(prompt_len=4, resp=6, layers=2, k=2, seed=0):
    """A sequence with `resp` response tokens and the routes an engine would have recorded (every
    position but the newest token's)."""
    rng = np.random.default_rng(seed)
    item = PromptItem("p", "g", np.arange(1, 1 + prompt_len, dtype=np.int32), 1)
    s = SeqState.from_item(item, 0, 0, 0.0)
    s.append(np.arange(resp, dtype=np.int32) + 3, np.full(resp, -0.5, np.float32), 0.0)
    routes = rng.integers(0, EXPERTS, (prompt_len + resp - 1, layers, k)).astype(np.uint8)
    assert s.add_routes(0, routes)
    return s, routes


def test_partial_stream_carries_routes_and_a_recovered_record_hands_them_on():
    """The partial pool's entries carry the routes beside the tokens (one frame per batch, by
    position); the record folds them like tokens (resends trimmed, gaps ignored) and the
    recovered record hands them to the importer, which keeps them."""
    from laminar.buffer.partials import PartialPool
    from laminar.rollout.deliver import partial_batch

    a, ra = _streamed_seq(seed=1)
    b, rb = _streamed_seq(seed=2)
    b.uid, b.sample_index = "g/1", 1
    pool = PartialPool(moe=MoeShape(EXPERTS, 2, (0, 1), True, 32))
    msg, upto = partial_batch([a, b], "r0")
    assert msg.routes is not None and msg.routes.dtype == np.uint8
    assert msg.route_starts.tolist() == [0, 0] and msg.route_lengths.tolist() == [9, 9]
    wire = decode(encode(msg))
    assert not pool.apply_batch(wire)
    a.sent_upto, b.sent_upto = upto
    a.routes_sent = b.routes_sent = 9
    # more tokens on a: the next entry brings only the new positions
    more = np.random.default_rng(3).integers(0, EXPERTS, (3, 2, 2)).astype(np.uint8)
    a.append(np.array([7, 8, 9], np.int32), np.zeros(3, np.float32), 0.0)
    assert a.add_routes(9, more)
    msg2, _ = partial_batch([a], "r0")
    assert msg2.route_starts.tolist() == [9] and msg2.route_lengths.tolist() == [3]
    assert not pool.apply_batch(decode(encode(msg2)))
    # a resend: tokens and routes trimmed, nothing twice
    assert pool.apply_batch(decode(encode(msg2))) == {"duplicate": 1}
    got = {p.uid: p for p in pool.query("r0")}
    np.testing.assert_array_equal(got["g/0"].routes, np.concatenate([ra, more]))
    np.testing.assert_array_equal(got["g/1"].routes, rb)
    assert len(got["g/0"].routes) == len(a.prompt_ids) + a.length - 1
    # the importer keeps them: its own prefill's routes only fill what comes after
    resumed = SeqState.from_partial(decode(encode(got["g/0"])), 0.0)
    fresh = np.full((len(a.prompt_ids) + a.length, 2, 2), 7, np.uint8)
    assert resumed.add_routes(0, fresh)
    out = resumed.trajectory("length", "r1", 0.0).routes
    np.testing.assert_array_equal(out[:12], np.concatenate([ra, more]))
    assert (out[12:] == 7).all()


def test_partial_stream_routes_that_do_not_fit_are_dropped_and_counted():
    from laminar.buffer.partials import PartialPool
    from laminar.rollout.deliver import partial_batch

    a, _ = _streamed_seq()
    msg, _ = partial_batch([a], "r0")
    msg.routes = np.full_like(msg.routes, EXPERTS)  # expert ids out of range
    pool = PartialPool(moe=MoeShape(EXPERTS, 2, (0, 1), True, 32))
    assert pool.apply_batch(msg) == {"bad_routes": 1}
    (p,) = pool.query("r0")
    assert p.routes is None and len(p.response_ids) == a.length  # the tokens are kept
    # columns that do not match the entries: the batch is malformed as a whole
    msg, _ = partial_batch([a], "r0")
    msg.route_lengths = np.array([3], np.int64)
    assert pool.apply_batch(msg) == {"bad": 1}
    # a gap in the routes (an entry lost) is ignored until a header restarts the record
    pool = PartialPool()
    msg, upto = partial_batch([a], "r0")
    assert not pool.apply_batch(msg)
    a.sent_upto, a.routes_sent = upto[0], 12  # as if positions 9..11 went out and were lost
    a.append(np.array([7], np.int32), np.zeros(1, np.float32), 0.0)
    a.add_routes(9, np.zeros((4, 2, 2), np.uint8))
    msg, _ = partial_batch([a], "r0")
    assert not pool.apply_batch(msg)
    (p,) = pool.query("r0")
    assert len(p.routes) == 9 and len(p.response_ids) == 7 and pool.counts["route_gaps"] == 1


@pytest.fixture(scope="module")
def chat_moe(tmp_path_factory):
    """The tiny MoE on the default alphabet (~50 tokens: a random policy rarely stops early) and
    the same policy with its routers moved, as a newer version would have them."""
    root = tmp_path_factory.mktemp("moe_chat")
    path = build_tiny_model(
        root / "m", hidden=32, layers=2, heads=2, kv_heads=1, kind="moe", experts=EXPERTS
    )
    moved = _perturbed(path, scale=0.5)
    moved.save_pretrained(root / "moved", safe_serialization=True)
    load_tokenizer_of(path).save_pretrained(root / "moved")
    return path, root / "moved"


def load_tokenizer_of(path):
    from laminar.models.tiny import load_tokenizer

    return load_tokenizer(path)


async def test_routes_survive_a_rollout_killed_mid_trajectory(tmp_path, chat_moe):
    """rollout-0 dies (no drain, no Bye) mid-trajectory; the manager recovers its trajectories
    from the buffer's partial pool onto rollout-1, which serves the policy with moved routers (a
    newer version would route the prefix differently). The stored trajectory's routes are exactly
    what rollout-0's engine recorded for every position the pool held (prompt and streamed
    tokens), and rollout-1's own after that."""
    import json

    from laminar.cluster import LocalCluster
    from laminar.config import config_from_dict
    from laminar.tasks import countup
    from tests.test_e2e_rollout import PROMPTS, stored, wait_for

    path, moved = chat_moe
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p, "answer": countup.answer_of(p)}) + "\n" for p in PROMPTS)
    )
    cfg = config_from_dict(
        {
            "name": "moe-kill",
            "run_dir": str(tmp_path / "run"),
            "cluster": {"transport": "inproc", "roles": {"manager": 1, "buffer": 1, "rollout": 2}},
            "transport": {
                "heartbeat_interval_s": 0.1,
                "heartbeat_liveness": 10,
                "request_timeout_s": 1.0,
                "startup_timeout_s": 30.0,
                "stop_timeout_s": 5.0,
                "reconnect_backoff_s": 0.02,
                "reconnect_backoff_max_s": 0.1,
            },
            "model": {"path": str(path)},
            "data": {"train": str(data), "epochs": 1, "shuffle": False, "chat_template": False},
            "reward": {"fn": "laminar.tasks.countup:reward", "workers": 0, "timeout_s": 10.0},
            "rollout": {
                "engine": "torch",
                "group_size": 2,
                "credits": 1,
                "max_running": 4,
                "partial_chunk_tokens": 2,
                "partial_flush_s": 0.02,
                "weights": "dir",
                "prompt_retry_s": 0.05,
                "sampling": {"max_tokens": 60, "temperature": 1.0},
            },
            "buffer": {"retry_after_s": 0.05},
        }
    )
    async with LocalCluster(cfg, roles={"manager": 1, "buffer": 1, "rollout": 1}) as cluster:
        buf, victim = cluster.node("buffer-0"), cluster.node("rollout-0")
        cluster.cfg.model.path = str(moved)  # the next rollout serves the moved routers
        await cluster.add("rollout", 1)

        def pooled() -> list[str]:
            return [
                u
                for u, s in victim.table.seqs.items()
                if (r := buf.partials.records.get(u)) is not None
                and (n := buf.partials.length(u) or 0) >= 6
                and r.routes_n == len(s.prompt_ids) + n - 1
                and s.length < 50
            ]

        await wait_for(lambda: pooled(), 60, "rollout-0 mid-trajectory, streamed", cluster)
        lost = pooled()
        held = {u: buf.partials.length(u) for u in lost}
        recorded = {u: victim.table.seqs[u].routes.copy() for u in lost}
        ids = {u: victim.table.seqs[u].ids.copy() for u in lost}
        await cluster.kill_node("rollout-0")
        await wait_for(
            lambda: set(lost) <= set(stored(buf)), 60, "the resumed trajectories", cluster
        )
        resumer = cluster.node("rollout-1")
        for u in lost:
            t = stored(buf)[u]
            p, k = len(t.prompt_ids), held[u]
            assert t.rollout_id == "rollout-1" and t.resumed == 1
            np.testing.assert_array_equal(t.response_ids[:k], ids[u][:k])
            assert t.routes.shape == (p + len(t.response_ids) - 1, 2, 2)
            # every position the pool held: as rollout-0's engine recorded it
            np.testing.assert_array_equal(t.routes[: p + k - 1], recorded[u][: p + k - 1])
            # the resumer routes that prefix otherwise: without the stream's routes, its own
            # prefill's would have been kept
            fwd = PackedForward(resumer.engine.model)
            t.reward = 1.0
            fwd.hidden(PackedLayout.build(TrainBatch.build([t]).samples))
            live = torch.stack(fwd.live_routes, 1)[: p + k - 1].sort(-1).values.numpy()
            assert (live != np.sort(recorded[u][: p + k - 1], -1)).any(), u


async def test_mode_partial_routes_come_from_the_version_that_sampled(moe_path):
    """Mode partial: an update interrupts a group mid-generation and it continues under version 1
    (routers moved). Each position keeps the route of the forward that first fed it, i.e. of the
    version that sampled the token after it: version 0's for every position its decode fed,
    version 1's prefill for the newest version-0 token (which version 1 feeds to sample the
    next), version 1's decode after that."""
    from laminar.logs import get_logger
    from laminar.metrics import Metrics
    from laminar.rollout.sequences import SequenceTable

    eng = TorchEngine(load_causal_lm(moe_path), None, max_running=4, max_model_len=64)
    await eng.start()
    table = SequenceTable(
        eng,
        SamplingParams(max_tokens=16, seed=4, ignore_eos=True),
        notify=(asyncio.Event(),),
        metrics=Metrics(),
        log=get_logger(role="rollout", node_id="t"),
        interrupts=True,
    )
    item = PromptItem(uid="p", group_id="g", prompt_ids=np.array([1, 5, 6, 7, 8], np.int32), n=2)
    table.start_group(item, 0)
    events: dict[str, list[tuple[int, int, np.ndarray]]] = {}
    done: dict[str, SeqState] = {}
    at: dict[str, int] = {}
    moved = _perturbed(moe_path, scale=0.5)
    try:
        async with asyncio.timeout(60):
            while table.seqs:
                ev = await eng.next_event(30)
                if ev.routes is not None:
                    events.setdefault(ev.seq_id, []).append((ev.version, ev.route_start, ev.routes))
                seq = table.on_event(ev)
                if seq is not None and ev.finished:
                    table.forget(seq.uid)
                    done[seq.uid] = seq
                if not at and all(q.length >= 5 for q in table.seqs.values()):
                    states = await table.interrupt()
                    at = {p.seq_id: len(p.output_ids) for p in states}
                    await eng.load_weights(list(moved.state_dict().items()), 1)
                    table.continue_at(states, 1)
    finally:
        await eng.close()
    assert set(at) == set(done) == {"g/0", "g/1"}
    p = len(item.prompt_ids)
    for uid, seq in done.items():
        t = seq.trajectory("length", "r0", 0.0)
        k = at[uid]
        assert t.token_versions.tolist() == [0] * k + [1] * (16 - k)
        v0 = np.concatenate([r for v, _, r in events[uid] if v == 0])
        (start, prefill), *decode = [(s, r) for v, s, r in events[uid] if v == 1]
        assert start == 0 and len(prefill) == p + k
        assert len(v0) == p + k - 1  # version 0 fed the prompt and its tokens but the newest
        np.testing.assert_array_equal(t.routes[: p + k - 1], v0)
        np.testing.assert_array_equal(t.routes[p + k - 1], prefill[p + k - 1])
        np.testing.assert_array_equal(t.routes[p + k :], np.concatenate([r for _, r in decode]))
        # version 1 routes the earlier positions otherwise: those are not its to record
        assert (np.sort(prefill[: p + k - 1], -1) != np.sort(v0, -1)).any()


@pytest.fixture(scope="module")
def tool_moe(tmp_path_factory):
    """The tiny MoE on the tool task's alphabet (the agent tests' chat renderer)."""
    from laminar.tasks import tooluse

    return build_tiny_model(
        tmp_path_factory.mktemp("tool_moe") / "m",
        alphabet=tooluse.ALPHABET,
        hidden=32,
        layers=2,
        heads=2,
        kv_heads=1,
        max_positions=512,
        kind="moe",
        experts=EXPERTS,
    )


@pytest.mark.usefixtures("agent_files")
async def test_agent_episode_routes_are_what_the_engine_recorded(tmp_path, tool_moe, monkeypatch):
    """A black-box agent makes three chat calls through the rollout's OpenAI endpoint, each one
    re-rendering the whole conversation. Each call is fed to the engine as the trajectory so far
    (its shared prefix), and the trajectory's routes are exactly what the engine recorded: every
    position from the first call that fed it (a later call's prefill recomputes the prefix; its
    routes there are not kept)."""
    from laminar.cluster import LocalCluster
    from laminar.rollout.sequences import SequenceTable
    from tests.test_agents import capture, make_cfg, wait_for

    fed: dict[str, list[np.ndarray]] = {}
    events: dict[str, list[tuple[int, np.ndarray]]] = {}
    submit, on_event = TorchEngine.submit, SequenceTable.on_event

    def record_submit(self, req):
        for sid in req.seq_ids():
            fed.setdefault(sid, []).append(np.concatenate([req.prompt_ids, req.resume_ids]))
        return submit(self, req)

    def record_event(self, ev):
        if ev.routes is not None:
            events.setdefault(ev.seq_id, []).append((ev.route_start, ev.routes.copy()))
        return on_event(self, ev)

    monkeypatch.setattr(TorchEngine, "submit", record_submit)
    monkeypatch.setattr(SequenceTable, "on_event", record_event)
    cfg = make_cfg(
        tmp_path,
        tool_moe,
        "agent-moe",
        rows=1,
        data={"epochs": 1},
        rollout={"sampling": {"max_tokens": 400, "temperature": 1.0}},
        agent={"fn": "tests.agent_fakes:three_call_agent"},
    )
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0)
        trajs = capture(rollout)
        want = cfg.rollout.group_size
        await wait_for(lambda: len(trajs) == want, 120, f"{want} trajectories", cluster)
    multi = 0
    for t in trajs:
        tokens = np.concatenate([t.prompt_ids, t.response_ids])
        calls = fed[t.uid]
        multi += len(calls) >= 2
        for c in calls:  # each call fed the trajectory so far
            np.testing.assert_array_equal(c, tokens[: len(c)])
        want_routes = np.zeros_like(t.routes)
        covered = 0
        for start, r in events[t.uid]:
            end = start + len(r)
            if end > covered:
                want_routes[covered:end] = r[covered - start :]
                covered = end
        assert covered == len(t.routes) == len(tokens) - 1
        np.testing.assert_array_equal(t.routes, want_routes)
        assert t.turns == len(calls)
    assert multi, "no episode made more than one call"


def _moe_trajs(moe_path, seed=3):
    """Two groups of two rolled out by the engine (routes recorded), rewards varying inside each
    group."""
    rolled = _rollout(load_causal_lm(moe_path), [[1, 5, 6, 7, 8], [1, 9, 9, 4]], seed=seed)
    trajs = list(rolled.values())
    for i, t in enumerate(trajs):
        t.reward = float(i % 2)
    return trajs


def test_checkpoint_and_export_round_trip(moe_path, tmp_path):
    """The trainer (packed forward, replay) saves and resumes an MoE policy (experts, routers,
    optimizer state) exactly, and its exported weights are the HF model's own names: a fresh HF
    Qwen3-MoE loads them strictly and computes the trainer's logits."""
    from laminar.trainer import checkpoint as ck
    from laminar.trainer.factory import open_trainer
    from laminar.trainer.torch_trainer import TorchTrainer
    from laminar.wiring.trainer import trainer_settings
    from tests.test_trainer import make_cfg

    cfg = make_cfg(str(moe_path), tmp_path, lr=1e-2, warmup_steps=1)
    a = TorchTrainer(trainer_settings(cfg), str(moe_path))
    assert a.model.replay is not None
    b1, b2 = TrainBatch.build(_moe_trajs(moe_path, 3)), TrainBatch.build(_moe_trajs(moe_path, 5))
    a.train_step(b1)
    ck.save_trainer(a, tmp_path, 1, {"version": 1, "frontier": {}}, str(moe_path)).wait()
    cfg.trainer.resume = "auto"
    b = open_trainer(trainer_settings(cfg), tmp_path).trainer
    assert isinstance(b, TorchTrainer)
    wa, wb = a.model.export_weights(), b.model.export_weights()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any("experts" in k for k in wa) and any("mlp.gate" in k for k in wa)
    sa = ck.optimizer_state(a.model.module, a.optimizer)["state"]
    sb = ck.optimizer_state(b.model.module, b.optimizer)["state"]
    assert sa.keys() == sb.keys()
    ma, mb = a.train_step(b2), b.train_step(b2)
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    # the export is what an HF MoE (and so the engines) loads, name for name
    hf = load_causal_lm(moe_path)
    res = hf.load_state_dict(
        {k: v.to(torch.float32) for k, v in b.model.export_weights().items()}, strict=False
    )
    assert not res.unexpected_keys
    assert set(res.missing_keys) <= ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        # the trainer's module returns hidden states; its head is applied apart (chunked)
        head = b.model.module.get_output_embeddings().weight
        mine = b.model.module(input_ids=ids).logits @ head.T
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_lora_on_the_attention_layers_of_an_moe(moe_path, tmp_path):
    """LoRA on an MoE (peft): adapters on the attention projections (the experts are fused 3-D
    parameters and the router is not a Linear: no adapters there); only the adapters train, the
    experts and routers stay frozen, and the packed forward still replays the recorded experts."""
    from laminar.config import LoraConfig
    from laminar.trainer.torch_trainer import TorchTrainer
    from laminar.wiring.trainer import trainer_settings
    from tests.test_trainer import make_cfg

    cfg = make_cfg(str(moe_path), tmp_path, lr=3e-2)
    cfg.model.lora = LoraConfig(
        rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    policy = TorchTrainer(trainer_settings(cfg), str(moe_path))
    assert policy.model.replay is not None
    before = {k: v.detach().clone() for k, v in policy.model.module.state_dict().items()}
    batch = TrainBatch.build(_moe_trajs(moe_path))
    for _ in range(2):
        policy.train_step(batch)
    after = policy.model.module.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed), sorted(changed)[:5]
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert all(any(f".{t}." in k for t in attn) for k in changed), sorted(changed)[:5]
    assert {t for t in attn if any(f".{t}." in k for k in changed)} == set(attn)
    version = policy.model.export_weights()
    assert version and all("lora_" in k for k in version)  # a version is the adapters
