"""A run that cannot train says so and stops: `laminar run`'s watch on the buffer's figures.

    watch = NoProgressWatch(cfg.cluster.no_progress_timeout_s, resumed=...)   # clock= for tests
    while running:                                                     # laminar/launch/run.py
        if watch.due():
            verdict = watch.observe(fetch_buffer_stats(cfg, timeout=1.0))   # launch/status.py
            if verdict is not None: print it, stop every node, exit 1

    buffer ──BufferStats──► observe ─► progress? (usable trajectories, trainer version): reset
                                    ─► failures? (refused by reason, unusable by cause): counted
                                    ─► no progress for timeout_s, failures since: the verdict,
                                       one line per top reason with its count

Every sample refused (`prompt_mismatch`, a reward out of range ...) or stored without a usable
reward (a reward that raises, an agent whose every call fails, an environment that breaks) leaves
every node healthy and the trainer waiting forever. The buffer sees all of it: BufferStats.refused
(per peer and reason), BufferStats.unusable_causes (the reward's, agent's or engine's error), the
usable trajectories (counts trajectories - unusable) and the trainer's committed version.

The clock starts when prompts are first served (or samples come back) during this launch: model
load and engine warm-up do not count, nor a resumed run's journaled figures (its first look is
their baseline). Any progress (a usable trajectory stored, a trainer step committed) resets it.
The verdict needs both: no progress for timeout_s and samples failed or refused since the
launch or the last progress; a run that progresses slowly, or whose episodes are merely long
(nothing fails), is never stopped. A buffer that restarted (its counters start over) only moves
the failure baseline.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from laminar.protocol.buffer import BufferStats

__all__ = ["NoProgressWatch", "REFUSAL_TEXT"]

REFUSAL_TEXT = {
    "not_served": "the buffer never served that group",
    "not_owner": "the sample is another rollout's (served or moved to it)",
    "prompt_mismatch": "the sample's prompt (its row's uid, or outside agent runs its token ids) "
    "is not the one its group was served with",
    "reward_range": "the reward is not finite or lies outside reward.min_value..max_value",
    "token_range": "a token id lies outside the model's vocabulary",
    "too_long": "the response is longer than any response can be (agent runs: or the prompt "
    "longer than data.max_prompt_tokens)",
    "batch_too_big": "a partial batch larger than the buffer takes",
}
"""What each refusal reason (laminar/protocol/buffer.py Refusal, a partial entry's) means."""

TOP_REASONS = 5
"""Reasons named in the verdict, most frequent first."""


def _failures(stats: BufferStats) -> tuple[int, Counter[str]]:
    """Samples refused or stored without a usable reward since the buffer started: the count,
    and by reason (the causes the buffer still remembers)."""
    out: Counter[str] = Counter()
    for reasons in stats.refused.values():
        for reason, n in reasons.items():
            out[f"refused {reason}"] += n
    refused = out.total()
    for cause, n in stats.unusable_causes.items():
        out[cause] += n
    return refused + stats.counts.get("unusable", 0), out


def _progress(stats: BufferStats) -> tuple[int, int]:
    """(usable trajectories stored, trainer version): either growing is progress."""
    counts = stats.counts
    return counts.get("trajectories", 0) - counts.get("unusable", 0), stats.trainer_version


def _reason_line(reason: str, n: int) -> str:
    refused = reason.removeprefix("refused ")
    if refused == reason:
        return f"  unusable x{n}: {reason}"
    why = REFUSAL_TEXT.get(refused)
    return f"  {refused} x{n}: refused by the buffer" + (f": {why}" if why else "")


class NoProgressWatch:
    def __init__(
        self,
        timeout_s: float,
        *,
        resumed: bool = False,
        poll_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """resumed: the run directory held an unfinished run (its buffer replays its journal:
        the figures at the first look are the past, not this launch's)."""
        self.timeout_s = timeout_s
        self.resumed = resumed
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.5, timeout_s / 10))
        self.clock = clock
        self._polled = -float("inf")
        self._served: int | None = None
        """Groups served before this launch (None: no look yet)."""
        self.since: float | None = None
        """When the clock started or progress was last seen (None: nothing served yet)."""
        self._progress = (0, 0)
        self._base: Counter[str] = Counter()
        """Failures by reason as they stood at the last progress (or before this launch)."""
        self._base_n = 0
        self._last_n = 0

    def due(self) -> bool:
        """Time for another look at the buffer (at most every poll_s)."""
        now = self.clock()
        if now - self._polled < self.poll_s:
            return False
        self._polled = now
        return True

    def observe(self, stats: BufferStats) -> str | None:
        """Take the buffer's latest figures; the verdict once nothing could train for timeout_s
        while samples failed or were refused, else None."""
        now = self.clock()
        n, failures = _failures(stats)
        if n < self._last_n:  # the buffer restarted: its counters start over
            self._base_n, self._base = n, failures
        self._last_n = n
        progress = _progress(stats)
        served = stats.counts.get("groups_served", 0)
        if self._served is None:  # the first look: what the run held before this launch
            self._served = served if self.resumed else 0
            self._progress = progress if self.resumed else (0, progress[1])
            if self.resumed:
                self._base_n, self._base = n, failures
        if self.since is None:
            if served <= self._served and n <= self._base_n:
                return None  # nothing served during this launch yet: the cluster is starting
            self.since = now  # the failures since the launch count
        if any(new > old for new, old in zip(progress, self._progress, strict=True)):
            self._reset(now, progress, n, failures)
            return None
        self._progress = progress
        idle = now - self.since
        if idle < self.timeout_s or n <= self._base_n:
            return None
        by_reason = failures - self._base  # only the positive differences
        lines = [_reason_line(r, k) for r, k in by_reason.most_common(TOP_REASONS)]
        if len(by_reason) > TOP_REASONS:
            lines.append(f"  and {len(by_reason) - TOP_REASONS} other reasons")
        head = (
            f"nothing could train for {idle:.0f} s (cluster.no_progress_timeout_s="
            f"{self.timeout_s:g}): no usable trajectory and no trainer step while "
            f"{n - self._base_n} samples failed or were refused"
        )
        return "\n".join([head + (":" if lines else ""), *lines])

    def _reset(self, now: float, progress: tuple[int, int], n: int, failures: Counter[str]) -> None:
        self.since, self._progress, self._base_n, self._base = now, progress, n, failures
