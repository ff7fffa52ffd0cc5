"""One call of an agent episode, served as a model turn of the episode's token sequence.

    openai_api.py ──driver.turn(token, ChatTurn | TextTurn) (agents.py: the token's episode,
    authorized)──► AgentCalls.serve(ep, token, turn, stream):
        messages -> canonical -> extends the episode? ──yes──► the new messages' tokens (mask 0;
        │    later-turn images expanded and put to their owner once, `_show_images`)
        └─no──► a new run from the rendered prompt (`_new_run`); moved here: matched against the
             recorded tokens first (`_resume`)
        -> `_generate`: GenRequest(version=the episode's; mode partial: the engine's) -> engine
           ──TokenEvent──► [node events loop] ──progressed(seq) (stream: TurnStream.push)
           ──finished──► turn_ended(seq, reason) ──ep.pending──► the turn flushed to the partial
           pool ──► TurnResult ──► openai_shapes.py: the reply

The per-call half of the black-box agent driver; the episode's lifecycle (attempts, claims,
closes, preemption, moves) is laminar/rollout/agents.py, which writes the AgentEpisode records
and the EpisodeIndex this reads (agent_episode.py). Built by the rollout node beside the driver,
from what a call needs: the agent config and token caps, the renderer, the sampling defaults,
the engine, the sequence table, the deliverer (its partial flush) and the later-turn images.

Token in, token out (laminar/agents/render.py): the first call of an attempt is rendered once and
its rendering, whatever it holds (a system message, the task wrapped in the agent's own words,
tools), becomes the sample's prompt (`seq.prompt_ids`; the partial header and the trajectory
carry it, and the buffer binds the sample to its group by identity, not by these tokens:
laminar/buffer/owners.py); a later call whose messages start with the episode's messages
(its assistant turns as this endpoint returned them) adds only its new messages' tokens (loss
mask 0, logprob 0.0) and the model's tokens are the engine's sampled ids (mask 1, behaviour
logprobs). A call whose messages do not extend the episode (the agent truncated or summarised
its history, changed its tools) starts a new run: the trained sample is the last consistent run
of calls, and the earlier runs' tokens are dropped and counted (`agent_history_rewrites`,
`agent_rewrite_tokens_dropped`). A later run keeps the attempt's first prompt (what its first
call rendered; `AgentEpisode.prompt_fixed`): a rewrite whose rendering starts with it (the
model's turns replayed in the agent's own words, a summary after the task) runs from it, the
rest of the rendering its context (loss mask 0, `agent_rewrite_context_tokens`); one whose
rendering starts elsewhere (a summary in place of the task) is refused (PROMPT_MISMATCH) and
the episode keeps the run it had. A new attempt (a retry from the prompt) renders its first
prompt afresh; a moved episode keeps the prompt its record holds. A call's new text is
length-checked (agent.max_text_chars) before it is tokenized, and tokenized in a worker thread
when long (`_tokenize`), so the loop that carries the rollout's heartbeats never stalls on an
agent's message. Why not one sample per run: a prompt's group has `rollout.group_size` samples
end to end (buffer, journal, advantages); extra samples would change what a group is. The last
run is the one that led to the reward.

A call over the context or the episode's token budget answers 400 (context_length_exceeded)
and marks the episode truncated (the lifecycle delivers it with finish_reason "length").

A moved episode's first call here (`_resume`, laminar/agents/resume.py) is matched against the
tokens recorded before the move: the answers before the move are kept, the call in flight
continues after its recorded tokens (or is answered from them when its turn was whole), at the
episode's version. An exported episode's call in flight answers 421 episode_moved, naming the
rollout the manager means to import it on (`moved_error`, `agent_moved_hinted`).
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import structlog

from laminar.agents.render import BadMessages, ChatRenderer, canonical, canonical_tools, image_urls
from laminar.agents.resume import match_record
from laminar.config import AgentConfig
from laminar.engines.base import Engine, SamplingParams, Structured
from laminar.metrics import Metrics
from laminar.protocol.data import ToolRecord
from laminar.rollout.agent_episode import AgentEpisode, EpisodeIndex, clear_episode
from laminar.rollout.agent_turns import (
    CallRefused,
    ChatTurn,
    Constraint,
    EpisodeMoved,
    Refusal,
    Sampling,
    TextTurn,
    TurnResult,
    TurnStream,
)
from laminar.rollout.deliver import Deliverer
from laminar.rollout.sequences import SequenceTable
from laminar.rollout.tracking import SeqState
from laminar.vision.images import BadImage, ImageData
from laminar.vision.turns import TurnImages

_T = TypeVar("_T")

THREAD_CHARS = 16384
"""New text longer than this is tokenized in a worker thread, off the event loop (a rollout whose
loop stalls stops beating and is declared dead)."""


class AgentCalls:
    """Serves each call of an agent episode as a model turn; the driver (agents.py) hands it the
    call's episode, the node's events loop the engine's tokens (`progressed`, `turn_ended`)."""

    def __init__(
        self,
        cfg: AgentConfig,
        *,
        max_total: int,
        max_prompt_tokens: int,
        renderer: ChatRenderer,
        params: SamplingParams,
        engine: Engine,
        table: SequenceTable,
        deliverer: Deliverer,
        live: EpisodeIndex,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        images: TurnImages | None = None,
    ):
        """`max_total`: response tokens per episode (model and agent together). `live`: the
        driver's episodes (agents.py). `images`: a vision-language policy's later-turn images
        (None: image parts refused)."""
        self.cfg, self.max_total, self.max_prompt_tokens = cfg, max_total, max_prompt_tokens
        self.images = images
        self.render, self.base_params = renderer, params
        self.engine, self.table, self.deliverer = engine, table, deliverer
        self.live, self.metrics, self.log = live, metrics, log
        self.streams: dict[str, TurnStream] = {}
        """Streamed calls generating now, by sample uid: the node's events loop hands their
        tokens on as the engine samples them (`progressed`)."""
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="agent-tokenize")
        """Large new text is tokenized here, one call at a time (a fast tokenizer is not safe to
        share between threads that tokenize at once)."""

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    # ---- from the node's events loop ----------------------------------------------------
    def owns(self, uid: str) -> bool:
        return uid in self.live.by_uid

    def progressed(self, seq: SeqState) -> None:
        """An engine event added tokens to `seq` (the node calls this while `streams` is not
        empty): a streamed call of it gets them now. Its final tokens come with the call's
        result."""
        st = self.streams.get(seq.uid)
        if st is None or seq.length <= st.upto:  # (below: the episode started again)
            return
        a, b = st.upto, seq.length
        st.push(seq.ids.view(a, b).copy(), seq.logprobs.view(a, b).copy())
        st.upto = seq.length

    def turn_ended(self, seq: SeqState, reason: str) -> None:
        """The engine finished a call's model turn (or gave up on it)."""
        ep = self.live.by_uid.get(seq.uid)
        # the partial pool learns the turn is whole: whoever resumes the episode answers the
        # repeated call from these tokens instead of generating after them
        seq.awaiting_env = reason in ("stop", "length")
        self.table.set_waiting(seq, True)
        self.table.mark_dirty(seq.uid)
        if ep is not None and ep.pending is not None and not ep.pending.done():
            ep.pending.set_result(reason)

    # ---- the driver's calls ---------------------------------------------------------------
    async def serve(
        self,
        ep: AgentEpisode,
        token: str,
        request: ChatTurn | TextTurn,
        stream: TurnStream | None = None,
    ) -> TurnResult:
        """One call of `ep` (authorized by the driver under `token`): a model turn after the
        request's new tokens. `stream`: a streamed call, whose tokens are pushed to it as the
        engine samples them; the call runs, is recorded and answers exactly as an unstreamed
        one."""
        if isinstance(request, ChatTurn):
            return await self._chat(ep, token, request, stream)
        return await self._text(ep, token, request, stream)

    async def _chat(
        self, ep: AgentEpisode, token: str, request: ChatTurn, stream: TurnStream | None
    ) -> TurnResult:
        structured = self._structured(request.constraints)
        messages, tools = request.messages, request.tools
        tools_on = tools is not None
        try:
            canon = [canonical(m) for m in messages]
        except BadMessages as exc:
            raise CallRefused(Refusal.BAD_MESSAGES, str(exc)) from None
        key = canonical_tools(tools)
        stops = self.render.stop_strings(tools_on)
        async with self._call(ep, token):
            n = len(ep.consumed) if ep.consumed is not None else -1
            extends = (
                ep.consumed is not None
                and key == ep.tools_key
                and canon[:n] == ep.consumed
                and len(canon) > n
            )
            chars = self._text_chars(canon[n:] if extends else canon)
            shown: list[str] = []
            try:
                if extends:
                    new = await self._tokenize(
                        chars, self.render.delta_ids, messages[n:], ep.after_eot
                    )
                    new, shown = await self._show_images(new, messages[n:])
                    prompt = None
                elif ep.recorded and image_urls(messages):
                    # a moved episode's history shows images, which a first call cannot: only
                    # its record can take it (rendered below if the record does not match)
                    new, prompt = [], None
                else:
                    new, prompt = (
                        [],
                        await self._tokenize(chars, self.render.first_ids, messages, tools),
                    )
            except BadMessages as exc:
                raise CallRefused(Refusal.BAD_MESSAGES, str(exc)) from None
            keep: int | None = None
            if ep.recorded:  # moved here: the call repeats or extends what the tokens hold
                ep.recorded = False
                got = self._resume(ep, messages, tools, tools_on, key)
                if got is None:
                    self.metrics.count("agent_resume_mismatch")
                    self.metrics.count("agent_rewrite_tokens_dropped", ep.seq.length)
                    clear_episode(ep, self.table)
                    if prompt is None and not extends:  # (its images: refused, a 400)
                        try:
                            prompt = self.render.first_ids(messages, tools)
                        except BadMessages as exc:
                            raise CallRefused(Refusal.BAD_MESSAGES, str(exc)) from None
                else:
                    self.metrics.count("agent_calls_resumed")
                    (new, keep, urls), prompt = got, None
                    # the call's own new messages' images (expanded in `new`): to the owner first
                    shown = [i.digest for i in await self._publish(urls)]
                    kept = 0 if keep is None else ep.seq.length - keep
                    self.metrics.count("agent_resume_kept_tokens", kept)
                    recorded = ep.seq.ids.view(0, ep.seq.length)
                    self.log.info(
                        "agent_call_resumed",
                        uid=ep.seq.uid,
                        calls_before=ep.calls,
                        recorded=len(recorded),
                        recorded_crc32=zlib.crc32(recorded.astype(np.int32).tobytes()),
                        kept=kept,
                    )
            if prompt is not None:
                new = self._new_run(ep, prompt)
                ep.tools_key = key
            reason, ids, lps = await self._generate(
                ep, token, new, request.sampling, stops, keep, structured, stream, shown
            )
            text = self.render.decode(ids.tolist())
            msg, called = self.render.assistant_message(text, tools_on, ep.seq.uid, ep.seq.turn)
            ep.consumed = canon + [canonical(msg)]
            ep.seq.tool_calls += tool_records(msg, ep.seq.turn)
        return self._result(ep, reason, ids, lps, text, msg, called)

    async def _text(
        self, ep: AgentEpisode, token: str, request: TextTurn, stream: TurnStream | None
    ) -> TurnResult:
        prompt = request.prompt
        async with self._call(ep, token):
            if ep.recorded:  # moved here: text turns are not matched, a new run starts
                ep.recorded = False
                self.metrics.count("agent_resume_mismatch")
                self.metrics.count("agent_rewrite_tokens_dropped", ep.seq.length)
                clear_episode(ep, self.table)
            if ep.text is not None and prompt.startswith(ep.text) and len(prompt) > len(ep.text):
                added = prompt[len(ep.text) :]
                new = await self._tokenize(self._text_chars([added]), self.render.encode, added)
            else:
                new = []
                text_ids = await self._tokenize(
                    self._text_chars([prompt]), self.render.encode, prompt
                )
                new = self._new_run(ep, self.render.bos + text_ids)
            reason, ids, lps = await self._generate(
                ep, token, new, request.sampling, (), stream=stream
            )
            text = self.render.decode(ids.tolist())
            ep.text = prompt + text
        return self._result(ep, reason, ids, lps, text)

    def _structured(self, constraints: tuple[Constraint, ...]) -> Structured | None:
        """The call's constraints as the engine enforces them, or a refusal (400) naming the
        field and the engine: a constraint silently ignored fails the agent's own parser."""
        engine, out = self.engine.name, None
        for c in constraints:
            if c.field == "response_format" and c.kind in self.engine.structured:
                out = Structured(c.kind, c.schema)
                continue
            if c.field == "response_format":
                why = (
                    f"`response_format` {c.kind} is not supported by the {engine} engine: it "
                    "does not constrain decoding (rollout.engine: vllm enforces json_object and "
                    "json_schema through vLLM's structured outputs); ask for JSON in the prompt"
                )
            else:
                asked = "required" if c.kind == "required" else f"function {c.name!r}"
                why = (
                    f"`tool_choice` {asked} is not supported by the {engine} engine: a tool call "
                    "is text in the chat template's format, which no engine here constrains; "
                    'use tool_choice "auto" (the model may call the tools) or "none"'
                )
            raise CallRefused(Refusal.UNSUPPORTED, why, param=c.field)
        return out

    @staticmethod
    def _result(
        ep: AgentEpisode,
        reason: str,
        ids: np.ndarray,
        lps: np.ndarray,
        text: str,
        message: dict[str, Any] | None = None,
        tool_called: bool = False,
    ) -> TurnResult:
        seq = ep.seq
        return TurnResult(
            turn_id=AgentCalls._turn_id(ep),
            ids=ids,
            logprobs=lps,
            text=text,
            reason=reason,
            prompt_tokens=len(seq.prompt_ids) + seq.turn_start,
            message=message,
            tool_called=tool_called,
        )

    @staticmethod
    def _turn_id(ep: AgentEpisode) -> str:
        """<sample uid>-<attempt>-<turn>: unique per turn of a sample."""
        return f"{ep.seq.uid}-{ep.attempt}-{ep.seq.turn}"

    def _call(self, ep: AgentEpisode, token: str) -> _OneCall:
        if ep.busy:
            raise CallRefused(
                Refusal.IN_FLIGHT,
                "a call of this episode is in flight: an episode's calls go one "
                "at a time (its token sequence is one line)",
            )
        if ep.calls >= self.cfg.max_calls:
            raise CallRefused(
                Refusal.MAX_CALLS,
                f"the episode made agent.max_calls ({self.cfg.max_calls}) calls already",
            )
        return _OneCall(ep)

    def _text_chars(self, texts: list[str]) -> int:
        """Characters of a call's new text, refused past agent.max_text_chars before anything
        is tokenized (a 2M-character message would hold the loop for seconds)."""
        chars = sum(map(len, texts))
        if chars > self.cfg.max_text_chars:
            raise CallRefused(
                Refusal.TEXT_TOO_LONG,
                f"the call brings {chars} characters of new text; at most "
                f"{self.cfg.max_text_chars} (agent.max_text_chars)",
            )
        return chars

    async def _tokenize(self, chars: int, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)`, in the tokenizing thread when the text is long (the loop keeps beating)."""
        if chars <= THREAD_CHARS:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizing, fn, *args)

    def _new_run(self, ep: AgentEpisode, prompt: list[int]) -> list[int]:
        """A call that does not extend the episode starts a run from `prompt` (its whole
        conversation rendered). The sample keeps one prompt: the attempt's first call's. A
        rewritten history whose rendering starts with that prompt's tokens (the agent replays
        the model's turns in its own words, as smolagents does, or summarises after the task)
        runs from it, the rest of its rendering returned as context (loss mask 0); one that
        starts elsewhere is refused (PROMPT_MISMATCH)."""
        seq = ep.seq
        first = seq.prompt_ids
        rest: list[int] = []
        if ep.prompt_fixed and (len(prompt) != len(first) or not np.array_equal(prompt, first)):
            n = len(first)
            if len(prompt) <= n or not np.array_equal(prompt[:n], first):
                # a sample has one prompt: a run that starts elsewhere would train another sample
                raise CallRefused(
                    Refusal.PROMPT_MISMATCH,
                    f"the conversation renders to a prompt ({len(prompt)} tokens) that does not "
                    f"start with this episode's ({n} tokens: what its first call rendered): a "
                    "rewritten history must keep the first call's messages (system message and "
                    "task included) and tools, and add to them",
                )
            prompt, rest = prompt[:n], prompt[n:]
        if len(prompt) > self.max_prompt_tokens:
            ep.truncated = True
            raise CallRefused(
                Refusal.TOO_LONG,
                f"the conversation is {len(prompt)} tokens; this model's "
                f"prompts hold at most {self.max_prompt_tokens} "
                "(data.max_prompt_tokens)",
            )
        if ep.consumed is not None or ep.text is not None:  # the agent rewrote its history
            self.metrics.count("agent_history_rewrites")
            self.metrics.count("agent_rewrite_tokens_dropped", seq.length)
            clear_episode(ep, self.table)
        if rest:
            self.metrics.count("agent_rewrite_context_tokens", len(rest))
        seq.prompt_ids = np.asarray(prompt, np.int32)
        seq.image_digests = []  # the agent's rendering holds no image (first calls refuse them)
        ep.prompt_fixed = True
        seq.sent_upto = 0
        self.table.mark_dirty(seq.uid)  # the header (with this prompt) restarts the record
        return rest

    async def _generate(
        self,
        ep: AgentEpisode,
        token: str,
        new: list[int],
        params: Sampling,
        stops: tuple[str, ...],
        keep: int | None = None,
        structured: Structured | None = None,
        stream: TurnStream | None = None,
        shown: list[str] | None = None,
    ) -> tuple[str, np.ndarray, np.ndarray]:
        """Run one call's model turn. `keep`: a resumed call, whose turn began at that response
        index with tokens recorded before the move (generation continues after them; a turn the
        record says was whole is answered from it). `stream`: gets the turn's tokens as they
        come (a resumed call's recorded ones at once). `shown`: digests of the images `new`
        shows (their owner holds them)."""
        seq = ep.seq
        if keep is not None and keep < seq.length and seq.awaiting_env:
            return self._answered(ep, "stop", keep)
        if seq.length + len(new) >= self.max_total:
            ep.truncated = True
            raise CallRefused(
                Refusal.TOO_LONG,
                f"the episode would hold {seq.length + len(new)} response tokens; "
                f"at most {self.max_total} (env.limits.max_total_tokens or "
                "rollout.sampling.max_tokens)",
            )
        if not self.table.interrupts and self.engine.version != seq.version:
            # (mode partial: a call runs at the engine's version, its tokens recorded as such)
            raise RuntimeError(
                f"{seq.uid}: agent episode at version {seq.version} would run on an engine at "
                f"version {self.engine.version}"
            )
        if new:
            if shown:  # a fresh list: headers already sent keep theirs
                seq.image_digests = [*seq.image_digests, *shown]
                seq.sent_upto = 0  # the partial record restarts with a header that names them
                self.metrics.count("turn_images", len(shown))
            seq.append_env(np.asarray(new, np.int32))
            self.metrics.count("agent_input_tokens", len(new))
            seq.turn += 1
        seq.turn_start = seq.length if keep is None else keep
        sp = self.base_params
        if params.temperature is not None or params.top_p is not None:
            if self.cfg.honor_sampling:
                sp = replace(
                    sp,
                    temperature=sp.temperature
                    if params.temperature is None
                    else params.temperature,
                    top_p=sp.top_p if params.top_p is None else params.top_p,
                )
            elif (params.temperature, params.top_p) != (sp.temperature, sp.top_p):
                self.metrics.count("agent_sampling_ignored")
        cap = self.max_total
        if params.max_tokens is not None:
            cap = min(cap, seq.turn_start + params.max_tokens)
        extra = tuple(s for s in (*params.stop, *stops) if s not in sp.stop)
        sp = replace(sp, max_tokens=cap, stop=tuple(sp.stop) + extra, structured=structured)
        ep.pending = asyncio.get_running_loop().create_future()
        seq.awaiting_env = False
        self.table.set_waiting(seq, False)
        self.table.mark_dirty(seq.uid)
        t0 = time.monotonic()
        if stream is not None:
            stream.upto, stream.turn_id = seq.turn_start, self._turn_id(ep)
            self.streams[seq.uid] = stream
            self.progressed(seq)  # a resumed call's tokens recorded before the move
        self.table.submit_turn(seq, sp)  # mode partial: at the engine's version, after a swap
        left = self.cfg.episode_timeout_s - (time.monotonic() - ep.t_attempt)
        try:
            reason = await asyncio.wait_for(asyncio.shield(ep.pending), max(left, 0.001))
        except TimeoutError:
            raise CallRefused(Refusal.TIME_UP, "the episode's time is up") from None
        finally:
            ep.pending = None
            if stream is not None:
                self.streams.pop(seq.uid, None)
        if reason == "moved":
            raise self.moved_error(token)
        if not self.live.current(ep, token) or reason not in ("stop", "length"):
            raise CallRefused(Refusal.ENDED, f"the episode ended or started again ({reason})")
        # the turn goes to the partial pool before the agent sees it, so a resume elsewhere finds
        # every answer the agent holds (else its repeated call cannot match: a new run, counted)
        await self.deliverer.flush_partials()
        call_s = time.monotonic() - t0
        self.metrics.add("agent_call_s", call_s)
        self.metrics.count("agent_call_ms", round(call_s * 1000))
        return self._answered(ep, reason, seq.turn_start)

    def _answered(
        self, ep: AgentEpisode, reason: str, start: int
    ) -> tuple[str, np.ndarray, np.ndarray]:
        seq = ep.seq
        seq.turn_start = start
        ep.calls += 1
        self.metrics.count("agent_calls")
        ids = seq.ids.view(seq.turn_start, seq.length).copy()
        lps = seq.logprobs.view(seq.turn_start, seq.length).copy()
        ep.after_eot = self.render.turns.ended_with_eot(ids.tolist())
        return reason, ids, lps

    def _resume(
        self,
        ep: AgentEpisode,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        tools_on: bool,
        key: str,
    ) -> tuple[list[int], int | None, list[str]] | None:
        """The first call of an episode moved here, against the tokens recorded before the move
        (laminar/agents/resume.py). On a match the episode's state is set as if its calls had
        run here; returns (new tokens still to append, where the call's model turn began when
        the record holds it, the image URLs those new tokens show), or None (the caller starts
        a new run)."""
        seq = ep.seq
        assert seq.mask is not None
        got = match_record(
            self.render,
            seq.uid,
            seq.prompt_ids,
            seq.ids.copy(),
            seq.mask.copy(),
            messages,
            tools,
            tools_on,
            expand=None if self.images is None else self._expand,
        )
        if got is None:
            return None
        ep.tools_key, ep.calls, ep.after_eot, seq.turn = key, got.calls, got.after_eot, got.turn
        # the calls the agent's answers made (the record holds their tokens, not the calls)
        answers = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
        seq.tool_calls = [r for k, m in enumerate(answers) for r in tool_records(m, k)]
        return got.new, got.keep, got.new_images

    # ---- images in later calls (laminar/vision/turns.py) -----------------------------------
    def _load(self, urls: list[str]) -> list[ImageData]:
        """An agent's images: data: URIs only (an agent's text never reads this host's files);
        raises BadImage."""
        assert self.images is not None
        for u in urls:
            if not u.startswith("data:"):
                raise BadImage("an agent's image must be a data: URI (nothing is fetched or read)")
        return self.images.load(urls)

    def _expand(self, ids: list[int], messages: list[dict[str, Any]]) -> list[int]:
        """`ids` rendered from `messages`, each image placeholder expanded as the processor does
        (what the recorded tokens hold); raises BadImage."""
        assert self.images is not None
        return self.images.expand(ids, self.images.token_counts(self._load(image_urls(messages))))

    async def _show_images(
        self, ids: list[int], messages: list[dict[str, Any]]
    ) -> tuple[list[int], list[str]]:
        """A call's new tokens (rendered from `messages`) with their images' placeholders
        expanded as the processor does, the images sent to their owner (the buffer) once; and
        their digests."""
        if self.images is None:  # the renderer refused image parts already
            return ids, []
        imgs = await self._publish(image_urls(messages))
        try:
            ids = self.images.expand(ids, self.images.token_counts(imgs))
        except BadImage as exc:
            self.metrics.count("agent_bad_images")
            raise CallRefused(Refusal.BAD_MESSAGES, f"image: {exc}") from None
        return ids, [i.digest for i in imgs]

    async def _publish(self, urls: list[str]) -> list[ImageData]:
        """Load and check images, then send them to their owner once. Refused (400
        bad_messages, counted `agent_bad_images`) when an image is bad or cannot be stored."""
        if not urls or self.images is None:
            return []
        try:
            imgs = await asyncio.to_thread(self._load, urls)
            await self.images.publish(imgs)
        except Exception as exc:  # the agent's image, or the buffer refused / did not answer
            self.metrics.count("agent_bad_images")
            raise CallRefused(Refusal.BAD_MESSAGES, f"image: {exc}") from None
        return imgs

    def moved_error(self, token: str) -> EpisodeMoved:
        """An exported episode's call; it names the rollout meant to import it, when known
        (counted: `agent_moved_hinted`)."""
        dest = self.live.moved[token][1] if token in self.live.moved else ""
        if dest:
            self.metrics.count("agent_moved_hinted")
        return EpisodeMoved(dest)


class _OneCall:
    """An episode's calls go one at a time."""

    def __init__(self, ep: AgentEpisode):
        self.ep = ep

    async def __aenter__(self) -> None:
        self.ep.busy = True

    async def __aexit__(self, *exc: Any) -> None:
        self.ep.busy = False
        self.ep.t_seen = time.monotonic()  # its agent has the answer: its idle clock restarts


def tool_records(message: Any, turn: int) -> list[ToolRecord]:
    """The tool calls of one assistant message as the trajectory records them (the episode's
    `episode/tool_calls`, `reward_by_tool_calls/*`). The agent runs its tools: the endpoint sees
    the calls, not their results or time, so each is `ok` with `seconds` NaN (tool/latency_* stay
    null and tool/error_rate 0 for agent episodes)."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    out: list[ToolRecord] = []
    for k, c in enumerate(calls if isinstance(calls, list) else []):
        fn = c.get("function") if isinstance(c, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        call_id = c.get("id") if isinstance(c, dict) else None
        out.append(
            ToolRecord(
                call_id=str(call_id or f"{turn}#{k}"),
                name=str(name or ""),
                turn=turn,
                seconds=math.nan,
            )
        )
    return out
