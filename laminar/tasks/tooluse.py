"""Tool use: the CPU task where a tiny policy does measurably better when it calls a calculator.

Two kinds of prompt, mixed:

    easy   "47+6=?"     a two-digit plus a one-digit number: the model adds it itself
           solution     "#53"
    hard   "47*86=?"    a two-digit times a two-digit number: too large for the model's
                        arithmetic; the calculator gets it right
           solution     '<tool_call>{"name":"calculator","arguments":{"expression":"47*86"}}'
                        '</tool_call>'
                        "\\n<tool_response>4042</tool_response>\\n"  (the env's turn, loss mask 0)
                        "#4042"

The model's turn ends at "</tool_call>" (ToolEnv's stop string) or EOS. The tool call
runs, its answer comes back in the tool role (for a tokenizer without a chat template:
"\\n<tool_response>" + output + "</tool_response>\\n", laminar/envs/template.py), and the
model writes "#" and the answer. The completion the reward sees is the decoded response,
environment tokens included; its answer is the "#N" after the last tool response, which
must be all that follows it, so a number inside a tool response is never taken for the
answer and a run-on after the answer scores 0.

Why this shape (a ~0.6M character-level transformer, 2 CPU cores, a few minutes of RL):
  * easy and hard differ in the operator, one character the model sees at once; the
    choice between answering and calling the tool is the first response token
    ('#' or '<'), so RL has one clear, local decision to flip;
  * a tool call copies the prompt's expression and the answer is copied back from the
    tool response: both are copies at short range, which a tiny model learns early in
    the warm-up; two-digit multiplication it never learns;
  * the warm-up demos (`demonstration`) answer easy prompts directly, and hard prompts
    through the tool only `tool_rate` of the time (0.3 by default); otherwise with the
    "estimate habit": both operands rounded to tens, then multiplied (47*86 -> 50*90 ->
    #4500), plausible and almost always wrong (operands of hard prompts are never
    multiples of ten). Greedy decoding of the warm-up model follows the habit on hard
    prompts; sampled at temperature 1 it calls the tool about `tool_rate` of the time,
    so most GRPO groups on hard prompts hold both outcomes.
  * the warm-up uses sft_warmup(token_norm="dataset"): with length buckets and a per-batch
    token mean, the first token of a long tool transcript weighs ~16x less than that of a
    short direct answer, and 30% tool demos gave a 4% tool rate instead of ~27%.

Measured (one run each, 2 shared cores; configs/tool_demo.yaml, 2000 warm-up steps, 40 RL
steps at lr 1e-4): greedy held-out accuracy 0.22 -> 0.88 on 300 prompts, tool-call rate
on hard prompts 0.00 -> 1.00 (the flip happens between steps 15 and 25), sums 0.93 -> 0.94.
At lr 2e-4 the flip came by step 15 but accuracy on the sums fell to 0.70: negative
advantages on wrong direct answers to products push direct answering down in general.

Rows: {uid, prompt, answer, kind: "easy" | "hard", solution}. Eval prompts come from a
fixed 10% slice of the prompt space (by a hash of the prompt), disjoint from every
training split whatever the seed.

    python -m laminar.tasks.tooluse --out data/tooluse --train 20000 --eval 400 --seed 0
    reward.fn: laminar.tasks.tooluse:reward
"""

from __future__ import annotations

import argparse
import json
import random
import re
import zlib
from pathlib import Path
from typing import Any

from laminar.tasks.countup import draw_prompts

TOOL = "calculator"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
ALPHABET = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    " \n+-*/=?#<>_{}[]():,.\"'!%&|^~;@$`\\"
)
"""Every character of prompts, tool calls and tool responses, error messages included (printable
ASCII)."""
EVAL_SLICE = 10
"""Percent of the prompt space reserved for eval prompts (by prompt hash)."""
KINDS = ("easy", "hard")

_EASY = re.compile(r"^(\d\d)\+(\d)=\?$")
_HARD = re.compile(r"^(\d\d)\*(\d\d)=\?$")
_FINAL = re.compile(r"^#(\d+)$")


# ---- prompts and solutions ----------------------------------------------------------


def parse_prompt(prompt: str) -> tuple[str, int, int]:
    """(kind, a, b); ValueError when the prompt is not one of this task's."""
    p = prompt.strip()
    if m := _EASY.match(p):
        a, b = int(m.group(1)), int(m.group(2))
        if a >= 10 and b >= 1:
            return "easy", a, b
    elif m := _HARD.match(p):
        a, b = int(m.group(1)), int(m.group(2))
        if a >= 11 and b >= 11 and a % 10 and b % 10:
            return "hard", a, b
    raise ValueError(
        f"not a tool-use prompt (want 'AB+C=?' or 'AB*CD=?', no multiples of 10): {prompt!r}"
    )


def expression(prompt: str) -> str:
    """The arithmetic the prompt asks for ("47*86")."""
    parse_prompt(prompt)
    return prompt.strip()[:-2]


def answer_of(prompt: str) -> int:
    kind, a, b = parse_prompt(prompt)
    return a + b if kind == "easy" else a * b


def estimate(prompt: str) -> int:
    """The warm-up's habit on hard prompts: round both operands to tens, then multiply."""
    kind, a, b = parse_prompt(prompt)
    if kind == "easy":
        return a + b
    return ((a + 5) // 10 * 10) * ((b + 5) // 10 * 10)


def tool_call_text(expr: str) -> str:
    """The model's tool call, ending with the stop string: <tool_call>{json}</tool_call>."""
    call = {"name": TOOL, "arguments": {"expression": expr}}
    return CALL_OPEN + json.dumps(call, separators=(",", ":")) + CALL_CLOSE


def tool_response_text(output: str) -> str:
    """The environment's turn as a tokenizer without a chat template renders it
    (envs/template.py)."""
    return f"\n{RESPONSE_OPEN}{output}{RESPONSE_CLOSE}\n"


Segments = list[tuple[str, bool]]
"""A transcript: (text, is_model) pieces in order; is_model False = environment text (loss mask
0)."""


def transcript(prompt: str, style: str) -> Segments:
    """The completion of one demo style: "tool" (call, response, answer), "direct" (the right
    answer), or "habit" (the estimate, on hard prompts)."""
    if style == "tool":
        value = str(answer_of(prompt))
        return [
            (tool_call_text(expression(prompt)), True),
            (tool_response_text(value), False),
            (f"#{value}", True),
        ]
    if style == "direct":
        return [(f"#{answer_of(prompt)}", True)]
    if style == "habit":
        return [(f"#{estimate(prompt)}", True)]
    raise ValueError(f"style must be 'tool', 'direct' or 'habit', got {style!r}")


def solve(prompt: str) -> str:
    """The reference completion: direct on easy prompts, through the calculator on hard ones."""
    kind, _, _ = parse_prompt(prompt)
    return "".join(t for t, _ in transcript(prompt, "direct" if kind == "easy" else "tool"))


def demonstration(prompt: str, rng: random.Random, tool_rate: float) -> Segments:
    """Easy prompts answered directly; hard ones through the tool with probability `tool_rate`,
    else with the estimate habit (wrong)."""
    if not 0.0 <= tool_rate <= 1.0:
        raise ValueError(f"tool_rate must be in [0, 1], got {tool_rate}")
    kind, _, _ = parse_prompt(prompt)
    if kind == "easy":
        return transcript(prompt, "direct")
    return transcript(prompt, "tool" if rng.random() < tool_rate else "habit")


def demonstrations(rows: list[dict[str, Any]], tool_rate: float, seed: int = 0) -> list[Segments]:
    """One demo transcript per row, deterministic in (rows, tool_rate, seed)."""
    rng = random.Random(f"tooluse/demo/{seed}")
    return [demonstration(r["prompt"], rng, tool_rate) for r in rows]


# ---- verifier and reward ------------------------------------------------------------


def final_answer(completion: str) -> str | None:
    """The digits of the "#N" that ends the completion after its last tool response, or None
    when what follows the last tool response (or the whole completion) is not exactly "#N"."""
    tail = completion.rsplit(RESPONSE_CLOSE, 1)[-1].strip()
    m = _FINAL.match(tail)
    return m.group(1) if m else None


def tool_calls(completion: str) -> int:
    """How many tool calls the completion made."""
    return completion.count(CALL_OPEN)


def verify(completion: str, answer: str | int) -> float:
    """1.0 when the final "#N" equals `answer` (as integers), else 0.0 (malformed: 0.0)."""
    got = final_answer(completion)
    try:
        return float(got is not None and int(got) == int(str(answer).strip()))
    except ValueError:
        return 0.0


def reward(prompt: str, completion: str, **row: Any) -> dict[str, float] | None:
    """{"reward": right final answer, "tool_calls": calls made, "format": ends in "#N"};
    None without a reference answer."""
    ref = row.get("answer")
    ref = row.get("ground_truth") if ref is None else ref
    if ref is None or str(ref).strip() == "":
        return None
    return {
        "reward": verify(completion, ref),
        "tool_calls": float(tool_calls(completion)),
        "format": float(final_answer(completion) is not None),
    }


# ---- dataset generation -------------------------------------------------------------


def is_eval_prompt(prompt: str) -> bool:
    """The fixed eval slice of the prompt space (independent of any seed)."""
    return zlib.crc32(prompt.encode()) % 100 < EVAL_SLICE


def sample_prompt(rng: random.Random, hard_share: float) -> tuple[str, str]:
    """(prompt, kind)."""
    if rng.random() < hard_share:
        a, b = (rng.choice([v for v in range(11, 100) if v % 10]) for _ in range(2))
        return f"{a}*{b}=?", "hard"
    return f"{rng.randint(10, 99)}+{rng.randint(1, 9)}=?", "easy"


def generate(
    n: int, split: str = "train", seed: int = 0, *, hard_share: float = 0.5
) -> list[dict[str, Any]]:
    """n rows of one split, deterministic in (split, seed, hard_share).

    Train rows are i.i.d. (prompts may repeat: there are 810 easy ones); eval rows are
    distinct prompts (81 easy ones exist in the eval slice, so ask for at most ~150 when
    half are easy).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 0.0 <= hard_share <= 1.0:
        raise ValueError(f"hard_share must be in [0, 1], got {hard_share}")
    rng = random.Random(f"tooluse/{split}/{seed}")
    rows: list[dict[str, Any]] = []
    for prompt, kind in draw_prompts(
        n, split, lambda: sample_prompt(rng, hard_share), is_eval_prompt
    ):
        rows.append(
            {
                "uid": f"tooluse-{split}-{seed}-{len(rows):06d}",
                "prompt": prompt,
                "answer": str(answer_of(prompt)),
                "kind": kind,
                "solution": solve(prompt),
            }
        )
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def write_splits(
    out: str | Path, train: int, eval: int, seed: int = 0, hard_share: float = 0.5
) -> dict[str, Any]:
    """Write out/train.jsonl and out/eval.jsonl; returns the paths and the hard share of each."""
    out = Path(out)
    tr, ev = (
        generate(train, "train", seed, hard_share=hard_share),
        generate(eval, "eval", seed, hard_share=hard_share),
    )
    return {
        "train": str(write_jsonl(tr, out / "train.jsonl")),
        "eval": str(write_jsonl(ev, out / "eval.jsonl")),
        "train_hard": sum(r["kind"] == "hard" for r in tr),
        "eval_hard": sum(r["kind"] == "hard" for r in ev),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m laminar.tasks.tooluse", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--out", required=True, help="directory for train.jsonl and eval.jsonl")
    ap.add_argument("--train", type=int, default=20_000, help="training rows")
    ap.add_argument("--eval", type=int, default=400, help="held-out rows (distinct prompts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hard-share", type=float, default=0.5, help="share of multiplication prompts")
    args = ap.parse_args(argv)
    print(
        json.dumps(
            write_splits(args.out, args.train, args.eval, args.seed, args.hard_share), indent=2
        )
    )


if __name__ == "__main__":
    main()
