"""The buffer and trainer understand turns: loss masks through the partial pool, intake,
journal, batches and losses; episode metrics.

.venv/bin/python -m pytest tests/test_multiturn_train.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from laminar.algo.episodes import episode_stats, percentile
from laminar.algo.losses import aggregate, policy_loss
from laminar.buffer.experience import ExperienceState
from laminar.buffer.holders import recover
from laminar.buffer.intake import Intake
from laminar.buffer.journal import Journal
from laminar.buffer.ledger import Ledger
from laminar.buffer.partials import PartialPool
from laminar.buffer.prompt_server import PromptServer
from laminar.buffer.prompts import PromptPool
from laminar.buffer.records import TrajectoryAccepted
from laminar.config import LaminarConfig, config_from_dict
from laminar.data.prompts import PromptEncoder, PromptRow
from laminar.logs import get_logger
from laminar.metrics import Metrics
from laminar.modes import Admission
from laminar.protocol.buffer import PromptRequest, TrajectoryAck
from laminar.protocol.data import (
    PartialChunk,
    PartialTrajectory,
    PromptItem,
    ToolRecord,
    Trajectory,
)
from laminar.trainer.batch import TrainBatch
from laminar.trainer.micro_batch import collate
from laminar.trainer.sim import SimTrainer
from laminar.trainer.torch_trainer import TorchTrainer
from laminar.transport.session import ErrorReply
from laminar.wiring.trainer import trainer_settings

PROMPT = np.array([5, 6, 7], np.int32)
# turn 0: 3 model tokens, tool answer: 2 env tokens, turn 1: 2 model tokens, user: 1 env, turn 2: 1
# model
RESP = np.array([10, 11, 12, 20, 21, 13, 14, 22, 15], np.int32)
MASK = np.array([1, 1, 1, 0, 0, 1, 1, 0, 1], np.uint8)


def multi_turn(
    uid: str = "g0/0", reward: float = 1.0, resp=RESP, mask=MASK, calls=(), **kw
) -> Trajectory:
    lp = np.where(mask == 1, -1.5, 0.0).astype(np.float32)
    group_id, _, idx = uid.rpartition("/")
    return Trajectory(
        uid=uid,
        group_id=group_id,
        prompt_uid="p",
        sample_index=int(idx),
        prompt_ids=PROMPT,
        response_ids=np.array(resp, np.int32),
        logprobs=lp,
        version=0,
        reward=reward,
        loss_mask=np.array(mask, np.uint8),
        turns=3,
        tool_calls=list(calls),
        **kw,
    )


def tool(
    k: int, ok: bool = True, seconds: float = 0.1, kind: str = "", cached: bool = False
) -> ToolRecord:
    return ToolRecord(
        call_id=f"g0/0#t0#c{k}",
        name="python",
        turn=0,
        ok=ok,
        error_kind=kind,
        seconds=seconds,
        cached=cached,
    )


# ---- partial pool ------------------------------------------------------------------------------
def _header(uid: str, mask: np.ndarray | None) -> PartialTrajectory:
    n = 0 if mask is None else len(mask)
    return PartialTrajectory(
        uid=uid,
        group_id="g0",
        prompt_uid="p",
        sample_index=0,
        prompt_ids=PROMPT,
        response_ids=RESP[:n],
        logprobs=np.zeros(n, np.float32),
        version=2,
        loss_mask=mask,
    )


def _chunk(uid: str, lo: int, hi: int, mask: bool = True, header=None) -> PartialChunk:
    return PartialChunk(
        uid=uid,
        version=2,
        offset=lo,
        token_ids=RESP[lo:hi],
        logprobs=np.zeros(hi - lo, np.float32),
        rollout_id="r0",
        header=header,
        loss_mask=MASK[lo:hi] if mask else None,
    )


def test_partial_pool_stores_and_recovers_the_loss_mask():
    pool = PartialPool()
    # the header carries the first turn (3 model tokens); then env tokens, a resend, a maskless
    # chunk
    assert pool.apply(_chunk("g0/0", 0, 0, header=_header("g0/0", MASK[:3]))) == "duplicate"
    assert pool.apply(_chunk("g0/0", 3, 5)) == "appended"
    assert (
        pool.apply(_chunk("g0/0", 2, 7)) == "appended"
    )  # overlaps one token: the mask is sliced too
    assert pool.apply(_chunk("g0/0", 7, 9)) == "appended"
    (p,) = recover(pool, {}, rollout_id="r0")
    assert np.array_equal(p.response_ids, RESP) and p.loss_mask is not None
    assert p.loss_mask.dtype == np.uint8 and np.array_equal(p.loss_mask, MASK)
    # a chunk without a mask is all model tokens
    assert pool.apply(_chunk("g0/1", 0, 0, header=_header("g0/1", MASK[:3]))) == "duplicate"
    assert pool.apply(_chunk("g0/1", 3, 5, mask=False)) == "appended"
    (q,) = pool.query(uids=["g0/1"])
    assert q.loss_mask is not None and q.loss_mask.tolist() == [1, 1, 1, 1, 1]
    # single-turn records stay maskless
    assert pool.apply(_chunk("g0/2", 0, 0, header=_header("g0/2", None))) == "duplicate"
    assert pool.apply(_chunk("g0/2", 0, 4, mask=False)) == "appended"
    (r,) = pool.query(uids=["g0/2"])
    assert r.loss_mask is None and len(r.response_ids) == 4
    # materialize compacts the pieces; a second query gives the same
    (p2,) = pool.query(uids=["g0/0"])
    assert np.array_equal(p2.loss_mask, MASK)


def test_partial_pool_rejects_and_counts_a_bad_mask_and_keeps_going():
    pool = PartialPool()
    pool.apply(_chunk("g0/0", 0, 0, header=_header("g0/0", MASK[:3])))
    bad = _chunk("g0/0", 3, 5)
    bad.loss_mask = np.ones(3, np.uint8)  # 3 entries for 2 tokens
    assert pool.apply(bad) == "bad"
    two = _chunk("g0/0", 3, 5)
    two.loss_mask = np.array([0, 2], np.uint8)  # not 0/1
    assert pool.apply(two) == "bad"
    head = _header("g0/9", MASK[:3])
    head.loss_mask = MASK[:2]
    assert pool.apply(_chunk("g0/9", 0, 0, header=head)) == "bad"
    assert pool.counts["bad_loss_mask"] == 3 and "g0/9" not in pool.records
    assert pool.apply(_chunk("g0/0", 3, 9)) == "appended"  # the record is intact
    (p,) = pool.query(uids=["g0/0"])
    assert np.array_equal(p.loss_mask, MASK)


# ---- intake + journal ----------------------------------------------------------------------
def buffer_parts(journal: Journal | None):
    cfg = LaminarConfig.model_validate(
        {"rollout": {"group_size": 2}, "trainer": {"batch_groups": 1}}
    )
    adm = Admission.for_mode(cfg.mode, cfg.trainer.batch_groups, cfg.buffer.max_staleness)
    state = ExperienceState(group_size=2, lost_member_policy="release_partial", admission=adm)
    metrics, log = Metrics(), get_logger(role="buffer", node_id="test")
    ledger = Ledger(state, journal, cfg.buffer.compact_bytes, metrics, log)
    if journal is not None:
        ledger.replay()
    pool = PromptPool(
        [PromptRow("p0", "prompt 0", {}, "mem:0")], PromptEncoder(None), shuffle=False, epochs=1
    )
    prompts = PromptServer(cfg.buffer, 2, admission=adm, ledger=ledger, pool=pool, metrics=metrics)
    return ledger, prompts, Intake(ledger, PartialPool(), metrics, log), metrics


def for_item(item: PromptItem, i: int, **kw) -> Trajectory:
    t = multi_turn(f"{item.group_id}/{i}", **kw)
    t.prompt_uid, t.prompt_ids = item.uid, item.prompt_ids
    return t


async def test_intake_rejects_a_wrong_length_mask_and_journal_round_trips_multi_turn(tmp_path):
    j = Journal(tmp_path / "b.journal", "always")
    ledger, prompts, intake, metrics = buffer_parts(j)
    item = (await prompts.serve(PromptRequest(rollout_id="r0", max_groups=1, version=0))).items[0]
    short = for_item(item, 0)
    short.loss_mask = MASK[:-1]
    reply = await intake.trajectory(short, "r0")
    assert isinstance(reply, ErrorReply) and "loss_mask" in reply.message
    assert metrics.counters["trajectories_rejected"] == 1
    calls = [tool(0, seconds=0.25), tool(1, ok=False, kind="timeout", seconds=5.0, cached=True)]
    good = for_item(item, 0, calls=calls, finish_reason="stop")
    good.logprobs[3] = -0.7  # an env token with a logprob: accepted, counted
    assert isinstance(await intake.trajectory(good, "r0"), TrajectoryAck)
    assert metrics.counters["env_logprob_nonzero"] == 1
    j.close()
    # replay: the stored member is the same trajectory, mask, turns and tool calls included
    j2 = Journal(tmp_path / "b.journal", "never")
    replayed, *_ = buffer_parts(j2)
    back = replayed.state.groups[item.group_id].members[0]
    j2.close()
    assert back.loss_mask is not None and back.loss_mask.dtype == np.uint8
    assert np.array_equal(back.loss_mask, MASK) and np.array_equal(back.response_ids, RESP)
    assert np.array_equal(back.logprobs, good.logprobs) and back.turns == 3
    assert back.tool_calls == calls and back.finish_reason == "stop"


def test_journal_record_round_trips_a_multi_turn_trajectory_exactly(tmp_path):
    t = multi_turn(calls=[tool(0), tool(1, ok=False, kind="crash", seconds=1.5)])
    single = multi_turn("g1/0")
    single.loss_mask, single.turns = None, 1
    j = Journal(tmp_path / "x.journal", "always")
    list(j.replay())
    j.append(TrajectoryAccepted(t))
    j.append(TrajectoryAccepted(single))
    j.close()
    j2 = Journal(tmp_path / "x.journal", "never")
    a, b = [rec.trajectory for rec in j2.replay() if isinstance(rec, TrajectoryAccepted)]
    j2.close()
    for got, want in ((a, t), (b, single)):
        for f in got.__struct_fields__:
            x, y = getattr(got, f), getattr(want, f)
            if isinstance(y, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y), f
            else:
                assert x == y, f
    assert b.loss_mask is None


# ---- batches and losses ----------------------------------------------------------------------
def test_collate_trains_exactly_the_delivered_ids_with_the_mask_aligned():
    trajs = [multi_turn("g0/0"), multi_turn("g0/1", resp=RESP[:5], mask=MASK[:5], reward=0.0)]
    plain = multi_turn("g0/2", reward=0.5)
    plain.loss_mask = None
    batch = TrainBatch.build([*trajs, plain])
    assert batch.n_seqs == 3 and not batch.dropped
    mb = collate(batch, [0, 1, 2])
    P = len(PROMPT)
    for r, t in enumerate([*trajs, plain]):
        n = len(t.response_ids)
        want = np.concatenate([t.prompt_ids, t.response_ids]).astype(np.int64)
        assert mb.input_ids[r, : P + n].tolist() == want.tolist()  # nothing re-encoded
        assert int(mb.attention_mask[r].sum()) == P + n
        mask = np.ones(n, bool) if t.loss_mask is None else t.loss_mask == 1
        assert mb.resp_mask[r, P - 1 : P - 1 + n].tolist() == mask.tolist()
        assert not mb.resp_mask[r, : P - 1].any() and not mb.resp_mask[r, P - 1 + n :].any()
        # the targets at response positions are the response ids
        assert mb.targets[r, P - 1 : P - 1 + n].tolist() == t.response_ids.tolist()
    assert batch.n_tokens == 6 + 3 + 9 == mb.n_tokens
    assert batch.n_response_tokens == 9 + 5 + 9


def test_bad_masks_are_dropped_and_counted():
    short = multi_turn("g0/0")
    short.loss_mask = MASK[:4]
    env_only = multi_turn("g0/1", mask=np.zeros(9, np.uint8))
    batch = TrainBatch.build([short, env_only, multi_turn("g0/2"), multi_turn("g0/3")])
    assert batch.n_seqs == 2
    assert batch.dropped == {"loss_mask_length": 1, "no_model_tokens": 1}


def test_a_group_that_drops_leave_with_one_member_is_dropped_whole():
    """One survivor has no baseline (advantage 0): it would only dilute token_mean."""
    bad = multi_turn("g0/0", mask=np.zeros(9, np.uint8))
    batch = TrainBatch.build([bad, multi_turn("g0/1"), multi_turn("g1/0"), multi_turn("g1/1")])
    assert [s.uid for s in batch.samples] == ["g1/0", "g1/1"]
    assert batch.dropped == {"no_model_tokens": 1, "singleton_group": 1}
    # a group that arrives with one member (group_size 1, a released partial group) is kept
    assert TrainBatch.build([multi_turn("g2/0")]).n_seqs == 1


def test_token_mean_and_seq_mean_count_model_tokens_only():
    batch = TrainBatch.build([multi_turn("g0/0"), multi_turn("g0/1", resp=RESP[:5], mask=MASK[:5])])
    mb = collate(batch, [0, 1])
    per_tok = torch.ones(mb.resp_mask.shape)
    # token_mean of a constant 1 is exactly 1 with model-token denominators
    assert (
        float(aggregate(per_tok, mb.resp_mask, "token_mean", batch.n_tokens, batch.n_seqs)) == 1.0
    )
    assert float(aggregate(per_tok, mb.resp_mask, "seq_mean_token_mean", batch.n_tokens, 2)) == 1.0
    # seq 0 has 6 model tokens, seq 1 has 3: seq-mean-token-mean of per-row constants 2 and 4
    rows = torch.tensor([[2.0], [4.0]]).expand_as(per_tok)
    assert float(aggregate(rows, mb.resp_mask, "seq_mean_token_mean", batch.n_tokens, 2)) == 3.0
    assert float(aggregate(rows, mb.resp_mask, "token_mean", batch.n_tokens, 2)) == pytest.approx(
        (6 * 2 + 3 * 4) / 9
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from laminar.models.tiny import build_tiny_model

    return str(
        build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=32, layers=1, heads=2, kv_heads=1)
    )


def make_cfg(model_path, run_dir, **algo):
    return config_from_dict(
        {
            "run_dir": str(run_dir),
            "model": {"path": model_path},
            "trainer": {"lr": 3e-3, "total_steps": 20, "micro_batch_tokens": 4096},
            "algo": {"advantage": "grpo", "is_mode": "truncate", **algo},
            "rollout": {"sampling": {"temperature": 1.0, "max_tokens": 16}},
        }
    )


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_env_tokens_get_exactly_zero_gradient(tiny, tmp_path, agg):
    policy = TorchTrainer(trainer_settings(make_cfg(tiny, tmp_path, agg=agg)), tiny)
    batch = TrainBatch.build([multi_turn("g0/0"), multi_turn("g0/1", resp=RESP[:5], mask=MASK[:5])])
    mb = collate(batch, [0, 1])
    seen: list[torch.Tensor] = []

    def keep_logits(_m, _inp, out):
        out.logits.retain_grad()
        seen.append(out.logits)

    hook = policy.model.module.register_forward_hook(keep_logits)
    s = policy.loss_settings

    def loss_of(behav: torch.Tensor) -> torch.Tensor:
        logp, _ = policy.model.token_logprobs(mb)
        adv = torch.ones(
            mb.resp_mask.shape
        )  # nonzero advantage at every position, env ones included
        return policy_loss(
            logp,
            logp.detach(),
            behav,
            adv,
            mb.resp_mask,
            s,
            n_tokens=batch.n_tokens,
            n_seqs=batch.n_seqs,
        )

    loss = loss_of(mb.behav_logp)
    loss.backward()
    hook.remove()
    grad = seen[0].grad[:, :-1].abs().sum(-1)  # [b, L-1]: gradient at each next-token position
    P = len(PROMPT)
    for r, n in ((0, 9), (1, 5)):
        m = torch.from_numpy(MASK[:n] == 1)
        g = grad[r, P - 1 : P - 1 + n]
        assert torch.all(g[~m] == 0), g
        assert torch.all(g[m] > 0), g
    # the behaviour logprobs of env tokens do not enter the loss at all
    wild = mb.behav_logp.clone()
    env = torch.zeros_like(mb.resp_mask)
    env[0, P - 1 : P - 1 + 9] = torch.from_numpy(MASK == 0)
    wild[env] = -40.0
    with torch.no_grad():
        assert float(loss_of(wild)) == float(loss.detach())


def test_train_step_on_multi_turn_counts_model_tokens_and_logs_episodes(tiny, tmp_path):
    policy = TorchTrainer(trainer_settings(make_cfg(tiny, tmp_path)), tiny)
    trajs = [
        multi_turn("g0/0", reward=1.0, calls=[tool(0, seconds=0.2)]),
        multi_turn("g0/1", resp=RESP[:5], mask=MASK[:5], reward=0.0),
    ]
    batch = TrainBatch.build(trajs)
    with torch.no_grad():  # on-policy behaviour logprobs on model tokens, junk on env tokens
        mb = collate(batch, [0, 1])
        logp, _ = policy.model.token_logprobs(mb)
    P = len(PROMPT)
    for r, t in enumerate(trajs):
        n = len(t.response_ids)
        own = logp[r, P - 1 : P - 1 + n].numpy()
        t.logprobs = np.where(t.loss_mask == 1, own, -25.0).astype(np.float32)
    before = {k: v.clone() for k, v in policy.model.module.state_dict().items()}
    m = policy.train_step(TrainBatch.build(trajs))
    assert m["tokens"] == 6 + 3 and m["response_len/mean"] == 7.0
    assert abs(m["is/w"] - 1) < 1e-4  # env tokens' junk behaviour logprobs never enter
    assert math.isfinite(m["loss"])
    assert m["episode/turns"] == 3.0 and m["episode/tool_calls"] == 0.5
    assert m["episode/env_token_frac"] == pytest.approx(5 / 14)
    assert m["reward_by_tool_calls/1"] == 1.0 and m["reward_by_tool_calls/0"] == 0.0
    assert any(not torch.equal(before[k], v) for k, v in policy.model.module.state_dict().items())


# ---- episode metrics ------------------------------------------------------------------------
def test_episode_metrics_on_a_hand_made_batch():
    calls_a = [tool(0, seconds=0.1), tool(1, ok=False, kind="timeout", seconds=10.0)]
    calls_b = [tool(0, seconds=0.3, cached=True)]
    trajs = [
        multi_turn("g0/0", reward=1.0, calls=calls_a),  # 2 calls, 9 resp / 3 env
        multi_turn(
            "g0/1", reward=0.5, calls=calls_b, resp=RESP[:5], mask=MASK[:5]
        ),  # 1 call, 5 / 2
        multi_turn("g0/2", reward=0.0, calls=[], resp=RESP[:3], mask=MASK[:3]),  # 0 calls, 3 / 0
        multi_turn("g0/3", reward=0.25, calls=[tool(k, seconds=0.2) for k in range(3)]),  # 3 calls
    ]
    trajs[2].turns = 1
    m = episode_stats(TrainBatch.build(trajs).samples)
    assert m["episode/turns"] == pytest.approx((3 + 3 + 1 + 3) / 4)
    assert m["episode/tool_calls"] == pytest.approx(6 / 4)
    assert m["tool/error_rate"] == pytest.approx(1 / 6)
    assert m["tool/cached_frac"] == pytest.approx(1 / 6)
    assert m["tool/latency_p50"] == pytest.approx(0.2) and m["tool/latency_p99"] == 10.0
    assert m["episode/env_token_frac"] == pytest.approx((3 + 2 + 0 + 3) / (9 + 5 + 3 + 9))
    assert m["reward_by_tool_calls/0"] == 0.0 and m["reward_by_tool_calls/1"] == 0.5
    assert m["reward_by_tool_calls/2+"] == pytest.approx((1.0 + 0.25) / 2)


def test_episode_metrics_are_absent_for_single_turn_and_nan_safe():
    plain = multi_turn("g0/0")
    plain.loss_mask, plain.turns = None, 1
    assert episode_stats(TrainBatch.build([plain]).samples) == {}
    assert episode_stats([]) == {}
    # multi-turn without any tool call: every key present, the tool figures NaN (logged as null)
    m = episode_stats(TrainBatch.build([multi_turn("g0/1")]).samples)
    assert math.isnan(m["tool/latency_p50"]) and math.isnan(m["tool/error_rate"])
    assert math.isnan(m["reward_by_tool_calls/1"]) and m["reward_by_tool_calls/0"] == 1.0
    assert percentile([1.0, math.nan, 3.0], 0.5) == 1.0 and math.isnan(percentile([], 0.9))


def test_sim_trainer_logs_episode_metrics(tmp_path):
    cfg = config_from_dict(
        {"run_dir": str(tmp_path), "trainer": {"engine": "sim", "sim_time_per_token_s": 0.0}}
    )
    m = SimTrainer(cfg.trainer, cfg.algo).step(
        TrainBatch.build([multi_turn("g0/0", calls=[tool(0)]), multi_turn("g0/1")])
    )
    assert m["tokens"] == 12 and m["episode/tool_calls"] == 0.5
