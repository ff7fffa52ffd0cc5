"""The buffer's group counts, in process: what a prompt request's admission and a trainer's
timed-out batch request read, kept as groups change against a scan of every live group (issue
51, eighth session).

    .venv/bin/python bench/group_counts.py --out bench/results/group_counts.json   # ~20 s

ExperienceState (laminar/buffer/experience.py) keeps the open-group count and the OPEN or READY
groups by version as they change. Before, `open_groups()` and `unconsumed_by_version()` scanned
every live group each call; the baseline here is that scan, run on the same state in the same
run. Shape: --groups live groups (group size 4) served at 8 versions, a third with all members in
(ready), a third with two, a third with none; each figure is the median of --repeats calls. Who
calls them: with a staleness bound (buffer.max_staleness) every PromptRequest's admission reads
the groups by version, and with global updates (modes sync, one_step, stream) every PromptRequest
asks whether a group older than its version is still open (the worst case for the scan: none is,
so it reads every group); a BatchRequest that times out and the stall check read the open count.
At the 7B multi-turn 1024-GPU row (~68 groups started a second) the prompt requests alone make
~68 reads a second.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchinfo import git_state  # noqa: E402

from laminar.buffer.experience import OPEN, ExperienceState  # noqa: E402
from laminar.buffer.records import GroupsServed, ServedGroup, TrajectoryAccepted  # noqa: E402
from laminar.modes import Admission  # noqa: E402
from laminar.protocol.data import PromptItem, Trajectory  # noqa: E402

GROUP_SIZE = 4


def build(groups: int) -> ExperienceState:
    """A state with `groups` live groups (see the module docstring)."""
    st = ExperienceState(
        group_size=GROUP_SIZE,
        lost_member_policy="release_partial",
        admission=Admission.for_mode("laminar", 4),
    )
    ids = np.arange(8, dtype=np.int32)
    for k in range(groups):
        gid, version = f"g{k}", k % 8
        item = PromptItem(uid=f"u{k}", group_id=gid, prompt_ids=ids, n=GROUP_SIZE)
        st.apply(GroupsServed([ServedGroup(gid, item.uid, GROUP_SIZE, version, item=item)]))
        for i in range((0, 2, GROUP_SIZE)[k % 3]):
            t = Trajectory(
                uid=f"{gid}/{i}",
                group_id=gid,
                prompt_uid=item.uid,
                sample_index=i,
                prompt_ids=ids,
                response_ids=ids,
                logprobs=np.zeros(8, np.float32),
                version=version,
                reward=1.0,
            )
            st.apply(TrajectoryAccepted(t))
    return st


def timed(fn: Any, repeats: int) -> float:
    """Median seconds of one call."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def run(groups: int, repeats: int) -> dict[str, Any]:
    st = build(groups)

    def scan_open() -> int:  # what open_groups() did before
        return sum(1 for g in st.groups.values() if g.state == OPEN)

    def scan_versions() -> Counter[int]:  # what unconsumed_by_version() did before
        return Counter(g.version for g in st.unconsumed())

    def scan_older() -> bool:  # what a prompt request under global updates did before
        return any(g.state == OPEN and g.version < 0 for g in st.groups.values())

    assert st.open_groups() == scan_open() and st.unconsumed_by_version() == scan_versions()
    assert st.open_before(0) == scan_older()
    row = {
        "groups": groups,
        "open_scan_us": timed(scan_open, repeats) * 1e6,
        "open_kept_us": timed(st.open_groups, repeats) * 1e6,
        "by_version_scan_us": timed(scan_versions, repeats) * 1e6,
        "by_version_kept_us": timed(st.unconsumed_by_version, repeats) * 1e6,
        "older_open_scan_us": timed(scan_older, repeats) * 1e6,
        "older_open_kept_us": timed(lambda: st.open_before(0), repeats) * 1e6,
    }
    row["open_ratio"] = row["open_scan_us"] / row["open_kept_us"]
    row["by_version_ratio"] = row["by_version_scan_us"] / row["by_version_kept_us"]
    row["older_open_ratio"] = row["older_open_scan_us"] / row["older_open_kept_us"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[1000, 8000, 32000])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("bench/results/group_counts.json"))
    args = ap.parse_args(argv)
    rows = [run(n, args.repeats) for n in args.groups]
    res = {
        "bench": "group_counts",
        **git_state(),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "config": {"groups": args.groups, "repeats": args.repeats, "group_size": GROUP_SIZE},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"{'groups':>7} | {'open: scan us':>13} {'kept us':>8} {'ratio':>8} | ", end="")
    print(f"{'by version: scan us':>19} {'kept us':>8} {'ratio':>8} | ", end="")
    print(f"{'open older: scan us':>19} {'kept us':>8} {'ratio':>8}")
    for r in rows:
        print(
            f"{r['groups']:>7} | {r['open_scan_us']:>13.1f} {r['open_kept_us']:>8.2f} "
            f"{r['open_ratio']:>8.0f} | {r['by_version_scan_us']:>19.1f} "
            f"{r['by_version_kept_us']:>8.2f} {r['by_version_ratio']:>8.0f} | "
            f"{r['older_open_scan_us']:>19.1f} {r['older_open_kept_us']:>8.2f} "
            f"{r['older_open_ratio']:>8.0f}"
        )
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
