"""The trained policy: a causal LM (models/decoder_lm.py module-free where the packed forward runs,
else HF's) + AdamW + warmup/cosine schedule, FSDP2 across ranks.
The torch implementation of the `Trainer` protocol (laminar/trainer/engine.py).

    policy = Policy(settings, model_path, DistContext())   # world 1: plain module
    metrics = policy.step(policy.prepare(trajectories))
    weights = policy.export()                               # rank 0: full state dict (collective)
    policy.save(run_dir, step, meta, keep)                  # checkpoint (collective, rank 0 writes)

Protocol methods are collectives under torch.distributed: on rank 0 each first tells the
other ranks to run the same method (dist.lead), which they do from follower.py.

One trainer step per batch, trainer.minibatches optimizer steps inside it:
    pack micro-batches (token budget; packed forward, trainer/packed.py: a prompt's samples
    together, each prompt run once; HF's padded forward: by length)
    ─► [k1-in-reward: no-grad pass for KL]
    ─► advantages (whole batch) ─► split the groups into M mini-batches
    ─► [trainer.skip_zero_advantage: samples with advantage exactly 0 get no micro-batch; their
        loss and gradient are 0, the mini-batch keeps its token/sequence counts and its AdamW step]
    ─► [M > 1, decoupled: no-grad pass for pi_prox on mini-batches 2..M]
    ─► per mini-batch: per micro-batch: forward (bf16 autocast on GPU, fp32 logits / T)
          ─► loss with the mini-batch's token/sequence counts ─► backward (accumulate)
       ─► clip grad norm ─► AdamW step
    ─► schedule step (one per trainer step: the lr schedule counts versions)

The proximal policy pi_prox is the parameters at the start of the step. With M = 1,
gradients accumulate over micro-batches and the parameters only move at the optimizer
step, so every micro-batch's forward runs at exactly those parameters: its logprobs,
detached, *are* the recompute (no grad, before any update in this step) — no second
forward pass is needed (tests check they are bit-identical to a separate no-grad pass).
Then the PPO ratio pi_theta/pi_prox is 1 at the step and the clip cannot act: the
update is REINFORCE with truncated behaviour weights (is_cap is the only brake).
With M > 1, mini-batch 1 still uses its own detached logprobs, and mini-batches 2..M
get pi_prox from one no-grad pass over them before the first optimizer step; by the
time they are trained the parameters have moved, the ratio differs from 1 and the
clip (clip_low/clip_high/dual_clip) bounds how far each step goes: a real trust region.
With decoupled=False (bypass) the behaviour logprobs take the proximal role.

LoRA (model.lora, laminar/models/lora.py): peft's LoRA layers on the frozen base, AdamW over the
adapters only, both forwards add the adapters' share; export() returns the adapters alone.

Memory (docs/planning.md; `laminar plan` traces this very code): the model's forward returns
hidden states and the head runs in trainer/logprobs.py, fp32, trainer.logprob_chunk_tokens at a
time and recomputed in backward; trainer.activation_checkpointing recomputes each decoder layer
in backward; under FSDP2 a mixed-precision policy gathers parameters in trainer.param_dtype
(bf16 on GPU) and reduces gradients in trainer.reduce_dtype (fp32).

FSDP2 (`fully_shard` per decoder layer, then the root) when world > 1: every rank
holds the whole batch (rank 0 broadcast it), takes micro-batches rank::world (padded
with zero-weight dummies so collectives line up) and the loss is multiplied by the
world size because FSDP averages gradients across ranks.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from laminar.algo.advantages import broadcast_to_tokens, compute_advantages, kl_penalized_rewards
from laminar.algo.episodes import episode_stats
from laminar.algo.losses import LossSettings, policy_loss
from laminar.algo.metrics import StatAccumulator, length_stats
from laminar.protocol.data import Trajectory
from laminar.protocol.trainer import RankCommand
from laminar.trainer import checkpoint as ck
from laminar.trainer.batch import MicroBatch, TrainBatch, collate, pack_micro_batches
from laminar.trainer.dist import DistContext, destroy, lead
from laminar.trainer.engine import TrainerSettings
from laminar.trainer.logprobs import full_token_logprobs
from laminar.trainer.logprobs import token_logprobs as chunked_logprobs
from laminar.trainer.packed import PackedForward, PackedLayout, pack_by_prompt, packed_forward
from laminar.weights.sink import VersionSink

if TYPE_CHECKING:
    from laminar.protocol.relay import WeightLayout


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup to 1 over `warmup` steps, then cosine down to `min_ratio` at `total`."""

    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


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
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


class Policy:
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
        self.tc, self.algo = settings.trainer, settings.algo
        self.model_path = model_path
        """Where the weights came from; its tokenizer files go into every checkpoint."""
        tc, algo = settings.trainer, settings.algo
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

        self.empty = empty and self.ctx.enabled and settings.model.lora is None
        """Built without weights (the sharded checkpoint's shards fill it)."""
        load = load or (load_empty if self.empty else load_weights)
        self.model = load(model_path)
        computed: list[Any] = []
        if self.empty:
            from laminar.models.tiny import computed_buffers

            computed = computed_buffers(self.model)
        self.lora = settings.model.lora
        """LoRA: only the adapters train and a version is the adapters (laminar/models/lora.py);
        added before checkpointing and sharding, so the memory plan traces them too."""
        if self.lora is not None:
            from laminar.models import lora as lo

            lo.add_adapters(self.model, self.lora)
            if adapter is not None:
                lo.load_adapter_state(self.model, lo.read_adapter_dir(adapter)[1])
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_len = getattr(self.model.config, "max_position_embeddings", None)
        dups = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        self._tied = dups - {n for n, _ in self.model.named_parameters()}
        self.head = self.model.get_output_embeddings()
        _hidden_head(self.head)
        self.ref = None
        if algo.kl_coef > 0:
            self.ref = (load_weights if self.empty else load)(settings.model.path or model_path)
            self.ref.requires_grad_(False)
            _hidden_head(self.ref.get_output_embeddings())
        # the sliding-window check needs a length; unknown, any window binds
        longest = int(self.max_len or settings.max_model_len or 1 << 30)
        self.packed = packed_forward(self.model, longest, tc.forward, self.ctx.enabled)
        """The packed training forward, or None: HF's padded forward (trainer.forward)."""
        self.packed_ref = PackedForward(self.ref) if self.packed and self.ref is not None else None
        # before sharding: fully_shard renames the layers' classes
        self.checkpointing = tc.activation_checkpointing and (
            self.packed is not None or apply_activation_checkpointing(self.model)
        )
        """Per-layer activation checkpointing is on (the packed forward's own, or HF's)."""
        if self.ctx.enabled:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = self.ctx.mesh or init_device_mesh(self.device.type, (self.ctx.world,))
            mp = (param_dtype(tc.param_dtype, self.device), getattr(torch, tc.reduce_dtype))
            apply_fsdp(self.model, mesh, *mp)
            if self.empty:  # this rank's shards only, uninitialised: restore() reads them
                from laminar.models.tiny import fill_buffers

                self.model.to_empty(device=self.device)
                fill_buffers(self.model, computed)
            else:
                self.model.to(self.device)  # moves this rank's shards only
            if self.ref is not None:
                apply_fsdp(self.ref, mesh, *mp)
                self.ref.to(self.device)
        self.checkpoint_group: Any = None
        """Async sharded checkpoints: a gloo group of their own, so DCP's collectives on the
        writer thread never interleave with the training step's (made by the first such save,
        on every rank; None: one process, or none saved yet)."""
        self.pending_save: ck.PendingSave | None = None
        """The async checkpoint in flight (at most one)."""
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=tc.lr,
            betas=(tc.betas[0], tc.betas[1]),
            weight_decay=tc.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(tc.warmup_steps, tc.total_steps, tc.min_lr_ratio)
        )
        temp = settings.temperature
        # logprobs must describe the distribution the sampler drew from: logits / T (greedy: T = 1)
        self.temperature = temp if temp > 0 else 1.0
        self.loss_settings = LossSettings.from_algo(algo, settings.max_tokens)
        self.pad_id = int(self.model.config.pad_token_id or 0)

    # ---- the Trainer protocol ---------------------------------------------------------------
    def prepare(self, trajectories: list[Trajectory]) -> TrainBatch:
        return TrainBatch.build(trajectories, self.vocab_size, self.max_len)

    def step(self, batch: TrainBatch) -> dict[str, float]:
        lead(self.ctx, RankCommand(kind="step", trajectories=batch.source))
        return self.train_step(batch)

    def export(self) -> dict[str, torch.Tensor]:
        lead(self.ctx, RankCommand(kind="export"))
        return self.export_weights(self.settings.model.dtype)

    def save(self, run_dir: Path, step: int, meta: dict[str, Any], keep: int) -> ck.PendingSave:
        """A checkpoint; with trainer.checkpoint_async (sharded) returns once staged, after the
        previous save in flight has landed (its wait: PendingSave.waited_s)."""
        lead(self.ctx, RankCommand(kind="checkpoint", step=step))
        busy = self.pending_save is not None and not self.pending_save.done()
        t0 = time.perf_counter()
        self.settle()
        waited = time.perf_counter() - t0 if busy else 0.0
        pending = ck.save_policy(
            self, run_dir, step, meta, self.model_path, keep, self.tc.checkpoint_async
        )
        pending.waited_s = waited
        self.pending_save = None if pending.done() else pending
        return pending

    def settle(self) -> None:
        """Wait for the checkpoint in flight, if any, to land (every rank: its own shards)."""
        if self.pending_save is not None:
            self.pending_save.wait()
            self.pending_save = None

    def restore(self, checkpoint: Path) -> dict[str, Any]:
        return ck.load_policy_state(self, checkpoint)

    def close(self) -> None:
        lead(self.ctx, RankCommand(kind="stop"))
        self.settle()
        destroy(self.ctx)

    # ---- forward ------------------------------------------------------------------------
    def _amp(self):
        return (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.autocast
            else contextlib.nullcontext()
        )

    def token_logprobs(
        self, mb: MicroBatch, model: torch.nn.Module | None = None, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi(target), entropy), both [b, L-1] and 0 off the response; entropy has grad only if
        asked.

        Only response positions reach the head (trainer/logprobs.py: fp32, trainer.
        logprob_chunk_tokens at a time): long prompts cost no [*, V] memory, and neither does a
        long micro-batch.
        """
        model = model or self.model
        packed = {id(self.model): self.packed, id(self.ref): self.packed_ref}.get(id(model))
        with self._amp():
            if packed is not None and mb.layout is not None:
                # resp_index's positions in row-major order
                hidden = packed.hidden(mb.layout, self.checkpointing and model is self.model)
            else:
                out = model(
                    input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False
                )
                steps = mb.resp_mask.shape[1]  # the head's output "logits" are hidden states
                rows, cols = mb.resp_index // steps, mb.resp_index % steps
                hidden = out.logits[rows, cols]  # [N, D]
        # the head's weight: read after the forward (under FSDP2 the root's parameters stay
        # gathered until its backward)
        head = cast(torch.nn.Linear, cast(Any, model).get_output_embeddings())
        targets = mb.targets.flatten()[mb.resp_index]
        chunk = self.tc.logprob_chunk_tokens
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
        """The samples `idx` collated on the trainer's device, with their packed layout when the
        packed forward runs."""
        mb = collate(batch, idx, self.pad_id)
        if self.packed is not None:
            mb.layout = PackedLayout.build([batch.samples[i] for i in idx])
        return mb.to(self.device)

    # ---- one optimizer step ---------------------------------------------------------------
    def _my_share(self, mbs: list[list[int]]) -> list[tuple[list[int], float]]:
        if not self.ctx.enabled or not mbs:  # none: a mini-batch of zero advantages only
            return [(m, 1.0) for m in mbs]
        mine = [(m, 1.0) for m in mbs[self.ctx.rank :: self.ctx.world]]
        per_rank = -(-len(mbs) // self.ctx.world)
        mine += [(mbs[0], 0.0)] * (
            per_rank - len(mine)
        )  # zero-weight dummies keep FSDP collectives aligned
        return mine

    def _carries_gradient(self, adv: torch.Tensor) -> list[bool]:
        """Per sample: may its loss have a gradient (trainer.skip_zero_advantage)? A sample with
        advantage exactly 0 has none when every loss term is proportional to the advantage."""
        s = self.loss_settings
        has_other_terms = s.entropy_coef > 0 or (s.kl_coef > 0 and s.kl_type == "k3_loss")
        if not self.tc.skip_zero_advantage or has_other_terms:
            return [True] * len(adv)
        return (adv != 0).tolist()

    def _minibatches(self, batch: TrainBatch) -> list[list[int]]:
        """Sample indices of each mini-batch: whole groups, in batch order, M near-equal parts."""
        n_groups = int(batch.groups.max()) + 1 if batch.n_seqs else 0
        m = max(1, min(self.tc.minibatches, n_groups))
        if m == 1:
            return [list(range(batch.n_seqs))]
        part_of = [g * m // n_groups for g in range(n_groups)]
        parts: list[list[int]] = [[] for _ in range(m)]
        for i, g in enumerate(batch.groups.tolist()):
            parts[part_of[g]].append(i)
        return parts

    def _plan(self, batch: TrainBatch, idx: list[int]) -> list[tuple[list[int], float]]:
        """This rank's micro-batches (batch indices, weight) of the samples `idx`."""
        budget = self.tc.micro_batch_tokens
        if self.packed is not None:
            return self._my_share(pack_by_prompt(batch.samples, idx, budget))
        packed = pack_micro_batches([batch.samples[i].length for i in idx], budget)
        return self._my_share([[idx[j] for j in mb] for mb in packed])

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        s, algo = self.loss_settings, self.algo
        if batch.n_seqs == 0:
            raise ValueError("train_step needs at least one usable trajectory")
        stats = StatAccumulator()
        rewards = batch.rewards
        if algo.kl_coef > 0 and algo.kl_type == "k1_reward":
            whole = self._plan(batch, list(range(batch.n_seqs)))
            rewards = kl_penalized_rewards(rewards, self._sequence_kl(batch, whole), algo.kl_coef)
        adv = compute_advantages(rewards, batch.groups, algo.advantage, algo.norm_std).to(
            self.device
        )
        parts = self._minibatches(batch)
        live = self._carries_gradient(adv)
        plans = [self._plan(batch, [i for i in idx if live[i]]) for idx in parts]
        # pi_prox of mini-batches 2..M, before any parameter moves (mini-batch 1 reuses its own
        # forward)
        prox_of: dict[tuple[int, int], torch.Tensor] = {}
        built: dict[tuple[int, int], MicroBatch] = {}  # collated (and laid out) once, used twice
        if len(parts) > 1 and algo.decoupled:
            with torch.no_grad():
                for k, plan in enumerate(plans[1:], start=1):
                    for j, (idx, _) in enumerate(plan):
                        built[k, j] = self.micro_batch(batch, idx)
                        prox_of[k, j], _ = self.token_logprobs(built[k, j])
        lr = float(self.scheduler.get_last_lr()[0])
        norms: list[float] = []
        n_micro = 0
        for k, (idx_k, plan) in enumerate(zip(parts, plans, strict=True)):
            n_tok = sum(batch.samples[i].n_model for i in idx_k)
            self.optimizer.zero_grad(set_to_none=True)
            for j, (idx, weight) in enumerate(plan):
                mb = built.pop((k, j), None) or self.micro_batch(batch, idx)
                st = stats if weight else StatAccumulator()
                logp, ent = self.token_logprobs(mb, entropy_grad=s.entropy_coef > 0)
                if not algo.decoupled:
                    prox = mb.behav_logp
                else:
                    prox = prox_of.pop((k, j)) if k else logp.detach()
                ref = None
                if self.ref is not None and s.kl_type == "k3_loss":
                    with torch.no_grad():
                        ref, _ = self.token_logprobs(mb, self.ref)
                    st.add("kl_ref", (logp.detach() - ref), mb.resp_mask)
                adv_tok = broadcast_to_tokens(adv[mb.index], mb.resp_mask)
                loss = policy_loss(
                    logp,
                    prox,
                    mb.behav_logp,
                    adv_tok,
                    mb.resp_mask,
                    s,
                    n_tokens=n_tok,
                    n_seqs=len(idx_k),
                    ref_logp=ref,
                    entropy=ent,
                    stats=st,
                )
                st.add("sum/loss", loss.detach())
                st.add("entropy", ent.detach(), mb.resp_mask)
                st.add("logp", logp.detach(), mb.resp_mask)
                (loss * (weight * self.ctx.world)).backward()
            n_micro += len(plan)
            if not plan:  # every sample of the mini-batch has advantage 0: the step still happens
                for p in self.model.parameters():
                    if p.requires_grad:  # a frozen base (LoRA) gets no gradient
                        p.grad = torch.zeros_like(p)
                stats.add("sum/loss", torch.zeros(()))
                stats.add("sum/loss/pg", torch.zeros(()))
            norms.append(self._optimizer_step())
        self.scheduler.step()
        if self.ctx.enabled:
            self._align_names(stats)
            stats.all_reduce(self.ctx.cpu_group)
        out = stats.finalize()
        for name in [n for n in stats.parts if n.startswith("sum/")]:
            out[name[4:]] /= len(parts)  # summed over mini-batches: report their mean
        finite = [x for x in norms if math.isfinite(x)]
        n_seq, adv_cpu = batch.n_seqs, adv.cpu()
        out.update(length_stats([len(x.response_ids) for x in batch.samples]))
        out.update(episode_stats(batch.samples))
        out.update(
            {
                "grad_norm": sum(finite) / len(finite) if finite else math.nan,
                "lr": lr,
                "skipped_step": float(len(finite) < len(norms)),
                "minibatches": float(len(parts)),
                "reward": float(batch.rewards.mean()),
                "reward_max": float(batch.rewards.max()),
                "reward_min": float(batch.rewards.min()),
                "adv/mean": float(adv_cpu.mean()),
                "adv/std": float(adv_cpu.std()) if n_seq > 1 else 0.0,
                "adv/max": float(adv_cpu.max()),
                "adv/min": float(adv_cpu.min()),
                "frac/zero_adv": float((adv_cpu == 0).float().mean()),
                "tokens": float(batch.n_tokens),
                "tokens_total": float(batch.total_tokens),
                "seqs": float(n_seq),
                "seqs_trained": float(sum(live)),
                "micro_batches": float(n_micro),
                "compute_s": time.perf_counter() - t0,
            }
        )
        return out

    def _optimizer_step(self) -> float:
        """Clip the global grad norm and step AdamW; a NaN/inf gradient never reaches the
        weights."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tc.grad_clip)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        grad_norm = float(norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # the batch still counts as consumed
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    @torch.no_grad()
    def _sequence_kl(self, batch: TrainBatch, share: list[tuple[list[int], float]]) -> torch.Tensor:
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

    def _align_names(self, stats: StatAccumulator) -> None:
        import torch.distributed as dist

        names: list[list[str]] = [[] for _ in range(self.ctx.world)]
        dist.all_gather_object(names, sorted(stats.parts), group=self.ctx.cpu_group)
        for name in set().union(*names):
            stats._part(name)

    # ---- weights and state ------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full model state dict on rank 0 (CPU when distributed), {} elsewhere. Collective."""
        sd: dict[str, torch.Tensor]
        if self.ctx.enabled:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            sd = cast(dict[str, torch.Tensor], get_model_state_dict(self.model, options=opts))
        else:
            sd = self.model.state_dict()
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

            sd = adapter_state(self.model)  # every rank gathers; rank 0 keeps
            if self.ctx.enabled:  # as full_state_dict: on rank 0's CPU
                sd = {k: v.cpu() for k, v in sd.items()} if self.ctx.is_main else {}
            return {k: (v if v.dtype == want else v.to(want)) for k, v in sd.items()}
        if not self.ctx.enabled:
            return {
                k: (v if v.dtype == want else v.to(want)) for k, v in self.full_state_dict().items()
            }
        cuda = self.device.type == "cuda"
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self._gathered(want, own=not cuda):
            if cuda:
                host = torch.empty(tensor.shape, dtype=want, pin_memory=True)
                out[name] = host.copy_(tensor, non_blocking=True)
            else:
                out[name] = tensor
        if cuda:
            torch.cuda.current_stream().synchronize()  # every copy to the host has landed
        return out

    def _gathered(self, want: torch.dtype, own: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, the whole tensor cast to `want` on the device) in state-dict order, tied copies
        dropped: rank 0 gets them, every rank runs the gathers (FSDP: one tensor at a time, so
        no full copy of the model is ever held). Without `own` a tensor already in `want` and not
        sharded is the live one (the caller copies it before the next step)."""
        for name, value in self.model.state_dict().items():
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
        sd = self.model.state_dict()  # a DTensor's shape is the whole tensor's
        return build_layout(
            (n, dtype, tuple(v.shape)) for n, v in sd.items() if n not in self._tied
        )

    def export_into(self, sink: VersionSink) -> None:
        """The version tensor by tensor into `sink`: each gathered and cast on the device, handed
        over while the next one gathers (the sink writes it meanwhile: laminar/weights/sink.py)."""
        lead(self.ctx, RankCommand(kind="export"))
        want = getattr(torch, self.settings.model.dtype)
        if self.lora is not None:
            items = list(self.export_weights(self.settings.model.dtype).items())
        else:
            items = self._gathered(want, own=False)  # type: ignore[assignment]
        failed: Exception | None = None
        for name, tensor in items:
            if failed is None:
                try:
                    sink.put(name, tensor)
                except Exception as exc:  # noqa: BLE001 - the gathers go on: every rank is in them
                    failed = exc
        if failed is not None:
            raise failed

    def optimizer_state(self) -> dict[str, Any]:
        """Full optimizer state keyed by parameter name (rank 0; collective when distributed)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, self.optimizer, options=opts)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(
            self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True)
        )
