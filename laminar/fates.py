"""The per-length audit of a run directory, offline: what the staleness policy did to the data.

    audit = run_fates(Path("runs/my-run"))     # None without a buffer journal
    audit.table, audit.summary, audit.warning  # laminar/buffer/audit.py
    grid_row = fate_panels({"laminar": audit})   # one figure row (report.png, the demo's)
    lines = fate_md({"laminar": audit})          # the summary.md section

Reads every `buffer-*.journal` of the run directory read-only (laminar.buffer.journal_format
.read_records: no lock, safe beside a live buffer) and replays it into the buffer's state
as the run's config.yaml builds it, so the counts are the journal's, exactly, compaction
included (the audit's counters travel in StateCounters). `laminar report RUN_DIR` adds the
figure row and the section; the demo and bench/learning.py put laminar and sync side by side.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laminar.buffer.audit import (
    CONSUMED,
    IN_BUFFER,
    Bucket,
    FateTable,
    LiveGroup,
    fate_summary,
    fate_table,
    fate_warning,
)
from laminar.buffer.journal_format import JournalError, read_records
from laminar.buffer.records import FateCounts
from laminar.config import ConfigError, LaminarConfig, load_config
from laminar.protocol.buffer import AuditSummary
from laminar.wiring.buffer import audit_settings, experience_state

__all__ = ["RunFates", "fate_md", "fate_panels", "merge_counts", "run_fates", "summary_keys"]


@dataclass
class RunFates:
    table: FateTable
    summary: AuditSummary | None
    warning: str | None
    journals: int


def merge_counts(parts: list[FateCounts]) -> FateCounts:
    """The counters of several buffers as one."""

    def add(dst: dict[Any, dict[Any, int]], src: Mapping[Any, Mapping[Any, int]]) -> None:
        for k, hist in src.items():
            c = Counter(dst.get(k, {}))
            c.update(hist)
            dst[k] = dict(c)

    out = FateCounts()
    for p in parts:
        add(out.lengths, p.lengths)
        add(out.staleness, p.staleness)
        add(out.groups, p.groups)
        add(out.group_tokens, p.group_tokens)
        out.abandoned += p.abandoned
    return out


def _config(run_dir: Path) -> LaminarConfig:
    path = run_dir / "config.yaml"
    try:
        return load_config(path if path.exists() else None)
    except ConfigError:
        return load_config(None)  # an unreadable config: the defaults (buckets, warn ratio)


def run_fates(run_dir: Path) -> RunFates | None:
    """The audit of a run directory's buffer journals (None: no journal, or none readable)."""
    journals = sorted(Path(run_dir).glob("buffer-*.journal"))
    if not journals:
        return None
    cfg = _config(Path(run_dir))
    counts, live, read = [], [], 0
    for path in journals:
        state = experience_state(cfg)
        try:
            for rec in read_records(path):
                state.apply(rec)
        except (JournalError, OSError, KeyError):
            continue  # not a journal, gone, or cut mid-batch: the others still count
        read += 1
        counts.append(state.fates.counts())
        live += [LiveGroup(list(g.members.values())) for g in state.groups.values()]
    if not read:
        return None
    table = fate_table(merge_counts(counts), live, cfg.buffer.audit_buckets)
    return RunFates(table, fate_summary(table), fate_warning(table, audit_settings(cfg)), read)


def summary_keys(f: RunFates | None, prefix: str = "audit_") -> dict[str, Any]:
    """summary.json figures: the longest bucket against the shortest."""
    s = f.summary if f is not None else None
    if s is None:
        return {f"{prefix}long_vs_short": None}
    return {
        f"{prefix}long_vs_short": s.long_vs_short,
        f"{prefix}long_kept": s.long_kept,
        f"{prefix}short_kept": s.short_kept,
        f"{prefix}long_min_tokens": s.long_min_tokens,
        f"{prefix}long_token_share_generated": s.long_token_share_generated,
        f"{prefix}long_token_share_trained": s.long_token_share_trained,
        f"{prefix}dropped": s.dropped,
        f"{prefix}warning": f.warning if f is not None else None,
    }


# ---- the figure ---------------------------------------------------------------------------
_FATE_COLORS = {
    CONSUMED: "tab:green",
    "staleness": "tab:red",
    "lost_member": "tab:purple",
    "reward_failure": "tab:brown",
    IN_BUFFER: "lightgray",
}
_HATCH = {0: "", 1: "//", 2: "..", 3: "xx"}
_LINE_COLORS = [("black", "tab:blue"), ("dimgray", "tab:orange"), ("gray", "tab:cyan")]
"""Per run: (generated, trained) token-share lines."""


def _fate_order(rows: list[Bucket]) -> list[str]:
    seen = {k for r in rows for k in r.fates}
    known = [k for k in _FATE_COLORS if k in seen and k != IN_BUFFER]
    other = sorted(seen - set(_FATE_COLORS))
    return known + other + ([IN_BUFFER] if IN_BUFFER in seen else [])


def _stacked(
    a: Any, runs: Mapping[str, RunFates | None], rows_of: str, title: str, shares: bool
) -> None:
    present = {name: f for name, f in runs.items() if f is not None and f.table.by_length}
    if not present:
        where = {"ha": "center", "va": "center", "transform": a.transAxes, "color": "gray"}
        a.text(0.5, 0.5, "no buffer journal in the run directory", **where)
        a.set_title(title)
        return
    width = 0.8 / len(present)
    labelled: set[str] = set()
    n_max = 0
    twin = a.twinx() if shares else None
    for j, (name, f) in enumerate(present.items()):
        rows: list[Bucket] = getattr(f.table, rows_of)
        n_max = max(n_max, len(rows))
        xs = [i + (j - (len(present) - 1) / 2) * width for i in range(len(rows))]
        bottom = [0.0] * len(rows)
        for fate in _fate_order(rows):
            h = [r.fates.get(fate, 0) / r.generated if r.generated else 0.0 for r in rows]
            label = fate if fate not in labelled else None
            labelled.add(fate)
            a.bar(
                xs,
                h,
                width * 0.95,
                bottom=bottom,
                color=_FATE_COLORS.get(fate, "tab:orange"),
                hatch=_HATCH.get(j, ""),
                edgecolor="white",
                label=label,
            )
            bottom = [b + x for b, x in zip(bottom, h, strict=True)]
        for x, r in zip(xs, rows, strict=True):
            stale = "" if math.isnan(r.staleness_mean) else f"s̄ {r.staleness_mean:.1f}"
            who = f"{name[:3]} " if len(present) > 1 else ""
            text = f"{who}n={r.generated}\n{stale}"
            a.text(x, 1.01, text, ha="center", va="bottom", fontsize=6)
        if twin is not None:
            gen = [f.table.share(r)[0] for r in rows]
            trained = [f.table.share(r)[1] for r in rows]
            gen_c, trained_c = _LINE_COLORS[j % len(_LINE_COLORS)]
            twin.plot(xs, gen, "o--", color=gen_c, ms=4, lw=0.8, label=f"{name}: generated")
            twin.plot(xs, trained, "x-", color=trained_c, ms=6, lw=1.0, label=f"{name}: trained")
    if len(present) == 1:
        rows = getattr(next(iter(present.values())).table, rows_of)
        a.set_xticks(range(len(rows)), [r.label for r in rows], fontsize=7)
    else:
        a.set_xticks(range(n_max), [str(i + 1) for i in range(n_max)])
    a.set_ylim(0, 1.15)
    a.set_ylabel("share of the bucket's trajectories")
    a.set_title(title, fontsize=10)
    a.legend(fontsize=7, loc="lower left")
    if twin is not None:
        twin.set_ylim(0, max(0.6, twin.get_ylim()[1]))
        twin.set_ylabel("share of all response tokens")
        twin.legend(fontsize=7, loc="lower right")


def fate_panels(runs: Mapping[str, RunFates | None]) -> list[Any]:
    """One figure row: each trajectory's fate by response length (bars: shares of the bucket;
    lines: the bucket's share of generated vs trained tokens; s̄: mean staleness at consumption)
    and by prompt difficulty (the group's mean reward). Several runs: side by side, one hatch
    each, buckets numbered shortest first (each run has its own quantiles)."""
    hatched = ", ".join(n for i, n in enumerate(runs) if i > 0)
    suffix = (
        f"\n{next(iter(runs))}: left, plain; {hatched}: right, hatched" if len(runs) > 1 else ""
    )

    def by_length(a: Any) -> None:
        _stacked(
            a,
            runs,
            "by_length",
            f"Fate by response length (tokens, quantile buckets){suffix}",
            shares=True,
        )
        a.set_xlabel("response length bucket (shortest first)")

    def by_difficulty(a: Any) -> None:
        _stacked(a, runs, "by_difficulty", f"Fate by group mean reward{suffix}", shares=False)
        a.set_xlabel("group mean reward (low = hard)")

    return [by_length, by_difficulty]


# ---- the summary ----------------------------------------------------------------------------
def _row(f: RunFates, r: Bucket, staleness: bool = True) -> str:
    gen, trained = f.table.share(r)
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(r.dropped.items())) or "0"
    kept = "n/a" if math.isnan(r.kept) else f"{r.kept:.0%}"
    cells = [r.label, r.generated, r.consumed, dropped, r.fates.get(IN_BUFFER, 0), kept]
    if staleness:
        mean = r.staleness_mean
        cells.append("n/a" if math.isnan(mean) else f"{mean:.2f} / {r.staleness_max}")
    cells += [f"{gen:.1%}", f"{trained:.1%}"]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def fate_md(runs: Mapping[str, RunFates | None]) -> list[str]:
    """The summary.md section: per run, its length buckets and difficulty bins."""
    lines = [
        "",
        "## What the staleness policy did to the data (per-length audit, from the buffer journal)",
        "",
        "Kept = consumed / (consumed + dropped): the share of a bucket's decided trajectories "
        "that training saw; 1.0 everywhere is no bias. Staleness at consumption: mean / max.",
    ]
    head = (
        "| {what} | generated | consumed | dropped (why) | in buffer | kept |{stale} "
        "share of generated tokens | share of trained tokens |"
    )
    for name, f in runs.items():
        lines += ["", f"### {name}", ""] if len(runs) > 1 else [""]
        if f is None or not f.table.by_length:
            lines.append("No buffer journal (buffer.journal=false) or no finished trajectory.")
            continue
        s = f.summary
        if s is not None and s.long_vs_short is not None:
            lines.append(
                f"Longest bucket (>= {s.long_min_tokens} tokens) against the shortest "
                f"(<= {s.short_max_tokens}): kept ratio **{s.long_vs_short:.2f}**; samples "
                f"abandoned before they finished: {f.table.abandoned}."
            )
        if f.warning:
            lines += ["", f"**Warning:** {f.warning}"]
        stale = " staleness at consumption |"
        lines += ["", head.format(what="response tokens", stale=stale), "|---" * 9 + "|"]
        lines += [_row(f, r) for r in f.table.by_length]
        if f.table.by_difficulty:
            lines += ["", head.format(what="group mean reward", stale=""), "|---" * 8 + "|"]
            lines += [_row(f, r, staleness=False) for r in f.table.by_difficulty]
    return lines
