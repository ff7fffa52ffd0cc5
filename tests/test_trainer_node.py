"""TrainerNode against a protocol-level fake buffer and fake manager (in-process, inproc).

    .venv/bin/python -m pytest tests/test_trainer_node.py -q

The fake buffer implements the trainer side of the buffer protocol exactly as
DESIGN/protocol/buffer.py state it: whole groups FIFO, a long-poll, batches in flight
until committed, restart=True puts in-flight batches back at the queue front,
duplicate commits are acknowledged. The real buffer is exercised with real
processes in tests/test_trainer_recovery.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from laminar.config import config_from_dict
from laminar.protocol.buffer import BatchCommit, BatchReply, BatchRequest, CommitAck
from laminar.protocol.core import NodeStatus
from laminar.protocol.trainer import VersionPublished
from laminar.transport.server import RpcServer
from laminar.transport.sockets import Wiring, new_context
from laminar.wiring.common import relay_links, socket_options
from laminar.wiring.nodes import build_node
from tests.test_trainer import make_trajs


class FakeBuffer:
    def __init__(self, ctx, endpoint, opts, groups):
        self.srv = RpcServer(ctx, endpoint, "buffer-0", "buffer", opts)
        self.srv.on(BatchRequest, self.on_batch)
        self.srv.on(BatchCommit, self.on_commit)
        self.queue = list(groups)  # list of lists of Trajectory (one list per group)
        self.inflight: dict[str, list] = {}
        self.requests: list[BatchRequest] = []
        self.commits: list[BatchCommit] = []
        self.served: list[tuple[str, list[str]]] = []
        self.commit_hook = None
        self.changed = asyncio.Event()
        self._n = 0

    async def on_batch(self, peer, req: BatchRequest):
        self.requests.append(req)
        if req.restart:
            back = [g for gs in self.inflight.values() for g in gs]
            self.queue[:0] = back
            self.inflight.clear()
        if len(self.queue) < req.groups:
            try:
                await asyncio.wait_for(self.changed.wait(), req.wait_s)
            except TimeoutError:
                pass
            return BatchReply()
        take, self.queue = self.queue[: req.groups], self.queue[req.groups :]
        self._n += 1
        bid = f"b{self._n}"
        self.inflight[bid] = take
        trajs = [t for g in take for t in g]
        self.served.append((bid, [t.uid for t in trajs]))
        return BatchReply(batch_id=bid, trajectories=trajs, group_ids=[g[0].group_id for g in take])

    async def on_commit(self, peer, c: BatchCommit):
        self.commits.append(c)
        if self.commit_hook is not None:
            await self.commit_hook(c)
        self.inflight.pop(c.batch_id, None)
        return CommitAck()


class FakeManager:
    def __init__(self, ctx, endpoint, opts, serving: dict[str, int] | None = None):
        # serving: the rollouts its heartbeats list to a buffer (laminar/manager/serving.py)
        status = NodeStatus(node_id="manager-0", role="manager", serving=serving or {})
        self.srv = RpcServer(ctx, endpoint, "manager-0", "manager", opts, status=lambda: status)
        self.published: list[VersionPublished] = []
        self.srv.on(VersionPublished, lambda peer, m: self.published.append(m))


def groups_of(trajs):
    out: dict[str, list] = {}
    for t in trajs:
        out.setdefault(t.group_id, []).append(t)
    return list(out.values())


def node_cfg(tmp_path: Path, model_path: str | None, **trainer):
    t = {
        "lr": 1e-3,
        "total_steps": 3,
        "batch_groups": 2,
        "batch_wait_s": 0.2,
        "micro_batch_tokens": 256,
        **trainer,
    }
    return config_from_dict(
        {
            "name": f"tn{abs(hash(str(tmp_path))) % 10**8}",
            "run_dir": str(tmp_path / "run"),
            "model": {"path": model_path},
            "trainer": t,
            "cluster": {"transport": "inproc", "roles": {"relay": 0}},
            "transport": {
                "heartbeat_interval_s": 0.05,
                "request_timeout_s": 2.0,
                "startup_timeout_s": 5.0,
            },
            "rollout": {"sampling": {"max_tokens": 16}},
        }
    )


@pytest.fixture
async def harness(tmp_path):
    ctx = new_context()
    made = []

    async def make(cfg, groups):
        opts = socket_options(cfg)
        buf = FakeBuffer(ctx, cfg.endpoint("buffer"), opts, groups)
        mgr = FakeManager(ctx, cfg.endpoint("manager"), opts)
        await buf.srv.start()
        await mgr.srv.start()
        made.extend([buf.srv, mgr.srv])
        return buf, mgr

    yield ctx, make
    for srv in made:
        await srv.close()
    ctx.destroy(linger=0)


async def run_trainer(cfg, ctx, timeout=60.0):

    node = build_node(cfg, "trainer", ctx=ctx)
    await asyncio.wait_for(node.run(), timeout)
    return node


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


async def test_torch_trainer_trains_publishes_commits_and_checkpoints(tiny, tmp_path, harness):
    ctx, make = harness
    cfg = node_cfg(tmp_path, tiny, checkpoint_every=2)
    buf, mgr = await make(cfg, groups_of(make_trajs(n_groups=6, group=2)))
    node = await run_trainer(cfg, ctx)
    assert node.step == 3 and node.version == 3
    assert [(c.batch_id, c.step, c.version) for c in buf.commits] == [
        ("b1", 1, 1),
        ("b2", 2, 2),
        ("b3", 3, 3),
    ]
    assert buf.requests[0].restart and not any(r.restart for r in buf.requests[1:])
    assert [r.trainer_version for r in buf.requests] == [0, 1, 2]
    assert [m.version for m in mgr.published] == [1, 2, 3] and mgr.published[-1].handoff == "direct"
    run = cfg.resolved_run_dir()
    assert (
        Path(mgr.published[-1].uri) == run / "weights" / "v3.safetensors"
        and Path(mgr.published[-1].uri).is_file()
    )
    lines = read_jsonl(run / "metrics.jsonl")
    assert [x["step"] for x in lines] == [1, 2, 3]
    for key in (
        "loss",
        "reward",
        "adv/mean",
        "is/ess",
        "grad_norm",
        "staleness",
        "tokens_per_s",
        "step_s",
        "lr",
        "version",
    ):
        assert key in lines[-1], key
    assert (
        lines[-1]["staleness_hist/2"] == 4
    )  # version-0 data (2 groups x 2) consumed by the version-2 trainer
    assert [p.name for p in (run / "checkpoints").iterdir()] and (
        run / "checkpoints" / "step_00000003"
    ).is_dir()
    assert (run / "tb").is_dir()
    consumed = read_jsonl(run / "consumed.jsonl")
    assert [c["uids"] for c in consumed] == [uids for _, uids in buf.served]


async def test_sim_trainer_emulates_steps_and_resumes(tmp_path, harness):
    ctx, make = harness
    cfg = node_cfg(tmp_path, None, engine="sim", sim_time_per_token_s=1e-5, total_steps=2)
    buf, mgr = await make(cfg, groups_of(make_trajs(n_groups=8, group=2)))
    node = await run_trainer(cfg, ctx)
    assert node.step == 2 and [c.version for c in buf.commits] == [1, 2]
    assert mgr.published[-1].handoff == "sim"
    # a second run with more steps resumes from the sim checkpoint (counters, no model)
    cfg2 = cfg.model_copy(deep=True)
    cfg2.trainer.total_steps = 3
    node = await run_trainer(cfg2, ctx)
    assert node.step == 3 and [c.step for c in buf.commits] == [1, 2, 3]
    assert buf.requests[-2].restart is False and sum(r.restart for r in buf.requests) == 2


async def test_audit_line_accounts_for_served_trajectories_not_trained_on(tmp_path, harness):
    """consumed.jsonl: a sample without a reward (e.g. its reward timed out) and the member a
    group is left with are listed as excluded, so every served uid is in the audit."""
    ctx, make = harness
    cfg = node_cfg(tmp_path, None, engine="sim", sim_time_per_token_s=1e-5, total_steps=1)
    trajs = make_trajs(n_groups=2, group=2)
    trajs[0].reward = None  # its group keeps one usable member: dropped whole (singleton_group)
    buf, _ = await make(cfg, groups_of(trajs))
    await run_trainer(cfg, ctx)
    [line] = read_jsonl(cfg.resolved_run_dir() / "consumed.jsonl")
    served = buf.served[0][1]
    assert sorted(line["uids"] + line["excluded"]) == sorted(served)
    assert sorted(line["excluded"]) == sorted([trajs[0].uid, trajs[1].uid])
    assert trajs[0].group_id == trajs[1].group_id


async def test_commit_checkpoint_mode_commits_only_what_a_checkpoint_holds(tmp_path, harness):
    ctx, make = harness
    cfg = node_cfg(
        tmp_path,
        None,
        engine="sim",
        sim_time_per_token_s=0,
        commit="checkpoint",
        checkpoint_every=2,
    )
    buf, _ = await make(cfg, groups_of(make_trajs(n_groups=6, group=2)))
    ckpts = cfg.resolved_run_dir() / "checkpoints"
    seen = []

    async def hook(c):
        seen.append((c.step, sorted(p.name for p in ckpts.iterdir() if not p.name.startswith("."))))

    buf.commit_hook = hook
    await run_trainer(cfg, ctx)
    # steps 1, 2 commit after step_2 is on disk; step 3 after the final checkpoint
    assert [s for s, _ in seen] == [1, 2, 3]
    assert (
        "step_00000002" in seen[0][1]
        and "step_00000002" in seen[1][1]
        and "step_00000003" in seen[2][1]
    )


async def test_killed_before_commit_the_batch_is_served_again_after_resume(tiny, tmp_path, harness):
    ctx, make = harness
    cfg = node_cfg(tmp_path, tiny, checkpoint_every=1, total_steps=3)
    buf, mgr = await make(cfg, groups_of(make_trajs(n_groups=6, group=2)))
    reached = asyncio.Event()

    async def hang_on_second_commit(c):
        if c.step == 2:
            reached.set()
            await asyncio.Event().wait()  # never acknowledged: the trainer dies waiting

    buf.commit_hook = hang_on_second_commit

    node = build_node(cfg, "trainer", ctx=ctx)
    task = asyncio.create_task(node.run())
    await asyncio.wait_for(reached.wait(), 60)
    task.cancel()  # abrupt death: no drain, no checkpoint of step 2
    with pytest.raises(asyncio.CancelledError):
        await task
    buf.commit_hook = None
    buf.commits = [c for c in buf.commits if c.step != 2]  # the hung one never completed
    second = buf.served[1][1]
    node = await run_trainer(cfg, ctx)
    # resumed from step_1: batch 2 (in flight) came back first after restart=True, then batch 3
    assert [uids for _, uids in buf.served[2:]] == [second, buf.served[3][1]]
    assert node.step == 3
    assert [c.step for c in buf.commits] == [1, 2, 3]
    # step 2 had been published (version 2) before the crash: the resumed trainer re-published its
    # step-1 weights as version 3, so versions never name two different weight sets
    assert [m.version for m in mgr.published] == [1, 2, 3, 4, 5]
    assert [(m.version, m.step) for m in mgr.published[2:]] == [(3, 1), (4, 2), (5, 3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from laminar.models.tiny import build_tiny_model

    return str(
        build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=32, layers=1, heads=2, kv_heads=1)
    )


async def test_weights_go_through_the_relay_tier_when_there_is_one(tiny, tmp_path, harness):
    """roles.relay > 0: the weights channel is the relay tier; the trainer pushes to the master
    relay."""
    from laminar.supervise import detached_spawn
    from laminar.weights.puller import WeightPuller

    ctx, make = harness
    cfg = node_cfg(tmp_path, tiny, total_steps=2)
    cfg.cluster.roles = {"manager": 1, "buffer": 1, "relay": 1, "trainer": 1, "rollout": 0}
    cfg.relay.shm_dir = str(tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    buf, mgr = await make(cfg, groups_of(make_trajs(n_groups=4, group=2)))
    relay = build_node(cfg, "relay", ctx=ctx)
    relay_task = asyncio.create_task(relay.run())
    try:
        await asyncio.wait_for(relay.ready.wait(), 10)
        node = await run_trainer(cfg, ctx)
        assert [(m.version, m.handoff) for m in mgr.published] == [(1, "relay"), (2, "relay")]
        assert all(m.stall_s >= 0 and m.num_bytes > 0 for m in mgr.published)
        puller = WeightPuller(
            relay_links(cfg),
            Wiring(ctx, relay.opts, "reader-0", "rollout", relay.log, detached_spawn),
        )
        await puller.start()
        try:
            assert await puller.wait_version(2, timeout=10) == 2
            w = await puller.pull()
            got = {k: v.clone() for k, v in w.named_tensors()}
            await w.release()
        finally:
            await puller.close()
        from laminar.trainer import checkpoint as ck
        from laminar.trainer.torch_trainer import TorchTrainer
        from laminar.wiring.trainer import trainer_settings

        final = ck.latest_checkpoint(cfg.resolved_run_dir())
        expect = TorchTrainer(trainer_settings(cfg), str(final / "model")).model.full_state_dict()
        assert got.keys() == expect.keys() and all(torch.equal(got[k], expect[k]) for k in expect)
        assert node.version == 2
        # streamed into the relay's slot (laminar/weights/sink.py); the digest rollouts attest
        # against came from the streamed bytes
        assert node.trainer is not None and node.trainer.stream_layout() is not None
        from laminar.weights.digest import weights_digest

        assert mgr.published[-1].digest == weights_digest(got.items())
        for line in read_jsonl(cfg.resolved_run_dir() / "metrics.jsonl"):
            assert line["weights_stall_s"] >= line["export_s"] + line["push_s"] > 0
    finally:
        relay.request_stop("test done")
        await asyncio.wait_for(relay_task, 10)


async def test_sim_trainer_pushes_a_tiny_blob_through_the_relay(tmp_path, harness):

    ctx, make = harness
    cfg = node_cfg(tmp_path, None, engine="sim", sim_time_per_token_s=0, total_steps=2)
    cfg.cluster.roles = {"manager": 1, "buffer": 1, "relay": 1, "trainer": 1, "rollout": 0}
    cfg.relay.shm_dir = str(tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    cfg.trainer.sim_weight_bytes = 1024
    buf, mgr = await make(cfg, groups_of(make_trajs(n_groups=4, group=2)))
    relay = build_node(cfg, "relay", ctx=ctx)
    relay_task = asyncio.create_task(relay.run())
    try:
        await asyncio.wait_for(relay.ready.wait(), 10)
        await run_trainer(cfg, ctx)
        assert [(m.version, m.handoff, m.num_bytes) for m in mgr.published] == [
            (1, "relay", 1024),
            (2, "relay", 1024),
        ]
    finally:
        relay.request_stop("test done")
        await asyncio.wait_for(relay_task, 10)


async def test_stop_request_drains_the_step_and_checkpoints(tiny, tmp_path, harness):
    """SIGTERM path: the step in flight finishes and commits, then a checkpoint holds it."""
    from laminar.trainer import checkpoint as ck

    ctx, make = harness
    cfg = node_cfg(tmp_path, tiny, total_steps=100)
    buf, _ = await make(cfg, groups_of(make_trajs(n_groups=40, group=2)))
    two = asyncio.Event()

    async def on_commit(c):
        if c.step == 2:
            two.set()

    buf.commit_hook = on_commit
    node = build_node(cfg, "trainer", ctx=ctx)
    task = asyncio.create_task(node.run())
    await asyncio.wait_for(two.wait(), 60)
    node.request_stop("signal SIGTERM")
    await asyncio.wait_for(task, 30)
    last = ck.latest_checkpoint(cfg.resolved_run_dir())
    assert last is not None and json.loads((last / "meta.json").read_text())["reason"] == "stop"
    assert int(last.name.split("_")[1]) == node.step >= 2
    assert [c.step for c in buf.commits] == list(
        range(1, node.step + 1)
    )  # all trained steps committed


async def test_trainer_finishes_when_the_buffer_says_data_is_exhausted(tmp_path, harness):
    ctx, make = harness
    cfg = node_cfg(tmp_path, None, engine="sim", sim_time_per_token_s=0, total_steps=100)
    buf, _ = await make(cfg, groups_of(make_trajs(n_groups=4, group=2)))
    plain = buf.on_batch

    async def exhausted_when_empty(peer, req):
        reply = await plain(peer, req)
        if not reply.trajectories:
            reply.exhausted = not buf.queue and not buf.inflight
        return reply

    buf.srv.on(BatchRequest, exhausted_when_empty)
    node = await run_trainer(cfg, ctx)
    assert node.step == 2 and node.exhausted and "data exhausted" in node.stop_reason
