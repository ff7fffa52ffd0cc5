"""The trained model: a causal LM (models/decoder_lm.py module-free where the packed forward runs,
else HF's) on its device, with its frozen reference (algo.kl_coef > 0), LoRA adapters, activation
checkpointing and FSDP2 sharding; its forward to log-probabilities, and its weights out.

    model = TrainedModel(settings, model_path, DistContext())  # world 1: plain module
    mb = model.micro_batch(batch, idx)          # samples idx: collated (+ packed layout) on device
    logp, ent = model.token_logprobs(mb)        # [b, L-1], 0 off the response
    weights = model.export_weights("bfloat16")  # rank 0: the version the rollouts load (collective)

The torch trainer (laminar/trainer/torch_trainer.py) owns one and steps AdamW over its
parameters; checkpoints (laminar/trainer/checkpoint.py) read and fill it. It never calls either.

Forward: the model returns hidden states and the head runs in trainer/logprobs.py, fp32,
trainer.logprob_chunk_tokens at a time and recomputed in backward; only response positions reach
the head. The packed forward (trainer/packed.py: a prompt's samples together, each prompt run
once) where trainer.forward allows it, else HF's padded forward. trainer.activation_checkpointing
recomputes each decoder layer in backward. An MoE policy replays the rollout's routes in either
forward (model.moe.routing_replay; models/moe.py). Under FSDP2 (`fully_shard` per decoder layer,
then the root, when world > 1) a mixed-precision policy gathers parameters in trainer.param_dtype
(bf16 on GPU) and reduces gradients in trainer.reduce_dtype (fp32); the master weights stay fp32.

LoRA (model.lora, laminar/models/lora.py): peft's LoRA layers on the frozen base, added before
checkpointing and sharding (so the memory plan traces them too); both forwards add the adapters'
share; export_weights() returns the adapters alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from laminar.models.moe import ROUTES_KWARG, MoeShape, replay_in_hf_forward
from laminar.models.tiny_vlm import is_vlm
from laminar.trainer.batch import TrainBatch
from laminar.trainer.dist import DistContext
from laminar.trainer.logprobs import full_token_logprobs
from laminar.trainer.logprobs import token_logprobs as chunked_logprobs
from laminar.trainer.micro_batch import MicroBatch, collate, padded_routes
from laminar.trainer.packed import PackedForward, PackedLayout, packed_forward
from laminar.trainer.protocol import TrainerSettings
from laminar.trainer.vision import vision_inputs, vision_model

if TYPE_CHECKING:
    from laminar.protocol.relay import WeightLayout


def _hidden_head(head: torch.nn.Module) -> None:
    """Make the model's forward return the final hidden states: the head's projection to the
    vocabulary runs in trainer/logprobs.py, in fp32 (algorithms.md §7), only at the trained
    positions and a chunk of tokens at a time."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x

    head.forward = forward  # this instance only


def param_dtype(choice: str, device: torch.device) -> torch.dtype:
    """trainer.param_dtype: auto = bfloat16 on GPU, float32 on CPU."""
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return cast(torch.dtype, getattr(torch, choice))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules HF says never to split (`_no_split_modules`)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def apply_activation_checkpointing(model: torch.nn.Module) -> bool:
    """Recompute each decoder layer in backward: its forward runs under torch's non-reentrant
    checkpoint (only the layer's input is kept), whatever train/eval mode the model is in (HF's own
    switch acts in train mode only, and this trainer runs in eval mode: no dropout). Parameter
    names do not change. Under FSDP2 the layer's pre-backward hook gathers its parameters before
    the recompute. False where the model names no decoder layers."""
    from torch.utils.checkpoint import checkpoint

    layers = decoder_layers(model)
    for layer in layers:
        inner = layer.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward  # this instance only
    return bool(layers)


def apply_fsdp(model: torch.nn.Module, mesh: Any, param: torch.dtype, reduce: torch.dtype) -> None:
    """fully_shard every decoder layer, then the root, under a mixed-precision policy: parameters
    gathered and computed in `param`, gradients reduce-scattered in `reduce`, the sharded master
    weights (and so AdamW's state) stay as loaded (fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    # a vision-language model's tower stays in the root's unit: a rank whose micro-batch shows no
    # image skips the tower, and a unit of its own would then miss its all-gather on that rank
    tower = vision_tower(model)
    skip = {id(m) for m in tower.modules()} if tower is not None else set()
    for layer in decoder_layers(model):
        if id(layer) not in skip:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """A vision-language model's vision tower (HF Qwen2-VL's `model.visual`), else None."""
    inner = getattr(model, "model", None)
    tower = getattr(inner, "visual", None) or getattr(model, "visual", None)
    return tower if isinstance(tower, torch.nn.Module) else None


class TrainedModel:
    def __init__(
        self,
        settings: TrainerSettings,
        model_path: str,
        ctx: DistContext | None = None,
        adapter: Path | None = None,
        load: Callable[[str], Any] | None = None,
        empty: bool = False,
    ):
        """`adapter`: a checkpoint's peft adapter directory to resume (model.lora runs). `load`:
        builds the model from a path (default: its weights, fp32; the memory plan passes one that
        builds the shape only, laminar/plan/trainer.py). `empty` (FSDP, resuming from a sharded
        checkpoint): the model is built on the meta device and each rank allocates only its own
        shards, uninitialised, for `restore` to fill: no rank ever holds the full weights."""
        from laminar.models.decoder_lm import load_model

        self.settings, self.ctx = settings, ctx or DistContext()
        self.model_path = model_path
        """Where the weights came from; its tokenizer files go into every checkpoint."""
        tc = settings.trainer
        dev = settings.model.device
        if dev.startswith("cuda") and self.ctx.enabled:
            dev = f"cuda:{self.ctx.local_rank}"
        self.device = torch.device(dev)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.autocast = self.device.type == "cuda"
        # fp32 master weights, eval() (no dropout); sharded from CPU so no GPU ever holds two full
        # copies
        load_on = "cpu" if self.ctx.enabled else str(self.device)
        # the packed forward reads parameters only: no transformers needed where it runs (not FSDP)
        module_free = tc.forward != "hf" and not self.ctx.enabled
        max_len = settings.max_model_len

        def load_weights(path: str) -> Any:
            return load_model(path, "float32", load_on, module_free, max_len, attention="sdpa")

        def load_empty(path: str) -> Any:
            from laminar.models.tiny import empty_causal_lm

            return empty_causal_lm(path, attention="sdpa")

        # (a vision-language model is built with its weights: its checkpoint's shards overwrite)
        self.empty = (
            empty and self.ctx.enabled and settings.model.lora is None and not is_vlm(model_path)
        )
        """Built without weights (the sharded checkpoint's shards fill it)."""
        load = load or (load_empty if self.empty else load_weights)
        self.module = load(model_path)
        """The trained causal LM (an HF module, or models/decoder_lm.py's module-free one)."""
        computed: list[Any] = []
        if self.empty:
            from laminar.models.tiny import computed_buffers

            computed = computed_buffers(self.module)
        self.lora = settings.model.lora
        """LoRA: only the adapters train and a version is the adapters (laminar/models/lora.py);
        added before checkpointing and sharding, so the memory plan traces them too."""
        if self.lora is not None:
            from laminar.models import lora as lo

            lo.add_adapters(self.module, self.lora)
            if adapter is not None:
                lo.load_adapter_state(self.module, lo.read_adapter_dir(adapter)[1])
        self.processor: Any = None
        """A vision-language model's HF processor (its image processor makes the pixel inputs of
        each micro-batch); None for a text model."""
        if is_vlm(model_path):
            self.processor = vision_model(self.module, model_path, settings)
        config = self.module.config  # HF's (a VLM nests its LM's) or DecoderLM's namespace
        text_config = config.get_text_config() if self.processor is not None else config
        self.vocab_size = int(text_config.vocab_size)
        self.max_len = getattr(text_config, "max_position_embeddings", None)
        dups = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        self._tied = dups - {n for n, _ in self.module.named_parameters()}
        self.head = self.module.get_output_embeddings()
        _hidden_head(self.head)
        self.ref = None
        """The frozen reference model of the KL terms (algo.kl_coef > 0), else None."""
        if settings.algo.kl_coef > 0:
            self.ref = (load_weights if self.empty else load)(settings.model.path or model_path)
            self.ref.requires_grad_(False)
            _hidden_head(self.ref.get_output_embeddings())
        # the sliding-window check needs a length; unknown, any window binds
        longest = int(self.max_len or settings.max_model_len or 1 << 30)
        self.packed = (
            None
            if self.processor is not None  # HF's forward: pixel inputs per row (trainer/vision.py)
            else packed_forward(self.module, longest, tc.forward, self.ctx.enabled)
        )
        """The packed training forward, or None: HF's padded forward (trainer.forward)."""
        self.packed_ref = PackedForward(self.ref) if self.packed and self.ref is not None else None
        moe = MoeShape.of(self.module) if self.processor is None else None
        self.replay = moe if settings.model.moe.routing_replay else None
        """The MoE shape whose recorded routes the forward replays (None: dense or replay off):
        the packed forward from its layout, HF's padded one (FSDP-sharded runs) through its
        routed layers (models/moe.py replay_in_hf_forward)."""
        if self.replay is not None and self.packed is None:
            # before checkpointing, which then recomputes each layer with the same routes
            for m in (self.module, self.ref):
                if m is not None:
                    replay_in_hf_forward(m, self.replay)
        # before sharding: fully_shard renames the layers' classes
        self.checkpointing = tc.activation_checkpointing and (
            self.packed is not None or apply_activation_checkpointing(self.module)
        )
        """Per-layer activation checkpointing is on (the packed forward's own, or HF's)."""
        if self.ctx.enabled:
            self._shard(computed)
        temp = settings.temperature
        # logprobs must describe the distribution the sampler drew from: logits / T (greedy: T = 1)
        self.temperature = temp if temp > 0 else 1.0
        self.pad_id = int(text_config.pad_token_id or 0)

    def _shard(self, computed: list[Any]) -> None:
        """FSDP2 over the ranks: this rank keeps its shards of the model (and of the reference)."""
        from torch.distributed.device_mesh import init_device_mesh

        tc = self.settings.trainer
        mesh = self.ctx.mesh or init_device_mesh(self.device.type, (self.ctx.world,))
        mp = (param_dtype(tc.param_dtype, self.device), getattr(torch, tc.reduce_dtype))
        apply_fsdp(self.module, mesh, *mp)
        if self.empty:  # this rank's shards only, uninitialised: restore() reads them
            from laminar.models.tiny import fill_buffers

            self.module.to_empty(device=self.device)
            fill_buffers(self.module, computed)
        else:
            self.module.to(self.device)  # moves this rank's shards only
        if self.ref is not None:
            apply_fsdp(self.ref, mesh, *mp)
            self.ref.to(self.device)

    # ---- forward ------------------------------------------------------------------------------
    def _amp(self):
        return (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.autocast
            else contextlib.nullcontext()
        )

    def token_logprobs(
        self, mb: MicroBatch, module: torch.nn.Module | None = None, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi(target), entropy) under `module` (default: the trained one; or `ref`), both
        [b, L-1] and 0 off the response; entropy has grad only if asked.

        Only response positions reach the head (trainer/logprobs.py: fp32, trainer.
        logprob_chunk_tokens at a time): long prompts cost no [*, V] memory, and neither does a
        long micro-batch.
        """
        model = module or self.module
        packed = {id(self.module): self.packed, id(self.ref): self.packed_ref}.get(id(model))
        with self._amp():
            if packed is not None and mb.layout is not None:
                # resp_index's positions in row-major order
                hidden = packed.hidden(mb.layout, self.checkpointing and model is self.module)
            else:
                replay = {} if mb.routes is None else {ROUTES_KWARG: (mb.routes, mb.routed)}
                out = model(
                    input_ids=mb.input_ids,
                    attention_mask=mb.attention_mask,
                    use_cache=False,
                    **(mb.vision or {}),
                    **replay,
                )
                steps = mb.resp_mask.shape[1]  # the head's output "logits" are hidden states
                rows, cols = mb.resp_index // steps, mb.resp_index % steps
                hidden = out.logits[rows, cols]  # [N, D]
        # the head's weight: read after the forward (under FSDP2 the root's parameters stay
        # gathered until its backward)
        head = cast(torch.nn.Linear, cast(Any, model).get_output_embeddings())
        targets = mb.targets.flatten()[mb.resp_index]
        chunk = self.settings.trainer.logprob_chunk_tokens
        if chunk:
            flat, flat_ent = chunked_logprobs(
                hidden, head.weight, head.bias, targets, self.temperature, chunk
            )
        else:
            flat, flat_ent = full_token_logprobs(
                hidden, head.weight, head.bias, targets, self.temperature
            )
        if not entropy_grad:
            flat_ent = flat_ent.detach()
        n = mb.resp_mask.numel()
        zeros = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        shape = mb.resp_mask.shape
        return (
            zeros.index_copy(0, mb.resp_index, flat).view(shape),
            zeros.index_copy(0, mb.resp_index, flat_ent).view(shape),
        )

    def micro_batch(self, batch: TrainBatch, idx: list[int]) -> MicroBatch:
        """The samples `idx` collated on the model's device, with their packed layout when the
        packed forward runs."""
        mb = collate(batch, idx, self.pad_id)
        if self.processor is not None:
            mb.vision = vision_inputs(self.processor, [batch.samples[i] for i in idx], mb.input_ids)
        rows = [batch.samples[i] for i in idx]
        if self.packed is not None:
            mb.layout = PackedLayout.build(rows, moe=self.replay)
        elif self.replay is not None:
            mb.routes, mb.routed = padded_routes(rows, mb.input_ids.shape[1], self.replay)
        return mb.to(self.device)

    @torch.no_grad()
    def sequence_kl(self, batch: TrainBatch, share: list[tuple[list[int], float]]) -> torch.Tensor:
        """sum_t (log pi_prox - log pi_ref) per sequence [B] (k1 for the reward), reduced over
        ranks."""
        kl = torch.zeros(batch.n_seqs, dtype=torch.float64)
        for idx, weight in share:
            mb = self.micro_batch(batch, idx)
            logp, _ = self.token_logprobs(mb)
            ref, _ = self.token_logprobs(mb, self.ref)
            per_seq = (
                torch.where(mb.resp_mask, logp - ref, torch.zeros_like(logp)).sum(-1).double().cpu()
            )
            kl.index_add_(0, mb.index, per_seq * weight)
        if self.ctx.enabled:
            import torch.distributed as dist

            dist.all_reduce(kl, group=self.ctx.cpu_group)
        return kl.float()

    # ---- weights out --------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full model state dict on rank 0 (CPU when distributed), {} elsewhere. Collective."""
        sd: dict[str, torch.Tensor]
        if self.ctx.enabled:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            sd = cast(dict[str, torch.Tensor], get_model_state_dict(self.module, options=opts))
        else:
            sd = self.module.state_dict()
        return (
            {k: v.detach() for k, v in sd.items() if k not in self._tied}
            if self.ctx.is_main
            else {}
        )

    def export_weights(self, dtype: str = "float32") -> dict[str, torch.Tensor]:
        """Weights for the rollouts (tied copies dropped, cast to the rollout dtype; rank 0, {}
        elsewhere); with LoRA the adapters alone, under peft's names. Collective.

        Under FSDP, tensor by tensor in layer order: each is all-gathered on the device, cast to
        `dtype` there, and only that copy goes to rank 0's host (a bf16 version moves half the
        bytes of the fp32 master weights, and no full fp32 copy is ever held); the copy to the
        host is issued without waiting (pinned memory) while the next tensor gathers."""
        want = getattr(torch, dtype)
        if self.lora is not None:
            from laminar.models.lora import adapter_state

            sd = adapter_state(self.module)  # every rank gathers; rank 0 keeps
            if self.ctx.enabled:  # as full_state_dict: on rank 0's CPU
                sd = {k: v.cpu() for k, v in sd.items()} if self.ctx.is_main else {}
            return {k: (v if v.dtype == want else v.to(want)) for k, v in sd.items()}
        if not self.ctx.enabled:
            return {
                k: (v if v.dtype == want else v.to(want)) for k, v in self.full_state_dict().items()
            }
        cuda = self.device.type == "cuda"
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.gathered(want, own=not cuda):
            if cuda:
                host = torch.empty(tensor.shape, dtype=want, pin_memory=True)
                out[name] = host.copy_(tensor, non_blocking=True)
            else:
                out[name] = tensor
        if cuda:
            torch.cuda.current_stream().synchronize()  # every copy to the host has landed
        return out

    def gathered(self, want: torch.dtype, own: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, the whole tensor cast to `want` on the device) in state-dict order, tied copies
        dropped: rank 0 gets them, every rank runs the gathers (FSDP: one tensor at a time, so
        no full copy of the model is ever held). Without `own` a tensor already in `want` and not
        sharded is the live one (the caller copies it before the next step)."""
        for name, value in self.module.state_dict().items():
            if name in self._tied:
                continue
            sharded = hasattr(value, "full_tensor")
            full = value.full_tensor() if sharded else value
            if not self.ctx.is_main:
                continue
            cast = full.detach().to(want)
            live = not sharded and cast.data_ptr() == value.data_ptr()
            yield name, (cast.clone() if own and live else cast)

    def stream_layout(self) -> WeightLayout | None:
        """The exported version's layout, from the shapes alone (nothing gathered); None with
        LoRA (the adapters are gathered to be named)."""
        if self.lora is not None:
            return None
        from laminar.weights.layout import build_layout

        dtype = self.settings.model.dtype
        sd = self.module.state_dict()  # a DTensor's shape is the whole tensor's
        return build_layout(
            (n, dtype, tuple(v.shape)) for n, v in sd.items() if n not in self._tied
        )
