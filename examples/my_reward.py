"""A custom reward for the example job: `reward.fn: examples.my_reward:reverse_reward`.

    laminar run examples/config.yaml          # from the repository root

The task: the prompt asks to reverse a short word ("reverse abc:"), the reference is the
reversed word ("cba"). Laminar calls `reverse_reward(prompt, completion, **row)` once per
sample, where `row` holds the dataset row's other columns as keyword arguments:

    TRL-style row   {"prompt": "reverse abc:", "answer": "cba", "partial_credit": true}
                    -> answer="cba", partial_credit=True
    verl-style row  {"prompt": [{"role": "user", "content": "reverse abc:"}],
                     "reward_model": {"ground_truth": "cba", "style": "rule"},
                     "data_source": "example/reverse", ...}
                    -> reward_model={...}, data_source="example/reverse", ...

It returns a dict: "reward" is what trains, the other keys are logged with the sample.
A row with no reference, or from a data source this function does not know, returns None:
the sample is left out of training (not scored 0). Check it by hand:

    python -c "from examples.my_reward import reverse_reward as r
    print(r('reverse abc:', 'cbx', answer='cba'))"
"""

from __future__ import annotations

from typing import Any

KNOWN_SOURCES = ("example/reverse",)


def reference(row: dict[str, Any]) -> str | None:
    """The reference answer of a TRL-style (`answer`) or verl-style (`reward_model.ground_truth`)
    row."""
    ref = row.get("answer")
    if ref is None and isinstance(row.get("reward_model"), dict):
        ref = row["reward_model"].get("ground_truth")
    return None if ref is None else str(ref)


def reverse_reward(
    prompt: str, completion: str, *, partial_credit: bool = True, **row: Any
) -> dict[str, float] | None:
    """1.0 for the reversed word; with partial_credit, credit for its letters and their places."""
    source = row.get("data_source")
    if source is not None and source not in KNOWN_SOURCES:
        return None  # not ours to judge
    ref = reference(row)
    if not ref:
        return None
    text = completion.strip()
    exact = float(text == ref)
    head = text[: len(ref)]
    in_place = sum(a == b for a, b in zip(head, ref, strict=False)) / len(ref)
    letters = sum(ch in ref for ch in head) / len(ref)  # the word's letters, in any order
    partial = 0.5 * letters + 0.5 * in_place
    return {
        "reward": max(exact, partial) if partial_credit else exact,
        "exact": exact,
        "in_place": in_place,
        "letters": letters,
    }
