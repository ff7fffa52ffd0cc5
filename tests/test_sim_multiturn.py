"""Multi-turn in the emulation and the simulator: the sim engine's turns, SimToolEnv,
bench/simcore.py.

.venv/bin/python -m pytest tests/test_sim_multiturn.py -q
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest

from laminar.config import config_from_dict
from laminar.engines.base import GenRequest, SamplingParams
from laminar.engines.sim import SimEngine, target_length
from laminar.envs.base import StepContext
from laminar.envs.loader import load_env
from laminar.envs.sim import SimToolEnv, _unit

ROOT = Path(__file__).resolve().parents[1]
PROMPT = np.arange(4, 14, dtype=np.int32)
P50, TAIL = 30, 5.0


def _load_sim():
    spec = importlib.util.spec_from_file_location("bench_simulate", ROOT / "bench" / "simulate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_simulate"] = mod
    spec.loader.exec_module(mod)
    return mod


sim = _load_sim()
# loading it put bench/ on sys.path: its sibling modules, imported where their names live
import simconfig  # noqa: E402
import simcore  # noqa: E402
import simparams  # noqa: E402


def engine(seed: int = 7) -> SimEngine:
    # step 0: every settle runs whole sequences at once, so a test waits on nothing but the loop
    return SimEngine(
        step_time_s=0.0, length_p50=P50, length_p99_over_p50=TAIL, seed=seed, chunk_tokens=8
    )


# ---- the sim engine's model turns ----------------------------------------------------------------


async def test_turn_lengths_are_drawn_per_turn_and_end_in_stop():
    e = engine()
    await e.start()
    prior = np.arange(37, dtype=np.int32)  # turn 0 and the environment's answer
    lps = np.zeros(37, np.float32)
    req = GenRequest(
        "ep",
        PROMPT,
        SamplingParams(max_tokens=4000),
        1,
        resume_ids=prior,
        resume_logprobs=lps,
        single=True,
        turn=2,
        turn_start=37,
    )
    ids, _, reason = (await e.generate_all(req, timeout=10))["ep"]
    drawn = target_length(7, "ep", P50, TAIL, turn=2)
    assert reason == "stop" and len(ids) == drawn  # new tokens only: the turn is its drawn length
    assert drawn != target_length(7, "ep", P50, TAIL, turn=1)  # each turn draws its own length
    # deterministic: another engine (another rollout) makes the very same tokens
    e2 = engine()
    await e2.start()
    ids2, _, _ = (await e2.generate_all(req, timeout=10))["ep"]
    assert np.array_equal(ids, ids2)


async def test_turn_zero_is_the_single_turn_draw_and_resume_keeps_the_target():
    e = engine()
    await e.start()
    single = (
        await e.generate_all(
            GenRequest("s", PROMPT, SamplingParams(max_tokens=4000), 1, single=True)
        )
    )["s"]
    assert len(single[0]) == min(
        4000, target_length(7, "s", P50, TAIL)
    )  # unchanged single-turn rule
    # a turn cut mid-way (repack) and resumed elsewhere ends where it would have: depends only on
    # (seq_id, turn, turn_start)
    full = turn_start = 50
    drawn = target_length(7, "m", P50, TAIL, turn=1)
    cut = turn_start + drawn // 2
    req = GenRequest(
        "m",
        PROMPT,
        SamplingParams(max_tokens=4000),
        1,
        resume_ids=np.zeros(cut, np.int32),
        resume_logprobs=np.zeros(cut, np.float32),
        single=True,
        turn=1,
        turn_start=full,
    )
    ids, _, reason = (await e.generate_all(req, timeout=10))["m"]
    assert reason == "stop" and cut + len(ids) == turn_start + drawn
    # the episode's cap (max_tokens counts the whole response) ends a turn with "length"
    capped = replace(req, req_id="m2", params=SamplingParams(max_tokens=cut + 1))
    ids, _, reason = (await e.generate_all(capped, timeout=10))["m2"]
    assert reason == "length" and cut + len(ids) == cut + 1


# ---- SimToolEnv ----------------------------------------------------------------------------------


def ctx(uid: str, turn: int, replay: bool = False, calls: int = 0) -> StepContext:
    return StepContext(uid=uid, turn=turn, tools=None, tool_calls_so_far=calls, replay=replay)


def test_sim_tool_env_draws():
    env = SimToolEnv(
        seed=3,
        max_calls=8,
        p_call=0.8,
        latency_p50_s=0.5,
        latency_p99_s=10.0,
        obs_min=20,
        obs_max=200,
    )
    again = SimToolEnv(seed=3, max_calls=8, p_call=0.8, latency_p50_s=0.5, latency_p99_s=10.0)
    uids = [f"u{i}" for i in range(4000)]
    calls = [env.tool_calls(u) for u in uids]
    assert calls == [again.tool_calls(u) for u in uids]  # a pure function of (seed, uid)
    assert calls != [SimToolEnv(seed=4).tool_calls(u) for u in uids]
    assert min(calls) == 0 and max(calls) == 8
    expected = sum(0.8**k for k in range(1, 9))  # truncated geometric: ~3.33
    assert abs(statistics.mean(calls) - expected) < 0.15
    lat = sorted(env.latency(f"u{i}#t0#c0") for i in range(4000))
    assert (
        abs(lat[2000] / 0.5 - 1) < 0.1 and abs(lat[3960] / 10.0 - 1) < 0.3
    )  # p50, p99: long-tailed
    obs = [env.observation_ids(f"c{i}") for i in range(500)]
    assert obs[0] == again.observation_ids("c0")
    assert all(20 <= len(o) <= 200 for o in obs) and all(0 <= x < 32000 for o in obs for x in o)
    with pytest.raises(ValueError, match="latency_p50_s"):
        SimToolEnv(latency_p50_s=2.0, latency_p99_s=1.0)


async def test_sim_tool_env_steps_sleep_on_live_calls_and_not_on_replay():
    env = SimToolEnv(seed=1, p_call=1.0, max_calls=2, latency_p50_s=0.05, latency_p99_s=0.05)
    state = env.reset({"prompt": "x"}, "x")
    t0 = time.monotonic()
    res = await asyncio.wait_for(env.step(state, ctx("e", 0), "model text"), 5)
    assert time.monotonic() - t0 >= 0.05  # the emulated sandbox: the step awaits the latency
    assert not res.done and res.observation_ids == env.observation_ids("e#t0#c0")
    (tr,) = res.tool_results
    assert tr.ok and tr.call_id == "e#t0#c0" and tr.seconds == pytest.approx(0.05) and not tr.cached
    assert (await env.step(state, ctx("e", 2), "answer")).done  # after max_calls: the final answer
    # replay (another rollout rebuilding the episode): answered at once from the "cache"
    slow = SimToolEnv(seed=1, p_call=1.0, latency_p50_s=100.0, latency_p99_s=100.0)
    st = slow.reset({}, "x")
    res = await asyncio.wait_for(slow.step(st, ctx("e", 0, replay=True), ""), 1.0)
    assert res.tool_results[0].cached and res.observation_ids == slow.observation_ids("e#t0#c0")
    # over the episode's call budget: an error observation, no run
    res = await asyncio.wait_for(
        slow.step(st, StepContext("e", 1, None, tool_calls_so_far=8), ""), 1.0
    )
    assert not res.tool_results[0].ok and res.tool_results[0].error_kind == "limit"
    assert 0.0 <= await env.score(state, ctx("e", 2)) <= 1.0
    # the sandbox's wall-clock limit kills a long call there: an error result, not a hang
    capped = SimToolEnv(
        seed=1, p_call=1.0, latency_p50_s=100.0, latency_p99_s=100.0, latency_max_s=0.01
    )
    res = await asyncio.wait_for(capped.step(capped.reset({}, ""), ctx("e", 0), ""), 5)
    (tr,) = res.tool_results
    assert not tr.ok and tr.error_kind == "timeout" and tr.seconds == 0.01 and res.observation_ids


def test_sim_tool_env_loads_from_the_config():
    cfg = config_from_dict(
        {"env": {"fn": "laminar.envs.sim:SimToolEnv", "kwargs": {"seed": 5, "p_call": 0.5}}}
    )
    env = load_env(cfg.env)
    assert isinstance(env, SimToolEnv) and env.seed == 5 and env.p_call == 0.5


async def test_episodes_on_the_sim_engine():
    """A small driver loop (what laminar/rollout/episodes.py does, without a node): the turns the
    engine ends and the environment answers add up to a deterministic token sequence and mask."""
    env = SimToolEnv(
        seed=2, p_call=0.7, latency_p50_s=0.002, latency_p99_s=0.02, obs_min=3, obs_max=9
    )

    async def episode(e: SimEngine, uid: str) -> tuple[list[int], list[int], int]:
        state = env.reset({}, "")
        ids: list[int] = []
        mask: list[int] = []
        turn, calls = 0, 0
        while True:
            req = GenRequest(
                uid,
                PROMPT,
                SamplingParams(max_tokens=4000),
                1,
                resume_ids=np.asarray(ids, np.int32),
                resume_logprobs=np.zeros(len(ids), np.float32),
                single=True,
                turn=turn,
                turn_start=len(ids),
            )
            new, _, reason = (await e.generate_all(req, timeout=10))[uid]
            assert reason == "stop" and len(new) == target_length(2, uid, P50, TAIL, turn)
            ids += new.tolist()
            mask += [1] * len(new)
            res = await env.step(state, ctx(uid, turn, calls=calls), "")
            if res.done:
                return ids, mask, calls
            calls += len(res.tool_results)
            assert res.observation_ids
            ids += res.observation_ids
            mask += [0] * len(res.observation_ids)
            turn += 1

    e = engine(seed=2)
    await e.start()
    uids = [f"g/{i}" for i in range(12)]
    first = await asyncio.gather(*(episode(e, u) for u in uids))
    e2 = engine(seed=2)
    await e2.start()
    second = await asyncio.gather(*(episode(e2, u) for u in uids))
    assert first == second
    for u, (_ids, mask, calls) in zip(uids, first, strict=True):
        assert calls == env.tool_calls(u)
        runs = np.flatnonzero(np.diff(mask)) + 1
        assert len(runs) == 2 * calls  # model, env, model, ..., model


# ---- the simulator -------------------------------------------------------------------------------

SMALL = simparams.SimParams(
    n_rollouts=16,
    trainer_s_per_token=1e-4,
    step_time_s=0.02,
    bound_b=16,
    max_running=32,
    kv_capacity_tokens=12000,
    prompt_tokens=16,
    length_p50=20,
    max_tokens=600,
    group_size=4,
    batch_groups=16,
    rollout_groups=4,
    buffer_capacity_groups=32,
    tool_calls_max=8,
    p_call=0.8,
    tool_latency_p50_s=0.2,
    tool_latency_p99_s=4.0,
    obs_tokens_min=5,
    obs_tokens_max=30,
)


def run(mode: str, seed: int = 0, **kw) -> dict:
    return sim.simulate(
        mode, params=replace(SMALL, **kw), seed=seed, warmup_steps=3, measure_steps=8
    )


def test_simulator_multiturn_runs_and_laminar_beats_sync(monkeypatch):
    plans = []
    orig = simcore.Sim.turn_plan

    def spy(self, first):
        plans.append(orig(self, first))
        return plans[-1]

    monkeypatch.setattr(simcore.Sim, "turn_plan", spy)
    rs = {m: run(m) for m in ("sync", "stream", "laminar")}
    assert rs["laminar"]["throughput_tok_s"] >= rs["sync"]["throughput_tok_s"]
    assert rs["laminar"]["throughput_tok_s"] >= rs["stream"]["throughput_tok_s"]
    calls = [len(p[1]) for p in plans]
    assert max(calls) == 8 and 2.5 < statistics.mean(calls) < 4.0
    for ends, obs, lat in plans:
        assert len(ends) == len(obs) + 1 == len(lat) + 1 and ends[-1] <= 600
        assert all(
            b - a > o for a, b, o in zip(ends, ends[1:], obs, strict=False)
        )  # a model turn after each output
    assert run("laminar") == rs["laminar"]  # deterministic per seed


def test_simulator_tool_latency_idles_sync_more_than_laminar():
    fast = {
        m: run(m, tool_latency_p50_s=0.001, tool_latency_p99_s=0.002) for m in ("sync", "laminar")
    }
    slow = {m: run(m, tool_latency_p50_s=1.0, tool_latency_p99_s=20.0) for m in ("sync", "laminar")}
    # the batch barrier waits for the slowest sandbox call of the batch
    assert slow["sync"]["throughput_tok_s"] < fast["sync"]["throughput_tok_s"]
    assert slow["sync"]["rollout_idle_frac"] > fast["sync"]["rollout_idle_frac"]
    # laminar: a trajectory's wait holds back only its own rollout's next version
    assert slow["laminar"]["throughput_tok_s"] > 2 * slow["sync"]["throughput_tok_s"]
    assert slow["laminar"]["rollout_idle_frac"] < slow["sync"]["rollout_idle_frac"]


def test_simulator_single_turn_unchanged_by_the_multiturn_fields():
    single = replace(
        SMALL, tool_calls_max=0, length_p50=40, max_tokens=400, kv_capacity_tokens=6000
    )
    a = sim.simulate("laminar", params=single, seed=1, warmup_steps=3, measure_steps=8)
    b = sim.simulate(
        "laminar",
        params=replace(single, p_call=0.1, tool_latency_p50_s=9.0, tool_latency_p99_s=99.0),
        seed=1,
        warmup_steps=3,
        measure_steps=8,
    )
    assert a == b


def test_params_from_config_reads_the_sim_tool_env():
    sys.path.insert(0, str(ROOT / "bench"))
    from cluster_run import MULTITURN, BenchParams, make_config

    prm = replace(BenchParams(), **MULTITURN)
    cfg = make_config("laminar", 4, 0, prm, Path("/tmp/lam-h6-unused"), Path("/tmp"))
    assert (
        cfg.env.fn == "laminar.envs.sim:SimToolEnv"
        and cfg.env.limits.max_turns == prm.tool_calls_max + 1
    )
    p = simconfig.params_from_config(cfg, 4)
    assert (p.tool_calls_max, p.p_call, p.tool_latency_p50_s, p.tool_latency_p99_s) == (
        8,
        prm.p_call,
        prm.tool_latency_p50_s,
        prm.tool_latency_p99_s,
    )
    assert p.tool_latency_max_s == prm.tool_latency_max_s
    assert p.length_p50 == 50 and (p.obs_tokens_min, p.obs_tokens_max) == (
        prm.obs_tokens_min,
        prm.obs_tokens_max,
    )
    # the same draws from the black-box sim agent (bench/cluster.py --agents) give the same params
    agents = make_config(
        "laminar", 4, 0, replace(prm, agents=True), Path("/tmp/lam-h6-unused"), Path("/tmp")
    )
    assert agents.env.fn is None and agents.agent.fn == "laminar.agents.sim:sim_tool_agent"
    assert simconfig.params_from_config(agents, 4) == p
    single = make_config("laminar", 4, 0, BenchParams(), Path("/tmp/lam-h6-unused"), Path("/tmp"))
    assert single.env.fn is None and simconfig.params_from_config(single, 4).tool_calls_max == 0
    assert math.isfinite(
        sim.simulate("laminar", params=p, warmup_steps=1, measure_steps=2)["throughput_tok_s"]
    )


def test_a_dilated_workload_is_the_same_workload_slower():
    """bench/cluster.py --time-scale k: every time constant x k, nothing else; the simulator
    then gives each mode 1/k of the throughput, so the ratios between modes stay."""
    sys.path.insert(0, str(ROOT / "bench"))
    from cluster_run import MULTITURN, TIMED, BenchParams, dilate, make_config

    prm = replace(BenchParams(), **MULTITURN)
    slow = dilate(prm, 3.0)
    for f in fields(BenchParams):
        was = getattr(prm, f.name)
        want = was * 3.0 if f.name in TIMED and was is not None else was
        assert getattr(slow, f.name) == pytest.approx(want), f.name
    tput = {}
    for k, p in ((1, prm), (3, slow)):
        cfg = make_config("laminar", 8, 0, p, Path("/tmp/lam-h6-unused"), Path("/tmp"))
        sp = simconfig.params_from_config(cfg, 8)
        for mode in ("laminar", "sync"):
            out = sim.simulate(mode, params=sp, seed=0, warmup_steps=2, measure_steps=6)
            tput[(k, mode)] = out["throughput_tok_s"]
    assert tput[(3, "laminar")] == pytest.approx(tput[(1, "laminar")] / 3, rel=0.1)
    ratio = {k: tput[(k, "laminar")] / tput[(k, "sync")] for k in (1, 3)}
    assert ratio[3] == pytest.approx(ratio[1], rel=0.1), ratio


@pytest.mark.slow
def test_emulated_multiturn_run(tmp_path):
    """One bench/cluster_run.py run on the multi-turn workload: the real rollouts drive
    SimToolEnv."""
    out = tmp_path / "fig.json"
    params = {"workload": "multiturn", "length_p50": 50, "warmup_s": 3, "window_s": 6}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "cluster_run.py"),
            "run",
            "--mode",
            "laminar",
            "--n",
            "4",
            "--params",
            json.dumps(params),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fig = json.loads(out.read_text())
    assert fig["steps_in_window"] >= 1 and fig["train_tok_s"] > 0
    counters = fig["rollout_counters"]
    assert (
        counters["tool_calls"] > 0
        and counters["env_tokens"] > 0
        and counters["episode_finish_stop"] > 0
    )


def test_a_run_that_trained_nothing_is_void_with_its_reason():
    """bench/cluster.py refuses a run with no trainer step in its window (every ratio against it
    would be 0 or a division by zero) and says what the rollouts counted."""
    sys.path.insert(0, str(ROOT / "bench"))
    from cluster import trained_nothing

    fig = {"mode": "sync", "n": 64, "seed": 0, "window_s": 18.0, "steps_in_window": 0}
    fig |= {"train_tok_s": 0.0, "startup_s": 40.0, "loadavg_1m": {"start": 1.0, "end": 2.0}}
    fig["rollout_counters"] = {"agent_calls": 10, "agent_failure_timeout": 3, "tool_calls": 2}
    why = trained_nothing(fig)
    assert why is not None and "sync N=64 seed=0 trained nothing" in why
    assert "agent_failure_timeout" in why and "tool_calls" not in why
    assert trained_nothing({**fig, "steps_in_window": 2, "train_tok_s": 900.0}) is None


class _Status:
    def __init__(self, state: str):
        self.state = state


class _Peer:
    def __init__(self, state: str | None):
        self.status = None if state is None else _Status(state)


def test_the_window_waits_until_every_rollout_serves():
    """Registered is not serving: a rollout whose engine or agent workers are still starting
    says starting_engine in its beats, and the bench's warm-up starts only when none does."""
    sys.path.insert(0, str(ROOT / "bench"))
    from cluster_run import BenchParams, _wait_ready

    class Manager:
        polls = 0

        def _live(self, role):
            self.polls += 1
            late = "starting_engine" if self.polls < 4 else ""
            return [_Peer(""), _Peer(None if self.polls < 2 else late)]

    class Cluster:
        def check(self):
            pass

    class Worker:
        def poll(self):
            return None

    m = Manager()
    asyncio.run(_wait_ready(m, Cluster(), 2, BenchParams(), Worker(), Path("/tmp/x/w.json")))
    assert m.polls == 4
    never = Manager()
    never.polls = -(10**9)
    with pytest.raises(RuntimeError, match="1 of 2 rollouts serving after 0.3 s"):
        asyncio.run(
            _wait_ready(
                never,
                Cluster(),
                2,
                BenchParams(ready_timeout_s=0.3),
                Worker(),
                Path("/tmp/x/w.json"),
            )
        )


def test_emulated_multiturn_run_through_agents(tmp_path):
    """The same workload driven by laminar.agents.sim:sim_tool_agent through each rollout's
    OpenAI endpoint, the rollouts of the run's worker process sharing one agent pool."""
    out = tmp_path / "fig.json"
    params = {
        "workload": "multiturn",
        "length_p50": 50,
        "warmup_s": 3,
        "window_s": 6,
        "agents": True,
        "agent_workers": 2,
    }
    cmd = [sys.executable, str(ROOT / "bench" / "cluster_run.py"), "run", "--mode", "laminar"]
    cmd += ["--n", "4", "--params", json.dumps(params), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fig = json.loads(out.read_text())
    assert fig["steps_in_window"] >= 1 and fig["train_tok_s"] > 0
    counters = fig["rollout_counters"]
    assert counters["agent_calls"] > 0 and counters["agent_finish_stop"] > 0
    # an episode past its token budget ends "length" (its agent's next call is refused and it
    # raises): not a failure
    assert counters.get("agent_raised_truncated", 0) <= counters.get("agent_finish_length", 0)
    assert not counters.get("agent_retries"), counters
    assert fig["agent_workers_cpu_s"] is not None


class _FakeClient:
    """What sim_tool_agent uses of an openai.AsyncOpenAI, recording each request's messages."""

    def __init__(self, uid: str):
        self.uid, self.sent = uid, []
        self.chat = self
        self.completions = self

    def _answer(self, messages):
        from openai.types.chat import ChatCompletion

        self.sent.append([dict(m) for m in messages])
        turn = len(self.sent) - 1
        return ChatCompletion.model_validate(
            {
                "id": f"chatcmpl-{self.uid}-0-{turn}",
                "object": "chat.completion",
                "created": 0,
                "model": "sim",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": f"turn {turn}"},
                    }
                ],
            }
        )

    async def create(self, model, messages):
        return self._answer(messages)

    async def post(self, path, body, cast_to):
        assert path == "/chat/completions" and body["model"] == "sim"
        return self._answer(body["messages"])


@pytest.mark.parametrize("client_call", ["create", "post"])
async def test_the_sim_agent_makes_sim_tool_envs_episode(client_call):
    """One call per model turn (the env's tool calls + 1), tool outputs of the env's drawn
    lengths (n - 2 bytes: n tokens with the newlines around them), the env's reward; both ways
    of calling send the same conversation."""
    from laminar.agents.sim import sim_tool_agent
    from laminar.envs.base import call_id

    kw = {"seed": 3, "p_call": 0.9, "latency_p50_s": 0.001, "latency_p99_s": 0.002}
    kw |= {"obs_min": 10, "obs_max": 40}
    env = SimToolEnv(**kw)
    uid = next(f"g/{i}" for i in range(50) if env.tool_calls(f"g/{i}") >= 2)
    client = _FakeClient(uid)
    reward = await sim_tool_agent({"prompt": "p"}, client, client_call=client_call, **kw)
    calls = env.tool_calls(uid)
    assert len(client.sent) == calls + 1
    last = client.sent[-1]
    outputs = [m["content"] for m in last[2::2]]
    assert [len(o) + 2 for o in outputs] == [
        len(env.observation_ids(call_id(uid, t, 0))) for t in range(calls)
    ]
    assert [m["content"] for m in last[1::2]] == [f"turn {t}" for t in range(calls)]
    assert reward == _unit("reward", 3, uid)  # the env's, for this episode
