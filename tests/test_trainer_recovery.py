"""Exactly-once against the real buffer: the trainer dies after consuming a batch but before
committing it; after resume the buffer serves that batch again, and nothing else twice.

    .venv/bin/python -m pytest tests/test_trainer_recovery.py -q            (in-process, fast)
    .venv/bin/python -m pytest tests/test_trainer_recovery.py -q -m slow    (real trainer processes)

The real BufferNode (journal on) and a fake manager run in this test process. A fake
rollout fills the buffer through the normal protocol (PromptRequest -> Trajectory).
Run 1 of the trainer has a fault injected before the commit of step 2
(tests/trainer_faults.py): it trains step 1 (commit, checkpoint), trains step 2 and dies
before committing it — as a real subprocess (`python tests/trainer_faults.py 2 node
--role trainer ...`, exit code 17) in the slow test, or in-process by an exception (no
drain, no checkpoint) in the fast one. Run 2 (no fault) resumes from step_1 and must be
served step 2's batch again.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from laminar.config import load_config
from laminar.protocol.buffer import BufferStats, BufferStatsRequest, PromptReply, PromptRequest
from laminar.protocol.data import Trajectory
from laminar.transport.client import RpcClient
from laminar.transport.sockets import new_context
from laminar.wiring.common import socket_options
from laminar.wiring.nodes import build_node
from tests.serving import until_members
from tests.test_trainer_node import FakeManager
from tests.trainer_faults import CRASH_EXIT_CODE, crash_before_commit

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from laminar.models.tiny import build_tiny_model

    return str(
        build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=32, layers=1, heads=2, kv_heads=1)
    )


def write_config(tmp: Path, ipc_dir: Path, model: str) -> Path:
    data = tmp / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(10, 30)
        )
    )
    cfg = {
        "name": "recov",
        "run_dir": str(tmp / "run"),
        "model": {"path": model},
        "cluster": {
            "transport": "ipc",
            "ipc_dir": str(ipc_dir),
            "roles": {"manager": 1, "buffer": 1, "relay": 0, "trainer": 1, "rollout": 0},
        },
        "transport": {
            "heartbeat_interval_s": 0.2,
            "heartbeat_liveness": 10,
            "startup_timeout_s": 60,
            "request_timeout_s": 5,
        },
        "data": {"train": str(data), "chat_template": False, "shuffle": False},
        "rollout": {"group_size": 2, "sampling": {"max_tokens": 8}},
        "buffer": {"fsync": "never"},
        "trainer": {
            "total_steps": 3,
            "batch_groups": 2,
            "checkpoint_every": 1,
            "batch_wait_s": 0.5,
            "lr": 1e-3,
            "micro_batch_tokens": 512,
        },
        "logging": {"level": "info", "json_logs": True},
    }
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def fill_buffer(cfg, ctx, groups: int) -> None:
    """A fake rollout: ask for prompt groups, answer every sample (behaviour logprob -2, reward
    0/1)."""
    cli = RpcClient(ctx, cfg.endpoint("buffer"), "rollout-0", "rollout", socket_options(cfg))
    await cli.connect(timeout=10)
    rng = np.random.default_rng(0)
    got = 0
    try:
        while got < groups:
            reply = await cli.request(
                PromptRequest(rollout_id="rollout-0", max_groups=groups - got, version=0), timeout=5
            )
            assert isinstance(reply, PromptReply), reply
            for item in reply.items:
                for i in range(item.n):
                    resp = rng.integers(4, 20, size=int(rng.integers(2, 6))).astype(np.int32)
                    t = Trajectory(
                        uid=f"{item.group_id}/{i}",
                        group_id=item.group_id,
                        prompt_uid=item.uid,
                        sample_index=i,
                        prompt_ids=item.prompt_ids,
                        response_ids=resp,
                        logprobs=np.full(len(resp), -2.0, np.float32),
                        version=0,
                        finish_reason="stop",
                        reward=float(i % 2),
                        rollout_id="rollout-0",
                    )
                    await cli.request(t, timeout=5)
                got += 1
    finally:
        await cli.close()


async def run_trainer_process(cfg_path: Path, crash_at: int | None, timeout: float = 120) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    entry = (
        ["-m", "laminar"]
        if crash_at is None
        else [str(ROOT / "tests" / "trainer_faults.py"), str(crash_at)]
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *entry,
        "node",
        "--role",
        "trainer",
        "--config",
        str(cfg_path),
        cwd=str(ROOT),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()  # only the process this test started, by its handle
        await proc.wait()
        raise AssertionError(
            f"trainer process {proc.pid} did not finish within {timeout}s"
        ) from None
    if proc.returncode not in (0, CRASH_EXIT_CODE):
        raise AssertionError(f"trainer exited {proc.returncode}:\n{err.decode()[-3000:]}")
    return proc.returncode


async def _scenario(tmp_path, short_dir, tiny, run_trainer) -> None:

    cfg_path = write_config(tmp_path, short_dir, tiny)
    cfg = load_config(cfg_path)
    ctx = new_context()
    serving = {"rollout-0": cfg.rollout.max_running}  # fill_buffer's fake rollout
    mgr = FakeManager(ctx, cfg.endpoint("manager"), socket_options(cfg), serving)
    await mgr.srv.start()
    buffer = build_node(cfg, "buffer", ctx=ctx)
    task = asyncio.create_task(buffer.run())
    try:
        await asyncio.wait_for(buffer.ready.wait(), 30)
        await until_members(buffer, serving)
        await fill_buffer(cfg, ctx, groups=6)
        await run_trainer(ctx, cfg_path, crash_at=2)
        run = cfg.resolved_run_dir()
        first = [json.loads(x) for x in (run / "consumed.jsonl").read_text().splitlines()]
        assert [c["step"] for c in first] == [1, 2]
        assert buffer.stats().counters.get("batches_served") == 2
        assert len(buffer.state.outstanding()) == 1  # step 2's batch: served, never committed
        await run_trainer(ctx, cfg_path, crash_at=None)
        consumed = [json.loads(x) for x in (run / "consumed.jsonl").read_text().splitlines()]
        second = consumed[2:]
        assert [c["step"] for c in second] == [2, 3]
        assert sorted(second[0]["uids"]) == sorted(
            first[1]["uids"]
        )  # the uncommitted batch, served again
        trained = [u for c in consumed[:1] + second for u in c["uids"]]
        assert len(trained) == len(set(trained)) == 12  # every trajectory trained exactly once
        stats = await _stats(cfg, ctx)
        assert stats.counters.get("batches_served") == 4
        assert stats.counters.get("commits_requeued", 0) == 0
        assert not buffer.state.outstanding()
    finally:
        buffer.request_stop("test done")
        await asyncio.wait_for(task, 30)
        await mgr.srv.close()
        ctx.destroy(linger=0)


async def test_uncommitted_batch_is_served_again_after_resume_in_process(tiny, tmp_path, short_dir):
    from laminar.node import NodeFailed
    from laminar.trainer.commits import CommitLedger

    async def run_in_process(ctx, cfg_path, crash_at):
        node = build_node(load_config(cfg_path), "trainer", ctx=ctx)
        if crash_at is None:
            await asyncio.wait_for(node.run(), 120)
            return
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(CommitLedger, "record", crash_before_commit(crash_at))
            with pytest.raises(NodeFailed, match="task") as failed:
                await asyncio.wait_for(node.run(), 120)
        assert "fault injected" in str(failed.value.__cause__)

    await _scenario(tmp_path, short_dir, tiny, run_in_process)


@pytest.mark.slow
async def test_uncommitted_batch_is_served_again_after_resume_real_processes(
    tiny, tmp_path, short_dir
):
    async def run_process(ctx, cfg_path, crash_at):
        assert await run_trainer_process(cfg_path, crash_at) == (
            0 if crash_at is None else CRASH_EXIT_CODE
        )

    await _scenario(tmp_path, short_dir, tiny, run_process)


async def _stats(cfg, ctx):
    cli = RpcClient(ctx, cfg.endpoint("buffer"), "probe", "cli", socket_options(cfg))
    try:
        await cli.connect(timeout=5)
        reply = await cli.request(BufferStatsRequest(), timeout=5)
        assert isinstance(reply, BufferStats)
        return reply
    finally:
        await cli.close()
