"""Held-out evaluation: greedy decoding with the torch engine (laminar/engines/greedy.py),
scored by the task verifier.

    acc = evaluate_model(path_or_model, rows, verify)
    # acc: {"accuracy", "prompts", "mean_len", "completions", ...}

Used by the demo before RL (the warm-up model), on weight snapshots saved during
the run (accuracy against wall-clock and step), and after RL.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def prompt_ids(tok: Any, prompt: str) -> np.ndarray:
    """BOS + prompt characters: the same encoding as the buffer's prompt pool and the warm-up."""
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    if tok.bos_token_id is not None:
        ids = [tok.bos_token_id, *ids]
    return np.asarray(ids, dtype=np.int32)


def evaluate_model(
    model_or_path: Any,
    rows: Sequence[dict[str, Any]],
    verify: Callable[[str, Any], float],
    max_tokens: int = 256,
    max_running: int = 64,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Greedy accuracy of a model on rows ({"prompt", "answer"}); runs its own event loop."""
    from laminar.engines.greedy import greedy_generate
    from laminar.models.tiny import open_model

    model, tokenizer = open_model(model_or_path, tokenizer)
    ids = greedy_generate(
        model,
        tokenizer,
        [prompt_ids(tokenizer, r["prompt"]) for r in rows],
        max_tokens=max_tokens,
        max_running=max_running,
    )
    outs = [tokenizer.decode(o.tolist(), skip_special_tokens=True) for o in ids]
    scores = [float(verify(o, r["answer"])) for o, r in zip(outs, rows, strict=True)]
    return {
        "accuracy": sum(scores) / max(1, len(scores)),
        "prompts": len(rows),
        "mean_len": statistics.fmean(len(o) for o in outs) if outs else 0.0,
        "completions": outs,
        "samples": [
            {"prompt": r["prompt"], "completion": o, "answer": r["answer"], "score": s}
            for r, o, s in list(zip(rows, outs, scores, strict=True))[:8]
        ],
    }
