"""The count-up demo task: generator, splits, length tail, verifier, imperfect demos.

.venv/bin/python -m pytest tests/test_tasks.py -q
"""

from __future__ import annotations

import json
import random
import re

import pytest

from laminar.tasks import countup as cu


def test_solve_writes_every_step_then_the_answer() -> None:
    assert cu.solve("37+8>60?") == "37+8=45<60;45+8=53<60;53+8=61>60;#61"
    assert cu.solve("05+3>05?") == "05+3=08>05;#08"
    assert cu.solve("52+8>60?") == "52+8=60=60;60+8=68>60;#68"  # equal is not above
    assert cu.answer_of("90+9>98?") == "99"


@pytest.mark.parametrize("bad", ["", "37+8>60", "37+0>60?", "60+8>37?", "95+9>97?", "3+5+2="])
def test_parse_prompt_rejects_malformed_and_out_of_range(bad: str) -> None:
    with pytest.raises(ValueError):
        cu.parse_prompt(bad)


def test_generate_is_deterministic_per_seed(tmp_path) -> None:
    assert cu.generate(300, "train", 7) == cu.generate(300, "train", 7)
    assert cu.generate(300, "train", 7) != cu.generate(300, "train", 8)
    a = cu.write_splits(tmp_path / "a", 200, 50, seed=3)
    b = cu.write_splits(tmp_path / "b", 200, 50, seed=3)
    for split in ("train", "eval"):
        assert open(a[split]).read() == open(b[split]).read()


def test_rows_are_consistent_and_use_the_small_alphabet() -> None:
    rows = cu.generate(2000, "train", 0)
    assert len({r["uid"] for r in rows}) == len(rows)
    step = re.compile(r"(\d\d)\+(\d)=(\d\d)([<=>])(\d\d);")
    for r in rows:
        assert set(r["prompt"] + r["solution"]) <= set(cu.ALPHABET)
        assert len(r["prompt"]) == 8
        start, stride, limit = cu.parse_prompt(r["prompt"])
        sums = step.findall(r["solution"])
        assert len(sums) == r["steps"]
        prev = start
        for a, b, c, cmp, t in sums:  # a correct addition from the previous value, compared
            assert (int(a), int(b), int(c), int(t)) == (prev, stride, prev + stride, limit)
            assert cmp == ("<" if int(c) < limit else "=" if int(c) == limit else ">")
            prev = int(c)
        assert int(r["answer"]) == prev > limit >= prev - stride  # first value past the limit
        assert cu.verify(r["solution"], r["answer"]) == 1.0 and cu.well_formed(r["solution"])


@pytest.mark.parametrize("seed", [0, 1])
def test_eval_prompts_are_disjoint_from_train_and_distinct(seed: int) -> None:
    train = cu.generate(3000, "train", seed)
    held = cu.generate(300, "eval", seed)
    eval_prompts = [r["prompt"] for r in held]
    assert len(set(eval_prompts)) == len(eval_prompts)
    assert not set(eval_prompts) & {r["prompt"] for r in train}
    # the slice is seed-independent: no seed's train split can hold an eval prompt
    assert all(cu.is_eval_prompt(p) for p in eval_prompts)
    assert not any(cu.is_eval_prompt(r["prompt"]) for r in cu.generate(1000, "train", seed + 10))


def test_solution_lengths_are_long_tailed() -> None:
    rows = cu.generate(4000, "train", 0)
    stats = cu.length_stats(rows)
    assert stats["p99_over_p50"] >= 5, stats
    assert stats["p50"] <= 30 and stats["max"] <= 250, stats
    assert sum(len(r["solution"]) <= 60 for r in rows) / len(rows) >= 0.75  # "mostly short"
    assert max(r["steps"] for r in rows) == 20  # the tail is actually reached


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("37+8=45<60;45+8=53<60;53+8=61>60;#61", 1.0),  # correct
        ("#61", 1.0),  # the verifier checks the answer, not the work
        ("37+8=45<60;45+8=53<60;#53", 0.0),  # stopped early: wrong final
        ("37+8=45<60;45+8=53<60;53+8=61>60;#62", 0.0),  # miscopied final
        ("37+8=45<60;45+8=53<60;53+8=61>60;61", 0.0),  # missing '#' marker
        ("", 0.0),
        ("#", 0.0),
        ("x#y 61", 0.0),  # garbage
        ("#53;#61", 0.0),  # the first '#' commits the answer
        ("#;#61", 0.0),  # ... even when nothing follows it
        ("37+8=45<60;#061", 1.0),  # zero padding does not matter
    ],
)
def test_verify(completion: str, expected: float) -> None:
    assert cu.verify(completion, "61") == expected


def test_reward_components_and_none_without_reference() -> None:
    prompt = "37+8>60?"
    assert cu.reward(prompt, cu.solve(prompt), answer="61") == {"reward": 1.0, "format": 1.0}
    assert cu.reward(prompt, "#61", ground_truth="61") == {"reward": 1.0, "format": 1.0}
    assert cu.reward(prompt, "37+8=45<60;#61", answer="61") == {"reward": 1.0, "format": 1.0}
    assert cu.reward(prompt, "37+8=45;#61", answer="61") == {"reward": 1.0, "format": 0.0}
    assert cu.reward(prompt, "#61 extra", answer="61") == {"reward": 1.0, "format": 0.0}
    assert cu.reward(prompt, "garbage", answer="61") == {"reward": 0.0, "format": 0.0}
    assert cu.reward(prompt, "#61") is None
    assert cu.reward(prompt, "#61", answer=None, steps=3) is None
    assert cu.reward(prompt, "#61", answer=None, ground_truth=61) == {"reward": 1.0, "format": 1.0}


def test_demonstrations_have_the_configured_error_rate() -> None:
    rows = cu.generate(4000, "train", 0)
    for rate in (0.0, 0.3, 0.7, 1.0):
        demos = cu.demonstrations(rows, rate, seed=1)
        assert all(cu.well_formed(d) for d in demos)  # mistakes are in content, never format
        wrong = sum(cu.verify(d, r["answer"]) == 0.0 for d, r in zip(demos, rows, strict=True))
        # 4000 draws: binomial sd <= 0.008, so 0.03 is ~4 sd
        assert abs(wrong / len(rows) - rate) <= 0.03, (rate, wrong)
    assert cu.demonstrations(rows[:50], 0.5, seed=2) == cu.demonstrations(rows[:50], 0.5, seed=2)


def test_habit_demos_overshoot_on_large_strides_only() -> None:
    rows = cu.generate(4000, "train", 0)
    demos = cu.demonstrations(rows, 0.7, seed=3, style="habit")
    big, small = [], []
    for d, r in zip(demos, rows, strict=True):
        stride = cu.parse_prompt(r["prompt"])[1]
        room = int(r["answer"]) + stride <= cu.MAX_VALUE
        (big if stride >= cu.HABIT_STRIDE and room else small).append((d, r))
    assert len(big) > 1000 and len(small) > 1000
    assert all(d == r["solution"] for d, r in small)  # small strides (or no room): always right
    wrong = [(d, r) for d, r in big if d != r["solution"]]
    assert abs(len(wrong) / len(big) - 0.7) <= 0.04
    for d, r in wrong:  # always the same mistake: one step past the first value past the limit
        assert cu.verify(d, r["answer"]) == 0.0 and cu.well_formed(d)
        assert d.count(";") == r["steps"] + 1 and d.startswith(r["solution"][:-3])
        assert int(cu.extract_answer(d)) == int(r["answer"]) + int(r["prompt"][3])
    with pytest.raises(ValueError):
        cu.demonstration("37+8>60?", random.Random(0), 0.5, style="sloppy")


def test_every_mistake_kind_occurs_and_each_one_is_wrong() -> None:
    rng = random.Random(0)
    seen = {"slip": 0, "stop": 0, "copy": 0}
    for r in cu.generate(300, "train", 2):
        start, stride, limit = cu.parse_prompt(r["prompt"])
        values = cu._count(start, stride, limit)
        for kind in seen:
            demo = cu._mistake(kind, start, stride, limit, values, rng)
            if demo is not None:
                seen[kind] += 1
                assert cu.well_formed(demo) and cu.verify(demo, r["answer"]) == 0.0, (kind, demo)
    assert seen["copy"] == seen["stop"] == 300 and seen["slip"] > 200, seen
    with pytest.raises(ValueError):
        cu.demonstration("37+8>60?", rng, 1.5)


def test_cli_writes_jsonl_splits(tmp_path, capsys) -> None:
    cu.main(["--out", str(tmp_path), "--train", "300", "--eval", "40", "--seed", "5"])
    info = json.loads(capsys.readouterr().out)
    train = [json.loads(x) for x in open(tmp_path / "train.jsonl")]
    held = [json.loads(x) for x in open(tmp_path / "eval.jsonl")]
    assert (len(train), len(held)) == (300, 40)
    assert train == cu.generate(300, "train", 5)
    assert set(train[0]) >= {"uid", "prompt", "answer", "steps"}
    assert info["train_lengths"]["n"] == 300
