"""The torch trainer: AdamW + warmup/cosine schedule over a TrainedModel, one optimizer step per
batch. The torch implementation of the `Trainer` protocol (laminar/trainer/protocol.py).

    trainer = TorchTrainer(settings, model_path, DistContext())  # world 1: plain module
    metrics = trainer.step(trainer.prepare(trajectories))
    weights = trainer.export()                    # rank 0: full state dict (collective)
    trainer.save(run_dir, step, meta, keep)       # checkpoint (collective, rank 0 writes)

Protocol methods are collectives under torch.distributed: on rank 0 each first tells the
other ranks to run the same method (dist.lead), which they do from follower.py.

The step only calls down and takes values back: index lists from trainer/packing.py,
micro-batches and log-probabilities from the model (trainer/model.py: packed.py, logprobs.py
below it), advantages and the loss from laminar/algo; checkpoints (trainer/checkpoint.py) read
this trainer through their `Checkpointable` protocol.

One trainer step per batch, trainer.minibatches optimizer steps inside it:
    plan micro-batches (trainer/packing.py, token budget; packed forward: a prompt's samples
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

LoRA (model.lora): AdamW over the adapters only; export() returns the adapters alone.
Memory (docs/planning.md; `laminar plan` traces this very code): see trainer/model.py.

FSDP2 (trainer/model.py) when world > 1: every rank holds the whole batch (rank 0 broadcast it),
takes micro-batches rank::world (trainer/packing.py: padded with zero-weight dummies so
collectives line up) and the loss is multiplied by the world size because FSDP averages
gradients across ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from laminar.algo.advantages import broadcast_to_tokens, compute_advantages, kl_penalized_rewards
from laminar.algo.episodes import episode_stats
from laminar.algo.losses import LossSettings, policy_loss
from laminar.algo.metrics import StatAccumulator, length_stats
from laminar.models.offload import HostStash, Moved
from laminar.protocol.data import Trajectory
from laminar.protocol.trainer import RankCommand
from laminar.trainer import checkpoint as ck
from laminar.trainer.batch import TrainBatch
from laminar.trainer.dist import DistContext, destroy, lead
from laminar.trainer.micro_batch import MicroBatch
from laminar.trainer.model import TrainedModel
from laminar.trainer.packing import (
    MicroPlan,
    carries_gradient,
    minibatches,
    plan_micro_batches,
)
from laminar.trainer.protocol import PendingSave, TrainerSettings
from laminar.vision.pixels import image_token_counts
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


class TorchTrainer:
    def __init__(
        self,
        settings: TrainerSettings,
        model_path: str,
        ctx: DistContext | None = None,
        adapter: Path | None = None,
        load: Callable[[str], Any] | None = None,
        empty: bool = False,
    ):
        """The model as laminar/trainer/model.py TrainedModel builds it (`adapter`, `load`,
        `empty`: see there), AdamW over its trainable parameters, the lr schedule."""
        self.settings, self.ctx = settings, ctx or DistContext()
        self.tc, self.algo = settings.trainer, settings.algo
        tc = settings.trainer
        self.model = TrainedModel(settings, model_path, self.ctx, adapter, load, empty)
        self.checkpoint_group: Any = None
        """Async sharded checkpoints: a gloo group of their own, so DCP's collectives on the
        writer thread never interleave with the training step's (made by the first such save,
        on every rank; None: one process, or none saved yet)."""
        self.pending_save: PendingSave | None = None
        """The async checkpoint in flight (at most one)."""
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.module.parameters() if p.requires_grad],
            lr=tc.lr,
            betas=(tc.betas[0], tc.betas[1]),
            weight_decay=tc.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(tc.warmup_steps, tc.total_steps, tc.min_lr_ratio)
        )
        self.loss_settings = LossSettings.from_algo(settings.algo, settings.max_tokens)
        self._params, self._optim = HostStash(), HostStash()
        """Colocated placement: parameters + gradients, and the AdamW state, while offloaded."""
        self.auto_onloads = 0
        """Calls that found the state offloaded and brought it back themselves."""

    # ---- colocated placement: the state in host memory while the rollouts generate ----------
    def offload(self, params: bool = True, optimizer: bool = True) -> Moved:
        """Parameters and gradients (`params`) and the AdamW state (`optimizer`) to host memory
        (pinned on CUDA), their device storage freed (models/offload.py). The next protocol call
        that needs them (step, export, save) brings them back first."""
        if self.ctx.enabled:
            raise NotImplementedError(
                "offload under FSDP (several trainer ranks) is not supported: colocated "
                "placement pairs one trainer rank with one rollout"
            )
        t0 = time.perf_counter()
        nbytes = count = 0
        if params and not self._params.offloaded:
            tensors = list(self.model.module.parameters())
            tensors += [p.grad for p in tensors if p.grad is not None]
            moved = self._params.offload(tensors)
            nbytes, count = nbytes + moved.nbytes, count + moved.tensors
        if optimizer and not self._optim.offloaded:
            state = [
                t
                for st in self.optimizer.state.values()
                for t in st.values()
                if isinstance(t, torch.Tensor)
            ]
            moved = self._optim.offload(state)
            nbytes, count = nbytes + moved.nbytes, count + moved.tensors
        return Moved(nbytes, time.perf_counter() - t0, count)

    def onload(self) -> Moved:
        """Everything offload() moved back on the device (no-op when nothing is in host memory)."""
        t0 = time.perf_counter()
        a, b = self._params.restore(), self._optim.restore()
        return Moved(a.nbytes + b.nbytes, time.perf_counter() - t0, a.tensors + b.tensors)

    @property
    def offloaded(self) -> bool:
        return self._params.offloaded or self._optim.offloaded

    def _resident(self) -> None:
        """A call that reads the state while it is in host memory (a stop checkpoint between two
        cycles): it comes back first, whatever the device costs."""
        if self.offloaded:
            self.onload()
            self.auto_onloads += 1

    # ---- the Trainer protocol ---------------------------------------------------------------
    def prepare(
        self, trajectories: list[Trajectory], images: Mapping[str, bytes] | None = None
    ) -> TrainBatch:
        proc = self.model.processor
        placeholder = None if proc is None else int(proc.image_token_id)
        counts = None if proc is None else image_token_counts(proc, images or {})
        return TrainBatch.build(
            trajectories, self.model.vocab_size, self.model.max_len, images, placeholder, counts
        )

    def step(self, batch: TrainBatch) -> dict[str, float]:
        self._resident()
        lead(self.ctx, RankCommand(kind="step", trajectories=batch.source, images=batch.images))
        return self.train_step(batch)

    def export(self) -> dict[str, torch.Tensor]:
        self._resident()
        lead(self.ctx, RankCommand(kind="export"))
        return self.model.export_weights(self.settings.model.dtype)

    def stream_layout(self) -> WeightLayout | None:
        self._resident()
        return self.model.stream_layout()

    def export_into(self, sink: VersionSink) -> None:
        """The version tensor by tensor into `sink`: each gathered and cast on the device, handed
        over while the next one gathers (the sink writes it meanwhile: laminar/weights/sink.py)."""
        self._resident()
        lead(self.ctx, RankCommand(kind="export"))
        dtype = self.settings.model.dtype
        if self.model.lora is not None:
            items = list(self.model.export_weights(dtype).items())
        else:
            items = self.model.gathered(getattr(torch, dtype), own=False)  # type: ignore[assignment]
        failed: Exception | None = None
        for name, tensor in items:
            if failed is None:
                try:
                    sink.put(name, tensor)
                except Exception as exc:  # noqa: BLE001 - the gathers go on: every rank is in them
                    failed = exc
        if failed is not None:
            raise failed

    def save(self, run_dir: Path, step: int, meta: dict[str, Any], keep: int) -> PendingSave:
        """A checkpoint; with trainer.checkpoint_async (sharded) returns once staged, after the
        previous save in flight has landed (its wait: PendingSave.waited_s)."""
        self._resident()
        lead(self.ctx, RankCommand(kind="checkpoint", step=step))
        busy = self.pending_save is not None and not self.pending_save.done()
        t0 = time.perf_counter()
        self.settle()
        waited = time.perf_counter() - t0 if busy else 0.0
        pending = ck.save_trainer(
            self, run_dir, step, meta, self.model.model_path, keep, self.tc.checkpoint_async
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
        return ck.restore_trainer(self, checkpoint)

    def close(self) -> None:
        lead(self.ctx, RankCommand(kind="stop"))
        self.settle()
        destroy(self.ctx)

    # ---- one optimizer step ---------------------------------------------------------------
    def _plan(self, batch: TrainBatch, idx: list[int]) -> MicroPlan:
        """This rank's micro-batches (batch indices, weight) of the samples `idx`."""
        by_prompt = self.model.packed is not None
        return plan_micro_batches(batch, idx, self.tc.micro_batch_tokens, by_prompt, self.ctx)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        s, algo, model = self.loss_settings, self.algo, self.model
        if batch.n_seqs == 0:
            raise ValueError("train_step needs at least one usable trajectory")
        stats = StatAccumulator()
        rewards = batch.rewards
        if algo.kl_coef > 0 and algo.kl_type == "k1_reward":
            whole = self._plan(batch, list(range(batch.n_seqs)))
            rewards = kl_penalized_rewards(rewards, model.sequence_kl(batch, whole), algo.kl_coef)
        adv = compute_advantages(rewards, batch.groups, algo.advantage, algo.norm_std).to(
            model.device
        )
        parts = minibatches(batch, self.tc.minibatches)
        live = carries_gradient(adv, s, self.tc.skip_zero_advantage)
        plans = [self._plan(batch, [i for i in idx if live[i]]) for idx in parts]
        # pi_prox of mini-batches 2..M, before any parameter moves (mini-batch 1 reuses its own
        # forward)
        prox_of: dict[tuple[int, int], torch.Tensor] = {}
        built: dict[tuple[int, int], MicroBatch] = {}  # collated (and laid out) once, used twice
        if len(parts) > 1 and algo.decoupled:
            with torch.no_grad():
                for k, plan in enumerate(plans[1:], start=1):
                    for j, (idx, _) in enumerate(plan):
                        built[k, j] = model.micro_batch(batch, idx)
                        prox_of[k, j], _ = model.token_logprobs(built[k, j])
        lr = float(self.scheduler.get_last_lr()[0])
        norms: list[float] = []
        n_micro = 0
        for k, (idx_k, plan) in enumerate(zip(parts, plans, strict=True)):
            n_tok = sum(batch.samples[i].n_model for i in idx_k)
            self.optimizer.zero_grad(set_to_none=True)
            for j, (idx, weight) in enumerate(plan):
                mb = built.pop((k, j), None) or model.micro_batch(batch, idx)
                st = stats if weight else StatAccumulator()
                logp, ent = model.token_logprobs(mb, entropy_grad=s.entropy_coef > 0)
                if not algo.decoupled:
                    prox = mb.behav_logp
                else:
                    prox = prox_of.pop((k, j)) if k else logp.detach()
                ref = None
                if model.ref is not None and s.kl_type == "k3_loss":
                    with torch.no_grad():
                        ref, _ = model.token_logprobs(mb, model.ref)
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
                for p in model.module.parameters():
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
        norm = torch.nn.utils.clip_grad_norm_(self.model.module.parameters(), self.tc.grad_clip)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        grad_norm = float(norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # the batch still counts as consumed
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _align_names(self, stats: StatAccumulator) -> None:
        import torch.distributed as dist

        names: list[list[str]] = [[] for _ in range(self.ctx.world)]
        dist.all_gather_object(names, sorted(stats.parts), group=self.ctx.cpu_group)
        for name in set().union(*names):
            stats._part(name)
