"""The silent stall: warn when trajectories arrive but nothing becomes trainable, and say why.

    health = StallWatch(cfg.buffer, cfg.reward.fn, state, metrics, log)   # clock= for tests
    health.observe(t)        # every stored trajectory (the intake calls it)
    health.check()           # also on a timer (the node): the stall needs no new arrival
    health.warnings          # the active warnings, by kind: NodeStatus.warnings

A trajectory without a usable reward (None: the reward said "not applicable" or failed;
an engine error) is stored but never trained on, and a group with no usable member
is dropped. When every sample ends that way the trainer waits forever while every
node looks healthy. Two checks catch it:

    rewards_none   more than buffer.stall_warn_none_frac of the last buffer.stall_window
                   trajectories have no usable reward (checked once min(window, 8) arrived)
    stalled        trajectories arrived but no whole group became ready for
                   buffer.stall_warn_after_s seconds
    reward_timeouts  the reward timed out (reward.timeout_s) on any of the last stall_window
                   trajectories: a hanging reward costs a whole timeout per sample, so
                   throughput collapses even when most rewards still come back; the
                   warning gives the count in the window and since start

Each warning names the causes with their counts (the reward's error, the row field it
could not find, the row's fields, a hint for verl-style rows) and the groups dropped
and why. A warning is logged when it first holds and then at most once per
stall_warn_after_s while it still holds; it is counted (`warn_<kind>`) and stays in
`warnings` until its condition clears. Causes are also counted since start (`totals`,
BufferStats.unusable_causes: what `laminar run` names when nothing can train).
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter, deque
from collections.abc import Callable

import structlog

from laminar.buffer.audit import (
    AuditSettings,
    FateTable,
    LiveGroup,
    fate_summary,
    fate_table,
    fate_warning,
)
from laminar.buffer.experience import ExperienceState
from laminar.config import BufferConfig
from laminar.metrics import Metrics
from laminar.protocol.buffer import AuditSummary
from laminar.protocol.data import Trajectory
from laminar.rewards.builtin import REFERENCE_FIELDS

__all__ = ["FateWatch", "StallWatch", "none_cause"]

_MIN_WINDOW = 8
"""The None fraction is judged only over at least this many trajectories (or a full window)."""
_BUILTIN_REWARDS = ("laminar.rewards.builtin:", "laminar.tasks.countup:reward")
_EPISODE_KINDS = {"agent": "the agent failed", "env": "the environment failed"}
"""reward_error_kind of an episode that ended in error, not in the engine."""
MAX_CAUSES = 32
"""Causes counted since start (StallWatch.totals): a cause text can carry a per-sample detail,
so the rarest is forgotten past this many."""
_KEY_ERROR = re.compile(r"^KeyError: '([^']+)'")
_MISSING_ARG = re.compile(
    r"missing \d+ required (?:positional |keyword-only )?arguments?: '([^']+)'"
)


def none_cause(t: Trajectory, builtin_reward: bool) -> tuple[str, str | None]:
    """(cause, field) of a trajectory without a usable reward: field names the row field the
    reward could not find, "" when it returned None for no stated reason, None when the
    cause is not about the row (an engine error, a reward that crashed)."""
    err, kind = t.reward_error, t.reward_error_kind
    if kind == "engine" or (t.finish_reason == "error" and not kind):
        return f"the engine failed to generate ({err or 'finish_reason error'})", None
    if kind in _EPISODE_KINDS:
        first = err.partition("\n")[0]  # a traceback follows the error itself
        return f"{_EPISODE_KINDS[kind]}: {first[:300]}", None
    if err:
        found = _KEY_ERROR.match(err) or _MISSING_ARG.search(err)
        if found:
            field = found.group(1)
            return f"the reward read a field the row does not have: {field!r} ({err[:120]})", field
        return f"the reward failed ({t.reward_error_kind or 'error'}): {err[:160]}", None
    if t.reward is not None and not math.isfinite(t.reward):
        return f"the reward is not finite ({t.reward})", None
    if builtin_reward:
        names = " or ".join(repr(f) for f in REFERENCE_FIELDS)
        return f"the reward found no {names} in the row", "answer"
    return "the reward returned None ('not applicable')", ""


def _hint(field: str | None, row_keys: list[str]) -> str:
    """A verl-shaped row whose reward looked for a TRL-style reference."""
    trl_ref = "answer" in row_keys or "ground_truth" in row_keys
    if "reward_model" in row_keys and not trl_ref and field in ("answer", "ground_truth", ""):
        return (
            "; verl-style rows keep the reference at reward_model.ground_truth (a custom reward "
            "gets it as reward_model=dict; the built-in rewards read it)"
        )
    return ""


class StallWatch:
    def __init__(
        self,
        bc: BufferConfig,
        reward_fn: str,
        state: ExperienceState,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.none_frac = bc.stall_warn_none_frac
        self.after_s = bc.stall_warn_after_s
        self.builtin_reward = reward_fn.startswith(_BUILTIN_REWARDS)
        self.state = state
        self.metrics = metrics
        self.log = log
        self.clock = clock
        self.window: deque[str | None] = deque(maxlen=bc.stall_window)
        """Per trajectory: None (usable) or its cause."""
        self.timed_out: deque[bool] = deque(maxlen=bc.stall_window)
        """Per trajectory of the window: did its reward time out?"""
        self.timeouts_total = 0
        self._timeouts = 0
        """True entries of `timed_out` (kept as it changes: checked per trajectory)."""
        self._timeout_example = ""
        self.causes: Counter[str] = Counter()
        """Causes of the trajectories in the window."""
        self.totals: Counter[str] = Counter()
        """Causes since start (at most MAX_CAUSES): BufferStats.unusable_causes."""
        self.example: dict[str, tuple[str | None, list[str]]] = {}
        """cause -> (missing field, row fields) of its latest trajectory."""
        self.warnings: dict[str, str] = {}
        self._logged: dict[str, float] = {}
        self._ready = state.counts["groups_ready"]
        self._ready_t = clock()
        self._arrived = 0
        """Trajectories stored since the last group became ready."""
        self._stalled_at = -math.inf
        """When the stalled text was last made: at most once a second (it counts the open
        groups, a pass over every group, and check runs per trajectory)."""

    # ---- inputs -------------------------------------------------------------------------
    def observe(self, t: Trajectory) -> None:
        """A trajectory was stored: window it, then check."""
        cause: str | None = None
        if t.reward is None or not math.isfinite(t.reward) or t.finish_reason == "error":
            cause, field = none_cause(t, self.builtin_reward)
            self.example[cause] = (field, sorted(t.row))
            self.metrics.count("reward_none")
        if len(self.window) == self.window.maxlen:
            old = self.window[0]
            if old is not None:
                self.causes[old] -= 1
                if self.causes[old] <= 0:
                    del self.causes[old]
        self.window.append(cause)
        if cause is not None:
            self.causes[cause] += 1
            if cause not in self.totals and len(self.totals) >= MAX_CAUSES:
                del self.totals[min(self.totals, key=self.totals.__getitem__)]
            self.totals[cause] += 1
        timeout = t.reward_error_kind == "timeout"
        if len(self.timed_out) == self.timed_out.maxlen and self.timed_out[0]:
            self._timeouts -= 1
        self.timed_out.append(timeout)
        self._timeouts += timeout
        if timeout:
            self.timeouts_total += 1
            self._timeout_example = t.reward_error[:120]
        self._arrived += 1
        self.check()

    def check(self) -> None:
        """Re-evaluate both warnings (cheap; rate-limited logging)."""
        now = self.clock()
        ready = self.state.counts["groups_ready"]
        if ready != self._ready:
            self._ready, self._ready_t, self._arrived = ready, now, 0
        seen = len(self.window)
        none = sum(self.causes.values())
        enough = seen >= min(_MIN_WINDOW, self.window.maxlen or _MIN_WINDOW)
        if enough and none > self.none_frac * seen:
            text = f"reward None for {none}/{seen} of the last trajectories: {self._causes_text()}"
            self._warn("rewards_none", f"{text}; {self._dropped_text()}", now)
        else:
            self._clear("rewards_none")
        idle = now - self._ready_t
        if self._arrived and idle >= self.after_s:
            if "stalled" in self.warnings and now - self._stalled_at < 1.0:
                return self._check_timeouts(now)
            self._stalled_at = now
            text = (
                f"no whole group became ready for {idle:.0f} s while {self._arrived} trajectories "
                f"arrived ({self.state.open_groups()} groups still open); {self._dropped_text()}"
            )
            if none:
                text += f"; reward None for {none}/{seen}: {self._causes_text()}"
            self._warn("stalled", text, now)
        else:
            self._clear("stalled")
        self._check_timeouts(now)

    def _check_timeouts(self, now: float) -> None:
        timeouts = self._timeouts
        if timeouts:
            text = (
                f"the reward timed out on {timeouts}/{len(self.timed_out)} of the last "
                f"trajectories ({self.timeouts_total} since start; {self._timeout_example}): each "
                "costs a whole reward.timeout_s, so throughput drops; fix the hanging reward or "
                "lower reward.timeout_s"
            )
            self._warn("reward_timeouts", text, now)
        else:
            self._clear("reward_timeouts")

    # ---- text -------------------------------------------------------------------------
    def _causes_text(self) -> str:
        parts = []
        for cause, n in self.causes.most_common(3):
            field, keys = self.example.get(cause, (None, []))
            parts.append(
                f"{cause} [{n}] (row fields: {', '.join(keys) or 'none'}){_hint(field, keys)}"
            )
        return "; ".join(parts)

    def _dropped_text(self) -> str:
        counts = self.state.counts
        why = {
            k.removeprefix("dropped_"): v
            for k, v in counts.items()
            if k.startswith("dropped_") and v
        }
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(why.items()))
        return f"{counts['groups_dropped']} groups dropped so far" + (
            f" ({reasons})" if reasons else ""
        )

    def hold(self, kind: str, text: str | None) -> None:
        """Another check's verdict (FateWatch): warn `text` while it is not None, else clear."""
        if text is None:
            self._clear(kind)
        else:
            self._warn(kind, text, self.clock())

    # ---- state ------------------------------------------------------------------------
    def _warn(self, kind: str, text: str, now: float) -> None:
        self.warnings[kind] = text
        last = self._logged.get(kind)
        if last is None or now - last >= self.after_s:
            self._logged[kind] = now
            self.metrics.count(f"warn_{kind}")
            self.log.warning(kind, detail=text)

    def _clear(self, kind: str) -> None:
        # the rate limit (_logged) survives a clear: a fraction hovering at the threshold
        # must not log at every trajectory
        if self.warnings.pop(kind, None) is not None:
            self.log.info(f"{kind}_cleared")


class FateWatch:
    """The per-length audit (laminar/buffer/audit.py), remade at most every
    buffer.audit_interval_s: its live figures for the trainer, and the warning when the longest
    responses are under-represented in training (`long_underrepresented`)."""

    KIND = "long_underrepresented"

    def __init__(
        self,
        bc: BufferConfig,
        settings: AuditSettings,
        state: ExperienceState,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.buckets = bc.audit_buckets
        self.every = bc.audit_interval_s
        self.settings = settings
        self.state = state
        self.clock = clock
        self.summary: AuditSummary | None = None
        self.warning: str | None = None
        self._at = -math.inf

    def table(self, live: bool = True) -> FateTable:
        """The audit; `live`: with the members of the live groups (in_buffer), read here."""
        groups = self.state.groups.values() if live else ()
        members = [LiveGroup(list(g.members.values())) for g in groups]
        return fate_table(self.state.fates.counts(), members, self.buckets)

    def due(self) -> bool:
        return self.clock() - self._at >= self.every

    def refresh(self) -> None:
        """Remake the live figures and the warning from the decided trajectories alone:
        O(distinct response lengths), whatever the buffer holds; never per trajectory."""
        self._at = self.clock()
        table = self.table(live=False)
        self.summary = fate_summary(table)
        self.warning = fate_warning(table, self.settings)
