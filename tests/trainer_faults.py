"""Fault injection for the trainer recovery tests: the tests know the crash points, the node does
not.

    monkeypatch.setattr(CommitLedger, "record", crash_before_commit(2))     # in-process: raises
    python tests/trainer_faults.py 2 node --role trainer --config FILE      # a process: exit 17

"Before commit": step N is trained and logged in consumed.jsonl, and its commit is about to
be owed to the buffer (CommitLedger.record) but never is: the process dies there, before
the weights are published and before the buffer hears of the step. In-process the node
dies of the exception (a supervised task failing: no drain, no checkpoint, like a crash);
as a process it exits at once with code 17 (no teardown at all).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from laminar.trainer.commits import CommitLedger

CRASH_EXIT_CODE = 17


def crash_before_commit(at_step: int, exit_code: int | None = None) -> Callable[..., None]:
    """A CommitLedger.record that dies at `at_step` (exit_code: the process exits; else raises)."""
    record = CommitLedger.record

    def faulty(self: CommitLedger, batch_id: str, step: int, version: int) -> None:
        if step == at_step:
            self.log.warning("fault_injected", point="crash_before_commit", step=step)
            if exit_code is not None:
                os._exit(exit_code)
            raise RuntimeError(f"fault injected before the commit of step {step}")
        record(self, batch_id, step, version)

    return faulty


if __name__ == "__main__":
    from laminar.cli import main

    CommitLedger.record = crash_before_commit(int(sys.argv[1]), CRASH_EXIT_CODE)  # type: ignore[method-assign]
    raise SystemExit(main(sys.argv[2:]))
