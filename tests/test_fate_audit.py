"""The per-length audit (laminar/buffer/audit.py, laminar/fates.py): what the staleness policy did
to the data, counted from the buffer's own fates and checked against its journal.

    .venv/bin/python -m pytest tests/test_fate_audit.py -q

The cluster case: sim rollouts whose response lengths are lognormal (a long tail) and a
tight staleness bound. Laminar's admission never lets a group expire
(tests/test_buffer_admission.py: it waits for the old groups instead), so the rollouts here
are served as a drop-based system serves them, without admission (`unadmitted`): the
batch planner then drops every group that finishes past the bound, and the long responses
finish last. The audit must count exactly what the journal holds, and warn; with the bound
lifted nothing is dropped and it must not warn.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from laminar.buffer.audit import (
    MIN_JUDGED,
    AuditSettings,
    FateAudit,
    LiveGroup,
    fate_summary,
    fate_table,
    fate_warning,
)
from laminar.buffer.experience import ExperienceState, usable
from laminar.buffer.journal_format import decode_record, encode_record, read_records
from laminar.buffer.prompt_server import PromptServer
from laminar.buffer.records import (
    BatchCommitted,
    BatchServed,
    FateCounts,
    GroupsDropped,
    GroupsServed,
    MemberAbandoned,
    ServedGroup,
    TrajectoryAccepted,
)
from laminar.cli import main
from laminar.cluster import LocalCluster
from laminar.config import write_resolved
from laminar.fates import run_fates
from laminar.modes import Admission
from laminar.protocol.data import PromptItem, Trajectory
from tests.sim_cluster import sim_config, trainer_metrics

N = 2


def traj(gid: str, i: int, length: int, version: int = 0, reward: float | None = 1.0) -> Trajectory:
    return Trajectory(
        uid=f"{gid}/{i}",
        group_id=gid,
        prompt_uid="u-" + gid,
        sample_index=i,
        prompt_ids=np.arange(2, dtype=np.int32),
        response_ids=np.zeros(length, np.int32),
        logprobs=np.zeros(length, np.float32),
        version=version,
        reward=reward,
    )


def fresh(policy: str = "release_partial") -> ExperienceState:
    return ExperienceState(
        group_size=N, lost_member_policy=policy, admission=Admission.for_mode("laminar", 1, 1)
    )


def serve(st: ExperienceState, gid: str, version: int = 0) -> None:
    item = PromptItem(uid="u-" + gid, group_id=gid, prompt_ids=np.arange(2, dtype=np.int32), n=N)
    st.apply(GroupsServed([ServedGroup(gid, item.uid, N, version, item=item)]))


def test_fates_are_counted_per_group_and_survive_compaction() -> None:
    st = fresh()
    for gid in "abcde":
        serve(st, gid)
    st.apply(TrajectoryAccepted(traj("a", 0, 5, reward=1.0)))
    st.apply(TrajectoryAccepted(traj("a", 1, 50, reward=None)))  # a reward failure
    st.apply(TrajectoryAccepted(traj("b", 0, 7, reward=0.0)))
    st.apply(TrajectoryAccepted(traj("b", 1, 9, reward=1.0)))
    st.apply(TrajectoryAccepted(traj("c", 0, 80)))
    st.apply(TrajectoryAccepted(traj("c", 1, 90)))
    st.apply(TrajectoryAccepted(traj("d", 0, 30)))
    st.apply(MemberAbandoned("d", 1))
    st.apply(TrajectoryAccepted(traj("e", 0, 11)))  # e stays open
    assert st.fates.counts() == FateCounts()  # nothing decided yet: nothing counted
    st.apply(BatchServed("B", 2, ["a", "b", "d"]))
    st.apply(BatchCommitted("B", 1, 3))
    st.apply(GroupsDropped(["c"], reason="expired"))
    c = st.fates.counts()
    assert c.lengths == {
        "consumed": {5: 1, 7: 1, 9: 1, 30: 1},
        "reward_failure": {50: 1},
        "staleness": {80: 1, 90: 1},
    }
    assert c.staleness == {5: {2: 1}, 7: {2: 1}, 9: {2: 1}, 30: {2: 1}}
    assert c.groups["consumed"] == {"1.00": 2, "0.50": 2} and c.abandoned == 1
    assert c.group_tokens["staleness"] == {"1.00": 170}

    again = fresh()  # through the journal's encoding, as compaction writes it
    for rec in st.snapshot():
        again.apply(decode_record(encode_record(rec)[8:]))
    assert again.fates.counts() == c
    assert [list(g.members) for g in again.groups.values()] == [[0]]  # e, still live

    live = [LiveGroup(list(g.members.values())) for g in st.groups.values()]
    table = fate_table(c, live, buckets=2)
    # edges: quantiles of the decided lengths (5 7 9 30 | 50 80 90); the live 11 joins the first
    assert [(r.lo, r.hi) for r in table.by_length] == [(5, 30), (50, 90)]
    short, long = table.by_length
    assert short.fates == {"consumed": 4, "in_buffer": 1} and short.kept == 1.0
    assert short.staleness_mean == 2.0 and short.staleness_max == 2
    assert long.fates == {"reward_failure": 1, "staleness": 2} and long.kept == 0.0
    assert math.isnan(long.staleness_mean)
    gen, trained = table.share(long)
    assert math.isclose(gen, 220 / 282) and trained == 0.0
    s = fate_summary(table)
    assert s is not None and s.long_vs_short == 0.0 and s.dropped == 3
    assert s.long_token_share_generated == pytest.approx(220 / 271)  # of the decided tokens
    assert fate_summary(fate_table(c, [], buckets=2)) == s  # the live figures: the same
    assert sum(table.share(r)[0] for r in table.by_length) == pytest.approx(1.0)
    assert [r.label for r in table.by_difficulty] == ["0.50", "1.00"]


def test_drop_group_policy_is_the_lost_member_fate() -> None:
    st = fresh("drop_group")
    serve(st, "a")
    st.apply(TrajectoryAccepted(traj("a", 0, 40)))
    st.apply(MemberAbandoned("a", 1))
    assert st.fates.counts().lengths == {"lost_member": {40: 1}}
    assert st.fates.counts().abandoned == 1


def biased(long_kept: float, n: int = 40) -> FateCounts:
    """n trajectories of length 10 all consumed; n of length 100, `long_kept` of them."""
    keep = round(n * long_kept)
    lengths = {"consumed": {10: n, 100: keep}}
    if keep < n:
        lengths["staleness"] = {100: n - keep}
    return FateCounts(lengths=lengths)


def test_warning_names_the_setting_and_judges_only_enough_data() -> None:
    lam = AuditSettings(0.5, "laminar", 2, "release_partial")
    table = fate_table(biased(0.25), [], buckets=4)
    assert len(table.by_length) == 2  # two distinct lengths: two buckets, not four
    s = fate_summary(table)
    assert s is not None and s.long_vs_short == 0.25 and s.dropped == 30
    text = fate_warning(table, lam)
    assert text is not None and "buffer.max_staleness=2" in text and "staleness: 30" in text
    sync = fate_warning(table, AuditSettings(0.5, "sync", 0, "release_partial"))
    assert sync is not None and "mode=sync" in sync
    assert fate_warning(fate_table(biased(0.75), [], 4), lam) is None  # 0.75 >= 0.5
    assert fate_warning(fate_table(biased(0.75), [], 4), AuditSettings(0.8, "laminar", 2, "x"))
    small = fate_table(biased(0.0, n=MIN_JUDGED - 1), [], 4)
    assert fate_warning(small, lam) is None  # too few to judge
    lost = FateCounts(lengths={"consumed": {10: 40, 100: 4}, "lost_member": {100: 36}})
    text = fate_warning(fate_table(lost, [], 4), AuditSettings(0.5, "laminar", None, "drop_group"))
    assert text is not None and "lost_member_policy=drop_group" in text


def test_empty_audit() -> None:
    table = fate_table(FateCounts(), [], 4)
    assert table.by_length == [] and fate_summary(table) is None
    assert FateAudit(None).counts() == FateCounts()


# ---- the cluster: sim engine, tight bound ---------------------------------------------------
@pytest.fixture
def unadmitted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve prompts without admission (a drop-based staleness policy): the batch planner keeps
    the bound and drops what finished past it."""
    init = PromptServer.__init__

    def without_admission(self: PromptServer, *a: Any, admission: Admission, **kw: Any) -> None:
        init(self, *a, admission=Admission.for_mode("laminar", admission.batch_groups), **kw)

    monkeypatch.setattr(PromptServer, "__init__", without_admission)


def journal_fates(path: Path) -> Counter[tuple[str, int]]:
    """(fate, response length) -> trajectories, straight from the journal's records."""
    members: dict[str, dict[int, Trajectory]] = {}
    batches: dict[str, list[str]] = {}
    fate: dict[str, str] = {}
    for rec in read_records(path):
        match rec:
            case TrajectoryAccepted(trajectory=t):
                assert t.sample_index not in members.setdefault(t.group_id, {}), "stored twice"
                members[t.group_id][t.sample_index] = t
            case BatchServed():
                batches[rec.batch_id] = rec.group_ids
            case BatchCommitted():
                fate.update(dict.fromkeys(batches[rec.batch_id], "consumed"))
            case GroupsDropped():
                assert rec.reason == "expired"
                fate.update(dict.fromkeys(rec.group_ids, "staleness"))
    out: Counter[tuple[str, int]] = Counter()
    for gid, ms in members.items():
        for t in ms.values():
            f = fate.get(gid, "in_buffer") if usable(t) else "reward_failure"
            out[f, len(t.response_ids)] += 1
    return out


@pytest.mark.parametrize("bound", [1, None], ids=["bound1", "unbounded"])
async def test_tight_bound_drops_the_long_ones_and_the_audit_says_so(
    tmp_path: Path, unadmitted: None, bound: int | None, capsys: pytest.CaptureFixture[str]
) -> None:
    buffer: dict = {"capacity": 32, "audit_interval_s": 0.05}
    if bound is not None:
        buffer["max_staleness"] = bound
    cfg = sim_config(
        tmp_path,
        mode="laminar",
        rollouts=2,
        total_steps=16,
        trainer={"sim_time_per_token_s": 1e-3},
        buffer=buffer,
        rollout={
            "group_size": 2,
            "credits": 4,
            "sim": {"length_p50": 20, "length_p99_over_p50": 8, "step_time_s": 0.002},
        },
    )
    write_resolved(cfg)  # as `laminar run` does: the offline audit reads the bound from it
    async with LocalCluster(cfg) as cluster:
        await cluster.wait_trainer(timeout=120)
    buf = cluster.node("buffer-0")  # stopped: its state is what the journal holds
    journal = cfg.resolved_run_dir() / "buffer-0.journal"

    # the counts match the journal exactly: live state, offline replay, and the records
    expected = journal_fates(journal)
    live = buf.fates.table()
    offline = run_fates(cfg.resolved_run_dir())
    assert offline is not None
    for table in (live, offline.table):
        got: Counter[tuple[str, int]] = Counter()
        for fate, hist in buf.state.fates.counts().lengths.items():
            got.update({(fate, n): c for n, c in hist.items()})
        assert got + Counter({k: v for k, v in expected.items() if k[0] == "in_buffer"}) == expected
        per_bucket = [Counter() for _ in table.by_length]
        for (f, n), c in expected.items():
            per_bucket[next(i for i, r in enumerate(table.by_length) if n <= r.hi)][f] += c
        assert [Counter(r.fates) for r in table.by_length] == per_bucket
        assert all(r.lo <= n <= r.hi for r in table.by_length for n in [r.lo, r.hi])
        assert sum(r.generated for r in table.by_length) == sum(expected.values())

    dropped = sum(c for (f, _), c in expected.items() if f == "staleness")
    buf.refresh_audit()
    warning = buf.health.warnings.get("long_underrepresented")
    s = offline.summary
    assert s is not None and s.long_vs_short is not None
    if bound is None:
        assert dropped == 0 and warning is None and offline.warning is None
        assert s.long_vs_short == 1.0
    else:
        # the known bias: drops, most of them long; the warning names the setting and the fix
        assert dropped > 0 and s.long_vs_short < 0.5, s
        assert warning is not None and warning == offline.warning
        assert "buffer.max_staleness=1" in warning and "raise it" in warning

    # live: the trainer logged the buffer's figures as audit/* keys (metrics.jsonl, TensorBoard)
    logged = [m for m in trainer_metrics(cfg) if "audit/long_vs_short" in m]
    assert logged, "no step logged the audit"
    assert {"audit/long_kept", "audit/short_kept", "audit/dropped"} <= set(logged[-1])

    # `laminar report RUN_DIR`: the figure row and the section, with the warning when it holds
    assert main(["report", str(cfg.resolved_run_dir())]) == 0
    md = (cfg.resolved_run_dir() / "summary.md").read_text()
    assert "What the staleness policy did to the data" in md
    assert ("**Warning:**" in md) == (bound is not None)
    assert (cfg.resolved_run_dir() / "report.png").stat().st_size > 10_000
    print(f"bound {bound}: dropped {dropped}, long/short kept {s.long_vs_short:.2f}")


# ---- across modes: the demo's summary and figure ---------------------------------------------
def journal_run(run_dir: Path, mode: str, drop_long: bool) -> Path:
    """A run directory whose buffer journal holds 40 short (10 tokens) and 40 long (100 tokens)
    one-member groups, all consumed, or the long ones dropped past the bound."""
    from laminar.buffer.journal import Journal
    from laminar.config import config_from_dict

    write_resolved(config_from_dict({"mode": mode, "rollout": {"group_size": 1}}), run_dir)
    j = Journal(run_dir / "buffer-0.journal", "never")
    for _ in j.replay():  # opens the new file
        pass
    for i in range(80):
        gid, length = f"g{i}", 10 if i < 40 else 100
        item = PromptItem(uid=gid, group_id=gid, prompt_ids=np.arange(2, dtype=np.int32), n=1)
        j.append(GroupsServed([ServedGroup(gid, gid, 1, 0, item=item)]))
        j.append(TrajectoryAccepted(traj(gid, 0, length)))
    short, long = [f"g{i}" for i in range(40)], [f"g{i}" for i in range(40, 80)]
    j.append(BatchServed("b0", 0, short if drop_long else short + long))
    j.append(BatchCommitted("b0", 1, 1))
    if drop_long:
        j.append(GroupsDropped(long, reason="expired"))
    j.close()
    return run_dir


def test_demo_reports_the_audit_for_both_modes(tmp_path: Path) -> None:
    from laminar import report
    from laminar.demo.results import panels, summarize, summary_md
    from laminar.fates import fate_md

    lam = journal_run(tmp_path / "laminar", "laminar", drop_long=True)
    sync = journal_run(tmp_path / "sync", "sync", drop_long=False)
    curve = [{"t": 0.0, "step": 0, "accuracy": 0.3}, {"t": 9.0, "step": 5, "accuracy": 0.5}]
    metrics = [{"step": i, "time": float(i), "reward": 0.5} for i in range(1, 6)]
    runs = {
        name: {"run_dir": str(d), "curve": curve, "metrics": metrics, "wall_clock_s": 10.0}
        for name, d in (("laminar", lam), ("sync", sync))
    }
    runs["laminar"]["t0"] = runs["sync"]["t0"] = 0.0
    s = summarize("laminar", runs, {"accuracy": 0.3, "prompts": 8}, {**curve[-1], "prompts": 8}, 20)
    assert s["audit_long_vs_short"] == 0.0 and s["sync_audit_long_vs_short"] == 1.0
    assert "buffer.max_staleness" in s["audit_warning"] and s["sync_audit_warning"] is None
    fates = {name: run_fates(Path(r["run_dir"])) for name, r in runs.items()}
    md = summary_md(s, fate_md(fates))
    assert "share trained on (per-length audit; 1 = no bias) | 0.00 | 1.00 |" in md
    assert "### laminar" in md and "### sync" in md and md.count("**Warning:**") == 1
    png = report.draw(tmp_path / "report.png", panels(runs, fates), size=(13.0, 13.5))
    assert png.stat().st_size > 10_000
