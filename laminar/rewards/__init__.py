"""Reward functions: `(prompt, completion, **row) -> float | dict | None`, sync or async.

A config names one as `module:function` (`reward.fn`); `row` carries the dataset
row's reference (`answer` or `ground_truth`) and extra columns. None means "not
applicable" (no reference): the sample is excluded, not scored 0. A dict returns
components; its "reward" entry is the scalar. The built-ins live in
`laminar.rewards.builtin` (exact_match, math_verify, demo_task).
"""
