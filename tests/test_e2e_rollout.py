"""End to end on CPU: the real buffer node, two torch rollouts with a tiny random model, a real
reward.

    .venv/bin/python -m pytest tests/test_rollout_e2e.py -q

Everything runs in this process over inproc (LocalCluster): manager, buffer (with
its journal in tmp_path), two rollouts with TorchEngine on a locally built tiny
character-level model, and the count-up task's reward in a spawned worker process.
The second test stops the buffer abruptly while the rollouts keep generating and
restarts it on the same run dir: every trajectory must end up stored exactly once.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from laminar.cluster import LocalCluster
from laminar.config import config_from_dict
from laminar.tasks import countup

PROMPTS = [
    countup.make_prompt(a, b, t)
    for a, b, t in [
        (10, 3, 20),
        (37, 8, 60),
        (5, 9, 40),
        (21, 4, 33),
        (50, 7, 70),
        (12, 2, 19),
        (3, 5, 30),
        (44, 6, 58),
    ]
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from laminar.models.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model",
        alphabet=countup.ALPHABET,
        hidden=32,
        layers=1,
        heads=2,
        kv_heads=1,
        max_positions=128,
    )


def make_cfg(tmp: Path, model: Path, name: str, prompts: list[str], **rollout: Any):
    data = tmp / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p, "answer": countup.answer_of(p)}) + "\n" for p in prompts)
    )
    return config_from_dict(
        {
            "name": name,
            "run_dir": str(tmp / "run"),
            "cluster": {"transport": "inproc", "roles": {"manager": 1, "buffer": 1, "rollout": 2}},
            # 2 busy cores: death after 1 s of silence, not 0.2 s (torch steps hold the GIL in
            # bursts)
            "transport": {
                "heartbeat_interval_s": 0.1,
                "heartbeat_liveness": 10,
                "request_timeout_s": 1.0,
                "startup_timeout_s": 30.0,
                "stop_timeout_s": 5.0,
                "reconnect_backoff_s": 0.02,
                "reconnect_backoff_max_s": 0.1,
            },
            "model": {"path": str(model)},
            "data": {"train": str(data), "epochs": 1, "shuffle": False},
            "reward": {"fn": "laminar.tasks.countup:reward", "workers": 1, "timeout_s": 10.0},
            "rollout": {
                "engine": "torch",
                "group_size": 2,
                "credits": 2,
                "max_running": 8,
                "partial_chunk_tokens": 4,
                "weights": "dir",
                "prompt_retry_s": 0.05,
                "sampling": {"max_tokens": 12, "temperature": 1.0},
                **rollout,
            },
            "buffer": {"retry_after_s": 0.05},
        }
    )


def stored(buffer: Any) -> dict[str, Any]:
    """uid -> Trajectory of every finished sample the buffer holds."""
    return {t.uid: t for g in buffer.state.groups.values() for t in g.members.values()}


async def wait_for(cond: Any, timeout: float, what: str, cluster: LocalCluster) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        cluster.check()
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)  # poll of a condition with no event of its own, under a deadline


async def test_buffer_and_two_torch_rollouts_produce_rewarded_trajectories(tmp_path, tiny_model):
    cfg = make_cfg(tmp_path, tiny_model, "e2e-a", PROMPTS)
    want = len(PROMPTS) * cfg.rollout.group_size
    async with LocalCluster(cfg) as cluster:
        buffer = cluster.node("buffer-0")
        await wait_for(lambda: len(stored(buffer)) == want, 60, f"{want} trajectories", cluster)
        trajs = stored(buffer)
        tok = cluster.node("rollout-0").deliverer.tokenizer
        for t in trajs.values():
            assert t.version == 0 and t.finish_reason in ("stop", "length")
            assert 1 <= len(t.response_ids) <= 12 and len(t.logprobs) == len(t.response_ids)
            assert (t.logprobs <= 0).all()
            assert t.reward in (0.0, 1.0) and "format" in t.reward_info, t.reward_info
            assert t.prompt in PROMPTS and t.row["answer"] == countup.answer_of(t.prompt)
            assert t.completion == tok.decode(t.response_ids.tolist(), skip_special_tokens=True)
        # which rollout took which group is a race (the first one ready may take them all)
        assert {t.rollout_id for t in trajs.values()} <= {"rollout-0", "rollout-1"}
        groups = list(buffer.state.groups.values())
        assert len(groups) == len(PROMPTS) and all(g.state == "ready" for g in groups)
        assert all(len({t.version for t in g.members.values()}) == 1 for g in groups)
        rollouts = cluster.role("rollout")
        assert all(r.rewards.stats["errors"] == 0 for r in rollouts)
        assert sum(r.rewards.stats["calls"] for r in rollouts) >= len(trajs)


async def test_buffer_cut_off_and_restarted_loses_and_duplicates_nothing(tmp_path, tiny_model):
    prompts = PROMPTS * 2  # the same prompt served twice is two groups (distinct group ids)
    # longer samples than the first test: the cut must land while groups are still being generated
    cfg = make_cfg(
        tmp_path,
        tiny_model,
        "e2e-b",
        prompts,
        credits=3,
        sampling={"max_tokens": 40, "temperature": 1.0},
    )
    want = len(prompts) * cfg.rollout.group_size
    n_rollouts = cfg.cluster.roles["rollout"]
    cfg.cluster.roles["rollout"] = 0
    async with LocalCluster(cfg) as cluster:
        # the rollouts start while this test watches: started one after the other by the cluster,
        # the first could finish every group while the second is still loading its model
        adding = [asyncio.ensure_future(cluster.add("rollout", i)) for i in range(n_rollouts)]
        # cut it off while groups are in hand, so finished work has to wait in the outboxes
        await wait_for(
            lambda: (
                len(stored(cluster.node("buffer-0"))) >= 2
                and sum(len(r.table.groups) for r in cluster.role("rollout") if r.ready.is_set())
                >= 2
            ),
            60,
            "a few trajectories stored and more in hand",
            cluster,
        )
        rollouts = list(await asyncio.gather(*adding))
        await cluster.kill_node("buffer-0")  # abrupt: no drain, sockets closed
        # the rollouts keep generating the groups in hand; finished ones wait in their outboxes
        await wait_for(
            lambda: sum(len(r.outbox) for r in rollouts) >= 2, 30, "outboxes filling", cluster
        )
        # the outage itself (the behaviour under test), twice the death deadline
        await asyncio.sleep(2.0)
        buffer = await cluster.add("buffer", 0)  # same run dir: replays its journal
        await wait_for(
            lambda: len(stored(buffer)) == want,
            60,
            f"{want} trajectories after the restart",
            cluster,
        )
        # stored is before acked: the last acks may still be on their way to the rollouts
        await wait_for(
            lambda: all(len(r.outbox) == 0 for r in rollouts), 30, "every outbox acked", cluster
        )
        trajs = stored(buffer)
        assert len(trajs) == want
        assert {(t.group_id, t.sample_index) for t in trajs.values()} == {
            (g.group_id, i) for g in buffer.state.groups.values() for i in range(g.n)
        }
        assert len(buffer.state.groups) == len(prompts)
        assert sum(r.outbox.stats["retries"] for r in rollouts) > 0
        dup = buffer.metrics.counters.get("trajectories_duplicate", 0)
        print(f"resent-and-deduplicated trajectories after the restart: {dup}")
