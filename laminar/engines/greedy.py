"""Greedy completions with the torch engine, outside the cluster: one blocking call that runs
its own event loop (the held-out evaluator, laminar/tasks/evaluate.py, for the trainer's
validation and the demos).

    outs = greedy_generate(model, tokenizer, prompt_ids, Greedy(max_tokens=64, stop=("\n",)))
    # one array of response ids per prompt; `cancel` (a threading.Event) ends it early

Every prompt is submitted at once (continuous batching on one TorchEngine, temperature 0), under
inference mode; each request has a deadline, so a stuck engine raises instead of hanging.
`greedy_engine` and `gather_or_cancel` are the same engine and the same early end for the
evaluator's multi-turn episodes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from laminar.engines.base import GenRequest, SamplingParams

T = TypeVar("T")

_CANCEL_POLL_S = 0.1
_GEN_TIMEOUT_S = 3600.0
"""Deadline on one prompt's generation (a stuck engine must not hang the trainer)."""


@dataclass(frozen=True)
class Greedy:
    """How greedy completions are generated."""

    max_tokens: int
    """Response tokens per prompt (per episode, model and environment tokens together)."""
    stop: tuple[str, ...] = ()
    """Stop strings of a single-turn completion (an episode stops at its environment's)."""
    max_running: int = 64
    """Sequences the engine decodes at once."""
    max_model_len: int | None = None
    """Prompt + response tokens (None: the model's max_position_embeddings)."""


def greedy_engine(model: Any, tokenizer: Any, n: int, greedy: Greedy) -> Any:
    """A TorchEngine sized for `n` prompts."""
    from laminar.engines.torch_engine import TorchEngine

    return TorchEngine(
        model,
        tokenizer,
        max_running=max(1, min(greedy.max_running, n)),
        max_model_len=greedy.max_model_len,
    )


async def gather_or_cancel(aws: Sequence[Awaitable[T]], cancel: threading.Event) -> list[T]:
    """Every result, in order; CancelledError as soon as `cancel` is set (polled)."""
    everything = asyncio.gather(*aws)
    while not everything.done():
        if cancel.is_set():
            everything.cancel()
            raise asyncio.CancelledError("validation cancelled: the node is stopping")
        await asyncio.wait({everything}, timeout=_CANCEL_POLL_S)
    return everything.result()


async def _generate(
    engine: Any, prompts: Sequence[np.ndarray], params: Any, cancel: threading.Event
) -> list[np.ndarray]:
    await engine.start()
    try:
        requests = [
            engine.generate_all(
                GenRequest(f"eval{i}", ids, params, single=True), timeout=_GEN_TIMEOUT_S
            )
            for i, ids in enumerate(prompts)
        ]
        results = await gather_or_cancel(requests, cancel)
    finally:
        await engine.close()
    return [next(iter(r.values()))[0] for r in results]


def greedy_generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[np.ndarray],
    greedy: Greedy,
    cancel: threading.Event | None = None,
) -> list[np.ndarray]:
    """Greedy response ids for each prompt with the torch engine. Blocking: runs its own event
    loop."""
    import torch

    engine = greedy_engine(model, tokenizer, len(prompts), greedy)
    params = SamplingParams(temperature=0.0, max_tokens=greedy.max_tokens, stop=greedy.stop)
    with torch.inference_mode():
        return asyncio.run(_generate(engine, prompts, params, cancel or threading.Event()))
