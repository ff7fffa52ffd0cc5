"""Build everything the example job needs, locally: a tiny HF model and a dataset in two shapes.

    python examples/prepare.py [--out runs/example-data] [--rows 2000]

writes, under --out (paths relative to where you run it, like the config's):

    model/          a tiny random Llama-style HF model + character-level tokenizer.json
                    (laminar/models/tiny.py); any local HF directory works the same way
    train.jsonl     TRL-style rows: {"prompt": str, "answer": str, "partial_credit": bool}
    eval.jsonl      held-out rows, same shape
    train.parquet   the same training prompts as verl-style rows: "prompt" as chat
                    messages, "reward_model": {"ground_truth": ...}, "data_source", "extra_info"

The task is reversing a short word ("reverse abc:" -> "cba"); examples/my_reward.py scores it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from laminar.models.tiny import build_tiny_model

LETTERS = "abcdefgh"
# The tokenizer has one token per character: every character a prompt or answer can use.
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 :\n"


def make_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """TRL-style rows: `prompt`, `answer` and an extra column that reaches the reward as a kwarg."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 4)))
        rows.append(
            {"prompt": f"reverse {word}:", "answer": word[::-1], "partial_credit": i % 2 == 0}
        )
    return rows


def to_verl(rows: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """The same prompts in verl's shape (what verl's data preprocessing scripts write)."""
    return [
        {
            "data_source": "example/reverse",
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "ability": "reverse",
            "reward_model": {"style": "rule", "ground_truth": r["answer"]},
            "extra_info": {"split": split, "index": i},
        }
        for i, r in enumerate(rows)
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="runs/example-data")
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_model(out / "model", alphabet=ALPHABET, seed=args.seed, hidden=64, layers=2)
    train = make_rows(args.rows, args.seed)
    held_out = make_rows(max(args.rows // 10, 16), args.seed + 1)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "eval.jsonl", held_out)
    write_parquet(out / "train.parquet", to_verl(train, "train"))
    print(
        f"wrote {out}/model, train.jsonl ({len(train)} rows), eval.jsonl ({len(held_out)}), "
        "train.parquet"
    )


if __name__ == "__main__":
    main()
