"""Simulator (bench/simulate.py) at small N, and the staleness rules it shares with the cluster."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

import laminar.manager.repack as repack_mod
import laminar.modes as st
from laminar.config import LaminarConfig

ROOT = Path(__file__).resolve().parents[1]


def _load_sim():
    spec = importlib.util.spec_from_file_location("bench_simulate", ROOT / "bench" / "simulate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_simulate"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


sim = _load_sim()
# loading it put bench/ on sys.path: its sibling modules, imported where their names live
import simconfig  # noqa: E402
import simcore  # noqa: E402
import simparams  # noqa: E402
import simrepack  # noqa: E402
import simscale  # noqa: E402

# an emulation-sized cluster: 16 one-GPU rollouts, short long-tailed responses, a trainer that
# takes ~1/10 of a sync iteration (not negligible, not the bottleneck)
SMALL = simparams.SimParams(
    n_rollouts=16,
    trainer_s_per_token=1e-4,
    step_time_s=0.02,
    bound_b=16,
    max_running=32,
    kv_capacity_tokens=6000,
    prompt_tokens=16,
    length_p50=40,
    max_tokens=400,
    group_size=4,
    batch_groups=16,
    rollout_groups=4,
    buffer_capacity_groups=32,
)


def run(mode: str, seed: int = 0, **kw) -> dict:
    return sim.simulate(
        mode, params=replace(SMALL, **kw), seed=seed, warmup_steps=3, measure_steps=10
    )


# ---- the simulator runs the real policies --------------------------------------------------------


def test_imports_the_real_planner_and_rules():
    # where the engine (simcore) and its repack rounds (simrepack) look them up
    assert simcore.plan_repack is repack_mod.plan_repack
    assert simrepack.is_candidate is repack_mod.is_candidate
    assert simcore.may_start_group is st.may_start_group
    assert simcore.policy_for is st.policy_for


def test_repack_plans_come_from_the_planner(monkeypatch):
    plans = []

    def spy(rollouts, c_max, bound_b, *, split=False):
        plan = repack_mod.plan_repack(rollouts, c_max, bound_b, split=split)
        plans.append(plan)
        return plan

    monkeypatch.setattr(simcore, "plan_repack", spy)  # the engine module calls it
    out = run("laminar")
    assert plans and out["repack_rounds"] == len(plans)
    assert out["moves"] == sum(len(p.moves) for p in plans) > 0


# ---- the paper's ordering and the modes' staleness -----------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_mode_ordering(seed):
    thr = {m: run(m, seed)["throughput_tok_s"] for m in simcore.SIM_MODES}
    assert thr["sync"] < thr["one_step"] and thr["sync"] < thr["stream"]
    assert thr["one_step"] == pytest.approx(thr["stream"], rel=0.15)
    assert max(thr["one_step"], thr["stream"]) < thr["laminar_norepack"] <= thr["laminar"]


def test_staleness_per_mode():
    hist = {m: run(m)["staleness_consumed"]["hist"] for m in ("sync", "one_step", "stream")}
    assert set(hist["sync"]) == {"0"}  # on-policy
    assert set(hist["one_step"]) == {"1"}  # batch k+1 generated while the trainer is on k
    assert set(hist["stream"]) <= {"0", "1"}
    bounded = run("laminar", max_staleness=2)
    assert max(int(k) for k in bounded["staleness_consumed"]["hist"]) <= 2
    assert run("stream")["dropped_groups"] == 0  # admission alone keeps stream within its bound


def test_partial_interrupts_instead_of_draining():
    """partial (AReaL-style): each update interrupts the in-flight trajectories, which continue
    under the new version; no drain, so the rollouts stay fuller than stream's, the bound holds on
    the oldest token, and re-filling the KV prefix after each update costs throughput."""
    stream, part = run("stream"), run("partial")
    assert part["interrupted_trajs"] > 0 and part["global_updates"] > 0
    assert stream["interrupted_trajs"] == 0
    assert part["decode_util"] > stream["decode_util"]
    assert part["throughput_tok_s"] > stream["throughput_tok_s"]
    bounded = run("partial", max_staleness=2)
    assert max(int(k) for k in bounded["staleness_consumed"]["hist"]) <= 2
    slow = run("partial", prefill_tok_s=2000.0)
    assert slow["throughput_tok_s"] < part["throughput_tok_s"]


def _feeder_free_credits(cfg, groups: list[list[bool]]) -> int:
    """The rollout node's own rule (PromptFeeder.free_credits) on a table holding `groups`: one
    list per group in hand, a flag per open sequence (True: waiting on its environment)."""
    from laminar.rollout.feeder import PromptFeeder

    seqs = {
        f"g{i}/{j}": SimpleNamespace(waiting=w)
        for i, g in enumerate(groups)
        for j, w in enumerate(g)
    }
    feeder = PromptFeeder.__new__(PromptFeeder)  # only the credit rule: no node, no sockets
    feeder.cfg, feeder.held = cfg, []
    feeder.table = SimpleNamespace(
        seqs=seqs,
        groups=dict.fromkeys(range(len(groups))),
        multi_turn=any(w for g in groups for w in g) or cfg.multi_turn,
        busy_groups=lambda: sum(1 for g in groups if not all(g)),
    )
    return feeder.free_credits()


@pytest.mark.parametrize("multi_turn", [False, True])
def test_refill_takes_as_many_groups_as_the_rollout_node(multi_turn):
    """A rollout with credits per sequence (refill_slots 12, groups of 4, 2 credits) holding 4
    groups, one straggler each: the node asks for (12 - 4) // 4 = 2 more single-turn, and none
    multi-turn, where 2 x credits caps the groups in hand. The simulator starts the same."""
    cfg = SimpleNamespace(refill_slots=12, group_size=4, credits=2, multi_turn=multi_turn)
    want = _feeder_free_credits(cfg, [[False]] * 4)
    assert want == (0 if multi_turn else 2)
    prm = replace(
        SMALL,
        refill_slots=12,
        refill_per_group=True,
        rollout_groups=2,
        tool_calls_max=3 if multi_turn else 0,
    )
    s = simcore.Sim("partial", prm, 0, 0, 0)
    r = s.ro[0]
    for seq in range(4):  # each group down to its one long sample
        g = simcore.Group(seq, 0, 1, r.idx)
        r.waiting.append(simcore.Traj(s.next_tid, g, 300))
        s.hold(r, r.waiting[-1])  # as start_group / an import record it
        s.next_tid += 1
    s.groups_started = 4
    s.refill(r)
    assert s.groups_started - 4 == want


def test_partial_update_resets_the_prefix_cache_of_tool_waits():
    """partial, multi-turn: a rollout whose only episode waits on a tool takes the update too
    (the node interrupts whenever it holds a sequence), and when the call returns the new weights
    have reset the prefix cache: the whole history is prefilled, not only the tool output."""
    prm = replace(
        SMALL,
        tool_calls_max=3,
        p_call=1.0,
        global_update_s=0.5,
        prefill_tok_s=1000.0,
        buffer_capacity_groups=0,  # no new groups: only the returning turn is prefilled
    )

    def tool_return(interrupted: bool) -> tuple[float, float, int, int]:
        """(stall before the call returns, prefill it costs, history before it, tool output)."""
        s = simcore.Sim("partial", prm, 0, 0, 0)
        r = s.ro[0]
        s.start_group(r)
        t = r.waiting.popleft()
        r.waiting.clear()
        r.held.clear()  # t is off to its tool call: nothing of the group is queued or running
        assert len(t.plan[0]) > 1  # its first turn ends in a call
        t.gen0 = t.end
        s.tool_call(r, t)
        if interrupted:
            s.interrupt_all()
        stalled, history, obs = r.stall_until, prm.prompt_tokens + t.gen0, t.plan[1][0]
        s.on_tool_done(r, t)
        return stalled, r.stall_until - stalled, history, obs

    stalled, prefill_s, history, obs = tool_return(interrupted=True)
    assert stalled == pytest.approx(0.5)  # no decode until the new weights are in
    assert prefill_s == pytest.approx((history + obs) / 1000.0)
    stalled, prefill_s, history, obs = tool_return(interrupted=False)
    assert stalled == 0.0
    assert prefill_s == pytest.approx(obs / 1000.0)  # the prompt and earlier turns are cached


def test_repack_helps_the_tail():
    a, b = run("laminar_norepack"), run("laminar")
    assert b["moves"] > 0 and b["moved_trajs"] >= b["moves"]
    assert b["decode_util"] > a["decode_util"]
    assert b["pulls"] > 0  # emptied sources refresh their weights


def test_deterministic_per_seed():
    assert run("laminar", 3) == run("laminar", 3)
    assert run("laminar", 3)["throughput_tok_s"] != run("laminar", 4)["throughput_tok_s"]


def test_tokens_are_conserved_and_kv_respected(monkeypatch):
    seen = []
    orig = simcore.Sim.after_change

    def check(self, r):
        if len(r.running) > 1:
            seen.append(self.kv(r) / self.prm.kv_capacity_tokens)
        orig(self, r)

    monkeypatch.setattr(simcore.Sim, "after_change", check)
    out = run("laminar", kv_capacity_tokens=800)  # tight KV: preemption happens
    assert out["preemptions"] > 0
    assert max(seen) <= 1.0 + 1e-9
    assert 0.7 < out["produced_over_consumed"] < 1.3  # steady state: made ~ what was trained on
    assert 0.0 <= out["rollout_idle_frac"] <= 1.0 and 0.0 <= out["decode_util"] <= 1.0


# ---- control-plane mechanisms (bench/simrepack.py: what the emulation showed the sim missed) -----


def test_refill_per_group_keeps_rollouts_fuller():
    # the rollout node tops up its credits whenever a group finishes and no newer version is out;
    # refilling only when dry leaves a rollout's tail running alone
    dry, per_group = run("laminar_norepack"), run("laminar_norepack", refill_per_group=True)
    assert per_group["decode_util"] > dry["decode_util"]
    assert per_group["throughput_tok_s"] > dry["throughput_tok_s"]


@pytest.mark.parametrize("tool_calls_max", [0, 3])
def test_groups_held_is_kept_as_the_trajectories_move(monkeypatch, tool_calls_max):
    # the credits a rollout holds are counted as trajectories start, finish, wait on tools, get
    # retracted, exported and imported; they must equal the groups it runs or queues at every
    # refill
    held = simcore.Sim.groups_held
    checks = []

    def checked(self, r):
        want = len({t.group.seq for t in r.running.values()} | {t.group.seq for t in r.waiting})
        got = held(self, r)
        checks.append(got == want and all(n > 0 for n in r.held.values()))
        return got

    monkeypatch.setattr(simcore.Sim, "groups_held", checked)
    out = run(
        "laminar",
        refill_per_group=True,
        refill_slots=24,
        refill_versions=2,
        repack_by_draining=True,
        retract_waiting=True,
        repack_split=True,
        tool_calls_max=tool_calls_max,
    )
    assert out["moves"] > 0 and len(checks) > 100 and all(checks)


def test_repack_from_stale_status_and_slow_moves():
    exact = run("laminar")
    assert (
        exact["export_missing"] == exact["import_rejected"] == exact["restarted_from_prompt"] == 0
    )
    # a plan made on reports 2 s old lists trajectories that finished since (missing at export)
    stale = run("laminar", status_age_s=2.0)
    assert stale["moves"] > 0 and stale["export_missing"] > 0
    # trajectories that spend 3 s in transit decode nowhere meanwhile: they finish later, so more
    # versions behind (throughput need not drop: the emptied source refills at once)
    slow = run("laminar", repack_move_s=3.0)
    assert slow["moves"] > 0
    assert slow["staleness_finished"]["mean"] > exact["staleness_finished"]["mean"] + 0.3


def test_prompt_round_trip_idles_dry_rollouts():
    base, rtt = run("laminar_norepack"), run("laminar_norepack", prompt_rtt_s=0.5)
    assert rtt["rollout_idle_frac"] > base["rollout_idle_frac"]


def test_update_round_restarts_the_period():
    grid = run("laminar", repack_interval_s=2.0)
    restart = run("laminar", repack_interval_s=2.0, repack_period_restarts=True)
    assert grid["repack_rounds"] > 0 and restart["repack_rounds"] > 0
    # ~1 s iterations, 2 s period: on a fixed grid a periodic round falls between most updates;
    # restarted after each update round, almost none does
    assert restart["repack_rounds"] < 0.8 * grid["repack_rounds"]


def test_measured_latencies_from_emulation_runs():
    """bench/cluster.py turns what a run recorded into simulator inputs (newest figures first)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import cluster  # noqa: E402  (bench/cluster.py)

    old = {
        "weight_load_s": {"mean": 0.03},
        "trainer_push_s_median": 0.006,
        "repack": {"moves": 10, "overhead_s_mean": 0.08},
    }
    # runs of the code before status pushes and prompts-during-load: both mechanisms off
    assert cluster.measured_latencies([old], "laminar") == pytest.approx(
        {
            "relay_pull_s": 0.03,
            "actor_push_s": 0.006,
            "repack_move_s": 0.08,
            "prompt_during_load": False,
            "status_push_min_s": 0.0,
        }
    )
    new = {
        **old,
        "manager_partials": {
            "move_export_s": {"mean": 0.02},
            "move_place_s": {"mean": 0.03},
            "repack_status_age_s": {"mean": 0.05},
        },
        "rollout_partials": {"prompt_rtt_idle_s": {"mean": 0.025}},
    }
    lat = cluster.measured_latencies([new], "laminar")
    assert lat["repack_move_s"] == pytest.approx(0.04)  # half the export + the import
    assert lat["status_age_s"] == pytest.approx(0.1) and lat["prompt_rtt_s"] == pytest.approx(0.025)
    assert cluster.measured_latencies([new], "sync") == {"global_update_s": 0.03}
    # rollouts that pushed their status: the push is modelled from the config (heartbeat period
    # plus push on change), the measured view age is compared with the simulator's, not fed in
    pushed = {**new, "rollout_counters": {"status_pushed": 900}}
    lat = cluster.measured_latencies([pushed], "laminar")
    assert (
        "status_age_s" not in lat
        and "status_push_min_s" not in lat
        and "prompt_during_load" not in lat
    )
    assert (
        cluster.sim_seeds(8, 3) == list(range(40))
        and len(cluster.sim_seeds(128, 3)) == cluster.SIM_SEEDS
    )


def test_pushed_status_gives_a_fresher_view():
    # issue #8 after the repack changes: rollouts push their status on change (at most every
    # status_push_min_s), so the planner's view is ~that old, not up to a heartbeat old
    beats = [run("laminar", seed=s, status_age_s=1.0) for s in range(3)]
    pushed = [run("laminar", seed=s, status_age_s=1.0, status_push_min_s=0.05) for s in range(3)]
    assert all(p["status_pushes"] > 0 for p in pushed) and all(
        b["status_pushes"] == 0 for b in beats
    )
    age_b, age_p = (sum(r["view_age_s"] for r in rs) / 3 for rs in (beats, pushed))
    assert age_p < 0.5 * age_b  # the mean age of a beat-only view is about half the period
    # a plan on a fresher view finds what it listed: fewer missing at export, fewer rejected imports
    miss_b, miss_p = (
        sum(r["export_missing"] + r["import_rejected"] for r in rs) for rs in (beats, pushed)
    )
    assert miss_p < miss_b
    # and it is switched on only where the rollout node runs its push loop (laminar with repack)
    assert run("laminar_norepack", status_age_s=1.0, status_push_min_s=0.05)["status_pushes"] == 0


def test_prompts_asked_during_the_load():
    # an idle rollout with a newer version asks for prompts while it loads: the refill waits
    # max(load, prompt round trip), not their sum, so rollouts idle less
    kw = dict(relay_pull_s=0.3, prompt_rtt_s=0.3)
    seq = [run("laminar_norepack", seed=s, **kw) for s in range(2)]
    par = [run("laminar_norepack", seed=s, prompt_during_load=True, **kw) for s in range(2)]
    for a, b in zip(seq, par, strict=True):
        assert b["rollout_idle_frac"] < a["rollout_idle_frac"]
        assert b["pulls"] > 0
    # with no round trip to hide there is nothing to gain: the same run
    assert (
        run("laminar_norepack", relay_pull_s=0.3, prompt_during_load=True)["throughput_tok_s"]
        == (run("laminar_norepack", relay_pull_s=0.3)["throughput_tok_s"])
    )


def test_bounded_concurrent_moves_wait_for_a_slot():
    # manager.repack.max_concurrent_moves: past the bound a move exports only once a slot frees
    # (each move repack_move_s), so what it listed has had time to finish: found missing
    free = run("laminar", repack_move_s=0.3)
    one = run("laminar", repack_move_s=0.3, max_concurrent_moves=1)
    assert free["moves"] > 0 and one["moves"] > 0
    assert one["export_missing"] > free["export_missing"]


def test_fixed_window_measures_like_the_emulation():
    # bench/cluster_run.py: steps that ended in [t0, t0 + len], timed from the last step before t0;
    # with none before, from the first in it (whose own start is unknown), unless it is alone
    for w0, wlen, n_before in ((3.0, 6.0, 0), (0.5, 30.0, 0), (9.0, 20.0, 1)):
        p = replace(SMALL, fixed_window_s=(w0, wlen))
        s = simcore.Sim("sync", p, 0, 0, 0)
        out = s.run()
        times = [t for t, _ in s.steps]
        inside = [(t, tok) for t, tok in s.steps if w0 <= t <= w0 + wlen]
        before = [t for t in times if t < w0]
        assert inside and max(times) <= w0 + wlen and len(before) == n_before
        if not before and len(inside) > 1:
            first, inside = inside[0][0], inside[1:]
        else:
            first = before[-1] if before else w0
        assert out["steps_measured"] == len(inside)
        assert out["throughput_tok_s"] == pytest.approx(
            sum(tok for _, tok in inside) / (inside[-1][0] - first)
        )
        assert out["sim_time_s"] == inside[-1][0]


# ---- parameters ----------------------------------------------------------------------------------


def test_params_from_config_matches_the_emulation():
    cfg = LaminarConfig()
    p = simconfig.params_from_config(cfg, n_rollouts=8)
    assert p.n_rollouts == 8 and p.step_time_s == cfg.rollout.sim.step_time_s
    assert p.bound_b == cfg.rollout.sim.bound_b and p.max_running == cfg.rollout.max_running
    assert p.length_p50 == cfg.rollout.sim.length_p50
    assert p.max_tokens == cfg.rollout.sampling.max_tokens
    assert p.group_size == cfg.rollout.group_size and p.batch_groups == cfg.trainer.batch_groups
    assert p.trainer_s_per_token == cfg.trainer.sim_time_per_token_s
    assert p.repack_bound_b == cfg.repack_bound_b() and p.c_max == cfg.manager.repack.c_max
    assert p.status_age_s == cfg.transport.heartbeat_interval_s  # repack plans from heartbeats
    assert p.refill_per_group and p.repack_period_restarts and p.repack_fixed_s == 0.0
    assert (
        p.prompt_during_load and p.max_concurrent_moves == cfg.manager.repack.max_concurrent_moves
    )
    # status pushed on change exactly where the rollout node spawns its push loop
    assert cfg.mode == "laminar" and cfg.manager.repack.enabled
    assert p.status_push_min_s == cfg.rollout.status_push_min_s > 0
    off = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"status_push": False})})
    assert simconfig.params_from_config(off, 8).status_push_min_s == 0.0
    norepack = cfg.model_copy(
        update={
            "manager": cfg.manager.model_copy(
                update={"repack": cfg.manager.repack.model_copy(update={"enabled": False})}
            )
        }
    )
    assert simconfig.params_from_config(norepack, 8).status_push_min_s == 0.0
    out = sim.simulate("laminar", params=p, warmup_steps=2, measure_steps=3)
    assert out["throughput_tok_s"] > 0 and out["n_rollouts"] == 8


def test_paper_allocation():
    assert simscale.params_for("32B", "laminar", 1024).n_rollouts == 128  # 512 rollout GPUs, TP4
    assert simscale.params_for("32B", "sync", 1024).n_rollouts == 256  # co-located: every GPU
    assert simscale.params_for("7B", "laminar", 256).n_rollouts == 64  # Table 2: 192/64, TP1
    assert simscale.params_for("7B", "one_step", 256).n_rollouts == 64  # 128 GPUs at TP2
    assert simscale.laminar_rollout_gpus(simscale.MODELS["72B"], 1024) == 512  # extrapolated 1:1
    for spec in simscale.MODELS.values():
        assert all(0.4 < simscale.balance(spec, n) < 1.5 for n in spec.laminar_rollout_gpus)


def test_laminar_and_partial_are_swept_on_one_grid():
    # each system at its best split from the same fractions: laminar also has the paper's row
    # (None), and a fraction landing on that row is not run twice
    quick = sim.split_options
    assert quick("partial", "7B", 256, True) == sim.RACE_FRACS
    assert quick("laminar", "7B", 256, True) == [None, *sim.RACE_FRACS]  # table: 64 of 256
    assert quick("laminar", "7B", 64, True) == [None, 0.5, 0.625]  # table: 24 = 0.375 x 64
    assert quick("laminar", "32B", 1024, True) == [None, 0.375, 0.625]  # table: half
    assert quick("laminar_norepack", "32B", 1024, True) == [None]
    assert quick("laminar", "7B", 1024, True, multiturn=True) == [None]
    assert quick("sync", "32B", 64, True) == [None]
    assert quick("stream", "32B", 64, True) == sim.QUICK_FRACS
    full = sim.split_options("laminar_norepack", "72B", 256, False)
    assert full == [None, 0.25, 0.375, 0.625, 0.75]
    assert sim.split_options("partial", "72B", 256, False) == sim.FULL_FRACS
    # a swept laminar run takes its rollout GPUs from the fraction, like the baselines
    assert simscale.params_for("7B", "laminar", 256, 0.375).n_rollouts == 96


def test_paper_scale_laminar_runs_the_refill_budget():
    # laminar at paper scale drains as the emulated cluster's rollouts do (issue 44): refill per
    # group under the K-version budget, draining rollouts as repack candidates; partial keeps K = 0
    from simscale import REFILL_VERSIONS

    for mode in ("laminar", "laminar_norepack"):
        p = simscale.params_for("32B", mode, 1024)
        assert p.refill_per_group and p.refill_versions == REFILL_VERSIONS == 3
        assert p.repack_by_draining
    part = simscale.params_for("32B", "partial", 1024)
    assert part.refill_per_group and part.refill_versions == 0 and not part.repack_by_draining
    # the repack-in-isolation runs keep the paper's rule (take a batch, drain it, pull)
    paper = simscale.params_for("32B", "laminar", 128, rollout_groups=32, **sim.PAPER_DRAIN)
    assert not paper.refill_per_group and paper.refill_versions == 0
    # at 32B on 64 GPUs the paper's rule leaves rollouts in their tails; the budget fills them
    kw = dict(warmup_steps=3, measure_steps=4)
    budget = sim.simulate("laminar", 64, "32B", 0, **kw)
    old = sim.simulate("laminar", 64, "32B", 0, **kw, **sim.PAPER_DRAIN)
    assert budget["decode_util"] > old["decode_util"]
    assert budget["throughput_tok_s"] > 1.05 * old["throughput_tok_s"]


def test_paper_scale_smoke():
    out = sim.simulate("laminar", 64, "32B", 0, warmup_steps=1, measure_steps=2, settle_s=0.0)
    assert out["n_rollouts"] == 8 and out["throughput_tok_s"] > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown mode"):
        sim.simulate("async", params=SMALL)
    with pytest.raises(ValueError, match="multiple of minibatches"):
        run("laminar", minibatches=5)
    with pytest.raises(ValueError, match="n_gpus"):
        sim.simulate("sync")


# ---- laminar.modes -------------------------------------------------------------------------------


def test_policies():
    assert st.policy_for("sync") == st.ModePolicy("sync", 0, global_update=True, whole_batch=True)
    assert st.policy_for("one_step").max_staleness == 1
    assert (
        st.policy_for("stream").max_staleness == 1 and st.policy_for("stream", 3).max_staleness == 3
    )
    assert st.policy_for("one_step", 5).max_staleness == 1  # one step by definition
    lam = st.policy_for("laminar")
    assert lam.max_staleness is None and not lam.global_update and not lam.whole_batch
    part = st.policy_for("partial", 4)
    assert part.global_update and part.interrupts and part.max_staleness == 4
    with pytest.raises(ValueError, match="unknown mode"):
        st.policy_for("areal")
    with pytest.raises(ValueError, match="max_staleness"):
        st.policy_for("laminar", -1)


def test_admission_rules():
    sync, stream, lam = st.policy_for("sync"), st.policy_for("stream"), st.policy_for("laminar", 2)
    g = 4
    assert st.start_cap(sync, 0, g) == 4 and st.start_cap(stream, 3, g) == 20
    assert st.start_cap(st.policy_for("laminar"), 9, g) is None
    ok = dict(trainer_version=2, rollout_version=2, batch_groups=g)
    assert st.may_start_group(sync, groups_started=11, **ok)
    assert not st.may_start_group(sync, groups_started=12, **ok)  # batch 2 fully started
    # global modes: once the trainer is ahead, drain and wait for the update
    assert not st.may_start_group(
        stream, trainer_version=3, rollout_version=2, groups_started=0, batch_groups=g
    )
    # laminar with a bound: an old rollout must refresh first; a fresh one may run ahead
    assert not st.may_start_group(
        lam, trainer_version=5, rollout_version=2, groups_started=0, batch_groups=g
    )
    assert st.may_start_group(
        lam, trainer_version=5, rollout_version=3, groups_started=31, batch_groups=g
    )
    assert not st.may_start_group(
        lam, trainer_version=5, rollout_version=3, groups_started=32, batch_groups=g
    )
    assert st.needs_update(lam, 5, 3) and not st.needs_update(lam, 3, 3)


def test_staleness_values_and_stats():
    assert st.staleness(7, 4) == 3
    assert st.admissible(7, 4, None) and st.admissible(7, 4, 3) and not st.admissible(7, 4, 2)
    s = st.StalenessStats()
    s.extend([0, 1, 1, 2, 5])
    s.add(-1)  # a stale report counts as on-policy
    summ = s.summary()
    assert summ["count"] == 6 and summ["max"] == 5 and summ["p50"] == 1
    assert summ["hist"] == {"0": 2, "1": 2, "2": 1, "5": 1}
    assert math.isclose(summ["mean"], 9 / 6, rel_tol=1e-3)
    assert st.StalenessStats().summary()["mean"] is None
