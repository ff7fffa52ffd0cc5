"""kill -9 of a rollout while its agents' calls are in flight: the calls return normally.

    .venv/bin/python -m pytest tests/test_agent_faults.py -q      (~40 s: five processes)

Real processes over ipc in a private directory (the harness of tests/procs.py):
manager, buffer, sim trainer, rollout-0 alone and rollout-1 in another process, all
`python -m laminar node --role ROLE`, on the sim engine (each call ~1 s of decoding). Every
episode is tests/agent_fakes.py `three_call_agent` (three chat calls through the official openai
client, run by the rollout's agent worker processes), which logs each call's start and answer.
rollout-0 is killed (SIGKILL, its pid only) while one of its agents' second or third call is in
flight. Its agent workers live on (own sessions): their clients find the rollout that recovered
the episode (run_dir/agents/endpoints), repeat the call there, and close the episode there.
Then, from what the processes wrote:

  * no agent call failed, and a call that started before the kill returned after it;
  * every prompt consumed exactly once as a whole group, and the buffer journal agrees;
  * each trajectory's model runs are exactly the answers its agent got (the logprobs of each
    call, in order): the calls answered before the kill are kept as they were; each resumed
    episode's trajectory starts with the tokens recorded before the kill (rollout-1's log:
    agent_call_resumed, their count and crc32), and some call in flight was continued after
    tokens it had made before the kill (kept > 0);
  * rollout-0's orphaned agent workers leave once their episodes are done.
"""

from __future__ import annotations

import json
import os
import signal
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.procs import Procs, fault_config
from tests.sim_cluster import read_jsonl

PROMPTS = 6
GROUP = 2
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def procs(tmp_path, short_dir):
    cfg = fault_config(
        tmp_path,
        short_dir,
        name="agentfaults",
        prompts=PROMPTS,
        group=GROUP,
        roles={"manager": 1, "buffer": 1, "relay": 0, "trainer": 1, "rollout": 2},
        over={
            "rollout": {
                "partial_chunk_tokens": 4,
                "sampling": {"max_tokens": 400},
                "sim": {
                    "step_time_s": 0.05,
                    "length_p50": 16,
                    "length_p99_over_p50": 2,
                    "kv_capacity_tokens": 8 * 500,
                },
            },
            "agent": {
                "fn": "tests.agent_fakes:three_call_agent",
                "workers": 1,
                "episode_timeout_s": 60.0,
                "reconnect_timeout_s": 30.0,
            },
            "trainer": {"batch_groups": PROMPTS},  # one step: no new version while episodes run
            "manager": {"repack": {"enabled": False}},
        },
    )
    p = Procs(tmp_path, cfg, pythonpath=[REPO], env={"AGENT_TEST_CALLS": str(calls(tmp_path))})
    yield p
    p.stop_all()


def calls(tmp: Path) -> Path:
    """The agents' log of their calls (tests/agent_fakes.py writes it)."""
    return tmp / "calls.jsonl"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_rollout_killed_mid_agent_call_the_call_returns_and_nothing_twice(procs):
    for name, role, index in [
        ("manager", "manager", 0),
        ("buffer", "buffer", 0),
        ("trainer", "trainer", 0),
        ("rollout-0", "rollout", 0),
        ("rollout-1", "rollout", 1),
    ]:
        procs.start(name, role, index)
    r0 = procs.procs["rollout-0"].pid

    def in_flight() -> list[dict]:
        """rollout-0's agents' later calls in flight for a while (some tokens made)."""
        recs = read_jsonl(calls(procs.tmp))
        ended = {(r["uid"], r["k"]) for r in recs if r["event"] == "end"}
        now = time.time()
        return [
            r
            for r in recs
            if r["event"] == "start"
            and r["k"] >= 1
            and r["ppid"] == r0
            and (r["uid"], r["k"]) not in ended
            and now - r["t"] > 0.3
        ]

    procs.wait(in_flight, "a second or third call of rollout-0's agents in flight", every=0.1)
    t_kill = procs.kill9("rollout-0")
    procs.wait_trainer_done()
    # rollout-0's agent workers (not started by this test, but by the rollout it killed) leave
    # once their episodes are closed; they are waited for by pid, and stopped by pid if not
    orphans = {r["pid"] for r in read_jsonl(calls(procs.tmp)) if r.get("ppid") == r0}
    end = time.monotonic() + 30
    while any(alive(p) for p in orphans) and time.monotonic() < end:
        time.sleep(0.1)  # polling process exits under a deadline
    left = [p for p in orphans if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    procs.stop_all()
    assert not left, f"rollout-0's agent workers did not leave: {left}"

    # no agent call failed; calls in flight at the kill returned after it, normally
    recs = read_jsonl(calls(procs.tmp))
    assert not [r for r in recs if r["event"] == "error"], [r for r in recs if "error" in r][:3]
    ends = [r for r in recs if r["event"] == "end"]
    spanned = [r for r in ends if r["t0"] < t_kill < r["t"] and r["ppid"] == r0]
    assert spanned, "no call was in flight across the kill"

    # every prompt consumed exactly once, as a whole group; the buffer journal agrees
    steps, trajs = procs.check_exactly_once(PROMPTS, GROUP)
    uids = [u for rec in steps for u in rec["uids"]]

    # each trajectory's model runs are the answers its agent got, in order, token for token
    by_uid = {t.uid: t for t in trajs}
    answers: dict[str, dict[int, list[float]]] = {}
    for r in ends:
        answers.setdefault(r["uid"], {})[r["k"]] = r["logprobs"]
    for uid in uids:
        t = by_uid[uid]
        mask = t.loss_mask
        assert mask is not None
        cuts = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
        bounds = [0, *cuts.tolist(), len(mask)]
        model = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if mask[a] == 1]
        got = answers[uid]
        assert sorted(got) == [0, 1, 2] and len(model) == 3, (uid, sorted(got), len(model))
        for k, (a, b) in enumerate(model):
            assert b - a == len(got[k]) and np.allclose(t.logprobs[a:b], got[k], atol=1e-6), (
                uid,
                k,
                t.rollout_id,
                t.resumed,
                t.logprobs[a:b].tolist(),
                got[k],
            )
    moved = {r["uid"] for r in spanned}
    assert all(by_uid[u].rollout_id == "rollout-1" and by_uid[u].resumed >= 1 for u in moved)
    resumed = [
        json.loads(line)
        for line in procs.log("rollout-1").splitlines()
        if '"agent_call_resumed"' in line
    ]
    assert resumed and any(r["kept"] > 0 for r in resumed), resumed
    for r in resumed:  # the finished episode extends the tokens recorded before the kill
        head = by_uid[r["uid"]].response_ids[: r["recorded"]].astype(np.int32)
        assert len(head) == r["recorded"] and zlib.crc32(head.tobytes()) == r["recorded_crc32"]
    assert "agent_failed" not in procs.log("rollout-1")
    assert "restarted_from_prompt" not in procs.log("manager")
