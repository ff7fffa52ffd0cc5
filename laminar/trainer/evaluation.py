"""Periodic validation: the trainer's current weights, greedy, on the first rows of data.eval,
scored by reward.fn.

    ev = open_evaluator(settings, log)     # EvalSettings; blocking (rows, a model); None: off
    await ev.start()                       # the reward runner
    if ev.due(step, total):
        metrics = await ev.run(weights)  # weights = trainer.export(); {"eval/accuracy", ...}
    await ev.close()

    data.eval ─► first trainer.eval_rows rows ─► PromptEncoder (as the buffer encodes them)
              ─► ValidationTask (a Task, laminar/tasks/base.py: the rows, scored by reward.fn)
    trainer.export() ─► a separate eval copy of the model (model.path architecture,
                        model.dtype, on trainer.eval_device)
                     ─► the held-out evaluator (laminar/tasks/evaluate.py): TorchEngine,
                        temperature 0, rollout.sampling max_tokens/stop
                     ─► decoded completions ─► RewardRunner(reward.fn) ─► mean = eval/accuracy

Runs before the first step of a fresh run (step 0: the starting point), every
`trainer.eval_every` steps and at the last step; the trainer waits for it (like a checkpoint)
while rollouts keep generating. Generation runs on a thread of its own with its own event loop
(asyncio.to_thread), so the trainer's heartbeats keep flowing, and it stops early when the
node stops. The eval copy of the model costs one more model in memory (in the
rollout dtype); the trained model itself is never touched.

Metrics (one metrics.jsonl line per validation, and TensorBoard): eval/accuracy (mean reward of
the scored rows), eval/n (rows scored), eval/excluded (reward None or failed), eval/mean_tokens,
eval/seconds. The first samples go to completions.jsonl with "eval": true.

Not run (one log line says why): trainer.engine=sim (no model), no data.eval, eval_every 0, a
trainer on a GPU with trainer.eval_device=auto (the eval copy and its KV cache would sit on rank
0's GPU next to its FSDP share: `laminar plan` shows whether eval_device=trainer fits).
Multi-turn runs (env.fn set) are validated single-turn only: one greedy completion per prompt,
scored by reward.fn, without the environment's tools or turns (episodes would need the tools
node and the env's own scoring; the line `eval_single_turn` says so at start).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from laminar.config import (
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from laminar.engines.greedy import Greedy
from laminar.tasks.base import HeldOut
from laminar.tasks.evaluate import evaluate

if TYPE_CHECKING:
    from laminar.rewards.runner import RewardRunner


@dataclass(frozen=True)
class EvalSettings:
    """The sections validation reads (laminar/wiring/trainer.py `eval_settings`)."""

    data: DataConfig
    """data.eval, chat_template, max_prompt_tokens."""
    trainer: TrainerConfig
    """eval_every, eval_rows, completions_per_step, engine."""
    model: ModelConfig
    """The eval copy of the model: path, dtype, device."""
    rollout: RolloutConfig
    """sampling.max_tokens/stop, max_running, max_model_len: generation as the rollouts do it."""
    reward: RewardConfig
    """Scores the completions."""
    env_fn: str | None
    """env.fn: set, validation is single-turn (logged at start)."""


def load_eval_rows(
    data: DataConfig, limit: int, tokenizer: Any, log: structlog.typing.FilteringBoundLogger
) -> list[HeldOut]:
    """The first `limit` usable rows of data.eval; bad rows are logged and skipped."""
    from laminar.data.prompts import BadRow, PromptEncoder, load_prompts

    assert data.eval is not None
    rows, report = load_prompts(data.eval)
    for err in report.errors:
        log.warning("bad_eval_row", error=err)
    encoder = PromptEncoder(tokenizer, data.chat_template, data.max_prompt_tokens)
    out: list[HeldOut] = []
    for r in rows:
        if len(out) >= limit:
            break
        try:
            ids, text = encoder.encode(r.prompt)
        except BadRow as exc:
            log.warning("bad_eval_row", error=f"{r.where}: {exc}")
            continue
        out.append(HeldOut(ids, text, r.row))
    return out


@dataclass(frozen=True)
class ValidationTask:
    """The trainer's Task (laminar/tasks/base.py): data.eval's first rows, single-turn, scored
    by reward.fn."""

    prompts: Sequence[HeldOut]
    rewards: RewardRunner
    episodes: None = None

    async def score(self, prompt: HeldOut, completion: str) -> float | None:
        return (await self.rewards.score(prompt.prompt, completion, prompt.row)).reward


class Evaluator:
    def __init__(
        self,
        settings: EvalSettings,
        model: Any,
        tokenizer: Any,
        rows: list[HeldOut],
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        from laminar.rewards.runner import RewardRunner

        s = settings.rollout
        self.greedy = Greedy(
            max_tokens=s.sampling.max_tokens,
            stop=tuple(s.sampling.stop),
            max_running=s.max_running,
            max_model_len=s.max_model_len,
        )
        self.model, self.tokenizer, self.log = model, tokenizer, log
        self.every = settings.trainer.eval_every
        r = settings.reward
        self.rewards = RewardRunner(r.fn, r.timeout_s, r.workers)
        self.task = ValidationTask(rows, self.rewards)
        self.samples = max(1, settings.trainer.completions_per_step)
        """Eval completions written to completions.jsonl per validation."""
        self.adapter = None
        """model.lora: the exported weights are adapters, merged into a pristine base copy."""
        if settings.model.lora is not None:
            from laminar.models.lora import MergedAdapter

            self.adapter = MergedAdapter(model, settings.model.lora)

    def due(self, step: int, total: int) -> bool:
        return step > 0 and (step % self.every == 0 or step == total)

    async def start(self) -> None:
        await self.rewards.start()

    async def close(self) -> None:
        await self.rewards.close()

    def _load_weights(self, weights: dict[str, Any]) -> None:
        if self.adapter is not None:
            self.adapter.apply(weights)
            return
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = {k for k in missing if k.startswith("lm_head")}
        if unexpected or set(missing) - tied:
            raise ValueError(
                f"exported weights do not fit the eval model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        if tied:
            self.model.tie_weights()

    async def run(
        self, weights: dict[str, Any], step: int
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """(metrics, a few sample records) of one validation of `weights`."""
        t0 = time.perf_counter()
        await asyncio.to_thread(self._load_weights, weights)
        outcomes = await evaluate(self.model, self.tokenizer, self.task, self.greedy)
        rewards = [o.reward for o in outcomes if o.reward is not None]
        metrics = {
            "eval/accuracy": statistics.fmean(rewards) if rewards else float("nan"),
            "eval/n": float(len(rewards)),
            "eval/excluded": float(len(outcomes) - len(rewards)),
            "eval/mean_tokens": statistics.fmean(o.tokens for o in outcomes) if outcomes else 0.0,
            "eval/seconds": time.perf_counter() - t0,
        }
        samples = [
            {
                "step": step,
                "eval": True,
                "prompt": o.prompt.prompt,
                "completion": o.completion,
                "reward": o.reward,
                "answer": o.prompt.row.get("answer"),
            }
            for o in outcomes[: self.samples]
        ]
        return metrics, samples


def open_evaluator(
    settings: EvalSettings, log: structlog.typing.FilteringBoundLogger
) -> Evaluator | None:
    """The evaluator the settings ask for, or None (with one log line saying why). Blocking."""
    data, tc, mc = settings.data, settings.trainer, settings.model
    if not data.eval or tc.eval_every == 0:
        return None
    if tc.engine == "sim":
        log.info("eval_skipped", reason="trainer.engine=sim has no model to generate with")
        return None
    if not mc.path:
        log.info("eval_skipped", reason="model.path is not set")
        return None
    device = mc.device if tc.eval_device != "cpu" else "cpu"
    if tc.eval_device == "auto" and device != "cpu":
        log.info(
            "eval_skipped",
            reason=f"the trainer is on {device}: the evaluator would share rank 0's GPU with "
            "its FSDP share; set trainer.eval_device=trainer (where `laminar plan` says it "
            "fits) or cpu",
        )
        return None
    if settings.env_fn:
        log.warning(
            "eval_single_turn",
            env=settings.env_fn,
            note="validation generates one greedy turn per prompt, scored by reward.fn",
        )
    from laminar.models.decoder_lm import load_model
    from laminar.models.prompt_tokenizer import load_prompt_tokenizer

    tokenizer = load_prompt_tokenizer(mc.path, chat_template=data.chat_template)
    rows = load_eval_rows(data, tc.eval_rows, tokenizer, log)
    if not rows:
        log.error("eval_skipped", reason=f"no usable rows in data.eval={data.eval}")
        return None
    model = load_model(
        mc.path,
        mc.dtype,
        device,
        module_free=True,
        max_len=settings.rollout.max_model_len,
    )
    log.info("eval_ready", rows=len(rows), every=tc.eval_every, file=data.eval)
    return Evaluator(settings, model, tokenizer, rows, log)
