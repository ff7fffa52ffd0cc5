"""What a rollout knows about each in-flight trajectory, and the messages built from it.

    seq = SeqState.from_item(item, i, version, now)    # a fresh sample of a prompt group
    seq = SeqState.from_partial(partial, now)          # a trajectory resumed here (import)
    seq.append(ev.token_ids, ev.logprobs)              # engine events (loss mask 1)
    seq.append_env(obs_ids)                            # an environment's answer (mask 0, logprob 0)
    chunk = seq.chunk(rollout_id)                    # PartialChunk of the tokens not yet streamed
    traj = seq.trajectory(reason, rollout_id)        # the finished Trajectory (reward filled later)
    part = seq.partial(ids, logprobs, rollout_id)    # PartialTrajectory for export

Partial-pool streaming contract (rollout -> buffer): a trajectory's chunks cover
its response tokens in order; chunk.offset is the index of its first token. The
chunk at offset 0 carries the header (a PartialTrajectory with everything needed
to resume it, whose response_ids/logprobs are empty: the tokens travel in the
chunk). A rollout that resumes a trajectory (import) or whose buffer connection
came back re-sends from offset 0 with a header, so a header always (re)starts the
record, owned by header.rollout_id. Chunks are one-way and best-effort; the final
Trajectory (acked) is what counts, and it supersedes the partial record.

Mode partial (an update interrupts in-flight trajectories, which continue under the new
version): `version` stays the trajectory's first version (its oldest token: what staleness
bounds) and `runs` records where each later version took over, so every token keeps the version
that sampled it (`token_versions`: on the partial batch, the export, the finished Trajectory).

MoE (routes recorded): each entry also carries the routes recorded since the last one, by
position of prompt + response (`routes_sent` .. ; from 0 with a header), so a record the pool
hands to a resumer after this rollout died has the routes its tokens were sampled with.

Multi-turn (a rollout with an environment): every chunk also carries its slice of the loss
mask (1 = engine token, 0 = environment token) and `awaiting_env`, true when the response up
to the chunk's end finishes a model turn whose environment answer is not appended yet; the
latest chunk reaching the record's end decides, so a flip of that flag alone is sent as an
empty chunk. A resumer uses it to tell "run the pending env step" from "keep generating".
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laminar.protocol.data import (
    PartialChunk,
    PartialTrajectory,
    PromptItem,
    ToolRecord,
    Trajectory,
)

_EMPTY_I = np.zeros(0, np.int32)
_EMPTY_F = np.zeros(0, np.float32)


class Growable:
    """An append-only 1-D array with amortised O(1) appends and zero-copy views."""

    def __init__(self, dtype: Any, initial: np.ndarray | None = None):
        data = np.asarray(initial if initial is not None else np.zeros(0), dtype=dtype)
        self._buf = np.zeros(max(64, 2 * len(data)), dtype=dtype)
        self._buf[: len(data)] = data
        self.n = len(data)

    def append(self, arr: np.ndarray) -> None:
        k = len(arr)
        if self.n + k > len(self._buf):
            grown = np.zeros(max(2 * len(self._buf), self.n + k), dtype=self._buf.dtype)
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n : self.n + k] = arr
        self.n += k

    def view(self, start: int = 0, end: int | None = None) -> np.ndarray:
        return self._buf[start : self.n if end is None else end]

    def copy(self) -> np.ndarray:
        return self._buf[: self.n].copy()


class RouteLog:
    """MoE: the routes of a sequence's positions (prompt + response), (n, moe_layers, k), each
    position's first record kept: a resume, the next turn of an episode or a mode-partial
    continuation prefills the sequence again and brings routes for every position, of which only
    the ones not recorded yet are appended (the routes the earlier tokens were sampled with
    stay)."""

    def __init__(self, initial: np.ndarray) -> None:
        self._buf = np.array(initial)
        self.n = len(initial)

    def extend(self, start: int, routes: np.ndarray) -> bool:
        """Record positions start .. start+len(routes); False (nothing kept) when they would leave
        a gap after the last recorded position."""
        if start > self.n or routes.shape[1:] != self._buf.shape[1:]:
            return False
        new = routes[self.n - start :]
        if not len(new):
            return True
        if self.n + len(new) > len(self._buf):
            grown = np.zeros(
                (max(64, 2 * len(self._buf), self.n + len(new)), *self._buf.shape[1:]),
                self._buf.dtype,
            )
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n : self.n + len(new)] = new
        self.n += len(new)
        return True

    def copy(self, upto: int | None = None) -> np.ndarray:
        return self._buf[: self.n if upto is None else min(self.n, upto)].copy()

    def view(self, start: int, end: int | None = None) -> np.ndarray:
        """Positions start .. end (zero-copy; valid until the next extend)."""
        return self._buf[start : self.n if end is None else min(self.n, end)]


@dataclass
class SeqState:
    uid: str
    group_id: str
    prompt_uid: str
    sample_index: int
    n: int
    prompt_ids: np.ndarray
    version: int
    prompt: str = ""
    row: dict[str, Any] = field(default_factory=dict)
    resumed: int = 0
    t_start: float = 0.0
    t_first_token: float = 0.0
    sent_upto: int = 0
    """Response tokens already streamed to the partial pool (0: the header goes next)."""
    exporting: bool = False
    ids: Growable = field(default_factory=lambda: Growable(np.int32))
    logprobs: Growable = field(default_factory=lambda: Growable(np.float32))
    # ---- multi-turn episodes (laminar/rollout/episodes.py); unused when the rollout has no env
    mask: Growable | None = None
    """Loss mask, uint8 per response token: 1 = sampled by the engine, 0 = the environment's
    (logprob 0.0). None: no environment here, every token is the model's (messages carry None)."""
    turn: int = 0
    """0-based index of the model turn being generated (or whose env step runs)."""
    turn_start: int = 0
    """Index in the response where the current model turn began."""
    tool_calls: list[ToolRecord] = field(default_factory=list)
    env_state: Any = None
    waiting: bool = False
    """Not in the engine: its environment step (or a replay after an import) runs."""
    awaiting_env: bool = False
    """The response ends with a complete model turn whose environment answer is not appended yet."""
    sent_awaiting: bool = False
    """`awaiting_env` as the partial pool last got it (a flip alone is worth a chunk)."""
    step_task: asyncio.Task[Any] | None = None
    """The running env step / replay of a waiting episode (export cancels it)."""
    agent_token: str = ""
    image_digests: list[str] = field(default_factory=list)
    """The prompt's images by digest (PromptItem.image_digests): carried, never their bytes."""
    """Black-box agents: the current attempt's episode token (travels with the partial)."""
    parked: bool = False
    """Black-box agents: preempted while its rollout waits to load weights (no tokens, no
    attempt); it holds no weights and starts again at the version loaded next (`unpark`)."""
    runs: list[tuple[int, int]] = field(default_factory=list)
    """Mode partial: (response index, version) where a newer version took over generating it
    (empty: every token at `version`)."""
    routes: RouteLog | None = None
    """MoE with routing replay: the expert ids of each position so far (None: none recorded)."""
    routes_sent: int = 0
    """Positions of `routes` already streamed to the partial pool (a header restarts at 0)."""

    @property
    def current_version(self) -> int:
        """The version generating it now (its newest tokens'); `version` outside mode partial."""
        return self.runs[-1][1] if self.runs else self.version

    def continue_at(self, version: int, at: int | None = None) -> None:
        """Mode partial: response tokens from index `at` (default: the next) on are sampled by
        `version` (an interrupt at an update, or an import on a rollout of a newer version)."""
        at = self.length if at is None else at
        if version == self.current_version:
            return
        if version < self.current_version or (self.runs and at < self.runs[-1][0]):
            raise ValueError(
                f"{self.uid}: cannot continue at version {version} from token {at}: it runs at "
                f"{self.current_version} (runs {self.runs})"
            )
        if at == 0:  # no token sampled yet: it simply starts at the new version
            self.version, self.runs = version, []
        elif self.runs and self.runs[-1][0] == at:  # the version before sampled none of it
            self.runs[-1] = (at, version)
        else:
            self.runs.append((at, version))

    def version_at(self, i: int) -> int:
        """The version that sampled (or samples) response token i."""
        v = self.version
        for at, w in self.runs:
            if at <= i:
                v = w
        return v

    def token_versions(self, start: int = 0, end: int | None = None) -> np.ndarray | None:
        """Version of each response token in [start, end) (None: all at `version`)."""
        if not self.runs:
            return None
        end = self.length if end is None else end
        out = np.full(max(0, end - start), self.version, np.int32)
        for at, v in self.runs:
            if at < end:
                out[max(0, at - start) :] = v
        return out

    @classmethod
    def from_item(
        cls, item: PromptItem, i: int, version: int, now: float, multi_turn: bool = False
    ) -> SeqState:
        return cls(
            uid=f"{item.group_id}/{i}",
            group_id=item.group_id,
            prompt_uid=item.uid,
            sample_index=i,
            n=item.n,
            prompt_ids=np.asarray(item.prompt_ids, np.int32),
            version=version,
            prompt=item.prompt,
            row=dict(item.row),
            t_start=now,
            image_digests=list(item.image_digests),
            mask=Growable(np.uint8) if multi_turn else None,
        )

    @classmethod
    def from_partial(cls, p: PartialTrajectory, now: float, multi_turn: bool = False) -> SeqState:
        mask = None
        if p.loss_mask is not None:
            mask = Growable(np.uint8, p.loss_mask)
        elif multi_turn:
            mask = Growable(np.uint8, np.ones(len(p.response_ids), np.uint8))
        return cls(
            uid=p.uid,
            group_id=p.group_id,
            prompt_uid=p.prompt_uid,
            sample_index=p.sample_index,
            n=p.n,
            prompt_ids=np.asarray(p.prompt_ids, np.int32),
            version=p.version,
            prompt=p.prompt,
            row=dict(p.row),
            resumed=p.resumed + 1,
            t_start=p.t_start or now,
            ids=Growable(np.int32, p.response_ids),
            logprobs=Growable(np.float32, p.logprobs),
            mask=mask,
            awaiting_env=p.awaiting_env and mask is not None,
            runs=version_runs(p.token_versions, p.version),
            agent_token=p.agent_token,
            image_digests=list(p.image_digests),
            routes=None if p.routes is None else RouteLog(p.routes),
        )

    @property
    def length(self) -> int:
        return self.ids.n

    def append(self, ids: np.ndarray, logprobs: np.ndarray, now: float) -> None:
        """The engine's tokens (mask 1)."""
        if len(ids) and not self.t_first_token:
            self.t_first_token = now
        self.ids.append(ids)
        self.logprobs.append(logprobs)
        if self.mask is not None:
            self.mask.append(np.ones(len(ids), np.uint8))

    def add_routes(self, start: int, routes: np.ndarray) -> bool:
        """An engine event's routes (positions start ..); False: they leave a gap, not kept."""
        if self.routes is None:
            if start:
                return False
            self.routes = RouteLog(routes)
            return True
        return self.routes.extend(start, routes)

    def append_env(self, ids: np.ndarray) -> None:
        """The environment's answer: mask 0, logprob 0.0 (context only, never trained)."""
        assert self.mask is not None, "environment tokens on a rollout without an environment"
        self.ids.append(np.asarray(ids, np.int32))
        self.logprobs.append(np.zeros(len(ids), np.float32))
        self.mask.append(np.zeros(len(ids), np.uint8))

    def mask_for(self, n: int) -> np.ndarray | None:
        """The loss mask of the first n response tokens (past what is known here: engine tokens)."""
        if self.mask is None:
            return None
        have = self.mask.view(0, min(n, self.mask.n))
        if len(have) == n:
            return have.copy()
        return np.concatenate([have, np.ones(n - len(have), np.uint8)])

    def header(self, rollout_id: str) -> PartialTrajectory:
        return PartialTrajectory(
            uid=self.uid,
            group_id=self.group_id,
            prompt_uid=self.prompt_uid,
            sample_index=self.sample_index,
            prompt_ids=self.prompt_ids,
            response_ids=_EMPTY_I,
            logprobs=_EMPTY_F,
            version=self.version,
            n=self.n,
            prompt=self.prompt,
            row=self.row,
            rollout_id=rollout_id,
            resumed=self.resumed,
            t_start=self.t_start,
            agent_token=self.agent_token,
            image_digests=self.image_digests,
        )

    def chunk(self, rollout_id: str) -> tuple[PartialChunk, int]:
        """The unsent tokens as one chunk, and the length it brings the pool up to once
        delivered."""
        start, end = self.sent_upto, self.length
        mask = None if self.mask is None else self.mask.view(start, end).copy()
        r0 = self.routes_sent if start else 0
        routes = None if self.routes is None else self.routes.view(r0).copy()
        msg = PartialChunk(
            uid=self.uid,
            version=self.version,
            offset=start,
            token_ids=self.ids.view(start, end).copy(),
            logprobs=self.logprobs.view(start, end).copy(),
            rollout_id=rollout_id,
            header=self.header(rollout_id) if start == 0 else None,
            loss_mask=mask,
            awaiting_env=self.awaiting_env,
            routes=routes if routes is not None and len(routes) else None,
            route_start=r0,
        )
        return msg, end

    def partial(self, ids: np.ndarray, logprobs: np.ndarray, rollout_id: str) -> PartialTrajectory:
        p = self.header(rollout_id)
        p.response_ids = np.asarray(ids, np.int32)
        p.logprobs = np.asarray(logprobs, np.float32)
        p.loss_mask = self.mask_for(len(ids))
        p.token_versions = self.token_versions(0, len(ids))  # past `length`: the newest version
        p.awaiting_env = self.awaiting_env and len(ids) == self.length
        if self.routes is not None:
            p.routes = self.routes.copy(len(self.prompt_ids) + len(ids))
        return p

    def trajectory(self, finish_reason: str, rollout_id: str, now: float) -> Trajectory:
        multi = self.mask is not None
        return Trajectory(
            uid=self.uid,
            group_id=self.group_id,
            prompt_uid=self.prompt_uid,
            sample_index=self.sample_index,
            prompt_ids=self.prompt_ids,
            response_ids=self.ids.copy(),
            logprobs=self.logprobs.copy(),
            version=self.version,
            finish_reason=finish_reason,
            rollout_id=rollout_id,
            prompt=self.prompt,
            row=self.row,
            resumed=self.resumed,
            timings={
                "t_start": self.t_start,
                "t_first_token": self.t_first_token or now,
                "t_finish": now,
                "gen_s": max(0.0, now - self.t_start),
            },
            loss_mask=self.mask.copy() if self.mask is not None else None,
            turns=self.turn + 1 if multi else 1,
            tool_calls=list(self.tool_calls),
            token_versions=self.token_versions(),
            image_digests=self.image_digests,
            routes=None
            if self.routes is None
            else self.routes.copy(len(self.prompt_ids) + self.length),
        )


def version_runs(token_versions: np.ndarray | None, version: int) -> list[tuple[int, int]]:
    """SeqState.runs from a per-token version column (None or all at `version`: no runs)."""
    if token_versions is None or not len(token_versions):
        return []
    tv = np.asarray(token_versions, np.int64)
    at = np.flatnonzero(np.diff(tv)) + 1
    runs = [(int(i), int(tv[i])) for i in at]
    if int(tv[0]) != version:
        runs.insert(0, (0, int(tv[0])))
    return runs


@dataclass
class GroupState:
    """A GRPO group in hand (one credit) until each of its samples here finished or left."""

    group_id: str
    open: set[str] = field(default_factory=set)
    item: PromptItem | None = None
    """The prompt it was started from (None: imported), so a group that never started can be
    taken back and started again at a newer version (SequenceTable.retract)."""
    started: float = 0.0
    """time.monotonic() when it was started here (retraction takes the youngest first)."""
