"""Rollout node: one generation engine fed from the buffer's prompt pool.

    buffer ──PromptReply──► [feeder.run()] ──start_group──► SequenceTable ──GenRequest──► engine
       ▲                      │ credits, versions: VersionGate            │ TokenEvents
       │                      │ (loads only when the table is empty)       ▼
       │                      │                                    [events loop] ── table.on_event
       │◄──PartialBatch (one-way, best-effort)──── [deliverer.stream()] ◄── table.mark_dirty
       │◄──Trajectory (acked, resent) ◄── [outbox.run()] ◄── Deliverer (reward task) ◄── finished
       │   (or Deliveries: those finished within rollout.deliver_window_frac of a trajectory's time)
    relay / run_dir/weights ──► WeightSubscriber ──► VersionGate.load ──► engine.load_weights
                                              └─► [gate.watch()] wakes the feeder on a new version
    manager ──Export/Import/RefreshRequest──► handlers below ──► table.export/.resume, gate.ask
    manager ◄──Heartbeat(NodeStatus(rollout=RolloutStatus))── beats, and [status push] on change

The parts (laminar/rollout/): VersionGate (versions.py: which version runs and loads next),
SequenceTable (sequences.py: in-flight groups and sequences, export/import of partials),
PromptFeeder (feeder.py: the pull loop; the only place weights change, with what blocks
and unblocks it), Deliverer (deliver.py: partial chunks, rewards, the acked Outbox). Each
takes typed dependencies and never sees this node; this module builds them in setup(),
spawns their loops in main(), and answers the manager's commands:

  * ExportRequest aborts trajectories in the engine and hands back their PartialTrajectory
    (every token so far), forgetting them here (agent episodes' calls answer 421 naming
    ExportRequest.dest, the rollout meant to import them).
  * ImportRequest resumes partials of this rollout's exact version (else ErrorReply
    version_mismatch; mode partial: of this version or older, continuing under this one),
    idempotently (uids running or recently finished here are reported as
    duplicate); it holds the gate's lock, so the version cannot change under it.
  * RefreshRequest asks the gate for the newest version (soft: min_version is waited for
    rollout.refresh_wait_s); the feeder loads it once the table is empty.

Multi-turn (env.fn set, or an env passed in): EpisodeDriver (episodes.py) takes each model turn
the engine finishes (stop | length) instead of the deliverer: the environment steps (tools via
the tools node when the cluster has one), its answer is appended with loss mask 0 and the
episode goes back into the engine at its own version; imports are rebuilt by replay first.

Black-box agents (agent.fn or agent.remote set): AgentDriver (agents.py) starts each fresh sample
as an episode of the user's agent, which calls this rollout's OpenAI-compatible endpoint
(openai_api.py, aiohttp in this loop); AgentCalls (agent_calls.py) serves each call as a turn at
the episode's version, ended by this node's events loop. An exported
episode's agent follows it (its calls here answer 421 episode_moved; the importer resumes the
call from the recorded tokens).

Heartbeats carry engine stats plus RolloutStatus (per-trajectory KV tokens, so repack can
choose what to move). In laminar mode with repack on, the status is also pushed as soon as it
changes (a sequence finished, work came or left, new weights; at most every
rollout.status_push_min_s), because a plan made on a view a beat old moves trajectories that
finished meanwhile onto rollouts that refilled meanwhile.

Stopping: no more prompts, in-flight work gets half the stop budget to finish, partial
chunks are flushed (what is left unfinished is in the partial pool for recovery), rewards
finish, then the outbox is flushed.

Run: laminar node --role rollout --config configs/skeleton.yaml [--index I]
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any

from laminar.engines.base import Engine, SamplingParams
from laminar.models.tiny_vlm import is_vlm
from laminar.node import NODE_STATUS, Node
from laminar.protocol.buffer import ImageBlobs, ImageFetch, ImagePut, ImagePutReply
from laminar.protocol.core import NodeStatus
from laminar.protocol.data import PartialTrajectory, newest_version
from laminar.protocol.rollout import (
    ASLEEP,
    VERSION_MISMATCH,
    ExportReply,
    ExportRequest,
    ImportReply,
    ImportRequest,
    RefreshReply,
    RefreshRequest,
    RolloutStatus,
    SleepReply,
    SleepRequest,
    WakeReply,
    WakeRequest,
)
from laminar.rollout.deliver import Deliverer
from laminar.rollout.feeder import PromptFeeder
from laminar.rollout.outbox import Outbox
from laminar.rollout.sequences import SequenceTable
from laminar.rollout.settings import RolloutNodeSettings
from laminar.rollout.versions import VersionGate
from laminar.transport.session import ErrorReply
from laminar.transport.sockets import Context, Peer, RemoteError, TransportError
from laminar.vision.images import BadImage
from laminar.vision.store import ImageCache
from laminar.vision.turns import TurnImages
from laminar.weights.channel import WeightSubscriber
from laminar.weights.factory import open_subscriber

STARTING_ENGINE = "starting_engine"
"""NodeStatus.state (and ErrorReply code) of a rollout whose engine has not started yet."""


class EngineStartTimeout(RuntimeError):
    """The engine did not start within rollout.engine_start_timeout_s: the rollout fails (exit
    non-zero)."""


if TYPE_CHECKING:
    from laminar.envs.base import Environment, ToolClient
    from laminar.rewards.runner import RewardRunner
    from laminar.rollout.agent_calls import AgentCalls
    from laminar.rollout.agents import AgentDriver
    from laminar.rollout.colocate import DeviceShare
    from laminar.rollout.episodes import EpisodeDriver
    from laminar.rollout.openai_api import OpenAIEndpoint


class RolloutNode(Node):
    role = "rollout"

    def __init__(
        self,
        settings: RolloutNodeSettings,
        ctx: Context | None = None,
        engine: Engine | None = None,
        weight_source: WeightSubscriber | None = None,
        env: Environment | None = None,
        tools: ToolClient | None = None,
    ):
        super().__init__(settings.node, ctx)
        self.settings = settings
        self.engine: Engine | None = engine
        self.device = settings.model.device
        """Where the torch engine runs (cuda: its own GPU, placed in setup)."""
        self.source: WeightSubscriber | None = weight_source
        self.env: Environment | None = env
        """Multi-turn environment (else built from env.fn in setup; None: single-turn)."""
        self.tools: ToolClient | None = tools
        """Tool client of the environment (else the tools node's, when the cluster has one)."""
        self.episodes: EpisodeDriver | None = None
        self.agents: AgentDriver | None = None
        """Black-box agents (agent.fn / agent.remote): their episodes and the HTTP endpoint."""
        self.agent_calls: AgentCalls | None = None
        """Each call of an agent episode, served as a model turn (the events loop ends them)."""
        self.endpoint: OpenAIEndpoint | None = None
        self.rewards: RewardRunner | None = None
        self.processor: Any = None
        """A vision-language model's HF processor, when environments or agents may add images in
        later turns (laminar/vision/turns.py)."""
        self.turn_images: TurnImages | None = None
        self.tokenizer: Any = None
        """HF tokenizer of model.path (torch/vllm engines), for completions and multi-turn
        templates."""
        self.engine_ready = asyncio.Event()
        """Set once the engine has started and the parts around it are built (status:
        starting_engine before)."""
        self.engine_started_at = 0.0
        self.wake = asyncio.Event()
        """The feeder's: a credit freed, a new version, a refresh asked, stopping."""
        self.status_changed = asyncio.Event()
        """Something repack plans from changed: the status push loop sends it to the manager."""
        # the parts, built in setup() once the engine and the weight source exist
        self.gate: VersionGate
        self.table: SequenceTable
        self.outbox: Outbox
        self.deliverer: Deliverer
        self.share: DeviceShare | None = None
        """Colocated placement: the sleep / wake half of the device time-share."""
        self.feeder: PromptFeeder

    # ---- lifecycle --------------------------------------------------------------------
    async def setup(self) -> None:
        s, t = self.settings, self.settings.transport
        # the reward first: a bad reward.fn fails the node at once, with the fix in the message
        if s.rollout.engine != "sim" or s.reward.sim == "fn":
            from laminar.rewards.runner import RewardRunner

            self.rewards = RewardRunner.from_config(s.reward)
            await self.rewards.start(self.spawn)
            self.on_close(self.rewards.close)
        # (re)connected: the buffer may have lost the partial records, so each restarts from offset
        # 0
        self.buffer = self.client(s.buffer, on_connect=self._restream_all)
        await self.buffer.connect(timeout=t.startup_timeout_s)
        self.outbox = Outbox(
            self.buffer,
            self.log,
            s.rollout.outbox_concurrency,
            t.request_timeout_s,
            t.reconnect_backoff_s,
            t.reconnect_backoff_max_s,
            window_frac=s.rollout.deliver_window_frac,
            window_max_s=s.rollout.partial_flush_s,
        )
        self.device = self._torch_device()
        if self.source is None:
            channel = dataclasses.replace(s.channel, device=self.device)
            self.source = open_subscriber(channel, self.wiring())
        await self.source.start()
        self.on_close(self.source.close)
        if s.rollout.engine != "sim" and s.model.path:
            from laminar.models.prompt_tokenizer import load_prompt_tokenizer

            # completions only need decoding; an environment's turns may render the chat template
            self.tokenizer = await asyncio.to_thread(
                load_prompt_tokenizer,
                s.model.path,
                chat_template=bool(s.env.fn or s.agent.fn or s.agent.remote),
            )
            if (s.env.fn or self.env is not None or self._has_agents()) and is_vlm(s.model.path):
                from laminar.models.tiny_vlm import load_processor

                # later turns may show images: their placeholders expand as the processor's do
                self.processor = await asyncio.to_thread(load_processor, s.model.path)
        if self.env is None and s.env.fn:
            from laminar.envs.loader import load_env

            self.env = load_env(s.env)
        if self.env is not None and self.tools is None and s.tools is not None:
            from laminar.rollout.tool_client import RemoteToolClient

            tools_rpc = self.client(s.tools)
            await tools_rpc.connect(timeout=t.startup_timeout_s)
            self.tools = RemoteToolClient(tools_rpc, s.tool_call_timeout_s)
        # the engine starts in the background (vLLM: a minute, off the loop): the node registers
        # meanwhile, beats and reports starting_engine; main() waits for it, under a deadline
        self.engine_started_at = time.monotonic()
        self.spawn(self._start_engine(), "engine-start")

    async def _start_engine(self) -> None:
        """Build and start the engine, then the parts around it; past the deadline the node
        fails."""
        ro = self.settings.rollout
        deadline = ro.engine_start_timeout_s
        try:
            await asyncio.wait_for(self._make_and_start_engine(), deadline)
        except TimeoutError:
            raise EngineStartTimeout(
                f"{self.node_id}: the {ro.engine} engine did not start within "
                f"{deadline:g} s (rollout.engine_start_timeout_s; raise it for a big model or a "
                "slow host)"
            ) from None
        self.log.info(
            "engine_started",
            engine=ro.engine,
            start_s=round(time.monotonic() - self.engine_started_at, 3),
        )
        self._build_parts()
        if self.agents is not None:  # listening (and its workers up) before the node is ready
            await self._start_agents()
        self.engine_ready.set()

    async def _make_and_start_engine(self) -> None:
        s = self.settings
        if self.engine is None:
            from laminar.engines.factory import make_engine

            kw: dict[str, Any] = {}
            if s.rollout.engine == "vllm":
                kw["env"] = self._vllm_env()
                if s.colocate is not None:  # sleeps while the trainer steps
                    kw["sleep_mode"] = True
            # loading a torch model blocks for seconds: off the loop, so this node keeps beating
            if s.rollout.engine == "torch":
                model = s.model.model_copy(update={"device": self.device})
                self.engine = await asyncio.to_thread(make_engine, s.rollout, model, **kw)
            else:
                self.engine = make_engine(s.rollout, s.model, **kw)
        self.on_close(self.engine.close)  # before start: a start cut short is closed too
        await self.engine.start(self.spawn)

    def _torch_device(self) -> str:
        """The torch engine's device: its own GPU by rollout index on cuda (placement.py)."""
        s = self.settings
        if s.rollout.engine != "torch" or s.model.device != "cuda" or not s.rollout.gpu_placement:
            return s.model.device
        from laminar.rollout.placement import host_placement, torch_device

        rollouts = s.rollouts
        p = host_placement(self.index % rollouts, rollouts, "cuda", 1, s.reserved_gpus)
        device = torch_device(p, s.model.device)
        self.log.info("engine_placement", placement=p.describe(), device=device, shared=p.shared)
        if p.shared:
            self.log.warning("engine_placement_shared", placement=p.describe())
        return device

    def _vllm_env(self) -> dict[str, str]:
        """The vLLM EngineCore's cores or GPUs (placement), for its environment."""
        from laminar.rollout.placement import Device, host_placement

        s = self.settings
        env: dict[str, str] = {}
        if s.rollout.vllm.placement:
            device: Device = "cuda" if s.model.device.startswith("cuda") else "cpu"
            tp = int(s.rollout.vllm_args.get("tensor_parallel_size", 1))
            rollouts = s.rollouts
            p = host_placement(self.index % rollouts, rollouts, device, tp, s.reserved_gpus)
            self.log.info("engine_placement", placement=p.describe(), env=p.env, shared=p.shared)
            if p.shared:
                self.log.warning("engine_placement_shared", placement=p.describe())
            env.update(p.env)
        return env

    def _build_parts(self) -> None:
        s, engine, env = self.settings, self.engine, self.env
        assert engine is not None and self.source is not None
        params = SamplingParams.from_config(s.rollout.sampling)
        limits = s.env.limits
        max_total = limits.max_total_tokens or params.max_tokens
        first = params
        if env is not None:
            from laminar.rollout.episodes import episode_params

            first = episode_params(params, tuple(env.stop), max_total, limits.max_turn_tokens, 0)
        self.table = SequenceTable(
            engine,
            first,
            notify=(self.wake, self.status_changed),
            metrics=self.metrics,
            log=self.log,
            multi_turn=env is not None or self._has_agents(),
            interrupts=s.mode == "partial",
            images=ImageCache(s.image_limits, max_images=max(64, 4 * s.rollout.max_running)),
        )
        source = self.source
        self.gate = VersionGate(
            source,
            engine,
            # partial: every rollout takes each version as soon as it is out (a global update)
            auto_refresh=(s.rollout.refresh_when_idle and s.mode == "laminar")
            or s.mode == "partial",
            refill_versions=s.rollout.refill_versions if s.mode == "laminar" else 0,
            refresh_wait_s=s.rollout.refresh_wait_s,
            notify=(self.status_changed,),
            metrics=self.metrics,
            log=self.log,
        )
        self.deliverer = Deliverer(
            self.node_id,
            self.buffer,
            self.table,
            outbox=self.outbox,
            latest_version=source.latest_version,
            digest_of=self.gate.digest,
            rewards=self.rewards,
            tokenizer=self.tokenizer,
            spawn=self.spawn,
            metrics=self.metrics,
            log=self.log,
            flush_s=s.rollout.partial_flush_s,
            max_batch_bytes=s.buffer_max_message_bytes // 2,
        )
        if self.processor is not None:
            self.turn_images = TurnImages(
                self.processor, s.image_limits, self.table.images, put=self._put_images
            )
        if env is not None:
            from laminar.envs.template import TurnTemplate
            from laminar.rollout.episodes import EpisodeDriver

            placeholder = "" if self.turn_images is None else self.turn_images.placeholder
            self.episodes = EpisodeDriver(
                env,
                template=TurnTemplate(self.tokenizer, image_placeholder=placeholder),
                images=self.turn_images,
                tools=self.tools,
                limits=limits,
                params=params,
                max_total=max_total,
                engine=engine,
                table=self.table,
                deliverer=self.deliverer,
                spawn=self.spawn,
                metrics=self.metrics,
                log=self.log,
            )
        if self._has_agents():
            self._build_agents(params)
        self.feeder = PromptFeeder(
            self.node_id,
            s.rollout,
            backoff_max_s=s.transport.reconnect_backoff_max_s,
            buffer=self.buffer,
            gate=self.gate,
            table=self.table,
            deliverer=self.deliverer,
            wake=self.wake,
            spawn=self.spawn,
            metrics=self.metrics,
            log=self.log,
        )
        if self.agents is not None:  # the driver preempts what only a silent agent holds
            self.feeder.on_drain = self.agents.preempt_idle

        if s.colocate is not None:
            from laminar.rollout.colocate import DeviceShare

            self.share = DeviceShare(
                engine=engine,
                table=self.table,
                gate=self.gate,
                feeder=self.feeder,
                deliverer=self.deliverer,
                wake=self.wake,
                keep_weights=s.colocate.rollout_weights == "offload",
                sleep_timeout_s=s.colocate.sleep_timeout_s,
                wake_timeout_s=s.colocate.wake_timeout_s,
                metrics=self.metrics,
                log=self.log,
            )

    def _has_agents(self) -> bool:
        return bool(self.settings.agent.fn or self.settings.agent.remote)

    def _build_agents(self, params: SamplingParams) -> None:
        import os

        from laminar.agents.render import ChatRenderer
        from laminar.rollout.agent_calls import AgentCalls
        from laminar.rollout.agent_episode import EpisodeIndex
        from laminar.rollout.agents import AgentDriver, AgentSettings
        from laminar.rollout.openai_api import EndpointLimits, OpenAIEndpoint

        s, ac = self.settings, self.settings.agent
        assert self.engine is not None
        settings = AgentSettings(
            ac,
            remote_key=os.environ.get(ac.remote_key_env, "") if ac.remote else "",
            endpoints_dir=str(s.agent_endpoints),
            node_id=self.node_id,
            reward_min=s.reward.min_value,
            reward_max=s.reward.max_value,
        )
        placeholder = "" if self.turn_images is None else self.turn_images.placeholder
        renderer = ChatRenderer(self.tokenizer, image_placeholder=placeholder)
        live = EpisodeIndex()
        self.agent_calls = AgentCalls(
            ac,
            max_total=s.env.limits.max_total_tokens or params.max_tokens,
            max_prompt_tokens=s.max_prompt_tokens,
            renderer=renderer,
            params=params,
            engine=self.engine,
            table=self.table,
            deliverer=self.deliverer,
            live=live,
            metrics=self.metrics,
            log=self.log,
            images=self.turn_images,
        )
        self.agents = AgentDriver(
            settings,
            calls=self.agent_calls,
            live=live,
            engine=self.engine,
            table=self.table,
            deliverer=self.deliverer,
            spawn=self.spawn,
            metrics=self.metrics,
            log=self.log,
        )
        self.table.on_start = self.agents.start
        self.table.on_unpark = self.agents.unparked
        self.endpoint = OpenAIEndpoint(
            self.agents,
            model_name=s.model_name,
            token_text=renderer.token_text,
            decode=renderer.decode,
            host=ac.host,
            port=ac.port + self.index if ac.port else 0,
            limits=EndpointLimits(
                max_body_bytes=ac.max_body_bytes,
                read_timeout_s=ac.read_timeout_s,
                max_connections=ac.max_connections,
                check_model_name=ac.check_model_name,
            ),
            metrics=self.metrics,
            log=self.log,
        )

    async def _start_agents(self) -> None:
        """The endpoint listens, then the agent workers start (they are handed its address)."""
        assert self.agents is not None and self.endpoint is not None
        assert self.agent_calls is not None
        url = await self.endpoint.start()
        self.on_close(self.endpoint.close)
        self.on_close(self.agent_calls.close)
        self.on_close(self.agents.close)
        await self.agents.start_workers(url + "/v1")

    def _restream_all(self) -> Any:
        # the buffer connects before the engine is up: nothing in flight to restream yet
        return self.table.restream_all() if self.engine_ready.is_set() else None

    async def _register(self) -> None:
        await super()._register()
        assert self.manager is not None
        self.manager.on(ExportRequest, self._on_export)
        self.manager.on(ImportRequest, self._on_import)
        self.manager.on(RefreshRequest, self._on_refresh)
        self.manager.on(SleepRequest, self._on_sleep)
        self.manager.on(WakeRequest, self._on_wake)
        # registered: the manager sees starting_engine in the beats while the engine starts; the
        # node is ready once it has (a start that fails or times out stops the node instead)
        await _first(self.engine_ready, self.stopping)

    async def main(self) -> None:
        await self.engine_ready.wait()  # the engine-start task fails the node past its deadline
        self.spawn(self._events(), "events")
        self.spawn(self.deliverer.stream(), "partials")
        self.spawn(self._attest(), "attest")
        self.spawn(self.outbox.run(), "outbox")
        self.spawn(self.gate.watch(self.wake), "versions")
        if self.table.interrupts:  # mode partial: an update interrupts at once (feeder.py)
            updated = asyncio.Event()
            self.spawn(self.gate.watch(updated), "versions-interrupt")
            self.spawn(self.feeder.interrupt_on_update(updated), "interrupts")
        if self.episodes is not None:
            self.spawn(self.episodes.watch(), "episode-clock")
        s = self.settings
        if s.rollout.status_push and s.mode == "laminar" and s.repack:
            self.spawn(self._status_push(), "status-push")  # only repack plans from a fresh view
        await self.feeder.run()
        await asyncio.Event().wait()  # stopping: drain() runs while main is still alive

    async def drain(self) -> None:
        if not self.engine_ready.is_set():
            return  # stopped while the engine was starting: nothing was taken yet
        self.feeder.stop()
        budget = self.settings.transport.stop_timeout_s * 0.9
        deadline = time.monotonic() + budget
        await self.table.wait_empty(budget / 2)
        if (
            self.episodes is not None and self.episodes.finishing
        ):  # environments scoring the last ones
            await asyncio.wait(
                set(self.episodes.finishing), timeout=max(0.0, deadline - time.monotonic())
            )
        ok = await self.deliverer.drain(max(0.0, deadline - time.monotonic()))
        self.log.info(
            "drained",
            unfinished=len(self.table),
            outbox_left=len(self.outbox),
            flushed=ok,
            trajectories=self.deliverer.finished_count,
        )
        if self.settings.rollout.engine == "vllm" and self.engine is not None:
            # vLLM's shutdown takes seconds (EngineCore, worker): here, while the node still beats,
            # not in teardown after the heartbeats stopped (peers would call this node dead)
            await self.engine.close()

    def status(self) -> NodeStatus:
        if not self.engine_ready.is_set():
            waited = time.monotonic() - self.engine_started_at if self.engine_started_at else 0.0
            ro = self.settings.rollout
            deadline = ro.engine_start_timeout_s
            note = (
                f"starting_engine: {ro.engine} engine starting for {waited:.0f} s "
                f"(deadline {deadline:g} s)"
            )
            return NodeStatus(
                node_id=self.node_id,
                role=self.role,
                version=-1,
                state=STARTING_ENGINE,
                warnings=[note],
                extra={"engine_start_s": round(waited, 1), "engine_deadline_s": deadline},
            )
        assert self.engine is not None
        st = self.engine.stats()
        scoring, scoring_oldest_s = self.deliverer.scoring()
        rollout = RolloutStatus(
            # per-trajectory KV (tokens held) lets the manager's repack pick what to move
            traj_tokens=self.table.kv_tokens(),
            kv_capacity_tokens=self.engine.capacity,
            measured_at=round(time.time(), 4),
            target_version=self.gate.target(),
            groups=len(self.table.groups),
            held=len(self.feeder.held),
            credits_free=self.feeder.free_credits(),
            outbox=len(self.outbox),
            outbox_oldest_s=round(self.outbox.oldest_age_s(), 3),
            scoring=scoring,
            scoring_oldest_s=round(scoring_oldest_s, 3),
            finished=self.deliverer.finished_count,
            tokens=st.tokens_generated,
            reward_errors=self.rewards.stats["errors"] if self.rewards is not None else 0,
            max_running=self.engine.max_running or self.settings.rollout.max_running,
            agent=self.endpoint.figures() if self.endpoint is not None else {},
            outbox_dropped=self.outbox.stats["abandoned"],
            asleep=self.share is not None and self.share.asleep,
        )
        return NodeStatus(
            node_id=self.node_id,
            role=self.role,
            version=self.gate.version,
            kv_use=st.kv_use,
            running=st.running,
            waiting=st.waiting,
            inflight=len(self.table),
            rollout=rollout,
            weights_digest=self.gate.digest(self.gate.version),
            attest_mismatches=self.gate.mismatches,
        )

    # ---- loops ------------------------------------------------------------------------------
    async def _attest(self) -> None:
        """Compare the served digest with the trainer's, as the manager's heartbeats carry it
        (laminar/rollout/versions.py: a mismatch quarantines and reloads)."""
        every = self.settings.transport.heartbeat_interval_s
        while True:
            assert self.manager is not None
            status = NODE_STATUS.unpack(self.manager.server_status)
            if (
                status is not None
                and status.expected_digests
                and self.gate.attest(status.expected_digests)
            ):
                self.wake.set()  # the feeder stops taking prompts and reloads once idle
            await asyncio.sleep(every)  # the manager's status changes only with its heartbeats

    async def _events(self) -> None:
        """Engine events: tokens into the table (and to a streamed agent call); finished ones to
        the deliverer; chunks to stream."""
        assert self.engine is not None
        chunk = self.settings.rollout.partial_chunk_tokens
        async for ev in self.engine.events():
            seq = self.table.on_event(ev)
            if seq is None:
                continue
            if ev.finished:
                if seq.exporting and ev.finish_reason == "abort":
                    continue  # the export handler owns it now
                if self.agent_calls is not None and self.agent_calls.owns(seq.uid):
                    self.agent_calls.turn_ended(seq, ev.finish_reason or "stop")  # it answers
                    continue
                if self.episodes is not None and ev.finish_reason in ("stop", "length"):
                    self.episodes.turn_ended(
                        seq, ev.finish_reason
                    )  # its environment answers, or it ends
                    continue
                self.table.forget(seq.uid)
                self.deliverer.finished(seq, ev.finish_reason or "stop")
            else:
                if self.agent_calls is not None and self.agent_calls.streams:
                    self.agent_calls.progressed(seq)  # a streamed call's tokens, as they come
                if seq.length - seq.sent_upto >= chunk:
                    self.table.mark_dirty(seq.uid)

    async def _status_push(self) -> None:
        """Send the status as soon as it changed, not only on the next beat: repack plans from it,
        and a plan made on a view up to a beat old moves trajectories that have finished meanwhile
        onto rollouts that have refilled or refreshed meanwhile. At most one push per
        status_push_min_s; changes in between go out together. Best effort: the beat timer still
        carries it."""
        gap = self.settings.rollout.status_push_min_s
        while True:
            await self.status_changed.wait()
            self.status_changed.clear()
            mgr = self.manager
            # (not connected: reconnecting; the handshake and the beats carry the status)
            if mgr is not None and mgr.connected:
                try:
                    await mgr.beat()
                    self.metrics.count("status_pushed")
                # best effort (a socket being replaced, a full pipe): the beat follows
                except Exception as exc:
                    self.metrics.count("status_push_failed")
                    self.log.debug("status_push_failed", error=str(exc))
            # the rate bound (a timer): what changes meanwhile goes in the next push
            await asyncio.sleep(gap)

    # ---- manager commands ------------------------------------------------------------------
    def _not_ready(self) -> ErrorReply | None:
        if self.engine_ready.is_set():
            return None
        return ErrorReply(
            code=STARTING_ENGINE, message=f"{self.node_id} is still starting its engine"
        )

    async def _on_export(self, peer: Peer, msg: ExportRequest) -> ExportReply | ErrorReply:
        if (busy := self._not_ready()) is not None:
            return busy
        partials, missing = await self.table.export(list(msg.uids), self.node_id)
        if self.agents is not None:  # their agents follow them (a call in flight answers 421)
            self.agents.release([p.uid for p in partials], msg.dest)
        self.metrics.count("exported", len(partials))
        self.log.info("exported", count=len(partials), missing=len(missing))
        return ExportReply(partials=partials, missing=missing, version=self.gate.version)

    async def _on_import(self, peer: Peer, msg: ImportRequest) -> ImportReply | ErrorReply:
        if (busy := self._not_ready()) is not None:
            return busy
        if self.share is not None and self.share.asleep:  # placed again once it is awake
            return ErrorReply(code=ASLEEP, message=f"{self.node_id} is asleep (colocated)")
        if (refused := await self._fetch_images(msg.partials)) is not None:
            return refused
        async with self.gate.lock:  # the version cannot change under an import
            version = self.gate.version
            # mode partial: an older one continues under this version (AReaL's partial rollout)
            newer = self.table.interrupts
            wrong = [
                p.uid
                for p in msg.partials
                if (newest_version(p) > version if newer else p.version != version)
            ]
            if wrong:
                self.metrics.count("import_rejected", len(msg.partials))
                return ErrorReply(
                    code=VERSION_MISMATCH,
                    message=f"{self.node_id} is at version {version}; "
                    f"{len(wrong)} partial(s) are not (e.g. {wrong[0]})",
                )
            bad = [
                p.uid
                for p in msg.partials
                if len(p.prompt_ids) == 0
                or len(p.response_ids) != len(p.logprobs)
                or (p.loss_mask is not None and len(p.loss_mask) != len(p.response_ids))
                or (
                    p.routes is not None and len(p.routes) > len(p.prompt_ids) + len(p.response_ids)
                )
            ]
            if bad:
                self.metrics.count("import_bad", len(bad))
                return ErrorReply(
                    code="bad_partial",
                    message=f"empty prompt or lengths differ (logprobs, mask, routes): {bad[:3]}",
                )
            accepted, duplicate = self.table.resume(msg.partials, version if newer else None)
            if self.episodes is not None:  # their environment state is rebuilt by replay first
                for uid in accepted:
                    self.episodes.adopt(self.table.seqs[uid])
            if self.agents is not None:  # their agents call here next (or they start again)
                for uid in accepted:
                    self.agents.adopt(self.table.seqs[uid])
        self.metrics.count("imported", len(accepted))
        self.log.info("imported", count=len(accepted), duplicate=len(duplicate))
        return ImportReply(accepted=accepted, duplicate=duplicate, version=version)

    async def _put_images(self, digests: list[str], data: list[bytes]) -> None:
        """Images a later turn added, to their owner (the buffer), which holds them durably before
        it answers; raises BadImage when it refused one (TurnImages.publish)."""
        reply = await self.buffer.request(
            ImagePut(digests=digests, data=data), timeout=self.settings.transport.request_timeout_s
        )
        if not isinstance(reply, ImagePutReply):
            raise BadImage(f"the buffer answered ImagePut with {type(reply).__name__}")
        if reply.refused:
            raise BadImage(f"the buffer refused {len(reply.refused)} image(s): {reply.reason}")
        self.metrics.count("turn_images_put", len(digests))
        self.metrics.count("turn_image_bytes_put", sum(len(d) for d in data))

    async def _fetch_images(self, partials: list[PartialTrajectory]) -> ErrorReply | None:
        """The images of imported partials this rollout lacks, from their owner (the buffer) by
        digest, each checked against it; None when all are here (docs/vision.md)."""
        cache = self.table.images
        need = cache.missing(d for p in partials for d in p.image_digests)
        if not need:
            return None
        try:
            reply = await self.buffer.request(
                ImageFetch(digests=need), timeout=self.settings.transport.request_timeout_s
            )
            if not isinstance(reply, ImageBlobs) or reply.missing:
                missing = reply.missing if isinstance(reply, ImageBlobs) else need
                raise BadImage(f"the buffer does not hold {len(missing)} image(s)")
            cache.add_fetched(reply.digests, reply.data)
        except (BadImage, TransportError, RemoteError, TimeoutError) as exc:
            self.metrics.count("import_bad_images", len(partials))
            self.log.warning("import_images_failed", count=len(need), error=str(exc))
            return ErrorReply(code="bad_image", message=f"images of the import: {exc}")
        self.metrics.count("images_fetched", len(need))
        return None

    async def _on_sleep(self, peer: Peer, msg: SleepRequest) -> SleepReply | ErrorReply:
        if (busy := self._not_ready()) is not None:
            return busy
        if self.share is None:
            return ErrorReply(code="not_colocated", message=f"{self.node_id} is not colocated")
        self.log.info("colocate_sleep_asked", trainer_version=msg.version)
        reply = await self.share.sleep()
        self.status_changed.set()
        return reply

    async def _on_wake(self, peer: Peer, msg: WakeRequest) -> WakeReply | ErrorReply:
        if (busy := self._not_ready()) is not None:
            return busy
        if self.share is None:
            return ErrorReply(code="not_colocated", message=f"{self.node_id} is not colocated")
        reply = await self.share.wake(msg.min_version)
        self.status_changed.set()
        return reply

    async def _on_refresh(self, peer: Peer, msg: RefreshRequest) -> RefreshReply | ErrorReply:
        if (busy := self._not_ready()) is not None:
            return busy
        pending = self.gate.ask(msg.min_version)
        self.wake.set()
        return RefreshReply(version=self.gate.version, pending=pending)


async def _first(*events: asyncio.Event) -> None:
    """Wait until any of `events` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
