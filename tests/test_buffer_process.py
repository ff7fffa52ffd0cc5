"""Buffer as a real process, killed with kill -9 mid-stream and restarted on the same run_dir.

    .venv/bin/python -m pytest tests/test_buffer_process.py -q

A manager and a buffer run as `python -m laminar node --role ...` processes. The test is the
rollout: it streams finished trajectories from 4 concurrent senders (each resent until acked,
like laminar.rollout.outbox), SIGKILLs the buffer by pid after some acks, starts a new buffer
process, and finishes the stream. Then it drains every batch: every acknowledged trajectory
is there, exactly once, and nothing else is. Also a trainer-side check: a batch served (not
committed) before the kill comes back after the restart, and commits stay final.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

from laminar.config import load_config
from laminar.protocol.buffer import BatchCommit, BatchRequest, BufferStatsRequest, PromptRequest
from laminar.protocol.data import Trajectory
from laminar.transport.client import RpcClient
from laminar.transport.sockets import TransportError, new_context
from laminar.wiring.common import socket_options
from tests.serving import serving_rollout

GROUPS, N = 12, 4


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:  # only the processes this test started, by pid
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()


def node(cfg_path: Path, role: str, log: Path, procs: list) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "ab") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", "laminar", "node", "--role", role, "--config", str(cfg_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    procs.append(p)
    return p


def trajectory(item, i: int) -> Trajectory:
    ids = np.arange(5 + i, dtype=np.int32)
    return Trajectory(
        uid=f"{item.group_id}/{i}",
        group_id=item.group_id,
        prompt_uid=item.uid,
        sample_index=i,
        prompt_ids=item.prompt_ids,
        response_ids=ids,
        logprobs=np.full(len(ids), -0.3, np.float32),
        version=0,
        reward=float(i % 2),
        finish_reason="stop",
        rollout_id="r0",
    )


@pytest.mark.parametrize("fsync", ["never", "always"])
async def test_kill_9_mid_stream_keeps_every_acked_trajectory_once(tmp_path, procs, fsync):
    ipc_dir = tempfile.mkdtemp(prefix="lamk-", dir="/tmp")
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(50))
    )
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(
        yaml.safe_dump(
            {
                "name": f"kill{uuid.uuid4().hex[:6]}",
                "run_dir": str(tmp_path / "run"),
                "cluster": {"transport": "ipc", "ipc_dir": ipc_dir},
                "transport": {
                    "heartbeat_interval_s": 0.1,
                    "heartbeat_liveness": 5,
                    "request_timeout_s": 2.0,
                    "request_retries": 0,
                    "startup_timeout_s": 30.0,
                },
                "logging": {"level": "info", "json_logs": True},
                "data": {"train": str(data)},
                # credits: the fake rollout holds all GROUPS open at once (2 x credits)
                "rollout": {"group_size": N, "credits": GROUPS // 2},
                "trainer": {"batch_groups": 2},
                "buffer": {"fsync": fsync},
            }
        )
    )
    cfg = load_config(cfg_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    node(cfg_path, "manager", logs / "manager.log", procs)
    buffer = node(cfg_path, "buffer", logs / "buffer.log", procs)
    ctx = new_context()
    opts = socket_options(cfg)
    rollout = RpcClient(ctx, cfg.endpoint("buffer"), "r0", "rollout", opts)
    trainer = RpcClient(ctx, cfg.endpoint("buffer"), "t0", "trainer", opts)
    beats: list[RpcClient] = []
    try:
        await rollout.connect(timeout=30)
        await trainer.connect(timeout=30)
        # the manager lists it as serving: the buffer serves it prompts
        beats.append(await serving_rollout(ctx, cfg, "r0", opts, timeout=30))
        items = []
        while len(items) < GROUPS:
            rep = await rollout.request(
                PromptRequest(rollout_id="r0", max_groups=GROUPS - len(items), version=0)
            )
            items += rep.items
            if not rep.items:  # not_member until the manager's next heartbeat names it
                await asyncio.sleep(rep.retry_after_s)
        # the first two groups complete and are served to the trainer before the crash, uncommitted
        first = [trajectory(it, i) for it in items[:2] for i in range(N)]
        for t in first:
            await rollout.request(t)
        before = await trainer.request(
            BatchRequest(trainer_id="t0", groups=2, trainer_version=0, wait_s=5)
        )
        assert len(before.trajectories) == 2 * N

        queue = [trajectory(it, i) for it in items[2:] for i in range(N)]
        acked: set[str] = {t.uid for t in first}
        killed = asyncio.Event()
        acked_at_kill = []

        async def sender() -> None:
            while queue:
                t = queue.pop(0)
                deadline = time.monotonic() + 60
                while True:  # resend until acked, like the rollout outbox
                    try:
                        await rollout.request(t, timeout=1.0, retries=0)
                        acked.add(t.uid)
                        break
                    except (TransportError, asyncio.CancelledError) as exc:
                        # a send pending while the client swaps its socket (reconnect) surfaces as
                        # CancelledError from pyzmq (transport issue, reported); our task was not
                        # cancelled
                        if (
                            isinstance(exc, asyncio.CancelledError)
                            and asyncio.current_task().cancelling()
                        ):
                            raise
                        assert time.monotonic() < deadline, f"{t.uid} never acked"
                        await asyncio.sleep(0.05)  # resend backoff
                if len(acked) >= len(first) + 12 and not killed.is_set():
                    killed.set()
                    acked_at_kill.append(len(acked))
                    os.kill(
                        buffer.pid, signal.SIGKILL
                    )  # mid-stream: other senders have requests in flight

        senders = [asyncio.create_task(sender()) for _ in range(4)]
        await asyncio.wait_for(killed.wait(), 30)
        assert buffer.wait(10) == -signal.SIGKILL
        node(cfg_path, "buffer", logs / "buffer.log", procs)  # same config, same run_dir
        await asyncio.wait_for(asyncio.gather(*senders), 90)
        assert len(acked) == GROUPS * N and acked_at_kill[0] < GROUPS * N

        stats = await trainer.request(BufferStatsRequest(), timeout=5)
        assert stats.counts["trajectories"] == GROUPS * N and stats.held == GROUPS * N
        assert stats.groups_outstanding == 2  # the batch served before the crash survived it
        # a restarted trainer gets the uncommitted batch back first, then the rest, each trajectory
        # once
        seen: list[str] = []
        restart = True
        while len(seen) < GROUPS * N:
            b = await trainer.request(
                BatchRequest(
                    trainer_id="t0", groups=2, trainer_version=0, wait_s=2, restart=restart
                ),
                timeout=5,
            )
            if restart:
                assert sorted(t.uid for t in b.trajectories) == sorted(
                    t.uid for t in before.trajectories
                )
            restart = False
            assert b.trajectories, b
            seen += [t.uid for t in b.trajectories]
            assert (
                await trainer.request(
                    BatchCommit(batch_id=b.batch_id, step=1, version=0), timeout=5
                )
            ).ok
        assert len(seen) == len(set(seen)) == GROUPS * N and set(seen) == acked
        again = await trainer.request(
            BatchRequest(trainer_id="t0", groups=1, trainer_version=0, wait_s=0), timeout=5
        )
        assert again.trajectories == [] and again.exhausted is False
    finally:
        for cli in (rollout, trainer, *beats):
            await cli.close()
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)
    log = (logs / "buffer.log").read_text()
    assert '"event": "journal_replayed"' in log and "Traceback" not in log
