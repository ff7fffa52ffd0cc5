"""What the staleness policy did to the data: every finished trajectory's fate, by response length
and by prompt difficulty.

    audit = FateAudit()                       # kept by ExperienceState, rebuilt by journal replay
    audit.commit(usable, failed, version, 0)  # a committed group (experience.py _apply_commit)
    audit.drop(members, 0, "expired")         # a dropped group (experience.py _drop)
    table = fate_table(audit.counts(), live, buckets=4)  # per length bucket / difficulty bin
    summary = fate_summary(table)      # the live keys (BatchReply.audit -> metrics.jsonl)
    text = fate_warning(table, AuditSettings(0.5, "laminar", 2, "release_partial"))  # or None

Asynchronous training drops or delays the trajectories that take longest (the long responses
to the hard prompts): a group that finishes more than buffer.max_staleness versions behind
the batch is dropped (`expired`), and drop_group drops a whole group at its first lost
member. The audit counts that per trajectory from what the buffer already decides, at group
granularity: nothing is added to the per-trajectory path (a group's members are counted when
the group is committed or dropped; the members of live groups are read when the table is
made, as `in_buffer`). The counts travel through compaction in StateCounters, so a replay
of the journal (laminar/journal_check.py) rebuilds them exactly.

Fates of a finished trajectory:
    consumed        its group was committed by a trainer step (trained on)
    staleness       its group was dropped past the staleness bound (GroupsDropped "expired")
    lost_member     drop_group dropped its group at a lost member
    reward_failure  no usable reward (None, NaN, the engine's error): never trained
    <reason>        any other drop reason, as the buffer names it
    in_buffer       its group is still open, ready or outstanding (not decided yet)
Samples abandoned before they finished (TrajectoryAbandoned: a dead rollout or engine) have
no length: they are counted apart (`abandoned`). A lease that runs out or a rollout's
retraction loses no finished trajectory (the group is served again, its members kept), so
neither is a fate of its own.

Length buckets are quantiles of the response length of the trajectories with a fate (ties
keep a length in one bucket, so there may be fewer; the first and last widen to hold the live
ones); difficulty is the group's mean usable reward
(rounded to 0.01), in at most `buckets` bins of equal width over the rewards seen.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from laminar.buffer.records import FateCounts
from laminar.protocol.buffer import AuditSummary
from laminar.protocol.data import Trajectory

__all__ = [
    "CONSUMED",
    "IN_BUFFER",
    "AuditSettings",
    "Bucket",
    "FateAudit",
    "FateTable",
    "LiveGroup",
    "fate_summary",
    "fate_table",
    "fate_warning",
]

CONSUMED, IN_BUFFER, REWARD_FAILURE = "consumed", "in_buffer", "reward_failure"
DROP_FATES = {"expired": "staleness", "no_usable_member": REWARD_FAILURE}
"""The buffer's drop reason -> the audit's fate (any other reason is its own fate)."""
NO_REWARD = "none"
"""Difficulty key of a group without a usable reward."""
MIN_JUDGED = 16
"""The warning judges a bucket only once this many of its trajectories have a fate."""


def difficulty(rewards: Sequence[float]) -> str:
    """A group's difficulty key: its mean usable reward to 0.01 ("none" without one)."""
    return f"{sum(rewards) / len(rewards):.2f}" if rewards else NO_REWARD


def _usable(t: Trajectory) -> bool:
    return t.reward is not None and math.isfinite(t.reward) and t.finish_reason != "error"


class FateAudit:
    """The counters: fate -> response length -> trajectories; consumed length -> staleness ->
    trajectories; fate -> difficulty -> (trajectories, tokens); abandoned samples."""

    def __init__(self, counts: FateCounts | None = None) -> None:
        c = counts or FateCounts()
        self.lengths: dict[str, Counter[int]] = {k: Counter(v) for k, v in c.lengths.items()}
        self.staleness: dict[int, Counter[int]] = {k: Counter(v) for k, v in c.staleness.items()}
        self.difficulty: dict[str, Counter[str]] = {k: Counter(v) for k, v in c.groups.items()}
        self.difficulty_tokens: dict[str, Counter[str]] = {
            k: Counter(v) for k, v in c.group_tokens.items()
        }
        self.abandoned = c.abandoned

    def _count(self, fate: str, members: list[Trajectory], key: str) -> None:
        if not members:
            return
        lengths = self.lengths.setdefault(fate, Counter())
        tokens = 0
        for t in members:
            size = len(t.response_ids)
            lengths[size] += 1
            tokens += size
        self.difficulty.setdefault(fate, Counter())[key] += len(members)
        self.difficulty_tokens.setdefault(fate, Counter())[key] += tokens

    def commit(
        self, usable: list[Trajectory], unusable: list[Trajectory], version: int, abandoned: int
    ) -> None:
        """A committed group: its usable members consumed at batch `version`, `unusable` ones
        failed, `abandoned` ones never finished."""
        self.abandoned += abandoned
        key = difficulty([t.reward for t in usable if t.reward is not None])
        self._count(CONSUMED, usable, key)
        self._count(REWARD_FAILURE, unusable, key)
        for t in usable:
            stale = max(0, version - t.version)
            self.staleness.setdefault(len(t.response_ids), Counter())[stale] += 1

    def drop(self, members: Iterable[Trajectory], abandoned: int, reason: str) -> None:
        """A dropped group: its finished members take the drop's fate (a member without a
        usable reward: reward_failure); `abandoned` members never finished."""
        ok: list[Trajectory] = []
        failed: list[Trajectory] = []
        for t in members:
            (ok if _usable(t) else failed).append(t)
        key = difficulty([t.reward for t in ok if t.reward is not None])
        self._count(DROP_FATES.get(reason, reason), ok, key)
        self._count(REWARD_FAILURE, failed, key)
        self.abandoned += abandoned

    def counts(self) -> FateCounts:
        """A detached copy (compaction encodes it on another thread)."""
        return FateCounts(
            lengths={k: dict(v) for k, v in self.lengths.items()},
            staleness={k: dict(v) for k, v in self.staleness.items()},
            groups={k: dict(v) for k, v in self.difficulty.items()},
            group_tokens={k: dict(v) for k, v in self.difficulty_tokens.items()},
            abandoned=self.abandoned,
        )


@dataclass
class LiveGroup:
    """A group not decided yet (open, ready, outstanding): its finished members."""

    members: list[Trajectory]


@dataclass
class Bucket:
    """One row of the table: trajectories of a length range (or a difficulty bin) by fate."""

    label: str
    lo: float
    hi: float
    fates: dict[str, int] = field(default_factory=dict)
    """Fate -> trajectories (consumed, staleness, ..., in_buffer)."""
    tokens: dict[str, int] = field(default_factory=dict)
    """Fate -> response tokens."""
    staleness_mean: float = math.nan
    staleness_max: int = 0

    @property
    def generated(self) -> int:
        return sum(self.fates.values())

    @property
    def consumed(self) -> int:
        return self.fates.get(CONSUMED, 0)

    @property
    def decided(self) -> int:
        """Trajectories with a fate (all but in_buffer)."""
        return self.generated - self.fates.get(IN_BUFFER, 0)

    @property
    def dropped(self) -> dict[str, int]:
        return {k: v for k, v in self.fates.items() if k not in (CONSUMED, IN_BUFFER) and v}

    @property
    def kept(self) -> float:
        """Consumed / decided: the share of its decided trajectories training saw."""
        return self.consumed / self.decided if self.decided else math.nan


@dataclass
class FateTable:
    by_length: list[Bucket]
    """Shortest first."""
    by_difficulty: list[Bucket]
    """Lowest mean reward (hardest) first; a last "none" bin for groups without a reward."""
    abandoned: int = 0
    generated_tokens: int = 0
    trained_tokens: int = 0

    def share(self, b: Bucket) -> tuple[float, float]:
        """(its share of the generated tokens, its share of the trained tokens)."""
        if not self.generated_tokens:
            return math.nan, math.nan
        trained = b.tokens.get(CONSUMED, 0) / self.trained_tokens if self.trained_tokens else 0.0
        return sum(b.tokens.values()) / self.generated_tokens, trained


def _quantile_edges(hist: Counter[int], buckets: int) -> list[int]:
    """Upper edges (inclusive) of up to `buckets` length ranges of about equal counts."""
    total = sum(hist.values())
    edges: list[int] = []
    acc, k = 0, 1
    for length in sorted(hist):
        acc += hist[length]
        while k < buckets and acc >= k * total / buckets:
            if not edges or edges[-1] != length:
                edges.append(length)
            k += 1
    last = max(hist)
    if not edges or edges[-1] != last:
        edges.append(last)
    return edges


def fate_table(counts: FateCounts, live: Sequence[LiveGroup], buckets: int = 4) -> FateTable:
    """The audit as rows: `counts` (FateAudit.counts) plus the members of the live groups."""
    lengths = {k: Counter(v) for k, v in counts.lengths.items()}
    groups = {k: Counter(v) for k, v in counts.groups.items()}
    group_tokens = {k: Counter(v) for k, v in counts.group_tokens.items()}
    for g in live:
        key = difficulty([t.reward for t in g.members if _usable(t) and t.reward is not None])
        for t in g.members:
            size = len(t.response_ids)
            lengths.setdefault(IN_BUFFER, Counter())[size] += 1
            groups.setdefault(IN_BUFFER, Counter())[key] += 1
            group_tokens.setdefault(IN_BUFFER, Counter())[key] += size
    decided: Counter[int] = Counter()
    for fate, hist in lengths.items():
        if fate != IN_BUFFER:
            decided.update(hist)
    every = decided + lengths.get(IN_BUFFER, Counter())
    table = FateTable(by_length=[], by_difficulty=[], abandoned=counts.abandoned)
    if not every:
        return table
    # the edges are quantiles of the decided trajectories (of all while none is decided), so the
    # table with the live groups and the one without (the live figures) share them
    rows: list[Bucket] = []
    prev = -1
    basis = decided or every
    for hi in _quantile_edges(basis, buckets):
        lo = min(n for n in basis if prev < n <= hi)
        rows.append(Bucket("", lo, hi))
        prev = hi
    rows[0].lo, rows[-1].hi = min(rows[0].lo, min(every)), max(rows[-1].hi, max(every))
    for r in rows:
        r.label = f"{r.lo:g}-{r.hi:g}" if r.lo != r.hi else f"{r.lo:g}"
    for fate, hist in lengths.items():
        for size, n in hist.items():
            row = next(r for r in rows if size <= r.hi)
            row.fates[fate] = row.fates.get(fate, 0) + n
            row.tokens[fate] = row.tokens.get(fate, 0) + n * size
    for row in rows:
        stale: Counter[int] = Counter()
        for size, by_stale in counts.staleness.items():
            if row.lo <= size <= row.hi:
                stale.update(by_stale)
        if stale:
            row.staleness_mean = sum(s * n for s, n in stale.items()) / sum(stale.values())
            row.staleness_max = max(stale)
    table.by_length = rows
    table.by_difficulty = _difficulty_rows(groups, group_tokens, buckets)
    table.generated_tokens = sum(sum(r.tokens.values()) for r in rows)
    table.trained_tokens = sum(r.tokens.get(CONSUMED, 0) for r in rows)
    return table


def _difficulty_rows(
    groups: dict[str, Counter[str]], tokens: dict[str, Counter[str]], buckets: int
) -> list[Bucket]:
    keys = {k for hist in groups.values() for k in hist}
    values = sorted(float(k) for k in keys if k != NO_REWARD)
    rows: list[Bucket] = []
    if values:
        lo, hi = values[0], values[-1]
        distinct = sorted(set(values))
        if len(distinct) <= buckets:  # e.g. 0/1 rewards: the group's share right, exactly
            rows = [Bucket(f"{v:.2f}", v, v) for v in distinct]
        else:
            width = (hi - lo) / buckets
            rows = [
                Bucket(f"{a:.2f}-{a + width:.2f}", a, a + width)
                for a in (lo + i * width for i in range(buckets))
            ]
    none = Bucket("no reward", math.nan, math.nan)
    for fate, hist in groups.items():
        for key, n in hist.items():
            if key == NO_REWARD:
                row = none
            else:
                v = float(key)
                row = next((r for r in rows if v <= r.hi + 1e-9), rows[-1])
            row.fates[fate] = row.fates.get(fate, 0) + n
            row.tokens[fate] = row.tokens.get(fate, 0) + tokens.get(fate, Counter())[key]
    return [r for r in rows if r.fates] + ([none] if none.fates else [])  # no empty bins


def fate_summary(table: FateTable) -> AuditSummary | None:
    """The live keys: the longest length bucket against the shortest, over the trajectories
    with a fate (so the same with or without the live groups; None before any data)."""
    if not table.by_length:
        return None
    short, long = table.by_length[0], table.by_length[-1]

    def decided_tokens(b: Bucket) -> int:
        return sum(n for fate, n in b.tokens.items() if fate != IN_BUFFER)

    every = sum(decided_tokens(b) for b in table.by_length)
    trained = table.trained_tokens
    ratio = long.kept / short.kept if short.kept else math.nan
    return AuditSummary(
        long_min_tokens=int(long.lo),
        short_max_tokens=int(short.hi),
        long_kept=_finite(long.kept),
        short_kept=_finite(short.kept),
        long_vs_short=_finite(ratio),
        long_token_share_generated=decided_tokens(long) / every if every else None,
        long_token_share_trained=long.tokens.get(CONSUMED, 0) / trained if trained else None,
        long_decided=long.decided,
        short_decided=short.decided,
        dropped=sum(sum(r.dropped.values()) for r in table.by_length),
    )


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class AuditSettings:
    """What the warning reads of the config (laminar/wiring/buffer.py `audit_settings` builds it
    for the buffer node and `laminar fates`)."""

    warn_ratio: float
    mode: str
    max_staleness: int | None
    lost_member_policy: str


def fate_warning(table: FateTable, settings: AuditSettings) -> str | None:
    """What to say when the longest bucket is kept less than settings.warn_ratio times as often
    as the shortest (judged once each has MIN_JUDGED decided trajectories), naming the setting
    behind its drops and what to change; None when it is not."""
    warn_ratio = settings.warn_ratio
    s = fate_summary(table)
    if s is None or s.long_vs_short is None or s.long_kept is None or s.short_kept is None:
        return None
    if min(s.long_decided, s.short_decided) < MIN_JUDGED or s.long_vs_short >= warn_ratio:
        return None
    long = table.by_length[-1]
    dropped = ", ".join(f"{k}: {v}" for k, v in sorted(long.dropped.items()))
    return (
        f"the longest responses (>= {s.long_min_tokens} tokens) are under-represented in "
        f"training: {s.long_kept:.0%} of them were trained on against {s.short_kept:.0%} of the "
        f"shortest (<= {s.short_max_tokens} tokens), ratio {s.long_vs_short:.2f} < "
        f"buffer.audit_warn_ratio {warn_ratio}; dropped: {dropped or 'none'}. "
        + _causes(long, settings)
    )


def _causes(long: Bucket, settings: AuditSettings) -> str:
    """The settings behind a bucket's drops, and what to change."""
    mode, max_staleness = settings.mode, settings.max_staleness
    lost_member_policy = settings.lost_member_policy
    advice = []
    for fate, _n in sorted(long.dropped.items(), key=lambda kv: -kv[1]):
        if fate == "staleness":
            if mode in ("sync", "one_step"):
                advice.append(
                    f"mode={mode} fixes the staleness bound at {0 if mode == 'sync' else 1}: "
                    "run mode=laminar with a buffer.max_staleness large enough for the longest "
                    "responses"
                )
            else:
                advice.append(
                    f"buffer.max_staleness={max_staleness} drops groups that finish that many "
                    "versions behind, and long responses finish last: raise it (or null, "
                    "unbounded) and let the trainer's correction (algo.is_mode) handle the "
                    "staleness"
                )
        elif fate == "lost_member":
            advice.append(
                f"buffer.lost_member_policy={lost_member_policy} drops a whole group at its "
                "first lost member, and long samples are the ones lost: use release_partial"
            )
        elif fate == REWARD_FAILURE:
            advice.append(
                "the reward fails more often on long responses: check reward.timeout_s and the "
                "reward's errors (laminar status)"
            )
        else:
            advice.append(f"groups dropped as {fate!r}")
    return "Cause: " + "; ".join(advice) + "." if advice else ""
