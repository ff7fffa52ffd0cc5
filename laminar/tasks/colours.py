"""Colours: the vision-language demo task, where the answer is only in the image.

Each prompt is the same text, "colour?", with one generated image: a filled shape (disc,
square or triangle) of one of four colours at a random place and size on a noisy light
background. The answer is the colour's name; a completion is right when it reads "#<name>"
before anything else ("#red"). Each split is balanced: every colour appears n // 4 or n // 4 + 1
times, in a shuffled order. A text-only model sees the same prompt every time, so it can do no
better than the most frequent colour (25% on a split whose size is a multiple of four); a VLM can
read the colour off the image tokens.

    generate(seed) -> rows {uid, prompt (TRL shape: an image part + "colour?"), images, answer}
        -> out/train.jsonl, out/eval.jsonl, out/images/*.png -> buffer -> rollouts
    completion -> reward(prompt, completion, **row) -> {"reward", "format"}

Images are PNG files next to the jsonl (paths relative to it), drawn with PIL from the seed:
the same seed writes byte-identical files.

    python -m laminar.tasks.colours --out data/colours --train 2000 --eval 200 --seed 0
"""

from __future__ import annotations

import argparse
import io
import json
import random
from pathlib import Path
from typing import Any

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
}
WARMUP_COLOURS = {
    "orange": (240, 130, 20),
    "purple": (130, 40, 170),
    "cyan": (20, 200, 210),
    "black": (25, 25, 25),
}
"""Colours that never appear in the task: a supervised warm-up on these teaches a random-weight
policy to read a colour off the image tokens (as a pretrained VLM can) without ever showing it
the answer to one of the task's colours (bench/vlm_colours.py)."""
SHAPES = ("disc", "square", "triangle")
QUESTION = "colour?"
ALPHABET = "abcdefghijklmnopqrstuvwxyz#?"


def draw(rng: random.Random, colour: str, size: int = 56) -> bytes:
    """A PNG of one shape of `colour` on a noisy light background."""
    from PIL import Image, ImageDraw

    bg = tuple(rng.randint(200, 255) for _ in range(3))
    im = Image.new("RGB", (size, size), bg)
    d = ImageDraw.Draw(im)
    r = rng.randint(size // 6, size // 3)
    cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
    rgb = COLOURS[colour] if colour in COLOURS else WARMUP_COLOURS[colour]
    jitter = tuple(max(0, min(255, c + rng.randint(-20, 20))) for c in rgb)
    shape = rng.choice(SHAPES)
    if shape == "disc":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=jitter)
    elif shape == "square":
        d.rectangle((cx - r, cy - r, cx + r, cy + r), fill=jitter)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=jitter)
    buf = io.BytesIO()
    im.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def solve(answer: str) -> str:
    return f"#{answer}"


def extract_answer(completion: str) -> str | None:
    text = completion.strip()
    if not text.startswith("#"):
        return None
    word = text[1:].split()[0] if text[1:].split() else ""
    return word.rstrip("#?") or None


def verify(completion: str, answer: str) -> float:
    return 1.0 if extract_answer(completion) == str(answer) else 0.0


def reward(prompt: str, completion: str, **row: Any) -> dict[str, float] | None:
    """1 for the right colour; `format` says whether a "#<word>" answer was given at all."""
    if "answer" not in row:
        return None
    got = extract_answer(completion)
    return {"reward": verify(completion, row["answer"]), "format": float(got is not None)}


def generate(n: int, seed: int, split: str, size: int = 56) -> list[tuple[dict[str, Any], bytes]]:
    """n (row, png bytes) pairs; the row's image path is filled in by `write_splits`."""
    rng = random.Random(f"colours/{seed}/{split}")
    # balanced, so no colour is a better blind guess than another (the text ceiling is 1/4)
    names = sorted(COLOURS)
    order = [names[k % len(names)] for k in range(n)]
    rng.shuffle(order)
    out = []
    for k, colour in enumerate(order):
        png = draw(rng, colour, size)
        row = {
            "uid": f"{split}-{seed}-{k}",
            "prompt": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
            ],
            "answer": colour,
        }
        out.append((row, png))
    return out


def write_splits(
    out: str | Path, train: int, eval_: int, seed: int = 0, size: int = 56
) -> dict[str, Path]:
    """out/train.jsonl, out/eval.jsonl, out/images/<split>-<k>.png."""
    root = Path(out)
    (root / "images").mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", train), ("eval", eval_)):
        f = root / f"{split}.jsonl"
        with open(f, "w") as fh:
            for row, png in generate(n, seed, split, size):
                name = f"images/{row['uid']}.png"
                (root / name).write_bytes(png)
                fh.write(json.dumps({**row, "images": [name]}) + "\n")
        paths[split] = f
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=int, default=56)
    a = ap.parse_args(argv)
    print(write_splits(a.out, a.train, a.eval, a.seed, a.size))


if __name__ == "__main__":
    main()
