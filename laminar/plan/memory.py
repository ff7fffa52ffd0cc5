"""The memory plan of a run: per-GPU peak of each process against the GPU, and what to change.

    plan = make_plan(cfg, Hardware(gpu_gib=80, gpus_per_node=8, trainer_gpus=4))
    print(format_plan(plan)); sys.exit(0 if plan.fits else 1)

    laminar plan configs/qwen2.5-7b-vllm.yaml --gpu-mem 80 --gpus-per-node 8 [key=value ...]

Processes, each on its GPU(s):
- trainer rank: measured (laminar/plan/trainer.py: the real TorchTrainer and step on fake
  tensors under torch's FSDPMemTracker) for the configured FSDP world, micro-batch, precision,
  checkpointing.
- evaluator (trainer/evaluation.py): a copy of the model in model.dtype plus a KV cache of
  rollout.max_running x max_model_len, on trainer rank 0's GPU when trainer.eval_device puts it
  there (added to that rank's figure), else not on a GPU.
- rollout: vLLM takes gpu_memory_utilization of its GPU and must hold the weights (model.dtype),
  an activation headroom (an estimate: vLLM profiles it at start) and the KV cache of
  max_running x max_model_len tokens; the torch engine holds the weights, the lean forward's fused
  q/k/v and gate/up copies (unless rollout.torch_forward is hf) and its paged KV pool of
  rollout.kv_capacity_tokens positions (default max_running x max_model_len), in whole blocks.
- a weight version: its bytes (model.dtype) and estimated times (device-to-host copy, one relay
  hop) from stated bandwidths.
- colocated placement (cluster.placement=colocated): the trainer rank and its rollout are one
  line, "colocated GPU", whose peak is the larger phase plus what stays resident through it:
  trainer phase = the trainer's peak + what the sleeping rollout keeps (vLLM level 1: ~1 GiB of
  context and graphs, est.; the torch engine: nothing) + the cuda_ipc version buffer; rollout
  phase = the rollout's figure + the trainer state left on the device (fp32 parameters unless
  cluster.colocate.offload_params, 2 x fp32 AdamW state unless offload_optimizer) + that buffer.
  When it does not fit, the line names an offload setting left off first, else the larger
  phase's own field.

A process whose figure exceeds `limit` (default 90%) of the GPU fails the plan, and its line names
the setting to change. Models are never downloaded: the shape is model.path/config.json, or the
committed one in configs/shapes/<name of model.path>/config.json.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from laminar.config import LaminarConfig
from laminar.models.moe import MoeShape, moe_parameter_count
from laminar.plan.trainer import TrainerMemory
from laminar.plan.vision import VisionPlan, text_shape, vision_plan

GIB = 1 << 30
SHAPES = Path(__file__).resolve().parents[2] / "configs" / "shapes"
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Hardware:
    gpu_gib: float = 80.0
    """Memory of one GPU (GiB)."""
    gpus_per_node: int = 8
    trainer_gpus: int | None = None
    """Trainer ranks per trainer node (default: half the node, as the sbatch launcher)."""
    trainer_nodes: int = 1
    limit: float = 0.9
    """The share of a GPU a process may plan to use."""
    d2h_bytes_per_s: float = 20e9
    """Device-to-host copy bandwidth assumed for a weight version (PCIe 4 x16, pinned)."""
    link_bytes_per_s: float = 12.5e9
    """Relay-to-relay bandwidth assumed (100 Gb/s) unless relay.link_bytes_per_s is set."""

    @property
    def trainer_world(self) -> int:
        per_node = self.trainer_gpus if self.trainer_gpus is not None else self.gpus_per_node // 2
        return max(1, per_node) * self.trainer_nodes


@dataclass
class ProcessPlan:
    process: str
    peak_bytes: int
    limit_bytes: int
    detail: str
    field: str = ""
    """The setting to change when it does not fit ("" when it fits)."""
    advice: str = ""

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.limit_bytes


@dataclass
class MoePlan:
    """Where a mixture-of-experts policy's bytes go on the trainer, and what expert parallelism
    (EP) of degree `ep` would change (figures per trainer rank; fp32 master weights, fp32
    gradients, AdamW's two fp32 moments: 16 bytes per trained parameter)."""

    experts: int
    top_k: int
    moe_layers: int
    expert_params: int
    """Every expert's gate/up/down of every MoE layer."""
    router_params: int
    """The routers (experts x hidden per MoE layer)."""
    active_params: int
    """Parameters one token runs through (dense parts + top_k experts per MoE layer)."""
    expert_state_bytes: int
    """Per rank under FSDP x world: the experts' parameters, gradients and AdamW state."""
    expert_optimizer_bytes: int
    """Of those, AdamW's moments."""
    router_state_bytes: int
    """Per rank: the routers' parameters, gradients and AdamW state."""
    ep: int
    """The EP degree figured (the largest divisor of the expert count up to the trainer world)."""
    gathered_layer_bytes: int
    """FSDP: one MoE layer's experts gathered for its forward (trainer.param_dtype)."""
    gathered_layer_bytes_ep: int
    """EP x ep: a rank gathers only its experts/ep experts of the layer."""
    expert_gather_bytes_per_step: int
    """FSDP: expert weights a rank receives per micro-batch (forward + backward's re-gather)."""
    all_to_all_bytes_per_step: int
    """EP x ep instead: tokens a rank sends and receives per micro-batch (dispatch + combine of
    each routed copy, forward and backward, every MoE layer)."""


@dataclass
class Plan:
    config: str
    hardware: Hardware
    processes: list[ProcessPlan] = field(default_factory=list)
    weight_version_bytes: int = 0
    weight_stall_s: float = 0.0
    """Estimated trainer stall per version: the bf16 copy to the host."""
    weight_hop_s: float = 0.0
    """Estimated time of one relay hop for a version."""
    notes: list[str] = field(default_factory=list)
    vision: dict[str, int] = field(default_factory=dict)
    """A vision-language model's figures (laminar/plan/vision.py); empty for a text model."""
    moe: MoePlan | None = None
    """A mixture-of-experts policy's expert figures (None: dense)."""

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.processes)

    def to_json(self) -> str:
        out = asdict(self)
        out["fits"] = self.fits
        for p, d in zip(self.processes, out["processes"], strict=True):
            d["fits"] = p.fits
        return json.dumps(out, indent=1)


def shape_dir(cfg: LaminarConfig) -> Path:
    """Where the model's config.json is: model.path, else configs/shapes/<its name>."""
    path = Path(cfg.model.path or "")
    if cfg.model.path and (path / "config.json").is_file():
        return path
    committed = SHAPES / path.name
    if path.name and (committed / "config.json").is_file():
        return committed
    raise FileNotFoundError(
        f"no config.json for model.path={cfg.model.path!r}: neither {path / 'config.json'} nor "
        f"{committed / 'config.json'} exists (download the model, or commit its config.json there)"
    )


def _kv_bytes_per_token(shape: dict[str, Any], dtype_bytes: int) -> int:
    heads = int(shape["num_attention_heads"])
    head_dim = int(shape.get("head_dim") or int(shape["hidden_size"]) // heads)
    kv_heads = int(shape.get("num_key_value_heads") or heads)
    return 2 * int(shape["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes


def _model_len(cfg: LaminarConfig, shape: dict[str, Any]) -> int:
    return int(cfg.rollout.max_model_len or shape.get("max_position_embeddings") or 4096)


def _trainer_advice(cfg: LaminarConfig, mem: TrainerMemory, limit: int) -> tuple[str, str]:
    tc = cfg.trainer
    if not tc.activation_checkpointing:
        return "trainer.activation_checkpointing", "set it true (recompute each layer in backward)"
    # the state (sharded parameters, gradients, AdamW) stays; the rest scales with the tokens
    state = sum(
        v
        for k, v in mem.parts.items()
        if any(w in k.lower() for w in ("param", "grad", "opt")) and "unsharded" not in k.lower()
    )
    if state >= limit:
        return "trainer GPUs", "the sharded state alone exceeds the GPU: add trainer ranks"
    share = (limit - state) / max(1, mem.peak_bytes - state)
    want = max(256, int(tc.micro_batch_tokens * share * 0.95) // 256 * 256)
    return "trainer.micro_batch_tokens", f"lower it to about {want}, or add trainer GPUs"


def make_plan(cfg: LaminarConfig, hw: Hardware, config_name: str = "") -> Plan:
    from laminar.plan.trainer import read_shape, trace_trainer
    from laminar.wiring.trainer import trainer_settings

    plan = Plan(config=config_name, hardware=hw)
    limit = int(hw.gpu_gib * GIB * hw.limit)
    shape_path = shape_dir(cfg)
    shape = read_shape(shape_path)
    vis = vision_plan(shape, shape_path, cfg.data)
    scratch = None
    if vis is not None:  # the language model is traced alone; the tower is counted below
        scratch = tempfile.TemporaryDirectory(prefix="laminar-plan-")
        shape = text_shape(shape)
        shape_path = Path(scratch.name)
        (shape_path / "config.json").write_text(json.dumps(shape))
    model_bytes = _DTYPE_BYTES.get(cfg.model.dtype, 4)
    model_len = _model_len(cfg, shape)
    kv_token = _kv_bytes_per_token(shape, model_bytes)
    params = 0
    trainer_peak = 0
    mem: TrainerMemory | None = None
    # trainer
    if cfg.trainer.engine == "torch":
        world = hw.trainer_world
        mem = trace_trainer(trainer_settings(cfg), shape_path, world, device="cuda")
        params = mem.params
        trainer_peak = mem.peak_bytes
        if vis is not None:  # frozen tower: fp32 weights sharded, one block's activations
            tower = vis.params * 4 // world + vis.tower_activation_bytes(mem.rows, 2)
            mem.parts["vision tower"] = tower
            trainer_peak += tower
            mem.peak_bytes = trainer_peak
        top = sorted(
            ((k, v) for k, v in mem.parts.items() if k != "vision tower"), key=lambda kv: -kv[1]
        )[:4]
        parts = ", ".join(f"{k.lower()} {v / GIB:.1f}" for k, v in top)
        traced = (
            "traced whole"
            if len(mem.traced_layers) == 1
            else f"traced at {mem.traced_layers[0]} and {mem.traced_layers[1]} layers (the split "
            f"is at {mem.traced_layers[1]}), extrapolated to {mem.layers}"
        )
        sharding = f"FSDP x{world}" if world > 1 else "one process"
        detail = (
            f"{sharding}, micro-batch {mem.rows} x {mem.row_tokens} tokens, checkpointing "
            f"{'on' if cfg.trainer.activation_checkpointing else 'off'}; {parts} GiB; {traced}"
        )
        if vis is not None:
            detail += f"; vision tower (frozen) {mem.parts['vision tower'] / GIB:.1f} GiB"
        trainer_plan = ProcessPlan("trainer rank", trainer_peak, limit, detail)
        if not trainer_plan.fits:
            trainer_plan.field, trainer_plan.advice = _trainer_advice(cfg, mem, limit)
        plan.processes.append(trainer_plan)
    if not params:
        params = _param_count(shape)
    if vis is not None:
        params += vis.params
        _vision_notes(plan, cfg, vis)
    moe = MoeShape.of_config(shape)
    if moe is not None:
        plan.moe = _moe_plan(cfg, shape, moe, params, hw.trainer_world)
        plan.notes.extend(_moe_notes(plan.moe))
    if scratch is not None:
        scratch.cleanup()
    weights = params * model_bytes
    # evaluator
    if cfg.trainer.engine == "torch" and cfg.trainer.eval_every > 0 and cfg.data.eval:
        ev_kv = cfg.rollout.max_running * model_len * kv_token
        ev = weights + ev_kv
        where = cfg.trainer.eval_device
        if where == "trainer":
            ep = ProcessPlan(
                "trainer rank 0 + evaluator",
                trainer_peak + ev,
                limit,
                f"evaluator on rank 0's GPU: weights {weights / GIB:.1f} + KV "
                f"{cfg.rollout.max_running} x {model_len} tokens {ev_kv / GIB:.1f} GiB",
            )
            if not ep.fits:
                ep.field = "trainer.eval_device"
                ep.advice = "auto (off on GPU trainers) or cpu"
            plan.processes.append(ep)
        else:
            plan.notes.append(
                f"evaluator: trainer.eval_device={where}: not on a GPU (it would add "
                f"{ev / GIB:.1f} GiB to trainer rank 0)"
            )
    # rollouts
    ro = cfg.rollout
    if ro.engine == "vllm":
        util = float(ro.vllm_args.get("gpu_memory_utilization", ro.vllm.gpu_memory_utilization))
        seqs = int(ro.vllm_args.get("max_num_seqs", ro.vllm.max_num_seqs or ro.max_running))
        tp = int(ro.vllm_args.get("tensor_parallel_size", 1))
        taken = int(util * hw.gpu_gib * GIB)
        # tensor parallel: each GPU holds 1/tp of the weights and of every token's KV
        weights_gpu = weights // tp
        headroom = int(0.1 * weights_gpu) + GIB
        kv_need = seqs * model_len * kv_token // tp
        kv_room = taken - weights_gpu - headroom
        detail = (
            f"vLLM takes {util:.2f} of each of its {tp} GPU(s): weights {weights_gpu / GIB:.1f}, "
            "headroom "
            f"{headroom / GIB:.1f} (est.), KV {seqs} x {model_len} tokens {kv_need / GIB:.1f} GiB "
            f"(room for {max(0, kv_room) / GIB:.1f})"
        )
        rp = ProcessPlan("rollout (vllm)", taken, limit, detail)
        if not rp.fits:
            rp.field, rp.advice = "rollout.vllm.gpu_memory_utilization", f"at most {hw.limit}"
        elif kv_room < kv_need:
            # vLLM still runs, with fewer sequences than asked: a plan failure, not a crash
            rp.peak_bytes = weights_gpu + headroom + kv_need
            rp.limit_bytes = taken
            rp.field = "rollout.max_running"
            fit = max(0, kv_room) * tp // max(1, model_len * kv_token)
            rp.advice = f"the KV cache holds {fit} sequences of max_model_len; lower it"
        plan.processes.append(rp)
    elif ro.engine == "torch" and cfg.model.device.startswith("cuda"):
        plan.processes.append(_torch_rollout(cfg, shape, weights, model_bytes, model_len, limit))
    if cfg.cluster.placement == "colocated":
        _colocate(plan, cfg, mem, weights, limit)
    # a weight version
    plan.weight_version_bytes = weights
    plan.weight_stall_s = weights / hw.d2h_bytes_per_s
    link = cfg.relay.link_bytes_per_s or hw.link_bytes_per_s
    plan.weight_hop_s = weights / link
    plan.notes.append(
        f"a weight version: {weights / GIB:.1f} GiB ({cfg.model.dtype}); trainer stall ~"
        f"{plan.weight_stall_s:.2f} s at {hw.d2h_bytes_per_s / 1e9:.0f} GB/s device-to-host, "
        f"~{plan.weight_hop_s:.2f} s a relay hop at {link / 1e9:.1f} GB/s (estimates)"
    )
    return plan


def _vision_notes(plan: Plan, cfg: LaminarConfig, vis: VisionPlan) -> None:
    """The vision figures: a note each, and `plan.vision` for --json."""
    plan.vision = {
        "tower_params": vis.params,
        "image_pixels": vis.image_pixels,
        "image_tokens": vis.image_tokens,
        "patches": vis.patches,
    }
    plan.notes.append(
        f"vision tower: {vis.params / 1e6:.0f}M parameters (depth {vis.depth}, width {vis.dim}), "
        f"counted in the trainer (frozen: fp32 weights sharded + one block's activations) and "
        f"in every rollout's weights"
    )
    budget = cfg.data.max_prompt_tokens
    line = (
        f"images: {vis.image_pixels} pixels at most (the processor's max_pixels, "
        f"data.max_image_pixels) = {vis.patches} patches = {vis.image_tokens} image tokens per "
        f"image in the sequence, against data.max_prompt_tokens={budget}"
    )
    if vis.image_tokens >= budget:
        line += (
            "; a prompt with one such image is skipped as too long: raise data.max_prompt_tokens "
            "or lower the processor's max_pixels"
        )
    plan.notes.append(line)


_VLLM_ASLEEP = 1 * GIB
"""What a vLLM engine keeps on its GPU asleep at level 1 (CUDA context, graphs): an estimate."""


def _colocate(
    plan: Plan, cfg: LaminarConfig, mem: TrainerMemory | None, weights: int, limit: int
) -> None:
    """Replace the trainer's and the rollout's lines with the one GPU they time-share."""
    trainer = next((p for p in plan.processes if p.process == "trainer rank"), None)
    rollout = next((p for p in plan.processes if p.process.startswith("rollout")), None)
    if trainer is None or rollout is None:
        plan.notes.append("colocated: no trainer or rollout on a GPU to pair")
        return
    cc = cfg.cluster.colocate
    params = mem.params if mem is not None else 0
    trainable = mem.trainable_params if mem is not None else 0
    keep_params = 0 if cc.offload_params else 4 * params  # fp32 master weights
    keep_optim = 0 if cc.offload_optimizer else 8 * trainable  # AdamW exp_avg + exp_avg_sq
    ipc = weights if cfg.rollout.weights == "cuda_ipc" else 0  # the handoff buffer, both phases
    asleep = _VLLM_ASLEEP if cfg.rollout.engine == "vllm" else 0
    train_phase = trainer.peak_bytes + asleep + ipc
    roll_phase = rollout.peak_bytes + keep_params + keep_optim + ipc
    gib = 1 / GIB
    detail = (
        f"trainer phase {train_phase * gib:.1f} (trainer {trainer.peak_bytes * gib:.1f} + rollout "
        f"asleep {asleep * gib:.1f} + cuda_ipc buffer {ipc * gib:.1f}); rollout phase "
        f"{roll_phase * gib:.1f} (rollout {rollout.peak_bytes * gib:.1f} + trainer resident: "
        f"parameters {keep_params * gib:.1f}, AdamW {keep_optim * gib:.1f} + cuda_ipc buffer "
        f"{ipc * gib:.1f}) GiB"
    )
    both = ProcessPlan("colocated GPU", max(train_phase, roll_phase), limit, detail)
    if not both.fits:
        if roll_phase >= train_phase and not cc.offload_optimizer and keep_optim:
            both.field, both.advice = "cluster.colocate.offload_optimizer", "set it true"
        elif roll_phase >= train_phase and not cc.offload_params and keep_params:
            both.field, both.advice = "cluster.colocate.offload_params", "set it true"
        elif roll_phase >= train_phase:
            both.field = rollout.field or (
                "rollout.vllm.gpu_memory_utilization"
                if cfg.rollout.engine == "vllm"
                else "rollout.kv_capacity_tokens"
            )
            both.advice = rollout.advice or "lower it: the rollout phase is the larger one"
        else:
            both.field = trainer.field or "trainer.micro_batch_tokens"
            both.advice = trainer.advice or "lower it: the trainer phase is the larger one"
    plan.processes = [p for p in plan.processes if p not in (trainer, rollout)] + [both]


def _torch_rollout(
    cfg: LaminarConfig,
    shape: dict[str, Any],
    weights: int,
    dtype_bytes: int,
    model_len: int,
    limit: int,
) -> ProcessPlan:
    """The torch engine's GPU: weights, the lean forward's fused copies, the paged KV pool, and a
    decode step's gather of one layer's blocks (max_running rows of the longest sequence, K and V;
    freed after each layer). SDPA's own workspace is not counted (the limit's margin)."""
    from laminar.engines.kv_cache import BLOCK_TOKENS, pool_positions

    ro = cfg.rollout
    asked = ro.kv_capacity_tokens or ro.max_running * model_len
    positions = pool_positions(asked, ro.max_running, model_len)
    kv_token = _kv_bytes_per_token(shape, dtype_bytes)
    kv = positions * kv_token
    fused = 0 if ro.torch_forward == "hf" else _fused_bytes(shape, dtype_bytes)
    longest = min(pool_positions(model_len) - BLOCK_TOKENS, positions - BLOCK_TOKENS)
    gather = ro.max_running * longest * kv_token // int(shape["num_hidden_layers"])
    source = (
        "rollout.kv_capacity_tokens"
        if ro.kv_capacity_tokens
        else f"kv_capacity_tokens unset: {ro.max_running} x {model_len}"
    )
    rp = ProcessPlan(
        "rollout (torch)",
        weights + fused + kv + gather,
        limit,
        f"weights {weights / GIB:.1f} + fused q/k/v, gate/up copies {fused / GIB:.1f} + KV pool "
        f"{positions} positions ({source}) {kv / GIB:.1f} + decode gather {gather / GIB:.1f} GiB",
    )
    if rp.fits:
        return rp
    room = limit - weights - fused - gather
    if room >= BLOCK_TOKENS * kv_token:
        fit = room // kv_token // BLOCK_TOKENS * BLOCK_TOKENS - BLOCK_TOKENS
        rp.field = "rollout.kv_capacity_tokens"
        rp.advice = f"about {fit} positions fit next to the weights; set it at most that"
    elif fused and weights < limit:
        rp.field, rp.advice = "rollout.torch_forward", "hf (no fused weight copies)"
    else:
        rp.field, rp.advice = "rollout.engine", "vllm with tensor_parallel_size > 1"
    return rp


def _fused_bytes(shape: dict[str, Any], dtype_bytes: int) -> int:
    """The lean forward's fused q/k/v and gate/up weights (engines/lean_forward.py): a second copy
    of those projections."""
    d, i, n = int(shape["hidden_size"]), int(shape["intermediate_size"]), shape["num_hidden_layers"]
    heads = int(shape["num_attention_heads"])
    head_dim = int(shape.get("head_dim") or d // heads)
    kv = int(shape.get("num_key_value_heads") or heads)
    moe = MoeShape.of_config(shape)
    dense = int(n) - (len(moe.layers) if moe is not None else 0)  # routed MLPs: no fused copy
    return (int(n) * d * (heads + 2 * kv) * head_dim + dense * 2 * d * i) * dtype_bytes


def _moe_plan(
    cfg: LaminarConfig, shape: dict[str, Any], moe: MoeShape, params: int, world: int
) -> MoePlan:
    d = int(shape["hidden_size"])
    experts, router = moe_parameter_count(moe, d)
    per_expert = 3 * d * moe.expert_intermediate
    n = len(moe.layers)
    ep = max(e for e in range(1, min(world, moe.experts) + 1) if moe.experts % e == 0)
    gathered = 2 if cfg.model.device.startswith("cuda") else 4  # bf16 gathers on a GPU trainer
    layer_bytes = moe.experts * per_expert * gathered
    tokens = cfg.trainer.micro_batch_tokens
    return MoePlan(
        experts=moe.experts,
        top_k=moe.top_k,
        moe_layers=n,
        expert_params=experts,
        router_params=router,
        active_params=params - experts + n * moe.top_k * per_expert,
        expert_state_bytes=experts * 16 // world,
        expert_optimizer_bytes=experts * 8 // world,
        router_state_bytes=router * 16 // world,
        ep=ep,
        gathered_layer_bytes=layer_bytes,
        gathered_layer_bytes_ep=layer_bytes // ep,
        expert_gather_bytes_per_step=2 * n * layer_bytes * (world - 1) // world,
        # each routed copy of a token goes out and comes back (2), in forward and backward (2)
        all_to_all_bytes_per_step=4 * n * tokens * moe.top_k * d * gathered * (ep - 1) // ep,
    )


def _moe_notes(m: MoePlan) -> list[str]:
    g = GIB
    return [
        f"experts: {m.expert_params / 1e9:.2f}B parameters in {m.moe_layers} MoE layers x "
        f"{m.experts} experts (top-{m.top_k}; {m.active_params / 1e9:.2f}B active per token), "
        f"routers {m.router_params / 1e6:.1f}M; per trainer rank: expert parameters + gradients "
        f"+ AdamW {m.expert_state_bytes / g:.2f} GiB (AdamW {m.expert_optimizer_bytes / g:.2f}), "
        f"routers {m.router_state_bytes / g:.3f} GiB",
        f"expert parallelism x{m.ep} (not built here; FSDP shards the experts like any weight): a "
        f"MoE layer's forward gathers {m.gathered_layer_bytes_ep / g:.2f} GiB of experts instead "
        f"of {m.gathered_layer_bytes / g:.2f}, and a micro-batch moves "
        f"{m.all_to_all_bytes_per_step / g:.2f} GiB of tokens all-to-all instead of gathering "
        f"{m.expert_gather_bytes_per_step / g:.2f} GiB of expert weights; the state per rank stays "
        f"{m.expert_state_bytes / g:.2f} GiB (experts split x{m.ep}, FSDP over the rest)",
    ]


def _param_count(shape: dict[str, Any]) -> int:
    """Parameters of a Llama-family decoder from its config (used when no trainer is traced); a
    mixture-of-experts one counts every expert and router instead of the dense MLP."""
    d, i, n = int(shape["hidden_size"]), int(shape["intermediate_size"]), shape["num_hidden_layers"]
    heads = int(shape["num_attention_heads"])
    head_dim = int(shape.get("head_dim") or d // heads)
    kv = int(shape.get("num_key_value_heads") or heads)
    v = int(shape["vocab_size"])
    attn = d * heads * head_dim * 2 + d * kv * head_dim * 2
    layer = attn + 3 * d * i + 2 * d
    head = 0 if shape.get("tie_word_embeddings") else v * d
    total = int(n) * layer + v * d + head + d
    moe = MoeShape.of_config(shape)
    if moe is not None:
        experts, router = moe_parameter_count(moe, d)
        total += experts + router - len(moe.layers) * 3 * d * i
    return total


def format_plan(plan: Plan) -> str:
    hw = plan.hardware
    lim = hw.gpu_gib * hw.limit
    lines = [
        f"memory plan {plan.config}: GPU {hw.gpu_gib:g} GiB, limit {hw.limit:.0%} = {lim:.1f} GiB,"
        f" {hw.gpus_per_node} GPUs/node, trainer {hw.trainer_world} rank(s)",
        f"{'process':<28} {'peak GiB':>9} {'limit':>7}  verdict",
    ]
    for p in plan.processes:
        verdict = "fits" if p.fits else f"DOES NOT FIT: change {p.field} ({p.advice})"
        if p.fits and p.field:
            verdict = f"fits; {p.field}: {p.advice}"
        lines.append(
            f"{p.process:<28} {p.peak_bytes / GIB:>9.1f} {p.limit_bytes / GIB:>7.1f}  {verdict}"
        )
        lines.append(f"{'':<28} {p.detail}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def refusal(plan: Plan) -> str:
    """One line per process that does not fit: process, figure, the setting to change."""
    return "; ".join(
        f"{p.process} needs {p.peak_bytes / GIB:.1f} GiB > {p.limit_bytes / GIB:.1f} GiB: change "
        f"{p.field} ({p.advice})"
        for p in plan.processes
        if not p.fits
    )
