"""Black-box agents on a rollout: each episode's lifecycle and the protocol its agent follows.

    feeder ──start_group──► SequenceTable ──on_start(seqs)──► AgentDriver.start: one episode per
                                                              sample, waiting, with a secret token
    [agent worker process] run(row, AsyncOpenAI(base_url=endpoint, api_key=token))
        │ POST /v1/chat/completions ──► openai_api.py ──parse (openai_shapes.py)──►
        │     driver.turn(token, ChatTurn | TextTurn): the token's episode (`_episode`: live,
        │     moved, preempted or unknown) ──► AgentCalls.serve (agent_calls.py: the call as a
        │     model turn at the episode's version) ──TurnResult──► openai_shapes.py: the reply
        ├─ [remote agent] POST claim ──► `claim` (the remote key) ──► an EpisodeClaim
        │                 POST close ──► `close_episode` (reward checked, `_score`)
        └─ returns the reward ──► driver: deliver (reward.fn on the transcript when None);
           raises / times out / its worker dies ──► the episode starts again from its prompt
           (under agent.retries; then delivered without a reward)
    node: release(uids, dest) on an export, adopt(seq) on an import, preempt_idle on a drain,
          unparked(seqs) after a load

Built by the rollout node when `agent.fn` (or `agent.remote`) is set, beside the AgentCalls that
serves each call; it writes the EpisodeIndex both read (agent_calls.py). The HTTP layer
(openai_api.py) and the worker pool are its only callers besides the node's hooks. It knows no
HTTP: its turns are typed (agent_turns.py), and a call it refuses raises EpisodeUnknown,
EpisodeMoved (with the rollout it went to) or CallRefused (a Refusal), which openai_shapes.py
turns into a status and an OpenAI error body.

One version per trajectory: a sample is one episode; its calls all generate at the version it
started on (the table is non-empty while the episode lives, so the rollout loads no weights
under it), and each call goes into the engine as a resume of the episode's exact token sequence,
like a turn of an in-process Environment (laminar/rollout/episodes.py). How a call's messages
become tokens (a run, a rewritten history, a resumed call): agent_calls.py.

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
client (laminar/agents/failover.py) repeats its call here, which resumes from the recorded
tokens (agent_calls.py `_resume`).
No agent within agent.reconnect_timeout_s (`agent_failure_lost`), or a partial without a token
(restarted from its prompt by the manager: its version is gone): it starts again from its
prompt here, run by this rollout's workers (`agent_restarted_on_import`).
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from laminar.config import AgentConfig
from laminar.engines.base import Engine
from laminar.metrics import Metrics
from laminar.rewards.runner import RewardFormatError, RewardResult, normalize_reward
from laminar.rollout.agent_calls import AgentCalls
from laminar.rollout.agent_episode import AgentEpisode, EpisodeIndex, clear_episode
from laminar.rollout.agent_pool import AgentPool, release_shared, shared_pool
from laminar.rollout.agent_turns import (
    CallRefused,
    ChatTurn,
    EpisodeClaim,
    EpisodeUnknown,
    Refusal,
    TextTurn,
    TurnResult,
    TurnStream,
)
from laminar.rollout.deliver import Deliverer
from laminar.rollout.sequences import SequenceTable
from laminar.rollout.tracking import SeqState
from laminar.subprocess_pool import WorkerLost, WorkerTimeout
from laminar.supervise import Spawn


@dataclass
class AgentSettings:
    cfg: AgentConfig
    remote_key: str = ""
    """Secret that claims remote episodes (empty: remote claims refused)."""
    endpoints_dir: str = ""
    """Where each rollout writes its endpoint's URL (run_dir/agents/endpoints): an agent worker's
    client looks there for the rollout that holds its episode after a move (empty: nowhere)."""
    node_id: str = ""
    reward_min: float = -math.inf
    reward_max: float = math.inf
    """reward.min_value..max_value: a reward outside is refused at close (the buffer would)."""


class AgentDriver:
    def __init__(
        self,
        settings: AgentSettings,
        *,
        calls: AgentCalls,
        live: EpisodeIndex,
        engine: Engine,
        table: SequenceTable,
        deliverer: Deliverer,
        spawn: Spawn,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ):
        """`calls`: serves each call of an episode (agent_calls.py). `live`: the episodes, shared
        with `calls` (this driver writes it)."""
        self.s, self.cfg = settings, settings.cfg
        self.calls, self.live = calls, live
        self.engine, self.table, self.deliverer = engine, table, deliverer
        self.spawn, self.metrics, self.log = spawn, metrics, log
        self.claims: asyncio.Queue[tuple[AgentEpisode, str]] = asyncio.Queue()
        """Remote episodes offered to claims, with the attempt's token (an entry of an attempt
        that ended meanwhile is skipped: an episode is never handed out twice)."""
        self.pool: AgentPool | None = None
        self.preempted: dict[str, None] = {}
        """Tokens of attempts preempted for a weight load (bounded, oldest dropped): their calls
        answer 409 episode_preempted rather than 401."""
        self.base_url = ""
        """Set once the HTTP server listens (http://host:port/v1)."""
        self.delivered = 0
        self.counts: Counter[str] = Counter()
        """idle_expired, episodes_preempted, agent_failures, agent_gave_up: beside the endpoint's
        refusals in the
        rollout's status (OpenAIEndpoint.figures)."""

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
            self.live.by_uid[seq.uid] = ep
            self._launch(ep)

    def adopt(self, seq: SeqState) -> None:
        """An imported agent partial (a repack move, or its rollout died). With its episode token
        (the partial carries it) the episode goes on here: its agent, wherever it runs, finds this
        rollout after a 421 or a dropped connection and repeats its call, which resumes from the
        recorded tokens (agent_calls.py `_resume`). If the agent neither calls nor closes it within
        agent.reconnect_timeout_s, the attempt fails (`agent_failure_lost`) and the episode starts
        again from its prompt, run by this rollout. Without a token (recovered from its prompt, no
        record of it) it starts again from its prompt at once."""
        ep = AgentEpisode(seq, "", seq.prompt_ids.copy())
        self.live.by_uid[seq.uid] = ep
        token = seq.agent_token
        if not token:
            self.metrics.count("agent_restarted_on_import")
            clear_episode(ep, self.table)
            self._launch(ep)
            return
        self.metrics.count("agent_moved_in")
        self.live.moved.pop(token, None)
        ep.token, ep.recorded = token, seq.length > 0
        ep.prompt_fixed = ep.recorded  # its calls rendered the record's prompt: later runs keep it
        self.live.by_token[token] = ep
        self.table.set_waiting(seq, True)
        self.spawn(self._await_agent(ep, token, self.cfg.reconnect_timeout_s), "agent-episode")

    def release(self, uids: list[str], dest: str = "") -> None:
        """These episodes were exported (a repack move): their agents go on with the rollout that
        imports them. A call in flight here answers 421 `episode_moved` (so do later ones), and the
        agent's client repeats it there. `dest`: the rollout the manager means to import them on
        (ExportRequest.dest; placement may still choose another): the 421 names it in its
        `Laminar-Moved-To` header, so the client asks there first instead of every rollout."""
        now = time.monotonic()
        for tok, (t, _) in list(self.live.moved.items()):
            if now - t > self.cfg.reconnect_timeout_s:
                del self.live.moved[tok]
        if dest == self.s.node_id:
            dest = ""
        for uid in uids:
            ep = self.live.by_uid.pop(uid, None)
            if ep is None:
                continue
            self.live.by_token.pop(ep.token, None)
            self.live.moved[ep.token] = (now, dest)
            self.metrics.count("agent_moved_out")
            if ep.pending is not None and not ep.pending.done():
                ep.pending.set_result("moved")

    # ---- attempts --------------------------------------------------------------------------
    def _launch(self, ep: AgentEpisode) -> None:
        ep.token = "lmn-" + secrets.token_urlsafe(24)
        ep.prompt_fixed = False  # a new attempt: its first call renders the prompt afresh
        ep.seq.agent_token = ep.token  # the partial carries it (a move resumes the episode)
        self.live.by_token[ep.token] = ep
        ep.t_attempt, ep.t_seen = time.monotonic(), None  # idle only once claimed or called
        self.spawn(self._attempt(ep, ep.token), "agent-episode")

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
        if not self.live.current(ep, token):
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
            if self.live.current(ep, token):
                await self._failed(ep, kind, str(exc))
            return
        if not self.live.current(ep, token):
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
        clear_episode(ep, self.table)
        self._launch(ep)

    async def _stop_generating(self, ep: AgentEpisode) -> None:
        """Revoke the attempt's token; a call of it in the engine is aborted."""
        self.live.by_token.pop(ep.token, None)
        seq = ep.seq
        if ep.pending is not None and not ep.pending.done():
            ep.pending.set_result("abort")
        if not seq.waiting and self.table.seqs.get(seq.uid) is seq:
            seq.exporting = True  # its abort event is ours (the node's events loop skips it)
            await self.engine.abort([seq.uid])
            seq.exporting = False
            self.table.set_waiting(seq, True)

    def _finish(self, ep: AgentEpisode, reason: str, score: RewardResult | None) -> None:
        seq = ep.seq
        self.live.by_uid.pop(seq.uid, None)
        self.live.by_token.pop(ep.token, None)
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
            ep = self.live.by_uid.get(seq.uid)
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
        clear_episode(ep, self.table)
        ep.seq.agent_token, ep.token = "", ""
        self.table.park(ep.seq)

    def unparked(self, seqs: list[SeqState]) -> None:
        """The table's parked samples, now at the version just loaded: a new attempt each, offered
        to its agents again like a fresh one."""
        for seq in seqs:
            ep = self.live.by_uid.get(seq.uid)
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
            if self.live.by_token.get(token) is ep:  # not restarted or finished meanwhile
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
        ep = self.live.by_token.get(token)
        if ep is None and token in self.live.moved:
            raise self.calls.moved_error(token)
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
        """One call of the episode `token` holds: a model turn after the request's new tokens
        (agent_calls.py). `stream`: a streamed call, whose tokens are pushed to it as the engine
        samples them; the call runs, is recorded and answers exactly as an unstreamed one."""
        return await self.calls.serve(self._episode(token), token, request, stream)
