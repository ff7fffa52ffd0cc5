"""Fault points and a route log for the MoE kill -9 test (tests/test_moe_faults.py): a rollout
process writes down every route its engine hands the node, and can stop mid-generation so the
test kills it there.

    python tests/moe_faults.py log FILE [hold DIR STEPS] node --role rollout --config FILE ...

log: every engine event's routes (uid, first position, the array), every import (uid, the
routes it came with) and, after each partial flush, how far each sequence's routes were streamed,
appended to FILE as pickles (a kill -9 may cut the last one short: readers stop there).

hold: the torch engine's STEPS-th decode step waits for DIR/release (which the test never
writes: it kills the process); DIR/holding says it got there. The node's event loop keeps
running meanwhile, so it streams what the engine recorded up to there to the partial pool.
Every trajectory also ignores the end-of-sequence token (runs to sampling.max_tokens).
"""

from __future__ import annotations

import pickle
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HOLD_DEADLINE_S = 300.0


def read_log(path: Path) -> Iterator[tuple[Any, ...]]:
    """The records of a log file, up to a record a kill cut short."""
    with open(path, "rb") as f:
        while True:
            try:
                yield pickle.load(f)
            except (EOFError, pickle.UnpicklingError):
                return


def log_routes(path: Path) -> None:
    """Patch the rollout's sequence table (engine events, imports) and partial stream."""
    from laminar.rollout.deliver import Deliverer
    from laminar.rollout.sequences import SequenceTable

    out = open(path, "ab")  # noqa: SIM115  (open for the life of the process)

    def write(*record: Any) -> None:
        pickle.dump(record, out)
        out.flush()

    on_event, resume = SequenceTable.on_event, SequenceTable.resume
    flush = Deliverer.flush_partials

    def logged_event(self: SequenceTable, ev: Any) -> Any:
        if ev.routes is not None:
            write("event", ev.seq_id, ev.route_start, ev.routes.copy())
        return on_event(self, ev)

    def logged_resume(self: SequenceTable, partials: Any, *args: Any, **kwargs: Any) -> Any:
        partials = list(partials)
        for p in partials:
            write("import", p.uid, None if p.routes is None else p.routes.copy())
        return resume(self, partials, *args, **kwargs)

    async def logged_flush(self: Deliverer) -> None:
        await flush(self)
        write("flushed", {u: s.routes_sent for u, s in self.table.seqs.items()})

    SequenceTable.on_event = logged_event  # type: ignore[method-assign]
    SequenceTable.resume = logged_resume  # type: ignore[method-assign]
    Deliverer.flush_partials = logged_flush  # type: ignore[method-assign]


def hold_decoding(folder: Path, at_step: int) -> None:
    """Patch TorchEngine._compute (its worker thread): the `at_step`-th call waits for
    folder/release; no end-of-sequence token ends a trajectory."""
    import laminar.engines.torch_engine as te

    compute = te.TorchEngine._compute
    steps = 0

    def holding(self: te.TorchEngine, batch: Any) -> Any:
        nonlocal steps
        steps += 1
        if steps == at_step:
            (folder / "holding").write_text(str(steps))
            deadline = time.monotonic() + HOLD_DEADLINE_S
            while not (folder / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # a file the test writes (or a kill -9)
        return compute(self, batch)

    te.TorchEngine._compute = holding  # type: ignore[method-assign]
    te._eos_ids = lambda model, tokenizer: set()  # type: ignore[attr-defined]


if __name__ == "__main__":
    from laminar.cli import main

    args = sys.argv[1:]
    while args[0] != "node":
        if args[0] == "log":
            log_routes(Path(args[1]))
            args = args[2:]
        elif args[0] == "hold":
            hold_decoding(Path(args[1]), int(args[2]))
            args = args[3:]
        else:
            raise SystemExit(f"unknown fault {args[0]!r}: log | hold")
    raise SystemExit(main(args))
