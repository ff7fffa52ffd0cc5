"""Greedy completions with the torch engine, outside the cluster: one blocking call that runs
its own event loop (the trainer's validation, laminar/trainer/evaluation.py, and the demos'
held-out evaluation, laminar/demo/evaluate.py).

    outs = greedy_generate(model, tokenizer, prompt_ids, max_tokens=64, stop=("\n",))
    # one array of response ids per prompt; `cancel` (a threading.Event) ends it early

Every prompt is submitted at once (continuous batching on one TorchEngine, temperature 0), under
inference mode; each request has a deadline, so a stuck engine raises instead of hanging.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from laminar.engines.base import GenRequest, SamplingParams

_CANCEL_POLL_S = 0.1
_GEN_TIMEOUT_S = 3600.0
"""Deadline on one prompt's generation (a stuck engine must not hang the trainer)."""


async def _generate(
    engine: Any, prompts: Sequence[np.ndarray], params: Any, cancel: threading.Event
) -> list[np.ndarray]:
    await engine.start()
    try:
        tasks = [
            asyncio.ensure_future(
                engine.generate_all(
                    GenRequest(f"eval{i}", ids, params, single=True), timeout=_GEN_TIMEOUT_S
                )
            )
            for i, ids in enumerate(prompts)
        ]
        everything = asyncio.gather(*tasks)
        while not everything.done():
            if cancel.is_set():
                everything.cancel()
                raise asyncio.CancelledError("validation cancelled: the node is stopping")
            await asyncio.wait({everything}, timeout=_CANCEL_POLL_S)
        results = everything.result()
    finally:
        await engine.close()
    return [next(iter(r.values()))[0] for r in results]


def greedy_generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[np.ndarray],
    *,
    max_tokens: int,
    stop: Sequence[str] = (),
    max_running: int = 64,
    max_model_len: int | None = None,
    cancel: threading.Event | None = None,
) -> list[np.ndarray]:
    """Greedy response ids for each prompt with the torch engine. Blocking: runs its own event
    loop."""
    import torch

    from laminar.engines.torch_engine import TorchEngine

    engine = TorchEngine(
        model,
        tokenizer,
        max_running=max(1, min(max_running, len(prompts))),
        max_model_len=max_model_len,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=tuple(stop))
    with torch.inference_mode():
        return asyncio.run(_generate(engine, prompts, params, cancel or threading.Event()))
