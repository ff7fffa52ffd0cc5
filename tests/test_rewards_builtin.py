"""Built-in rewards: exact_match, math_verify, demo_task.

.venv/bin/python -m pytest tests/test_rewards_builtin.py -q
"""

from __future__ import annotations

import pytest

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
    assert rb.demo_task is countup.reward
    prompt = "37+8>60?"
    assert rb.demo_task(prompt, countup.solve(prompt), answer="61") == {
        "reward": 1.0,
        "format": 1.0,
    }
    assert rb.demo_task(prompt, "37+8=45<60;#45", answer="61") == {"reward": 0.0, "format": 1.0}
