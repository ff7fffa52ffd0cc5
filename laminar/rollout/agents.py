"""Black-box agents on a rollout: each episode's lifecycle, and each of its calls as a turn.

    feeder ──start_group──► SequenceTable ──on_start(seqs)──► AgentDriver.start: one episode per
                                                              sample, waiting, with a secret token
    [agent worker process] run(row, AsyncOpenAI(base_url=endpoint, api_key=token))
        │ POST /v1/chat/completions ──► openai_api.py ──parse (openai_shapes.py)──►
        │     driver.turn(token, ChatTurn | TextTurn): messages -> new tokens (mask 0) ->
        │     GenRequest(version=the episode's; mode partial: the engine's, per-token versions
        │     kept) -> engine -> turn_ended -> TurnResult ──► openai_shapes.py: the reply
        │     (stream: true: each engine event's tokens also go to the call's TurnStream,
        │     `progressed`, as the node's events loop sees them; the TurnResult is the same)
        └─ returns the reward ──► driver: deliver (reward.fn on the transcript when None);
           raises / times out / its worker dies ──► the episode starts again from its prompt
           (under agent.retries; then delivered without a reward)

Built by the rollout node when `agent.fn` (or `agent.remote`) is set; the HTTP layer
(openai_api.py) and the worker pool are its only callers besides the node's hooks. It knows no
HTTP: its turns are typed (agent_turns.py), and a call it refuses raises EpisodeUnknown,
EpisodeMoved (with the rollout it went to) or CallRefused (a Refusal), which openai_shapes.py
turns into a status and an OpenAI error body.

One version per trajectory: a sample is one episode; its calls all generate at the version it
started on (the table is non-empty while the episode lives, so the rollout loads no weights
under it), and each call goes into the engine as a resume of the episode's exact token sequence,
like a turn of an in-process Environment (laminar/rollout/episodes.py).

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

Rewards: what the buffer would refuse (not a finite number in reward.min_value..max_value)
is refused at a remote close (BAD_REWARD, the episode stays open) and, returned by an in-process
agent, delivered as a failed reward (`agent_bad_reward`); components are coerced to what the wire
carries (laminar/rewards/runner.py).

Failures: the agent's code raising, its worker dying (kill -9), passing agent.episode_timeout_s
or, once it claimed or called the episode, leaving it without a call or close for
agent.idle_timeout_s (`agent_failure_idle`, counted `idle_expired`) fail the attempt
(`agent_failures`, `agent_failure_<kind>`); the episode's tokens are thrown away (the partial
record restarts at offset 0), its token revoked (a late call of the old
attempt gets 401) and it starts again from its prompt at the same version (`agent_retries`),
at most agent.retries times; then it is delivered without a reward (`agent_gave_up`), so its
group still completes and the sample is never trained. A sample is delivered once, whatever
the attempts.

Preempted (`preempt_idle`, agent.preempt_idle_s): while the rollout waits to load newer weights
and only agent episodes hold the loaded version, one whose agent is silent is ended, its token
answering 409 episode_preempted, and its sample parked in the table (no tokens, no version)
until the load is done; then it starts again from its prompt at the new version (`unparked`),
not counted against agent.retries.

A call over the context or the episode's token budget answers 400
(context_length_exceeded) and marks the episode truncated: when the agent ends (or raises),
the sample is delivered with finish_reason "length" and reward.fn scores it.

Moves (repack, a dead rollout's recovery): the agent follows its episode. The episode's token
travels in its partial (`SeqState.agent_token` -> PartialTrajectory.agent_token), and each
call's turn is flushed to the partial pool before the answer goes out. Exported here
(`release`): the episode's calls answer 421 episode_moved (a call in flight too), naming the
rollout the manager means to import it on (header `Laminar-Moved-To`, from ExportRequest.dest;
`agent_moved_hinted`), so the client asks there first instead of every rollout. Imported here
(`adopt`): the episode waits for its agent (`_await_agent`, like a remote one); the agent's
client (laminar/agents/failover.py) repeats its call here, and `_resume` matches it against the
recorded tokens: the answers before the move are kept, the call in flight continues after its
recorded tokens (or is answered from them when its turn was whole), at the episode's version.
No agent within agent.reconnect_timeout_s (`agent_failure_lost`), or a partial without a token
(restarted from its prompt by the manager: its version is gone): it starts again from its
prompt here, run by this rollout's workers (`agent_restarted_on_import`).
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
import zlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import structlog

from laminar.agents.render import BadMessages, ChatRenderer, canonical, canonical_tools, image_urls
from laminar.agents.resume import match_record
from laminar.config import AgentConfig
from laminar.engines.base import Engine, SamplingParams, Structured
from laminar.metrics import Metrics
from laminar.protocol.data import ToolRecord
from laminar.rewards.runner import RewardFormatError, RewardResult, normalize_reward
from laminar.rollout.agent_pool import AgentPool, release_shared, shared_pool
from laminar.rollout.agent_turns import (
    CallRefused,
    ChatTurn,
    Constraint,
    EpisodeClaim,
    EpisodeMoved,
    EpisodeUnknown,
    Refusal,
    Sampling,
    TextTurn,
    TurnResult,
    TurnStream,
)
from laminar.rollout.deliver import Deliverer
from laminar.rollout.sequences import SequenceTable
from laminar.rollout.tracking import Growable, SeqState
from laminar.subprocess_pool import WorkerLost, WorkerTimeout
from laminar.supervise import Spawn
from laminar.vision.images import BadImage, ImageData
from laminar.vision.turns import TurnImages


@dataclass
class AgentEpisode:
    seq: SeqState
    token: str
    first_prompt: np.ndarray
    """The prompt ids the sample reverts to when it starts again (served: the row's rendering;
    moved here: the prompt its record holds)."""
    attempt: int = 0
    prompt_fixed: bool = False
    """The attempt's first call rendered `seq.prompt_ids`: a later run (a rewritten history, a
    resume that does not match) must render to exactly it (False: the next call's rendering,
    whatever it holds, becomes the sample's prompt)."""
    consumed: list[str] | None = None
    """Canonical messages the episode's tokens hold (None: no call yet in this run)."""
    text: str | None = None
    """Text turns: the text the episode's tokens hold (prompt + completions)."""
    tools_key: str = ""
    after_eot: bool = False
    calls: int = 0
    busy: bool = False
    truncated: bool = False
    pending: asyncio.Future[str] | None = None
    outcome: asyncio.Future[tuple[bool, Any]] | None = None
    """Remote agents and moved episodes: (ok, reward or error text), set by the close call."""
    t_attempt: float = field(default_factory=time.monotonic)
    recorded: bool = False
    """Moved here with tokens its agent's next call must be matched against (`_resume`)."""
    touched: bool = False
    """Its agent called or closed it on this rollout since it moved here."""
    t_seen: float | None = None
    """When its agent last claimed, called or closed it (None: not yet): past
    agent.idle_timeout_s of silence the attempt fails (`_await_agent`)."""


@dataclass
class AgentSettings:
    cfg: AgentConfig
    max_total: int
    """Response tokens per episode (model and agent together)."""
    max_prompt_tokens: int
    remote_key: str = ""
    """Secret that claims remote episodes (empty: remote claims refused)."""
    endpoints_dir: str = ""
    """Where each rollout writes its endpoint's URL (run_dir/agents/endpoints): an agent worker's
    client looks there for the rollout that holds its episode after a move (empty: nowhere)."""
    node_id: str = ""
    reward_min: float = -math.inf
    reward_max: float = math.inf
    """reward.min_value..max_value: a reward outside is refused at close (the buffer would)."""


_T = TypeVar("_T")

THREAD_CHARS = 16384
"""New text longer than this is tokenized in a worker thread, off the event loop (a rollout whose
loop stalls stops beating and is declared dead)."""


class AgentDriver:
    def __init__(
        self,
        settings: AgentSettings,
        *,
        renderer: ChatRenderer,
        params: SamplingParams,
        engine: Engine,
        table: SequenceTable,
        deliverer: Deliverer,
        spawn: Spawn,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        images: TurnImages | None = None,
    ):
        """`images`: a vision-language policy's later-turn images (None: image parts refused)."""
        self.s, self.cfg = settings, settings.cfg
        self.images = images
        self.render, self.base_params = renderer, params
        self.engine, self.table, self.deliverer = engine, table, deliverer
        self.spawn, self.metrics, self.log = spawn, metrics, log
        self.by_uid: dict[str, AgentEpisode] = {}
        self.by_token: dict[str, AgentEpisode] = {}
        self.claims: asyncio.Queue[tuple[AgentEpisode, str]] = asyncio.Queue()
        """Remote episodes offered to claims, with the attempt's token (an entry of an attempt
        that ended meanwhile is skipped: an episode is never handed out twice)."""
        self.pool: AgentPool | None = None
        self.preempted: dict[str, None] = {}
        """Tokens of attempts preempted for a weight load (bounded, oldest dropped): their calls
        answer 409 episode_preempted rather than 401."""
        self.moved: dict[str, tuple[float, str]] = {}
        """Tokens of episodes exported from here (their calls answer 421 episode_moved), with
        when and the rollout the manager meant to import them on ("" unknown); forgotten after
        agent.reconnect_timeout_s."""
        self.base_url = ""
        """Set once the HTTP server listens (http://host:port/v1)."""
        self.delivered = 0
        self.streams: dict[str, TurnStream] = {}
        """Streamed calls generating now, by sample uid: the node's events loop hands their
        tokens on as the engine samples them (`progressed`)."""
        self.counts: Counter[str] = Counter()
        """idle_expired, episodes_preempted, agent_failures, agent_gave_up: beside the endpoint's
        refusals in the
        rollout's status (OpenAIEndpoint.figures)."""
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="agent-tokenize")
        """Large new text is tokenized here, one call at a time (a fast tokenizer is not safe to
        share between threads that tokenize at once)."""

    # ---- lifecycle -----------------------------------------------------------------------
    async def start_workers(self, base_url: str) -> None:
        self.base_url = base_url
        if self.s.endpoints_dir:  # agents of a moved episode find this endpoint here
            d = Path(self.s.endpoints_dir)
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{self.s.node_id}.tmp"
            tmp.write_text(base_url)
            tmp.replace(d / self.s.node_id)
        if not self.cfg.fn:
            return
        sizes = {"workers": self.cfg.workers, "concurrency": self.cfg.concurrency}
        if self.cfg.shared_workers:  # one pool for every rollout of this process
            self.pool = await shared_pool(
                self.cfg.fn, **sizes, hello_timeout_s=self.cfg.startup_timeout_s, log=self.log
            )
            return
        self.pool = AgentPool(
            self.cfg.fn,
            **sizes,
            hello_timeout_s=self.cfg.startup_timeout_s,
            spawn=self.spawn,
            log=self.log,
        )
        await self.pool.start()

    async def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        if self.s.endpoints_dir:
            (Path(self.s.endpoints_dir) / self.s.node_id).unlink(missing_ok=True)
        if self.pool is not None:
            pool = self.pool
            await (release_shared(pool) if self.cfg.shared_workers else pool.close())

    # ---- from the table (feeder) and the node -------------------------------------------------
    def start(self, seqs: list[SeqState]) -> None:
        """Fresh samples: each an episode waiting for its agent's first call."""
        for seq in seqs:
            self.table.set_waiting(seq, True)
            ep = AgentEpisode(seq, "", seq.prompt_ids.copy())
            self.by_uid[seq.uid] = ep
            self._launch(ep)

    def adopt(self, seq: SeqState) -> None:
        """An imported agent partial (a repack move, or its rollout died). With its episode token
        (the partial carries it) the episode goes on here: its agent, wherever it runs, finds this
        rollout after a 421 or a dropped connection and repeats its call, which resumes from the
        recorded tokens (`_resume`). If the agent neither calls nor closes it within
        agent.reconnect_timeout_s, the attempt fails (`agent_failure_lost`) and the episode starts
        again from its prompt, run by this rollout. Without a token (recovered from its prompt, no
        record of it) it starts again from its prompt at once."""
        ep = AgentEpisode(seq, "", seq.prompt_ids.copy())
        self.by_uid[seq.uid] = ep
        token = seq.agent_token
        if not token:
            self.metrics.count("agent_restarted_on_import")
            self._clear(ep)
            self._launch(ep)
            return
        self.metrics.count("agent_moved_in")
        self.moved.pop(token, None)
        ep.token, ep.recorded = token, seq.length > 0
        ep.prompt_fixed = ep.recorded  # its calls rendered the record's prompt: later runs keep it
        self.by_token[token] = ep
        self.table.set_waiting(seq, True)
        self.spawn(self._await_agent(ep, token, self.cfg.reconnect_timeout_s), "agent-episode")

    def release(self, uids: list[str], dest: str = "") -> None:
        """These episodes were exported (a repack move): their agents go on with the rollout that
        imports them. A call in flight here answers 421 `episode_moved` (so do later ones), and the
        agent's client repeats it there. `dest`: the rollout the manager means to import them on
        (ExportRequest.dest; placement may still choose another): the 421 names it in its
        `Laminar-Moved-To` header, so the client asks there first instead of every rollout."""
        now = time.monotonic()
        for tok, (t, _) in list(self.moved.items()):
            if now - t > self.cfg.reconnect_timeout_s:
                del self.moved[tok]
        if dest == self.s.node_id:
            dest = ""
        for uid in uids:
            ep = self.by_uid.pop(uid, None)
            if ep is None:
                continue
            self.by_token.pop(ep.token, None)
            self.moved[ep.token] = (now, dest)
            self.metrics.count("agent_moved_out")
            if ep.pending is not None and not ep.pending.done():
                ep.pending.set_result("moved")

    def owns(self, uid: str) -> bool:
        return uid in self.by_uid

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
        ep = self.by_uid.get(seq.uid)
        # the partial pool learns the turn is whole: whoever resumes the episode answers the
        # repeated call from these tokens instead of generating after them
        seq.awaiting_env = reason in ("stop", "length")
        self.table.set_waiting(seq, True)
        self.table.mark_dirty(seq.uid)
        if ep is not None and ep.pending is not None and not ep.pending.done():
            ep.pending.set_result(reason)

    # ---- attempts --------------------------------------------------------------------------
    def _launch(self, ep: AgentEpisode) -> None:
        ep.token = "lmn-" + secrets.token_urlsafe(24)
        ep.prompt_fixed = False  # a new attempt: its first call renders the prompt afresh
        ep.seq.agent_token = ep.token  # the partial carries it (a move resumes the episode)
        self.by_token[ep.token] = ep
        ep.t_attempt, ep.t_seen = time.monotonic(), None  # idle only once claimed or called
        self.spawn(self._attempt(ep, ep.token), "agent-episode")

    def _current(self, ep: AgentEpisode, token: str) -> bool:
        return self.by_token.get(token) is ep and self.by_uid.get(ep.seq.uid) is ep

    async def _await_agent(self, ep: AgentEpisode, token: str, first_s: float) -> None:
        """The episode's agent is not ours to run (remote, or it moved here): wait for its close.
        Within `first_s` the agent must have called or closed it here, else it is lost; once it
        claimed or called it, agent.idle_timeout_s without a call or close (none in flight) and
        the attempt fails as idle, so a silent agent pins the rollout's weights that long at
        most, not the whole agent.episode_timeout_s."""
        ep.outcome = asyncio.get_running_loop().create_future()
        ep.t_attempt = time.monotonic()
        total, idle = self.cfg.episode_timeout_s, self.cfg.idle_timeout_s
        while not ep.outcome.done():
            now = time.monotonic()
            if now >= ep.t_attempt + total:
                ok, out = False, ("timeout", f"no close within {total:g}s")
                break
            if not ep.touched and now >= ep.t_attempt + first_s:
                ok, out = False, ("lost", f"its agent did not call or close it within {first_s:g}s")
                break
            if ep.t_seen is not None and not ep.busy and now >= ep.t_seen + idle:
                self.counts["idle_expired"] += 1
                ok, out = False, ("idle", f"its agent neither called nor closed it for {idle:g}s")
                break
            # re-checked at least every idle_timeout_s: a call ending moves the idle deadline
            end = min(ep.t_attempt + total, now + idle)
            if not ep.touched:
                end = min(end, ep.t_attempt + first_s)
            if ep.t_seen is not None and not ep.busy:
                end = min(end, ep.t_seen + idle)
            await asyncio.wait([ep.outcome], timeout=max(end - now, 0.001))
        else:
            ok, out = ep.outcome.result()
        if not self._current(ep, token):
            return
        if not ok and out[0] == "preempted":
            await self._park(ep)
            return
        await (self._returned(ep, out) if ok else self._failed(ep, *out))

    async def _attempt(self, ep: AgentEpisode, token: str) -> None:
        if self.pool is None:  # remote agents claim it
            self.claims.put_nowait((ep, token))
            ep.touched = True
            await self._await_agent(ep, token, self.cfg.episode_timeout_s)
            return
        request = {
            "base_url": self.base_url,
            "api_key": token,
            "row": self._row(ep.seq),
            "kwargs": self.cfg.kwargs,
            "timeout_s": self.cfg.episode_timeout_s,
            "endpoints_dir": self.s.endpoints_dir,
            "reconnect_s": self.cfg.reconnect_timeout_s,
        }
        try:
            reply = await self.pool.run(request, self.cfg.episode_timeout_s)
        except WorkerLost as exc:
            kind = "timeout" if isinstance(exc, WorkerTimeout) else "worker_died"
            if self._current(ep, token):
                await self._failed(ep, kind, str(exc))
            return
        if not self._current(ep, token):
            return
        if reply.get("ok"):
            await self._returned(ep, reply.get("reward"))
        else:
            await self._failed(ep, "exception", str(reply.get("error", "?")))

    @staticmethod
    def _row(seq: SeqState) -> dict[str, Any]:
        row = dict(seq.row)
        row.setdefault("prompt", seq.prompt)
        row.setdefault("uid", seq.prompt_uid)
        return row

    async def _returned(self, ep: AgentEpisode, reward: Any) -> None:
        """The agent's run returned `reward`: deliver the sample."""
        await self._stop_generating(ep)
        try:
            score = self._score(reward)
        except Exception as exc:  # the agent's return value is user data
            self.metrics.count("agent_bad_reward")
            score = RewardResult.failure("format", f"agent reward: {exc}")
        if ep.seq.length == 0:
            self.metrics.count("agent_no_calls")
            score = RewardResult.failure("agent", "the agent made no model call")
            self._finish(ep, "error", score)
            return
        self._finish(ep, "length" if ep.truncated else "stop", score)

    async def _failed(self, ep: AgentEpisode, kind: str, why: str) -> None:
        await self._stop_generating(ep)
        if ep.truncated and ep.seq.length:
            # it ran out of tokens and its agent raised on the refusal: an episode's end, not a
            # failure; its transcript is scored
            self.metrics.count("agent_raised_truncated")
            self._finish(ep, "length", None)
            return
        self.metrics.count("agent_failures")
        self.metrics.count(f"agent_failure_{kind}")
        self.counts["agent_failures"] += 1
        self.log.warning(
            "agent_failed", uid=ep.seq.uid, kind=kind, attempt=ep.attempt, error=why[:300]
        )
        if ep.attempt >= self.cfg.retries:
            self.metrics.count("agent_gave_up")
            self.counts["agent_gave_up"] += 1
            self._finish(ep, "error", RewardResult.failure("agent", f"{kind}: {why}"))
            return
        self.metrics.count("agent_retries")
        ep.attempt += 1
        self._clear(ep)
        self._launch(ep)

    async def _stop_generating(self, ep: AgentEpisode) -> None:
        """Revoke the attempt's token; a call of it in the engine is aborted."""
        self.by_token.pop(ep.token, None)
        seq = ep.seq
        if ep.pending is not None and not ep.pending.done():
            ep.pending.set_result("abort")
        if not seq.waiting and self.table.seqs.get(seq.uid) is seq:
            seq.exporting = True  # its abort event is ours (the node's events loop skips it)
            await self.engine.abort([seq.uid])
            seq.exporting = False
            self.table.set_waiting(seq, True)

    def _clear(self, ep: AgentEpisode) -> None:
        """Back to `first_prompt` with no tokens; the partial record restarts at offset 0."""
        seq = ep.seq
        seq.ids, seq.logprobs = Growable(np.int32), Growable(np.float32)
        seq.mask = Growable(np.uint8)
        seq.routes = None  # a new attempt: its prefill records them again
        seq.prompt_ids = ep.first_prompt.copy()
        seq.image_digests = []  # the agent's images came with its calls: gone with their tokens
        seq.sent_upto, seq.turn, seq.turn_start, seq.awaiting_env = 0, 0, 0, False
        seq.tool_calls = []
        ep.consumed, ep.text, ep.tools_key = None, None, ""
        ep.after_eot, ep.calls, ep.truncated, ep.recorded = False, 0, False, False
        self.table.mark_dirty(seq.uid)

    def _finish(self, ep: AgentEpisode, reason: str, score: RewardResult | None) -> None:
        seq = ep.seq
        self.by_uid.pop(seq.uid, None)
        self.by_token.pop(ep.token, None)
        if self.table.seqs.get(seq.uid) is not seq:
            return
        self.table.forget(seq.uid)
        self.metrics.add("agent_calls_per_episode", ep.calls)
        self.metrics.count(f"agent_finish_{reason}")
        self.delivered += 1
        self.deliverer.finished(seq, reason, score)

    # ---- preemption for a weight load ------------------------------------------------------
    def preempt_idle(self) -> None:
        """The rollout waits to load newer weights (the feeder's drain). If nothing but agent
        episodes still holds the loaded version, each of them whose agent (remote, or moved here)
        has no call in flight and has been silent for agent.preempt_idle_s is preempted: it starts
        again from its prompt at the version loaded next. Liveness is never hostage to a silent
        agent; one that is still working loses the attempt (counted `agent_preempted`, not against
        agent.retries), as a dead rollout's episodes do. In-process agents (agent.fn) are ours and
        keep their episodes; they end or time out."""
        wait = self.cfg.preempt_idle_s
        if wait <= 0:
            return
        now, ready = time.monotonic(), []
        for seq in self.table.seqs.values():
            if seq.parked:
                continue
            ep = self.by_uid.get(seq.uid)
            if ep is None or ep.busy or ep.outcome is None or ep.outcome.done():
                return  # something else holds the version: the drain waits for it anyway
            seen = ep.t_seen if ep.t_seen is not None else ep.t_attempt
            if not seq.waiting or now < seen + wait:
                return
            ready.append(ep)
        for ep in ready:
            ep.outcome.set_result((False, ("preempted", "")))  # type: ignore[union-attr]

    async def _park(self, ep: AgentEpisode) -> None:
        """Preempted: the token revoked (later calls answer 409), the tokens dropped, and the
        sample parked in the table until the next version is loaded (`unparked`)."""
        await self._stop_generating(ep)
        self.preempted[ep.token] = None
        if len(self.preempted) > 4096:
            del self.preempted[next(iter(self.preempted))]
        self.metrics.count("agent_preempted")
        self.counts["episodes_preempted"] += 1
        self.log.info("agent_preempted", uid=ep.seq.uid, version=ep.seq.version)
        self._clear(ep)
        ep.seq.agent_token, ep.token = "", ""
        self.table.park(ep.seq)

    def unparked(self, seqs: list[SeqState]) -> None:
        """The table's parked samples, now at the version just loaded: a new attempt each, offered
        to its agents again like a fresh one."""
        for seq in seqs:
            ep = self.by_uid.get(seq.uid)
            if ep is not None and ep.seq is seq:
                self._launch(ep)

    # ---- remote agents --------------------------------------------------------------------
    def check_claim_key(self, key: str) -> None:
        """Raises CallRefused(BAD_CLAIM_KEY) unless `key` is the remote key (compared as UTF-8
        bytes in constant time: any header text, a non-ASCII one included, is refused, not an
        error)."""
        given = key.encode("utf-8", "replace")
        if not self.s.remote_key or not secrets.compare_digest(given, self.s.remote_key.encode()):
            raise CallRefused(Refusal.BAD_CLAIM_KEY, "not a key that may claim episodes")

    async def claim(self, key: str, wait_s: float) -> EpisodeClaim | None:
        """A remote agent takes a waiting episode (None: none within `wait_s`)."""
        self.check_claim_key(key)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                ep, token = await asyncio.wait_for(
                    self.claims.get(), max(0.0, deadline - time.monotonic())
                )
            except TimeoutError:
                return None
            if self.by_token.get(token) is ep:  # not restarted or finished meanwhile
                ep.t_seen = time.monotonic()  # its idle clock starts
                return EpisodeClaim(
                    ep.token, self._row(ep.seq), self.base_url, self.cfg.episode_timeout_s
                )

    def close_episode(self, token: str, reward: Any, error: str | None) -> None:
        """A remote (or moved-here) episode's agent ended: with `reward`, or raised `error`."""
        ep = self._episode(token)
        if ep.outcome is None or ep.outcome.done():
            raise CallRefused(
                Refusal.NOT_CLOSABLE, "this episode is not a remote one, or already closed"
            )
        if error is not None:
            ep.outcome.set_result((False, ("remote_error", error)))
            return
        try:  # refused here, with why, rather than dropped by the buffer unanswered
            self._score(reward)
        except RewardFormatError as exc:
            raise CallRefused(
                Refusal.BAD_REWARD,
                f"the reward cannot be trained: {exc}; close again with a finite number in "
                f"[{self.s.reward_min:g}, {self.s.reward_max:g}] (reward.min_value..max_value), "
                "a dict with such a 'reward', null, or an error",
            ) from None
        ep.outcome.set_result((True, reward))

    def _score(self, reward: Any) -> RewardResult | None:
        """An agent's reward as the sample carries it (None: reward.fn scores the transcript);
        raises RewardFormatError for what the buffer would refuse (not a finite number, or
        outside reward.min_value..max_value). Components are coerced to what the wire carries
        (laminar/rewards/runner.py normalize_reward)."""
        if reward is None:
            return None
        value, info = normalize_reward(reward)
        lo, hi = self.s.reward_min, self.s.reward_max
        if value is not None and not lo <= value <= hi:
            raise RewardFormatError(f"reward {value:g} is outside [{lo:g}, {hi:g}]")
        return RewardResult(value, info)

    # ---- the endpoint's calls -------------------------------------------------------------
    def authorize(self, token: str) -> None:
        """Raises EpisodeMoved or EpisodeUnknown unless `token` is a live episode here."""
        self._episode(token)

    def _episode(self, token: str) -> AgentEpisode:
        ep = self.by_token.get(token)
        if ep is None and token in self.moved:
            raise self._moved(token)
        if ep is None and token in self.preempted:
            raise CallRefused(
                Refusal.PREEMPTED,
                "this episode was preempted: its rollout loaded new weights while its agent sat "
                f"silent for agent.preempt_idle_s ({self.cfg.preempt_idle_s:g}s); it starts "
                "again from its prompt under a new token (remote agents: claim it again)",
            )
        if ep is not None:
            ep.touched, ep.t_seen = True, time.monotonic()
        if ep is None:
            raise EpisodeUnknown
        return ep

    async def turn(
        self, token: str, request: ChatTurn | TextTurn, stream: TurnStream | None = None
    ) -> TurnResult:
        """One call of the episode `token` holds: a model turn after the request's new tokens.
        `stream`: a streamed call, whose tokens are pushed to it as the engine samples them;
        the call runs, is recorded and answers exactly as an unstreamed one."""
        if isinstance(request, ChatTurn):
            return await self._chat(token, request, stream)
        return await self._text(token, request, stream)

    async def _chat(self, token: str, request: ChatTurn, stream: TurnStream | None) -> TurnResult:
        ep = self._episode(token)
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
                    self._clear(ep)
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

    async def _text(self, token: str, request: TextTurn, stream: TurnStream | None) -> TurnResult:
        ep = self._episode(token)
        prompt = request.prompt
        async with self._call(ep, token):
            if ep.recorded:  # moved here: text turns are not matched, a new run starts
                ep.recorded = False
                self.metrics.count("agent_resume_mismatch")
                self.metrics.count("agent_rewrite_tokens_dropped", ep.seq.length)
                self._clear(ep)
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
            turn_id=AgentDriver._turn_id(ep),
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
        if len(prompt) > self.s.max_prompt_tokens:
            ep.truncated = True
            raise CallRefused(
                Refusal.TOO_LONG,
                f"the conversation is {len(prompt)} tokens; this model's "
                f"prompts hold at most {self.s.max_prompt_tokens} "
                "(data.max_prompt_tokens)",
            )
        if ep.consumed is not None or ep.text is not None:  # the agent rewrote its history
            self.metrics.count("agent_history_rewrites")
            self.metrics.count("agent_rewrite_tokens_dropped", seq.length)
            self._clear(ep)
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
        if seq.length + len(new) >= self.s.max_total:
            ep.truncated = True
            raise CallRefused(
                Refusal.TOO_LONG,
                f"the episode would hold {seq.length + len(new)} response tokens; "
                f"at most {self.s.max_total} (env.limits.max_total_tokens or "
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
        cap = self.s.max_total
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
            raise self._moved(token)
        if not self._current(ep, token) or reason not in ("stop", "length"):
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

    def _moved(self, token: str) -> EpisodeMoved:
        """An exported episode's call; it names the rollout meant to import it, when known
        (counted: `agent_moved_hinted`)."""
        dest = self.moved[token][1] if token in self.moved else ""
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
