"""Built-in reward functions, named in config as `laminar.rewards.builtin:<name>`.

Every reward has the shape `(prompt, completion, **row) -> float | dict | None`.
The reference is found by `reference(row)`, first match wins:

    answer, ground_truth            TRL-style columns
    reward_model.ground_truth       verl-style rows: `reward_model` as a dict (parquet
                                    struct), as a JSON string, or a flattened
                                    `reward_model.ground_truth` column

A row without one gets None ("not applicable": the sample is left out of
training, not scored 0; the buffer warns when that happens to most samples).
Dataflow:

    rollout finishes a sample -> reward(prompt, completion, **row) -> Trajectory.reward

    exact_match  whitespace-normalised string equality
    math_verify  last \\boxed{...} (else the final number) vs the reference, numerically
    demo_task    the count-up task's verifier (laminar.tasks.countup.reward)

Run a reward by hand:
    python -c "from laminar.rewards.builtin import math_verify
    print(math_verify('', r'\\boxed{1/2}', answer='0.5'))"
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from laminar.tasks import countup

__all__ = [
    "exact_match",
    "math_verify",
    "demo_task",
    "reference",
    "last_boxed",
    "final_number",
    "REFERENCE_FIELDS",
]

REFERENCE_FIELDS = ("answer", "ground_truth", "reward_model.ground_truth")
"""Where `reference` looks, in order (named by the buffer's missing-reward warning)."""


def _verl_ground_truth(row: Mapping[str, Any]) -> Any:
    rm = row.get("reward_model")
    if isinstance(rm, str | bytes):  # a row flattened to JSON text (jsonl/csv exports)
        try:
            rm = json.loads(rm)
        except ValueError:
            return None
    if isinstance(rm, Mapping):
        return rm.get("ground_truth")
    return row.get("reward_model.ground_truth")


def reference(row: Mapping[str, Any]) -> str | None:
    """The row's reference answer as text, or None when it has none (see REFERENCE_FIELDS).

    The first field that is present and not None decides: a blank one means "no reference"
    (it does not fall through to the next field).
    """
    for ref in (row.get("answer"), row.get("ground_truth"), _verl_ground_truth(row)):
        if ref is not None:
            text = str(ref)
            return text if text.strip() else None
    return None


def _squash(text: str) -> str:
    return " ".join(text.split())


def exact_match(prompt: str, completion: str, **row: Any) -> float | None:
    """1.0 when completion and reference are equal after collapsing whitespace."""
    ref = reference(row)
    if ref is None:
        return None
    return float(_squash(completion) == _squash(ref))


def demo_task(prompt: str, completion: str, **row: Any) -> dict[str, float] | None:
    """The count-up task's verifier (laminar.tasks.countup.reward) on any row shape."""
    ref = reference(row)
    if ref is None:
        return None
    return countup.reward(prompt, completion, **{**row, "answer": ref})


# ---- math answers -------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
# thousands groups first so "1,234" is one number; then plain integers / decimals; then a/b
# a sign counts only where it cannot be a minus between operands ("10-3" ends in 3, not -3)
_SIGN = r"(?:(?<![\w)])[-+])?"
_NUMBER = re.compile(
    _SIGN + r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+(?:\.\d+)?)?"
)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces allowed); None if absent or unclosed."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth = 1
    for i in range(starts[-1], len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[starts[-1] : i]
    return None  # unclosed: the model was cut off mid-answer


def final_number(text: str) -> str | None:
    """The last number in the text (with thousands commas, decimals or a/b), or None."""
    found = _NUMBER.findall(_FRAC.sub(r"\1/\2", text))
    return found[-1] if found else None


def normalize(answer: str) -> str:
    """Canonical text of an answer: no $ or %, spaces, thousands commas, leading +, trailing .0."""
    s = _FRAC.sub(r"(\1)/(\2)", answer)
    s = re.sub(r"\\(?:left|right|!|,|;|\s)", "", s)
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\?[$%]", "", s)  # currency and percent signs carry no value here
    s = s.replace(" ", "").strip().rstrip(".")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    s = re.sub(r"^\(([-+]?[\d.]+)\)/\(([-+]?[\d.]+)\)$", r"\1/\2", s)  # \frac{1}{2} -> 1/2
    s = re.sub(r"^\(([^()]*)\)$", r"\1", s)
    s = s.lstrip("+")
    s = re.sub(r"(\d)\.0+$", r"\1", s)
    return s


def to_number(answer: str) -> Fraction | None:
    """An exact value for a normalised number or simple fraction a/b, else None."""
    parts = answer.split("/")
    if len(parts) > 2:
        return None
    try:
        values = [Fraction(p.strip("()")) for p in parts]
    except (ValueError, ZeroDivisionError):
        return None
    if len(values) == 2:
        return None if values[1] == 0 else values[0] / values[1]
    return values[0]


def _extract(completion: str) -> str | None:
    # a completion that opened a \\boxed{} answers there or not at all: an unclosed box
    # (cut off mid-answer) must not fall back to whatever number came last
    if _BOXED.search(completion):
        return last_boxed(completion)
    return final_number(completion)


def _reference_answer(ref: str) -> str:
    boxed = last_boxed(ref)
    if boxed is not None:
        return boxed
    if "####" in ref:  # GSM8K-style solution text
        return ref.rsplit("####", 1)[1]
    return ref


def answers_equal(got: str, want: str) -> bool:
    a, b = normalize(got), normalize(want)
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    return x is not None and y is not None and x == y


def math_verify(prompt: str, completion: str, **row: Any) -> float | None:
    """1.0 when the last \\boxed{} (else the final number) equals the reference.

    Numbers compare by value (1,000 == 1000.0 == +1000; 1/2 == 0.5 == \\frac{1}{2});
    anything else compares as normalised text.
    """
    ref = reference(row)
    if ref is None:
        return None
    got = _extract(completion)
    if got is None:
        return 0.0
    return float(answers_equal(got, _reference_answer(ref)))
