"""Built-in rewards: exact_match, math_verify, demo_task.

.venv/bin/python -m pytest tests/test_rewards_builtin.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from laminar.buffer.prompts import PromptPool
from laminar.data.prompts import PromptEncoder, load_prompts
from laminar.rewards import builtin as rb
from laminar.tasks import countup


def test_exact_match_normalises_whitespace() -> None:
    assert rb.exact_match("p", "  hello   world\n", answer="hello world") == 1.0
    assert rb.exact_match("p", "hello\tworld", ground_truth=" hello world ") == 1.0
    assert rb.exact_match("p", "hello worlds", answer="hello world") == 0.0
    assert rb.exact_match("p", "Hello world", answer="hello world") == 0.0


@pytest.mark.parametrize("fn", [rb.exact_match, rb.math_verify, rb.demo_task])
def test_no_reference_means_not_applicable(fn) -> None:
    assert fn("p", "42") is None
    assert fn("p", "42", answer=None) is None
    assert fn("p", "42", answer="  ", steps=3) is None
    assert fn("p", "42", ground_truth=None, uid="x") is None


def test_answer_takes_precedence_over_ground_truth() -> None:
    assert rb.exact_match("p", "a", answer="a", ground_truth="b") == 1.0
    assert rb.math_verify("p", "7", answer=0, ground_truth="7") == 0.0  # 0 is a reference


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        # \boxed{...}: the last one wins, nested braces are kept whole
        (r"so \boxed{3} no wait \boxed{4}", "4", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
        (r"\boxed{2^{10}}", "2^{10}", 1.0),
        (r"\boxed{{12}}", "12", 0.0),  # "{12}" is not a number and not the text "12"
        (r"$\boxed{-7}$ and then 99", "-7", 1.0),  # boxed beats a later number
        (r"the answer is \boxed{12", "12", 0.0),  # unclosed box: cut off, no answer
        (r"\boxed{ 1,000 }", "1000", 1.0),
        (r"\boxed{\$5.00}", "5", 1.0),
        (r"\boxed{x+1}", "x + 1", 1.0),  # non-numbers compare as normalised text
        # no box: the final number in the text
        ("The total is 1,234,567 apples.", "1234567", 1.0),
        ("10 - 3 = 7", "7", 1.0),  # a minus between operands is not a sign
        ("x = -5", "-5", 1.0),
        ("first 3, then 2/4 of it", "0.5", 1.0),
        (r"it is \frac{3}{4}", "0.75", 1.0),
        ("12.0", "12", 1.0),
        ("+8", "8", 1.0),
        ("$42$", "42", 1.0),
        (r"a rise of 50\%", "50", 1.0),
        ("the answer is .5", "1/2", 1.0),
        ("values 1,2,3", "3", 1.0),
        ("no digits here", "3", 0.0),
        ("", "3", 0.0),
        ("41", "42", 0.0),
        ("1/3", "0.333", 0.0),  # fractions compare exactly
        ("2/0", "2/0", 1.0),  # not a number: equal as text
        # references in other shapes are reduced the same way
        ("72", "Natalia sold 48 + 24 = 72 clips.\n#### 72", 1.0),
        ("5", r"\boxed{5}", 1.0),
        ("1000", "1,000", 1.0),
        ("8", "+8.0", 1.0),
    ],
)
def test_math_verify(completion: str, reference: str | int, expected: float) -> None:
    assert rb.math_verify("prompt", completion, answer=reference) == expected


def test_math_verify_accepts_numeric_references() -> None:
    assert rb.math_verify("p", r"\boxed{3}", ground_truth=3) == 1.0
    assert rb.math_verify("p", r"\boxed{2.5}", answer=2.5) == 1.0


def test_helpers() -> None:
    assert rb.last_boxed(r"a \boxed{x_{1}} b \fbox{y}") == "y"
    assert rb.last_boxed("nothing") is None
    assert rb.final_number("3 apples and 4,500 pears") == "4,500"
    assert rb.normalize(r"\left( 1,234 \right)") == "1234"


def test_demo_task_is_the_countup_verifier() -> None:
    prompt = "37+8>60?"
    assert rb.demo_task(prompt, "37+8=45<60;#45", answer="61") == countup.reward(
        prompt, "37+8=45<60;#45", answer="61"
    )
    assert rb.demo_task(prompt, countup.solve(prompt), answer="61") == {
        "reward": 1.0,
        "format": 1.0,
    }
    assert rb.demo_task(prompt, "37+8=45<60;#45", answer="61") == {"reward": 0.0, "format": 1.0}


# ---- verl-style rows: the reference at reward_model.ground_truth -------------------------------


@pytest.mark.parametrize("fn", [rb.exact_match, rb.math_verify, rb.demo_task])
def test_verl_rows_are_read(fn) -> None:
    prompt, right, wrong = "37+8>60?", countup.solve("37+8>60?"), "37+8=45<60;#45"
    rm = {"style": "rule", "ground_truth": countup.answer_of(prompt)}

    def score(completion: str, **row) -> float | None:
        out = fn(prompt, completion, data_source="toy", **row)
        return out["reward"] if isinstance(out, dict) else out

    # a parquet struct (dict), a JSON string (flattened jsonl), a flattened column
    ref_right = right if fn is rb.demo_task else rm["ground_truth"]
    for row in (
        {"reward_model": rm},
        {"reward_model": json.dumps(rm)},
        {"reward_model.ground_truth": rm["ground_truth"]},
    ):
        assert score(ref_right, **row) == 1.0, row
        assert score(wrong, **row) == 0.0, row
    # no ground truth inside reward_model, or text that is not JSON: not applicable
    assert score(ref_right, reward_model={"style": "rule"}) is None
    assert score(ref_right, reward_model="rule") is None


def test_top_level_reference_wins_over_reward_model() -> None:
    assert rb.exact_match("p", "a", answer="a", reward_model={"ground_truth": "b"}) == 1.0
    assert rb.exact_match("p", "b", ground_truth="b", reward_model={"ground_truth": "c"}) == 1.0
    assert rb.reference({"reward_model": {"ground_truth": 12}}) == "12"
    assert rb.reference({"answer": None, "reward_model": {"ground_truth": "x"}}) == "x"


def test_verl_parquet_rows_reach_the_reward(tmp_path: Path) -> None:
    """The loader -> pool -> reward path on verl-shaped parquet rows (chat prompt, nested
    struct)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "toy/add",
            "prompt": [
                {"role": "system", "content": "add"},
                {"role": "user", "content": f"{i}+{i}="},
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(4)
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    loaded, report = load_prompts(path)
    assert report.rows == 4 and report.bad == 0
    pool = PromptPool(loaded, PromptEncoder(None), shuffle=False)  # no chat template: joined text
    items, _ = pool.next_items(4, n=2)
    for i, it in enumerate(items):
        assert bytes(it.prompt_ids.tolist()).decode() == f"system: add\nuser: {i}+{i}="
        assert it.prompt == f"{i}+{i}="  # the reward sees the last user message
        assert it.row["reward_model"] == {"style": "rule", "ground_truth": str(2 * i)}
        assert it.row["extra_info"] == {"index": i, "split": "train"}
        assert rb.math_verify(it.prompt, rf"\boxed{{{2 * i}}}", **it.row) == 1.0
        assert rb.math_verify(it.prompt, "no idea", **it.row) == 0.0
