"""`laminar journal check RUN_DIR`: verify every journal of a run directory offline.

    laminar journal check runs/demo        # exit 0: every journal clean; 1: problems (listed)

Buffer journals (`buffer-*.journal`, laminar.buffer.journal_format): header and schema, each
record's checksum and decoding (record types counted), undecodable records with their byte
offsets, a torn tail (bytes), damage in the middle. Tools journals (`tools/*.journal`,
JSON lines, laminar.tools.cache): lines that do not parse and a torn last line.
Nothing is changed and no lock is taken, so it is safe beside a running buffer (a
record being appended may then show as a torn tail).

`replay_buffer_journal` is the audit the fault tests and bench/chaos.py run after a stop: the
journal replayed into a buffer's state (summary: held, committed, dropped, abandoned, ...)
and every trajectory it holds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from laminar.buffer.experience import ExperienceState
from laminar.buffer.journal import Journal
from laminar.buffer.journal_format import JournalReport, check_journal
from laminar.buffer.records import TrajectoryAccepted
from laminar.protocol.data import Trajectory

__all__ = ["check_run_dir", "check_tools_journal", "journal_check_main", "replay_buffer_journal"]


def replay_buffer_journal(
    path: Path, state: ExperienceState
) -> tuple[ExperienceState, list[Trajectory]]:
    """Offline audit of a stopped run: the buffer journal at `path` replayed into a fresh
    `state` (laminar.wiring.buffer.experience_state of the run's config), and every trajectory
    it recorded (usable or not)."""
    trajs: list[Trajectory] = []
    journal = Journal(path, "never")
    try:
        for rec in journal.replay():
            state.apply(rec)
            if isinstance(rec, TrajectoryAccepted):
                trajs.append(rec.trajectory)
    finally:
        journal.close()
    return state, trajs


def check_tools_journal(path: Path) -> tuple[int, list[tuple[int, str]], int]:
    """(good lines, [(offset, why)] bad lines, torn tail bytes) of a tools JSON-lines journal."""
    good, bad, torn = 0, [], 0
    offset = 0
    with open(path, "rb") as f:
        for line in f:
            here, offset = offset, offset + len(line)
            if not line.endswith(b"\n"):
                torn = len(line)
                break
            try:
                rec = json.loads(line)
            except ValueError as exc:
                bad.append((here, f"not JSON: {exc}"))
                continue
            if not isinstance(rec, dict) or "t" not in rec or "id" not in rec:
                bad.append((here, "not a tools record (needs 't' and 'id')"))
                continue
            good += 1
    return good, bad, torn


def _print_buffer(rep: JournalReport, out: TextIO) -> None:
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(rep.kinds.items())) or "none"
    state = "ok" if rep.ok else "PROBLEMS"
    print(
        f"{rep.path}: {state}  schema {rep.schema}, {rep.size} bytes, {rep.records} records "
        f"({kinds})",
        file=out,
    )
    if rep.error:
        print(f"  error: {rep.error}", file=out)
    for off, kind, why in rep.bad:
        print(f"  bad record at byte offset {off} (kind {kind}): {why}", file=out)
    if rep.torn_bytes:
        print(
            f"  torn tail: {rep.torn_bytes} bytes from byte offset {rep.torn_offset} "
            "(replay would cut them and keep them as <file>.corrupt-<ms>)",
            file=out,
        )


def check_run_dir(run_dir: Path, out: TextIO | None = None) -> int:
    """Check every journal under run_dir and print what was found (to `out`, default the
    sys.stdout of the call, not of the import); returns the number with problems."""
    out = out if out is not None else sys.stdout
    problems = 0
    buffers = sorted(run_dir.glob("buffer-*.journal"))
    for path in buffers:
        rep = check_journal(path)
        _print_buffer(rep, out)
        problems += not rep.ok
    tools = sorted((run_dir / "tools").glob("*.journal"))
    for path in tools:
        good, bad, torn = check_tools_journal(path)
        print(f"{path}: {'ok' if not bad and not torn else 'PROBLEMS'}  {good} records", file=out)
        for off, why in bad:
            print(f"  bad line at byte offset {off}: {why}", file=out)
        if torn:
            print(f"  torn tail: {torn} bytes (a line without its newline)", file=out)
        problems += bool(bad or torn)
    if not buffers and not tools:
        print(f"{run_dir}: no journals found", file=out)
    return problems


def journal_check_main(run_dir: str) -> int:
    """Exit code: 0 every journal clean, 1 a problem in one, 2 no such directory."""
    path = Path(run_dir)
    if not path.is_dir():
        print(f"laminar journal check: {run_dir} is not a directory", file=sys.stderr)
        return 2
    return 1 if check_run_dir(path) else 0
