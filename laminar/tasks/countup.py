"""Count-up: the synthetic reasoning task of the default CPU demo.

A prompt asks: start at A, add B again and again, and stop at the first value
above T. The reference solution writes every addition and its comparison with
T out, then the answer after '#':

    prompt    "37+8>60?"
    solution  "37+8=45<60;45+8=53<60;53+8=61>60;#61"

Why this shape (the demo trains a ~1M-parameter character-level transformer on
2 CPU cores for a few minutes):
  * every number is two zero-padded digits and every step is exactly 11 chars
    ("AA+B=CC?TT;" with ? one of < = >), so everything a step needs sits at a
    *fixed* offset: the previous result 6 chars back, B and T 11 chars back
    (the first step reads them from the fixed-width prompt). Adding is
    two-digit plus one-digit with a carry; comparing is two digits against
    two digits right beside them; stopping is "the last comparison was >".
    A tiny model learns all three locally. An earlier form without the
    written comparison ("AA+B=CC;") learned the sums but not when to stop:
    comparing with T far back in the prompt was too hard for it.
  * the step count s = ceil((T - A + 1) / B) is drawn per prompt from a
    truncated power law (half the prompts take 1 step, 2% take 17-20), so
    solution lengths (11*s + 3 chars) are long-tailed: p50 25, p99 ~200,
    p99/p50 about 8 (see `length_stats`).
  * `demonstration` writes deliberately imperfect solutions at a chosen rate,
    either random mistakes (for sampled evaluation) or one systematic habit
    (for greedy evaluation), so a supervised warm-up gives a model that is
    right only part of the time and RL has something to fix.

Alphabet: "0123456789+<=>;#?" (17 characters). Dataflow:

    generate(seed) -> rows {uid, prompt, answer, steps, solution}
        -> train.jsonl / eval.jsonl -> buffer -> rollouts
    completion -> reward(prompt, completion, **row) -> {"reward", "format"}

Eval prompts come from a fixed 10% slice of the prompt space (chosen by a hash
of the prompt), so they never appear in any training split, whatever the seed.

    python -m laminar.tasks.countup --out data/countup --train 20000 --eval 500 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

ALPHABET = "0123456789+<=>;#?"
MAX_VALUE = 99
"""Every number is written with two digits, so no value may pass 99."""
EVAL_SLICE = 10
"""Percent of the prompt space reserved for eval prompts (by prompt hash)."""
ERROR_KINDS = ("slip", "stop", "copy")
HABIT_STRIDE = 5
"""Demos in the "habit" style go wrong only on prompts with at least this stride."""

_PROMPT = re.compile(r"^(\d\d)\+(\d)>(\d\d)\?$")
_CHAIN = re.compile(r"^(?:\d\d\+\d=\d\d[<=>]\d\d;)*#\d+$")
_ANSWER = re.compile(r"\s*(\d+)")


def make_prompt(start: int, stride: int, limit: int) -> str:
    return f"{start:02d}+{stride}>{limit:02d}?"


def parse_prompt(prompt: str) -> tuple[int, int, int]:
    """(start, stride, limit) of a prompt; ValueError when it is not a count-up prompt."""
    m = _PROMPT.match(prompt.strip())
    if m is None:
        raise ValueError(f"not a count-up prompt (want 'AA+B>TT?'): {prompt!r}")
    start, stride, limit = (int(g) for g in m.groups())
    if stride == 0 or start > limit or _count(start, stride, limit)[-1] > MAX_VALUE:
        raise ValueError(f"count-up prompt out of range: {prompt!r}")
    return start, stride, limit


def _count(value: int, stride: int, limit: int) -> list[int]:
    """The values after each addition, ending at the first one above `limit`."""
    out = []
    while True:
        value += stride
        out.append(value)
        if value > limit:
            return out


def _write(start: int, stride: int, limit: int, values: list[int], final: int) -> str:
    steps, prev = [], start
    for v in values:
        cmp = "<" if v < limit else "=" if v == limit else ">"
        steps.append(f"{prev:02d}+{stride}={v:02d}{cmp}{limit:02d};")
        prev = v
    return "".join(steps) + f"#{final:02d}"


def solve(prompt: str) -> str:
    """The reference solution: every step, then '#' and the answer."""
    start, stride, limit = parse_prompt(prompt)
    values = _count(start, stride, limit)
    return _write(start, stride, limit, values, values[-1])


def answer_of(prompt: str) -> str:
    return solve(prompt).rsplit("#", 1)[1]


def demonstration(prompt: str, rng: random.Random, error_rate: float, style: str = "random") -> str:
    """A solution that is deliberately wrong some of the time; the format is always exact.

    style "random": wrong (final answer differs) with probability `error_rate`, by one
      mistake of a random kind: one sum off by 1-3 with the chain carried on from the
      wrong value ("slip"), stopping one step early or going one step too far ("stop"),
      or miscopying the last value after '#' ("copy"). A model sampled at temperature 1
      repeats such mistakes; a greedy decoder mostly does not (each wrong token is rare).
    style "habit": one systematic misconception, for demos judged by greedy decoding:
      on prompts with stride >= HABIT_STRIDE, with probability `error_rate`, the student
      takes one step too many (past the limit once, then once more) and answers that
      value; where the extra step would pass 99 the demo is right. With `error_rate`
      above 0.5 the warm-up model's greedy choice at that one decision (the token after
      the first ">TT;") is the habit, so greedy accuracy is roughly the share of
      small-stride prompts, and RL has one clear decision to flip. Prompts with a small
      stride are always solved correctly.
    """
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
    if style not in ("random", "habit"):
        raise ValueError(f"style must be 'random' or 'habit', got {style!r}")
    start, stride, limit = parse_prompt(prompt)
    values = _count(start, stride, limit)
    if style == "habit":
        if stride >= HABIT_STRIDE and values[-1] + stride <= MAX_VALUE:
            if rng.random() < error_rate:
                values = [*values, values[-1] + stride]
        return _write(start, stride, limit, values, values[-1])
    if rng.random() >= error_rate:
        return _write(start, stride, limit, values, values[-1])
    kinds = list(ERROR_KINDS)
    rng.shuffle(kinds)
    for kind in kinds:  # the first kind that fits this prompt
        wrong = _mistake(kind, start, stride, limit, values, rng)
        if wrong is not None:
            return wrong
    raise AssertionError(f"no mistake fits {prompt!r}")  # "copy" always fits


def _mistake(
    kind: str, start: int, stride: int, limit: int, values: list[int], rng: random.Random
) -> str | None:
    true = values[-1]
    if kind == "copy":
        wrong = rng.choice(
            [v for v in range(max(0, true - 9), min(MAX_VALUE, true + 9) + 1) if v != true]
        )
        return _write(start, stride, limit, values, wrong)
    if kind == "stop":
        if rng.random() < 0.5 and true + stride <= MAX_VALUE:
            late = [*values, true + stride]
            return _write(start, stride, limit, late, late[-1])
        early = values[:-1]
        return _write(start, stride, limit, early, early[-1] if early else start)
    # slip: step j writes prev + stride + delta; later steps add correctly until past the limit
    candidates = [(j, d) for j in range(len(values)) for d in (-3, -2, -1, 1, 2, 3)]
    rng.shuffle(candidates)
    for j, delta in candidates:  # the first that stays two-digit and changes the answer
        slipped = values[j] + delta
        if not 0 <= slipped <= MAX_VALUE:
            continue
        chain = [*values[:j], slipped, *([] if slipped > limit else _count(slipped, stride, limit))]
        if chain[-1] != true and chain[-1] <= MAX_VALUE:
            return _write(start, stride, limit, chain, chain[-1])
    return None


# ---- verifier and reward ------------------------------------------------------------


def extract_answer(completion: str) -> str | None:
    """The digits after the first '#' (the answer is committed there), or None."""
    at = completion.find("#")
    m = _ANSWER.match(completion, at + 1) if at >= 0 else None
    return m.group(1) if m else None


def verify(completion: str, answer: str | int) -> float:
    """1.0 when the answer after '#' equals `answer` (as integers), else 0.0."""
    got = extract_answer(completion)
    try:
        return float(got is not None and int(got) == int(str(answer).strip()))
    except ValueError:  # a reference that is not an integer can never be matched
        return 0.0


def well_formed(completion: str) -> bool:
    """True when the completion is steps 'AA+B=CC?TT;' then '#N' and nothing else."""
    return _CHAIN.match(completion.strip()) is not None


def reward(prompt: str, completion: str, **row: Any) -> dict[str, float] | None:
    """{"reward": correct final answer, "format": well-formed chain}; None without a reference."""
    ref = row.get("answer")
    ref = row.get("ground_truth") if ref is None else ref
    if ref is None or str(ref).strip() == "":
        return None
    return {"reward": verify(completion, ref), "format": float(well_formed(completion))}


# ---- dataset generation -------------------------------------------------------------


def is_eval_prompt(prompt: str) -> bool:
    """The fixed eval slice of the prompt space (independent of any seed)."""
    return zlib.crc32(prompt.encode()) % 100 < EVAL_SLICE


def step_weights(max_steps: int = 20, alpha: float = 1.6) -> list[float]:
    """P(s) proportional to s**-alpha for s = 1..max_steps (a truncated power law)."""
    if not 1 <= max_steps <= MAX_VALUE // 2:
        raise ValueError(f"max_steps must be in [1, {MAX_VALUE // 2}], got {max_steps}")
    return [s**-alpha for s in range(1, max_steps + 1)]


def sample_prompt(rng: random.Random, weights: list[float]) -> tuple[str, int]:
    """(prompt, steps): steps from `weights`, then a stride, start and limit that give it."""
    steps = rng.choices(range(1, len(weights) + 1), weights)[0]
    stride = rng.randint(1, min(9, MAX_VALUE // steps))
    start = rng.randint(0, MAX_VALUE - steps * stride)
    limit = rng.randint(start + (steps - 1) * stride, start + steps * stride - 1)
    return make_prompt(start, stride, limit), steps


def generate(
    n: int, split: str = "train", seed: int = 0, *, max_steps: int = 20, alpha: float = 1.6
) -> list[dict[str, Any]]:
    """n rows of one split, deterministic in (split, seed, max_steps, alpha).

    Train rows are i.i.d. (a prompt may repeat: the short-chain corner of the space
    holds only a few thousand prompts); eval rows are distinct prompts.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"countup/{split}/{seed}")
    weights = step_weights(max_steps, alpha)
    rows: list[dict[str, Any]] = []
    for prompt, steps in draw_prompts(
        n, split, lambda: sample_prompt(rng, weights), is_eval_prompt
    ):
        solution = solve(prompt)
        rows.append(
            {
                "uid": f"countup-{split}-{seed}-{len(rows):06d}",
                "prompt": prompt,
                "answer": solution.rsplit("#", 1)[1],
                "steps": steps,
                "solution": solution,
            }
        )
    return rows


def draw_prompts(
    n: int, split: str, sample: Callable[[], tuple[str, Any]], is_eval: Callable[[str], bool]
) -> list[tuple[str, Any]]:
    """n draws of (prompt, info) whose prompts fall on `split`'s side of the eval slice; eval
    prompts are distinct. Raises when the space cannot give that many."""
    want_eval = split == "eval"
    out: list[tuple[str, Any]] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 1000 * (n + 10):
            raise ValueError(f"could not draw {n} distinct {split} prompts; ask for fewer")
        prompt, info = sample()
        if is_eval(prompt) != want_eval or (want_eval and prompt in seen):
            continue
        seen.add(prompt)
        out.append((prompt, info))
    return out


def demonstrations(
    rows: list[dict[str, Any]], error_rate: float, seed: int = 0, style: str = "random"
) -> list[str]:
    """One imperfect demonstration per row (for the supervised warm-up)."""
    rng = random.Random(f"countup/demo/{seed}")
    return [demonstration(r["prompt"], rng, error_rate, style) for r in rows]


def length_stats(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Reference-solution lengths in characters (= tokens for a char tokenizer)."""
    lengths = sorted(len(r["solution"]) for r in rows)
    if not lengths:
        raise ValueError("no rows")

    def pct(q: float) -> float:
        return float(lengths[min(len(lengths) - 1, int(q * len(lengths)))])

    p50, p99 = pct(0.50), pct(0.99)
    return {
        "n": len(lengths),
        "mean": sum(lengths) / len(lengths),
        "p50": p50,
        "p90": pct(0.90),
        "p99": p99,
        "max": float(lengths[-1]),
        "p99_over_p50": p99 / p50,
    }


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def write_splits(
    out: str | Path, train: int, eval: int, seed: int = 0, **kw: Any
) -> dict[str, Any]:
    """Write out/train.jsonl and out/eval.jsonl; returns paths and length statistics."""
    out = Path(out)
    train_rows, eval_rows = generate(train, "train", seed, **kw), generate(eval, "eval", seed, **kw)
    return {
        "train": str(write_jsonl(train_rows, out / "train.jsonl")),
        "eval": str(write_jsonl(eval_rows, out / "eval.jsonl")),
        "train_lengths": length_stats(train_rows) if train_rows else None,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m laminar.tasks.countup", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--out", required=True, help="directory for train.jsonl and eval.jsonl")
    ap.add_argument("--train", type=int, default=20_000, help="training rows")
    ap.add_argument("--eval", type=int, default=500, help="held-out rows (distinct prompts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=20, help="longest chain")
    ap.add_argument("--alpha", type=float, default=1.6, help="power-law exponent of the step count")
    args = ap.parse_args(argv)
    info = write_splits(
        args.out, args.train, args.eval, args.seed, max_steps=args.max_steps, alpha=args.alpha
    )
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
