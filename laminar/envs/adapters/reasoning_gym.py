"""reasoning-gym as a dataset + reward source (optional: `pip install reasoning-gym`).

    python -m laminar.envs.adapters.reasoning_gym --dataset leg_counting --size 2000 \\
        --seed 0 --out data/rg_train.jsonl
    data.train: data/rg_train.jsonl
    reward.fn: laminar.envs.adapters.reasoning_gym:reward

`write_dataset` draws `size` entries from a generator (`reasoning_gym.create_dataset(name,
size=, seed=, **config)`) and writes one jsonl row each: prompt (the question plus an
instruction to answer in <answer></answer> tags), answer, question, metadata (the
generator's, JSON-safe), and rg_dataset / rg_config, which is all `reward` needs to
rebuild the same generator and score with its own verifier (`score_answer(answer, entry)`:
exact match or the task's checker, e.g. any valid solution of a puzzle). The answer is
the text in the completion's last <answer></answer> (reasoning_gym.utils.extract_answer);
a completion without one scores 0.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

INSTRUCTION = "\nGive your final answer between <answer> and </answer>."


class ReasoningGymMissing(ImportError):
    """reasoning-gym is not installed."""


def _rg() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ReasoningGymMissing(
            "the reasoning-gym adapter needs the reasoning-gym package: pip install reasoning-gym"
        ) from None
    return reasoning_gym


def _plain(value: Any) -> Any:
    """JSON-safe copy of a generator's metadata (tuples -> lists, odd objects -> str)."""
    return json.loads(json.dumps(value, default=str))


def write_dataset(
    name: str,
    out: str | Path,
    size: int,
    seed: int = 0,
    config: dict[str, Any] | None = None,
    instruction: str = INSTRUCTION,
) -> Path:
    """Write `size` rows of generator `name` to jsonl at `out`; returns the path."""
    rg = _rg()
    cfg = {"size": size, "seed": seed, **(config or {})}
    data = rg.create_dataset(name, **cfg)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(size):
            entry = data[i]
            row = {
                "uid": f"rg-{name}-{seed}-{i}",
                "prompt": entry["question"] + instruction,
                "answer": str(entry["answer"]),
                "question": entry["question"],
                "metadata": _plain(entry.get("metadata", {})),
                "rg_dataset": name,
                "rg_config": _plain(cfg),
            }
            f.write(json.dumps(row) + "\n")
    return path


@functools.lru_cache(maxsize=32)
def _generator(name: str, config_json: str) -> Any:
    return _rg().create_dataset(name, **json.loads(config_json))


def reward(
    prompt: str,
    completion: str,
    answer: str | None = None,
    rg_dataset: str | None = None,
    rg_config: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    question: str | None = None,
    **_: Any,
) -> float | None:
    """Score with the generator's own verifier; None (not applicable) for a row without one."""
    if rg_dataset is None or answer is None:
        return None
    gen = _generator(rg_dataset, json.dumps(rg_config or {}, sort_keys=True))  # ReasoningGymMissing
    from reasoning_gym.utils import extract_answer

    given = extract_answer(completion)
    if given is None:
        return 0.0
    entry = {"question": question or prompt, "answer": answer, "metadata": metadata or {}}
    return float(gen.score_answer(answer=given, entry=entry))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", required=True, help="a reasoning-gym generator, e.g. leg_counting")
    ap.add_argument("--size", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default="{}", help="generator settings as a JSON object")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    path = write_dataset(args.dataset, args.out, args.size, args.seed, json.loads(args.config))
    print(f"wrote {args.size} rows to {path}")


if __name__ == "__main__":
    main()
