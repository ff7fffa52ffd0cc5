"""kill -9 of a rollout while its agents' calls are in flight: the calls return normally.

    .venv/bin/python -m pytest tests/test_agent_faults.py -q      (~40 s: five processes)

Real processes over ipc in a private directory (the pattern of tests/test_multiturn_faults.py):
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
import subprocess
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from laminar.config import load_config
from tests.sim_cluster import PROCESS_FAULT_TRANSPORT, read_jsonl, write_prompts

PROMPTS = 6
GROUP = 2
DEADLINE_S = 150.0
REPO = Path(__file__).resolve().parents[1]


class Procs:
    """The nodes of this test: start by role, kill -9 by name, stop all (only these pids)."""

    def __init__(self, tmp: Path, ipc_dir: Path):
        self.tmp = tmp
        self.calls = tmp / "calls.jsonl"
        cfg = {
            "name": "agentfaults",
            "mode": "laminar",
            "run_dir": str(tmp / "run"),
            "cluster": {
                "transport": "ipc",
                "ipc_dir": str(ipc_dir),
                "roles": {"manager": 1, "buffer": 1, "relay": 0, "trainer": 1, "rollout": 2},
            },
            "transport": dict(PROCESS_FAULT_TRANSPORT),
            "data": {
                "train": str(write_prompts(tmp / "prompts.jsonl", PROMPTS)),
                "epochs": 1,
                "shuffle": False,
            },
            "rollout": {
                "engine": "sim",
                "group_size": GROUP,
                "credits": 2,
                "max_running": 8,
                "partial_chunk_tokens": 4,
                "prompt_retry_s": 0.1,
                "refresh_wait_s": 2.0,
                "sampling": {"max_tokens": 400},
                "sim": {
                    "step_time_s": 0.05,
                    "bound_b": 8,
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
            "trainer": {
                "engine": "sim",
                "batch_groups": PROMPTS,  # one step: no new version while episodes run
                "total_steps": 1000,
                "sim_time_per_token_s": 2e-4,
                "checkpoint_every": 1,
                "commit": "checkpoint",
                "batch_wait_s": 0.5,
            },
            "buffer": {"fsync": "always", "retry_after_s": 0.1},
            "manager": {"repack": {"enabled": False}, "timeline_interval_s": 0.25},
            "logging": {"level": "info"},
        }
        self.cfg_path = tmp / "config.yaml"
        self.cfg_path.write_text(yaml.safe_dump(cfg))
        self.cfg = load_config(self.cfg_path)
        self.run_dir = Path(cfg["run_dir"])
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), self.env.get("PYTHONPATH", "")) if p
        )
        self.env["AGENT_TEST_CALLS"] = str(self.calls)

    def start(self, name: str, role: str, index: int = 0) -> None:
        cmd = [sys.executable, "-m", "laminar", "node", "--role", role, "--index", str(index)]
        cmd += ["--config", str(self.cfg_path)]
        log = open(self.tmp / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
        )

    def kill9(self, name: str) -> float:
        os.kill(self.procs[name].pid, signal.SIGKILL)
        t = time.time()
        assert self.procs[name].wait(10) == -signal.SIGKILL
        return t

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def logs(self) -> str:
        return "\n".join(
            f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.tmp.glob("*.log"))
        )

    def wait(self, cond, what: str, timeout: float = DEADLINE_S):
        """Poll a condition (files, processes) against a deadline; returns its value."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"{name} exited with {p.returncode}\n{self.logs()}")
            try:
                value = cond()
            except (OSError, ValueError):  # a file mid-write
                value = None
            if value:
                return value
            time.sleep(0.1)  # polling processes and files; no event to wait on across processes
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")


@pytest.fixture
def procs(tmp_path, short_dir):
    p = Procs(tmp_path, short_dir)
    yield p
    p.stop_all()


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
        recs = read_jsonl(procs.calls)
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

    procs.wait(in_flight, "a second or third call of rollout-0's agents in flight")
    t_kill = procs.kill9("rollout-0")
    procs.wait(lambda: procs.procs["trainer"].poll() == 0, "the trainer finishing the epoch")
    # rollout-0's agent workers (not started by this test, but by the rollout it killed) leave
    # once their episodes are closed; they are waited for by pid, and stopped by pid if not
    orphans = {r["pid"] for r in read_jsonl(procs.calls) if r.get("ppid") == r0}
    end = time.monotonic() + 30
    while any(alive(p) for p in orphans) and time.monotonic() < end:
        time.sleep(0.1)  # polling process exits under a deadline
    left = [p for p in orphans if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    procs.stop_all()
    assert not left, f"rollout-0's agent workers did not leave: {left}"

    # no agent call failed; calls in flight at the kill returned after it, normally
    recs = read_jsonl(procs.calls)
    assert not [r for r in recs if r["event"] == "error"], [r for r in recs if "error" in r][:3]
    ends = [r for r in recs if r["event"] == "end"]
    spanned = [r for r in ends if r["t0"] < t_kill < r["t"] and r["ppid"] == r0]
    assert spanned, "no call was in flight across the kill"

    # every prompt consumed exactly once, as a whole group
    last: dict[int, dict] = {}
    for rec in read_jsonl(procs.run_dir / "consumed.jsonl"):
        last[rec["step"]] = rec
    uids = [u for k in sorted(last) for u in last[k]["uids"]]
    assert not [u for u, c in Counter(uids).items() if c > 1], "consumed twice"
    groups = Counter(u.rpartition("/")[0] for u in uids)
    assert set(groups.values()) == {GROUP} and len({g.split("@")[0] for g in groups}) == PROMPTS
    from laminar.journal_check import replay_buffer_journal
    from laminar.wiring.buffer import experience_state

    state, trajs = replay_buffer_journal(
        procs.run_dir / "buffer-0.journal", experience_state(procs.cfg)
    )
    summary = state.summary()
    assert summary["held"] == 0 and summary["pending"] == 0, summary
    assert summary.get("groups_committed") == len(groups) and not summary.get("abandoned"), summary

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
        for line in (procs.tmp / "rollout-1.log").read_text().splitlines()
        if '"agent_call_resumed"' in line
    ]
    assert resumed and any(r["kept"] > 0 for r in resumed), resumed
    for r in resumed:  # the finished episode extends the tokens recorded before the kill
        head = by_uid[r["uid"]].response_ids[: r["recorded"]].astype(np.int32)
        assert len(head) == r["recorded"] and zlib.crc32(head.tobytes()) == r["recorded_crc32"]
    assert "agent_failed" not in (procs.tmp / "rollout-1.log").read_text()
    assert "restarted_from_prompt" not in (procs.tmp / "manager.log").read_text()
