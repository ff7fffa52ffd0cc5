"""Multi-turn episodes on a rollout: the environment answers between model turns.

    engine ──TokenEvent(finished stop|length)──► [events loop] ──driver.turn_ended(seq)──┐
      ▲                                                                                   ▼
      │   GenRequest(resume_ids = every token so far, same version, turn k+1)   [env-step task]
      └──────────────── driver._submit ◄── observation ids (mask 0) ◄── env.step(state, ctx, text)
                                                      └── done / a limit ──► deliverer.finished
    ImportRequest ──table.resume (admitted waiting)──► driver.adopt(seq) ──► [env-replay task]
                      reset + step over the recorded turns (tools from the cache) ──► step or submit

Built by the rollout node only when `env.fn` is configured (laminar/envs: Environment,
TurnTemplate); the parts it drives (SequenceTable, Deliverer, the engine) never see it.

Design (the issue's two choices, and why):
  * One weight version per trajectory. Every model token of an episode comes from the
    version it started on: turn k+1 is resubmitted with `version=seq.version`, and the
    rollout loads weights only when its table is empty, which waiting episodes keep
    non-empty. The off-policy correction stays exact (one behaviour version per
    trajectory, the paper's rule). The cost, a rollout with an episode waiting on a tool
    cannot load new weights, is bounded by the per-turn and episode timeouts, and repack
    can move waiting episodes away. Mode partial is the exception by definition: its next
    turn goes in at the engine's version (per-token versions record it, the correction uses
    each token's own behaviour logprob).
  * Environment state survives a rollout's loss by deterministic replay, not by env
    workers. The trajectory (partial pool, export) carries every token and the loss mask;
    elsewhere the episode is rebuilt by `env.reset(row, prompt)` then `env.step` over each
    recorded model turn with `ctx.replay=True`. Tool calls have deterministic ids
    (uid#t<turn>#c<k>), and the tools node runs each id at most once (a repeat gets the
    cached result, or waits for the first run), so a replay never re-runs a side effect.
    Replayed observation ids are compared with the recorded ones (`replay_mismatch`
    counted); the recorded tokens win. No stateful service per episode, and any single
    loss (a rollout; the tools node, which journals its results) is survived.

Token in, token out: model tokens are the engine's sampled ids (mask 1, behaviour
logprobs); the environment's answer is tokenized once by the turn template (or given as
`observation_ids`) and appended with mask 0 and logprob 0.0. Nothing is re-tokenized.

Images (vision-language policies, `StepResult.images`): the observation's placeholders are
expanded as the model's processor does, the images are put to the buffer once before the
observation goes in (laminar/vision/turns.py), and the sequence's image digests grow by them (the
partial record restarts with a header that names them); a replay renders them the same way. A bad
image ends the episode in error (`turn_bad_images`); a model turn that sampled the placeholder
token ends it (`turn_sampled_placeholder`: its next prefill would read it as an image slot).

Turn boundaries. Model runs and environment runs alternate in the loss mask, each
non-empty: a model turn with no tokens, or a step that is not done but answers nothing,
ends the episode (finish_reason "stop"). Whether the last model run is a finished turn
(its step pending) or a turn cut mid-way (repack, a crash) cannot be told from the
tokens in general (a turn ended by a length cap, the sim engine): the partial says it
(`awaiting_env`, laminar/protocol/data.py), set when the turn ended and streamed to the
partial pool with the chunk that reaches the end.

Limits (cfg.env.limits): max_turns (finish "turns"; the last allowed turn's step still
runs, so the environment sees the answer), max_tool_calls (passed to the step in its
StepContext; the environment answers calls past it with an error observation),
max_total_tokens (engine max_tokens over the whole response; an observation that would
reach it ends the episode, "length"), max_turn_tokens (a turn cut by it still gets its
step), turn_timeout_s (a step past it ends the episode, "timeout": a made-up observation
would make the replayed state differ from the recorded one), episode_timeout_s (wall
clock since the episode began; a generating episode past it is aborted, "timeout").

Errors in the environment (reset/step/score raising) are user code: counted
(`env_errors`), logged, and the episode is delivered with finish_reason "error" and no
reward; the rollout keeps running. Reward: `env.score(state, ctx)` when it returns a
value, else reward.fn on the decoded completion (the deliverer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

import numpy as np
import structlog

from laminar.config import EnvLimits
from laminar.engines.base import Engine, SamplingParams
from laminar.envs.base import Environment, StepContext, StepResult, ToolClient, ToolResult
from laminar.envs.replay import replay, split_segments
from laminar.envs.template import TurnTemplate
from laminar.metrics import Metrics
from laminar.rewards.runner import RewardResult, normalize_reward
from laminar.rollout.deliver import Deliverer
from laminar.rollout.sequences import SequenceTable
from laminar.rollout.tracking import SeqState
from laminar.supervise import Spawn
from laminar.vision.images import BadImage, ImageData
from laminar.vision.turns import TurnImages


def episode_params(
    base: SamplingParams,
    stop: tuple[str, ...],
    max_total: int,
    max_turn_tokens: int | None,
    used: int,
) -> SamplingParams:
    """Sampling params of a model turn starting at response index `used`: the env's stop strings
    added, max_tokens (which counts resumed tokens) capped by the episode and the turn budget."""
    cap = max_total if max_turn_tokens is None else min(max_total, used + max_turn_tokens)
    extra = tuple(s for s in stop if s not in base.stop)
    return replace(base, max_tokens=cap, stop=tuple(base.stop) + extra)


class EpisodeDriver:
    def __init__(
        self,
        env: Environment,
        *,
        template: TurnTemplate,
        tools: ToolClient | None,
        limits: EnvLimits,
        params: SamplingParams,
        max_total: int,
        engine: Engine,
        table: SequenceTable,
        deliverer: Deliverer,
        spawn: Spawn,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        images: TurnImages | None = None,
    ):
        """`images`: a vision-language policy's later-turn images (None: text only; an
        observation with images ends its episode in error)."""
        self.env, self.template, self.tools, self.limits = env, template, tools, limits
        self.images = images
        self.base_params = params
        """The rollout's sampling params, before the per-turn caps and the env's stop strings."""
        self.max_total = max_total
        self.engine, self.table, self.deliverer = engine, table, deliverer
        self.spawn = spawn
        self.metrics, self.log = metrics, log
        self.finishing: set[asyncio.Task[Any]] = set()

    def turn_params(self, used: int) -> SamplingParams:
        return episode_params(
            self.base_params,
            tuple(self.env.stop),
            self.max_total,
            self.limits.max_turn_tokens,
            used,
        )

    # ---- from the events loop ----------------------------------------------------------------
    def turn_ended(self, seq: SeqState, reason: str) -> None:
        """The engine finished this sequence's model turn (stop | length): step, or finish it."""
        if reason == "length" and seq.length >= self.max_total:
            self._finish(seq, "length")
        elif seq.length == seq.turn_start:  # an empty turn: nothing for the environment to answer
            self._finish(seq, "stop")
        elif self.images is not None and self._sampled_placeholder(seq):
            # the next prefill would read it as an image slot: the episode cannot go on (and the
            # trainer drops it, "placeholder_in_response")
            self.metrics.count("turn_sampled_placeholder")
            self._finish(seq, "stop")
        else:
            seq.awaiting_env = True
            self._wait(seq, self._step(seq), "env-step")

    def _sampled_placeholder(self, seq: SeqState) -> bool:
        assert self.images is not None
        turn = seq.ids.view(seq.turn_start, seq.length)
        return bool((turn == self.images.image_token_id).any())

    def adopt(self, seq: SeqState) -> None:
        """An imported episode (admitted waiting): rebuild its env state by replay, then go on."""
        self._wait(seq, self._replay(seq), "env-replay")

    def _wait(self, seq: SeqState, coro: Coroutine[Any, Any, None], name: str) -> None:
        self.table.set_waiting(seq, True)
        self.table.mark_dirty(seq.uid)  # the partial pool learns `awaiting_env` (and any tail)
        seq.step_task = self.spawn(coro, name)

    def _ours(self, seq: SeqState) -> bool:
        """Still this rollout's (not exported or finished meanwhile)."""
        return self.table.seqs.get(seq.uid) is seq and not seq.exporting

    # ---- one environment step ------------------------------------------------------------------
    def _left(self, seq: SeqState) -> float:
        return self.limits.episode_timeout_s - (time.time() - seq.t_start)

    def _ctx(
        self, seq: SeqState, turn: int, tool_calls: int, budget: float, replay: bool
    ) -> StepContext:
        return StepContext(
            uid=seq.uid,
            turn=turn,
            tools=self.tools,
            tool_calls_so_far=tool_calls,
            max_tool_calls=self.limits.max_tool_calls,
            timeout_s=budget,
            replay=replay,
        )

    async def _step(self, seq: SeqState) -> None:
        if not self._ours(seq):
            return
        budget = min(self.limits.turn_timeout_s, self._left(seq))
        if budget <= 0:
            self._finish(seq, "timeout")
            return
        model_ids = seq.ids.view(seq.turn_start, seq.length).copy()
        t0 = time.monotonic()
        try:
            if seq.env_state is None:
                seq.env_state = self.env.reset(seq.row, seq.prompt)
            ctx = self._ctx(seq, seq.turn, len(seq.tool_calls), budget, replay=False)
            res = await asyncio.wait_for(
                self.env.step(seq.env_state, ctx, self.template.decode(model_ids.tolist())), budget
            )
            if res.images:  # reading and processing images: off the event loop
                obs, imgs = await asyncio.to_thread(self._render, res, model_ids.tolist())
            else:
                obs, imgs = self._render(res, model_ids.tolist())
        except BadImage as exc:  # the environment's image (or its placeholders): not generated on
            if self._ours(seq):
                self.metrics.count("turn_bad_images")
                self._env_error(seq, "image", exc)
            return
        except TimeoutError:
            if self._ours(seq):
                self.metrics.count("env_step_timeouts")
                self._finish(seq, "timeout")
            return
        except (
            Exception
        ) as exc:  # the environment is user code: the episode ends, the rollout goes on
            if self._ours(seq):
                self._env_error(seq, "step", exc)
            return
        if not self._ours(seq):
            return
        if imgs and not res.done:
            try:  # the owner holds them before any message names their digests
                assert self.images is not None
                await self.images.publish(imgs)
            except Exception as exc:  # refused by the buffer, or it could not be reached
                if self._ours(seq):
                    self.metrics.count("turn_image_put_failed")
                    self._env_error(seq, "image", exc)
                return
            if not self._ours(seq):
                return
        self.metrics.add("env_step_s", time.monotonic() - t0)
        self._record_tools(seq, res.tool_results, seq.turn)
        self._answer(seq, res, obs, [i.digest for i in imgs])

    def _render(
        self, res: StepResult, model_ids: list[int]
    ) -> tuple[np.ndarray | None, list[ImageData]]:
        """A step's observation tokens (image placeholders expanded as the model's processor does)
        and its checked images; raises BadImage."""
        imgs: list[ImageData] = []
        if res.images:
            if self.images is None:
                raise BadImage("an observation with images needs a vision-language model.path")
            imgs = self.images.load(res.images)
        if res.observation_ids is not None:
            ids = [int(t) for t in res.observation_ids]
        elif res.observation is None and not imgs:
            return None, imgs
        else:
            after_eot = self.template.ended_with_eot(model_ids)
            text = "" if res.observation is None else res.observation
            ids = self.template.observation_ids(text, res.role, after_eot, images=len(imgs))
        if self.images is not None:  # a placeholder with no image would misplace every image
            ids = self.images.expand(ids, self.images.token_counts(imgs))
        return np.asarray(ids, np.int32), imgs

    def _replay_observation(self, res: StepResult, model_ids: list[int]) -> list[int]:
        obs, _ = self._render(res, model_ids)
        return [] if obs is None else obs.tolist()

    def _record_tools(self, seq: SeqState, results: list[ToolResult], turn: int) -> None:
        for r in results:
            seq.tool_calls.append(r.record(turn))
            self.metrics.count("tool_calls")
            self.metrics.add("tool_s", r.seconds)
            if not r.ok:
                self.metrics.count("tool_errors")
                self.metrics.count(f"tool_error_{r.error_kind or 'unknown'}")
            if r.cached:
                self.metrics.count("tool_cached")

    def _answer(
        self, seq: SeqState, res: StepResult, obs: np.ndarray | None, digests: list[str]
    ) -> None:
        """The step of turn seq.turn answered: the episode ends, or its answer goes in and turn+1
        starts. `digests`: the answer's images (their owner holds them)."""
        if res.done:
            self._finish(seq, "stop")
        elif seq.turn + 1 >= self.limits.max_turns:
            self._finish(seq, "turns")
        elif obs is None or not len(obs):
            self.metrics.count("env_empty_observation")
            self._finish(seq, "stop")
        elif seq.length + len(obs) >= self.max_total:
            self._finish(seq, "length")
        else:
            if digests:  # a fresh list: headers already sent keep theirs
                seq.image_digests = [*seq.image_digests, *digests]
                seq.sent_upto = 0  # the partial record restarts with a header that names them
                self.metrics.count("turn_images", len(digests))
            seq.append_env(obs)
            self.metrics.count("env_tokens", len(obs))
            seq.turn += 1
            seq.turn_start = seq.length
            seq.awaiting_env = False
            self._submit(seq)

    def _submit(self, seq: SeqState) -> None:
        """Back into the engine for the next model turn, at the episode's own version (mode
        partial: at the engine's, the episode continues across versions)."""
        if not self.table.interrupts and self.engine.version != seq.version:
            # one version per trajectory: weights load only when the table is empty, and a waiting
            # episode keeps it non-empty; getting here is a bug, and it must not train silently
            raise RuntimeError(
                f"{seq.uid}: episode at version {seq.version} would resume on an "
                f"engine at version {self.engine.version}"
            )
        self.table.set_waiting(seq, False)
        self.table.mark_dirty(seq.uid)
        # mode partial: at the engine's version (after an interrupt)
        self.table.submit_turn(seq, self.turn_params(seq.length))

    # ---- replay (an imported episode) -------------------------------------------------------
    async def _replay(self, seq: SeqState) -> None:
        """Rebuild the environment state (laminar/envs/replay.py: reset, then step over every
        recorded model turn that has a recorded answer, tool calls served from the cache). Then
        run the pending step (`awaiting_env`, or the last model run ended its turn), or resubmit
        the turn that was cut mid-way."""
        assert seq.mask is not None
        ids, mask = seq.ids.copy(), seq.mask.copy()
        segs = split_segments(ids, mask)
        if segs and segs[0].kind == "env":
            self.metrics.count("replay_bad_partial")  # environment tokens before any model token

        def ctx_for(turn: int, tool_calls: int) -> StepContext:
            budget = min(self.limits.turn_timeout_s, max(self._left(seq), 1e-3))
            return self._ctx(seq, turn, tool_calls, budget, replay=True)

        t0 = time.monotonic()
        try:
            rep = await replay(
                self.env,
                seq.row,
                seq.prompt,
                ids,
                mask,
                self.template,
                ctx_for,
                observe=self._replay_observation,
            )
        except TimeoutError:  # a replayed step past its budget (or the episode's)
            if self._ours(seq):
                self.metrics.count("replay_failed")
                self._finish(seq, "timeout")
            return
        except Exception as exc:
            if self._ours(seq):
                self.metrics.count("replay_failed")
                self._env_error(seq, "replay", exc)
            return
        if not self._ours(seq):
            return
        self.metrics.count("episodes_replayed")
        self.metrics.add("replay_s", time.monotonic() - t0)
        if rep.mismatches:
            self.metrics.count("replay_mismatch", rep.mismatches)  # the recorded tokens win
        seq.env_state, seq.tool_calls = rep.state, rep.tool_records
        self.metrics.count("tool_calls_replayed", len(rep.tool_records))
        seq.turn = rep.turns_done
        if (
            segs and segs[-1].kind == "model"
        ):  # the last run is the model's: its turn is the current one
            seq.turn_start = segs[-1].start
            seq.awaiting_env = seq.awaiting_env or rep.last_turn_complete
        else:
            seq.turn_start = len(ids)
            seq.awaiting_env = False  # nothing to answer (a stale flag)
        if seq.awaiting_env:
            await self._step(seq)
        elif seq.length >= self.max_total:
            self._finish(seq, "length")
        else:
            self._submit(seq)

    # ---- the end ----------------------------------------------------------------------------
    def _env_error(self, seq: SeqState, where: str, exc: BaseException) -> None:
        self.metrics.count("env_errors")
        self.log.warning(
            "env_error",
            uid=seq.uid,
            where=where,
            turn=seq.turn,
            error=f"{type(exc).__name__}: {exc}",
        )
        why = f"env {where}: {type(exc).__name__}: {exc}"
        self._finish(seq, "error", RewardResult.failure("env", why))

    def _finish(self, seq: SeqState, reason: str, score: RewardResult | None = None) -> None:
        """The episode is over: it leaves the table (its credit is free), then score and deliver."""
        seq.awaiting_env = False
        seq.step_task = None
        self.table.forget(seq.uid)
        self.deliverer.scoring_started(seq.uid)  # the environment scores it, then the deliverer
        n_env = 0 if seq.mask is None else int(seq.length - seq.mask.view().sum())
        self.metrics.add("episode_turns", seq.turn + 1)
        self.metrics.add("episode_tool_calls", len(seq.tool_calls))
        if seq.length:
            self.metrics.add("env_token_frac", n_env / seq.length)
        self.metrics.count(f"episode_finish_{reason}")
        task = self.spawn(self._score_and_deliver(seq, reason, score), "episode-score")
        self.finishing.add(task)
        task.add_done_callback(self.finishing.discard)

    async def _score_and_deliver(
        self, seq: SeqState, reason: str, score: RewardResult | None
    ) -> None:
        if score is None:
            try:
                if seq.env_state is None:
                    seq.env_state = self.env.reset(seq.row, seq.prompt)
                ctx = self._ctx(
                    seq, seq.turn, len(seq.tool_calls), self.limits.turn_timeout_s, replay=False
                )
                out = await asyncio.wait_for(
                    self.env.score(seq.env_state, ctx), self.limits.turn_timeout_s
                )
                if out is not None:
                    score = RewardResult(*normalize_reward(out))
            except Exception as exc:  # user code: no reward rather than a dead rollout
                self.metrics.count("env_score_errors")
                self.log.warning(
                    "env_score_error", uid=seq.uid, error=f"{type(exc).__name__}: {exc}"
                )
                why = f"env score: {type(exc).__name__}: {exc}"
                score = RewardResult.failure("env", why)
        self.deliverer.finished(seq, reason, score)

    # ---- the episode clock -------------------------------------------------------------------
    async def watch(self) -> None:
        """Ends generating episodes past episode_timeout_s (waiting ones: their step's budget)."""
        period = min(1.0, self.limits.episode_timeout_s / 4)
        while True:
            await asyncio.sleep(period)  # a timer: the deadline check of every generating episode
            now = time.time()
            late = [
                s
                for s in self.table.seqs.values()
                if not s.waiting
                and not s.exporting
                and now - s.t_start > self.limits.episode_timeout_s
            ]
            for seq in late:
                await self._cut(seq)

    async def _cut(self, seq: SeqState) -> None:
        seq.exporting = True  # its abort event is ours, not a trajectory the engine gave up on
        states = await self.engine.abort([seq.uid])
        if self.table.seqs.get(seq.uid) is not seq:
            return
        seq.exporting = False
        if not states:
            return  # it finished in the engine first: its final event ends the turn
        p = states[0]
        if len(p.output_ids) > seq.length:  # tokens the events loop has not seen yet (model tokens)
            seq.append(p.output_ids[seq.length :], p.logprobs[seq.length :], time.time())
        self.metrics.count("episode_timeouts")
        self._finish(seq, "timeout")
