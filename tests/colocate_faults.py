"""Fault points for the colocated kill -9 tests (tests/test_colocate_faults.py): the tests know
where the cycle must be when they kill a node, the nodes do not.

    python tests/colocate_faults.py hold DIR STEP node --role trainer --config FILE
    python tests/colocate_faults.py no-eos [hold-gen DIR] node --role rollout --config FILE

hold: at its STEP-th training step the trainer holds the device (its state back on the device,
the colocated rollout asleep) until DIR/release exists: it writes DIR/holding when it gets
there, then waits (a deadline of HOLD_DEADLINE_S) before it steps. A test that kills a node
"while the trainer holds the device" waits for DIR/holding, so the state is reached
deterministically, not by luck of timing.

no-eos: the torch engine ignores the model's end-of-sequence token, so every trajectory runs to
rollout.sampling.max_tokens: an untrained tiny model would otherwise stop after ~1/vocab of its
tokens.

hold-gen: the rollout's engine stops mid-generation, a few decode steps into its first batch after
the first update (version >= 1), writes DIR/generating and waits for DIR/release-gen: a kill
"while generating" then finds trajectories in flight every time, not as often as the heartbeat's
lag allows.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HOLD_DEADLINE_S = 300.0


def hold_at_step(folder: Path, at_step: int) -> None:
    """Patch TorchTrainer.step: the `at_step`-th call waits for folder/release."""
    from laminar.trainer.torch_trainer import TorchTrainer

    step = TorchTrainer.step
    calls = 0

    def holding(self: TorchTrainer, batch: Any) -> dict[str, float]:
        nonlocal calls
        calls += 1
        if calls == at_step:
            (folder / "holding").write_text(str(calls))
            deadline = time.monotonic() + HOLD_DEADLINE_S
            while not (folder / "release").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("the test never released the device")
                time.sleep(0.05)  # a file the test writes: no event crosses the process boundary
        return step(self, batch)

    TorchTrainer.step = holding  # type: ignore[method-assign]


def hold_generating(folder: Path, after_steps: int = 24) -> None:
    """Patch TorchEngine._compute (its worker thread): the `after_steps`-th decode step at
    version >= 1 waits for folder/release-gen (the node's event loop keeps beating)."""
    from laminar.engines.torch_engine import TorchEngine

    compute = TorchEngine._compute
    steps = 0

    def holding(self: TorchEngine, batch: Any) -> Any:
        nonlocal steps
        if self.version >= 1:
            steps += 1
            if steps == after_steps:
                (folder / "generating").write_text(str(len(self._running)))
                deadline = time.monotonic() + HOLD_DEADLINE_S
                while not (folder / "release-gen").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)  # a file the test writes (or a kill -9)
        return compute(self, batch)

    TorchEngine._compute = holding  # type: ignore[method-assign]


def ignore_eos() -> None:
    import laminar.engines.torch_engine as te

    te._eos_ids = lambda model, tokenizer: set()  # type: ignore[attr-defined]


if __name__ == "__main__":
    from laminar.cli import main

    args = sys.argv[1:]
    while args[0] != "node":
        if args[0] == "hold":
            hold_at_step(Path(args[1]), int(args[2]))
            args = args[3:]
        elif args[0] == "hold-gen":
            hold_generating(Path(args[1]))
            args = args[2:]
        elif args[0] == "no-eos":
            ignore_eos()
            args = args[1:]
        else:
            raise SystemExit(f"unknown fault {args[0]!r}: hold | hold-gen | no-eos")
    raise SystemExit(main(args))
