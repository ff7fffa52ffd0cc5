"""Simulator engine: one discrete-event run of one mode (sync, one_step, stream, partial,
laminar[_norepack]).

    prompt pool ──groups──► rollout ×R (decode model, KV cache, preemption) ──finished──► buffer
         ▲ admission: laminar.modes                        │ repack: laminar.manager.repack  │
         └──────────── trainer (time ∝ tokens) ◄──────────────────────────────────────────┘
                       │ new version: global update (sync/one_step/stream) or relay pull (laminar)

The admission/staleness rules and the repack planner are the real ones, imported from
laminar.modes and laminar.manager.repack; only the hardware is modelled:

- Decode: all sequences of a rollout advance one token per step; the step takes step_time_s up
  to bound_b sequences and grows linearly past it. A rollout runs at most max_running sequences
  and admits a queued one only while KV use stays under admit_frac; when KV hits 100% the
  youngest sequences are preempted down to admit_frac (vLLM recompute preemption). Prefill
  (new prompts, readmission, repack imports) stalls the rollout for tokens / prefill_tok_s.
- Lengths: lognormal with median length_p50 and p99/p50 = length_p99_over_p50, clipped to
  max_tokens. Each GRPO group of group_size samples runs on one rollout at one version.
- Multi-turn (tool_calls_max > 0, the tool-calling workload): a trajectory is model turns with
  tool calls between them (`turn_plan`: a run of p_call coins, at most tool_calls_max calls;
  per-turn lengths drawn like single-turn responses; lognormal sandbox latency; obs tokens of
  tool output). A turn that ends in a call leaves the batch (its KV and decode slot are free for
  the rollout's other sequences) and rejoins the same rollout's queue when the call returns,
  prefilling only the tool output (prefix cache). A group whose open trajectories all wait on
  tools holds no credit (the rollout takes other groups, at most 2x credits in hand, as
  laminar/rollout/feeder.py does), but it keeps its version: the rollout loads no new weights
  while one of its trajectories waits on a tool (one version per trajectory), repack does not
  move a waiting one, and a global update waits for it (the baselines' barrier). partial is the
  exception: its update interrupts whatever a rollout holds, tool waits included, and the load
  resets the prefix cache, so a call that returns after it prefills the whole history again.
  Trained tokens count the tool output; generated tokens do not.
- Trainer: an update on T tokens takes max(T * trainer_s_per_token, mini-batches *
  trainer_minibatch_floor_s); the floor is the FSDP traffic of one optimizer step, which does not
  shrink with more GPUs - why per-GPU trainer throughput falls at large scale (strong scaling).
- Weights: global modes stop every rollout for global_update_s once all drained (partial: at
  once, interrupting, while the trainer, stalled actor_push_s, trains on); laminar stalls
  the trainer actor_push_s, the version reaches relays relay_broadcast_s later, and a rollout
  pulls it (relay_pull_s) whenever it runs dry or is emptied by repack.

Modes (rules from laminar.modes.policy_for):
- sync: co-located on every GPU; global batch j generated at version j, the trainer waits for
  all of it, then a global update. one_step: split GPUs; batch j+1 generated at version j while
  the trainer trains batch j. stream: like one_step, but the trainer takes each mini-batch as
  soon as its groups finished (staleness bound 1). With a global update that must wait for every
  rollout to drain, one_step and stream differ only in how much training hides behind the tail.
- partial (AReaL's partial rollout): split GPUs, streamed consumption like stream, and a global
  update as soon as each trainer step ends, without a drain: every rollout stops decoding for
  global_update_s, then fills the KV prefix of each of its in-flight sequences again (prompt +
  tokens so far, at prefill_tok_s) and continues them under the new version. A group's version
  stays its first token's, so staleness (and the bound) is that of its oldest token. Its
  rollouts ask for their own groups as laminar's do (`refill`: credits, refill_slots, prompt
  round trips); between a trainer step and the end of its update none may start (admission).
  Credits per sequence (refill_slots) bound only the open sequences; the 2x credits cap on
  groups in hand applies with them only multi-turn, as the rollout node's feeder does: with a
  queue that never drains, the single-turn groups a rollout holds pile up behind their long
  tails (4-6 of them with 12 slots), and a cap there would leave it under B.
- laminar_norepack / laminar: each rollout takes its own batch, drains it, pulls the newest
  version from its relay and takes the next; the trainer consumes finished groups FIFO. With
  refill_per_group (the rollout node's credit loop: the emulation, and paper scale since issue
  44) a rollout also takes a new group whenever one finishes while no newer version is out (with
  refill_versions K: while the newest is fewer than K versions ahead; a dry rollout pulls the
  newest at once; repack with repack_by_draining takes as candidates the rollouts past that
  point); a dry rollout's prompts
  arrive prompt_rtt_s after it asks (with prompt_during_load, asked while it loads a newer
  version: it waits max(relay_pull_s, prompt_rtt_s)). laminar also repacks every
  repack_interval_s and right after each trainer update (bench/simrepack.py: planned from status
  reports - heartbeats, and pushes on change -, moves that take time and wait for a slot,
  imports rejected by a rollout that refreshed meanwhile).

Figures: throughput = tokens consumed / time between trainer-update completions over the window
(paper §8 metric; the window: after warm-up steps and settle_s, or with fixed_window_s the
emulation's fixed window, steps ending in it timed from the last one before it); rollout idle =
share of rollout time with nothing decoding (sync: includes the training phase on shared GPUs);
decode_util = mean of min(running, B) / B; staleness = trainer version - trajectory version, at
consumption and at finish.

Parameters (bench/simparams.py) come from bench/simscale.py (`params_for`: paper scale) or
bench/simconfig.py (`params_from_config`: the emulated cluster of bench/cluster.py);
bench/simulate.py's `simulate()` runs a Sim.

Run: .venv/bin/python bench/simulate.py --quick
(tests: .venv/bin/python -m pytest tests/test_simulate.py -q)
"""

from __future__ import annotations

import heapq
import math
import random
import sys
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from simparams import SimParams  # noqa: E402
from simrepack import RepackMixin  # noqa: E402

from laminar.manager.repack import plan_repack  # noqa: E402
from laminar.modes import StalenessStats, may_start_group, policy_for  # noqa: E402

SIM_MODES = ("sync", "one_step", "stream", "partial", "laminar_norepack", "laminar")
EV_TOOL = 14  # a multi-turn trajectory's tool call answered (repack's events: bench/simrepack.py)
Z99 = 2.3263478740408408  # standard-normal 99th percentile


class Traj:
    """One sample. `gen0` tokens were generated before it was (re)admitted on its current
    rollout at progress `start_p`; its current model run ends at response index `end` (the
    whole `length` single-turn), when the rollout's progress reaches `fin`.
    Multi-turn: `plan` = (ends, obs, lat): model turn k ends at response index ends[k], then
    tool call k takes lat[k] seconds and adds obs[k] tokens; `length` is the whole response."""

    __slots__ = (
        "id",
        "group",
        "length",
        "gen0",
        "start_p",
        "fin",
        "end",
        "turn",
        "plan",
        "cached",
        "call_loads",
    )

    def __init__(
        self,
        tid: int,
        group: Group,
        length: int,
        plan: tuple[list[int], list[int], list[float]] | None = None,
    ) -> None:
        self.id, self.group, self.length, self.gen0, self.start_p = tid, group, length, 0, 0.0
        self.fin = -1.0
        self.plan, self.turn = plan, 0
        self.end = length if plan is None else plan[0][0]
        self.cached = 0
        """KV tokens its next admission need not prefill (prefix cache, after a tool call)."""
        self.call_loads = 0
        """Its rollout's `loads` when its tool call began: a load since reset the prefix cache."""

    def restart(self) -> None:
        """Back to the prompt (its tokens lost): turn 0 again."""
        self.gen0, self.turn, self.cached = 0, 0, 0
        self.end = self.length if self.plan is None else self.plan[0][0]

    def model_tokens(self) -> int:
        return self.length - (sum(self.plan[1]) if self.plan is not None else 0)


class Group:
    __slots__ = ("seq", "version", "left", "tokens", "origin")

    def __init__(self, seq: int, version: int, n: int, origin: int) -> None:
        self.seq, self.version, self.left, self.tokens, self.origin = seq, version, n, 0, origin


class Rollout:
    __slots__ = (
        "idx",
        "version",
        "prog",
        "t_ref",
        "stall_until",
        "running",
        "heap",
        "waiting",
        "kv_base",
        "gen",
        "in_hand",
        "pulling",
        "asking",
        "last_kv",
        "work_t",
        "decode_t",
        "util_a",
        "status",
        "prompts_ready",
        "push_next",
        "push_pending",
        "tooling",
        "retracted",
        "loads",
        "held",
    )

    def __init__(self, idx: int) -> None:
        self.idx, self.version, self.prog, self.t_ref, self.stall_until = idx, 0, 0.0, 0.0, 0.0
        self.running: dict[int, Traj] = {}  # insertion order = admission order (youngest last)
        self.heap: list[tuple[float, int]] = []  # (progress at which it finishes, traj id)
        self.waiting: deque[Traj] = deque()
        self.tooling: dict[int, Traj] = {}  # multi-turn: waiting on a tool call (no KV, no slot)
        self.held: dict[int, int] = {}
        """Group seq -> its trajectories here, running or queued (Sim.hold / Sim.release): the
        groups that hold a credit, kept as they change (a set over a paper-scale rollout's
        1,024 sequences at every refill was most of a run's time)."""
        self.retracted: list[
            Traj
        ] = []  # unstarted groups taken back while draining (retract_waiting)
        self.kv_base = 0.0  # KV tokens = kv_base + len(running) * prog
        self.gen = self.in_hand = 0
        self.pulling = self.asking = False
        # prompts asked for during a load that came back before the load ended
        self.prompts_ready = False
        self.push_next, self.push_pending = 0.0, False  # status pushes: rate bound, one queued
        self.last_kv = 0.0
        self.status: Any = None  # (RolloutLoad, trajectory loads, time) of its latest report
        self.work_t = self.decode_t = self.util_a = 0.0
        self.loads = 0
        """partial: updates taken with sequences held; each reset the prefix cache (the engine's
        reset_prefix_cache after a weight load)."""


class Sim(RepackMixin):
    """One run of one mode; `run()` returns the figures."""

    def __init__(
        self, mode: str, prm: SimParams, seed: int, warmup_steps: int, measure_steps: int
    ) -> None:
        if mode not in SIM_MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {SIM_MODES}")
        self.mode, self.prm = mode, prm
        self.policy = policy_for(
            "laminar" if mode.startswith("laminar") else mode,
            prm.max_staleness
            if mode in ("stream", "partial", "laminar", "laminar_norepack")
            else None,
        )
        self.do_repack = mode == "laminar" and prm.repack
        self.pulls_own_work = not self.policy.global_update or self.policy.interrupts
        """Each rollout asks for its own groups (`refill`: laminar, and partial, whose rollouts
        keep their concurrency topped up between updates) instead of a global dispatch."""
        self.rb = prm.repack_bound_b or prm.bound_b
        self.rng, self.seed = random.Random(seed), seed
        self.sigma = math.log(prm.length_p99_over_p50) / Z99
        self.mu = math.log(prm.length_p50)
        # multi-turn draws on their own stream: the single-turn draws stay what they were
        self.mt_rng = random.Random(seed * 1_000_003 + 11)
        self.lat_mu = math.log(prm.tool_latency_p50_s)
        self.lat_sigma = math.log(prm.tool_latency_p99_s / prm.tool_latency_p50_s) / Z99
        self.ro = [Rollout(i) for i in range(prm.n_rollouts)]
        self.events: list[tuple[float, int, int, Any]] = []
        self.ev_seq = 0
        self.now = 0.0
        self.next_tid = 0
        self.groups_started = 0
        self.inflight = 0  # trajectories started and not finished, all rollouts
        self.version = 0  # trainer version
        self.newest_avail = 0  # laminar: newest version on every relay
        self.updating = False
        self.trainer_busy = False
        self.buffer: deque[Group] = deque()  # finished groups, FIFO
        self.done_by_batch: dict[int, list[Group]] = {}
        self.idle: set[int] = set()  # laminar rollouts waiting for buffer room or admission
        self.warm, self.measure = warmup_steps, measure_steps
        # Both the warm-up and the window also last at least two lifetimes of the longest
        # trajectory, so a window never sees only the burst of a synchronised start.
        life = prm.max_tokens * prm.step_time_s + prm.tool_calls_max * prm.tool_latency_p50_s
        self.settle = 2 * life if prm.settle_s is None else prm.settle_s
        self.start_idx: int | None = None  # index in self.steps where the window starts
        self.done = False
        self.steps: list[tuple[float, int]] = []  # (update completion time, tokens)
        self.cons_stale, self.fin_stale = StalenessStats(), StalenessStats()
        self.snap: dict[str, float] = {}
        self.counts = {
            "repack_rounds": 0,
            "moves": 0,
            "moved_trajs": 0,
            "preemptions": 0,
            "dropped_groups": 0,
            "global_updates": 0,
            "pulls": 0,
            "export_missing": 0,
            "export_empty": 0,
            "import_rejected": 0,
            "import_elsewhere": 0,
            "restarted_from_prompt": 0,
            "status_pushes": 0,
            "retracted_groups": 0,
            "interrupted_trajs": 0,
        }
        self.view_age = [0.0, 0]  # sum, count: how old the statuses moves were planned on
        self.win_gen_tokens = self.win_prod_tokens = 0
        self.step_tokens = self.mb_done = 0
        self.train_t: list[float] = []  # start, end of every trainer update
        if prm.minibatches < 1 or prm.batch_groups % prm.minibatches:
            raise ValueError(
                f"batch_groups {prm.batch_groups} must be a multiple of minibatches "
                f"{prm.minibatches}"
            )

    # ---- event plumbing ---------------------------------------------------------------------
    def push(self, t: float, kind: int, data: Any) -> None:
        self.ev_seq += 1
        heapq.heappush(self.events, (t, self.ev_seq, kind, data))

    def step_time(self, n: int) -> float:
        b = self.prm.bound_b
        return self.prm.step_time_s if n <= b else self.prm.step_time_s * n / b

    def advance(self, r: Rollout) -> None:
        now, n = self.now, len(r.running)
        if n:
            r.work_t += now - r.t_ref
            start = max(r.t_ref, r.stall_until)
            if now > start:
                dt = now - start
                r.prog += dt / self.step_time(n)
                r.decode_t += dt
                r.util_a += dt * min(n, self.prm.bound_b) / self.prm.bound_b
        r.t_ref = now

    def kv(self, r: Rollout) -> float:
        return r.kv_base + len(r.running) * r.prog

    def schedule(self, r: Rollout) -> None:
        r.gen += 1
        n = len(r.running)
        if not n:
            return
        while not self.live(r, r.heap[0]):  # lazy deletion of moved/preempted entries
            heapq.heappop(r.heap)
        st = self.step_time(n)
        steps = r.heap[0][0] - r.prog
        room = self.prm.kv_capacity_tokens - self.kv(r)
        if n > 1 and room < math.inf:
            steps = min(steps, max(0.0, room / n))
        self.push(max(self.now, r.stall_until) + max(0.0, steps) * st, 0, (r.idx, r.gen))

    @staticmethod
    def live(r: Rollout, entry: tuple[float, int]) -> bool:
        t = r.running.get(entry[1])
        return t is not None and t.fin == entry[0]

    def admit(self, r: Rollout) -> None:
        """Move queued sequences into the running batch while KV and max_running allow."""
        cap = self.prm.kv_capacity_tokens * self.prm.admit_frac
        prefill = 0
        while r.waiting and len(r.running) < self.prm.max_running:
            t = r.waiting[0]
            need = self.prm.prompt_tokens + t.gen0
            if r.running and self.kv(r) + need > cap:
                break  # head-of-line blocking, as in vLLM's FCFS scheduler
            r.waiting.popleft()
            t.start_p = r.prog
            r.kv_base += need - r.prog
            r.running[t.id] = t
            t.fin = r.prog + t.end - t.gen0
            heapq.heappush(r.heap, (t.fin, t.id))
            prefill += need - t.cached
            t.cached = 0
        if prefill and self.prm.prefill_tok_s < math.inf:
            r.stall_until = max(r.stall_until, self.now) + prefill / self.prm.prefill_tok_s

    def remove(self, r: Rollout, t: Traj) -> None:
        """Take a running sequence off the rollout, keeping its generated tokens in t.gen0."""
        del r.running[t.id]
        r.kv_base -= self.prm.prompt_tokens + t.gen0 - t.start_p
        t.gen0 += round(r.prog - t.start_p)
        if not r.running:
            r.kv_base = 0.0  # no float drift carried into the next batch

    # ---- rollouts -----------------------------------------------------------------------------
    def on_rollout(self, r: Rollout) -> None:
        self.advance(r)
        eps = 1e-6
        while r.heap and r.heap[0][0] <= r.prog + eps:
            entry = heapq.heappop(r.heap)
            if not self.live(r, entry):
                continue
            t = r.running[entry[1]]
            self.remove(r, t)
            self.release(r, t)
            t.gen0 = t.end
            if t.plan is not None and t.turn + 1 < len(t.plan[0]):
                self.tool_call(r, t)
            else:
                self.finish(r, t)
        if len(r.running) > 1 and self.kv(r) >= self.prm.kv_capacity_tokens - eps:
            floor = self.prm.kv_capacity_tokens * self.prm.admit_frac
            while len(r.running) > 1 and self.kv(r) > floor:
                t = r.running[next(reversed(r.running))]
                self.remove(r, t)
                r.waiting.appendleft(t)
                self.counts["preemptions"] += 1
        self.admit(r)
        self.after_change(r)

    def tool_call(self, r: Rollout, t: Traj) -> None:
        """Multi-turn: the model turn ended in a tool call; the trajectory waits off the batch."""
        assert t.plan is not None
        r.tooling[t.id] = t
        t.call_loads = r.loads
        self.push(self.now + t.plan[2][t.turn], EV_TOOL, (r.idx, t))

    def on_tool_done(self, r: Rollout, t: Traj) -> None:
        """The call answered: its output goes in (prefix-cached prompt and history), next turn
        queues."""
        self.advance(r)
        del r.tooling[t.id]
        assert t.plan is not None
        # partial: weights loaded during the call reset the prefix cache: the whole history again
        t.cached = self.prm.prompt_tokens + t.gen0 if t.call_loads == r.loads else 0
        t.gen0 += t.plan[1][t.turn]
        t.turn += 1
        t.end = t.plan[0][t.turn]
        r.waiting.append(t)
        self.hold(r, t)
        self.admit(r)
        self.after_change(r)

    def finish(self, r: Rollout, t: Traj) -> None:
        g = t.group
        g.left -= 1
        g.tokens += self.prm.prompt_tokens + t.length
        self.inflight -= 1
        if self.start_idx is not None:
            self.fin_stale.add(self.version - g.version)
            self.win_gen_tokens += t.model_tokens()
            self.win_prod_tokens += self.prm.prompt_tokens + t.length
        if g.left == 0:
            self.ro[g.origin].in_hand -= 1
            if self.policy.whole_batch:
                self.done_by_batch.setdefault(g.seq // self.prm.batch_groups, []).append(g)
            else:
                self.buffer.append(g)

    def after_change(self, r: Rollout) -> None:
        """Common tail of every rollout event: refill, update, train, reschedule."""
        if self.policy.global_update:
            if not self.policy.interrupts:
                self.dispatch_global()
            self.maybe_global_update()
        if self.pulls_own_work:
            self.refill(r)
        self.try_train()
        self.schedule(r)
        self.note_change(r)

    def start_group(self, r: Rollout) -> None:
        g = Group(self.groups_started, r.version, self.prm.group_size, r.idx)
        self.groups_started += 1
        r.in_hand += 1
        for _ in range(self.prm.group_size):
            x = self.rng.lognormvariate(self.mu, self.sigma)
            first = max(1, min(self.prm.max_tokens, round(x)))
            if self.prm.tool_calls_max:
                plan = self.turn_plan(first)
                r.waiting.append(Traj(self.next_tid, g, plan[0][-1], plan))
            else:
                r.waiting.append(Traj(self.next_tid, g, first))
            self.hold(r, r.waiting[-1])
            self.next_tid += 1
        self.inflight += self.prm.group_size

    def turn_plan(self, first: int) -> tuple[list[int], list[int], list[float]]:
        """A multi-turn trajectory's turns (laminar/envs/sim.py's draws): a run of p_call coins
        gives the tool calls; each adds obs tokens after lat seconds, then a model turn drawn like
        the first. The max_tokens cap ends it (an output that would reach it: the episode ends)."""
        p, rng = self.prm, self.mt_rng
        n = 0
        while n < p.tool_calls_max and rng.random() < p.p_call:
            n += 1
        ends, obs, lat = [first], [], []
        for _ in range(n):
            o = rng.randint(p.obs_tokens_min, p.obs_tokens_max)
            wait = (
                rng.lognormvariate(self.lat_mu, self.lat_sigma)
                if self.lat_sigma > 0
                else p.tool_latency_p50_s
            )
            wait = min(wait, p.tool_latency_max_s)
            m = max(1, round(rng.lognormvariate(self.mu, self.sigma)))
            if ends[-1] + o >= p.max_tokens:
                break
            obs.append(o)
            lat.append(wait)
            ends.append(min(p.max_tokens, ends[-1] + o + m))
        return ends, obs, lat

    def may_start(self, r: Rollout) -> bool:
        return may_start_group(
            self.policy,
            trainer_version=self.version,
            rollout_version=r.version,
            groups_started=self.groups_started,
            batch_groups=self.prm.batch_groups,
        )

    def dispatch_global(self) -> None:
        """Baselines: hand groups to the least-loaded rollouts while the mode's rules allow."""
        if self.updating or not self.may_start(self.ro[0]):
            return  # one version everywhere in global modes: one check stands for all rollouts
        heap = [(r.in_hand, r.idx) for r in self.ro if r.in_hand < self.prm.rollout_groups]
        heapq.heapify(heap)
        touched: dict[int, Rollout] = {}
        while heap:
            _, i = heap[0]
            r = self.ro[i]
            if not self.may_start(r):
                break  # same version everywhere in global modes, so no rollout may start
            if i not in touched:
                self.advance(r)
                touched[i] = r
            self.start_group(r)
            if r.in_hand < self.prm.rollout_groups:
                heapq.heapreplace(heap, (r.in_hand, i))
            else:
                heapq.heappop(heap)
        for r in touched.values():
            self.admit(r)
            self.schedule(r)

    def groups_held(self, r: Rollout) -> int:
        """Groups with a trajectory on this rollout (imported ones too): the node's used credits.
        A group whose open trajectories all wait on a tool holds none
        (laminar/rollout/feeder.py)."""
        return len(r.held)

    @staticmethod
    def hold(r: Rollout, t: Traj) -> None:
        """t joined r's running or queued trajectories."""
        seq = t.group.seq
        r.held[seq] = r.held.get(seq, 0) + 1

    @staticmethod
    def release(r: Rollout, t: Traj) -> None:
        """t left r's running and queued trajectories (finished, off to a tool, exported,
        retracted)."""
        seq = t.group.seq
        left = r.held[seq] - 1
        if left:
            r.held[seq] = left
        else:
            del r.held[seq]

    def groups_in_hand(self, r: Rollout) -> int:
        """Groups with a trajectory here in any state, tool waits included (capped at 2x
        credits)."""
        return len(
            {t.group.seq for t in r.running.values()}
            | {t.group.seq for t in r.waiting}
            | {t.group.seq for t in r.tooling.values()}
        )

    def refill(self, r: Rollout, answered: bool = False) -> None:
        """Laminar: a rollout with nothing left pulls newer weights, then takes its own batch;
        with refill_per_group it also tops up its credits while no newer version is out.
        A dry rollout's prompts arrive prompt_rtt_s after it asks (`answered`: they are here)."""
        if r.pulling or r.asking:
            return
        # nothing to decode; multi-turn: tool waits keep the version (a load waits for them) but
        # not the decode slots, which take new groups meanwhile (feeder.py's credits)
        dry = not r.running and not r.waiting
        if self.draining(r) and self.prm.retract_waiting and r.waiting:
            self.retract(r)
        if self.newest_avail > r.version and (self.draining(r) or (dry and not r.tooling)):
            if not dry or r.tooling:
                return  # drain first: every trajectory runs on one version
            r.pulling = True
            self.idle.discard(r.idx)
            self.counts["pulls"] += 1
            self.push(self.now + self.prm.relay_pull_s, 3, (r.idx, self.newest_avail))
            if self.prm.prompt_during_load and self.prm.prompt_rtt_s > 0:
                r.asking = True  # its prompts come back while it loads; they start once loaded
                self.push(self.now + self.prm.prompt_rtt_s, 9, r.idx)
            return
        if not dry and not self.prm.refill_per_group:
            return
        if dry and self.prm.prompt_rtt_s > 0 and not answered:
            r.asking = True  # decoding nothing until the buffer's reply is back
            self.push(self.now + self.prm.prompt_rtt_s, 9, r.idx)
            return
        cap = self.prm.buffer_capacity_groups
        started = self.groups_held(r) if self.prm.refill_per_group and not dry else 0
        first = started
        hand = self.groups_in_hand(r) if r.tooling else started
        slots = self.prm.refill_slots
        # the cap on groups in hand, 2x credits (feeder.free_credits): with credits per group it
        # always applies; with credits per sequence only multi-turn, where groups whose episodes
        # all wait on tools hold no slot (single-turn, the slots alone bound a rollout's groups)
        hand_cap = 2 * self.prm.rollout_groups
        if slots is not None:  # credits per sequence: room for a whole group among the open ones
            open_seqs = len(r.running) + len(r.waiting) + len(r.retracted)
            started, first = 0, 0
            limit = max(0, slots - open_seqs) // self.prm.group_size
            if not self.prm.tool_calls_max:
                hand_cap = math.inf
        else:
            limit = self.prm.rollout_groups
        while (
            started < limit
            and hand < hand_cap
            and (cap is None or len(self.buffer) < cap)
            and self.may_start(r)
        ):
            self.start_group(r)
            started += 1
            hand += 1
        if started > first:
            self.idle.discard(r.idx)
            self.admit(r)
        elif dry or started < limit:
            self.idle.add(r.idx)  # woken when buffer room or a version appears

    def draining(self, r: Rollout) -> bool:
        """Laminar: the rollout takes nothing more at its version (a newer one is out, or with
        refill_versions K the newest is K ahead); it finishes what it holds, then pulls."""
        k = self.prm.refill_versions
        return self.newest_avail >= r.version + k if k > 0 else self.newest_avail > r.version

    def retract(self, r: Rollout) -> None:
        """Take back the queued groups none of whose samples started (they run at the next
        version)."""
        by_group: dict[int, list[Traj]] = {}
        for t in r.waiting:
            by_group.setdefault(t.group.seq, []).append(t)
        out = [
            ts
            for ts in by_group.values()
            if len(ts) == ts[0].group.left == self.prm.group_size and all(t.gen0 == 0 for t in ts)
        ]
        if not out:
            return
        gone = {t.id for ts in out for t in ts}
        r.waiting = deque(t for t in r.waiting if t.id not in gone)
        for ts in out:
            r.retracted.extend(ts)
            for t in ts:
                self.release(r, t)
        self.counts["retracted_groups"] += len(out)

    def restart_retracted(self, r: Rollout) -> None:
        """After a load: the taken-back groups start first, at the version just loaded."""
        if not r.retracted:
            return
        for t in r.retracted:
            t.group.version = r.version
            self.hold(r, t)
        r.waiting.extend(r.retracted)
        r.retracted = []
        self.admit(r)

    def wake_idle(self) -> None:
        for i in sorted(self.idle):
            r = self.ro[i]
            if not (r.pulling or r.asking) and (
                self.prm.refill_per_group or not (r.running or r.waiting)
            ):
                self.advance(r)
                self.refill(r)
                self.schedule(r)
                self.note_change(r)

    # ---- trainer and weights -----------------------------------------------------------------
    def try_train(self) -> None:
        """Start the next trainer update: a whole global batch (sync, one_step) or one
        mini-batch of the first finished groups (stream, laminar: streamed consumption)."""
        if self.policy.global_update:
            self.maybe_global_update()  # a due update goes first once every rollout drained
        if self.trainer_busy or (self.updating and not self.policy.interrupts):
            return
        if self.policy.whole_batch:
            batch = self.done_by_batch.get(self.version, [])
            if len(batch) < self.prm.batch_groups:
                return
            del self.done_by_batch[self.version]
            mbs = self.prm.minibatches
        else:
            need, batch, mbs = self.prm.batch_groups // self.prm.minibatches, [], 1
            while self.buffer and len(batch) < need:
                g = self.buffer.popleft()
                if (
                    self.policy.max_staleness is not None
                    and self.version - g.version > self.policy.max_staleness
                ):
                    self.counts["dropped_groups"] += 1
                    continue
                batch.append(g)
            if len(batch) < need:
                self.buffer.extendleft(reversed(batch))
                return
        tokens = sum(g.tokens for g in batch)
        if self.start_idx is not None:
            for g in batch:
                self.cons_stale.add(self.version - g.version, self.prm.group_size)
        self.trainer_busy = True
        dur = max(tokens * self.prm.trainer_s_per_token, mbs * self.prm.trainer_minibatch_floor_s)
        self.train_t += (self.now, self.now + dur)
        self.push(self.now + dur, 1, (tokens, mbs))

    def on_train_done(self, tokens: int, mbs: int) -> None:
        self.step_tokens += tokens
        self.mb_done += mbs
        if self.mb_done < self.prm.minibatches:
            self.trainer_busy = False
            self.wake_idle()  # buffer room freed
            self.try_train()
            return
        tokens, self.step_tokens, self.mb_done = self.step_tokens, 0, 0
        self.version += 1
        self.steps.append((self.now, tokens))
        if self.prm.fixed_window_s is not None:
            pass  # the window opens and closes on timers (run)
        elif self.start_idx is None and len(self.steps) >= self.warm and self.now >= self.settle:
            self.start_idx = len(self.steps)
            self.take_snapshot("start")
        elif self.start_idx is not None and len(self.steps) - self.start_idx >= self.measure:
            self.done = self.now - self.snap["start_t"] >= self.settle  # windows end on an update
        if self.policy.interrupts:
            # partial: the trainer hands the version off (actor_push_s) and trains on while the
            # rollouts' interrupting update runs
            self.push(self.now + self.prm.actor_push_s, 2, None)
        elif self.policy.global_update:
            self.trainer_busy = False
        else:
            self.push(self.now + self.prm.actor_push_s, 2, None)  # trainer free after the push
            self.push(
                self.now + self.prm.actor_push_s + self.prm.relay_broadcast_s, 4, self.version
            )
            if self.do_repack:
                self.repack(after_update=True)
        self.wake_idle()
        self.try_train()

    def maybe_global_update(self) -> None:
        if (
            self.updating
            or self.trainer_busy
            or (self.inflight and not self.policy.interrupts)
            or self.version <= self.ro[0].version
        ):
            return
        self.updating = True
        self.counts["global_updates"] += 1
        if self.policy.interrupts:
            self.interrupt_all()
        self.push(self.now + self.prm.global_update_s, 5, self.version)

    def interrupt_all(self) -> None:
        """partial: every rollout stops for the update, then prefills each in-flight sequence's
        prompt and tokens so far again (its KV was computed by the old weights) and continues it
        under the new version; nothing is lost. A rollout whose episodes all wait on tools takes
        the update too (laminar/rollout/feeder.py interrupts whenever it holds a sequence): a turn
        whose call returns meanwhile waits for the new weights. One holding nothing is not stalled.
        """
        upd = self.prm.global_update_s
        for r in self.ro:
            self.advance(r)
            if not r.running and not r.waiting and not r.tooling:
                continue
            held = self.kv(r) if r.running else 0.0
            refill = held / self.prm.prefill_tok_s if self.prm.prefill_tok_s < math.inf else 0.0
            r.loads += 1  # the new weights reset the prefix cache: queued turns prefill it all
            for t in r.waiting:
                t.cached = 0
            r.stall_until = max(r.stall_until, self.now) + upd + refill
            self.counts["interrupted_trajs"] += len(r.running)
            self.schedule(r)

    def on_update_done(self, version: int) -> None:
        self.updating = False
        for r in self.ro:
            self.advance(r)
            r.version = version
        if self.policy.interrupts:
            self.wake_idle()  # partial: rollouts that could not start at the old version ask now
        else:
            self.dispatch_global()
        self.try_train()

    # ---- repack ------------------------------------------------------------------------------
    def plan(self, loads: list[Any]) -> Any:
        """The real planner (looked up here, so a test can spy on simcore.plan_repack)."""
        return plan_repack(loads, self.prm.c_max, self.rb, split=self.prm.repack_split)

    # ---- measurement -------------------------------------------------------------------------
    def take_snapshot(self, key: str) -> None:
        for r in self.ro:
            self.advance(r)
        self.snap[key + "_t"] = self.now
        self.snap[key + "_work"] = sum(r.work_t for r in self.ro)
        self.snap[key + "_decode"] = sum(r.decode_t for r in self.ro)
        self.snap[key + "_util"] = sum(r.util_a for r in self.ro)

    def run(self) -> dict[str, Any]:
        if not self.pulls_own_work:
            self.dispatch_global()
        else:
            for r in self.ro:
                self.refill(r)
                self.schedule(r)
            if self.do_repack:
                self.repack_start(self.seed)
        if self.prm.fixed_window_s is not None:
            w0, wlen = self.prm.fixed_window_s
            self.push(w0, 10, None)
            self.push(w0 + wlen, 11, None)
        elif not self.warm and not self.settle:
            self.start_idx = 0
            self.take_snapshot("start")
        n_events = 0
        while not self.done:
            if not self.events:
                raise RuntimeError(
                    f"{self.mode}: no events left after {len(self.steps)} steps (deadlock)"
                )
            t, _, kind, data = heapq.heappop(self.events)
            self.now = t
            n_events += 1
            if kind == 0:
                r = self.ro[data[0]]
                if data[1] == r.gen:
                    self.on_rollout(r)
            elif kind == 1:
                self.on_train_done(*data)
            elif kind == 2:
                self.trainer_busy = False
                self.try_train()
            elif kind == 3:
                r = self.ro[data[0]]
                self.advance(r)
                r.pulling, r.version = False, data[1]
                self.restart_retracted(r)
                ready, r.prompts_ready = r.prompts_ready, False
                self.refill(r, answered=ready)  # prompts asked for during the load start now
                self.try_train()
                self.schedule(r)
                self.note_change(r)
            elif kind == 9:  # a dry rollout's prompt request answered
                r = self.ro[data]
                self.advance(r)
                r.asking = False
                if r.pulling:
                    r.prompts_ready = True  # asked while loading: they wait for the weights
                    continue
                self.refill(r, answered=True)
                self.schedule(r)
                self.note_change(r)
            elif kind == 4:
                self.newest_avail = max(self.newest_avail, data)
                if self.prm.retract_waiting:  # the rollout node's feeder wakes on a new version
                    for r in self.ro:
                        if r.waiting and self.draining(r) and not r.pulling:
                            self.retract(r)
                self.wake_idle()
            elif kind == 5:
                self.on_update_done(data)
            elif kind == 10:  # fixed window opens
                self.start_idx = len(self.steps)
                self.take_snapshot("start")
            elif kind == 11:  # fixed window closes
                self.done = True
            elif kind == EV_TOOL:
                self.on_tool_done(self.ro[data[0]], data[1])
            else:  # repack rounds, heartbeats, status pushes, exports, move arrivals (simrepack.py)
                self.on_repack_event(kind, data)
        self.take_snapshot("end")
        return self.figures(n_events)

    def busy_between(self, t0: float, t1: float) -> float:
        it = iter(self.train_t)
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in zip(it, it, strict=False))

    def figures(self, n_events: int) -> dict[str, Any]:
        s = self.snap
        assert self.start_idx is not None
        t0, t1 = s["start_t"], self.steps[-1][0] if self.steps else s["start_t"]
        n_steps = len(self.steps) - self.start_idx
        tokens = sum(tok for _, tok in self.steps[self.start_idx :])
        if self.prm.fixed_window_s is not None:
            # as bench/cluster_run.py measures: steps that ended in the window, timed from the last
            # step before it (none: from the first in it, which then only starts the count, unless
            # it is the only one); time-based figures over the whole window
            if not self.start_idx and n_steps > 1:
                n_steps -= 1
                tokens -= self.steps[0][1]
                first = self.steps[0][0]
            else:
                first = self.steps[self.start_idx - 1][0] if self.start_idx else t0
            span = (t1 - first) if n_steps else math.nan
            window = s["end_t"] - t0
        else:
            span = window = t1 - t0
        ro_time = window * self.prm.n_rollouts
        n_gpus = self.prm.n_gpus or self.prm.n_rollouts
        thr = tokens / span if n_steps else 0.0
        return {
            "mode": self.mode,
            "throughput_tok_s": thr,
            "throughput_per_gpu": thr / n_gpus,
            "gen_tok_s": self.win_gen_tokens / window,
            "iteration_s": span / n_steps if n_steps else math.nan,
            "steps_measured": n_steps,
            "produced_over_consumed": self.win_prod_tokens / tokens if tokens else math.nan,
            "trainer_busy_frac": self.busy_between(t0, t0 + window) / window,
            "rollout_idle_frac": max(0.0, 1 - (s["end_work"] - s["start_work"]) / ro_time),
            "decode_util": (s["end_util"] - s["start_util"]) / ro_time,
            "staleness_consumed": self.cons_stale.summary(),
            "staleness_finished": self.fin_stale.summary(),
            "sim_time_s": t1,
            "events": n_events,
            "view_age_s": self.view_age[0] / self.view_age[1] if self.view_age[1] else math.nan,
            **self.counts,
        }
