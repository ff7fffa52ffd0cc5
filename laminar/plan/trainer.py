"""A trainer rank's peak memory, measured by running its real step on fake tensors.

    mem = trace_trainer(settings, shape_dir, world=8, device="cuda")   # TrainerMemory
    mem.peak_bytes, mem.parts  # the peak and what it is made of (params, grads, optimizer, ...)

How: a fake process group of `world` ranks (this process is rank 0), then the trainer's own
`TorchTrainer` (laminar/trainer/torch_trainer.py) under torch's FakeTensorMode with a loader that
builds the model from `shape_dir/config.json` (meta device, then uninitialised fake tensors: no
bytes and no weights are read). Everything the trainer does to it runs for real: FSDP2's sharding
with the mixed-precision policy, activation checkpointing, AdamW, the micro-batch's forward, the
chunked log-probabilities, backward and the optimizer step. torch's FSDPMemTracker
(torch.distributed._tools) counts every tensor's storage on the device through it. The step is
run twice: the first untracked (AdamW creates its state, FSDP initialises), the second tracked,
with the parameters, the gradients the first left and the AdamW state already there.

What is not the real step: the loss arithmetic on the [tokens]-sized log-probabilities is a sum
(its tensors are the size of one fp32 per token); the micro-batch is the largest the config
allows (rows of max_model_len, prompt + response, up to trainer.micro_batch_tokens; one row when
a sample alone is longer); the attention kernels are the device's memory-efficient ones (sdpa).

Depth: a model of more than `max_traced_layers` layers is traced at k and 2k layers (k =
max_traced_layers / 2) and the peak extrapolated linearly to its depth: every per-layer cost
(sharded parameters, gradients, AdamW state, kept activations or checkpointed layer inputs)
grows with the layer count and the one-layer transients do not. tests/test_plan.py checks the
extrapolation against a full trace, and the full trace against a real step's measured peak.
"""

from __future__ import annotations

import dataclasses
import json
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from laminar.models.moe import MoeShape
from laminar.protocol.data import Trajectory
from laminar.trainer.protocol import TrainerSettings

GIB = 1 << 30


@dataclass
class TrainerMemory:
    peak_bytes: int
    """A trainer rank's peak device memory during a training step (bytes)."""
    parts: dict[str, int] = field(default_factory=dict)
    """The peak split by kind (FSDPMemTracker's: sharded/unsharded parameters and gradients,
    optimizer state, activations, temporaries...) at the deepest traced depth (not extrapolated:
    the split of a peak is not linear in depth)."""
    rows: int = 0
    """Sequences in the traced micro-batch."""
    row_tokens: int = 0
    """Tokens in each (prompt + response)."""
    trained_tokens: int = 0
    """Tokens whose log-probabilities the step computes."""
    traced_layers: list[int] = field(default_factory=list)
    """Layer counts traced (one: the whole model; two: extrapolated from them)."""
    layers: int = 0
    """The model's depth."""
    params: int = 0
    """The model's parameter count."""
    trainable_params: int = 0
    """Parameters the optimizer updates (all of them unless an adapter freezes the rest)."""


def read_shape(shape_dir: str | Path) -> dict[str, Any]:
    """The model's config.json (its architecture and sizes)."""
    return json.loads((Path(shape_dir) / "config.json").read_text())


def micro_batch_shape(settings: TrainerSettings, model_len: int) -> tuple[int, int, int]:
    """(rows, tokens per row, trained tokens per row) of the largest micro-batch the config
    allows: rows of the longest sample (prompt + response up to max_model_len)."""
    row = min(model_len, settings.max_model_len or model_len)
    response = max(1, min(settings.max_tokens, row - 1))
    rows = max(1, settings.trainer.micro_batch_tokens // row)
    return rows, row, response


def _trajectories(rows: int, row: int, response: int, vocab: int) -> list[Trajectory]:
    rng = np.random.default_rng(0)
    prompt = row - response
    # one group (rewards differ, so every sample has an advantage), a prompt of its own each:
    # no prompt is shared (the packed forward's worst case)
    return [
        Trajectory(
            uid=f"plan/{i}",
            group_id="plan",
            prompt_uid="plan",
            sample_index=i,
            prompt_ids=rng.integers(0, vocab, prompt).astype(np.int32),
            response_ids=rng.integers(0, vocab, response).astype(np.int32),
            logprobs=np.full(response, -1.0, dtype=np.float32),
            version=0,
            reward=float(i % 2),
        )
        for i in range(rows)
    ]


def _shape_loader(shape: dict[str, Any], device: str, fake: Any):
    """A model loader (TrainedModel's `load`): the HF model of `shape` on the meta device, then
    moved to fake tensors on `device` (uninitialised: nothing is computed or read)."""

    def load(_path: str) -> Any:
        import torch

        from laminar.models.tiny import IMPORT_LOCK

        with IMPORT_LOCK:
            from transformers import AutoConfig, AutoModelForCausalLM
        cfg = AutoConfig.for_model(**shape)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                cfg, attn_implementation="sdpa", dtype=torch.float32
            )
        with fake:
            model.to_empty(device=device)
        if MoeShape.of_config(shape) is not None:
            for module in model.modules():
                if hasattr(module, "gate_up_proj") and hasattr(module, "num_experts"):
                    module.forward = types.MethodType(_balanced_experts, module)
        return model.eval()

    return load


def _balanced_experts(
    self: Any, hidden: Any, top_k_index: Any, top_k_weights: Any
) -> Any:  # pragma: no cover - runs on fake tensors only
    """An HF experts module's forward as the trace runs it: routing balanced (each expert takes
    ceil(tokens x k / experts) tokens), the planning assumption, with static shapes (the real
    forward's nonzero has a data-dependent size fake tensors cannot carry). The same matmuls,
    activations and gate-weight products per expert as the real ones at a balanced load."""
    import math

    import torch
    import torch.nn.functional as F

    t, k = top_k_index.shape
    n = math.ceil(t * k / self.num_experts)
    out = torch.zeros_like(hidden)
    for e in range(self.num_experts):
        tok = torch.arange(e * n, (e + 1) * n, device=hidden.device) % t
        gate, up = F.linear(hidden[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
        h = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[tok, :1]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


def _trace(
    settings: TrainerSettings,
    shape: dict[str, Any],
    world: int,
    device: str,
    rows: int,
    row: int,
    response: int,
    gpu: bool,
) -> tuple[int, dict[str, int], int, int]:
    """(peak, parts, params, trainable params) of one trace at `shape`'s depth."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from laminar.trainer.batch import TrainBatch
    from laminar.trainer.dist import DistContext
    from laminar.trainer.torch_trainer import TorchTrainer

    ctx = DistContext()
    if world > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        # the mesh is built outside the fake mode (it reads its rank table)
        mesh = init_device_mesh(device.split(":")[0], (world,))
        ctx = DistContext(rank=0, world=world, cpu_group=dist.group.WORLD, mesh=mesh)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        policy = TorchTrainer(settings, "<shape>", ctx, load=_shape_loader(shape, device, fake))
        batch = TrainBatch.build(_trajectories(rows, row, response, int(shape["vocab_size"])))
        idx = list(range(rows))
        mb = policy.model.micro_batch(batch, idx)  # collated on the CPU, moved to the (fake) device
        # a GPU trainer computes under bf16 autocast: so does the trace (on the CPU's autocast)
        policy.model.autocast = gpu
        with fake:

            def step() -> None:
                policy.optimizer.zero_grad(set_to_none=True)
                logp, ent = policy.model.token_logprobs(mb, entropy_grad=True)
                if policy.model.ref is not None:
                    with torch.no_grad():
                        policy.model.token_logprobs(mb, policy.model.ref)
                (logp.sum() + 0.0 * ent.sum()).backward()
                torch.nn.utils.clip_grad_norm_(policy.model.module.parameters(), 1.0)
                policy.optimizer.step()

            step()  # untracked: AdamW creates its state, FSDP initialises lazily
            tracker: Any
            if world > 1:
                tracker = FSDPMemTracker(policy.model.module, policy.optimizer)
                tracker.track_inputs((mb.input_ids,))
            else:  # one process, no FSDP: the plain tracker
                tracker = MemTracker()
                tracker.track_external(policy.model.module, policy.optimizer)
            with tracker:  # the steady state: parameters, gradients and AdamW state exist
                step()
            snap = tracker.get_tracker_snapshot("peak")
        # a DTensor's numel is its full (global) size
        params = sum(p.numel() for p in policy.model.module.parameters())
        trainable = sum(p.numel() for p in policy.model.module.parameters() if p.requires_grad)
    finally:
        if world > 1:
            dist.destroy_process_group()
    dev = next(d for d in snap if d.type == device.split(":")[0])
    parts = {str(getattr(k, "value", k)): int(v) for k, v in snap[dev].items() if k != "Total"}
    return int(snap[dev]["Total"]), parts, params, trainable


def trace_trainer(
    settings: TrainerSettings,
    shape_dir: str | Path,
    world: int,
    device: str = "cuda",
    max_traced_layers: int = 4,
) -> TrainerMemory:
    """The peak device memory of trainer rank 0 of `world` for one training step (see the module
    docstring); `device` = cuda: parameters are gathered in trainer.param_dtype's GPU default."""
    shape = read_shape(shape_dir)
    settings = _on_device(settings, device)
    layers = int(shape["num_hidden_layers"])
    model_len = int(shape.get("max_position_embeddings") or settings.max_model_len or 4096)
    rows, row, response = micro_batch_shape(settings, model_len)
    trace_device = "cpu"  # fake tensors: no memory; the cpu type runs where no GPU is
    if layers <= max_traced_layers:
        depths = [layers]
    else:
        k = max(1, max_traced_layers // 2)
        depths = [k, 2 * k]
    traced = []
    for n in depths:
        one = {**shape, "num_hidden_layers": n, "max_window_layers": n}
        gpu = device.startswith("cuda")
        traced.append(_trace(settings, one, world, trace_device, rows, row, response, gpu))
    peak, parts, params, trainable = traced[-1]
    if len(depths) == 2:
        (p1, _, n1_params, n1_train), (p2, _, n2_params, n2_train) = traced
        k, extra = depths[0], layers - depths[1]
        peak = p2 + (p2 - p1) * extra // k
        params = n2_params + (n2_params - n1_params) * extra // k
        trainable = n2_train + (n2_train - n1_train) * extra // k
    return TrainerMemory(
        peak_bytes=peak,
        parts={n: v for n, v in parts.items() if v},
        rows=rows,
        row_tokens=row,
        trained_tokens=rows * response,
        traced_layers=depths,
        layers=layers,
        params=params,
        trainable_params=trainable,
    )


def _on_device(settings: TrainerSettings, device: str) -> TrainerSettings:
    """The settings with the trainer's device and its dtype default resolved for `device` (the
    trace itself runs on fake CPU tensors: param_dtype auto means bfloat16 on a GPU)."""
    tc = settings.trainer
    if tc.param_dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
        tc = tc.model_copy(update={"param_dtype": dtype})
    model = settings.model.model_copy(update={"device": "cpu"})
    return dataclasses.replace(settings, trainer=tc, model=model)
